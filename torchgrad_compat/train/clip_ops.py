"""TensorFlow's gradient clipping (``tf.clip_by_global_norm`` and friends) with TF's arithmetic.

``torch.nn.utils.clip_grad_norm_`` computes another number: per-tensor norms,
then a norm of those, a ``1e-6`` added to the divisor, and non-finite norms
left to an option. TensorFlow's rule, reproduced here op by op:

- ``global_norm(ts) = sqrt(2 * sum_i l2_loss(t_i))`` with ``l2_loss(t) = sum(t * t) / 2``;
- ``clip_by_global_norm`` scales every tensor by
  ``clip_norm * min(1 / global_norm, 1 / clip_norm)`` plus ``(global_norm - global_norm)``,
  which is 0 for a finite norm and NaN otherwise: when the global norm is inf
  or NaN, **every** clipped tensor becomes NaN (a loss scale's skip relies on
  it);
- ``clip_by_norm(t, c) = t * c / max(norm(t), c)`` with the norm over ``axes``
  (0 stays 0);
- ``clip_by_value(t, lo, hi) = max(min(t, hi), lo)``, NaN kept.

A sparse COO tensor plays TF's ``IndexedSlices``: its values are clipped (and
counted in a norm) as they are, duplicate indices uncoalesced, as TF counts the
rows of an ``IndexedSlices``; its indices are kept. ``None`` entries stay
``None``. Elementwise each result is TF's to the bit given the same norm, and a
norm over whole tensors is TF's to the bit: :func:`sum_of_squares` adds in the
order of TF's CPU kernels (Eigen's, on one thread), and square roots are
correctly rounded, as TF's. A norm over some ``axes`` of :func:`clip_by_norm`
adds in torch's order (1 ulp off TF's for some values, measured in
``docs/train.md``). A ``DTensor`` counts every rank's shard: each shard's sum
of squares in Eigen's order, those sums all-reduced (within a few ulps of TF's
sum over the whole tensor, not its bits).

Differences from TensorFlow: subnormal numbers are kept (TF's kernels flush
them to zero: its global norm of ``[3e-20, 4e-20]`` in float32 is 0, here
5e-20); a negative, NaN or infinite ``clip_norm`` is refused with a
``ValueError`` (TF clamps a negative one to 0 in ``clip_by_norm`` and computes
with the others); ``name`` is accepted and unused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._torch_internals import sparse_indices, sparse_values
from ..optim.wrapper import check_range, sqrt
from ._eigen_sum import PACKET, eigen_sum_short, eigen_sums


def global_norm(t_list: Sequence[Tensor | None], name: str | None = None) -> Tensor:
    """``sqrt(sum(t * t))`` over every tensor of ``t_list``, as TF's ``global_norm``.

    Computed as TF does: each tensor's ``l2_loss`` (half its sum of squares), their
    sum, times 2, the square root. ``None`` entries are skipped; a sparse tensor
    counts its values.

    Raises:
        TypeError: ``t_list`` is not a sequence of tensors (or None), or mixes dtypes.
        ValueError: ``t_list`` holds no tensor.
    """
    return _global_norm(_values_of(t_list), t_list)


def _global_norm(entries: list[Tensor | None], t_list: Sequence[Tensor | None]) -> Tensor:
    """:func:`global_norm` of ``t_list``, whose entries' values are ``entries`` (None skipped)."""
    values = [v for v in entries if v is not None]
    if not values:
        raise ValueError("Invalid t_list value: it holds no tensor (only None entries, or none at all)")
    dtypes = {v.dtype for v in values}
    if len(dtypes) > 1:
        raise TypeError(
            f"t_list must hold tensors of one dtype, as TF's global_norm stacks them: got {dtypes}"
        )
    # TF's l2_loss of each tensor, then reduce_sum of the stacked halves: Eigen's order again.
    sums = _summed_over_shards(_sums_of_squares(values), t_list)
    if _on_host(sums):
        # The same operations in numpy, a few microseconds less each than torch's on tiny tensors.
        with np.errstate(all="ignore"):  # inf and NaN as IEEE arithmetic makes them
            total = eigen_sum_short(sums.numpy() * 0.5)
            if total is not None:
                norm = np.empty((), total.dtype)
                np.sqrt(total * 2.0, out=norm)
                return torch.from_numpy(norm)
    return sqrt(_eigen_sum(sums * 0.5) * 2.0)


