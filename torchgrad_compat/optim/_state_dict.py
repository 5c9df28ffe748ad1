"""Loading optimizer state: every entry checked before anything changes, and the package's older
layouts migrated."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._group_keys import LOSS_SCALE_KEY_PREFIX, refuse_keys_it_would_not_read
from ._hyper import Hyper, _check_group_values
from ._memory import _overflows, check_no_shared_elements

if TYPE_CHECKING:
    from .optimizer import Optimizer

import math
from typing import Any

import torch
from torch import Tensor

from ._checks import describe


def _check_non_slot(cls: str, name: str, value: Any, current: Tensor) -> None:
    """A loaded non-slot tensor must match the kind and shape of ``current`` and be finite.

    It is read on the host once, at load time: a NaN beta power would turn
    every later update into NaN.
    """
    if (
        not isinstance(value, Tensor)
        or value.shape != current.shape
        or value.dtype.is_floating_point != current.dtype.is_floating_point
        or value.dtype == torch.bool
    ):
        kind = "floating" if current.dtype.is_floating_point else "integer"
        raise TypeError(
            f"{cls}: loaded non-slot state {name} must be a {kind} tensor of shape "
            f"{tuple(current.shape)}, got {describe(value)}"
        )
    if value.is_meta or not bool(torch.isfinite(value).all()):
        raise ValueError(f"Invalid {name} value: {value!r}; expected finite numbers")


def _merge_old_non_slot(cls: str, state_dict: Any) -> Any:
    """A state dict of the earlier layout (top-level ``"non_slot_state"``) in the current one.

    Each group's non-slot dict moves into its param group; anything else is
    returned as given, for ``validate_state_dict`` to judge.
    """
    if not isinstance(state_dict, dict) or "non_slot_state" not in state_dict:
        return state_dict
    state_dict = dict(state_dict)
    old, groups = state_dict.pop("non_slot_state"), state_dict.get("param_groups")
    if not isinstance(groups, list):
        return state_dict
    if (
        not isinstance(old, list)
        or len(old) != len(groups)
        or not all(isinstance(ns, dict) and isinstance(g, dict) for ns, g in zip(old, groups, strict=True))
    ):
        raise ValueError(
            f"{cls}: loaded 'non_slot_state' (the earlier layout) must be a list of one dict per "
            f"parameter group ({len(groups)}), got {describe(old)}"
        )
    state_dict["param_groups"] = [{**g, **ns} for g, ns in zip(groups, old, strict=True)]
    return state_dict


def validate_state_dict(opt: Optimizer, state_dict: dict[str, Any]) -> None:
    """Check everything ``load_state_dict`` will load (the non-slot state is in the groups)."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("state_dict must hold 'state' and 'param_groups' (from Optimizer.state_dict())")
    if len(saved_groups) != len(opt.param_groups):
        # (torch's words, which its tools match, with the counts.)
        raise ValueError(
            f"loaded state dict has a different number of parameter groups: {len(saved_groups)}, "
            f"where this optimizer has {len(opt.param_groups)}"
        )
    cls = type(opt).__name__
    id_to_param: dict[Any, tuple[Tensor, dict[str, Any]]] = {}
    for i, (saved, group) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        if not isinstance(saved, dict) or "params" not in saved:
            raise ValueError(f"{cls}: loaded param group {i} must be a dict holding 'params'")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size "
                f"of optimizer's group: group {i} holds {len(saved['params'])} parameters, "
                f"this optimizer's {len(group['params'])}"
            )
        wrapper_keys = sorted(k for k in saved if isinstance(k, str) and k.startswith(LOSS_SCALE_KEY_PREFIX))
        if wrapper_keys:
            # A LossScaleOptimizer takes these out before its wrapped optimizer loads the rest.
            raise ValueError(
                f"{cls}: loaded param group {i} holds a LossScaleOptimizer's loss scale "
                f"({wrapper_keys}); load it through a LossScaleOptimizer around this optimizer, or "
                "delete those entries from every group to drop the scale"
            )
        missing = [spec.key for spec in opt._hypers if isinstance(spec, Hyper) and spec.key not in saved]
        if missing:
            # torch's load would replace the group, and the step would look for them in vain.
            raise ValueError(
                f"{cls}: loaded param group {i} lacks the hyperparameters {missing} "
                f"(it holds {sorted(k for k in saved if k != 'params')}); "
                "was it saved from another optimizer?"
            )
        merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
        _check_group_values(merged, opt._hypers, {p.dtype for p in group["params"]})
        try:
            # Another optimizer's hyperparameter (ProximalAdagrad's l1 loaded into Adagrad, SGD's
            # weight_decay) would be refused at every later step, after the load had replaced all.
            refuse_keys_it_would_not_read(opt, merged)
        except ValueError as error:
            raise ValueError(f"loaded param group {i}: {error}") from None
        for pid, p in zip(saved["params"], group["params"], strict=True):
            id_to_param[pid] = (p, merged)
    loaded: list[tuple[str, Tensor]] = []
    for pid, slots in state_dict["state"].items():
        if pid not in id_to_param:
            raise ValueError(f"loaded state dict holds state for an unknown parameter id {pid!r}")
        p, group = id_to_param[pid]
        expected = opt.slot_names(group)
        extra = sorted(set(slots) - set(expected))
        if extra:
            # Another optimizer's slots (RMSProp's "momentum" read as Momentum's) give wrong numbers.
            raise ValueError(
                f"{cls}: loaded state of parameter {pid} holds {extra}, which are not slots of "
                f"this optimizer (its slots: {list(expected)}); was it saved from another optimizer?"
            )
        for slot in expected:
            if slot not in slots:
                raise ValueError(
                    f"{cls}: loaded state of parameter {pid} lacks slot {slot!r} "
                    f"(it holds {sorted(slots)}); was it saved from another optimizer?"
                )
            value = slots[slot]
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise TypeError(
                    f"{cls}: loaded slot {slot!r} of parameter {pid} must be a floating tensor, "
                    f"got {describe(value)}"
                )
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"{cls}: loaded slot {slot!r} of parameter {pid} has shape "
                    f"{tuple(value.shape)}, expected the parameter's shape {tuple(p.shape)}"
                )
            if value.is_meta and not p.is_meta:
                raise ValueError(
                    f"{cls}: loaded slot {slot!r} of parameter {pid} is a meta tensor, which holds "
                    "no values to load (was the state saved from a model built on the meta device?)"
                )
            if value.layout != torch.strided:
                raise TypeError(
                    f"{cls}: loaded slot {slot!r} of parameter {pid} must be a dense (strided) "
                    f"tensor, got layout {value.layout}"
                )
            if value.dtype != p.dtype and not value.is_meta and _overflows(value, p.dtype):
                # torch casts a loaded slot to its parameter's dtype; the cast would make the inf.
                raise ValueError(
                    f"{cls}: loaded slot {slot!r} of parameter {pid} ({value.dtype}) holds finite "
                    f"values that overflow the parameter's dtype {p.dtype}, into which it is loaded"
                )
            loaded.append((f"loaded slot {slot!r} of parameter {pid}", value))
    check_no_shared_elements(cls, loaded)
    for i, (saved, group) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        missing = [key for key in opt._non_slot_keys if key not in saved]
        if missing:
            raise ValueError(
                f"{cls}: loaded param group {i} lacks the non-slot state {missing} "
                f"(it holds {sorted(k for k in saved if k != 'params')}); "
                "was it saved from another optimizer?"
            )
        for key, value in opt.non_slot_state(group).items():
            check_loaded_non_slot(opt, f"{key} (group {i})", key, saved[key], value)


