"""What a TF checkpoint's names stand for here: variables by ``var_map`` (with layouts), slots and
optimizer-wide state by TF's naming, and the tensors each is copied from or into."""

from __future__ import annotations

import bisect
import copy
import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import optim as tgo
from ..amp import DynamicLossScale, LossScaleOptimizer
from ..optim.wrapper import OptimizerWrapper, bytes_spanned
from ._bundle import BundleReader
from ._state_file import latest_checkpoint

# TF2 object-based checkpoints: a variable's value lives under its object path plus this.
_ATTRIBUTE = "/.ATTRIBUTES/VARIABLE_VALUE"
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
_GLOBAL_STEP_NAMES = {"name": ("global_step",), "object": (f"global_step{_ATTRIBUTE}", f"step{_ATTRIBUTE}")}
_INTEGER_DTYPES = (torch.int32, torch.int64)
# The suffixes of a checkpoint's files: a prefix ending in one could not be told from a file.
_FILE_SUFFIX = re.compile(r"\.(index|data-\d{5}-of-\d{5})$")
_NUMPY_DTYPES = (
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


# ---------------------------------------------------------------------- the optimizer's state
def _optimizer_wide_state(opt: tgo.Optimizer) -> list[dict[str, Tensor]]:
    """The optimizer's per-group dicts of optimizer-wide state (Adam's beta powers), written in place.

    The one place that knows where that state lives.
    """
    return [opt.non_slot_state(group) for group in opt.param_groups]


def _unwrap(optimizer: Any) -> tuple[tgo.Optimizer | None, DynamicLossScale | None, bool]:
    """(the optimizer of the ten, the dynamic loss scale around it, whether a LossScaleOptimizer wraps it)."""
    if optimizer is None:
        return None, None, False
    loss_scale = None
    in_loss_scale_optimizer = False
    while isinstance(optimizer, OptimizerWrapper):
        if isinstance(optimizer, LossScaleOptimizer):
            in_loss_scale_optimizer = True
            if isinstance(optimizer.loss_scale, DynamicLossScale):
                loss_scale = optimizer.loss_scale
        optimizer = optimizer.inner_optimizer
    if not isinstance(optimizer, tgo.Optimizer):
        raise TypeError(
            "optimizer must be one of torchgrad_compat.optim's optimizers (or a LossScaleOptimizer "
            f"around one), got {type(optimizer).__name__}: TF's slots exist only for those"
        )
    return optimizer, loss_scale, in_loss_scale_optimizer


def _slot_order(opt: tgo.Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
    """The slots of ``group``'s variables in TF's creation order (the class's ``tf_slot_order``):
    the i-th is ``v/<name>`` (i = 0) or ``v/<name>_<i>`` in a name-based checkpoint."""
    _rule_class(opt)
    used = set(opt.slot_names(group))
    return tuple(name for name in type(opt).tf_slot_order if name in used)


def _default_name(opt: tgo.Optimizer) -> str:
    """TF's default ``name=`` of the optimizer: its class's name less "Optimizer"."""
    return _rule_class(opt).__name__.removesuffix("Optimizer")


def _rule_class(opt: tgo.Optimizer) -> type:
    """The class of this package that defines ``opt``'s rule (a user's subclass keeps its TF names)."""
    for cls in type(opt).__mro__:
        if "tf_slot_order" in vars(cls) and cls is not tgo.Optimizer:
            return cls
    raise TypeError(f"no TensorFlow slot names are known for {type(opt).__name__}")


# ---------------------------------------------------------------------- names
class _Names:
    """TF's names for variables and optimizer state, name-based (TF1 Saver) or object-based (TF2)."""

    def __init__(
        self,
        object_based: bool,
        optimizer_name: str,
        in_loss_scale_optimizer: bool = False,
        non_slot_suffix: str = "",
        loss_scale_suffix: str = "",
        scope: str = "",
        scoped_slots: bool = True,
    ):
        self.object_based = object_based
        # TF1 names an optimizer's variables after the scope its update was built in: a name
        # scope prefixes its optimizer-wide state, a variable scope its slots too.
        self.non_slot_prefix = f"{scope}/" if scope else ""
        self.slot_prefix = self.non_slot_prefix if scoped_slots else ""
        self.non_slot_suffix = non_slot_suffix
        self.loss_scale_suffix = loss_scale_suffix
        self.loss_scale_path = optimizer_name
        # TF's MixedPrecisionLossScaleOptimizer tracks the optimizer it wraps as ``base_optimizer``.
        self.optimizer_name = (
            f"{optimizer_name}/base_optimizer" if object_based and in_loss_scale_optimizer else optimizer_name
        )

    def variable(self, key: str) -> str:
        if self.object_based and not key.endswith(_ATTRIBUTE):
            return key + _ATTRIBUTE
        return key

    def slot(self, key: str, slot: str, index: int) -> str:
        if self.object_based:
            base = key.removesuffix(_ATTRIBUTE)
            return f"{base}/.OPTIMIZER_SLOT/{self.optimizer_name}/{slot}{_ATTRIBUTE}"
        return f"{self.slot_prefix}{key}/{self.optimizer_name}" + (f"_{index}" if index else "")

    def non_slot(self, name: str) -> str:
        if self.object_based:
            return f"{self.optimizer_name}/{name}{_ATTRIBUTE}"
        return self.non_slot_prefix + name + self.non_slot_suffix

    def loss_scale(self, name: str) -> str:
        if self.object_based:
            return f"{self.loss_scale_path}/loss_scale/{name}{_ATTRIBUTE}"
        return name + self.loss_scale_suffix


# ---------------------------------------------------------------------- arguments
def _resolve_prefix(path: str | os.PathLike[str]) -> str:
    """A checkpoint prefix from a prefix, a file of the checkpoint, or a directory with a state file.

    A path that is both a prefix and, less a file's suffix, another prefix is the
    prefix. The state file's path is taken as written: TF names prefixes there.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    text = os.fspath(path)
    if os.path.isdir(text):
        latest = latest_checkpoint(text)
        prefix = latest if os.path.isabs(latest) else os.path.join(text, latest)
        if not os.path.exists(f"{prefix}.index"):
            raise FileNotFoundError(
                f"{os.path.join(text, 'checkpoint')} names {latest!r} as the latest checkpoint, "
                f"but {prefix}.index does not exist"
            )
        return prefix
    if os.path.exists(f"{text}.index"):
        return text
    stripped = _FILE_SUFFIX.sub("", text)
    if stripped == text or not os.path.exists(f"{stripped}.index"):
        raise FileNotFoundError(f"no TensorFlow checkpoint at path {text!r}: {stripped}.index does not exist")
    return stripped


def _parse_var_map(var_map: Any) -> dict[str, tuple[Tensor, tuple[int, ...] | None]]:
    """``{name: (tensor, permutation or None)}``; the permutation takes TF's layout to the tensor's."""
    if not isinstance(var_map, Mapping):
        raise TypeError(f"var_map must be a mapping of TF names to tensors, got {type(var_map).__name__}")
    parsed: dict[str, tuple[Tensor, tuple[int, ...] | None]] = {}
    seen: dict[int, str] = {}
    for name, value in var_map.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"var_map keys must be non-empty TF variable names (str), got {name!r}")
        layout = None
        if isinstance(value, tuple):
            if len(value) != 2:
                raise TypeError(
                    f"var_map[{name!r}] must be a tensor or (tensor, layout), got a {len(value)}-tuple"
                )
            value, layout = value
        if not isinstance(value, Tensor):
            raise TypeError(f"var_map[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
        if id(value) in seen:
            raise ValueError(f"var_map gives the same tensor for {seen[id(value)]!r} and {name!r}")
        seen[id(value)] = name
        parsed[name] = (value, _parse_layout(name, layout, value.dim()))
    return parsed


def _as_parameters(
    parsed: dict[str, tuple[Tensor, tuple[int, ...] | None]], opt: tgo.Optimizer
) -> tuple[dict[str, tuple[Tensor, tuple[int, ...] | None]], dict[str, Tensor]]:
    """``parsed`` with each alias of one of ``opt``'s parameters replaced by the parameter itself,
    and the entries that are views of part of a parameter, with that parameter.

    ``model.state_dict()``, ``p.data`` and ``p.detach()`` give other tensor objects over a
    parameter's memory. Taken as they are, they would carry the variable but not its slots: the
    optimizer's state would be silently left behind. An entry over part of a parameter (TF's
    separate q/k/v kernels as row blocks of one ``in_proj_weight``, or ``weight.T``) has as its
    slots the same view of the parameter's slots (see :func:`_slot_view`).
    """
    return _resolve_against(parsed, [p for group in opt.param_groups for p in group["params"]])


def _resolve_against(
    parsed: dict[str, tuple[Tensor, tuple[int, ...] | None]], params: list[Tensor]
) -> tuple[dict[str, tuple[Tensor, tuple[int, ...] | None]], dict[str, Tensor]]:
    """:func:`_as_parameters` against any tensors that own state (an optimizer's parameters, the
    variables an ``ExponentialMovingAverage`` averages)."""
    managed = set(map(id, params))
    if all(id(t) in managed for t, _ in parsed.values()):
        return parsed, {}
    same_view: dict[tuple[Any, ...], Tensor] = {}
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for i, p in enumerate(params):
        if p.layout == torch.strided and not p.is_meta and p.numel() and (start := p.data_ptr()):
            same_view.setdefault((p.device, start, p.shape, p.stride(), p.dtype), p)
            spans.setdefault(str(p.device), []).append((start, start + bytes_spanned(p), i))
    # Per device: spans by start, and the furthest end among the first k (a bisect finds overlaps).
    reach: dict[str, tuple[list[int], list[int]]] = {}
    for device, ranges in spans.items():
        ranges.sort()
        reach[device] = ([r[0] for r in ranges], list(itertools.accumulate((r[1] for r in ranges), max)))
    resolved, parts = dict(parsed), {}
    for key, (t, perm) in parsed.items():
        if id(t) in managed or t.layout != torch.strided or t.is_meta or not t.numel() or not t.data_ptr():
            continue
        param = same_view.get((t.device, t.data_ptr(), t.shape, t.stride(), t.dtype))
        if param is not None:
            resolved[key] = (param, perm)
            continue
        start, end = t.data_ptr(), t.data_ptr() + bytes_spanned(t)
        starts, furthest = reach.get(str(t.device), ([], []))
        before_end = bisect.bisect_left(starts, end)  # the spans that start before t ends
        if before_end and furthest[before_end - 1] > start:
            i = next(i for s_, e_, i in spans[str(t.device)] if s_ < end and start < e_)
            parts[key] = params[i]
    return resolved, parts


def _slot_view(key: str, slot: Tensor, part: Tensor, param: Tensor) -> Tensor:
    """The elements of ``slot`` that are to ``slot`` what ``part`` is to ``param``."""
    size = param.element_size()
    offset, rest = divmod(part.data_ptr() - param.data_ptr(), size)
    dense = bytes_spanned(param) == param.numel() * size
    if not (
        dense
        and part.dtype == param.dtype
        and slot.stride() == param.stride()
        and rest == 0
        and offset >= 0
        and offset * size + bytes_spanned(part) <= bytes_spanned(param)
    ):
        raise ValueError(
            f"var_map[{key!r}] is a view of part of a parameter the optimizer manages, but not one its "
            f"slots can follow (parameter shape {tuple(param.shape)}, strides {param.stride()}; view "
            f"shape {tuple(part.shape)}, strides {part.stride()}): pass the parameter itself, with a layout"
        )
    return slot.as_strided(part.shape, part.stride(), slot.storage_offset() + offset)


def _check_tf_names(object_based: bool, scope: Any, **suffixes: Any) -> None:
    """Check ``scope`` and the ``*_suffix`` arguments (None: not given); all are name-based only."""
    for arg, suffix in suffixes.items():
        if suffix is not None and (not isinstance(suffix, str) or not re.fullmatch(r"(_\d+)?", suffix)):
            raise ValueError(f"{arg} must be '' or '_' and a number (TF's), got {suffix!r}")
    if scope is not None and (
        not isinstance(scope, str) or not scope or scope.startswith("/") or scope.endswith("/")
    ):
        raise ValueError(f"scope must be a TF scope name such as 'train' (no '/' at its ends), got {scope!r}")
    for arg, value in {**suffixes, "scope": scope}.items():
        if value and object_based:
            raise ValueError(
                f"{arg}={value!r} is for name-based checkpoints; an object-based one "
                "names each optimizer's state by its path (optimizer_name)"
            )


def _slots_scoped(reader: BundleReader, keys: Sequence[str], scope: str, optimizer_name: str) -> bool:
    """Whether the checkpoint holds the slots of ``keys`` (the optimizer's variables) under ``scope``
    (a variable scope) or not (a name scope)."""
    for key in keys:
        if f"{scope}/{key}/{optimizer_name}" in reader.entries:
            return True
        if f"{key}/{optimizer_name}" in reader.entries:
            return False
    return True


def _keys_of_managed(
    parsed: dict[str, tuple[Tensor, tuple[int, ...] | None]],
    parts: dict[str, Tensor],
    opt: tgo.Optimizer | None,
) -> list[str]:
    """The ``var_map`` names whose tensor is (or is part of) one of ``opt``'s parameters: those with slots."""
    if opt is None:
        return []
    managed = {id(p) for group in opt.param_groups for p in group["params"]}
    return [key for key, (t, _) in parsed.items() if id(parts.get(key, t)) in managed]


def _parse_layout(name: str, layout: Any, ndim: int) -> tuple[int, ...] | None:
    if layout is None:
        return None
    if isinstance(layout, str) and layout == "transpose":
        if ndim != 2:
            raise ValueError(
                f"var_map[{name!r}] layout 'transpose' needs a 2-D tensor, got {ndim}-D; "
                "give a dim permutation, e.g. (3, 2, 0, 1) for a Conv2D kernel HWIO -> OIHW"
            )
        return (1, 0)
    if isinstance(layout, str) or not isinstance(layout, Sequence):
        raise ValueError(f"var_map[{name!r}] layout must be 'transpose' or a dim permutation, got {layout!r}")
    perm = tuple(layout)
    is_int = all(isinstance(d, int) and not isinstance(d, bool) for d in perm)
    if not is_int or sorted(perm) != list(range(ndim)):
        raise ValueError(
            f"var_map[{name!r}] layout {layout!r} is not a permutation of the tensor's {ndim} dims"
        )
    return perm


def _to_torch_layout(value: Tensor, perm: tuple[int, ...] | None) -> Tensor:
    return value if perm is None else value.permute(perm)


def _to_tf_layout(value: Tensor, perm: tuple[int, ...] | None) -> Tensor:
    if perm is None:
        return value
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return value.permute(inverse)


@dataclass
class _Target:
    name: str
    tensor: Tensor
    perm: tuple[int, ...] | None = None
    integer: bool = False  # an integer counter: any integer dtype is accepted
    shared: bool = False  # optimizer-wide state, one target per param group under one TF name
    # State with a valid range (beta powers, steps, the loss scale): the owner's own check of a
    # loaded value, run before anything is copied; it raises TypeError or ValueError.
    check: Callable[[Tensor], None] | None = None
    # A view of part of another tensor (a slot of a parameter that the var_map entry is part of).
    of: Tensor | None = None


def _targets(
    parsed: dict[str, tuple[Tensor, tuple[int, ...] | None]],
    parts: dict[str, Tensor],
    opt: tgo.Optimizer | None,
    loss_scale: DynamicLossScale | None,
    names: _Names,
    step_name: str,
) -> tuple[list[_Target], dict[Tensor, dict[str, Tensor]]]:
    """Every tensor a TF checkpoint holds for ``var_map`` and the optimizer, under TF's names.

    Also returns the slots made for parameters that have none yet (to be
    installed only once a load has succeeded).
    """
    targets = [_Target(names.variable(key), tensor, perm) for key, (tensor, perm) in parsed.items()]
    fresh: dict[Tensor, dict[str, Tensor]] = {}
    if opt is not None:
        group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
        for key, (tensor, perm) in parsed.items():
            param = parts.get(key, tensor)  # (a view of part of a parameter: the same view of its slots)
            group = group_of.get(id(param))
            if group is None:
                continue  # not trained by this optimizer: no slots
            state = opt.state.get(param) or fresh.get(param)
            if not state:
                state = fresh[param] = opt.initial_slots(group, param)
            for index, slot in enumerate(_slot_order(opt, group)):
                if param is tensor:
                    targets.append(_Target(names.slot(key, slot, index), state[slot], perm))
                else:
                    view = _slot_view(key, state[slot], tensor, param)
                    targets.append(_Target(names.slot(key, slot, index), view, perm, of=state[slot]))
        for key in type(opt).tf_non_slot_names:
            for i, group_state in enumerate(_optimizer_wide_state(opt)):
                check = _non_slot_check(opt, key, i, group_state[key])
                targets.append(_Target(names.non_slot(key), group_state[key], shared=True, check=check))
        if isinstance(opt, tgo.AdagradDAOptimizer):
            # TF's AdagradDA reads the global step; this port keeps it as a tensor or its own counter.
            if opt.global_step is not None:
                steps = [opt.global_step]
            else:
                steps = [group_state["global_step"] for group_state in _optimizer_wide_state(opt)]
            targets.extend(
                _Target(
                    step_name,
                    step,
                    integer=True,
                    shared=True,
                    check=_non_slot_check(opt, "global_step", i, step),
                )
                for i, step in enumerate(steps)
            )
    if loss_scale is not None:
        scale, good_steps = loss_scale.variables()
        targets.append(
            _Target(
                names.loss_scale("current_loss_scale"),
                scale,
                check=_loss_scale_check(loss_scale, "current_loss_scale"),
            )
        )
        targets.append(
            _Target(
                names.loss_scale("good_steps"),
                good_steps,
                integer=True,
                check=_loss_scale_check(loss_scale, "good_steps"),
            )
        )
    return targets, {t: slots for t, slots in fresh.items() if slots}


def _non_slot_check(opt: tgo.Optimizer, key: str, group: int, current: Tensor) -> Callable[[Tensor], None]:
    """The optimizer's own check of a loaded non-slot value (finite, in range), as load_state_dict runs it."""
    return lambda value: opt.check_loaded_non_slot(f"{key} (group {group})", key, value, current)


def _loss_scale_check(loss_scale: DynamicLossScale, key: str) -> Callable[[Tensor], None]:
    """The loss scale's own check of a loaded ``key``: its ``load_state_dict``, tried on a copy."""
    return lambda value: copy.deepcopy(loss_scale).load_state_dict({**loss_scale.state_dict(), key: value})
