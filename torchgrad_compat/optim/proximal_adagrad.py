"""``tf.compat.v1.train.ProximalAdagradOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Hyper, HyperScalars
from ._numerics import one_element_rows, sqrt
from .adagrad import constant_slot
from .optimizer import Optimizer, Params

__all__ = ["ProximalAdagradOptimizer", "proximal_adagrad"]


class ProximalAdagradOptimizer(Optimizer):
    r"""Proximal Adagrad (FOBOS, Adagrad step size), exactly as TF v1's ``ProximalAdagradOptimizer``.

    With :math:`\eta` = ``learning_rate``, :math:`\lambda_1` =
    ``l1_regularization_strength``, :math:`\lambda_2` =
    ``l2_regularization_strength`` and the accumulator :math:`a` starting at
    ``initial_accumulator_value``:

    .. math::
        a &\leftarrow a + g^2 \\
        \eta_t &= \eta / \sqrt{a} \\
        \theta' &= \theta - g\eta_t \\
        \theta &\leftarrow \operatorname{sign}(\theta')\max(|\theta'| - \eta_t\lambda_1, 0)
            \,/\, (1 + \lambda_2\eta_t)

    with :math:`\eta_t` evaluated as ``η·rsqrt(a)``. L1 shrinks towards zero
    (exactly zero inside the dead zone) and L2 divides; neither is a gradient
    term. As in TF's kernel, :math:`\lambda_1 = 0` takes the form
    :math:`\theta'/(1 + \lambda_2\eta_t)`, which differs from the one above only
    in the sign of a zero. :math:`\lambda_2 = 0` skips the division by
    :math:`1 + 0\cdot\eta_t = 1` (TF divides; the two differ only where
    :math:`\eta_t` overflows to infinity, where TF's quotient is NaN). Only a
    Python number is tested for 0: a tensor or callable value keeps the
    general form, since choosing would read it on the host.

    Slots: ``accumulator`` (``initial_accumulator_value``, made directly in the
    parameter dtype); torch has no counterpart.

    Sparse gradients (row-sparse COO) are lazy, as in TF: duplicate rows are
    summed, then only the given rows are accumulated, stepped and shrunk.

    Numerics: TF evaluates ``rsqrt`` with Eigen's vectorised approximation (up
    to 2 ulp from ``1/√a``, depending on the CPU); ``torch.rsqrt`` stands in the
    same place, so results agree with TF to a few ulp, not bit for bit. TF's
    sparse kernel for rows of one element (1-D variables, rows of shape (1,))
    uses an exact ``η/√a`` and a float64 denominator, and so does this
    optimizer there: those rows are TF's bit for bit.

    Differences from TF:
        1. TF's dense path passes the float32 hyperparameters uncast, so it
           rejects float64 variables unless they are given as float64 tensors;
           here they are rounded to float32 and cast to the parameter dtype
           for every dtype, as TF's sparse path does.
        2. ``learning_rate`` may be 0 (TF's CPU kernel requires it positive).
        3. Every dtype runs (TF's CPU kernels are float32 and float64 only).

    ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        initial_accumulator_value: ``> 0``; the accumulator's starting value.
        l1_regularization_strength: ``>= 0``.
        l2_regularization_strength: ``>= 0``.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
        >>> opt = ProximalAdagradOptimizer([w], learning_rate=0.5, initial_accumulator_value=12.0)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.7500, -0.7500], dtype=torch.float64)
    """

    tf_slot_order: ClassVar[tuple[str, ...]] = ("accumulator",)
    _hypers = (
        Hyper("lr", "learning_rate", 0.0),
        Hyper(
            "initial_accumulator_value",
            "initial_accumulator_value",
            0.0,
            low_inclusive=False,
            in_param_dtype=True,
        ),
        Hyper("l1", "l1_regularization_strength", 0.0),
        Hyper("l2", "l2_regularization_strength", 0.0),
    )
    _slots = ("accumulator",)

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float | Tensor | Any = 0.0,
        l2_regularization_strength: float | Tensor | Any = 0.0,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": learning_rate,
            "initial_accumulator_value": initial_accumulator_value,
            "l1": l1_regularization_strength,
            "l2": l2_regularization_strength,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def _init_slots(self, group, p):
        return {"accumulator": constant_slot(p, group["initial_accumulator_value"])}

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        scalars = _scalars(hyper)
        proximal_adagrad(
            params,
            grads,
            [s["accumulator"] for s in slots],
            **scalars,
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_proximal_adagrad(p, indices, values, slots["accumulator"], **_scalars(hyper))


def _scalars(hyper: HyperScalars) -> dict[str, Tensor | None]:
    """η, λ₁ and λ₂ in the params' dtype; None for a λ that is the Python number 0."""
    return {
        "lr": hyper.lr,
        "l1": None if hyper.is_zero("l1") else hyper.l1,
        "l2": None if hyper.is_zero("l2") else hyper.l2,
    }


