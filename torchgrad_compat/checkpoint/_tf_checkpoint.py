"""TensorFlow checkpoints in and out: variables, slots, optimizer-wide state, global step."""

from __future__ import annotations

import bisect
import contextlib
import copy
import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import optim as tgo
from ..amp import DynamicLossScale, LossScaleOptimizer
from ..optim.wrapper import OptimizerWrapper, bytes_spanned, check_no_shared_elements
from ._bundle import BundleEntry, BundleReader, CorruptCheckpointError, check_writable, write_bundle
from ._state_file import latest_checkpoint, state_with

__all__ = [
    "CheckpointMismatchError",
    "LoadInfo",
    "list_tf_checkpoint",
    "load_tf_checkpoint",
    "save_tf_checkpoint",
]

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


@dataclass
class LoadInfo:
    """What ``load_tf_checkpoint`` did.

    Attributes:
        global_step: the checkpoint's global step (``global_step``; in an
            object-based checkpoint a root object ``global_step`` or ``step``),
            or None when it has none.
        loaded: the checkpoint names copied into the model or the optimizer, sorted.
        unused: the checkpoint names left unread, sorted.
        skipped: with ``strict=False``, every name the load wanted but left
            alone, -> why (not in the checkpoint, a shape or dtype that does not
            fit, a corrupt or truncated tensor, a dtype torch has no match for);
            its tensor keeps its value. Always empty with ``strict=True``.
    """

    global_step: int | None
    loaded: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


class CheckpointMismatchError(ValueError):
    """The checkpoint does not hold what ``var_map`` and the optimizer ask for.

    Raised by ``load_tf_checkpoint`` before anything is written: a name is
    missing, a shape (after the layout) or dtype differs, or a tensor's dtype
    has no torch counterpart (TF's ``resource``, ``variant``, ``string``...).

    Attributes:
        problems: every offending checkpoint name -> why, sorted by name.
    """

    def __init__(self, message: str, problems: dict[str, str]):
        super().__init__(message)
        self.problems = dict(sorted(problems.items()))


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
    params = [p for group in opt.param_groups for p in group["params"]]
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


