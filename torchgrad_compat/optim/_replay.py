"""Step replay: a fused ``step()`` made again without its checks while nothing they decided has
changed (see ``_StepReplay``)."""

from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from .._torch_internals import dispatching_or_transforming, set_grad_mode
from ._census import _same_entries, _same_objects
from ._checks import GRAD_OF
from ._fused.run import FusedStep, RecordedCall
from ._group_keys import _WRAPPER_KEY_PREFIXES
from ._hyper import HyperScalars
from ._numerics import _HALF_DTYPES, _compute_dtype

if TYPE_CHECKING:
    from ._census import SameMeta, _SlotRecord
    from ._fused.run import Unscaling
    from .optimizer import Optimizer


# The types of the param-group values a replayed step may depend on: values that cannot change in
# place, so that one found to be the very object it was is the value it was.
_REPLAYABLE_VALUES = (bool, int, float, str, type(None))


class _ReplayedGroup(NamedTuple):
    """What :class:`_StepReplay` keeps of one param group."""

    group: dict[str, Any]
    keys: list[Any]
    values: list[Any]
    everyone: list[Tensor]  # the group's parameters, as listed
    has_grad: list[bool] | None  # whether each had a gradient; None where every one had
    params: list[Tensor]  # those that had one: the ones updated
    census: SameMeta  # of the updated parameters and their gradients
    slot_record: _SlotRecord | None
    dicts: list[dict[str, Any]]  # the updated parameters' slot dicts
    fused: FusedStep  # what the replayed step tells run_fused (its recorded call)
    evaluated: dict[str, Any]  # the group's hyperparameters as the step evaluated them
    hyper: HyperScalars  # their tensors, made at the first replay and kept while unchanged
    ends: bool  # whether the rule ends a group (non-slot state or its own _finish)


