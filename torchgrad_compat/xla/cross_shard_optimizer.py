"""``tf.compat.v1.tpu.CrossShardOptimizer`` over ``torch.distributed`` or ``torch_xla``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ..optim.wrapper import OptimizerWrapper, called_from_dcp_init, check_global_step, check_range
from ._agreement import check_group_assignment, check_same_on_every_rank, check_same_step_on_every_rank
from ._collective import Collective, find_collective
from ._reducer import DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientReducer

__all__ = ["CrossShardOptimizer"]

_SPMD_NOTE = (
    "CrossShardOptimizer: torch_xla runs in SPMD mode, where the step is one program over the whole "
    "device mesh and GSPMD already sums the gradients across its data-parallel shards; they are applied "
    "as they are, with no second reduction. 'reduction' has no per-replica losses to act on there: the "
    "loss over the global batch decides (its mean gives 'mean'; times the number of data shards, 'sum')"
)
# TF's losses.Reduction.MEAN is "weighted_mean" and SUM is "weighted_sum".
_REDUCTIONS = {"mean": "mean", "weighted_mean": "mean", "sum": "sum", "weighted_sum": "sum"}


def _checked_reduction(reduction: Any) -> str:
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a string, 'mean' or 'sum', got {type(reduction).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"Invalid reduction value: {reduction!r}; expected 'mean' or 'sum' (or TF's "
            "losses.Reduction.MEAN 'weighted_mean' / SUM 'weighted_sum')"
        )
    return _REDUCTIONS[reduction]


def _checked_bucket_cap_mb(bucket_cap_mb: Any) -> float | None:
    if bucket_cap_mb is None:
        return None
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number or None, got {type(bucket_cap_mb).__name__}")
    check_range("bucket_cap_mb", bucket_cap_mb, 0.0, math.inf, low_inclusive=False)
    return float(bucket_cap_mb)


class CrossShardOptimizer(OptimizerWrapper):
    r"""Sums gradients across replicas, then applies the wrapped optimizer: TF's ``CrossShardOptimizer``.

    With :math:`n` replicas (or :math:`n` = the size of each subgroup of
    ``group_assignment``) and replica :math:`r`'s gradient :math:`g_r`, every
    replica of a group applies ``opt`` to

    .. math::
        g = \sum_r g_r \quad (\text{``sum''}), \qquad
        g = \frac{1}{n}\sum_r g_r \quad (\text{``mean''}).

    Two ways to get there, as the wrapped optimizer is driven:

    - TF style, exactly TensorFlow's: ``compute_gradients`` scales the loss by
      :math:`1/n` for "mean" (only when there is more than one replica), and
      ``apply_gradients`` *sums* the given gradients, so a gradient computed
      some other way and passed to ``apply_gradients`` is summed, never averaged.
      ``minimize`` is the two in turn.
    - torch style, as DDP: ``loss.backward()`` reduces ``p.grad`` itself (each
      replica's gradient divided by :math:`n` before the sum for "mean"); when
      ``backward()`` returns, ``p.grad`` holds the cross-replica result, so
      gradient clipping sees it, and ``step()`` applies it. Gradients that no
      backward pass reduced (set by hand, or computed under :meth:`no_sync`) are
      reduced by ``step()``.

    Every replica then holds bitwise the same gradients and, starting from the
    same parameters, stays bitwise in step. The parameters are *not* broadcast:
    start every rank from the same values (same seed, or a broadcast).

    Communication. Gradients travel in flat buckets, one per device and dtype,
    taken in reverse registration order, so a model with hundreds of tensors
    needs a few collectives. The sizes are DDP's: by default the first bucket
    holds 1 MiB, so that its all-reduce starts early in backward, and the next
    25 MiB; an explicit ``bucket_cap_mb`` sizes every bucket, the first
    included. With ``torch.distributed`` a post-accumulate-grad hook notes each
    gradient as backward produces it, and once all of a bucket's are there the
    bucket is filled and starts its asynchronous all-reduce while backward goes
    on; buckets start in a fixed order, so every rank issues the same
    collectives, and the end of backward waits for them (as DDP's does). With
    ``torch_xla`` the all-reduces go into the traced step and XLA schedules them.

    Parameters without a gradient. A replica without a gradient for a parameter
    contributes zeros, and every replica applies the result; when no replica has
    one, the parameter gets ``None`` (TF passes ``None`` through, and the wrapped
    optimizer skips it). Each bucket carries per-parameter presence counters in
    the same all-reduce, so all replicas agree without another collective; they
    are read on the host (one small device-to-host copy per bucket and
    reduction). XLA replicas run one program, so there presence is local and
    nothing is read back.

    Sparse gradients (row-sparse COO, from ``nn.Embedding(sparse=True)``) are
    all-gathered: row counts first, then indices and values padded to the
    longest. The sum is an uncoalesced sparse tensor holding every replica's
    rows, which this package's optimizers coalesce (summing duplicate rows) as
    TF's do; a parameter that is sparse on one replica and dense on another gets
    a dense sum.

    Checks. A mistake on one rank must not leave the others waiting in a
    collective, nor let them drift apart. At construction, in one small
    exchange, every rank learns whether any rank's arguments are invalid
    (``reduction``, ``group_assignment``, ...) and whether all ranks have the
    same settings and the same parameters (count, order, shapes, dtypes); if
    not, every rank raises the same error, naming the rank and the argument or
    parameter, before any collective that depends on them. Construction and
    :meth:`add_param_group` are therefore collective: every rank must call
    them. Subgroups are created once, here. Once more, before the first
    update, every rank checks that all ranks wrap the same optimizer classes,
    with the same hyperparameters, over the same parameter values (int64
    checksums of their bits: one pass over the parameters, one small exchange
    and one host read, once).

    A rank that stops answering (a hung or stopped process) makes the others
    wait in their next collective for the process group's ``timeout``
    (``init_process_group(..., timeout=...)``: gloo's default is 30 minutes),
    after which that collective raises ``RuntimeError`` on them. Pass a timeout
    that fits your steps.

    Without a process group, or with a world size of 1, this is the wrapped
    optimizer plus a one-time warning (TF: "Assuming 1" shard).

    torch_xla SPMD (``torch_xla.runtime.use_spmd()``): the step is one program
    over the whole mesh, the loss is the global batch's, and GSPMD sums the
    gradients across the data-parallel shards as part of that program. This is
    then the wrapped optimizer plus a one-time warning: a second reduction would
    count every gradient once per shard. ``reduction`` has no per-replica
    losses to act on: the global loss decides (its mean over the batch gives
    "mean"; multiplied by the number of data shards, "sum").

    Differences from TensorFlow:
        1. ``group_assignment`` must be a true permutation: TF compares sets and
           lets duplicates such as ``[[0, 1], [2, 3], [3, 3]]`` through.
        2. Sparse gradients stay sparse (TF's ``cross_replica_sum`` densifies an
           ``IndexedSlices``).
        3. A parameter with a gradient on some replicas only is updated on all
           of them (TF's replicas run one program, so this cannot differ there).

    Differences from DDP and ``torch_xla``:
        1. "sum" exists; "mean" over a subgroup divides by the subgroup size,
           where ``xm.reduce_gradients(groups=...)`` divides by the world size.
        2. The reduction lives in the optimizer, so gradients from
           ``torch.autograd.grad``, ``torch.func`` or by hand work (TF style).
        3. Several backward passes before one ``step()`` each reduce what
           ``p.grad`` holds, which for "mean" gives the mean of the accumulated
           gradients (as DDP) and for "sum" would count earlier passes once per
           replica, so it raises: run all but the last under :meth:`no_sync`.

    Args:
        opt: the optimizer to wrap: this package's or any ``torch.optim.Optimizer``.
        reduction: "mean" or "sum" (TF's ``losses.Reduction.MEAN``/``SUM``
            spellings, "weighted_mean"/"weighted_sum", too).
        name: TF's name, accepted and kept (``.name``).
        group_assignment: None, or equal-size lists of ranks that together are
            a permutation of ``range(world_size)``: each list reduces separately.
        bucket_cap_mb: bucket size in MiB, for every bucket (DDP's argument); None
            for DDP's default, 1 MiB for the first bucket and 25 MiB after.

    Raises:
        TypeError: ``opt`` is not an optimizer; ``reduction``, ``name``,
            ``group_assignment`` or ``bucket_cap_mb`` has the wrong type.
        ValueError: an unknown ``reduction``; a ``group_assignment`` that is
            not an equal-size split of a permutation of the ranks.
        RuntimeError: the ranks differ in settings or parameters.

    Example (one process, so a local step and a warning; under ``torchrun`` the
    same code sums across the ranks)::

        >>> import warnings
        >>> from torchgrad_compat.optim import GradientDescentOptimizer
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        >>> with warnings.catch_warnings(record=True):
        ...     opt = CrossShardOptimizer(GradientDescentOptimizer([w], learning_rate=0.25))
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.5000, -0.5000])
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        reduction: str = "mean",
        name: str = "CrossShardOptimizer",
        group_assignment: list[list[int]] | None = None,
        *,
        bucket_cap_mb: float | None = None,
    ):
        super().__init__(opt)
        collective = find_collective(self._all_params())
        self._num_shards = 1 if collective is None else collective.world_size
        self._collective: Collective | None = None
        self._reducer: GradientReducer | None = None
        # When the ranks are next to check that they take the same step (None: they have), and the
        # first param group whose parameter values that check compares (see add_param_group).
        self._agreement_due: str | None = "at the first step"
        self._values_from = 0
        distributed = collective is not None and collective.world_size > 1 and not collective.spmd
        try:
            self._reduction = _checked_reduction(reduction)
            if not isinstance(name, str):
                raise TypeError(f"name must be a string, got {type(name).__name__}: {name!r}")
            self._bucket_cap_mb = _checked_bucket_cap_mb(bucket_cap_mb)
            # TF validates group_assignment even outside a shard context, against 1 shard.
            self._group_assignment = check_group_assignment(group_assignment, self._num_shards)
            complex_at = next(((i, p) for i, p in enumerate(self._all_params()) if p.is_complex()), None)
            if distributed and complex_at is not None:
                raise TypeError(
                    f"CrossShardOptimizer: parameter {complex_at[0]} is complex ({complex_at[1].dtype}), "
                    "whose gradients it does not sum across replicas; train its torch.view_as_real view "
                    "instead"
                )
        except (TypeError, ValueError) as error:
            if not distributed:
                raise
            # A mistake on one rank only must not leave the others waiting in a collective:
            # every rank learns of it in the exchange below and raises the same error.
            argument_error: Exception | None = error
        else:
            argument_error = None
        self.name = name
        if collective is not None and collective.spmd:
            warnings.warn(_SPMD_NOTE, stacklevel=2)
            return
        if collective is None or collective.world_size == 1:
            if collective is None:
                why = "no torch.distributed process group is initialized"
            else:
                why = f"the {collective.library} world size is 1"
            warnings.warn(
                f"CrossShardOptimizer: {why}; assuming 1 shard: gradients are applied locally, as "
                "TensorFlow does outside a shard context",
                stacklevel=2,
            )
            return
        self._collective = collective
        self._check_same_on_every_rank(self._optimizer.param_groups, argument_error)
        collective.join_groups(self._group_assignment)
        self._build_reducer()

    # ------------------------------------------------------------------ settings
    @property
    def reduction(self) -> str:
        """``"mean"`` or ``"sum"``."""
        return self._reduction

    @property
    def group_assignment(self) -> list[list[int]] | None:
        return self._group_assignment

    @property
    def num_shards(self) -> int:
        """The number of replicas (the world size; 1 when there is nothing to talk to)."""
        return self._num_shards

    @property
    def _group_size(self) -> int:
        return len(self._group_assignment[0]) if self._group_assignment else self._num_shards

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._optimizer!r}, reduction={self._reduction!r}, "
            f"group_assignment={self._group_assignment!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "CrossShardOptimizer cannot be pickled or copied: it is bound to this process's process "
            "groups and autograd hooks. Save state_dict() and wrap a new optimizer instead."
        )

    # ------------------------------------------------------------------ collective set-up
    def _check_same_on_every_rank(
        self, param_groups: Sequence[Any], argument_error: Exception | None = None
    ) -> None:
        assert self._collective is not None
        settings = {}
        if argument_error is None:
            settings = {
                "reduction": self._reduction,
                "group_assignment": self._group_assignment,
                "bucket_cap_mb": self._bucket_cap_mb,
            }
        params_by_group = [group["params"] for group in param_groups]
        check_same_on_every_rank(self._collective, settings, params_by_group, argument_error)

    def _agree_at_first_step(self) -> None:
        """Before the first update, and the first after ``add_param_group``: every rank wraps the
        same optimizer, with the same hyperparameters, over the same parameter values (see
        ``check_same_step_on_every_rank``)."""
        if self._collective is None or self._agreement_due is None:
            return
        chain, inner = [], self._optimizer
        while True:
            chain.append(f"{type(inner).__module__}.{type(inner).__qualname__}")
            if not isinstance(inner, OptimizerWrapper):
                break
            inner = inner.inner_optimizer
        check_same_step_on_every_rank(
            self._collective, chain, self.param_groups, self._agreement_due, self._values_from
        )
        self._agreement_due = None

    def _build_reducer(self) -> None:
        assert self._collective is not None
        if self._reducer is not None:
            self._reducer.close()
        if self._bucket_cap_mb is None:
            cap_bytes, first_cap_bytes = DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES
        else:
            cap_bytes = first_cap_bytes = int(self._bucket_cap_mb * 1024 * 1024)
        self._reducer = GradientReducer(self._all_params(), self._collective, cap_bytes, first_cap_bytes)
        if self._collective.overlap:
            self._reducer.attach_hooks(average=self._reduction == "mean")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; collective: every rank adds the same parameters."""
        if self._reducer is None:
            self._optimizer.add_param_group(param_group)
            return
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with a 'params' entry, got {param_group!r}")
        params = param_group["params"]
        param_group = {**param_group, "params": [params] if isinstance(params, Tensor) else list(params)}
        self._check_same_on_every_rank([*self.param_groups, param_group])
        self._optimizer.add_param_group(param_group)
        self._build_reducer()
        # Before the next update, every group's hyperparameters and the new group's parameter
        # values are compared, as every group's were before the first (the others' values may
        # differ by now: replicas in different subgroups train apart).
        if self._agreement_due is None:
            self._values_from = len(self.param_groups) - 1
        self._agreement_due = "at the first step after add_param_group"

    # ------------------------------------------------------------------ torch style
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)
        if self._reducer is not None:
            self._reducer.synced = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate ``p.grad`` locally; the next reduction includes them.

        As DDP's ``no_sync``: for gradient accumulation, run all but the last
        micro-batch's backward inside it.
        """
        if self._reducer is None:
            yield
            return
        previous = self._reducer.sync_enabled
        self._reducer.sync_enabled = False
        try:
            yield
        finally:
            self._reducer.sync_enabled = previous

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce ``p.grad`` unless a backward pass already did, then step the wrapped optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if called_from_dcp_init():
            # torch.distributed.checkpoint making a fresh optimizer's state (see Optimizer.step):
            # zero gradients, on parameters about to be loaded; not the first update, which is
            # still checked for agreement.
            self._optimizer.step()
            return loss
        if self._reducer is not None:
            self._reducer.check_no_broken_pass()
        self._agree_at_first_step()
        unfrozen = self._reducer.unfrozen() if self._reducer is not None else []
        if self._reducer is not None and not self._reducer.synced:
            self._reducer.reduce_grads(average=self._reduction == "mean")
        elif self._reducer is not None and self._reducer.left_out:
            # Unfrozen after the hooks were made, with a gradient that came after its bucket left.
            self._reducer.reduce_left_out()
        self._optimizer.step()
        if self._reducer is not None:
            self._reducer.synced = False
        if unfrozen:
            self._build_reducer()  # hooks for them from the next pass on
        return loss

    # ------------------------------------------------------------------ TF style
    def compute_gradients(
        self,
        loss: Tensor | Callable[[], Tensor],
        var_list: Sequence[Tensor] | None = None,
        gate_gradients: int = OptimizerWrapper.GATE_OP,
        aggregation_method: int | None = None,
        colocate_gradients_with_ops: bool = False,
        grad_loss: Tensor | None = None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """The wrapped optimizer's gradients of ``loss``, scaled by ``1/n`` for "mean" with ``n > 1`` (TF).

        The gradients are not yet summed: clip or inspect them per replica,
        then pass them to :meth:`apply_gradients`.
        """
        if self._reduction == "mean" and self._num_shards > 1:
            if callable(loss) and not isinstance(loss, Tensor):
                with torch.enable_grad():
                    loss = loss()
            if isinstance(loss, Tensor):
                with torch.enable_grad():
                    loss = loss * (1.0 / self._group_size)
        return super().compute_gradients(
            loss,
            var_list=var_list,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss,
        )

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Tensor | None, Tensor]],
        global_step: Tensor | None = None,
        name: str | None = None,
    ) -> None:
        """Sum the gradients across replicas (``None`` passes through), then apply the wrapped optimizer.

        The sum is a sum for both reductions, as in TF: "mean" comes from the
        loss scaling in :meth:`compute_gradients`. Every pair is checked before
        any collective.
        """
        pairs = list(grads_and_vars)
        if self._reducer is None:
            self._apply_inner(pairs, global_step, name)
            return
        if not pairs:
            raise ValueError("No variables provided.")
        grads, listed = self._grads_by_param(pairs)
        if global_step is not None:
            check_global_step(global_step)
        self._agree_at_first_step()
        sums = self._reducer.reduce(grads, average=False)
        # A variable another replica has a gradient for is applied here too, so replicas stay equal.
        params = self._all_params()
        others = [i for i in range(len(params)) if i not in listed and sums[i] is not None]
        summed = [(sums[i], params[i]) for i in [*listed, *others]]
        self._apply_inner(summed, global_step, name)
