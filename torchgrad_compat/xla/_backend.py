"""Collectives and gradient buckets behind ``CrossShardOptimizer``.

Two collective back-ends share one interface, :class:`Collective`:

- :class:`DistributedCollective`: ``torch.distributed`` with any backend (gloo,
  nccl, …) on the default process group, subgroups created once from
  ``group_assignment``. Its all-reduce is asynchronous, so buckets can start
  during ``backward()``.
- :class:`XlaCollective`: ``torch_xla``'s all-reduce with replica ``groups``, for
  parameters on an XLA device. XLA traces the collectives into the step's graph
  and schedules them itself.

:class:`GradientReducer` sums gradients across replicas. Gradients are copied
into flat buffers, one per bucket of parameters of one device and dtype, so a
model with hundreds of tensors needs a few collectives. Each bucket's buffer
ends with two presence counters per parameter (dense gradient, sparse gradient)
that are summed with the gradients, so every rank learns, in the same
collective, which parameters have a gradient on some rank and which are sparse
somewhere; every rank then takes the same decisions and runs the same further
collectives.
"""

from __future__ import annotations

import json
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .._torch_internals import current_graph_task_id, sparse_nnz, sparse_rows, sparse_values

__all__ = [
    "Collective",
    "DistributedCollective",
    "GradientReducer",
    "XlaCollective",
    "check_group_assignment",
    "check_same_on_every_rank",
    "check_same_step_on_every_rank",
    "find_collective",
]

# DDP's default bucket sizes: a small first bucket, so that the first all-reduce starts early in
# backward, then 25 MiB. DDP uses them only when bucket_cap_mb is not given, and so does
# CrossShardOptimizer: an explicit size applies to every bucket.
FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# Presence counters per parameter at the end of a bucket: (dense gradients, sparse gradients).
_COUNTERS = 2


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


def check_group_assignment(value: Any, world_size: int) -> list[list[int]] | None:
    """``group_assignment`` as a list of lists of ints, or None; raise if it is not valid.

    TensorFlow's rule, made strict: equal-size lists that together are a
    permutation of ``range(world_size)``. TF compares *sets*, which lets
    duplicates through (``[[0, 1], [2, 3], [3, 3]]`` for 4 shards); this rejects them.
    """
    if value is None or (isinstance(value, list) and not value):
        return None
    if not isinstance(value, list) or not all(isinstance(group, list) for group in value):
        raise TypeError(f"group_assignment must be a list of lists of ranks, got {value!r}")
    for group in value:
        for rank in group:
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise TypeError(
                    f"group_assignment must hold integer ranks, got {type(rank).__name__} {rank!r} "
                    f"in {value!r}"
                )
    if sorted(rank for group in value for rank in group) != list(range(world_size)):
        raise ValueError(
            f"Invalid group_assignment value: {value!r}; expected a permutation of range({world_size}) "
            f"(each of the {world_size} ranks exactly once)"
        )
    if len({len(group) for group in value}) != 1:
        raise ValueError(
            f"Invalid group_assignment value: {value!r}; the size of each subgroup must be equal, "
            f"got sizes {[len(group) for group in value]}"
        )
    return [list(group) for group in value]


def _describe_param(entry: list[Any]) -> str:
    group, index, shape, dtype, device = entry
    return f"param group {group}, index {index}: shape {tuple(shape)}, {dtype} on {device}"


_ARGUMENT_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