class _StepReplay:
    """A fused ``step()`` made again without its checks while everything they decided is as it was.

    A training loop's steps differ in the values of the gradients, parameters and
    slots, and in nothing a step's checks and decisions read: the groups, their
    hyperparameters, which tensors are updated and their metadata. On a CPU whose
    caches the backward pass has filled with other data, those checks (the group
    dicts, the hyperparameters' ranges, the state's slots, the fused plan and
    kernel lookups: some forty Python functions) cost about as much as the
    kernels over a million parameters. A step replayed reads the gradients,
    checks that the same parameters have one, that those and their gradients have
    the metadata the last step found (:class:`SameMeta`, one call), that each
    group dict holds the very objects it held then (values that cannot change in
    place: numbers, flags, strings; the same parameters in the same order), and
    that ``state`` holds the same slot dicts with slots of the same names and
    metadata (:class:`_SlotRecord`); then it updates each group through the very
    methods the whole step uses (``Optimizer._update_bucket``, the rule's
    ``_apply_dense``, ``Optimizer._end_group``), so every scalar a rule computes
    (Adam's ``alpha`` from its beta powers, and any a rule may add) is computed
    afresh: the replay keeps tensors and the fused plan, never a number. It hands
    the rule the group's hyperparameter tensors it made at its first replay
    (:class:`HyperScalars`, while nothing has written to one), and skips the fused
    kernel lookup where the rule asks for the very kernel it asked for last time
    (:class:`RecordedCall`). ``_end_group`` runs for a rule that ends a group
    (non-slot state or its own ``_finish``). Any difference, or any mode that
    changes how a step runs (``torch.compile``, inference mode, a dispatch mode or
    functorch transform), and the step takes the whole path, which makes a new
    record or none.

    Recorded only where that path depends on nothing else: a step's census found
    each group's parameters and gradients (dense, of one device, the CPU, and one
    dtype, not half) and its check of the slots found them, ``fused`` is on, and
    the rule is this package's own. :func:`set_step_replay` turns it off.
    """

    __slots__ = ("_groups", "_state_keys", "_state_values")

    def __init__(self, groups: list[_ReplayedGroup], state_keys: list[Any], state_values: list[Any]):
        self._groups, self._state_keys, self._state_values = groups, state_keys, state_values

    @staticmethod
    def may_follow(
        optimizer: Optimizer,
        dense: dict[int, dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]]],
        in_pair_order: set[int],
        slot_records: dict[int, _SlotRecord | None],
    ) -> bool:
        """Whether a step over these groups (each with its one bucket) may be recorded for
        replay: see the class docstring."""
        cls = type(optimizer)
        if not _enabled or not cls._own_rule():
            return False
        has_slots = cls._overrides("_init_slots")
        non_slot = set(optimizer._non_slot_keys)
        for gi, group in enumerate(optimizer.param_groups):
            buckets = dense.get(gi)
            if (
                buckets is None
                or gi not in in_pair_order
                or not group.get("fused")
                # (A rule with slots needs their record: none is made at the step that makes them.)
                or gi not in slot_records
                or (slot_records[gi] is not None) != has_slots
            ):
                return False
            ((device, dtype),) = buckets
            if device.type != "cpu" or dtype in _HALF_DTYPES:
                return False
            # (A wrapper's keys, such as the loss scale's state tensors, are not read by the rule;
            # the non-slot tensors are the ones the last step put there, checked by identity.)
            if not all(
                _replayable(v)
                for k, v in group.items()
                if k != "params" and k not in non_slot and not k.startswith(_WRAPPER_KEY_PREFIXES)
            ):
                return False
        return True

    @classmethod
    def of(
        cls,
        optimizer: Optimizer,
        calls: list[tuple[RecordedCall, tuple[list[Tensor], ...]] | None],
        lists: dict[int, tuple[list[Tensor], list[Tensor]]],
        census_of: dict[int, SameMeta],
        slot_records: dict[int, _SlotRecord | None],
        slots_of: dict[int, list[dict[str, Any]]],
        evaluated: list[dict[str, Any]],
    ) -> _StepReplay | None:
        """The record of the step just taken, whose fused calls were ``calls`` (one per group, in
        order), or None where a call's tensors cannot be found again from the groups and slots."""
        groups = optimizer.param_groups
        if len(calls) != len(groups) or any(call is None for call in calls):
            return None
        records = []
        ends = bool(optimizer._non_slot_keys) or type(optimizer)._overrides("_finish")
        for gi, (group, (call, rows)) in enumerate(zip(groups, calls, strict=True)):
            params, grads = lists[gi]
            everyone = list(group["params"])
            has_grad = list(map(operator.is_not, map(GRAD_OF, everyone), itertools.repeat(None)))
            if not (
                _same_objects(list(itertools.compress(everyone, has_grad)), params)
                and _same_objects(rows[0], params)
                and _same_objects(rows[1], grads)
            ):
                return None
            dicts = slots_of.get(gi, [])
            records.append(
                _ReplayedGroup(
                    group,
                    list(group),
                    list(group.values()),
                    everyone,
                    None if all(has_grad) else has_grad,
                    list(params),
                    census_of[gi],
                    slot_records[gi],
                    dicts,
                    FusedStep(True, replaying=call),
                    evaluated[gi],
                    HyperScalars(evaluated[gi], _compute_dtype(params[0].dtype), params[0].device, kept=True),
                    ends,
                )
            )
        state = optimizer.state
        return cls(records, list(state), list(state.values()))

    def run(self, optimizer: Optimizer, unscaling: Unscaling | None) -> bool:
        """Take the step as recorded if everything it depends on is as it was; else change nothing
        and return False. ``unscaling``: the step's kernels are to unscale the gradients (see
        ``Optimizer.step``)."""
        if not _enabled or torch.is_inference_mode_enabled() or dispatching_or_transforming():
            return False
        # (Grad mode off as torch.no_grad() turns it off, without the Python calls of its
        # decorator or context manager: a replayed step's host time is counted in calls.)
        grad_mode = torch.is_grad_enabled()
        set_grad_mode(False)
        try:
            return self._run(optimizer, unscaling)
        finally:
            set_grad_mode(grad_mode)

    def _run(self, optimizer: Optimizer, unscaling: Unscaling | None) -> bool:
        groups = optimizer.param_groups
        if len(groups) != len(self._groups) or not _same_entries(
            optimizer.state, self._state_keys, self._state_values
        ):
            return False
        updates = []
        for group, kept in zip(groups, self._groups, strict=True):
            if (
                group is not kept.group
                or list(group) != kept.keys
                or not _same_objects(list(group.values()), kept.values)
                or not _same_objects(group["params"], kept.everyone)
            ):
                return False
            grads = list(map(GRAD_OF, kept.everyone))
            if kept.has_grad is not None:  # (the same parameters must have none now)
                has_grad = list(map(operator.is_not, grads, itertools.repeat(None)))
                if has_grad != kept.has_grad:
                    return False
                grads = list(itertools.compress(grads, has_grad))
            # (Where every parameter had a gradient, one that has none now fails the census.)
            params, dicts, slot_record = kept.params, kept.dicts, kept.slot_record
            if not kept.census.holds([*params, *grads]):
                return False
            if slot_record is not None and not slot_record.holds(dicts):
                return False
            if not kept.hyper.unchanged():
                return False
            updates.append((group, kept, grads))
        for gi, (group, kept, grads) in enumerate(updates):
            params = kept.params
            non_slot = optimizer.non_slot_state(group) if kept.ends else {}
            fused = kept.fused
            fused.unscaling = unscaling
            slots = kept.dicts or [{}] * len(params)
            optimizer._update_bucket(group, params, grads, slots, non_slot, kept.hyper, fused)
            if kept.ends:
                optimizer._end_group(gi, group, non_slot, kept.evaluated)
                # (The group's non-slot tensors are the new ones _end_group put there.)
                kept.values[:] = group.values()
        return True


# Whether fused steps are recorded and replayed (see set_step_replay).
_enabled = True


def set_step_replay(enabled: bool) -> bool:
    """Turn step replay on or off for every optimizer; returns the setting it replaces.

    With ``fused=True`` on the CPU, a ``step()`` whose groups, hyperparameters,
    parameters, gradients' metadata and slots are as at the last step skips the
    checks that found them so (about 15% of a step over a million parameters in
    a hundred tensors, 8% over ten million in a thousand; see docs/fused.md).
    The numbers are the same either way: a replayed step computes every scalar
    through the rule's own update. Off, every step takes the whole path.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_step_replay: enabled must be a bool, got {type(enabled).__name__}: {enabled!r}")
    previous, _enabled = _enabled, enabled
    return previous


def _replayable(value: Any) -> bool:
    """Whether ``value`` cannot change in place: a number, flag, string or None, or a tuple of them
    (Adam's ``betas``)."""
    if type(value) is tuple:
        return all(type(v) in _REPLAYABLE_VALUES for v in value)
    return type(value) in _REPLAYABLE_VALUES
