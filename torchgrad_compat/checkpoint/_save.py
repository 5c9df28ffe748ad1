"""Writing a model and its optimizer as a TF checkpoint that TF restores: ``save_tf_checkpoint``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..train import ExponentialMovingAverage
from ._bundle import BundleReader, check_writable, write_bundle
from ._ema import ema_targets
from ._mapping import (
    _FILE_SUFFIX,
    _OBJECT_GRAPH,
    _as_parameters,
    _check_tf_names,
    _default_name,
    _Names,
    _parse_var_map,
    _targets,
    _to_tf_layout,
    _unwrap,
)
from ._state_file import state_with


# ---------------------------------------------------------------------- save
def save_tf_checkpoint(
    path: str | os.PathLike[str],
    var_map: Mapping[str, Tensor | tuple[Tensor, Any]],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    ema: ExponentialMovingAverage | None = None,
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
        ema: a ``torchgrad_compat.train.ExponentialMovingAverage``: its shadows
            under TF1's names (``<var_map name>/<ema.name>``, in TF's layout),
            which a ``Saver`` restores into the graph's
            ``tf.compat.v1.train.ExponentialMovingAverage``, and the averages of
            tensors under the names ``ema.state_dict()`` gives them. Every
            variable it averages must be in ``var_map``.
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
            ``global_step`` outside ``[0, 2**63 - 1]``; an ``ema`` that holds no
            averages yet or averages a variable ``var_map`` lacks. Each names the path, the
            tensor or the argument.
        CorruptCheckpointError: the directory's ``checkpoint`` state file, or
            with ``append=True`` the checkpoint at ``path``, cannot be read.
        RuntimeError: ``ema`` is inside its ``swapped()`` block (the variables
            hold the averages).
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
    if ema is not None:
        targets += ema_targets(parsed, ema, False)
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
