"""A first draft of ``var_map``: a checkpoint's model variables matched to a module's tensors by name."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from ._bundle import BundleReader
from ._tf_checkpoint import _ATTRIBUTE, _OBJECT_GRAPH, _resolve_prefix

__all__ = ["suggest_var_map"]

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


def _model_variables(reader: BundleReader) -> list[str]:
    """The checkpoint's names that are model variables, not slots or optimizer-wide state."""
    names = [n for n in reader.entries if n != _OBJECT_GRAPH and reader.entries[n].torch_dtype is not None]
    plain = {n.removesuffix(_ATTRIBUTE) for n in names}
    out = []
    for name in names:
        path = name.removesuffix(_ATTRIBUTE)
        parts = path.split("/")
        if "/.OPTIMIZER_SLOT/" in name or parts[-1] in _NOT_MODEL:
            continue
        # A name-based slot is its variable's name plus "/<optimizer name>[_i]".
        if any("/".join(parts[:i]) in plain for i in range(1, len(parts))):
            continue
        out.append(path)
    return sorted(out)


def _torch_path(tf_name: str) -> list[str]:
    parts = tf_name.split("/")
    return [*parts[:-1], _LEAVES.get(parts[-1], parts[-1])]


def _layout(tf_shape: tuple[int, ...], tensor: Tensor) -> Any:
    """The layout that takes TF's shape to the tensor's, "none" when already equal, or None when none does."""
    if tf_shape == tuple(tensor.shape):
        return "none"
    for layout in _LAYOUTS.get(len(tf_shape), ()):
        perm = (1, 0) if layout == "transpose" else layout
        if tuple(tf_shape[d] for d in perm) == tuple(tensor.shape):
            return layout
    return None


def suggest_var_map(path: str | os.PathLike[str], module: torch.nn.Module) -> dict[str, Any]:
    """Match a checkpoint's model variables to ``module``'s parameters and buffers: a ``var_map`` to review.

    A TF variable matches a torch tensor when their names agree on the last
    two components (the layer and the variable, TF's ``kernel`` / ``embeddings``
    / ``gamma`` read as ``weight``, ``beta`` as ``bias``, ``moving_mean`` /
    ``moving_variance`` as ``running_mean`` / ``running_var``) and a layout
    takes TF's shape to the tensor's (none, ``"transpose"`` for 2-D, or
    ``[spatial..., in, out]`` -> ``[out, in, spatial...]`` for convolution
    kernels). Longer agreement wins; a tie, or no match, leaves the variable
    out. Optimizer slots and optimizer-wide variables are never suggested.
    Check the result (``list_tf_checkpoint`` shows what is left) before loading.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    reader = BundleReader(_resolve_prefix(path))
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    suggested: dict[str, Any] = {}
    used: set[int] = set()
    for tf_name in _model_variables(reader):
        entry = reader.entries.get(tf_name) or reader.entries[tf_name + _ATTRIBUTE]
        want = _torch_path(tf_name)
        best: list[tuple[str, Tensor, Any]] = []
        best_score = 1
        for torch_name, tensor in tensors.items():
            have = torch_name.split(".")
            score = 0
            while score < min(len(want), len(have)) and want[-1 - score] == have[-1 - score]:
                score += 1
            layout = _layout(entry.shape, tensor) if score > 1 and id(tensor) not in used else None
            if layout is None or score < best_score:
                continue
            if score > best_score:
                best, best_score = [], score
            best.append((torch_name, tensor, layout))
        if len(best) == 1:
            _, tensor, layout = best[0]
            used.add(id(tensor))
            suggested[tf_name] = tensor if layout == "none" else (tensor, layout)
    return suggested