# ---------------------------------------------------------------------- list / load
def list_tf_checkpoint(path: str | os.PathLike[str]) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of a TF checkpoint as ``(name, shape, dtype)``, sorted by name; no TensorFlow needed.

    ``path`` is a checkpoint prefix (``"model.ckpt-1000"``) or a directory
    (its latest checkpoint, named by its ``checkpoint`` state file). ``dtype``
    is TF's name for it (``"float32"``, ``"int64"``, ``"string"``, ...).
    """
    reader = BundleReader(_resolve_prefix(path))
    return [(e.name, e.shape, e.dtype) for e in sorted(reader.entries.values(), key=lambda e: e.name)]


def load_tf_checkpoint(
    path: str | os.PathLike[str],
    var_map: Mapping[str, Tensor | tuple[Tensor, Any]],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    optimizer_name: str | None = None,
    non_slot_suffix: str | None = None,
    loss_scale_suffix: str | None = None,
    scope: str | None = None,
    strict: bool = True,
) -> LoadInfo:
    """Copy a TF checkpoint's variables, and the optimizer's slots and state, into torch tensors.

    Works without TensorFlow. Reads name-based checkpoints (``tf.compat.v1.train.Saver``)
    and object-based ones (``tf.train.Checkpoint``; then ``var_map`` names are
    object paths such as ``"model/dense/kernel"`` and ``optimizer_name`` is the
    optimizer's attribute on the checkpoint, ``"optimizer"`` by default).

    Args:
        path: a checkpoint prefix, one of its files, or a directory (its
            latest checkpoint, as its ``checkpoint`` state file names it; that
            name is taken as written, never stripped of a file suffix).
        var_map: TF variable name -> tensor, or -> ``(tensor, layout)`` where
            layout is ``"transpose"`` (2-D) or a dim permutation ``perm`` with
            ``tensor = tf_value.permute(perm)``; applied to the slots too. An
            alias of a parameter (a ``model.state_dict()`` value) stands for it;
            a view of part of one takes the same view of its slots; tensors
            sharing an element are refused.
        optimizer: one of ``torchgrad_compat.optim``'s optimizers, or a
            ``LossScaleOptimizer`` (or other wrapper) around one. The slots of
            every ``var_map`` tensor it manages are filled from TF's slot
            variables (made first if the optimizer has not stepped yet), and its
            optimizer-wide state from TF's (Adam's ``beta1_power`` /
            ``beta2_power``; AdagradDA's step from the global step; a dynamic
            loss scale's ``current_loss_scale`` and ``good_steps``).
        optimizer_name: TF's ``name=`` of the optimizer when it was not the default.
        non_slot_suffix: name-based checkpoints only. A TF1 graph with two Adam
            optimizers holds ``beta1_power`` for the first and ``beta1_power_1``
            for the second (TF makes the names unique, whatever ``name=``);
            ``""`` loads the first's, ``"_1"`` the second's. Left None, a
            checkpoint holding both is refused as ambiguous.
        loss_scale_suffix: name-based checkpoints only, as ``non_slot_suffix``
            for a dynamic loss scale's ``current_loss_scale`` and ``good_steps``:
            TF1 numbers those of a graph's second loss-scale optimizer
            ``current_loss_scale_1``, in the order the optimizers were made (its
            beta powers are numbered in the order of their first update, which
            may differ). Left None, a checkpoint holding several is refused as
            ambiguous.
        scope: name-based checkpoints only: the scope the TF optimizer's
            ``minimize``/``apply_gradients`` ran in, ``"train"`` for
            ``with tf.variable_scope("train"):`` or ``tf.name_scope("train")``.
            TF1 then names its optimizer-wide state ``train/beta1_power``, and,
            under a variable scope, its slots ``train/<variable>/Adam``; each
            slot is read under the name the checkpoint holds.
        strict: True (the default): everything asked for must be in the
            checkpoint and valid, or nothing is loaded. False: load what is
            valid, leave the rest as it is and say why in ``LoadInfo.skipped``
            (e.g. the weights of a run trained with another optimizer, whose
            slots the checkpoint lacks: the slots keep their initial values).

    Returns:
        A :class:`LoadInfo`.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CorruptCheckpointError: the index or the state file is malformed, or a
            file of the checkpoint is not a regular file (a FIFO is refused, not
            waited on), or (``strict=True``) a tensor asked for is truncated or
            fails its CRC32C check; its ``problems`` lists every such tensor.
            The message names the file and the entry. Nothing has been changed.
        CheckpointMismatchError: (``strict=True``) a name is missing from the
            checkpoint, a shape or dtype differs, or a dtype has no torch
            counterpart; its ``problems`` lists every one. Nothing has been changed.
        TypeError: a bad argument type.

    Loading is all or nothing and holds one copy of the data: first every
    name, shape and dtype is checked and every tensor's CRC32C computed as its
    bytes stream past (none kept); only then is each tensor read and copied
    into its target, one at a time, so at most one tensor's bytes are held
    beside the targets. The files stay open from the checks to the copies, so a
    checkpoint saved over the same prefix meanwhile is not read; only a file
    overwritten in place mid-load (TF never does) could fail a copy's CRC32C
    after earlier copies were made.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}: {strict!r}")
    with BundleReader(_resolve_prefix(path)) as reader:
        return _load(
            reader, var_map, optimizer, optimizer_name, non_slot_suffix, loss_scale_suffix, scope, strict
        )


