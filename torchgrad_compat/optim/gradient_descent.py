"""``tf.compat.v1.train.GradientDescentOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Hyper
from .optimizer import Optimizer, Params

__all__ = ["GradientDescentOptimizer", "gradient_descent"]


class GradientDescentOptimizer(Optimizer):
    r"""Plain gradient descent, as TensorFlow's ``GradientDescentOptimizer``.

    With :math:`\eta` = ``learning_rate``:

    .. math::
        \theta \leftarrow \theta - g\,\eta

    Slots: none.

    Sparse gradients: TensorFlow does *not* sum duplicate indices first; it
    scatter-adds ``-g * lr`` row by row, so a row named twice is updated twice
    in sequence, ``(θ - g₁η) - g₂η``. This optimizer does the same.

    Differences from ``torch.optim.SGD`` (without momentum): the product is
    ``g * lr`` with ``lr`` rounded to float32 and then to the parameter dtype
    (``torch.optim.SGD`` adds ``-lr * g`` with ``lr`` in double); the results
    agree up to rounding. ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts, as for any torch optimizer.
        learning_rate: step size, ``>= 0``; a number, a 0-d tensor or a callable.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: ``learning_rate`` is negative, NaN or infinite.
        TypeError: ``learning_rate`` is not a number, 0-d tensor or callable.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        >>> opt = GradientDescentOptimizer([w], learning_rate=0.5)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([0., 0.])
    """

    tf_slot_order: ClassVar[tuple[str, ...]] = ()
    _hypers = (Hyper("lr", "learning_rate", 0.0),)
    _coalesce_sparse = False

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        super().__init__(params, {"lr": learning_rate, "foreach": foreach, "fused": fused})

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        gradient_descent(
            params,
            grads,
            lr=hyper.lr,
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_gradient_descent(p, indices, values, lr=hyper.lr)


def _single_tensor_gradient_descent(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    lr: Tensor,
) -> None:
    for p, g in zip(params, grads, strict=True):
        p.sub_(g * lr)  # θ = θ - g·η


def _multi_tensor_gradient_descent(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    lr: Tensor,
    scratch: list[list[Tensor]],
) -> None:
    # Three passes where torch.optim.SGD needs one: its add_(g, alpha=-lr) is a
    # fused multiply-add, which does not round g·η before the subtraction as TF
    # does. The product goes into the scratch list (copy_ + in-place, no allocation).
    (step,) = scratch
    torch._foreach_copy_(step, grads)
    torch._foreach_mul_(step, lr)
    torch._foreach_sub_(params, step)


gradient_descent = functional(
    _single_tensor_gradient_descent,
    _multi_tensor_gradient_descent,
    scratch=1,
    doc="""Functional form of :class:`GradientDescentOptimizer`'s dense update.""",
)


def _sparse_gradient_descent(p: Tensor, indices: Tensor, values: Tensor, *, lr: Tensor) -> None:
    # TF's resource path: scatter_add(θ, indices, (-g)·η), duplicates in order.
    p.index_add_(0, indices, values.neg() * lr)
