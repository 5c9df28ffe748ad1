"""Checks that every replica takes the same step: the same ``group_assignment``, the same
parameters and settings, the same step number."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._collective import Collective


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