def clip_by_global_norm(
    t_list: Sequence[Tensor | None],
    clip_norm: float | Tensor,
    use_norm: float | Tensor | None = None,
    name: str | None = None,
) -> tuple[list[Tensor | None], Tensor]:
    """Scale every tensor so that their global norm is at most ``clip_norm``, as TF's.

    Returns ``(clipped, global_norm)``. With ``n = use_norm`` (default
    :func:`global_norm` of ``t_list``), each tensor is multiplied by::

        clip_norm * min(1 / n, 1 / clip_norm) + (n - n)

    in ``n``'s dtype: unchanged up to rounding below the threshold, NaN for all
    when ``n`` is inf or NaN. ``None`` entries stay ``None``; a sparse tensor
    keeps its indices. The results are new tensors: :func:`clip_by_global_norm_`
    clips ``p.grad`` in place.

    Args:
        t_list: tensors (dense or sparse COO) or None.
        clip_norm: ≥ 0 and finite (0 clips everything to 0).
        use_norm: the global norm to use, if already computed.

    Raises:
        ValueError: ``clip_norm`` negative or not finite; ``t_list`` without a tensor.
        TypeError: ``t_list`` not a sequence of tensors.
    """
    values = _values_of(t_list)
    _check_clip_norm(clip_norm)
    norm = _global_norm(values, t_list) if use_norm is None else _norm_tensor(use_norm, values)
    clipped = _scale_all(values, _scale(norm, clip_norm), in_place=False)
    return [_like(t, c) for t, c in zip(t_list, clipped, strict=True)], norm