def _single_tensor_proximal_adagrad(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    *,
    lr: Tensor,
    l1: Tensor | None,
    l2: Tensor | None,
) -> None:
    for p, g, a in zip(params, grads, accums, strict=True):
        a.add_(g * g)  # 1. a = a + g²
        lr_t = a.rsqrt().mul_(lr)  # 2. η_t = η·rsqrt(a)
        p.sub_(g * lr_t)  # 3. θ' = θ - g·η_t
        if l1 is not None:
            shrunk = (p.abs() - lr_t * l1).clamp_min_(0)
            p.sign_().mul_(shrunk)  # 4. θ' ← sign(θ')·max(|θ'| - η_tλ₁, 0)
        if l2 is not None:
            p.div_(lr_t.mul_(l2).add_(1))  # 5. θ = θ' / (1 + λ₂η_t)


def _multi_tensor_proximal_adagrad(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    *,
    lr: Tensor,
    l1: Tensor | None,
    l2: Tensor | None,
    scratch: list[list[Tensor]],
) -> None:
    # Temporaries go into the scratch lists (copy_ + in-place ops, no
    # allocation); g² is taken of the scratch copy (tmp * tmp), which reads one
    # list instead of two.
    tmp, lr_t = scratch[:2]
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, tmp)
    torch._foreach_add_(accums, tmp)
    torch._foreach_copy_(lr_t, accums)
    torch._foreach_rsqrt_(lr_t)
    torch._foreach_mul_(lr_t, lr)
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, lr_t)
    torch._foreach_sub_(params, tmp)
    if l1 is not None:
        shrunk = scratch[2]
        torch._foreach_copy_(shrunk, params)
        torch._foreach_abs_(shrunk)
        torch._foreach_copy_(tmp, lr_t)
        torch._foreach_mul_(tmp, l1)
        torch._foreach_sub_(shrunk, tmp)
        torch._foreach_clamp_min_(shrunk, 0)
        torch._foreach_sign_(params)
        torch._foreach_mul_(params, shrunk)
    if l2 is not None:
        torch._foreach_mul_(lr_t, l2)
        # add_ of a bare number binds to the Scalar overload, which wraps it for
        # every tensor (~4x the per-tensor overhead); a list of a 0-d 1 broadcasts.
        torch._foreach_add_(lr_t, [torch.ones_like(l2)] * len(lr_t))
        torch._foreach_div_(params, lr_t)


proximal_adagrad = functional(
    _single_tensor_proximal_adagrad,
    _multi_tensor_proximal_adagrad,
    scratch=lambda *, l1, **_: 2 if l1 is None else 3,
    doc="""Functional form of :class:`ProximalAdagradOptimizer`'s dense update (scalars in the params' dtype).

    ``l1=None`` selects TF's λ₁ = 0 form θ'/(1 + λ₂η_t); ``l2=None`` skips that
    division. The foreach path takes two lists of temporaries, three when
    ``l1`` is given.
    """,
)


def _sparse_proximal_adagrad(p, indices, values, accum, *, lr, l1, l2):
    # TF's SparseApplyProximalAdagrad applies the dense formula to the given
    # rows only (rows are unique after coalescing). For rows of one element its
    # scalar code takes η_t = η/√a (a division, not rsqrt) and divides by
    # 1.0 + λ₂η_t in double (the literal is one), rounding the quotient once.
    rows, accum_rows = p.index_select(0, indices), accum.index_select(0, indices)
    if not one_element_rows(p):
        _single_tensor_proximal_adagrad([rows], [values], [accum_rows], lr=lr, l1=l1, l2=l2)
    else:
        accum_rows.add_(values * values)
        lr_t = lr / sqrt(accum_rows)
        rows.sub_(lr_t * values)
        if l1 is not None:
            shrunk = (rows.abs() - lr_t * l1).clamp_min_(0)
            rows.sign_().mul_(shrunk)
        if l2 is not None:
            rows = (rows.double() / (1.0 + (lr_t * l2).double())).to(rows.dtype)
    accum.index_copy_(0, indices, accum_rows)
    p.index_copy_(0, indices, rows)
