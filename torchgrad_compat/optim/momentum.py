"""``tf.compat.v1.train.MomentumOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Flag, Hyper
from .optimizer import Optimizer, Params

__all__ = ["MomentumOptimizer", "momentum"]


class MomentumOptimizer(Optimizer):
    r"""Momentum (heavy ball or Nesterov), exactly as TensorFlow v1's ``MomentumOptimizer``.

    With :math:`\eta` = ``learning_rate`` and :math:`\mu` = ``momentum``:

    .. math::
        a &\leftarrow a\mu + g \\
        \theta &\leftarrow \theta - a\eta
            && \text{(use\_nesterov=False)} \\
        \theta &\leftarrow \theta - (g\eta + a\mu\eta)
            && \text{(use\_nesterov=True, with the new } a\text{)}

    Slots: ``momentum`` (0; torch's ``momentum_buffer``).

    Sparse gradients (row-sparse COO) are lazy, as in TF: duplicate rows are
    summed, then only the given rows of ``a`` and of the parameter change;
    the momentum of the other rows neither decays nor moves them. TF's sparse
    Nesterov kernel multiplies :math:`(\eta\mu)a` where the dense one
    multiplies :math:`(a\mu)\eta`; both are reproduced.

    Differences from ``torch.optim.SGD(momentum=μ, dampening=0)``, which has
    the same algebra:
        1. The update is rounded in TF's order: ``a * lr`` with ``lr`` rounded
           to float32 and then to the parameter dtype, and Nesterov as
           ``g·η + (a·μ)·η`` where torch computes ``η·(g + μ·a)``.
        2. Sparse gradients are supported, lazily (torch's SGD densifies them).

    ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        momentum: ``>= 0``; a number, a 0-d tensor or a callable.
        use_nesterov: use Nesterov momentum.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable,
            or ``use_nesterov`` is not a bool.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        >>> opt = MomentumOptimizer([w], learning_rate=0.25, momentum=0.5)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.5000, -0.5000])
    """

    tf_slot_order: ClassVar[tuple[str, ...]] = ("momentum",)
    _hypers = (
        Hyper("lr", "learning_rate", 0.0),
        Hyper("momentum", "momentum", 0.0),
        Flag("use_nesterov", "use_nesterov"),
    )
    _slots = ("momentum",)

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        momentum: float | Tensor | Any,
        use_nesterov: bool = False,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": learning_rate,
            "momentum": momentum,
            "use_nesterov": use_nesterov,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def _init_slots(self, group, p):
        return {"momentum": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        use_nesterov = hyper.value("use_nesterov")
        momentum(
            params,
            grads,
            [s["momentum"] for s in slots],
            lr=hyper.lr,
            momentum=hyper.momentum,
            use_nesterov=use_nesterov,
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_momentum(
            p,
            indices,
            values,
            slots["momentum"],
            lr=hyper.lr,
            momentum=hyper.momentum,
            use_nesterov=hyper.value("use_nesterov"),
        )


def _single_tensor_momentum(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    *,
    lr: Tensor,
    momentum: Tensor,
    use_nesterov: bool,
) -> None:
    for p, g, a in zip(params, grads, accums, strict=True):
        a.mul_(momentum).add_(g)  # 1. a = aμ + g
        if use_nesterov:
            p.sub_((g * lr).add_((a * momentum).mul_(lr)))  # 2. θ = θ - (gη + (aμ)η)
        else:
            p.sub_(a * lr)  # 2. θ = θ - aη


def _multi_tensor_momentum(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    *,
    lr: Tensor,
    momentum: Tensor,
    use_nesterov: bool,
    scratch: list[list[Tensor]],
) -> None:
    # Temporaries go into the scratch lists (copy_ + in-place ops, no allocation).
    # Five passes (nine with Nesterov) where torch.optim.SGD needs three (four):
    # its add_(buf, alpha=-lr) fuses the product into the subtraction, one
    # rounding where TF has two.
    torch._foreach_mul_(accums, momentum)
    torch._foreach_add_(accums, grads)
    step = scratch[0]
    if use_nesterov:
        tmp = scratch[1]
        torch._foreach_copy_(step, grads)
        torch._foreach_mul_(step, lr)
        torch._foreach_copy_(tmp, accums)
        torch._foreach_mul_(tmp, momentum)
        torch._foreach_mul_(tmp, lr)
        torch._foreach_add_(step, tmp)
    else:
        torch._foreach_copy_(step, accums)
        torch._foreach_mul_(step, lr)
    torch._foreach_sub_(params, step)


momentum = functional(
    _single_tensor_momentum,
    _multi_tensor_momentum,
    scratch=lambda *, use_nesterov, **_: 2 if use_nesterov else 1,
    doc="""Functional form of :class:`MomentumOptimizer`'s dense update (scalars in the params' dtype).

    The foreach path takes one list of temporaries, two with ``use_nesterov``.
    """,
)


def _sparse_momentum(p, indices, values, accum, *, lr, momentum, use_nesterov):
    # TF's SparseApplyMomentum: only the given rows; rows are unique after coalescing.
    a = accum.index_select(0, indices).mul_(momentum).add_(values)
    accum.index_copy_(0, indices, a)
    if use_nesterov:
        # The sparse kernel associates (η·μ)·a, not the dense (a·μ)·η.
        step = (values * lr).add_(a * (lr * momentum))
    else:
        step = a * lr
    p.index_add_(0, indices, step.neg_())