def check_same_on_every_rank(
    collective: Collective,
    settings: dict[str, Any],
    params_by_group: Sequence[Sequence[Tensor]],
    argument_error: Exception | None = None,
) -> None:
    """Raise the same error on every rank unless every rank has valid, equal settings and parameters.

    One exchange of a small JSON description over the whole world. A mismatch
    would otherwise surface as a hang or, worse, as a silently wrong sum (gloo
    happily all-reduces a ``[4]`` tensor against a ``[3]`` one on some ranks).
    Every rank compares every rank with rank 0, so all raise the same
    ``RuntimeError``. ``argument_error`` is this rank's error for an invalid
    argument, raised by every rank once the exchange has told them all: as it is
    when every rank has the same one, else naming the ranks it came from.
    """
    entries = [
        [g, i, list(p.shape), str(p.dtype).removeprefix("torch."), p.device.type]
        for g, params in enumerate(params_by_group)
        for i, p in enumerate(params)
    ]
    error = None if argument_error is None else [type(argument_error).__name__, str(argument_error)]
    mine = {"settings": settings, "params": entries, "error": error}
    payload = json.dumps(mine, sort_keys=True).encode()
    everyone = [json.loads(b) for b in collective.all_gather_bytes(payload)]
    errors = [(rank, other["error"]) for rank, other in enumerate(everyone) if other["error"] is not None]
    if errors:
        if argument_error is not None and len(errors) == len(everyone) and all(e == error for _, e in errors):
            raise argument_error
        (rank, (kind, message)), ranks = errors[0], [r for r, e in errors if e == errors[0][1]]
        where = f"rank {rank}" if len(ranks) == 1 else f"ranks {ranks}"
        raise _ARGUMENT_ERRORS.get(kind, ValueError)(
            f"CrossShardOptimizer on {where} (of {len(everyone)}): {message}; every rank raises this error"
        )
    first = everyone[0]
    for rank, other in enumerate(everyone[1:], start=1):
        for key in sorted(first["settings"]):
            if first["settings"][key] != other["settings"][key]:
                raise RuntimeError(
                    f"CrossShardOptimizer: {key} differs across ranks: {first['settings'][key]!r} on "
                    f"rank 0, {other['settings'][key]!r} on rank {rank}; every rank must pass the same"
                )
        ours, theirs = first["params"], other["params"]
        for k, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            if a != b:
                raise RuntimeError(
                    "CrossShardOptimizer: the wrapped optimizer's parameters differ across ranks: "
                    f"parameter {k} is ({_describe_param(a)}) on rank 0 but ({_describe_param(b)}) on "
                    f"rank {rank}; every rank must hold the same parameters in the same order"
                )
        if len(ours) != len(theirs):
            longer, extra = (0, ours) if len(ours) > len(theirs) else (rank, theirs)
            raise RuntimeError(
                "CrossShardOptimizer: the wrapped optimizer's parameters differ across ranks: rank 0 "
                f"has {len(ours)} parameters, rank {rank} has {len(theirs)}; the first extra one, on rank "
                f"{longer}, is parameter {min(len(ours), len(theirs))} "
                f"({_describe_param(extra[min(len(ours), len(theirs))])})"
            )


def _setting(value: Any) -> Any:
    """A hyperparameter as JSON that is equal across ranks exactly when the values are."""
    if isinstance(value, float):
        return value.hex()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Tensor):
        return [_setting(float(v)) for v in value.detach().reshape(-1).tolist()]
    if isinstance(value, (list, tuple)):
        return [_setting(v) for v in value]
    if callable(value):
        name = f"callable {getattr(value, '__qualname__', type(value).__qualname__)}"
        try:
            now = value()  # a TF-style zero-argument hyperparameter: its value now, as the step reads it
        except TypeError:
            return name  # takes arguments: not a hyperparameter read at the step
        return [name, _setting(now), repr(now)]
    return f"{type(value).__qualname__} {value!r}"


def _shown(value: Any, setting: Any) -> str:
    """A hyperparameter for an error message, from its ``_setting`` (a callable is not called again)."""
    if callable(value) and isinstance(setting, list):
        return f"{setting[0].removeprefix('callable ')} giving {setting[2]}"
    return repr(value)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprints(params: Sequence[Tensor]) -> Tensor:
    """Two int64 checksums of each parameter's bits: their sum and the sum of their squares.

    Integer sums wrap identically whatever the order of the reduction, so equal
    parameters give equal checksums on every rank and every kind of device.
    """
    sums = []
    for p in params:
        bits = p.detach().reshape(-1).view(_BITS[p.element_size()]).to(torch.int64)
        sums.append(torch.stack([bits.sum(), (bits * bits).sum()]))
    return torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.int64)


