"""The fused engine's settings, and what a step hands it besides the tensors (context variables)."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from .._census import SameMeta, _SlotRecord
    from .run import Unscaling


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

# True while Optimizer._apply runs: every row it hands the fused kernels has its parameter's
# shape (step() and apply_gradients check gradients; slots are made and loaded so).
_ROWS_FIT: contextvars.ContextVar[bool] = contextvars.ContextVar("_ROWS_FIT", default=False)

# Set by Optimizer._apply around one group's update: the kept metadata that step()'s census found
# the group's parameters and gradients (these lists) to have, and the kept metadata of the group's
# slots that its check of the slots found them to have (None without slots), with nothing run
# since that could change them (see _FusedPlan._holds_as_last_found).
_CENSUS_HELD: contextvars.ContextVar[
    tuple[SameMeta, list[Tensor], list[Tensor], _SlotRecord | None] | None
] = contextvars.ContextVar("_CENSUS_HELD", default=None)

# Set by Optimizer._apply while it records a step to replay (see _StepReplay): each run_fused call
# appends what it called, or None where it took another way than one plan's kernel calls.
_FUSED_CALLS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("_FUSED_CALLS", default=None)

# Set by LossScaleOptimizer around a step of ours whose fused kernels unscale the gradients in
# their own pass (see _unscaling).
UNSCALING: contextvars.ContextVar[Unscaling | None] = contextvars.ContextVar("UNSCALING", default=None)
