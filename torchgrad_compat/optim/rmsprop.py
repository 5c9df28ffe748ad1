"""``tf.compat.v1.train.RMSPropOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Flag, Hyper, HyperScalars
from ._numerics import foreach_sqrt_, sqrt_
from .optimizer import Optimizer, Params

__all__ = ["RMSPropOptimizer", "rmsprop"]


class RMSPropOptimizer(Optimizer):
    r"""RMSProp, exactly as TensorFlow v1's ``RMSPropOptimizer``.

    With :math:`\eta` = ``learning_rate``, :math:`\rho` = ``decay``,
    :math:`\mu` = ``momentum`` and :math:`\epsilon` = ``epsilon``, ``ms`` the
    ``rms`` slot, ``mom`` the ``momentum`` slot and ``mg`` the ``mg`` slot:

    .. math::
        ms &\leftarrow ms + (g^2 - ms)(1 - \rho) \\
        mg &\leftarrow mg + (g - mg)(1 - \rho) \qquad \text{(centered only)} \\
        d &= ms + \epsilon \quad\text{or, centered,}\quad d = (ms - mg^2) + \epsilon \\
        mom &\leftarrow mom\,\mu + g\eta / \sqrt{d} \\
        \theta &\leftarrow \theta - mom

    The momentum buffer is updated even when ``momentum`` is 0 (it then holds
    the last step).

    Slots: ``rms`` (**1**; torch's ``square_avg``, which starts at 0),
    ``momentum`` (0; torch's ``momentum_buffer``) and, when ``centered``,
    ``mg`` (0; torch's ``grad_avg``).

    Sparse gradients (row-sparse COO) follow TF's sparse rule, which is lazy:
    duplicate rows are summed, then only the given rows change, with the
    kernel's own association (the other rows' ``rms`` does not decay):

    .. math::
        ms &\leftarrow ms\rho + g^2(1 - \rho), \qquad
        mg \leftarrow mg\rho + g(1 - \rho) \\
        d &= ms + \epsilon \quad\text{or, centered,}\quad d = (ms + \epsilon) - mg^2 \\
        mom &\leftarrow mom\,\mu + \operatorname{rsqrt}(d)\,\eta\,g, \qquad \theta \leftarrow \theta - mom

    TF's CPU kernel computes that ``rsqrt`` with Eigen's SIMD approximation on
    rows wider than a SIMD packet (a few ulp from ``torch.rsqrt``).

    Differences from ``torch.optim.RMSprop``:
        1. ``rms`` starts at 1, not 0.
        2. ``epsilon`` is inside the square root, :math:`\sqrt{ms + \epsilon}`
           (torch: :math:`\sqrt{ms} + \epsilon`); centered, :math:`\sqrt{ms - mg^2 + \epsilon}`.
        3. The learning rate is folded into the momentum buffer
           (torch: ``buf = μ·buf + g/avg; θ -= lr·buf``), so changing the
           learning rate does not rescale the momentum already accumulated.
        4. The defaults are TF's: ``decay=0.9`` (torch's ``alpha=0.99``) and
           ``epsilon=1e-10`` (torch: 1e-8).
        5. ``1 - decay`` is evaluated in float32 and the parameter dtype, as TF does.
        6. Sparse gradients are supported, lazily (torch's RMSprop rejects them).

    ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        decay: discount of the running averages, in ``[0, 1]``.
        momentum: ``>= 0``.
        epsilon: ``>= 0``.
        centered: normalise by the centered second moment (adds the ``mg`` slot).
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable,
            or ``centered`` is not a bool.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        >>> opt = RMSPropOptimizer([w], learning_rate=0.1)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.8246, -0.8246])
    """

    tf_slot_order: ClassVar[tuple[str, ...]] = ("rms", "mg", "momentum")
    _hypers = (
        Hyper("lr", "learning_rate", 0.0),
        Hyper("decay", "decay", 0.0, 1.0, high_inclusive=True),
        Hyper("momentum", "momentum", 0.0),
        Hyper("epsilon", "epsilon", 0.0),
        Flag("centered", "centered"),
    )
    _slots = ("momentum", "rms")

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        decay: float | Tensor | Any = 0.9,
        momentum: float | Tensor | Any = 0.0,
        epsilon: float | Tensor | Any = 1e-10,
        centered: bool = False,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": learning_rate,
            "decay": decay,
            "momentum": momentum,
            "epsilon": epsilon,
            "centered": centered,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def slot_names(self, group):
        # ``centered`` is per group, so is the ``mg`` slot.
        return (*self._slots, "mg") if group["centered"] else self._slots

    def _init_slots(self, group, p):
        # TF's creation order: rms, [mg], momentum.
        slots = {"rms": torch.ones_like(p, memory_format=torch.preserve_format)}
        if group["centered"]:
            slots["mg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        slots["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return slots

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        centered = group["centered"]
        foreach, fused = path
        rmsprop(
            params,
            grads,
            [s["rms"] for s in slots],
            [s["momentum"] for s in slots],
            [s["mg"] for s in slots] if centered else [],
            lr=hyper.lr,
            one_minus_decay=hyper.one - hyper.decay,
            momentum=hyper.momentum,
            epsilon=hyper.epsilon,
            centered=centered,
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_rmsprop(
            p,
            indices,
            values,
            slots["rms"],
            slots["momentum"],
            slots["mg"] if group["centered"] else None,
            hyper=hyper,
        )


def _single_tensor_rmsprop(
    params: list[Tensor],
    grads: list[Tensor],
    mss: list[Tensor],
    moms: list[Tensor],
    mgs: list[Tensor],
    *,
    lr: Tensor,
    one_minus_decay: Tensor,
    momentum: Tensor,
    epsilon: Tensor,
    centered: bool,
) -> None:
    for i, (p, g, ms, mom) in enumerate(zip(params, grads, mss, moms, strict=True)):
        ms.add_((g * g).sub_(ms).mul_(one_minus_decay))  # 1. ms = ms + (g² - ms)(1-ρ)
        if centered:
            mg = mgs[i]
            mg.add_((g - mg).mul_(one_minus_decay))  # 2. mg = mg + (g - mg)(1-ρ)
            denom = (ms - mg * mg).add_(epsilon)  # 3. d = (ms - mg²) + ε
        else:
            denom = ms + epsilon  # 3. d = ms + ε
        mom.mul_(momentum).add_((g * lr).div_(sqrt_(denom)))  # 4. mom = mom·μ + gη/√d
        p.sub_(mom)  # 5. θ = θ - mom


def _multi_tensor_rmsprop(
    params: list[Tensor],
    grads: list[Tensor],
    mss: list[Tensor],
    moms: list[Tensor],
    mgs: list[Tensor],
    *,
    lr: Tensor,
    one_minus_decay: Tensor,
    momentum: Tensor,
    epsilon: Tensor,
    centered: bool,
    scratch: list[list[Tensor]],
) -> None:
    # Temporaries go into the two scratch lists (copy_ + in-place ops, no
    # allocation); squares are taken of a scratch copy (tmp * tmp), which reads
    # one list instead of two. addcdiv_ with value=1 rounds as mom + q (the
    # product by 1 is exact). add_ of a bare 0-d tensor binds to the Scalar
    # overload, which reads it on the host and costs ~4x the per-tensor
    # overhead, so ε goes in as a list.
    tmp, denom = scratch
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, tmp)
    torch._foreach_sub_(tmp, mss)
    torch._foreach_mul_(tmp, one_minus_decay)
    torch._foreach_add_(mss, tmp)
    if centered:
        torch._foreach_copy_(tmp, grads)
        torch._foreach_sub_(tmp, mgs)
        torch._foreach_mul_(tmp, one_minus_decay)
        torch._foreach_add_(mgs, tmp)
        torch._foreach_copy_(tmp, mgs)
        torch._foreach_mul_(tmp, tmp)
        torch._foreach_copy_(denom, mss)
        torch._foreach_sub_(denom, tmp)
    else:
        torch._foreach_copy_(denom, mss)
    torch._foreach_add_(denom, [epsilon] * len(denom))
    foreach_sqrt_(denom)
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, lr)
    torch._foreach_mul_(moms, momentum)
    torch._foreach_addcdiv_(moms, tmp, denom, value=1)
    torch._foreach_sub_(params, moms)


rmsprop = functional(
    _single_tensor_rmsprop,
    _multi_tensor_rmsprop,
    scratch=2,
    doc="""Functional form of :class:`RMSPropOptimizer`'s dense update (``mgs`` is empty unless centered).""",
)


def _sparse_rmsprop(
    p: Tensor,
    indices: Tensor,
    values: Tensor,
    ms: Tensor,
    mom: Tensor,
    mg: Tensor | None,
    *,
    hyper: HyperScalars,
) -> None:
    # TF's SparseApply(Centered)RMSProp on the given (unique) rows; note the
    # association differs from the dense kernel and the step uses rsqrt.
    one_minus_decay = hyper.one - hyper.decay
    ms_rows = ms.index_select(0, indices).mul_(hyper.decay).add_((values * values).mul_(one_minus_decay))
    denom = ms_rows + hyper.epsilon
    if mg is not None:
        mg_rows = mg.index_select(0, indices).mul_(hyper.decay).add_(values * one_minus_decay)
        denom.sub_(mg_rows * mg_rows)
        mg.index_copy_(0, indices, mg_rows)
    step = denom.rsqrt_().mul_(hyper.lr).mul_(values)
    mom_rows = mom.index_select(0, indices).mul_(hyper.momentum).add_(step)
    p.index_copy_(0, indices, p.index_select(0, indices).sub_(mom_rows))
    ms.index_copy_(0, indices, ms_rows)
    mom.index_copy_(0, indices, mom_rows)