def check_same_step_on_every_rank(
    collective: Collective,
    optimizer_chain: list[str],
    param_groups: Sequence[dict[str, Any]],
    when: str = "at the first step",
    values_from: int = 0,
) -> None:
    """Raise the same ``RuntimeError`` on every rank unless the ranks are about to take the same step.

    Before the first step (and the first after a group is added: ``when`` says
    which): the wrapped optimizers (class by class), every param group's
    hyperparameters, and checksums of the values of the parameters in groups
    ``values_from`` on. Ranks that differ in any of these would otherwise drift
    apart in silence. (After training, the groups before the added ones are
    not compared: replicas in different subgroups of ``group_assignment``
    hold different values by then.)
    """
    compared = list(enumerate(param_groups))[values_from:]
    params = [p for _, group in compared for p in group["params"]]
    where = [(g, i) for g, group in compared for i in range(len(group["params"]))]
    settings = [{k: _setting(v) for k, v in group.items() if k != "params"} for group in param_groups]
    mine = {
        "optimizer": optimizer_chain,
        "groups": settings,
        "shown": [
            {k: _shown(v, settings[g][k]) for k, v in group.items() if k != "params"}
            for g, group in enumerate(param_groups)
        ],
        "params": collective.to_host(_fingerprints(params)),
    }
    everyone = [json.loads(b) for b in collective.all_gather_bytes(json.dumps(mine, sort_keys=True).encode())]
    first = everyone[0]
    for rank, other in enumerate(everyone[1:], start=1):
        if other["optimizer"] != first["optimizer"]:
            raise RuntimeError(
                f"CrossShardOptimizer: the wrapped optimizer differs across ranks: {first['optimizer']} on "
                f"rank 0, {other['optimizer']} on rank {rank}; every rank must wrap the same optimizer"
            )
        for g, (ours, theirs) in enumerate(zip(first["groups"], other["groups"], strict=True)):
            for key in sorted(set(ours) | set(theirs)):
                if ours.get(key) != theirs.get(key):
                    raise RuntimeError(
                        f"CrossShardOptimizer: param group {g}'s {key!r} differs across ranks {when}: "
                        f"{first['shown'][g].get(key)} on rank 0, {other['shown'][g].get(key)} on rank "
                        f"{rank}; every rank must use the same hyperparameters"
                    )
        for k, (ours, theirs) in enumerate(zip(first["params"], other["params"], strict=True)):
            if ours != theirs:
                g, i = where[k]
                raise RuntimeError(
                    f"CrossShardOptimizer: parameter {i} of param group {g} (shape {tuple(params[k].shape)}) "
                    f"holds different values on rank 0 and rank {rank} {when}; start every rank "
                    "from the same parameters (the same seed, or a broadcast from rank 0)"
                )


@dataclass
class _Bucket:
    """Parameters of one device and dtype whose gradients travel in one flat buffer.

    ``buffer`` holds the gradients (``grads``), then, when the counters are
    read, two presence counters per parameter (``counters``). ``params[j]`` is
    parameter ``indices[j]`` and ``views[j]`` its gradient inside the buffer,
    shaped like it.
    ``local_counts[j]`` is this rank's contribution to the counters and
    ``local_sparse`` its sparse gradients by parameter index, as of the last
    fill. ``hooked`` is the number of parameters with a gradient hook and
    ``pending`` how many of those the current backward pass has not produced yet.
    """

    indices: list[int]
    params: list[Tensor]
    buffer: Tensor
    grads: Tensor
    views: list[Tensor]
    counters: Tensor | None
    hooked: int
    local_counts: list[tuple[int, int]] = field(default_factory=list)
    local_sparse: dict[int, Tensor] = field(default_factory=dict)
    pending: int = 0
    work: Work | None = None


