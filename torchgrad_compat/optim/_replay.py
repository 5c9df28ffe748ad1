"""Step replay: a fused ``step()`` made again from the last one's kernel calls while nothing they
depend on has changed (see ``StepReplay``)."""

from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from .._torch_internals import tracing_or_transforming, version
from ._census import _same_entries, _same_objects
from ._checks import GRAD_OF
from ._fused import config as fused_config
from ._group_keys import _WRAPPER_KEY_PREFIXES
from ._hyper import HyperScalars, _is_kept_number
from ._numerics import _HALF_DTYPES, _compute_dtype

if TYPE_CHECKING:
    from ._census import SameMeta, _SlotRecord
    from ._fused.kernel import _FusedKernel
    from ._fused.plan import _FusedPlan
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
    has_grad: list[bool]  # whether each had a gradient
    params: list[Tensor]  # those that had one: the ones updated
    census: SameMeta  # of the updated parameters and their gradients
    slot_record: _SlotRecord | None
    dicts: list[dict[str, Any]]  # the updated parameters' slot dicts
    names: list[str | None]  # the slot in each slot list of the call (None: an empty list)
    kernel: _FusedKernel
    plan: _FusedPlan
    scalars: dict[str, Any]
    versions: list[tuple[Tensor, int]]  # the scalars' tensors, and their versions then
    derives: bool  # whether some scalars are ones the rule computes at every step (see of())
    evaluated: dict[str, Any]  # the group's hyperparameters as the step evaluated them


