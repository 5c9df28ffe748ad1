"""``tf.compat.v1.train.FtrlOptimizer`` as a torch optimizer."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Hyper, HyperScalars, float32_tensor
from ._numerics import foreach_sqrt_, one_element_rows, sqrt
from .optimizer import Optimizer, Params

__all__ = ["FtrlOptimizer", "ftrl"]


class FtrlOptimizer(Optimizer):
    r"""FTRL-Proximal, exactly as TensorFlow v1's ``FtrlOptimizer``.

    With :math:`\eta` = ``learning_rate``, :math:`p` = ``learning_rate_power``,
    :math:`\lambda_1` = ``l1_regularization_strength``, :math:`\lambda_s` =
    ``l2_shrinkage_regularization_strength``, ``a`` the ``accum`` slot, ``l``
    the ``linear`` slot and TF's effective L2 strength
    :math:`\lambda_2 = l_2 + \beta / (2\max(\eta, 10^{-36}))` (``l2_regularization_strength``
    and ``beta``, evaluated in float32, or in float64 when one of them is a float64 tensor):

    .. math::
        n &= a + g^2 \\
        \hat g &= g \quad\text{or, when } \lambda_s > 0,\quad \hat g = g + 2\lambda_s\theta \\
        \sigma &= (n^{-p} - a^{-p}) / \eta \\
        l &\leftarrow l + (\hat g - \sigma\theta) \\
        \theta &\leftarrow \begin{cases}
            (\lambda_1\operatorname{sign}(l) - l) / (n^{-p}/\eta + 2\lambda_2) & |l| > \lambda_1 \\
            0 & \text{otherwise}
        \end{cases} \\
        a &\leftarrow n

    :math:`\theta` on the right is the value before the step. :math:`x^{-p}` is
    ``sqrt(x)`` when ``learning_rate_power == -0.5`` (TF's special case) and
    ``pow(x, -p)`` otherwise; ``learning_rate_power=0`` is a fixed learning rate.
    ``accum`` is always updated with the raw :math:`g^2` (TF's ``ApplyFtrlV2``
    since the fix of tensorflow#18317).

    The parameter is a closed form of the accumulators: a step with a zero
    gradient still moves a parameter whose value is not that closed form (for
    example its initial value), as in TensorFlow.

    Slots: ``accum`` (``initial_accumulator_value``) and ``linear`` (0).
    ``torch.optim`` has no FTRL.

    Sparse gradients (row-sparse COO) follow TF's sparse rule, which is lazy:
    duplicate rows are summed, then only the given rows change, by the same
    formula except in two details of TF's sparse kernel: the new parameter is
    :math:`(\operatorname{clip}(l, -\lambda_1, \lambda_1) - l) / (n^{-p}/\eta + 2\lambda_2)`
    (the same value), and when a row holds a single element (a 1-D parameter)
    the linear slot is summed as :math:`(l + \hat g) - \sigma\theta`.

    Differences from TensorFlow:
        1. ``learning_rate`` must be ``> 0`` (TF's constructor accepts 0, but
           the dense kernel then divides by zero and the sparse kernel
           rejects it).
        2. For ``learning_rate_power != -0.5`` the power is ``torch.pow``
           (float32 and half tensors: taken in float64 and rounded) where TF
           uses Eigen's ``pow``: they differ by up to 1 ulp (float32) or 2 ulp
           (float64) per call, which the cancellations in σ and ``l``
           amplify. TF's sparse kernel on 1-element rows calls ``pow(x, 0.5)``
           where this uses ``sqrt``. In float64, torch's CPU ``pow`` rounds
           some inputs (0.4% with AVX2) otherwise in its vectorised loop than
           in the scalar loop that finishes each range, so a float64
           parameter's update can differ by an ulp with where an element lies
           (in an FSDP2 shard, a thread's range); float32 and half updates
           do not depend on it.
        3. ``accum_name``, ``linear_name``, ``use_locking`` and ``name`` are not
           reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``> 0``; a number, a 0-d tensor or a callable.
        learning_rate_power: ``<= 0``.
        initial_accumulator_value: ``>= 0``; the starting value of ``accum``.
        l1_regularization_strength: ``>= 0``.
        l2_regularization_strength: ``>= 0``.
        l2_shrinkage_regularization_strength: ``>= 0``; when ``> 0`` the
            gradient in ``linear`` is :math:`g + 2\lambda_s\theta`.
        beta: ``>= 0`` or None (0); adds :math:`\beta/(2\eta)` to the L2 strength.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        >>> opt = FtrlOptimizer([w], learning_rate=0.1)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.7451, -0.7451])
    """

    tf_slot_order: ClassVar[tuple[str, ...]] = ("accum", "linear")
    _hypers = (
        Hyper("lr", "learning_rate", 0.0, low_inclusive=False),
        Hyper(
            "learning_rate_power",
            "learning_rate_power",
            -math.inf,
            0.0,
            low_inclusive=False,
            high_inclusive=True,
        ),
        Hyper("initial_accumulator_value", "initial_accumulator_value", 0.0, in_param_dtype=True),
        Hyper("l1_regularization_strength", "l1_regularization_strength", 0.0),
        Hyper("l2_regularization_strength", "l2_regularization_strength", 0.0),
        Hyper("l2_shrinkage_regularization_strength", "l2_shrinkage_regularization_strength", 0.0),
        Hyper("beta", "beta", 0.0),
    )
    _slots = ("accum", "linear")

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any,
        learning_rate_power: float | Tensor | Any = -0.5,
        initial_accumulator_value: float | Tensor | Any = 0.1,
        l1_regularization_strength: float | Tensor | Any = 0.0,
        l2_regularization_strength: float | Tensor | Any = 0.0,
        l2_shrinkage_regularization_strength: float | Tensor | Any = 0.0,
        beta: float | Tensor | Any | None = None,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": learning_rate,
            "learning_rate_power": learning_rate_power,
            "initial_accumulator_value": initial_accumulator_value,
            "l1_regularization_strength": l1_regularization_strength,
            "l2_regularization_strength": l2_regularization_strength,
            "l2_shrinkage_regularization_strength": l2_shrinkage_regularization_strength,
            "beta": 0.0 if beta is None else beta,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def _init_slots(self, group, p):
        value = group["initial_accumulator_value"]
        value = value() if callable(value) and not isinstance(value, Tensor) else value
        # TF's ``ones * initial_accumulator_value``: the value is converted to the
        # parameter dtype directly, not through float32.
        return {
            "accum": torch.ones_like(p, memory_format=torch.preserve_format).mul_(value),
            "linear": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        if foreach and params[0].device.type != "cpu" and torch.compiler.is_compiling():
            # torch.compile of the foreach form on CUDA (torch 2.11, Inductor's default
            # options) gave parameters off by up to 3.07 after one step, where every other
            # rule's foreach form compiled correctly; the CPU compile is right. Inside a
            # compiled step the update is traced from the reference loop instead, which
            # Inductor also fuses (the loop is what fused=True compiles, bitwise on CUDA).
            foreach = False
        ftrl(
            params,
            grads,
            [s["accum"] for s in slots],
            [s["linear"] for s in slots],
            **_scalars(hyper),
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_ftrl(p, indices, values, slots["accum"], slots["linear"], **_scalars(hyper))


def _scalars(hyper: HyperScalars) -> dict[str, Tensor | None]:
    """The kernel's scalars in the parameter dtype; None selects TF's plain (V1, sqrt) branches.

    ``l1`` and ``two_l2`` are None where they are the Python number 0: those
    terms then drop out (see :func:`ftrl`); a tensor or callable value is not
    read on the host to find out.
    """
    two = hyper.tensor(2.0)
    # TF branches in Python on the raw values: ApplyFtrlV2 when l2_shrinkage > 0,
    # and the kernels special-case lr_power == -0.5 as sqrt.
    shrinkage = hyper.value("l2_shrinkage_regularization_strength") > 0
    sqrt_power = hyper.value("learning_rate_power") == -0.5
    no_l1 = hyper.is_zero("l1_regularization_strength")
    no_l2 = hyper.is_zero("l2_regularization_strength") and hyper.is_zero("beta")
    return {
        "lr": hyper.lr,
        "l1": None if no_l1 else hyper.l1_regularization_strength,
        "two_l2": None if no_l2 else two * _adjusted_l2(hyper),
        "two_l2_shrinkage": two * hyper.l2_shrinkage_regularization_strength if shrinkage else None,
        "neg_lr_power": None if sqrt_power else -hyper.learning_rate_power,
    }


def _adjusted_l2(hyper: HyperScalars) -> Tensor:
    """TF's effective L2, ``l2 + beta / (2 * max(lr, 1e-36))``, then in the parameter dtype.

    TF evaluates it in float32, or in float64 when a float64 tensor takes part: its Python
    numbers then enter in float64 directly.
    """
    names = ("lr", "l2_regularization_strength", "beta")
    values = [hyper.value(name) for name in names]
    if any(isinstance(v, Tensor) and v.dtype == torch.float64 for v in values):
        lr, l2, beta = (torch.as_tensor(v, dtype=torch.float64, device=hyper.device) for v in values)
    else:
        lr, l2, beta = (float32_tensor(v, hyper.device) for v in values)
    return (l2 + beta / (2.0 * torch.clamp_min(lr, 1e-36))).to(hyper.dtype)


def _power(x: Tensor, neg_lr_power: Tensor | None) -> Tensor:
    """``x ** -lr_power``; TF computes the default ``lr_power = -0.5`` as ``sqrt``.

    Other powers of float32 and half tensors are taken in float64 and rounded.
    torch's float32 ``pow`` on CPU gives other bits in its vectorised loop than
    in the scalar loop that finishes each range (by an ulp, for 0.7% of inputs
    with AVX2), so a value's power would depend on where it lies: in a shard of
    FSDP2, in one thread's range, in a fused kernel. Rounded from float64, where
    the two loops differ by far less than a float32 ulp, every offset gets the
    same bits. (float64 tensors keep that dependence: see the class docstring.)
    """
    if neg_lr_power is None:
        return sqrt(x)
    if x.dtype == torch.float64:
        return torch.pow(x, neg_lr_power)
    return torch.pow(x.double(), neg_lr_power.double()).to(x.dtype)


def _foreach_power_(xs: list[Tensor], neg_lr_power: Tensor | None) -> None:
    """``x ← x ** -lr_power`` in place for every ``x`` in ``xs`` (see ``_power``)."""
    if neg_lr_power is None:
        foreach_sqrt_(xs)
        return
    # A list of exponents keeps torch.pow(Tensor, Tensor); a single 0-d tensor
    # would become a Python scalar, whose kernel special-cases some exponents.
    if not xs or xs[0].dtype == torch.float64:
        torch._foreach_pow_(xs, [neg_lr_power] * len(xs))
        return
    wide = [x.double() for x in xs]
    torch._foreach_pow_(wide, [neg_lr_power.double()] * len(wide))
    torch._foreach_copy_(xs, wide)


def _single_tensor_ftrl(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    linears: list[Tensor],
    *,
    lr: Tensor,
    l1: Tensor | None,
    two_l2: Tensor | None,
    two_l2_shrinkage: Tensor | None,
    neg_lr_power: Tensor | None,
) -> None:
    for p, g, a, lin in zip(params, grads, accums, linears, strict=True):
        new_a = a + g * g  # 1. n = a + g²
        g_hat = g if two_l2_shrinkage is None else g + two_l2_shrinkage * p  # 2. ĝ = g + 2λₛθ
        root = _power(new_a, neg_lr_power)
        sigma = (root - _power(a, neg_lr_power)).div_(lr)  # 3. σ = (n⁻ᵖ - a⁻ᵖ)/η
        lin.add_(g_hat - sigma.mul_(p))  # 4. l = l + (ĝ - σθ)
        x = lin.neg() if l1 is None else torch.sign(lin).mul_(l1).sub_(lin)  # 5. x = λ₁ sign(l) - l
        y = root.div_(lr) if two_l2 is None else root.div_(lr).add_(two_l2)  # 6. y = n⁻ᵖ/η + 2λ₂
        live = lin.abs() > (0.0 if l1 is None else l1)
        p.copy_(torch.where(live, x.div_(y), 0.0))  # 7. θ = x/y where |l| > λ₁, else 0
        a.copy_(new_a)  # 8. a = n


def _multi_tensor_ftrl(
    params: list[Tensor],
    grads: list[Tensor],
    accums: list[Tensor],
    linears: list[Tensor],
    *,
    lr: Tensor,
    l1: Tensor | None,
    two_l2: Tensor | None,
    two_l2_shrinkage: Tensor | None,
    neg_lr_power: Tensor | None,
    scratch: list[list[Tensor]],
) -> None:
    # Temporaries go into the three scratch lists (copy_ + in-place ops, no
    # allocation); a is overwritten by n once a⁻ᵖ is taken. add_ of a bare 0-d
    # tensor binds to the Scalar overload, which reads it on the host and costs
    # ~4x the per-tensor overhead, so 2λ₂ goes in as a list.
    tmp, step, roots = scratch
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, tmp)
    torch._foreach_copy_(step, accums)
    _foreach_power_(step, neg_lr_power)
    torch._foreach_add_(accums, tmp)
    torch._foreach_copy_(roots, accums)
    _foreach_power_(roots, neg_lr_power)
    torch._foreach_copy_(tmp, roots)
    torch._foreach_sub_(tmp, step)
    torch._foreach_div_(tmp, lr)
    torch._foreach_mul_(tmp, params)
    if two_l2_shrinkage is None:
        torch._foreach_copy_(step, grads)
    else:
        torch._foreach_copy_(step, params)
        torch._foreach_mul_(step, two_l2_shrinkage)
        torch._foreach_add_(step, grads)
    torch._foreach_sub_(step, tmp)
    torch._foreach_add_(linears, step)
    torch._foreach_div_(roots, lr)
    if two_l2 is not None:
        torch._foreach_add_(roots, [two_l2] * len(roots))
    # θ = (clamp(l, 0 - λ₁, λ₁) - l) / y, TF's sparse form, without a select:
    # where |l| > λ₁ it is line 7's x/y (the clamp is ±λ₁ = sign(l)·λ₁), and
    # elsewhere it is +0/y = +0, except that it is NaN where y is 0 or NaN, or l
    # is NaN. The bound 0 - λ₁ is +0 when λ₁ = 0, so that clamping a +0 gives
    # +0 whichever operand a kernel returns on ties; clamp(l, +0, +0) - l is 0 - l.
    if l1 is None:
        torch._foreach_zero_(params)
    else:
        torch._foreach_copy_(params, linears)
        torch._foreach_clamp_min_(params, [torch.zeros_like(l1).sub_(l1)] * len(params))
        torch._foreach_clamp_max_(params, [l1] * len(params))
    torch._foreach_sub_(params, linears)
    torch._foreach_div_(params, roots)
    # torch.where is a scalar loop on CPU (several arithmetic passes' worth), so
    # there it runs only on the tensors holding a NaN, found by their norms; on
    # other devices, and traced by torch.compile (where a host read breaks the graph), it
    # runs on every tensor rather than read the norms on the host.
    if params[0].device.type == "cpu" and not torch.compiler.is_compiling():
        has_nan = torch.stack(torch._foreach_norm(params)).isnan().tolist()
    else:
        has_nan = [True] * len(params)
    for p, lin, nan in zip(params, linears, has_nan, strict=True):
        if nan:
            p.copy_(torch.where(lin.abs() > (0.0 if l1 is None else l1), p, 0.0))


ftrl = functional(
    _single_tensor_ftrl,
    _multi_tensor_ftrl,
    scratch=3,
    doc="""Functional form of :class:`FtrlOptimizer`'s dense update.

    ``two_l2`` is twice the effective L2 strength; ``two_l2_shrinkage`` is None
    for TF's ``ApplyFtrl`` (no shrinkage); ``neg_lr_power`` is None for
    ``learning_rate_power == -0.5`` (square roots). ``l1=None`` stands for
    λ₁ = 0 and ``two_l2=None`` for 2λ₂ = 0: the results are those of zero
    tensors, without their no-op arithmetic (``y + 0`` is ``y``, as ``y ≥ +0``;
    ``x`` is ``-l`` wherever the dead zone keeps ``x/y``).
    """,
)


def _sparse_ftrl(
    p: Tensor,
    indices: Tensor,
    values: Tensor,
    accum: Tensor,
    linear: Tensor,
    *,
    lr: Tensor,
    l1: Tensor | None,
    two_l2: Tensor | None,
    two_l2_shrinkage: Tensor | None,
    neg_lr_power: Tensor | None,
) -> None:
    # TF's SparseApplyFtrl(V2) on the given (unique) rows.
    theta = p.index_select(0, indices)
    a = accum.index_select(0, indices)
    lin = linear.index_select(0, indices)
    new_a = a + values * values
    g_hat = values if two_l2_shrinkage is None else values + two_l2_shrinkage * theta
    root = _power(new_a, neg_lr_power)
    sigma_theta = (root - _power(a, neg_lr_power)).div_(lr).mul_(theta)
    if one_element_rows(p):
        # TF's kernel for one element per row is scalar C++: (l + ĝ) - σθ.
        lin = (lin + g_hat).sub_(sigma_theta)
    else:
        lin = lin + (g_hat - sigma_theta)
    x = torch.zeros_like(lin).sub_(lin) if l1 is None else torch.clamp(lin, -l1, l1).sub_(lin)
    y = root.div_(lr) if two_l2 is None else root.div_(lr).add_(two_l2)
    p.index_copy_(0, indices, x.div_(y))
    accum.index_copy_(0, indices, new_a)
    linear.index_copy_(0, indices, lin)
