"""Slots (TF's per-variable optimizer state): their creation and the checks that they still fit.

As TF's ``slot_creator``, slots are made in their variable's shape, dtype and device, from the
initial values the rule gives, the first time the variable is updated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._census import _same_entries, _same_objects, _SlotRecord
from ._checks import _SECOND, _SHAPE_OF, DEVICE_OF, DTYPE_OF, describe
from ._hyper import Hyper, _check_slot_values, _evaluate

if TYPE_CHECKING:
    from .optimizer import Optimizer


def create_slots(
    opt: Optimizer,
    grouped: dict[int, list[tuple[Tensor, Tensor]]],
    evaluated: list[dict[str, Any]] | None = None,
) -> dict[int, list[dict[str, Any]]]:
    """Create the slots of parameters that have none yet, their initial values checked first;
    return each group's slot dicts, in the order of its pairs (empty without slots).

    ``evaluated`` holds each group's evaluated hyperparameters when an update
    follows; without it only the slots' initial values are evaluated.
    """
    if not type(opt)._overrides("_init_slots"):
        # No slots: `state` stays empty, as torch's SGD leaves it.
        return {}
    initial_values = tuple(spec for spec in opt._hypers if isinstance(spec, Hyper) and spec.in_param_dtype)
    state = opt.state
    for gi, pairs in grouped.items():
        names = opt.slot_names(opt.param_groups[gi])
        if len(names) > len(opt._slots):
            # A slot a group flag adds (RMSProp's "mg" when centered), switched on after the
            # first step: TF fixes it at construction, and the update would not find it.
            for _, p in pairs:
                if state.get(p) and any(name not in state[p] for name in names):
                    raise ValueError(
                        f"{type(opt).__name__}: parameter {describe(p)} of param group {gi} has no "
                        f"slot {[n for n in names if n not in state[p]]}: the group's options were "
                        "changed after its first step (TF fixes them at construction)"
                    )
    # By identity, as the dict finds them (Tensor.__hash__ is id(), but a Python call per
    # lookup: 1.2 ms per 1000 parameters within a step, against 0.3 ms for this).
    # (Traced by dynamo as the plain lookups.)
    compiling = torch.compiler.is_compiling()
    reused = False
    if compiling:
        found = {gi: [state.get(p) for _, p in pairs] for gi, pairs in grouped.items()}
    else:
        found = slot_dicts_as_kept(opt, grouped)
        reused = found is not None
        if found is None:
            by_id = {id(p): slots for p, slots in state.items()}
            found = {gi: list(map(by_id.get, map(id, map(_SECOND, pairs)))) for gi, pairs in grouped.items()}
    missing = {
        gi: [p for (_, p), slots in zip(pairs, found[gi], strict=True) if not slots]
        if not all(found[gi])
        else []
        for gi, pairs in grouped.items()
    }
    for gi, params in missing.items():
        if params:
            values = (
                evaluated[gi] if evaluated is not None else _evaluate(opt.param_groups[gi], initial_values)
            )
            _check_slot_values(values, opt._hypers, {p.dtype for p in params})
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        # Made as ordinary tensors: an inference tensor could not be updated by a later step
        # outside inference mode, which would raise after other slots had moved.
        with torch.inference_mode(False):
            init_missing_slots(opt, missing)
    else:
        init_missing_slots(opt, missing)
    for gi, params in missing.items():
        if params:
            found[gi] = [state.get(p, {}) for _, p in grouped[gi]]
    if not compiling and not (reused and not any(missing.values())):
        # (Taken from what was kept, with no slot made: what is kept is what it was.)
        params_of = {gi: list(map(_SECOND, pairs)) for gi, pairs in grouped.items()}
        opt.__dict__["_slot_dicts_kept"] = (list(state), list(state.values()), params_of, found)
    return found


def slot_dicts_as_kept(
    opt: Optimizer, grouped: dict[int, list[tuple[Tensor, Tensor]]]
) -> dict[int, list[dict[str, Any]]] | None:
    """The slot dicts :func:`create_slots` found at the last step, if ``state`` holds the very
    same keys and values, in the same order, and each group the very same parameters.

    Compared by identity in C (about 10 ns an entry), where finding them again costs a Python
    iteration over ``state`` and a lookup per parameter. Any change to ``state`` (a slot dict
    replaced or added, a loaded state dict) shows in its keys or values.
    """
    kept = opt.__dict__.get("_slot_dicts_kept")
    if kept is None:
        return None
    keys, values, params_of, found = kept
    state = opt.state
    if not _same_entries(state, keys, values) or params_of.keys() != grouped.keys():
        return None
    for gi, pairs in grouped.items():
        if not _same_objects(list(map(_SECOND, pairs)), params_of[gi]):
            return None
    return {gi: list(dicts) for gi, dicts in found.items()}


def check_slots_follow_params(
    opt: Optimizer,
    found: dict[int, tuple[list[Tensor], tuple[torch.device, torch.dtype] | None]],
    shapes: dict[int, list[torch.Size]],
    grouped: dict[int, list[tuple[Tensor, Tensor]]],
) -> dict[int, _SlotRecord | None]:
    """Refuse a step where a parameter's slots differ from it in shape, dtype or device, before
    anything is updated; return, per group, the kept metadata its slots were found to have
    (None for a rule without slots; a group whose slots have none kept is left out).

    Slots are made in their parameter's shape, dtype and device, as TF's are.
    A parameter converted afterwards (``model.double()``, ``model.to(device)``)
    or given other memory (``p.data = torch.cat([p.data, rows])``, a view in
    another shape) keeps them as they were, and so does a slot replaced or
    given other memory (``opt.state[p]["m"] = ...``). The update paths then
    parted ways: with float32 slots of float64 variables (Adam) the loop,
    foreach and fused paths gave three different results, and with a slot of
    another shape the loop updated the parameters before the one that failed
    (a step half taken), foreach failed in torch's words, and the fused path,
    for a reshape of the same size, updated it in memory order. Reading every
    slot in Python at every step would cost as much as the check of the
    gradients, so a group's slots are read only when its parameters, their
    shapes, or their one device and dtype (see :func:`_shared_kind`; each
    one's, in groups that have none: mixed, sparse or sharded) differ from the
    last step that read them, when ``state`` holds other slot dicts, or when a
    slot's name or metadata differs from what it was then (:class:`_SlotRecord`:
    the names in one list, the metadata in one call over all of them). A
    parameter's slot dict missing one of the rule's slots (deleted or renamed) is
    refused too: the update would fail on it, after the groups before it.
    """
    if not type(opt)._overrides("_init_slots"):
        return dict.fromkeys(found)
    seen = opt.__dict__.setdefault("_slots_read_for", {})
    state = opt.state
    cls = type(opt).__name__
    as_kept = slot_dicts_as_kept(opt, grouped)
    records: dict[int, _SlotRecord | None] = {}
    for gi, (params, kind) in found.items():
        shape_list = shapes[gi] if gi in shapes else list(map(_SHAPE_OF, params))
        if kind is not None:
            key: tuple[Any, ...] = (kind, list(map(id, params)), shape_list)
        else:
            each = (list(map(DTYPE_OF, params)), list(map(DEVICE_OF, params)))
            key = (None, list(map(id, params)), shape_list, *each)
        last = seen.get(gi)
        if last is not None and last[1] is not None and as_kept is not None and last[0] == key:
            if last[1].holds(as_kept[gi]):
                records[gi] = last[1]
                continue
        slots, dicts = [], []
        for p in params:
            slot_dict = state.get(p, {})
            dicts.append(slot_dict)
            # (Slots a group option adds, such as RMSProp's "mg", are left to create_slots.)
            absent = [name for name in opt._slots if name not in slot_dict] if slot_dict else []
            if absent:
                raise ValueError(
                    f"{cls}: variable {describe(p)} has slots {sorted(slot_dict)} but not "
                    f"{absent}: a slot was deleted from opt.state[p]. `del opt.state[p]` makes that "
                    "variable's slots again, from their initial values, at the next step"
                )
            for name, slot in slot_dict.items():
                if not isinstance(slot, Tensor):
                    continue
                if slot.shape != p.shape:
                    raise ValueError(
                        f"{cls}: slot {name!r} of variable {describe(p)} has shape "
                        f"{tuple(slot.shape)}: the variable was given memory of another shape after "
                        "its slots were made (as by p.data = ...), or the slot was replaced. A slot "
                        "keeps its variable's shape, as in TensorFlow; `del opt.state[p]` makes that "
                        "variable's slots again, from their initial values, at the next step"
                    )
                if slot.dtype != p.dtype or slot.device != p.device:
                    raise TypeError(
                        f"{cls}: slot {name!r} of variable {describe(p)} is {slot.dtype} on "
                        f"{slot.device}, but the variable is now {p.dtype} on {p.device}: it was "
                        "converted after its slots were made (as by model.double() or model.to()), "
                        "or the slot was replaced. A slot keeps its variable's dtype and device, as "
                        "in TensorFlow; opt.load_state_dict(opt.state_dict()) converts the slots to "
                        "the variables' dtypes and devices"
                    )
                slots.append(slot)
        record = _SlotRecord.of(slots, dicts) if slots else None
        seen[gi] = (key, record)
        if record is not None or not slots:
            records[gi] = record
    return records


def init_missing_slots(opt: Optimizer, missing: dict[int, list[Tensor]]) -> None:
    state = opt.state
    for gi, params in missing.items():
        group = opt.param_groups[gi]
        for p in params:
            slots = opt._init_slots(group, p)
            if slots:
                state[p] = slots
