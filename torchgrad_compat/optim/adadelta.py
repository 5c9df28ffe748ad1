"""``tf.compat.v1.train.AdadeltaOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Hyper, HyperScalars
from ._numerics import foreach_sqrt_, sqrt_
from .optimizer import Optimizer, Params

__all__ = ["AdadeltaOptimizer", "adadelta"]


class AdadeltaOptimizer(Optimizer):
    r"""Adadelta, exactly as TensorFlow v1's ``AdadeltaOptimizer``.

    With :math:`\eta` = ``learning_rate``, :math:`\rho` = ``rho`` and
    :math:`\epsilon` = ``epsilon``, ``a`` the ``accum`` slot and ``u`` the
    ``accum_update`` slot:

    .. math::
        a &\leftarrow a\rho + g^2(1 - \rho) \\
        \Delta &= \sqrt{u + \epsilon}\cdot\operatorname{rsqrt}(a + \epsilon)\cdot g \\
        \theta &\leftarrow \theta - \Delta\eta \\
        u &\leftarrow u\rho + \Delta^2(1 - \rho)

    Slots: ``accum`` (0; torch's ``square_avg``) and ``accum_update`` (0;
    torch's ``acc_delta``).

    Sparse gradients (row-sparse COO) follow TF's sparse rule, which is lazy:
    duplicate rows are summed, then only the given rows of the slots and the
    parameter change, by the same formula; the other rows' accumulators do
    not decay.

    Differences from ``torch.optim.Adadelta``:
        1. The defaults are TF's: ``learning_rate=0.001`` (torch: ``lr=1.0``),
           ``rho=0.95`` (torch: 0.9) and ``epsilon=1e-8`` (torch: 1e-6).
        2. The step multiplies by ``rsqrt(a + ε)``; torch divides,
           ``Δ = √(u+ε) / √(a+ε) · g``. The two agree up to rounding.
        3. ``1 - rho`` is evaluated in float32 and the parameter dtype, as TF does.
        4. Sparse gradients are supported (torch's Adadelta rejects them).

    TensorFlow's CPU kernel computes ``rsqrt`` with Eigen's SIMD approximation,
    which can be a few ulp from the correctly rounded ``1/√x`` that
    ``torch.rsqrt`` gives: results agree with TF to a few ulp per step, not bit
    for bit. ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        rho: decay rate, in ``[0, 1]``.
        epsilon: ``>= 0``.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        >>> opt = AdadeltaOptimizer([w], learning_rate=1.0)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.9996, -0.9996])
    """

    tf_slot_order: ClassVar[tuple[str, ...]] = ("accum", "accum_update")
    _hypers = (
        Hyper("lr", "learning_rate", 0.0),
        Hyper("rho", "rho", 0.0, 1.0, high_inclusive=True),
        Hyper("epsilon", "epsilon", 0.0),
    )
    _slots = ("accum", "accum_update")

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any = 0.001,
        rho: float | Tensor | Any = 0.95,
        epsilon: float | Tensor | Any = 1e-08,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {"lr": learning_rate, "rho": rho, "epsilon": epsilon, "foreach": foreach, "fused": fused}
        super().__init__(params, defaults)

    def _init_slots(self, group, p):
        return {
            "accum": torch.zeros_like(p, memory_format=torch.preserve_format),
            "accum_update": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        adadelta(
            params,
            grads,
            [s["accum"] for s in slots],
            [s["accum_update"] for s in slots],
            lr=hyper.lr,
            rho=hyper.rho,
            one_minus_rho=hyper.one - hyper.rho,
            epsilon=hyper.epsilon,
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_adadelta(p, indices, values, slots["accum"], slots["accum_update"], hyper=hyper)


def _single_tensor_adadelta(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    accum_updates: list[Tensor],
    *,
    lr: Tensor,
    rho: Tensor,
    one_minus_rho: Tensor,
    epsilon: Tensor,
) -> None:
    for p, g, a, u in zip(params, grads, accums, accum_updates, strict=True):
        a.mul_(rho).add_((g * g).mul_(one_minus_rho))  # 1. a = aρ + g²(1-ρ)
        delta = sqrt_(u + epsilon).mul_((a + epsilon).rsqrt_()).mul_(g)  # 2. Δ = √(u+ε)·rsqrt(a+ε)·g
        p.sub_(delta * lr)  # 3. θ = θ - Δη
        u.mul_(rho).add_((delta * delta).mul_(one_minus_rho))  # 4. u = uρ + Δ²(1-ρ)


def _multi_tensor_adadelta(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    accum_updates: list[Tensor],
    *,
    lr: Tensor,
    rho: Tensor,
    one_minus_rho: Tensor,
    epsilon: Tensor,
    scratch: list[list[Tensor]],
) -> None:
    # Temporaries go into the two scratch lists (copy_ + in-place ops, no
    # allocation); squares are taken of a scratch copy (tmp * tmp), which reads
    # one list instead of two, and Δ is squared in place once θ has its step.
    # add_ of a bare 0-d tensor binds to the Scalar overload, which reads it on
    # the host and costs ~4x the per-tensor overhead, so ε goes in as a list.
    tmp, delta = scratch
    eps = [epsilon] * len(params)
    torch._foreach_mul_(accums, rho)
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, tmp)
    torch._foreach_mul_(tmp, one_minus_rho)
    torch._foreach_add_(accums, tmp)
    torch._foreach_copy_(delta, accum_updates)
    torch._foreach_add_(delta, eps)
    foreach_sqrt_(delta)
    torch._foreach_copy_(tmp, accums)
    torch._foreach_add_(tmp, eps)
    torch._foreach_rsqrt_(tmp)
    torch._foreach_mul_(delta, tmp)
    torch._foreach_mul_(delta, grads)
    torch._foreach_copy_(tmp, delta)
    torch._foreach_mul_(tmp, lr)
    torch._foreach_sub_(params, tmp)
    torch._foreach_mul_(accum_updates, rho)
    torch._foreach_mul_(delta, delta)
    torch._foreach_mul_(delta, one_minus_rho)
    torch._foreach_add_(accum_updates, delta)


adadelta = functional(
    _single_tensor_adadelta,
    _multi_tensor_adadelta,
    scratch=2,
    doc="""Functional form of :class:`AdadeltaOptimizer`'s dense update (scalars in the params' dtype).""",
)


def _sparse_adadelta(
    p: Tensor, indices: Tensor, values: Tensor, accum: Tensor, accum_update: Tensor, *, hyper: HyperScalars
) -> None:
    # TF's SparseApplyAdadelta: the dense formula on the given (unique) rows only.
    one_minus_rho = hyper.one - hyper.rho
    a = accum.index_select(0, indices).mul_(hyper.rho).add_((values * values).mul_(one_minus_rho))
    u = accum_update.index_select(0, indices)
    delta = sqrt_(u + hyper.epsilon).mul_((a + hyper.epsilon).rsqrt_()).mul_(values)
    p.index_copy_(0, indices, p.index_select(0, indices).sub_(delta * hyper.lr))
    accum.index_copy_(0, indices, a)
    accum_update.index_copy_(0, indices, u.mul_(hyper.rho).add_((delta * delta).mul_(one_minus_rho)))
