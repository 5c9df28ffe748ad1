"""Checks of gradients, parameters and counters that every update path makes before it writes.

Each raises an error that names the variable and what is wrong, before anything changes.
DTensor parameters (FSDP2, tensor parallelism) are checked and reduced to their local shards here.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .._torch_internals import sparse_rows

_FUSED_DEVICES = ("cpu", "cuda")


def _check_dtensor_grad(cls: str, g: Tensor, p: Tensor) -> None:
    """A DTensor parameter's gradient must be a dense DTensor laid out as it (see ``_local_shards``)."""
    if g.is_sparse:
        raise ValueError(
            f"{cls}: sparse gradients of DTensor parameters are not supported (variable {describe(p)}); "
            "FSDP2 and tensor parallelism produce dense gradients"
        )
    if (
        not isinstance(p, DTensor)
        or not isinstance(g, DTensor)
        or g.placements != p.placements
        or g.device_mesh != p.device_mesh
    ):

        def layout(t: Tensor) -> str:
            return (
                f"placements {t.placements} on {t.device_mesh}"
                if isinstance(t, DTensor)
                else "a plain tensor"
            )

        raise ValueError(
            f"{cls}: the gradient of {describe(p)} ({layout(p)}) must be laid out as its variable, with the "
            f"same placements and mesh; got {layout(g)}"
        )


def _local_shards(
    params: list[Tensor], grads: list[Tensor], slots: list[dict[str, Tensor]]
) -> tuple[list[Tensor], list[Tensor], list[dict[str, Tensor]]]:
    """The local shards of DTensor parameters, gradients and slots; plain tensors as given.

    Every update rule of this package is elementwise, so a rank updating its
    own shard computes exactly what the unsharded update computes for those
    elements, with no communication. That needs the gradient laid out as the
    parameter (FSDP2's reduce-scattered ``Shard(0)`` gradients are); a
    ``Partial`` gradient (not yet reduced) or another layout is refused
    before anything changes (``_check_dtensor_grad``). The
    slots were made by ``*_like(param)`` and are sharded as the parameter.
    Working on the local tensors also keeps the foreach path's scratch buffers
    (plain tensors, see ``Optimizer._scratch``) and 0-d hyperparameter tensors
    out of DTensor's dispatch, which refuses to mix them.
    """
    if not any(isinstance(p, DTensor) for p in params):
        return params, grads, slots
    local_params = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    local_slots = [{k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()} for s in slots]
    return local_params, local_grads, local_slots


DTYPE_OF = operator.attrgetter("dtype")

GRAD_OF = operator.attrgetter("grad")

_SHAPE_OF = operator.attrgetter("shape")

DEVICE_OF = operator.attrgetter("device")

_LAYOUT_OF = operator.attrgetter("layout")

_SECOND = operator.itemgetter(1)


def _check_fused_devices(cls: str, params: list[Any]) -> None:
    for p in params:
        if isinstance(p, Tensor) and p.device.type not in _FUSED_DEVICES:
            raise RuntimeError(
                f"{cls}: `fused=True` requires parameters on {' or '.join(_FUSED_DEVICES)} "
                f"(the devices torch.compile generates kernels for), got one on {p.device}"
            )


def _shared_kind(
    grads: list[Tensor],
    params: list[Tensor],
    checked: bool = False,
    param_shapes: list[torch.Size] | None = None,
) -> tuple[torch.device, torch.dtype] | None:
    """The one device and dtype of every parameter and gradient, when every gradient is dense and
    strided with its parameter's shape and none of them is a DTensor; else None.

    ``checked``: each gradient is known to fit its parameter (shape, dtype, device), so only the
    parameters' devices and dtypes are read. ``param_shapes``: the parameters' shapes, where the
    caller has read them. Read by ``map`` over whole lists, attribute by
    attribute: in the usual case it replaces both :func:`grads_fit` and a second reading
    of the devices and dtypes to group the update by them.
    """
    # (First what a group of several dtypes or devices fails at, before the costlier reads.)
    dtypes = set(map(DTYPE_OF, params))
    if len(dtypes) != 1 or len(devices := set(map(DEVICE_OF, params))) != 1:
        return None
    if set(map(_LAYOUT_OF, grads)) != {torch.strided}:
        return None
    if any(issubclass(t, DTensor) for t in {*map(type, params), *map(type, grads)}):
        return None
    if not checked and list(map(_SHAPE_OF, grads)) != (
        list(map(_SHAPE_OF, params)) if param_shapes is None else param_shapes
    ):
        return None
    if not checked and (set(map(DEVICE_OF, grads)) != devices or set(map(DTYPE_OF, grads)) != dtypes):
        return None
    return devices.pop(), dtypes.pop()


def grads_fit(grads: list[Tensor], params: list[Tensor]) -> bool:
    """Whether every gradient is dense and strided, with its parameter's shape, dtype and device,
    pair by pair: where :func:`_shared_kind` finds no one kind (parameters of several devices or
    dtypes in one group), or where it is not needed; ``check_grad`` then names what is wrong."""
    strided = torch.strided
    return all(
        g.layout == strided and g.shape == p.shape and g.dtype == p.dtype and g.device == p.device
        for g, p in zip(grads, params, strict=True)
    )