def _plan(params: Sequence[Tensor], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, in launch order.

    Parameters are taken in reverse registration order, roughly the order in
    which backward produces their gradients (as DDP), and grouped by (device,
    dtype); a bucket closes when it reaches its size cap: ``first_cap_bytes``
    for the first bucket of each (device, dtype), ``cap_bytes`` after.
    """
    closed: list[list[int]] = []
    open_: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    size: dict[tuple[torch.device, torch.dtype], int] = {}
    seen: set[tuple[torch.device, torch.dtype]] = set()
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.device, p.dtype)
        open_.setdefault(key, []).append(i)
        size[key] = size.get(key, 0) + p.numel() * p.element_size()
        if size[key] >= (cap_bytes if key in seen else first_cap_bytes):
            closed.append(open_.pop(key))
            size[key] = 0
            seen.add(key)
    return closed + list(open_.values())


class _ReadyHook:
    """A post-accumulate-grad hook that does not keep its reducer alive."""

    __slots__ = ("_index", "_reducer")

    def __init__(self, reducer: GradientReducer, index: int):
        self._reducer = weakref.ref(reducer)
        self._index = index

    def __call__(self, param: Tensor) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer._on_grad_ready(self._index)


class GradientReducer:
    """Cross-replica sums of the gradients of ``params``, bucketed; optionally overlapped with backward.

    :meth:`reduce` sums a list of gradients (one per parameter, ``None`` allowed)
    and returns the sums. With :meth:`attach_hooks`, every ``backward()`` reduces
    ``p.grad`` itself: a post-accumulate-grad hook counts each gradient as
    autograd produces it, and once a bucket has all of its gradients they are
    copied in and its asynchronous all-reduce starts while backward goes on
    (buckets start strictly in order, so every rank issues the same collectives
    in the same order); at the end of backward the remaining buckets start,
    every bucket is waited for and the sums are written back to ``p.grad``. The
    hooks only count, so that the Python work per gradient inside backward
    stays small; a bucket's copy is one call.

    Presence: a parameter without a gradient on a rank contributes zeros there;
    its sum is None only when no rank in the group has a gradient for it.

    Sparse gradients (row-sparse COO) are all-gathered within the group: the
    number of rows first, then the row indices and values, padded to the
    longest. Their sum is an *uncoalesced* sparse tensor (every replica's rows,
    in group order), which the optimizers coalesce, summing duplicate rows. A
    parameter that is dense on one rank and sparse on another gets a dense sum.

    ``average`` divides each replica's contribution by the group size before the
    sum (as DDP does, so half-precision sums do not overflow); TF-style callers
    pass ``average=False``, their loss being scaled already.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        collective: Collective,
        bucket_cap_bytes: int,
        first_bucket_cap_bytes: int,
    ):
        self._params = list(params)
        self._collective = collective
        plan = _plan(self._params, bucket_cap_bytes, first_bucket_cap_bytes)
        self._buckets = [self._make_bucket(indices) for indices in plan]
        # Parameter index -> its bucket.
        self._bucket_of = {i: bucket for bucket in self._buckets for i in bucket.indices}
        self._handles: list[Any] = []
        self._unhooked: list[int] = []  # parameters frozen when the hooks were made
        self.left_out: list[int] = []  # of those, the ones the last pass left with a local gradient
        self._average_in_backward = False
        self._in_pass = False
        self._pass_task: int | None = None  # the autograd graph task of the pass in progress
        self._next = 0
        self.sync_enabled = True
        # True once a backward pass has written its sums to p.grad, until the caller clears it.
        self.synced = False

    def _make_bucket(self, indices: list[int]) -> _Bucket:
        params = [self._params[i] for i in indices]
        numel = sum(p.numel() for p in params)
        extra = _COUNTERS * len(params) if self._collective.reads_counters else 0
        buffer = torch.zeros(numel + extra, dtype=params[0].dtype, device=params[0].device)
        grads = buffer[:numel]
        views, offset = [], 0
        for p in params:
            views.append(grads[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        counters = buffer[numel:].view(len(params), _COUNTERS) if extra else None
        return _Bucket(
            indices,
            params,
            buffer,
            grads,
            views,
            counters,
            hooked=sum(p.requires_grad for p in params),
        )

    # ------------------------------------------------------------------ one reduction
    def _launch(self, bucket: _Bucket, grads: list[Tensor | None], average: bool) -> None:
        """Copy ``grads`` (one per parameter of ``bucket``) into its buffer and start its all-reduce.

        The dense gradients go in with one ``_foreach_copy_`` and are divided by
        one ``div_`` over the bucket, the same arithmetic as per parameter with
        two calls instead of one or two per parameter.
        """
        counts: list[tuple[int, int]] = []
        sparse: dict[int, Tensor] = {}
        views, dense = [], []
        for i, view, grad in zip(bucket.indices, bucket.views, grads, strict=True):
            if grad is None or grad.is_sparse:
                view.zero_()
                if grad is None:
                    counts.append((0, 0))
                else:
                    sparse[i] = grad
                    counts.append((0, 1))
            else:
                views.append(view)
                dense.append(grad)
                counts.append((1, 0))
        if dense:
            torch._foreach_copy_(views, dense)
        if average and self._collective.group_size > 1:
            bucket.grads.div_(self._collective.group_size)
        bucket.local_counts, bucket.local_sparse = counts, sparse
        if bucket.counters is not None:
            bucket.counters.copy_(torch.tensor(counts, dtype=bucket.buffer.dtype))
        bucket.work = self._collective.all_reduce_sum(bucket.buffer)

    def _check_row_sparse(self, i: int, grad: Tensor | None) -> None:
        """Refuse a sparse gradient other than row-sparse: only its row indices are gathered."""
        if (
            grad is not None
            and grad.is_sparse
            and (grad.sparse_dim() != 1 or grad.shape != self._params[i].shape)
        ):
            raise ValueError(
                f"CrossShardOptimizer: the sparse gradient of parameter {i} has {grad.sparse_dim()} "
                f"sparse dims and shape {tuple(grad.shape)}; only row-sparse gradients (one sparse dim, "
                f"as nn.Embedding(sparse=True) makes) of the parameter's shape "
                f"{tuple(self._params[i].shape)} are summed"
            )

    def _collect(self, average: bool) -> list[Tensor | None]:
        """Wait for every bucket and read the sums: one entry per parameter."""
        works = []
        for bucket in self._buckets:
            assert bucket.work is not None, "every bucket is launched before it is collected"
            works.append(bucket.work)
            bucket.work = None
        counts = []
        for bucket, work in zip(self._buckets, works, strict=True):
            work.wait()
            # One small device-to-host read per bucket (none with XLA, see XlaCollective).
            counts.append(bucket.counters.tolist() if bucket.counters is not None else bucket.local_counts)
        sparse_indices = sorted(
            i
            for bucket, summed in zip(self._buckets, counts, strict=True)
            for i, (_, sparse) in zip(bucket.indices, summed, strict=True)
            if sparse > 0
        )
        sparse_sums = self._sum_sparse(sparse_indices, average) if sparse_indices else {}
        results: list[Tensor | None] = [None] * len(self._params)
        for bucket, summed in zip(self._buckets, counts, strict=True):
            for i, view, (dense, sparse) in zip(bucket.indices, bucket.views, summed, strict=True):
                if sparse > 0:
                    results[i] = view + sparse_sums[i].to_dense() if dense > 0 else sparse_sums[i]
                elif dense > 0:
                    results[i] = view
        return results

    def _sum_sparse(self, indices: list[int], average: bool) -> dict[int, Tensor]:
        """All-gather the sparse gradients of ``indices`` in the group; uncoalesced sums."""
        local_sparse = {i: g for bucket in self._buckets for i, g in bucket.local_sparse.items()}
        local = [local_sparse.get(i) for i in indices]
        device = self._params[indices[0]].device
        nnz = torch.tensor(
            [0 if g is None else sparse_nnz(g) for g in local], dtype=torch.int64, device=device
        )
        nnz_by_member = [row.tolist() for row in self._collective.all_gather(nnz)]
        sums = {}
        for k, (i, grad) in enumerate(zip(indices, local, strict=True)):
            p = self._params[i]
            lengths = [row[k] for row in nnz_by_member]
            longest = max(lengths)
            rows = torch.zeros(longest, dtype=torch.int64, device=p.device)
            values = torch.zeros((longest, *p.shape[1:]), dtype=p.dtype, device=p.device)
            if grad is not None:
                rows[: sparse_nnz(grad)] = sparse_rows(grad)
                values[: sparse_nnz(grad)] = sparse_values(grad)
                if average:
                    values.div_(self._collective.group_size)
            if longest > 0:
                all_rows = self._collective.all_gather(rows)
                all_values = self._collective.all_gather(values)
                rows = torch.cat([r[:n] for r, n in zip(all_rows, lengths, strict=True)])
                values = torch.cat([v[:n] for v, n in zip(all_values, lengths, strict=True)])
            sums[i] = torch.sparse_coo_tensor(rows.unsqueeze(0), values, p.shape, check_invariants=False)
        return sums

    def reduce(self, grads: Sequence[Tensor | None], *, average: bool) -> list[Tensor | None]:
        """The cross-replica sums of ``grads`` (one per parameter).

        Dense sums are views of the buckets, valid until the next reduction.
        Bucket ``k + 1`` is filled while bucket ``k`` is on the wire.
        """
        for i, grad in enumerate(grads):  # (all of them before any collective starts)
            self._check_row_sparse(i, grad)
        for bucket in self._buckets:
            self._launch(bucket, [grads[i] for i in bucket.indices], average)
        return self._collect(average)

    @torch.no_grad()
    def reduce_grads(self, *, average: bool) -> None:
        """Replace every ``p.grad`` by its cross-replica sum (torch style, without hooks)."""
        self._write_grads(self.reduce([p.grad for p in self._params], average=average))

    def _write_grads(self, results: list[Tensor | None]) -> None:
        destinations, sources = [], []
        for p, summed in zip(self._params, results, strict=True):
            if summed is None:
                continue
            if summed.is_sparse:
                p.grad = summed
            elif p.grad is None or p.grad.is_sparse:
                p.grad = summed.clone()
            else:
                destinations.append(p.grad)
                sources.append(summed)
        if destinations:
            torch._foreach_copy_(destinations, sources)

    # ------------------------------------------------------------------ overlap with backward
    def attach_hooks(self, *, average: bool) -> None:
        """Reduce ``p.grad`` during every ``backward()`` (see the class docstring)."""
        self._average_in_backward = average
        for i, p in enumerate(self._params):
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(_ReadyHook(self, i)))
            else:
                self._unhooked.append(i)

    def unfrozen(self) -> list[int]:
        """Parameters that require grad now but did not when the hooks were made (none are theirs)."""
        return [i for i in self._unhooked if self._params[i].requires_grad]

    @torch.no_grad()
    def reduce_left_out(self) -> None:
        """Replace ``p.grad`` of the parameters the last pass left local by its cross-replica sum."""
        wanted, self.left_out = set(self.left_out), []
        grads = [p.grad if i in wanted else None for i, p in enumerate(self._params)]
        results = self.reduce(grads, average=self._average_in_backward)
        self._write_grads([r if i in wanted else None for i, r in enumerate(results)])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def _current_grad(param: Tensor) -> Tensor | None:
        # Hooks run with grad mode on under backward(create_graph=True); the buckets stay out of graphs.
        grad = param.grad
        return grad.detach() if grad is not None and grad.requires_grad else grad

    def check_no_broken_pass(self, in_backward: bool = False) -> None:
        """Refuse to go on after a backward pass that raised midway: its ``_finish_pass`` never
        ran. Seen at the next step (outside backward), or at the next pass's first gradient."""
        if not self._in_pass:
            return
        task = current_graph_task_id()
        if in_backward and (task is None or task == self._pass_task):
            return  # the pass in progress (or a torch that does not tell passes apart)
        raise RuntimeError(
            "CrossShardOptimizer: an earlier backward pass raised after its gradient sums had "
            f"started ({self._next} of {len(self._buckets)} buckets on the wire). The replicas' "
            "collectives are no longer paired, and summing on would mix gradients of different "
            "passes, or of different steps across replicas. Restart the processes and resume "
            "from a checkpoint."
        )

    def _on_grad_ready(self, i: int) -> None:
        if not self.sync_enabled:
            return
        self.check_no_broken_pass(in_backward=True)
        if not self._in_pass:
            if self.synced and not self._average_in_backward:
                raise RuntimeError(
                    "CrossShardOptimizer(reduction='sum'): a second backward pass before step() would "
                    "add the gradients already summed by the first one again, once per replica. Run all "
                    "but the last backward pass under `with opt.no_sync():`, or call step() or "
                    "zero_grad() in between."
                )
            self._in_pass, self._pass_task = True, current_graph_task_id()
            for bucket in self._buckets:
                bucket.pending = bucket.hooked
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
        self._bucket_of[i].pending -= 1
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        """Launch the next bucket with its parameters' current ``.grad`` (hooked or not: unused, frozen)."""
        bucket = self._buckets[self._next]
        grads = [self._current_grad(p) for p in bucket.params]
        for i, grad in zip(bucket.indices, grads, strict=True):  # (reduce() checks all before any launch)
            self._check_row_sparse(i, grad)
        self._launch(bucket, grads, self._average_in_backward)
        self._next += 1

    @torch.no_grad()
    def _finish_pass(self) -> None:
        try:
            while self._next < len(self._buckets):
                self._launch_next()
            results = self._collect(self._average_in_backward)
            self._write_grads(results)
            # A parameter without a hook (frozen when they were made) whose gradient came after
            # its bucket left, on every rank: its gradient is still the local one.
            self.left_out = [
                i for i in self._unhooked if results[i] is None and self._params[i].grad is not None
            ]
        finally:
            self._in_pass = False
            self._next = 0
        self.synced = True