def _load(
    reader: BundleReader,
    var_map: Mapping[str, Tensor | tuple[Tensor, Any]],
    optimizer: torch.optim.Optimizer | None,
    optimizer_name: str | None,
    non_slot_suffix: str | None,
    loss_scale_suffix: str | None,
    scope: str | None,
    strict: bool,
) -> LoadInfo:
    parsed = _parse_var_map(var_map)
    opt, loss_scale, in_lso = _unwrap(optimizer)
    parts: dict[str, Tensor] = {}
    if opt is not None:
        parsed, parts = _as_parameters(parsed, opt)
    # Each copy must land in memory of its own: an expanded view, or two entries sharing memory,
    # would keep only the last value written.
    check_no_shared_elements("load_tf_checkpoint", [(f"var_map[{k!r}]", t) for k, (t, _) in parsed.items()])
    object_based = _OBJECT_GRAPH in reader.entries
    if optimizer_name is not None and (not isinstance(optimizer_name, str) or not optimizer_name):
        raise TypeError(f"optimizer_name must be a non-empty str, got {optimizer_name!r}")
    default = "optimizer" if object_based else (_default_name(opt) if opt is not None else "")
    _check_tf_names(object_based, scope, non_slot_suffix=non_slot_suffix, loss_scale_suffix=loss_scale_suffix)
    managed_keys = _keys_of_managed(parsed, parts, opt)
    name = optimizer_name or default
    names = _Names(
        object_based,
        name,
        in_lso,
        non_slot_suffix or "",
        loss_scale_suffix or "",
        scope or "",
        # A name scope leaves the slots unscoped: read them where the checkpoint has them.
        scoped_slots=bool(scope) and _slots_scoped(reader, managed_keys, scope, name),
    )

    global_step_name = next(
        (n for n in _GLOBAL_STEP_NAMES["object" if object_based else "name"] if n in reader.entries), None
    )
    step_name = global_step_name or _GLOBAL_STEP_NAMES["object" if object_based else "name"][0]
    targets, fresh_slots = _targets(parsed, parts, opt, loss_scale, names, step_name)

    # 1. Validate everything, reading no data into memory.
    mismatched, corrupt = _validate(reader, targets, global_step_name)
    if opt is not None:
        mismatched.update(_extra_slots(reader, managed_keys, opt, names, {t.name for t in targets}))
        if not object_based and non_slot_suffix is None:
            mismatched.update(_ambiguous_non_slot(reader, opt, names.non_slot_prefix))
    if loss_scale is not None and not object_based and loss_scale_suffix is None:
        mismatched.update(_ambiguous_loss_scale(reader))
    if strict and (mismatched or corrupt):
        raise _load_error(reader, mismatched, corrupt)
    skipped = {**mismatched, **corrupt}
    # 2. Copy, one tensor at a time.
    to_load = [t for t in targets if t.name not in skipped]
    with torch.no_grad():
        for target in to_load:
            _copy_into(target.tensor, _to_torch_layout(reader.read(target.name), target.perm))
        loaded_ids = {id(t.tensor) for t in to_load} | {id(t.of) for t in to_load if t.of is not None}
        if loss_scale is not None and id(loss_scale.variables()[0]) in loaded_ids:
            # As its load_state_dict does: a scale below 1 has its unscaled gradients checked too.
            loss_scale.may_be_below_one = float(loss_scale.variables()[0]) < 1.0
        for tensor, state in fresh_slots.items():
            # Slots made for this load: installed when any of them was loaded (the others keep
            # their initial values, as TF's initializers would give them).
            if any(id(slot) in loaded_ids for slot in state.values()):
                opt.state[tensor] = state  # type: ignore[union-attr]

    loaded = {t.name for t in to_load}
    global_step = None
    if global_step_name is not None and global_step_name not in skipped:
        global_step = int(reader.read(global_step_name).item())
        loaded.add(global_step_name)
    unused = sorted(set(reader.entries) - loaded - set(skipped) - {_OBJECT_GRAPH})
    return LoadInfo(
        global_step=global_step, loaded=sorted(loaded), unused=unused, skipped=dict(sorted(skipped.items()))
    )


def _validate(
    reader: BundleReader, targets: list[_Target], global_step_name: str | None
) -> tuple[dict[str, str], dict[str, str]]:
    """({name: why it does not fit its target}, {name: why its bytes cannot be read}).

    Names, shapes and dtypes come from the index; the data files are read only
    to stream every remaining tensor's bytes through its CRC32C, and to read
    the scalars whose owner checks their range (``_Target.check``).
    """
    mismatched: dict[str, str] = {}
    for target in targets:
        entry = reader.entries.get(target.name)
        if entry is None:
            mismatched[target.name] = "not in the checkpoint"
        elif entry.torch_dtype is None:
            mismatched[target.name] = f"checkpoint dtype {entry.dtype} has no torch dtype"
        else:
            problem = _mismatch(entry, target)
            if problem:
                mismatched.setdefault(target.name, problem)
    to_check = {t.name for t in targets} - set(mismatched)
    if global_step_name is not None:
        step_entry = reader.entries[global_step_name]
        if step_entry.torch_dtype not in _INTEGER_DTYPES:
            mismatched[global_step_name] = f"checkpoint dtype {step_entry.dtype}, a global step is an integer"
        elif tuple(step_entry.shape) != ():
            mismatched[global_step_name] = (
                f"checkpoint shape {list(step_entry.shape)}, a global step is a scalar"
            )
        else:
            to_check.add(global_step_name)
    corrupt: dict[str, str] = {}
    for name in sorted(to_check):
        try:
            reader.verify(name)
        except CorruptCheckpointError as error:
            corrupt[name] = str(error)
    for target in targets:
        if target.name in mismatched or target.name in corrupt:
            continue
        if not target.integer and target.check is None:
            continue
        value = reader.read(target.name)
        if target.integer:
            # An int64 counter copied into a narrower integer would wrap (T < 0 for AdagradDA).
            number, info = int(value), torch.iinfo(target.tensor.dtype)
            if not info.min <= number <= info.max:
                mismatched[target.name] = (
                    f"value {number} does not fit the tensor's dtype {target.tensor.dtype}"
                )
                continue
        if target.check is not None:
            try:
                target.check(value)
            except (TypeError, ValueError) as error:
                mismatched.setdefault(target.name, f"invalid value: {error}")
    if (
        global_step_name is not None
        and global_step_name not in mismatched
        and global_step_name not in corrupt
    ):
        step = int(reader.read(global_step_name))
        if step < 0:
            mismatched[global_step_name] = f"value {step}, a global step is >= 0"
    return mismatched, corrupt