def check_grad(cls: str, g: Any, p: Tensor) -> None:
    if not isinstance(g, Tensor):
        raise TypeError(
            f"Gradient must be a Tensor or None, got {type(g).__name__} for variable {describe(p)}"
        )
    if g.shape != p.shape:
        raise ValueError(
            f"{cls}: gradient shape {tuple(g.shape)} does not match variable shape {tuple(p.shape)}"
        )
    if g.dtype != p.dtype:
        raise TypeError(f"{cls}: gradient dtype {g.dtype} does not match variable dtype {p.dtype}")
    if g.device != p.device:
        raise ValueError(f"{cls}: gradient on {g.device} but variable on {p.device}")
    if g.is_sparse:
        if g.sparse_dim() != 1:
            raise ValueError(
                f"{cls}: sparse gradients must be row-sparse (sparse_dim 1, as from "
                f"nn.Embedding(sparse=True) or TF's IndexedSlices), got sparse_dim {g.sparse_dim()}"
            )
        _check_rows(cls, g, p)
    elif g.layout != torch.strided:
        raise ValueError(f"{cls}: gradient layout {g.layout} is not supported (strided or sparse COO)")


def _check_rows(cls: str, g: Tensor, p: Tensor) -> None:
    """Refuse a sparse gradient whose row indices fall outside ``p``.

    torch builds sparse tensors without checking their indices
    (``check_invariants=False``), and an index past the end fails only inside
    the update, after other parameters were changed. Reading the bounds is one
    host synchronisation per sparse gradient; the sparse path already pays one
    to coalesce. A gradient marked coalesced must also have its rows sorted and unique:
    ``coalesce()`` trusts the mark, and duplicate rows would then be updated as if
    each came alone (one pass over the indices, in the same read).
    """
    rows = sparse_rows(g)
    if rows.numel() == 0:
        return
    checks = [*torch.aminmax(rows)]
    if g.is_coalesced():
        checks.append((rows[1:] <= rows[:-1]).any().to(rows.dtype))
    low, high, *unsorted = (int(x) for x in torch.stack(checks).tolist())
    if low < 0 or high >= p.shape[0]:
        bad = low if low < 0 else high
        raise ValueError(
            f"{cls}: sparse gradient row index {bad} is out of range for variable {describe(p)} "
            f"(valid rows: 0 to {p.shape[0] - 1})"
        )
    if any(unsorted):
        raise ValueError(
            f"{cls}: sparse gradient for variable {describe(p)} is marked coalesced, but its row "
            "indices are not sorted and unique; build it without is_coalesced=True (or call "
            "coalesce() on an unmarked one)"
        )


# int32 and int64, as TF's global_step; narrower integers wrap within a training run (uint8 at 256 steps).
_GLOBAL_STEP_DTYPES = (torch.int32, torch.int64)


def check_global_step(global_step: Any) -> None:
    """A global step a step can count with: a 0-d int32/int64 tensor, incrementable in place, below
    its dtype's largest value (on the CPU, where it is read without a device synchronisation)."""
    if not isinstance(global_step, Tensor) or global_step.dim() != 0 or global_step.dtype.is_floating_point:
        raise TypeError(f"global_step must be a 0-d integer tensor, got {describe(global_step)}")
    if global_step.dtype not in _GLOBAL_STEP_DTYPES:
        raise TypeError(
            "global_step must be a 0-d int32 or int64 tensor (as TensorFlow's), got "
            f"{describe(global_step)}; a narrower integer wraps around during training"
        )
    if global_step.is_meta:
        raise ValueError(f"Invalid global_step value: {describe(global_step)}; a meta tensor holds no count")
    if global_step.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"Invalid global_step value: {describe(global_step)} is an inference tensor (made under "
            "torch.inference_mode()), which cannot be incremented in place outside inference mode"
        )
    if global_step.device.type == "cpu":
        # Read where that costs no device synchronisation (an accelerator's count is not read).
        largest = torch.iinfo(global_step.dtype).max
        if int(global_step) >= largest:
            raise ValueError(
                f"Invalid global_step value: {int(global_step)} is the largest {global_step.dtype}; "
                f"the step would wrap it around to {torch.iinfo(global_step.dtype).min}"
            )


def describe(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
    return f"{type(v).__name__}: {v!r}"


_UNSCALABLE_DTYPES = (torch.float32, torch.float64)


def check_unscalable(
    cls: str,
    kinds: dict[int, tuple[torch.device, torch.dtype] | None],
    lists: dict[int, tuple[list[Tensor], list[Tensor]]],
) -> None:
    """Refuse ``step(unscaling=...)`` where a gradient would be left scaled or unscaled twice: the
    fused kernels unscale dense float32/float64 CPU gradients only (a sparse gradient's rule, a
    half-precision working copy, a DTensor shard would keep the scale), each once per kernel."""
    for gi in lists:
        kind = kinds.get(gi)
        if kind is None or kind[0].type != "cpu" or kind[1] not in _UNSCALABLE_DTYPES:
            raise ValueError(
                f"{cls}.step(unscaling=...): the gradients of param group {gi} must be dense, of one "
                f"dtype, float32 or float64, on the CPU (found {kind or 'several kinds or sparse ones'});"
                " unscale them before step() instead"
            )
    grads = [g for _, group_grads in lists.values() for g in group_grads]
    if len(set(map(id, grads))) != len(grads):
        raise ValueError(
            f"{cls}.step(unscaling=...): one gradient tensor is the gradient of two parameters and "
            "would be unscaled twice; unscale it before step() instead"
        )
