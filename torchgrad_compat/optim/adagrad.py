"""``tf.compat.v1.train.AdagradOptimizer`` as a torch optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Hyper
from ._numerics import one_element_rows, sqrt
from .optimizer import Optimizer, Params

__all__ = ["AdagradOptimizer", "adagrad"]


class AdagradOptimizer(Optimizer):
    r"""Adagrad, exactly as TensorFlow v1's ``AdagradOptimizer``.

    With :math:`\eta` = ``learning_rate`` and the accumulator :math:`a`
    starting at ``initial_accumulator_value``:

    .. math::
        a &\leftarrow a + g^2 \\
        \theta &\leftarrow \theta - g\eta\,/\sqrt{a}

    evaluated as ``θ - (g·η)·rsqrt(a)``. There is no epsilon.

    Slots: ``accumulator`` (``initial_accumulator_value``, made directly in the
    parameter dtype; torch's ``sum``).

    Sparse gradients (row-sparse COO) are lazy, as in TF: duplicate rows are
    summed, then only the given rows of ``a`` and of the parameter change.

    Numerics: TF evaluates ``rsqrt`` with Eigen's vectorised approximation (up
    to 2 ulp from ``1/√a``, depending on the CPU); ``torch.rsqrt`` stands in the
    same place of the formula, so results agree with TF to a few ulp, not bit
    for bit. TF's sparse kernel for rows of one element (1-D variables, rows
    of shape (1,)) divides by an exact ``√a`` instead, and so does this
    optimizer there: those rows are TF's bit for bit.

    Differences from ``torch.optim.Adagrad``:
        1. The accumulator starts at ``initial_accumulator_value`` = 0.1 (torch: 0)
           and must be positive.
        2. No epsilon: torch computes ``θ - lr·g / (√a + eps)``.
        3. No ``lr_decay`` and no ``weight_decay``.

    ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        initial_accumulator_value: ``> 0``; the accumulator's starting value.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
        >>> opt = AdagradOptimizer([w], learning_rate=0.5, initial_accumulator_value=12.0)
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
    )
    _slots = ("accumulator",)

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        initial_accumulator_value: float = 0.1,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": learning_rate,
            "initial_accumulator_value": initial_accumulator_value,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def _init_slots(self, group, p):
        return {"accumulator": constant_slot(p, group["initial_accumulator_value"])}

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        adagrad(
            params,
            grads,
            [s["accumulator"] for s in slots],
            lr=hyper.lr,
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_adagrad(p, indices, values, slots["accumulator"], lr=hyper.lr)


def constant_slot(p: Tensor, value: float | Tensor | Callable[[], Any]) -> Tensor:
    """A slot like ``p`` filled with ``value``, converted straight to ``p``'s dtype.

    TF builds such slots with a constant initializer in the variable's dtype,
    so a float64 accumulator starts at float64(0.1), not at float32(0.1).
    """
    if callable(value) and not isinstance(value, Tensor):
        value = value()
    return torch.full_like(p, float(value), memory_format=torch.preserve_format)


def _single_tensor_adagrad(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    *,
    lr: Tensor,
) -> None:
    for p, g, a in zip(params, grads, accums, strict=True):
        a.add_(g * g)  # 1. a = a + g²
        p.sub_((g * lr).mul_(a.rsqrt()))  # 2. θ = θ - (gη)·rsqrt(a)


def _multi_tensor_adagrad(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    *,
    lr: Tensor,
    scratch: list[list[Tensor]],
) -> None:
    # Temporaries go into the two scratch lists (copy_ + in-place ops, no
    # allocation). torch.optim.Adagrad folds g² into a with addcmul_, a fused
    # multiply-add that rounds once where TF rounds g² first.
    step, rsqrt = scratch
    torch._foreach_copy_(step, grads)
    torch._foreach_mul_(step, grads)
    torch._foreach_add_(accums, step)
    torch._foreach_copy_(rsqrt, accums)
    torch._foreach_rsqrt_(rsqrt)
    torch._foreach_copy_(step, grads)
    torch._foreach_mul_(step, lr)
    torch._foreach_mul_(step, rsqrt)
    torch._foreach_sub_(params, step)


adagrad = functional(
    _single_tensor_adagrad,
    _multi_tensor_adagrad,
    scratch=2,
    doc="""Functional form of :class:`AdagradOptimizer`'s dense update (``lr`` in the params' dtype).""",
)


def _sparse_adagrad(p, indices, values, accum, *, lr):
    # TF's SparseApplyAdagrad applies the dense formula to the given rows only
    # (rows are unique after coalescing); for rows of one element its scalar code
    # divides by the square root, θ - (ηg)/√a, where the others multiply by rsqrt.
    rows, accum_rows = p.index_select(0, indices), accum.index_select(0, indices)
    if one_element_rows(p):
        accum_rows.add_(values * values)
        rows.sub_((values * lr).div_(sqrt(accum_rows)))
    else:
        _single_tensor_adagrad([rows], [values], [accum_rows], lr=lr)
    accum.index_copy_(0, indices, accum_rows)
    p.index_copy_(0, indices, rows)
