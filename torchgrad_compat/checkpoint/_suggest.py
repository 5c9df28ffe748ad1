"""A draft of ``var_map``: a checkpoint's model variables matched to a module's tensors.

By name first, then by shape, then by order; ties are refused, never guessed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._bundle import BundleReader
from ._mapping import _ATTRIBUTE, _OBJECT_GRAPH, _resolve_prefix

__all__ = ["AmbiguousVarMapError", "SuggestedVarMap", "suggest_var_map"]

# TF (Keras layer) variable names -> torch's parameter and buffer names.
_LEAVES = {
    "kernel": "weight",
    "embeddings": "weight",
    "gamma": "weight",
    "beta": "bias",
    "moving_mean": "running_mean",
    "moving_variance": "running_var",
}
# Optimizer-wide and bookkeeping variables: never model weights.
_NOT_MODEL = {
    "global_step",
    "step",
    "save_counter",
    "beta1_power",
    "beta2_power",
    "current_loss_scale",
    "good_steps",
}
# TF's layout -> torch's, by rank: Dense kernels [in, out] -> [out, in]; Conv1D/2D/3D kernels
# [spatial..., in, out] -> [out, in, spatial...].
_LAYOUTS: dict[int, tuple[Any, ...]] = {
    2: ("transpose",),
    3: ((2, 1, 0),),
    4: ((3, 2, 0, 1),),
    5: ((4, 3, 0, 1, 2),),
}


def _model_variables(reader: BundleReader, ema_name: str) -> tuple[list[str], list[str]]:
    """The checkpoint's names that are model variables (not slots or optimizer-wide state), and
    those that are moving averages (``<name>/<ema_name>``, and the ``biased`` and ``local_step``
    of a zero-debiased one)."""
    names = [n for n in reader.entries if n != _OBJECT_GRAPH and reader.entries[n].torch_dtype is not None]
    plain = {n.removesuffix(_ATTRIBUTE) for n in names}
    out, averages = [], []
    for name in names:
        path = name.removesuffix(_ATTRIBUTE)
        parts = path.split("/")
        if parts[-1] == ema_name or (parts[-2:-1] == [ema_name] and parts[-1] in ("biased", "local_step")):
            # A variable's shadow is its variable's name plus the suffix, as a slot is; a
            # tensor's (a batch's moments) has no variable beside it, and is no model weight.
            averages.append(path)
            continue
        if "/.OPTIMIZER_SLOT/" in name or parts[-1] in _NOT_MODEL:
            continue
        # A name-based slot is its variable's name plus "/<optimizer name>[_i]".
        if any("/".join(parts[:i]) in plain for i in range(1, len(parts))):
            continue
        out.append(path)
    return sorted(out), sorted(averages)


def _torch_path(tf_name: str) -> list[str]:
    parts = tf_name.split("/")
    return [*parts[:-1], _LEAVES.get(parts[-1], parts[-1])]


def _layout(tf_name: str, tf_shape: tuple[int, ...], tensor: Tensor) -> Any:
    """The layout that takes TF's value to the tensor's, "none" for none needed, or None when none does.

    A ``kernel`` (Dense, Conv) always changes layout, even when the shapes
    already agree (a square Dense kernel is still [in, out]); other variables
    (embeddings, biases, batch-norm's) never do.
    """
    if tf_name.rpartition("/")[2] == "kernel" and len(tf_shape) in _LAYOUTS:
        (layout,) = _LAYOUTS[len(tf_shape)]
        perm = (1, 0) if layout == "transpose" else layout
        return layout if tuple(tf_shape[d] for d in perm) == tuple(tensor.shape) else None
    return "none" if tuple(tf_shape) == tuple(tensor.shape) else None


class AmbiguousVarMapError(ValueError):
    """``suggest_var_map`` found more than one equally good torch tensor for a TF variable.

    Attributes:
        candidates: each ambiguous TF name -> the torch names that fit it equally well.
    """

    def __init__(self, message: str, candidates: dict[str, list[str]]):
        super().__init__(message)
        self.candidates = candidates


@dataclass(frozen=True)
class Match:
    """One suggested pair: how it was found (``"name"``, ``"shape"`` or ``"order"``) and its layout."""

    tf_name: str
    torch_name: str
    layout: Any  # None, "transpose" or a dim permutation
    how: str
    tf_shape: tuple[int, ...]
    torch_shape: tuple[int, ...]


class SuggestedVarMap(dict):
    """The suggested ``var_map`` (a dict, ready for ``load_tf_checkpoint``) and how it was found.

    Attributes:
        matches: every pair, in checkpoint order, as :class:`Match`.
        unmatched_checkpoint: the checkpoint's model variables no tensor was found for (name, shape).
        unmatched_module: the module's parameters and buffers left out (name, shape).
        averages: the checkpoint's moving averages (name, shape): never model
            variables; ``load_tf_checkpoint(..., ema=ema)`` reads them by the
            names of the variables in ``var_map``.
    """

    matches: list[Match]
    unmatched_checkpoint: list[tuple[str, tuple[int, ...]]]
    unmatched_module: list[tuple[str, tuple[int, ...]]]
    averages: list[tuple[str, tuple[int, ...]]]

    def report(self) -> str:
        """What matched (and how, with the layout) and what did not, as plain text."""
        lines = [f"matched {len(self.matches)}:"]
        for m in self.matches:
            layout = "" if m.layout is None else f", layout {m.layout!r}"
            pair = f"{m.tf_name} {list(m.tf_shape)} -> {m.torch_name} {list(m.torch_shape)}"
            lines.append(f"  {pair} (by {m.how}{layout})")
        lines.append(f"checkpoint variables left out: {len(self.unmatched_checkpoint)}")
        lines += [f"  {name} {list(shape)}" for name, shape in self.unmatched_checkpoint]
        lines.append(f"module tensors left out: {len(self.unmatched_module)}")
        lines += [f"  {name} {list(shape)}" for name, shape in self.unmatched_module]
        lines.append(f"moving averages (load them with ema=): {len(self.averages)}")
        lines += [f"  {name} {list(shape)}" for name, shape in self.averages]
        return "\n".join(lines)


def _natural_key(name: str) -> list[Any]:
    """Keras numbers layers dense, dense_1, dense_2, ..., dense_10: sort them in creation order."""
    return [(int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", name)]


def _layer_and_leaf(name: str, sep: str) -> tuple[str, str]:
    layer, _, leaf = name.rpartition(sep)
    return layer, leaf


def suggest_var_map(
    path: str | os.PathLike[str],
    module: torch.nn.Module,
    *,
    verbose: bool = False,
    ema_name: str = "ExponentialMovingAverage",
) -> SuggestedVarMap:
    """Match a checkpoint's model variables to ``module``'s parameters and buffers: a ``var_map`` to review.

    Three passes, each over what the previous left:

    1. **name**: the names agree on the last two components (the layer and
       the variable; TF's ``kernel`` / ``embeddings`` / ``gamma`` read as
       ``weight``, ``beta`` as ``bias``, ``moving_mean`` / ``moving_variance``
       as ``running_mean`` / ``running_var``), longer agreement first;
    2. **shape**: a TF layer (``dense_1/kernel`` + ``dense_1/bias``) goes to
       the one torch module whose tensors of the same kinds (weight, bias, ...)
       all fit it: equal shapes, or shapes a layout reaches;
    3. **order**: TF layers that fit the same torch modules equally well go
       to them in order (TF's layer numbering, ``dense``, ``dense_1``, ...;
       the module's registration order), when there are as many of one as of
       the other.

    A layout is none, ``"transpose"`` for 2-D (Dense's [in, out] ->
    Linear's [out, in]), or ``[spatial..., in, out]`` -> ``[out, in,
    spatial...]`` for convolution kernels (Conv2D's HWIO -> OIHW). Optimizer
    slots and optimizer-wide variables are never suggested; variables that
    nothing fits are left out and reported. Moving averages (TF1's
    ``<name>/ExponentialMovingAverage``, with a zero-debiased one's ``biased``
    and ``local_step``) are never suggested either, nor counted as left out:
    they are listed in ``averages``, for ``load_tf_checkpoint``'s ``ema=``.

    Args:
        path: a checkpoint prefix, or a directory (its latest checkpoint).
        module: the torch model.
        verbose: print :meth:`SuggestedVarMap.report` (what matched, how, and what did not).
        ema_name: the ``name=`` of the TF graph's ``ExponentialMovingAverage``,
            the last component of its averages' names.

    Returns:
        A :class:`SuggestedVarMap`: the ``var_map`` itself, with the report.

    Raises:
        AmbiguousVarMapError: a variable fits several tensors equally well (or
            several variables one tensor); ``candidates`` lists them. Give those
            pairs yourself: build ``var_map`` from the rest of the suggestion.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(verbose, bool):
        raise TypeError(f"verbose must be a bool, got {type(verbose).__name__}: {verbose!r}")
    if not isinstance(ema_name, str):
        raise TypeError(f"ema_name must be a str, got {type(ema_name).__name__}: {ema_name!r}")
    if not ema_name or "/" in ema_name:
        raise ValueError(f"ema_name must be a TF name without '/', got {ema_name!r}")
    reader = BundleReader(_resolve_prefix(path))
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    model_variables, averages = _model_variables(reader, ema_name)

    def shape_of(tf_name: str) -> tuple[int, ...]:
        return tuple((reader.entries.get(tf_name) or reader.entries[tf_name + _ATTRIBUTE]).shape)

    shapes = {tf_name: shape_of(tf_name) for tf_name in model_variables}
    matches: dict[str, Match] = {}
    used: set[str] = set()
    ambiguous: dict[str, list[str]] = {}

    def take(tf_name: str, torch_name: str, layout: Any, how: str) -> None:
        matches[tf_name] = Match(
            tf_name,
            torch_name,
            None if layout == "none" else layout,
            how,
            tuple(shapes[tf_name]),
            tuple(tensors[torch_name].shape),
        )
        used.add(torch_name)

    # 1. By name. A tensor that is the best name match of two variables is refused for both.
    best_of: dict[str, list[tuple[str, Any]]] = {}
    for tf_name, shape in shapes.items():
        want = _torch_path(tf_name)
        best: list[tuple[str, Any]] = []
        best_score = 1
        for torch_name, tensor in tensors.items():
            have = torch_name.split(".")
            score = 0
            while score < min(len(want), len(have)) and want[-1 - score] == have[-1 - score]:
                score += 1
            layout = _layout(tf_name, shape, tensor) if score > 1 else None
            if layout is None or score < best_score:
                continue
            if score > best_score:
                best, best_score = [], score
            best.append((torch_name, layout))
        if best:
            best_of[tf_name] = best
    claimed: dict[str, list[str]] = {}
    for tf_name, best in best_of.items():
        for torch_name, _ in best:
            claimed.setdefault(torch_name, []).append(tf_name)
    for tf_name, best in best_of.items():
        if len(best) > 1:
            ambiguous[tf_name] = [name for name, _ in best]
        elif len(claimed[best[0][0]]) > 1:
            ambiguous[tf_name] = [
                f"{best[0][0]} (also the best match of "
                + ", ".join(n for n in claimed[best[0][0]] if n != tf_name)
                + ")"
            ]
        else:
            take(tf_name, *best[0], "name")

    # 2. and 3. By shape, then order, layer by layer.
    tf_layers: dict[str, dict[str, str]] = {}  # TF layer -> {torch leaf kind: TF name}
    for tf_name in shapes:
        if tf_name in matches or tf_name in ambiguous:
            continue
        layer, leaf = _layer_and_leaf(tf_name, "/")
        tf_layers.setdefault(layer, {})[_LEAVES.get(leaf, leaf)] = tf_name
    torch_modules: dict[str, dict[str, str]] = {}  # torch module -> {leaf: torch name}
    for torch_name in tensors:
        if torch_name not in used:
            prefix, leaf = _layer_and_leaf(torch_name, ".")
            torch_modules.setdefault(prefix, {})[leaf] = torch_name

    def fits(tf_layer: str, torch_module: str) -> dict[str, Any] | None:
        """{TF name: layout} when every variable of the TF layer fits the module's tensor of its kind."""
        variables, leaves = tf_layers[tf_layer], torch_modules[torch_module]
        if not set(variables) <= set(leaves):
            return None
        layouts = {}
        for kind, tf_name in variables.items():
            layout = _layout(tf_name, shapes[tf_name], tensors[leaves[kind]])
            if layout is None:
                return None
            layouts[tf_name] = layout
        return layouts

    def assign(layer: str, torch_module: str, how: str) -> None:
        for tf_name, layout in (fits(layer, torch_module) or {}).items():
            leaf = _layer_and_leaf(tf_name, "/")[1]
            take(tf_name, torch_modules[torch_module][_LEAVES.get(leaf, leaf)], layout, how)
        pending.remove(layer)
        free.remove(torch_module)

    # Each round: a layer that fits one free module alone takes it (by shape); failing that, a
    # closed group (n layers that fit the same n modules, which no other layer fits) pairs up
    # in order. Then the candidates are counted again, until nothing moves.
    module_order = list(torch_modules)
    pending, free = set(tf_layers), set(torch_modules)
    while True:
        candidates = {
            layer: [m for m in module_order if m in free and fits(layer, m) is not None] for layer in pending
        }
        groups: dict[tuple[str, ...], list[str]] = {}
        for layer, fitting in candidates.items():
            if fitting:
                groups.setdefault(tuple(fitting), []).append(layer)
        singles = [
            (layers[0], fitting[0]) for fitting, layers in groups.items() if len(fitting) == len(layers) == 1
        ]
        for layer, torch_module in singles:
            assign(layer, torch_module, "shape")
        if singles:
            continue
        closed = [
            (fitting, layers)
            for fitting, layers in groups.items()
            if len(fitting) == len(layers) > 1
            and not any(set(fitting) & set(candidates[other]) for other in pending if other not in layers)
        ]
        for fitting, layers in closed:
            for layer, torch_module in zip(sorted(layers, key=_natural_key), fitting, strict=True):
                assign(layer, torch_module, "order")
        if not closed:
            break
    for layer in pending:
        for kind, tf_name in tf_layers[layer].items():
            if candidates[layer]:
                ambiguous[tf_name] = [torch_modules[m][kind] for m in candidates[layer]]

    if ambiguous:
        lines = [
            f"  {tf_name} {list(shapes[tf_name])}: {', '.join(names)}"
            for tf_name, names in sorted(ambiguous.items())
        ]
        raise AmbiguousVarMapError(
            f"suggest_var_map: {len(ambiguous)} checkpoint variable(s) of {reader.prefix} fit several "
            "tensors of the module equally well (or share one); give these pairs in var_map yourself:\n"
            + "\n".join(lines),
            {k: list(v) for k, v in sorted(ambiguous.items())},
        )
    suggestion = SuggestedVarMap()
    ordered = [matches[n] for n in shapes if n in matches]
    for m in ordered:
        suggestion[m.tf_name] = (
            tensors[m.torch_name] if m.layout is None else (tensors[m.torch_name], m.layout)
        )
    suggestion.matches = ordered
    suggestion.unmatched_checkpoint = [(n, tuple(s)) for n, s in shapes.items() if n not in matches]
    suggestion.unmatched_module = [(n, tuple(t.shape)) for n, t in tensors.items() if n not in used]
    suggestion.averages = [(n, shape_of(n)) for n in averages]
    if verbose:
        print(suggestion.report())
    return suggestion