def clip_by_global_norm_(
    parameters: Tensor | Iterable[Tensor], clip_norm: float | Tensor, use_norm: float | Tensor | None = None
) -> Tensor:
    """:func:`clip_by_global_norm` of the parameters' ``.grad``, in place; returns the global norm.

    For a torch training loop, between ``backward()`` and ``step()`` (as
    ``torch.nn.utils.clip_grad_norm_``): parameters without a gradient are
    skipped, a sparse gradient's values are scaled where they are, a DTensor's
    local shard is scaled (its norm counts every rank's shards). Clip the
    unscaled gradients: with a ``LossScaleOptimizer``, after ``opt.unscale_()``
    and before ``opt.step()``; a non-finite norm turns every gradient into NaN,
    and a step with a non-finite gradient stays skipped. With a
    ``CrossShardOptimizer``, ``p.grad`` holds the cross-replica sum once
    ``backward()`` returns: every replica clips the same sum.

    Raises:
        ValueError: ``clip_norm`` negative or not finite; no parameter has a gradient.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [g for p in params if (g := p.grad) is not None]
    _check_clip_norm(clip_norm)
    if not grads:
        raise ValueError("Invalid parameters value: no parameter has a gradient to clip")
    values = _values_of(grads)
    norm = _global_norm(values, grads) if use_norm is None else _norm_tensor(use_norm, values)
    with torch.no_grad():
        _scale_all(values, _scale(norm, clip_norm), in_place=True)
    return norm


def clip_by_norm(
    t: Tensor, clip_norm: float | Tensor, axes: int | Sequence[int] | None = None, name: str | None = None
) -> Tensor:
    """``t * clip_norm / max(norm(t), clip_norm)``, the norm over ``axes`` (all by default), as TF's.

    The norm is ``sqrt(sum(t * t))`` over ``axes``, kept as 0 where that sum is
    0 (so an all-zero slice stays 0, without a division by 0). A sparse tensor's
    values are clipped as a whole (TF's ``IndexedSlices``), its indices kept.

    Raises:
        ValueError: ``clip_norm`` negative or not finite.
    """
    values = _value_of("t", t)
    _check_clip_norm(clip_norm)
    if axes is None:
        l2sum = sum_of_squares(values).reshape([1] * values.dim())
    else:
        # A partial reduction: torch's order of addition, not Eigen's (the last bits may differ).
        dims = [axes] if isinstance(axes, int) else list(axes)
        l2sum = (values * values).sum(dim=dims, keepdim=True)
    positive = l2sum > 0
    l2norm = torch.where(positive, sqrt(torch.where(positive, l2sum, torch.ones_like(l2sum))), l2sum)
    c = _as_tensor(clip_norm, values)
    return _like(t, values * c / torch.maximum(l2norm, c))


def clip_by_value(
    t: Tensor, clip_value_min: float | Tensor, clip_value_max: float | Tensor, name: str | None = None
) -> Tensor:
    """``max(min(t, clip_value_max), clip_value_min)``, as TF's: NaN stays NaN.

    The bounds (numbers or tensors that broadcast to ``t``) are taken in ``t``'s
    dtype. A sparse tensor's values are clipped, its indices kept.

    Raises:
        ValueError: number bounds that are NaN or in the wrong order.
    """
    values = _value_of("t", t)
    low, high = clip_value_min, clip_value_max
    if not isinstance(low, Tensor) and not isinstance(high, Tensor) and not low <= high:
        raise ValueError(
            f"Invalid clip_value_min value: {low!r}; expected a number <= clip_value_max ({high!r})"
        )
    clipped = torch.maximum(torch.minimum(values, _as_tensor(high, values)), _as_tensor(low, values))
    return _like(t, clipped)


def _values_of(t_list: Any) -> list[Tensor | None]:
    """The dense values of each entry of a sequence (see :func:`_value_of`), None kept."""
    if isinstance(t_list, (str, Tensor)) or not isinstance(t_list, Sequence):
        raise TypeError(f"t_list must be a sequence of tensors, got {type(t_list).__name__}")
    values: list[Tensor | None] = []
    for i, t in enumerate(t_list):
        if t is None or (type(t) is Tensor and t.layout == torch.strided and t.is_floating_point()):
            values.append(t)  # the usual entries, without building a name for an error
        else:
            values.append(_value_of(f"t_list[{i}]", t))
    return values


def _value_of(arg: str, t: Any) -> Tensor:
    """A dense tensor itself; a sparse COO tensor's values as stored; a DTensor's local shard."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{arg} must be a floating tensor, got {_describe(t)}")
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(t, dtensor):
        if any(p.is_partial() for p in t.placements):
            raise ValueError(
                f"Invalid {arg} value: a DTensor with placements {t.placements}; its local tensors "
                "are partial sums: redistribute it to Shard or Replicate placements first"
            )
        return _value_of(arg, t.to_local())
    if t.layout == torch.sparse_coo:
        # The rows as given (uncoalesced): TF counts an IndexedSlices' duplicate rows apart.
        return sparse_values(t)
    if t.layout != torch.strided:
        raise TypeError(f"{arg} must be dense or sparse COO, got layout {t.layout}")
    return t


def _like(t: Tensor | None, values: Tensor | None) -> Tensor | None:
    """``values`` in ``t``'s form: a sparse COO tensor gets ``t``'s indices back, a DTensor its
    mesh and placements."""
    if t is None or values is None:
        return values
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(t, dtensor):
        local = _like(t.to_local(), values)
        return dtensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    if t.layout != torch.sparse_coo:
        return values
    return torch.sparse_coo_tensor(sparse_indices(t), values, t.shape, is_coalesced=t.is_coalesced())


