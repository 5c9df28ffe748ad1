""":class:`GradientReducer` sums gradients across replicas. Gradients are copied
into flat buffers, one per bucket of parameters of one device and dtype, so a
model with hundreds of tensors needs a few collectives. Each bucket's buffer
ends with two presence counters per parameter (dense gradient, sparse gradient)
that are summed with the gradients, so every rank learns, in the same
collective, which parameters have a gradient on some rank and which are sparse
somewhere; every rank then takes the same decisions and runs the same further
collectives.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._torch_internals import current_graph_task_id, sparse_nnz, sparse_rows, sparse_values
from ._collective import Collective, Work

# DDP's default bucket sizes: a small first bucket, so that the first all-reduce starts early in
# backward, then 25 MiB. DDP uses them only when bucket_cap_mb is not given, and so does
# CrossShardOptimizer: an explicit size applies to every bucket.
FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# Presence counters per parameter at the end of a bucket: (dense gradients, sparse gradients).
_COUNTERS = 2


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