def _ambiguous_non_slot(reader: BundleReader, opt: tgo.Optimizer, prefix: str) -> dict[str, str]:
    """Optimizer-wide state a name-based checkpoint holds for more than one optimizer of the graph.

    TF1 names the beta powers of a graph's second Adam ``beta1_power_1`` (and so
    on), whatever its ``name=``: ``beta1_power`` alone may be another optimizer's,
    and its bias correction would be silently wrong here.
    """
    ambiguous = {}
    keys = type(opt).tf_non_slot_names
    if keys:
        whose = f"the same state of another {_default_name(opt)} optimizer"
        ambiguous.update(_numbered_twins(reader, [prefix + k for k in keys], whose, "non_slot_suffix"))
    return ambiguous


def _ambiguous_loss_scale(reader: BundleReader) -> dict[str, str]:
    """A dynamic loss scale's state that a name-based checkpoint holds for more than one optimizer:
    TF1 names a graph's second one ``current_loss_scale_1`` (see ``_ambiguous_non_slot``)."""
    keys = ("current_loss_scale", "good_steps")
    return _numbered_twins(reader, keys, "the loss scale of another optimizer", "loss_scale_suffix")


def _numbered_twins(reader: BundleReader, keys: Sequence[str], whose: str, arg: str) -> dict[str, str]:
    """``{key: why}`` for each key the checkpoint holds beside ``key_1`` (and so on), which are ``whose``."""
    ambiguous = {}
    for key in keys:
        others = sorted(n for n in reader.entries if re.fullmatch(rf"{re.escape(key)}_\d+", n))
        if key in reader.entries and others:
            ambiguous[key] = (
                f"ambiguous: the checkpoint also holds {others}, {whose} of the TF graph; pass "
                f"{arg}='' for {key!r}, or the suffix of the others (such as '_1')"
            )
    return ambiguous


def _extra_slots(
    reader: BundleReader,
    managed_keys: list[str],
    opt: tgo.Optimizer,
    names: _Names,
    wanted: set[str],
) -> dict[str, str]:
    """Slot variables the checkpoint holds for the loaded variables that this optimizer has no slot for.

    An Adam checkpoint read by a Momentum optimizer named "Adam", or a
    centered RMSProp's by a plain one, would otherwise fill the wrong slots
    silently: TF numbers a variable's slots ``v/N``, ``v/N_1``, ... by creation order.
    """
    keys = {names.variable(key).removesuffix(_ATTRIBUTE) for key in managed_keys}
    if not names.object_based:
        keys = {names.slot_prefix + key for key in keys}
    extra = {}
    suffix = re.compile(rf"{re.escape(names.optimizer_name)}(_\d+)?")
    marker = f"/.OPTIMIZER_SLOT/{names.optimizer_name}/"
    for name in reader.entries:
        if name in wanted:
            continue
        if names.object_based:
            base, found, _ = name.partition(marker)
            owner = base if found else None
        else:
            head, _, tail = name.rpartition("/")
            owner = head if suffix.fullmatch(tail) else None
        if owner in keys:
            extra[name] = (
                f"a slot of {owner!r} that {type(opt).__name__} does not have: the checkpoint was "
                "written by another optimizer (or another configuration of it)"
            )
    return extra


