"""Reading a TF checkpoint into a model and its optimizer, all or nothing: ``load_tf_checkpoint``."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import optim as tgo
from ..optim.wrapper import check_no_shared_elements
from ..train import ExponentialMovingAverage
from ._bundle import BundleEntry, BundleReader, CorruptCheckpointError
from ._ema import ema_targets
from ._errors import CheckpointMismatchError
from ._mapping import (
    _ATTRIBUTE,
    _GLOBAL_STEP_NAMES,
    _INTEGER_DTYPES,
    _NUMPY_DTYPES,
    _OBJECT_GRAPH,
    _as_parameters,
    _check_tf_names,
    _default_name,
    _keys_of_managed,
    _Names,
    _parse_var_map,
    _resolve_prefix,
    _slots_scoped,
    _Target,
    _targets,
    _to_torch_layout,
    _unwrap,
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
    ema: ExponentialMovingAverage | None = None,
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
        ema: a ``torchgrad_compat.train.ExponentialMovingAverage`` (applied
            once, so that its shadows exist): each averaged variable's shadow
            is filled from ``<its var_map name>/<ema.name>`` (TF1's
            ``dense/kernel/ExponentialMovingAverage``), in the variable's
            layout; the averages of tensors (``tensors=``) and their
            zero-debias ``biased`` / ``local_step`` from the names
            ``ema.state_dict()`` gives them. Name-based checkpoints only (TF2's
            EMA is not trackable, so ``tf.train.Checkpoint`` holds no shadows
            by TF's names: map those in ``var_map``).
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
        ValueError: ``ema`` holds no averages yet, averages a variable that
            ``var_map`` does not map, or is given for an object-based checkpoint.
        RuntimeError: ``ema`` is inside its ``swapped()`` block.

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
            reader, var_map, optimizer, ema, optimizer_name, non_slot_suffix, loss_scale_suffix, scope, strict
        )


def _load(
    reader: BundleReader,
    var_map: Mapping[str, Tensor | tuple[Tensor, Any]],
    optimizer: torch.optim.Optimizer | None,
    ema: ExponentialMovingAverage | None,
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
    if ema is not None:
        targets += ema_targets(parsed, ema, object_based)

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