def sum_of_squares(t: Tensor) -> Tensor:
    """``sum(t * t)`` over all of ``t`` in the order TF's CPU kernels (Eigen, one thread) add.

    Eigen's full reduction: ranges longer than 1024 packets split in halves at a
    packet boundary, summed apart, then added; a shorter range summed in four
    packet-wide accumulators over blocks of four packets (then folded into the
    first), then packet by packet, the tail element by element, and the tail's
    sum plus the accumulator's lanes (added as a tree). The same additions here,
    on ``t``'s device: TF's bits for float32 and float64 (other dtypes: torch's
    order). TF on several threads sums a large tensor in shards, whose order
    depends on the thread count: then the last bits may differ.
    """
    return _sums_of_squares([t])[0]


def _sums_of_squares(values: list[Tensor]) -> Tensor:
    """:func:`sum_of_squares` of each of ``values`` (one dtype), as a 1-d tensor on the first's
    device; differentiable."""
    if values[0].dtype not in PACKET:
        return torch.stack([(v * v).sum().to(values[0].device) for v in values])
    return _eigen_sums(values, square=True)


def _eigen_sum(x: Tensor) -> Tensor:
    """Eigen's sum of the 1-d ``x`` (torch's order for a dtype Eigen's order is not known for)."""
    return _eigen_sums([x], square=False)[0] if x.dtype in PACKET else x.sum()


def _eigen_sums(values: list[Tensor], *, square: bool) -> Tensor:
    """:func:`eigen_sums`, differentiable, the tensors of each device summed together and the sums
    gathered on the first's device."""
    if torch.is_grad_enabled() and any(v.requires_grad for v in values):
        return _EigenSums.apply(square, *values)
    device = _common_device(values)
    if device is not None:
        return eigen_sums(values, square=square)
    groups: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(v.device, []).append(i)
    sums = values[0].new_empty(len(values))
    for members in groups.values():
        sums[members] = eigen_sums([values[i] for i in members], square=square).to(device)
    return sums


class _EigenSums(torch.autograd.Function):
    """Eigen's sums (computed without autograd) with their gradient: 1, or ``2 t`` for squares."""

    @staticmethod
    def forward(ctx: Any, square: bool, *values: Tensor) -> Tensor:
        ctx.square = square
        ctx.save_for_backward(*values)
        return _eigen_sums(list(values), square=square)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grads = [grad[i].to(v.device) for i, v in enumerate(ctx.saved_tensors)]
        if ctx.square:
            return (None, *(2 * g * v for g, v in zip(grads, ctx.saved_tensors, strict=True)))
        return (None, *(g.expand_as(v) for g, v in zip(grads, ctx.saved_tensors, strict=True)))


def _scale_all(values: list[Tensor | None], scale: Tensor, *, in_place: bool) -> list[Tensor | None]:
    """Every tensor of ``values`` times ``scale`` (one multiplication each, TF's), one
    ``torch._foreach_mul`` per device; in place, or new tensors. None stays None."""
    present = [i for i, v in enumerate(values) if v is not None]
    device = _common_device([values[i] for i in present])
    groups: dict[torch.device, list[int]] = {}
    if device is not None:
        groups[device] = present
    else:
        for i in present:
            groups.setdefault(values[i].device, []).append(i)
    out: list[Tensor | None] = list(values)
    for device, members in groups.items():
        tensors = [values[i] for i in members]
        factor = scale.to(device=device, dtype=tensors[0].dtype)
        if in_place:
            torch._foreach_mul_(tensors, factor)
        elif torch.is_grad_enabled() and (factor.requires_grad or any(t.requires_grad for t in tensors)):
            for i, t in zip(members, tensors, strict=True):  # foreach ops lack this derivative
                out[i] = t * factor
        else:
            for i, product in zip(members, torch._foreach_mul(tensors, factor), strict=True):
                out[i] = product
    return out


def _common_device(tensors: list[Tensor]) -> torch.device | None:
    """The device of all ``tensors``, or None when they are on several (or there are none)."""
    if not tensors:
        return None
    device = tensors[0].device
    if device.type == "cpu":  # a flag per tensor: cheaper than comparing devices, for long lists
        return device if all([t.is_cpu for t in tensors]) else None
    return device if all([t.device == device for t in tensors]) else None


