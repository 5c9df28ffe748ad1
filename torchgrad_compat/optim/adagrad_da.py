"""``tf.compat.v1.train.AdagradDAOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._checks import check_global_step
from ._dispatch import functional
from ._hyper import Hyper
from ._numerics import foreach_sqrt_, one_element_rows, sqrt
from .adagrad import constant_slot
from .optimizer import Optimizer, Params

__all__ = ["AdagradDAOptimizer", "adagrad_da"]


class AdagradDAOptimizer(Optimizer):
    r"""Adagrad dual averaging, exactly as TensorFlow v1's ``AdagradDAOptimizer``.

    With :math:`\eta` = ``learning_rate``, :math:`\lambda_1` =
    ``l1_regularization_strength``, :math:`\lambda_2` =
    ``l2_regularization_strength`` and :math:`T` = ``global_step + 1`` (read
    before this apply increments it), the accumulators :math:`a` (of gradients)
    and :math:`s` (of squared gradients) are updated and the parameter is
    *recomputed* from them:

    .. math::
        a &\leftarrow a + g \\
        s &\leftarrow s + g^2 \\
        \theta &\leftarrow -\eta\,\operatorname{sign}(a)\max(|a| - T\lambda_1, 0)
            \,/\, (\lambda_2 (T\eta) + \sqrt{s})

    so the parameter's previous value is never read, and a zero gradient still
    moves it as :math:`T` grows. As in TF's kernel, :math:`\lambda_1 = 0` takes
    the form :math:`-(\eta a) / (\dots)` (the same bits as the one above); a
    :math:`\lambda_1` given as a tensor (or a callable returning one) always
    takes the general form, since choosing would read it on the host.

    Slots: ``gradient_accumulator`` (0) and ``gradient_squared_accumulator``
    (``initial_gradient_squared_accumulator_value``, made directly in the
    parameter dtype); torch has no counterpart.

    The step :math:`T`: when ``global_step`` is a 0-d integer tensor, it is read
    at every apply, as in TF, and advances only when it is incremented (by
    ``apply_gradients(..., global_step=global_step)`` or by the caller). When
    ``global_step`` is None, the optimizer keeps its own int64 counter
    (non-slot state ``global_step``, one per param group, starting at 0,
    advanced once per ``step``/``apply_gradients`` call, kept in the param
    group as ``group["global_step"]`` and saved with it), so :math:`T = 1, 2, 3, \dots` as in TF
    with the global step passed to ``apply_gradients``.

    Sparse gradients (row-sparse COO) are lazy, as in TF: duplicate rows are
    summed, then only the given rows are accumulated and recomputed; the other
    rows keep their value although :math:`T` advanced. TF's sparse kernel
    evaluates the same quantity as
    :math:`-\operatorname{sign}(a)\max(|a|/T - \lambda_1, 0) / (\lambda_2 + \sqrt{s}/(T\eta))`,
    which is reproduced; for rows of one element (1-D variables, rows of
    shape (1,)) it computes the dense form in float64 instead, and so does
    this optimizer: those rows are TF's bit for bit.

    Differences from TF:
        1. ``global_step`` may be omitted (TF requires it); see above.
        2. Every dtype runs (TF's CPU kernels are float32 and float64 only).

    ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        global_step: None, or a 0-d integer tensor holding the number of
            completed steps.
        initial_gradient_squared_accumulator_value: ``> 0``; the squared
            accumulator's starting value.
        l1_regularization_strength: ``>= 0``.
        l2_regularization_strength: ``>= 0``.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable,
            or ``global_step`` is not None or a 0-d integer tensor.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
        >>> opt = AdagradDAOptimizer([w], learning_rate=0.5, initial_gradient_squared_accumulator_value=12.0)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([-0.2500,  0.2500], dtype=torch.float64)
    """

    _non_slot_ranges = (Hyper("global_step", "global_step", 0.0),)
    tf_slot_order: ClassVar[tuple[str, ...]] = ("gradient_accumulator", "gradient_squared_accumulator")
    _hypers = (
        Hyper("lr", "learning_rate", 0.0),
        Hyper(
            "initial_gradient_squared_accumulator_value",
            "initial_gradient_squared_accumulator_value",
            0.0,
            low_inclusive=False,
            in_param_dtype=True,
        ),
        Hyper("l1", "l1_regularization_strength", 0.0),
        Hyper("l2", "l2_regularization_strength", 0.0),
    )
    _slots = ("gradient_accumulator", "gradient_squared_accumulator")
    _pickled_attributes = (*Optimizer._pickled_attributes, "_global_step")

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        global_step: Tensor | None = None,
        initial_gradient_squared_accumulator_value: float = 0.1,
        l1_regularization_strength: float | Tensor | Any = 0.0,
        l2_regularization_strength: float | Tensor | Any = 0.0,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        if global_step is not None:
            check_global_step(global_step)
            _check_step_count(global_step)
        # Set before the base class adds the param groups: _init_non_slot reads it.
        self._global_step = global_step
        defaults = {
            "lr": learning_rate,
            "initial_gradient_squared_accumulator_value": initial_gradient_squared_accumulator_value,
            "l1": l1_regularization_strength,
            "l2": l2_regularization_strength,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(params, defaults)

    @property
    def global_step(self) -> Tensor | None:
        """The ``global_step`` tensor this optimizer reads (TF's), or None where it counts its own
        steps (in each group's ``global_step``)."""
        return self._global_step

    def _apply(self, grouped, kinds=None, shapes=None, lists=None, census_of=None, unscaling=None):
        # The caller's global_step is read again before every step where that is cheap (on the
        # CPU; an accelerator's would stall it), as hyperparameters are.
        step = self._global_step
        if step is not None and step.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_step_count(step)
        super()._apply(grouped, kinds, shapes, lists, census_of, unscaling)

    def _init_slots(self, group, p):
        return {
            "gradient_accumulator": torch.zeros_like(p, memory_format=torch.preserve_format),
            "gradient_squared_accumulator": constant_slot(
                p, group["initial_gradient_squared_accumulator_value"]
            ),
        }

    def _init_non_slot(self, group, device):
        if self._global_step is not None:
            return {}
        return {"global_step": torch.zeros((), dtype=torch.int64, device=device)}

    def _step_index(self, non_slot: dict[str, Tensor], device: torch.device) -> Tensor:
        """T = global_step + 1, an int64 0-d tensor on ``device``."""
        global_step = self._global_step if self._global_step is not None else non_slot["global_step"]
        return global_step.to(device=device, dtype=torch.int64) + 1

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        # TF's dense kernel converts T to float32 before casting it to the
        # parameter dtype, its sparse kernel converts it directly (the two
        # differ only past 2**24 steps).
        t = hyper.tensor(self._step_index(non_slot, hyper.device))
        foreach, fused = path
        # TF branches on λ₁ > 0 (t_l1=None selects its λ₁ = 0 form). With λ₂ = 0
        # the denominator's λ₂(Tη) is +0, added to √s > 0 (s starts positive and
        # only grows), so it is left out. Only a Python number is tested:
        # branching on a tensor would read it on the host.
        adagrad_da(
            params,
            grads,
            [s["gradient_accumulator"] for s in slots],
            [s["gradient_squared_accumulator"] for s in slots],
            neg_lr=-hyper.lr,
            t_l1=None if hyper.is_zero("l1") else t * hyper.l1,
            l2_t_lr=None if hyper.is_zero("l2") else hyper.l2 * (t * hyper.lr),
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        step = self._step_index(non_slot, hyper.device)
        if one_element_rows(p):
            _sparse_adagrad_da_scalar_rows(
                p,
                indices,
                values,
                slots["gradient_accumulator"],
                slots["gradient_squared_accumulator"],
                step=step,
                lr=hyper.lr,
                l1=hyper.l1,
                l2=hyper.l2,
            )
            return
        t = step.to(hyper.dtype)
        _sparse_adagrad_da(
            p,
            indices,
            values,
            slots["gradient_accumulator"],
            slots["gradient_squared_accumulator"],
            t=t,
            t_lr=t * hyper.lr,
            l1=hyper.l1,
            l2=hyper.l2,
        )

    def _finish(self, group, non_slot, values):
        if self._global_step is None:
            self._advance(non_slot, "global_step", torch.add, 1)


def _check_step_count(global_step: Tensor) -> None:
    """Refuse a negative ``global_step``: the update's ``T = global_step + 1`` must be at least 1."""
    value = int(global_step)
    if value < 0:
        raise ValueError(
            f"Invalid global_step value: {value}; expected >= 0 (AdagradDA's step T = global_step + 1 "
            "must be at least 1)"
        )


def _single_tensor_adagrad_da(
    params: list[Tensor],
    grads: list[Tensor],
    grad_accums: list[Tensor],
    squared_accums: list[Tensor],
    *,
    neg_lr: Tensor,
    t_l1: Tensor | None,
    l2_t_lr: Tensor | None,
) -> None:
    for p, g, a, s in zip(params, grads, grad_accums, squared_accums, strict=True):
        a.add_(g)  # 1. a = a + g
        s.add_(g * g)  # 2. s = s + g²
        if t_l1 is None:
            num = a * neg_lr  # 3. (λ₁ = 0: -η·a, TF's (η·a)·(-1))
        else:
            shrunk = (a.abs() - t_l1).clamp_min_(0)  # 3. max(|a| - Tλ₁, 0)
            num = (a.sign() * neg_lr).mul_(shrunk)  #    -η·sign(a)·max(…)
        den = sqrt(s)
        if l2_t_lr is not None:
            den.add_(l2_t_lr)
        p.copy_(num.div_(den))  # 4. θ = … / (λ₂(Tη) + √s)


def _multi_tensor_adagrad_da(
    params: list[Tensor],
    grads: list[Tensor],
    grad_accums: list[Tensor],
    squared_accums: list[Tensor],
    *,
    neg_lr: Tensor,
    t_l1: Tensor | None,
    l2_t_lr: Tensor | None,
    scratch: list[list[Tensor]],
) -> None:
    # θ's old value is never read, so the numerator is built in the parameters
    # themselves and the one temporary goes into the scratch list (copy_ +
    # in-place ops, no allocation).
    (tmp,) = scratch
    torch._foreach_add_(grad_accums, grads)
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, grads)
    torch._foreach_add_(squared_accums, tmp)
    torch._foreach_copy_(params, grad_accums)
    if t_l1 is None:
        torch._foreach_mul_(params, neg_lr)
    else:
        torch._foreach_copy_(tmp, grad_accums)
        torch._foreach_abs_(tmp)
        # (A list of the 0-d tensor: see adam's _multi_tensor_adam.)
        torch._foreach_sub_(tmp, [t_l1] * len(tmp))
        torch._foreach_clamp_min_(tmp, 0)
        torch._foreach_sign_(params)
        torch._foreach_mul_(params, neg_lr)
        torch._foreach_mul_(params, tmp)
    torch._foreach_copy_(tmp, squared_accums)
    foreach_sqrt_(tmp)
    if l2_t_lr is not None:
        torch._foreach_add_(tmp, [l2_t_lr] * len(tmp))
    torch._foreach_div_(params, tmp)


adagrad_da = functional(
    _single_tensor_adagrad_da,
    _multi_tensor_adagrad_da,
    scratch=1,
    doc="""Functional form of :class:`AdagradDAOptimizer`'s dense update.

    ``neg_lr`` = -η, ``t_l1`` = T·λ₁ and ``l2_t_lr`` = λ₂·(T·η), each rounded in
    the params' dtype. ``t_l1=None`` selects TF's λ₁ = 0 form
    θ = (a·(-η)) / (…); ``l2_t_lr=None`` leaves the λ₂ term out of the
    denominator.
    """,
)


def _sparse_adagrad_da(p, indices, values, grad_accum, squared_accum, *, t, t_lr, l1, l2):
    # TF's SparseApplyAdagradDA: only the given rows (unique after coalescing),
    # with the quantity rearranged as -sign(a)·max(|a|/T - λ₁, 0) / (λ₂ + √s/(Tη)).
    a = grad_accum.index_select(0, indices).add_(values)
    s = squared_accum.index_select(0, indices).add_(values * values)
    grad_accum.index_copy_(0, indices, a)
    squared_accum.index_copy_(0, indices, s)
    shrunk = a.abs().div_(t).sub_(l1).clamp_min_(0)
    rows = a.sign().neg_().mul_(shrunk).div_(sqrt(s).div_(t_lr).add_(l2))
    p.index_copy_(0, indices, rows)


def _sparse_adagrad_da_scalar_rows(p, indices, values, grad_accum, squared_accum, *, step, lr, l1, l2):
    # TF's SparseApplyAdagradDA takes rows of one element through scalar code in double: each
    # gradient (and its square) is added in double and the sum rounded to the accumulator's dtype;
    # θ = sign(-a)·η·max(|a| - T·λ₁, 0) / (T·λ₂·η + √s), with √s in the accumulator's dtype and
    # the rest in double, rounded once. (The rows of more elements rearrange it: _sparse_adagrad_da.)
    g = values.reshape(-1).double()
    a = (grad_accum.index_select(0, indices).reshape(-1).double() + g).to(p.dtype)
    s = (squared_accum.index_select(0, indices).reshape(-1).double() + g * g).to(p.dtype)
    grad_accum.index_copy_(0, indices, a.reshape(-1, *p.shape[1:]))
    squared_accum.index_copy_(0, indices, s.reshape(-1, *p.shape[1:]))
    t, lr, l1, l2 = step.double(), lr.double(), l1.double(), l2.double()
    den = (t * l2 * lr) + sqrt(s).double()
    rows = (a.neg().sign().double() * lr * (a.abs().double() - t * l1).clamp_min(0)).div_(den)
    p.index_copy_(0, indices, rows.to(p.dtype).reshape(-1, *p.shape[1:]))
