"""``tf.compat.v1.train.ProximalGradientDescentOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Hyper, HyperScalars
from ._numerics import one_element_rows
from .optimizer import Optimizer, Params

__all__ = ["ProximalGradientDescentOptimizer", "proximal_gradient_descent"]


class ProximalGradientDescentOptimizer(Optimizer):
    r"""Proximal gradient descent (FOBOS), exactly as TensorFlow v1's ``ProximalGradientDescentOptimizer``.

    With :math:`\eta` = ``learning_rate``, :math:`\lambda_1` =
    ``l1_regularization_strength`` and :math:`\lambda_2` =
    ``l2_regularization_strength``:

    .. math::
        \theta' &= \theta - g\eta \\
        \theta &\leftarrow \operatorname{sign}(\theta')\max(|\theta'| - \eta\lambda_1, 0)
            \,/\, (1 + \lambda_2\eta)

    L1 shrinks towards zero (exactly zero inside the dead zone) and L2 divides;
    neither is a gradient term. With :math:`\lambda_1 = \lambda_2 = 0` this is
    plain gradient descent. As in TF's kernel, :math:`\lambda_1 = 0` takes the
    form :math:`\theta'/(1 + \lambda_2\eta)`, which differs from the one above
    only in the sign of a zero; a :math:`\lambda_1` given as a tensor (or a
    callable returning one) always takes the general form, since choosing would
    read it on the host.

    Slots: none.

    Sparse gradients (row-sparse COO) are lazy, as in TF: duplicate rows are
    summed (unlike ``GradientDescentOptimizer``), then only the given rows are
    stepped and shrunk; the other rows get no shrinkage. TF's kernel for rows
    of one element (1-D variables, rows of shape (1,)) divides by a float64
    denominator, and so does this optimizer there (bit for bit).

    Differences from TF:
        1. TF's dense path passes the float32 hyperparameters uncast, so it
           rejects float64 variables unless they are given as float64 tensors;
           here they are rounded to float32 and cast to the parameter dtype
           for every dtype, as TF's sparse path does.
        2. Every dtype runs (TF's CPU kernels are float32 and float64 only).

    Differences from ``torch.optim.SGD``: L1 and L2 are proximal steps, not
    ``weight_decay`` (which adds :math:`\lambda\theta` to the gradient).
    ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        l1_regularization_strength: ``>= 0``.
        l2_regularization_strength: ``>= 0``.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.25]))
        >>> opt = ProximalGradientDescentOptimizer([w], learning_rate=0.25, l1_regularization_strength=1.0)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.2500, -0.2500,  0.0000])
    """

    tf_slot_order: ClassVar[tuple[str, ...]] = ()
    _hypers = (
        Hyper("lr", "learning_rate", 0.0),
        Hyper("l1", "l1_regularization_strength", 0.0),
        Hyper("l2", "l2_regularization_strength", 0.0),
    )

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        l1_regularization_strength: float | Tensor | Any = 0.0,
        l2_regularization_strength: float | Tensor | Any = 0.0,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": learning_rate,
            "l1": l1_regularization_strength,
            "l2": l2_regularization_strength,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        proximal_gradient_descent(
            params,
            grads,
            **_scalars(hyper),
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        l2_lr = None if hyper.is_zero("l2") else hyper.l2 * hyper.lr
        _sparse_proximal_gradient_descent(p, indices, values, **_scalars(hyper), l2_lr=l2_lr)


def _scalars(hyper: HyperScalars) -> dict[str, Tensor | None]:
    """η, η·λ₁ and 1 + λ₂·η in the params' dtype; None where the term drops out.

    TF's kernel branches on λ₁ > 0 and uses the plain form θ'/(1 + λ₂η) when
    λ₁ = 0 (``lr_l1=None``); with λ₂ = 0 that division is by exactly 1 and is
    skipped (``denom=None``). Only a Python number is tested: a tensor or
    callable value keeps the general form, since branching on it would read
    it on the host.
    """
    return {
        "lr": hyper.lr,
        "lr_l1": None if hyper.is_zero("l1") else hyper.lr * hyper.l1,
        "denom": None if hyper.is_zero("l2") else hyper.one + hyper.l2 * hyper.lr,
    }


def _single_tensor_proximal_gradient_descent(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    lr: Tensor,
    lr_l1: Tensor | None,
    denom: Tensor | None,
) -> None:
    for p, g in zip(params, grads, strict=True):
        p.sub_(g * lr)  # 1. θ' = θ - gη
        if lr_l1 is not None:
            shrunk = (p.abs() - lr_l1).clamp_min_(0)
            p.sign_().mul_(shrunk)  # 2. θ = sign(θ')·max(|θ'| - ηλ₁, 0) …  (λ₁ = 0: θ')
        if denom is not None:
            p.div_(denom)  #    … / (1 + λ₂η)


def _multi_tensor_proximal_gradient_descent(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    lr: Tensor,
    lr_l1: Tensor | None,
    denom: Tensor | None,
    scratch: list[list[Tensor]],
) -> None:
    # The one temporary goes into the scratch list (copy_ + in-place ops, no
    # allocation); θ' and the shrunk value are built in the parameters themselves.
    (tmp,) = scratch
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, lr)
    torch._foreach_sub_(params, tmp)
    if lr_l1 is not None:
        torch._foreach_copy_(tmp, params)
        torch._foreach_abs_(tmp)
        # (A list of the 0-d tensor: see adam's _multi_tensor_adam.)
        torch._foreach_sub_(tmp, [lr_l1] * len(tmp))
        torch._foreach_clamp_min_(tmp, 0)
        torch._foreach_sign_(params)
        torch._foreach_mul_(params, tmp)
    if denom is not None:
        torch._foreach_div_(params, denom)


proximal_gradient_descent = functional(
    _single_tensor_proximal_gradient_descent,
    _multi_tensor_proximal_gradient_descent,
    scratch=1,
    doc="""Functional form of :class:`ProximalGradientDescentOptimizer`'s dense update.

    ``lr_l1`` = η·λ₁ and ``denom`` = 1 + λ₂·η, each rounded in the params'
    dtype. ``lr_l1=None`` selects TF's λ₁ = 0 form θ'/(1 + λ₂η); ``denom=None``
    leaves out the division (λ₂ = 0).
    """,
)


def _sparse_proximal_gradient_descent(p, indices, values, *, lr, lr_l1, denom, l2_lr):
    # TF's SparseApplyProximalGradientDescent applies the dense formula to the
    # given rows only (rows are unique after coalescing). For rows of one element
    # its scalar code divides by ``1.0 + λ₂η``, a double (the literal is one): in
    # float32 the quotient is taken in float64 and rounded once.
    rows = p.index_select(0, indices)
    in_double = l2_lr is not None and p.dtype == torch.float32 and one_element_rows(p)
    _single_tensor_proximal_gradient_descent(
        [rows], [values], lr=lr, lr_l1=lr_l1, denom=None if in_double else denom
    )
    if in_double:
        rows = (rows.double() / (1.0 + l2_lr.double())).to(rows.dtype)
    p.index_copy_(0, indices, rows)
