"""The fused engine's settings."""

from __future__ import annotations

# Tensors per compiled call of a fused update (see run_fused). Larger chunks call fewer times
# but compile for longer: Adam, cold Inductor cache, 22.5 s at 32 and 15.8 s at 16 (3.4 s warm),
# while a call costs ~16 µs of host time (63 calls for 1000 tensors: 1 ms).
FUSED_CHUNK = 16

# Graphs a fused update may compile per optimizer rule (dtypes, devices and options), for dynamo.
_FUSED_GRAPH_LIMIT = 64

# Elements of the rows of zeros a fused kernel is compiled on (see _FusedKernel._compile).
_FUSED_SIZE_HINT = 4096

# The largest row a fused kernel takes on a GPU: Triton kernels compiled for small sizes index
# in int32 (less a margin for the last block's offsets); larger rows take the reference loop.
_TRITON_ROW_LIMIT = 2**31 - 2**16

# CUDA graphs a fused plan keeps, one per set of gradient addresses (see _FusedPlan.step_graph).
_GRAPHS_PER_PLAN = 4