def _dtensor_class() -> type | None:
    """torch's DTensor class, or None while ``torch.distributed.tensor`` is not imported (then no
    DTensor exists, and the import, which is slow, is not made for nothing)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _summed_over_shards(sums: Tensor, t_list: Sequence[Tensor | None]) -> Tensor:
    """Each DTensor's sum over all its shards (``sums`` has one per tensor of ``t_list``, None
    skipped): its local sum all-reduced over the process group of each mesh dimension it is
    sharded along (replicated dimensions hold the same values already)."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return sums
    tensors = [t for t in t_list if t is not None]
    by_groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, dtensor):
            mesh = t.device_mesh
            groups = tuple(mesh.get_group(d) for d, p in enumerate(t.placements) if p.is_shard())
            if groups:
                by_groups.setdefault(groups, []).append(i)
    if not by_groups:
        return sums
    sums = sums.clone()
    for groups, members in by_groups.items():
        part = sums[members]
        for group in groups:
            torch.distributed.all_reduce(part, group=group)
        sums[members] = part
    return sums


def _scale(norm: Tensor, clip_norm: float | Tensor) -> Tensor:
    """TF's ``clip_norm * min(1 / n, 1 / clip_norm) + (n - n)`` in ``n``'s dtype, on its device."""
    if not isinstance(clip_norm, Tensor) and _on_host(norm):
        n = norm.numpy()  # the same operations in numpy (see _global_norm)
        c = n.dtype.type(clip_norm)
        scale = np.empty((), n.dtype)
        with np.errstate(all="ignore"):
            np.add(c * np.minimum(1.0 / n, 1.0 / c), n - n, out=scale)
        return torch.from_numpy(scale)
    c = _as_tensor(clip_norm, norm)
    return c * torch.minimum(1.0 / norm, 1.0 / c) + (norm - norm)


def _on_host(t: Tensor) -> bool:
    """Whether ``t`` is a plain float32 or float64 CPU tensor that numpy may compute with in
    torch's place: autograd is not to record an operation on it, and no ``torch.compile`` traces."""
    return (
        type(t) is Tensor
        and t.dtype in PACKET
        and t.device.type == "cpu"
        and not (t.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
    )


def _as_tensor(value: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def _norm_tensor(use_norm: float | Tensor, values: list[Tensor | None]) -> Tensor:
    """A given ``use_norm`` as a 0-d tensor (a number in the dtype of the tensors)."""
    if isinstance(use_norm, Tensor):
        if use_norm.dim() != 0 or not use_norm.is_floating_point():
            raise TypeError(f"use_norm must be a 0-d floating tensor or a number, got {_describe(use_norm)}")
        return use_norm
    if isinstance(use_norm, bool) or not isinstance(use_norm, (int, float)):
        raise TypeError(f"use_norm must be a 0-d floating tensor or a number, got {_describe(use_norm)}")
    like = next((v for v in values if v is not None), None)
    if like is None:
        raise ValueError("Invalid t_list value: it holds no tensor (only None entries, or none at all)")
    return _as_tensor(use_norm, like)


def _check_clip_norm(clip_norm: Any) -> None:
    if isinstance(clip_norm, Tensor):
        if clip_norm.dim() != 0 or not clip_norm.is_floating_point():
            raise TypeError(
                f"clip_norm must be a number or a 0-d floating tensor, got {_describe(clip_norm)}"
            )
        if clip_norm.device.type != "cpu":
            return  # read on the host only where that costs no device synchronisation
        value = float(clip_norm)
    elif isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
        raise TypeError(f"clip_norm must be a number or a 0-d floating tensor, got {_describe(clip_norm)}")
    else:
        value = clip_norm
    check_range("clip_norm", value, 0.0)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dim()}-d {value.dtype} tensor ({value.layout})"
    return f"{type(value).__name__}: {value!r}"