def check_loaded_non_slot(opt: Optimizer, name: str, key: str, value: Any, current: Tensor) -> None:
    """A loaded value of the non-slot state ``key`` (``name`` in errors), before it is stored.

    It must be of ``current``'s kind and shape, finite, and in the range
    ``_non_slot_ranges`` gives (Adam's beta powers in [0, 1)). Used by
    ``load_state_dict`` and by ``torchgrad_compat.checkpoint``.
    """
    _check_non_slot(type(opt).__name__, name, value, current)
    for spec in opt._non_slot_ranges:
        if spec.key == key:
            spec.check(float(value))


def check_live_non_slot(opt: Optimizer, index: int, group: dict[str, Any]) -> None:
    """Check a group's non-slot state as the update is about to read it.

    It lives in the group dict, where tools write without going through
    ``load_state_dict`` (``ZeroRedundancyOptimizer.load_state_dict`` copies
    the saved group entries straight into its local optimizer), and so can
    code. A tensor this optimizer put there itself (at construction, load or
    its last update) is trusted. Any other is checked: its kind, and, as for
    hyperparameters (``_evaluate``), its range when it is a CPU tensor, read
    on the host without a device synchronisation.
    """
    cls = type(opt).__name__
    ranges = {spec.key: spec for spec in opt._non_slot_ranges}
    written = opt.__dict__.get("_written_non_slot", {})
    for key in opt._non_slot_keys:
        value = group.get(key)
        if written.get((index, key)) is value:
            continue
        if (
            not isinstance(value, Tensor)
            or value.dim() != 0
            or value.dtype == torch.bool
            or value.is_complex()
            or value.is_meta
        ):
            raise TypeError(
                f"{cls}: the non-slot state {key!r} of param group {index} must be a 0-d real tensor, "
                f"got {describe(value) if key in group else 'nothing'}"
            )
        if value.device.type != "cpu":
            continue
        number = float(value)
        if key in ranges:
            ranges[key]._check_number(number, ())
        elif not math.isfinite(number):
            raise ValueError(f"Invalid {key} value: {number!r}; expected a finite number")