def _load_error(reader: BundleReader, mismatched: dict[str, str], corrupt: dict[str, str]) -> ValueError:
    """One error listing every problem: CorruptCheckpointError if any tensor is unreadable."""
    lines = []
    missing = sorted(n for n, why in mismatched.items() if why == "not in the checkpoint")
    if missing:
        available = sorted(n for n in reader.entries if n != _OBJECT_GRAPH)
        shown = ", ".join(available[:20]) + (", ..." if len(available) > 20 else "")
        lines.append(
            f"not in the checkpoint: {', '.join(missing)} (it holds {len(available)} tensors: {shown})"
        )
    lines += [f"{name}: {why}" for name, why in sorted(mismatched.items()) if name not in missing]
    lines += [f"{name}: {why}" for name, why in sorted(corrupt.items())]
    message = "cannot load the TF checkpoint " + reader.prefix + ":\n  " + "\n  ".join(lines)
    message += "\nnothing was loaded (strict=False loads what is valid and reports the rest)"
    if corrupt:
        return CorruptCheckpointError(message, {**mismatched, **corrupt})
    return CheckpointMismatchError(message, mismatched)


def _copy_into(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)``; into CPU memory as numpy's single-threaded copy.

    torch splits even a few-MB CPU copy across its intra-op threads, and where
    the cores are shared every copy then waits for a descheduled thread:
    loading 300 MB in 152 tensors on a loaded 2-core machine took 1.95 s of
    ``copy_`` with 2 threads, 0.10 s with one. The version counter is bumped
    as ``copy_`` would, so autograd still sees the write.
    """
    if (
        dst.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.dtype in _NUMPY_DTYPES
        and not dst.is_conj()
    ):
        np.copyto(dst.detach().numpy(), src.numpy())
        torch.autograd.graph.increment_version(dst)
    else:
        dst.copy_(src)


def _mismatch(entry: BundleEntry, target: _Target) -> str | None:
    """Why the checkpoint's ``entry`` cannot be copied into ``target``, or None."""
    tensor = target.tensor
    integer_counter = target.integer and entry.torch_dtype in _INTEGER_DTYPES
    if entry.torch_dtype != tensor.dtype and not integer_counter:
        return f"checkpoint dtype {entry.dtype}, tensor dtype {tensor.dtype}"
    if target.perm is None:
        if tuple(entry.shape) != tuple(tensor.shape):
            return f"checkpoint shape {list(entry.shape)}, tensor shape {list(tensor.shape)}"
        return None
    if len(entry.shape) != len(target.perm):
        return f"checkpoint shape {list(entry.shape)} has another rank than layout {target.perm}"
    permuted = [entry.shape[d] for d in target.perm]
    if permuted != list(tensor.shape):
        return (
            f"checkpoint shape {list(entry.shape)} ({permuted} after the layout), "
            f"tensor shape {list(tensor.shape)}"
        )
    return None