class _StepReplay:
    """The kernel calls of a fused ``step()``, made again by the next ``step()`` while everything
    that decided them is as it was.

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
    place: numbers, flags, strings; the same parameters in the same order), that
    ``state`` holds the same slot dicts with slots of the same names and metadata
    (:class:`_SlotRecord`), and that the hyperparameter tensors were not written in
    place; then it makes the same kernel calls over this step's tensors (a slot
    replaced in its dict is read where it is now). Any difference, or any mode that
    changes how a step runs (``torch.compile``, inference mode, a dispatch mode or
    functorch transform), and the step takes
    the whole path, which makes a new record or none.

    Recorded only where that path depends on nothing else: a step's census found
    each group's parameters and gradients (dense, of one device, the CPU, and one
    dtype, not half) and its check of the slots found them, ``fused`` is on, the
    rule is this package's own, and each of its kernel's scalars is a hyperparameter
    made by :func:`number_tensor` or one the rule computes at every step by a
    function it names (:attr:`Optimizer._derived_scalars`: RMSProp's ``1 - decay``,
    Adam's ``alpha`` from its beta powers), which the replay calls again. A rule's
    optimizer-wide state (Adam's beta powers, new tensors at every step) is then
    advanced by its ``_finish``, as the whole path does, and the record takes the
    new tensors as the group's values. Rules whose scalars depend on options
    computed otherwise (the proximal rules' and Ftrl's regularization, AdagradDA's
    step) are not replayed.
    """

    __slots__ = ("_groups", "_inv_scale", "_state_keys", "_state_values")

    def __init__(
        self,
        groups: list[_ReplayedGroup],
        state_keys: list[Any],
        state_values: list[Any],
        inv_scale: Tensor | None,
    ):
        self._groups, self._state_keys, self._state_values = groups, state_keys, state_values
        # The inverse loss scale its kernels unscaled the gradients by (see _unscaling), if any.
        self._inv_scale = inv_scale

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
        has_slots = cls._overrides("_init_slots")
        # (This package's rules keep non-slot state that _finish advances from the group alone;
        # the kernel scalars they compute from it are checked to be derived ones by of().)
        if (
            optimizer._non_slot_keys or cls._overrides("_finish") or cls._overrides("_sync_aliases")
        ) and not cls._own_rule():
            return False
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
        calls: list[Any],
        lists: dict[int, tuple[list[Tensor], list[Tensor]]],
        census_of: dict[int, SameMeta],
        slot_records: dict[int, _SlotRecord | None],
        slots_of: dict[int, list[dict[str, Any]]],
        evaluated: list[dict[str, Any]],
        unscaling: Unscaling | None,
    ) -> _StepReplay | None:
        """The record of the step just taken, whose fused calls were ``calls`` (one per group, in
        order), or None where a call cannot be derived again from the groups and slots alone.
        ``unscaling``: what the step's kernels unscaled the gradients by, if anything.

        A scalar that is not a kept hyperparameter tensor must be one the rule computes at each
        step (:attr:`Optimizer._derived_scalars`: Adam's ``alpha`` from its beta powers, its
        ``1 - beta1``): a replay computes it again from the group's non-slot tensors and its
        hyperparameters as this step evaluated them (the group values being the very same
        objects), and ends each group with ``_finish`` as the step did."""
        groups = optimizer.param_groups
        derivable = type(optimizer)._derived_scalars
        if len(calls) != len(groups) or any(call is None for call in calls):
            return None
        records = []
        for gi, (group, (kernel, plan, rows, scalars)) in enumerate(zip(groups, calls, strict=True)):
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
            names: list[str | None] = []
            for slots in rows[2:]:
                if not slots:  # (a slot the group's options leave out, RMSProp's "mg")
                    names.append(None)
                    continue
                # (The one name it is under: a tensor under two names could be either's.)
                found = [n for n, t in dicts[0].items() if t is slots[0]] if dicts else []
                if len(found) != 1 or not _same_objects(slots, [d[found[0]] for d in dicts]):
                    return None
                names.append(found[0])
            versions = []
            for name, value in scalars.items():
                if name in derivable:
                    continue
                if isinstance(value, Tensor):
                    if not _is_kept_number(value):
                        return None
                    versions.append((value, version(value)))
                elif type(value) not in _REPLAYABLE_VALUES:
                    return None
            records.append(
                _ReplayedGroup(
                    group,
                    list(group),
                    list(group.values()),
                    everyone,
                    has_grad,
                    list(params),
                    census_of[gi],
                    slot_records[gi],
                    dicts,
                    names,
                    kernel,
                    plan,
                    scalars,
                    versions,
                    not derivable.keys().isdisjoint(scalars),
                    evaluated[gi],
                )
            )
        state = optimizer.state
        return cls(records, list(state), list(state.values()), unscaling and unscaling.inv_scale)

    def run(self, optimizer: Optimizer, unscaling: Unscaling | None) -> bool:
        """Take the step as recorded if everything it depends on is as it was; else change nothing
        and return False. ``unscaling``: the step's kernels are to unscale the gradients (see
        ``Optimizer.step``)."""
        if torch.is_inference_mode_enabled() or tracing_or_transforming():
            return False
        # (Kernels that unscale the gradients by this inverse scale, or that do not: as recorded.)
        if (unscaling and unscaling.inv_scale) is not self._inv_scale:
            return False
        groups = optimizer.param_groups
        if len(groups) != len(self._groups) or not _same_entries(
            optimizer.state, self._state_keys, self._state_values
        ):
            return False
        calls = []
        for group, kept in zip(groups, self._groups, strict=True):
            if (
                group is not kept.group
                or list(group) != kept.keys
                or not _same_objects(list(group.values()), kept.values)
                or not _same_objects(group["params"], kept.everyone)
                or kept.plan.chunk_size != fused_config.FUSED_CHUNK
            ):
                return False
            grads = list(map(GRAD_OF, kept.everyone))
            has_grad = list(map(operator.is_not, grads, itertools.repeat(None)))
            if has_grad != kept.has_grad:
                return False
            if len(kept.params) != len(grads):
                grads = list(itertools.compress(grads, has_grad))
            params, dicts, slot_record = kept.params, kept.dicts, kept.slot_record
            if not kept.census.holds([*params, *grads]):
                return False
            if slot_record is not None and not slot_record.holds(dicts):
                return False
            if not all(version(t) == v for t, v in kept.versions):
                return False
            slots = [list(map(operator.itemgetter(name), dicts)) if name else [] for name in kept.names]
            scalars = kept.scalars
            if kept.derives:
                hyper = HyperScalars(kept.evaluated, _compute_dtype(params[0].dtype), params[0].device)
                scalars = {**scalars, **optimizer._derived(optimizer.non_slot_state(group), hyper)}
            calls.append((kept.plan, kept.kernel, (params, grads, *slots), scalars))
        if unscaling is not None:
            unscaling.started = True
        for plan, kernel, lists, scalars in calls:
            plan.call(kernel, lists, scalars)
        # The rest of the step, for rules with non-slot state: as Optimizer._apply ends a group.
        if type(optimizer)._overrides("_finish"):
            for gi, (group, kept) in enumerate(zip(groups, self._groups, strict=True)):
                non_slot = optimizer.non_slot_state(group)
                optimizer._finish(group, non_slot, kept.evaluated)
                group.update(non_slot)
                optimizer._mark_written(gi, group)
                kept.values[:] = group.values()
        return True


def _replayable(value: Any) -> bool:
    """Whether ``value`` cannot change in place: a number, flag, string or None, or a tuple of them
    (Adam's ``betas``)."""
    if type(value) is tuple:
        return all(type(v) in _REPLAYABLE_VALUES for v in value)
    return type(value) in _REPLAYABLE_VALUES
