"""CUDA graphs of a fused step, and the memory pool that keeps the gradients where they were."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..._torch_internals import bump_versions

if TYPE_CHECKING:
    from .kernel import _FusedKernel
    from .plan import _FusedPlan


class _StepGraph:
    """A plan's kernel calls for one step on CUDA, captured as one CUDA graph and replayed at later steps.

    On a GPU the fused step is bound by the host: 63 calls a step for 1000
    tensors, each through Inductor's launcher. A replay is one launch. What the
    captured kernels read and write is fixed by address: the parameters,
    slots and fillers the plan holds (a plan holds while they stay where they
    are), the gradients (a graph is replayed only while every gradient is at
    the address it was captured with, and the plan checks their sizes, dtypes
    and layout at every step), and the hyperparameters, which are copied into
    tensors of the graph's own before each replay. The kernels are the same as
    the direct calls', so a replay gives their numbers bit for bit.
    """

    def __init__(
        self,
        plan: _FusedPlan,
        kernel: _FusedKernel,
        lists: tuple[list[Tensor], ...],
        scalars: dict[str, Any],
        addresses: list[int],
    ):
        self.kernel, self.addresses = kernel, addresses
        self.names = [name for name, v in scalars.items() if isinstance(v, Tensor)]
        self.written = plan.aliases
        self.replays = 0
        device = lists[1][0].device
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.device(device), torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                # Made during the capture, from the graph's own memory pool: memory kept from the
                # pool the gradients come from would move them, and no graph would be replayed.
                self.inputs = [torch.empty_like(scalars[name]) for name in self.names]
                captured = {**scalars, **dict(zip(self.names, self.inputs, strict=True))}
                plan.call(kernel, lists, captured)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        self.graph = graph

    def replay(self, scalars: dict[str, Any]) -> None:
        torch._foreach_copy_(self.inputs, [scalars[name] for name in self.names])
        self.graph.replay()
        bump_versions(self.written)
        self.replays += 1


# Per CUDA device, the memory pool of the optimizer-wide state that a step replaces (None: the
# allocator refused one).
_STATE_POOLS: dict[torch.device, Any] = {}


@functools.cache
def _caching_allocator() -> bool:
    """Whether CUDA memory comes from torch's own caching allocator (``backend:native``).

    The graph replay and the private pool rest on how that allocator hands out
    memory. Under ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` a capture of
    the fused step aborted the process (torch 2.11, H100), so there the kernels
    are launched one call at a time. The backend is fixed when the process starts.
    """
    return torch.cuda.get_allocator_backend() == "native"


@contextmanager
def _apart_from_gradients(device: torch.device) -> Iterator[None]:
    """Allocate, on CUDA, from a memory pool kept for optimizer-wide state, not the default one.

    State a step replaces (Adam's beta powers) lives until the next step. Taken
    from the pool the backward pass takes the gradients from, it moves the
    blocks the caching allocator hands the next gradients, so they would land
    somewhere else at every step (in turn over six sets of addresses, in a
    loop of 100 ``Linear`` layers), and the fused step's CUDA graph would
    never be replayed. In a torch release without ``torch.cuda.use_mem_pool``,
    with an allocator that has no such pools, inside a CUDA graph capture and
    under ``torch.compile``, the default pool is used.
    """
    if (
        device.type != "cuda"
        or not hasattr(torch.cuda, "use_mem_pool")
        or torch.compiler.is_compiling()
        or torch.cuda.is_current_stream_capturing()
        or not _caching_allocator()
    ):
        yield
        return
    if device not in _STATE_POOLS:
        try:
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool, device=device):
                pass
        except RuntimeError:  # a release or build whose allocator refuses private pools
            pool = None
        _STATE_POOLS[device] = pool
    pool = _STATE_POOLS[device]
    if pool is None:
        yield
        return
    with torch.cuda.use_mem_pool(pool, device=device):
        yield
