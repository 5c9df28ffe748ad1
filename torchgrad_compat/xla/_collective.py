"""The collectives behind ``CrossShardOptimizer``, behind one interface, :class:`Collective`:

- :class:`DistributedCollective`: ``torch.distributed`` with any backend (gloo,
  nccl, …) on the default process group, subgroups created once from
  ``group_assignment``. Its all-reduce is asynchronous, so buckets can start
  during ``backward()``.
- :class:`XlaCollective`: ``torch_xla``'s all-reduce with replica ``groups``, for
  parameters on an XLA device. XLA traces the collectives into the step's graph
  and schedules them itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Work(Protocol):
    def wait(self) -> Any: ...


class _Done:
    """The handle of a collective that has already been issued in order (XLA traces it)."""

    def wait(self) -> None:
        return None


class Collective(ABC):
    """What :class:`GradientReducer` needs from a communication library.

    ``group_size`` is the number of replicas whose gradients are summed together:
    the world, or one subgroup of ``group_assignment`` once :meth:`join_groups`
    has run.
    """

    # Named in messages.
    library: str
    # all_reduce_sum returns before the data has moved, so buckets may start during backward.
    overlap: bool
    # The summed presence counters are read on the host (see GradientReducer).
    reads_counters: bool
    # One program over a whole device mesh (torch_xla SPMD): the compiler reduces the gradients.
    spmd: bool = False

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.group_size = world_size

    @abstractmethod
    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, indexed by rank (over the whole world)."""

    @abstractmethod
    def join_groups(self, group_assignment: list[list[int]] | None) -> None:
        """Reduce within this rank's subgroup from now on (collective: every rank calls it)."""

    @abstractmethod
    def all_reduce_sum(self, tensor: Tensor) -> Work:
        """Start summing ``tensor`` in place across this rank's group."""

    @abstractmethod
    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every group member's ``tensor`` (same shape everywhere), in group order."""

    def to_host(self, tensor: Tensor) -> list[Any]:
        """``tensor.tolist()``: the values on the host."""
        return tensor.tolist()


class DistributedCollective(Collective):
    """``torch.distributed`` on the default process group, with any backend.

    Metadata travels on ``device`` (the parameters' device), which the backend
    must support anyway since the gradients are reduced there.
    """

    library = "torch.distributed"
    overlap = True
    reads_counters = True

    def __init__(self, device: torch.device):
        super().__init__(dist.get_world_size())
        self._device = device
        self._group: dist.ProcessGroup | None = None

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        # Tensors rather than all_gather_object: nothing received from a peer is unpickled.
        data = torch.tensor(list(payload), dtype=torch.uint8, device=self._device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self._device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        lengths = [int(s) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self._device)
        padded[: data.numel()] = data
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return [bytes(g[:n].tolist()) for g, n in zip(gathered, lengths, strict=True)]

    def join_groups(self, group_assignment: list[list[int]] | None) -> None:
        if group_assignment is not None:
            # new_group must be entered by every rank, for every subgroup, in the same order.
            self._group, _ = dist.new_subgroups_by_enumeration(group_assignment)
            self.group_size = len(group_assignment[0])

    def all_reduce_sum(self, tensor: Tensor) -> Work:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group, async_op=True)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.group_size)]
        dist.all_gather(out, tensor, group=self._group)
        return out


class XlaCollective(Collective):
    """``torch_xla``: ``xm.all_reduce(xm.REDUCE_SUM, tensors, groups=...)`` and friends.

    XLA programs are the same on every replica, as on TPU in TensorFlow, so
    presence is taken from the local gradients: reading the summed counters on
    the host would force the graph to run every step.
    """

    library = "torch_xla"
    overlap = False
    reads_counters = False

    def __init__(self) -> None:
        try:
            import torch_xla.core.xla_model as xm
            import torch_xla.runtime as xr
        except ImportError as error:
            raise ImportError(
                "CrossShardOptimizer: the parameters are on an XLA device, which needs the torch_xla "
                "package, and importing torch_xla failed"
            ) from error
        super().__init__(xr.world_size())
        self.spmd = xr.is_spmd()
        self._xm = xm
        self._groups: list[list[int]] | None = None

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        # Not xm.rendezvous: its all_gather pins the layout, which pads each replica's tensor by
        # its ordinal and so gives every replica a different program. A collective must be one
        # program on every replica; here the lengths go first, then payloads padded to the longest.
        # Each exchange is a graph of its own (torch_xla.sync before the read), as in xm.rendezvous.
        import torch_xla

        device = torch_xla.device()
        torch_xla.sync()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        sizes = self._xm.all_gather(size, pin_layout=False)
        torch_xla.sync()
        lengths = sizes.cpu().tolist()
        data = torch.zeros(max(lengths), dtype=torch.uint8)
        data[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
        gathered = self._xm.all_gather(data.to(device), pin_layout=False)
        torch_xla.sync()
        rows = gathered.cpu().view(len(lengths), -1)
        return [bytes(row[:n].tolist()) for row, n in zip(rows, lengths, strict=True)]

    def to_host(self, tensor: Tensor) -> list[Any]:
        # The step so far runs as one graph first: a read of a pending tensor would run the part
        # it needs, and the end of the step that part again.
        import torch_xla

        torch_xla.sync()
        return tensor.cpu().tolist()

    def join_groups(self, group_assignment: list[list[int]] | None) -> None:
        self._groups = group_assignment
        if group_assignment is not None:
            self.group_size = len(group_assignment[0])

    def all_reduce_sum(self, tensor: Tensor) -> Work:
        # Out of place, then copy_: the in-place list form (``all_reduce(op, [tensor])``) swaps the
        # buffer's value underneath torch_xla's functionalization, so views taken of the buffer
        # earlier (the per-parameter gradients) keep reading the values from before the sum.
        # copy_ goes through the dispatcher, which updates every view.
        tensor.copy_(self._xm.all_reduce(self._xm.REDUCE_SUM, tensor, groups=self._groups))
        return _Done()

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        # pin_layout=False for the same reason as in all_gather_bytes.
        gathered = self._xm.all_gather(tensor.unsqueeze(0), dim=0, groups=self._groups, pin_layout=False)
        return list(gathered.unbind(0))


def find_collective(params: Sequence[Tensor]) -> Collective | None:
    """The back-end the parameters call for, or None when there is nothing to talk to.

    XLA when the parameters are on an XLA device; else ``torch.distributed``
    when a default process group exists; else None. The caller treats a world
    of size 1 as None too.
    """
    device_types = sorted({p.device.type for p in params})
    if "xla" in device_types:
        if len(device_types) > 1:
            raise ValueError(
                f"CrossShardOptimizer: the parameters are on devices of types {device_types}; "
                "with XLA every parameter must be on the XLA device"
            )
        return XlaCollective()
    if dist.is_available() and dist.is_initialized():
        return DistributedCollective(params[0].device)
    return None