# ---------------------------------------------------------------------- save
def save_tf_checkpoint(
    path: str | os.PathLike[str],
    var_map: Mapping[str, Tensor | tuple[Tensor, Any]],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    global_step: int | Tensor | None = None,
    optimizer_name: str | None = None,
    non_slot_suffix: str = "",
    loss_scale_suffix: str = "",
    scope: str | None = None,
    scoped_slots: bool = True,
    append: bool = False,
) -> str:
    """Write a name-based TF checkpoint that ``tf.compat.v1.train.Saver`` restores; no TensorFlow needed.

    Writes ``<path>.index`` and ``<path>.data-00000-of-00001`` and records the
    checkpoint in the directory's ``checkpoint`` state file (so
    ``tf.train.latest_checkpoint`` and ``load_tf_checkpoint(directory)`` find it).

    Args:
        path: the checkpoint prefix, e.g. ``"run/model.ckpt-1000"``.
        var_map: as for :func:`load_tf_checkpoint`; the layout is undone on the way out.
        optimizer: its slots (initial values where it has not stepped), its
            optimizer-wide state and, for a ``LossScaleOptimizer`` with a
            dynamic scale, ``current_loss_scale`` and ``good_steps``, under TF's names.
        global_step: written as the int64 ``global_step`` variable. For
            AdagradDA (whose step is TF's global step) it defaults to the
            optimizer's own counter, and must agree with it when given.
        optimizer_name: TF's ``name=`` of the optimizer in the TF graph, if not the default.
        non_slot_suffix: ``"_1"`` (and so on) writes the optimizer-wide state
            under the names TF1 gives a graph's second optimizer of one kind
            (``beta1_power_1``), as for :func:`load_tf_checkpoint`.
        loss_scale_suffix: the same for a dynamic loss scale's variables.
        scope: the scope of the TF graph's optimizer, as for
            :func:`load_tf_checkpoint`: prefixes the optimizer-wide state, and
            the slots unless ``scoped_slots=False`` (a ``tf.name_scope``, which
            leaves slot names alone).
        append: add to the checkpoint already at ``path`` instead of replacing
            it, for a graph with several optimizers (a GAN's): save the
            generator's variables and optimizer, then the discriminator's with
            ``append=True`` and its suffix or scope. A name written twice is
            refused, except an equal ``global_step``. The checkpoint there is
            checked whole (sizes, pieces, CRC32C) before any of it is read.

    Returns:
        The prefix written.

    Raises:
        ValueError: what could not be read back is refused before anything is
            written: a prefix that is empty, a directory, holds a NUL or ends as
            a checkpoint's file does (``.index``, ``.data-00000-of-00001``); a
            tensor name that is empty, holds a NUL, is not valid Unicode or is
            ``_CHECKPOINTABLE_OBJECT_GRAPH``; a meta, sparse or nested tensor; a
            ``global_step`` outside ``[0, 2**63 - 1]``. Each names the path, the
            tensor or the argument.
        CorruptCheckpointError: the directory's ``checkpoint`` state file, or
            with ``append=True`` the checkpoint at ``path``, cannot be read.
        OSError: a write failed (a full disk); the error names the file.

    A save is all or nothing. It reads and checks the directory's state file
    first, then writes the data file, the index and the new state file in full,
    each under a fresh temporary name in the directory (created exclusively,
    never through a symlink planted there), syncs them, and only then renames
    them over their final names: data, index, state file. A save that fails
    leaves nothing new: no temporary, no checkpoint, the state file as it was.
    (Should a rename itself fail, the files already renamed are removed again
    where there were none before; one that replaced a file of a checkpoint
    saved earlier at the same prefix stays replaced, and the mismatched pair
    is then refused on load by its CRC32C, never read as values.)
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    prefix = _check_prefix(os.fspath(path))
    parsed = _parse_var_map(var_map)
    opt, loss_scale, _ = _unwrap(optimizer)
    parts: dict[str, Tensor] = {}
    if opt is not None:
        parsed, parts = _as_parameters(parsed, opt)
    if optimizer_name is not None and (not isinstance(optimizer_name, str) or not optimizer_name):
        raise TypeError(f"optimizer_name must be a non-empty str, got {optimizer_name!r}")
    _check_tf_names(False, scope, non_slot_suffix=non_slot_suffix, loss_scale_suffix=loss_scale_suffix)
    for arg, flag in (("scoped_slots", scoped_slots), ("append", append)):
        if not isinstance(flag, bool):
            raise TypeError(f"{arg} must be a bool, got {type(flag).__name__}: {flag!r}")
    names = _Names(
        False,
        optimizer_name or (_default_name(opt) if opt is not None else ""),
        non_slot_suffix=non_slot_suffix,
        loss_scale_suffix=loss_scale_suffix,
        scope=scope or "",
        scoped_slots=scoped_slots,
    )
    step = _check_step_arg(global_step)

    targets, _ = _targets(parsed, parts, opt, loss_scale, names, "global_step")
    tensors: dict[str, Tensor] = {}
    for target in targets:
        value = _to_tf_layout(target.tensor, target.perm).detach()
        if target.integer:
            value = value.to(torch.int64)
        if target.name not in tensors:
            tensors[target.name] = value
        elif not target.shared:
            raise ValueError(
                f"two tensors would be saved as {target.name!r}; check var_map and optimizer_name"
            )
        elif not torch.equal(tensors[target.name].cpu(), value.cpu()):
            raise ValueError(
                f"the param groups hold different {target.name} ({tensors[target.name].item()!r} vs "
                f"{value.item()!r}); a TF optimizer has one"
            )
    for name, value in tensors.items():
        check_writable(name, value)
    if _OBJECT_GRAPH in tensors:
        raise ValueError(
            f"cannot write tensor {_OBJECT_GRAPH!r}: TF reserves the name for the object graph of "
            "object-based checkpoints"
        )
    if step is not None:
        own = tensors.setdefault("global_step", torch.tensor(step, dtype=torch.int64))
        if int(own) != step:
            raise ValueError(
                f"global_step={step} disagrees with AdagradDAOptimizer's step {int(own)}; "
                "TF's AdagradDA reads the global step, so the two must match"
            )

    directory = Path(prefix).parent
    state, state_text = state_with(directory, Path(prefix).name)
    if append:
        tensors = _appended_to(prefix, tensors)
    created = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    try:
        write_bundle(prefix, tensors, also={state: state_text})
    except BaseException:
        for made in created:  # deepest first; none holds anything this save left
            with contextlib.suppress(OSError):
                made.rmdir()
        raise
    return prefix


def _check_prefix(prefix: str) -> str:
    """``prefix``, checked to name a checkpoint that a load of it finds again."""
    name = os.path.basename(prefix)
    if "\x00" in prefix:
        raise ValueError(f"path {prefix!r} holds a NUL character")
    if os.path.isdir(prefix):
        raise ValueError(f"path {prefix!r} is a directory; give a checkpoint prefix such as 'dir/model.ckpt'")
    if name in ("", ".", ".."):
        raise ValueError(f"path {prefix!r} names no file; give a checkpoint prefix such as 'dir/model.ckpt'")
    if _FILE_SUFFIX.search(name):
        raise ValueError(
            f"path {prefix!r} ends as a checkpoint's file does ({_FILE_SUFFIX.search(name)[0]!r}), so "
            "it would be read as that file; give the prefix, such as 'dir/model.ckpt'"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"path {prefix!r}: its file name is not UTF-8, which the directory's state file needs"
        ) from None
    return prefix


def _appended_to(prefix: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint at ``prefix`` (all of it, checked) with ``tensors`` added; no name twice.

    Everything is checked before any tensor is read: the names, then every
    tensor's size, pieces and CRC32C (streamed, nothing kept).
    """
    if not Path(prefix + ".index").is_file():
        raise FileNotFoundError(f"append=True: no checkpoint at {prefix!r} to add to")
    with BundleReader(prefix) as reader:
        if _OBJECT_GRAPH in reader.entries:
            raise ValueError(
                f"append=True: the checkpoint at {prefix!r} is object-based (tf.train.Checkpoint); "
                "this writes name-based ones"
            )
        unreadable = sorted(n for n, e in reader.entries.items() if e.torch_dtype is None)
        if unreadable:
            raise ValueError(
                f"append=True: the checkpoint at {prefix!r} holds tensors this package cannot carry "
                f"over (TF dtypes without a torch counterpart): {unreadable}"
            )
        twice = sorted(set(tensors) & set(reader.entries) - {"global_step"})
        if twice:
            raise ValueError(
                f"append=True: the checkpoint at {prefix!r} already holds {twice[0]!r}; give this "
                "optimizer its TF names (optimizer_name, non_slot_suffix, scope) and each variable once"
            )
        for name in sorted(reader.entries):
            reader.verify(name)
        if "global_step" in tensors and "global_step" in reader.entries:
            held_step = reader.read("global_step")
            if held_step.shape != () or int(held_step) != int(tensors["global_step"]):
                raise ValueError(
                    f"append=True: the checkpoint at {prefix!r} holds global_step {held_step.tolist()}, "
                    f"this save gives {int(tensors['global_step'])}; one TF graph has one global step"
                )
        held = {name: reader.read(name) for name in reader.entries}
    return {**held, **tensors}


def _check_step_arg(global_step: Any) -> int | None:
    if global_step is None:
        return None
    if isinstance(global_step, Tensor):
        if global_step.dim() != 0 or global_step.is_meta or not _is_integer(global_step.dtype):
            raise TypeError(f"global_step must be an int or a 0-d integer tensor, got {global_step!r}")
        global_step = global_step.item()  # (int() of a uint64 past 2**63 - 1 raises, unnamed)
    elif isinstance(global_step, bool) or not isinstance(global_step, int):
        raise TypeError(f"global_step must be an int or a 0-d integer tensor, got {global_step!r}")
    if not 0 <= global_step <= torch.iinfo(torch.int64).max:
        raise ValueError(
            f"Invalid global_step value: {global_step!r}; expected a value >= 0 that fits TF's int64 "
            "global_step"
        )
    return global_step


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
