"""What a TF checkpoint holds for an ``ExponentialMovingAverage``: each averaged variable's shadow
under ``<TF name of the variable>/<ema name>``, in the variable's TF layout, and the averages of
tensors (with their zero-debias variables) under their own names."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ..train import ExponentialMovingAverage
from ._mapping import _ATTRIBUTE, _resolve_against, _slot_view, _Target


def ema_targets(
    parsed: dict[str, tuple[Tensor, tuple[int, ...] | None]],
    ema: Any,
    object_based: bool,
) -> list[_Target]:
    """The shadows ``ema`` holds, as targets named after their variables' ``var_map`` names.

    Raises:
        TypeError: ``ema`` is not an ``ExponentialMovingAverage``.
        RuntimeError: inside ``ema.swapped()``.
        ValueError: ``ema`` holds no averages, averages a variable ``var_map`` does not map,
            or the checkpoint is object-based.
    """
    if not isinstance(ema, ExponentialMovingAverage):
        raise TypeError(
            f"ema must be a torchgrad_compat.train.ExponentialMovingAverage, got {type(ema).__name__}"
        )
    if ema.is_swapped:
        # The variables hold the averages until the block ends, and then get their trained values
        # back: a save would write averages as weights, a load's weights would be undone.
        raise RuntimeError(
            "ema= inside ema.swapped(): the variables hold their averages until the block ends; "
            "save or load the checkpoint after it"
        )
    if object_based:
        # TF2's tf.train.ExponentialMovingAverage is not trackable: tf.train.Checkpoint refuses it,
        # so no object-based checkpoint holds shadows under names TF chose.
        raise ValueError(
            "ema= reads and writes TF1's names (<variable>/ExponentialMovingAverage); this checkpoint "
            "is object-based (tf.train.Checkpoint), where shadows sit wherever their program put "
            "them: map each one in var_map instead, e.g. {'ema/w': ema.average(model.weight)}"
        )
    state = ema.state_dict()
    if not state:
        raise ValueError(
            f"ema={ema!r} holds no averages yet: call ema.apply(model.named_parameters()) first, "
            "so that its shadows exist to be filled"
        )
    variables = ema.variables_to_restore()  # {TF name of the shadow, by the EMA's names: variable}
    resolved, parts = _resolve_against(parsed, list(variables.values()))
    suffix = f"/{ema.name}"
    targets = []
    for average_name, variable in variables.items():
        shadow = state[average_name]
        keys = [k for k, (t, _) in resolved.items() if t is variable or parts.get(k) is variable]
        if not keys:
            raise ValueError(
                f"ema averages {average_name.removesuffix(suffix)!r} (a tensor of shape "
                f"{list(variable.shape)}), which var_map does not map: its shadow would have no TF "
                "name; add the variable to var_map"
            )
        for key in keys:
            tensor, perm = resolved[key]
            name = key.removesuffix(_ATTRIBUTE) + suffix
            if tensor is variable:
                targets.append(_Target(name, shadow, perm))
            else:
                view = _slot_view(key, shadow, tensor, variable)
                targets.append(_Target(name, view, perm, of=shadow))
    for name, tensor in state.items():
        if name not in variables:
            # The averages of tensors (TF's non-Variable inputs), and their zero-debias variables.
            check = _check_local_step if name.endswith("/local_step") else None
            targets.append(_Target(name, tensor, check=check))
    return targets


def _check_local_step(value: Tensor) -> None:
    """A zero-debias ``local_step``: a count, as ``ExponentialMovingAverage.load_state_dict`` wants."""
    step = float(value)
    if not (step >= 0 and math.isfinite(step) and step == math.floor(step)):
        raise ValueError(f"local_step is {step!r}, expected a count >= 0")
