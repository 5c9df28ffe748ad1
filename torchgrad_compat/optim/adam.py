"""``tf.compat.v1.train.AdamOptimizer`` as a torch optimizer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._dispatch import functional
from ._hyper import Hyper, HyperScalars, float32_tensor
from ._numerics import foreach_sqrt_, sqrt
from .optimizer import Optimizer, Params

__all__ = ["AdamOptimizer", "adam"]


def _alpha(non_slot: dict[str, Tensor], hyper: HyperScalars) -> Tensor:
    """α = η·√(1 - p₂) / (1 - p₁), in the parameter dtype (TF casts the powers first)."""
    beta1_power = non_slot["beta1_power"].to(device=hyper.device, dtype=hyper.dtype)
    beta2_power = non_slot["beta2_power"].to(device=hyper.device, dtype=hyper.dtype)
    return hyper.lr * sqrt(hyper.one - beta2_power) / (hyper.one - beta1_power)


class AdamOptimizer(Optimizer):
    r"""Adam, exactly as TensorFlow v1's ``AdamOptimizer``.

    With :math:`\eta` = ``learning_rate``, :math:`\beta_1` = ``beta1``,
    :math:`\beta_2` = ``beta2``, :math:`\hat\epsilon` = ``epsilon`` and the
    optimizer-wide powers :math:`p_1 = \beta_1^t`, :math:`p_2 = \beta_2^t`:

    .. math::
        \alpha &= \eta\sqrt{1 - p_2} / (1 - p_1) \\
        m &\leftarrow m + (g - m)(1 - \beta_1) \\
        v &\leftarrow v + (g^2 - v)(1 - \beta_2) \\
        \theta &\leftarrow \theta - m\alpha / (\sqrt{v} + \hat\epsilon)

    and, once per ``step``/``apply_gradients`` after every parameter is
    updated, :math:`p_1 \leftarrow p_1\beta_1`, :math:`p_2 \leftarrow p_2\beta_2`.

    Slots: ``m`` (0; torch's ``exp_avg``) and ``v`` (0; torch's ``exp_avg_sq``).
    Non-slot state: ``beta1_power`` and ``beta2_power``, float32, starting at
    ``beta1`` and ``beta2``: one pair per param group (TF keeps one per
    optimizer), advanced once per call whether or not a parameter had a
    gradient, kept in the param group (``group["beta1_power"]``) and so saved
    in ``state_dict()["param_groups"]``.

    Each param group also holds torch's ``betas = (beta1, beta2)``, so that
    schedulers which cycle momentum (``OneCycleLR``, ``CyclicLR``) find and
    cycle ``beta1``. The two spellings are reconciled before every update and
    every ``state_dict()``: whichever was changed since the last update is
    copied to the other (changing both is a ``ValueError``); a group dict may
    give ``betas`` in place of ``beta1``/``beta2``. ``beta1_power`` starts at
    the ``beta1`` of construction, so a scheduler that sets ``beta1`` before
    the first step (OneCycleLR) starts from that power, as a TF variable
    initialised from the constructor's ``beta1`` would.

    Sparse gradients (row-sparse COO) follow TF's sparse rule, which is *not*
    lazy: duplicate rows are summed, then ``m`` and ``v`` of every row decay
    (``m ← m β₁``, ``m[rows] += g (1-β₁)``, likewise ``v``) and every row of
    the parameter moves. TF builds that rule from graph ops, which a TF1 session
    rewrites (Grappler, on by default): with ``beta2`` a number it scales the
    square as ``g·(g(1-β₂))``, not as the source's ``(g·g)(1-β₂)``; so does this
    rule (a tensor ``beta2``, a variable in TF, keeps the source's order).

    Differences from ``torch.optim.Adam``:
        1. ``epsilon`` is added to :math:`\sqrt{v}`, not to the bias-corrected
           :math:`\sqrt{\hat v}` (TF's "epsilon hat"): a TF ``epsilon`` equals
           torch's ``eps`` times :math:`\sqrt{1-\beta_2^t}`.
        2. The step count is optimizer-wide: a parameter that skipped steps
           still sees :math:`t` advance (torch counts per parameter).
        3. The bias corrections use float32 running products of the betas, and
           ``1 - beta`` is evaluated in float32 (``1 - 0.999 = 0.0009999871``).
        4. Sparse gradients decay every row (``torch.optim.SparseAdam`` is lazy).

    ``use_locking`` and ``name`` are not reproduced.

    Args:
        params: tensors or param-group dicts.
        learning_rate: ``>= 0``; a number, a 0-d tensor or a callable.
        beta1: in ``[0, 1)``.
        beta2: in ``[0, 1)``.
        epsilon: ``>= 0``.
        foreach: use the multi-tensor path; None picks it where torch would.
        fused: update through kernels torch.compile generates, one pass over the
            parameter, its gradient and its slots (CPU and CUDA; see docs/fused.md).

    Raises:
        ValueError: a hyperparameter is out of range, NaN or infinite.
        TypeError: a hyperparameter is not a number, 0-d tensor or callable.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        >>> opt = AdamOptimizer([w], learning_rate=0.1)
        >>> opt.minimize(lambda: (w * w).sum())
        >>> w.detach()
        tensor([ 0.9000, -0.9000])
    """

    # beta1_power = beta1**t: 1 would divide by zero in the bias correction.
    _non_slot_ranges = (
        Hyper("beta1_power", "beta1_power", 0.0, 1.0),
        Hyper("beta2_power", "beta2_power", 0.0, 1.0),
    )
    tf_slot_order: ClassVar[tuple[str, ...]] = ("m", "v")
    tf_non_slot_names: ClassVar[tuple[str, ...]] = ("beta1_power", "beta2_power")
    _hypers = (
        Hyper("lr", "learning_rate", 0.0),
        Hyper("beta1", "beta1", 0.0, 1.0),
        Hyper("beta2", "beta2", 0.0, 1.0),
        Hyper("epsilon", "epsilon", 0.0),
    )
    _slots = ("m", "v")

    def __init__(
        self,
        params: Params,
        learning_rate: float | Tensor | Any = 0.001,
        beta1: float | Tensor | Any = 0.9,
        beta2: float | Tensor | Any = 0.999,
        epsilon: float | Tensor | Any = 1e-08,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": learning_rate,
            "beta1": beta1,
            "beta2": beta2,
            "betas": (beta1, beta2),
            "epsilon": epsilon,
            "foreach": foreach,
            "fused": fused,
        }
        # ``betas`` of each group as last reconciled with ``beta1``/``beta2``, by the group dict's
        # identity (see _sync_aliases): a group listed twice is one group, whatever its index.
        self._synced_betas: dict[int, tuple[dict[str, Any], tuple[Any, Any]]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; torch's ``betas=(beta1, beta2)`` is accepted in place of TF's two keys."""
        group = dict(param_group)
        if "betas" in group:
            if "beta1" in group or "beta2" in group:
                raise ValueError(
                    f"param group gives both 'betas' ({group['betas']!r}) and 'beta1'/'beta2'; give one"
                )
            group["beta1"], group["beta2"] = _check_betas(group.pop("betas"))
        super().add_param_group(group)
        added = self.param_groups[-1]
        added["betas"] = (added["beta1"], added["beta2"])
        self._synced_betas[id(added)] = (added, added["betas"])

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A loaded group's beta1/beta2 are the truth (state_dict() saves them reconciled).
        super().__setstate__(state)
        for group in self.param_groups:
            group["betas"] = (group["beta1"], group["beta2"])
        self._synced_betas = {id(group): (group, group["betas"]) for group in self.param_groups}

    def _sync_aliases(self) -> None:
        # Schedulers that cycle momentum (OneCycleLR, CyclicLR) write torch's
        # group["betas"]; TF code writes group["beta1"]. Whichever changed since the
        # last reconciliation is copied to the other. A group this optimizer has not reconciled
        # yet (a dict put into param_groups by other code) takes beta1/beta2 as the truth.
        synced_before, synced_now = self._synced_betas, {}
        for i, group in enumerate(self.param_groups):
            betas, tf_betas = group["betas"], (group["beta1"], group["beta2"])
            kept = synced_now.get(id(group)) or synced_before.get(id(group))
            synced = kept[1] if kept is not None and kept[0] is group else betas
            if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
                _check_betas(betas)  # names "betas" (the comparison below would fail on its shape)
            betas_moved, tf_moved = not _same(betas, synced), not _same(tf_betas, synced)
            if betas_moved and tf_moved:
                raise ValueError(
                    f"param group {i} changed both 'betas' (to {betas!r}) and 'beta1'/'beta2' (to "
                    f"{tf_betas!r}) since the last step; change one of them"
                )
            if betas_moved:
                group["beta1"], group["beta2"] = _check_betas(betas)
            elif tf_moved:
                # Checked before use, with every hyperparameter (a state_dict() may still save it).
                group["betas"] = tf_betas
            synced_now[id(group)] = (group, group["betas"])
        self._synced_betas = synced_now

    def _init_slots(self, group, p):
        return {
            "m": torch.zeros_like(p, memory_format=torch.preserve_format),
            "v": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def _init_non_slot(self, group, device):
        def power(beta: Any) -> Tensor:
            beta = beta() if callable(beta) and not isinstance(beta, Tensor) else beta
            return torch.as_tensor(beta, dtype=torch.float32, device=device).detach().clone()

        return {"beta1_power": power(group["beta1"]), "beta2_power": power(group["beta2"])}

    def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
        foreach, fused = path
        adam(
            params,
            grads,
            [s["m"] for s in slots],
            [s["v"] for s in slots],
            alpha=_alpha(non_slot, hyper),
            one_minus_beta1=hyper.one - hyper.beta1,
            one_minus_beta2=hyper.one - hyper.beta2,
            epsilon=hyper.epsilon,
            foreach=foreach,
            fused=fused,
            scratch=self._scratch,
        )

    def _apply_sparse(self, group, p, indices, values, slots, non_slot, hyper):
        _sparse_adam(p, indices, values, slots["m"], slots["v"], alpha=_alpha(non_slot, hyper), hyper=hyper)

    def _finish(self, group, non_slot, values):
        for name, key in (("beta1_power", "beta1"), ("beta2_power", "beta2")):
            power = non_slot[name]
            beta = float32_tensor(values[key], power.device)
            self._advance(non_slot, name, torch.mul, beta)


def _check_betas(betas: Any) -> tuple[Any, Any]:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"betas must be a pair (beta1, beta2), got {type(betas).__name__}: {betas!r}")
    for spec, value in zip(AdamOptimizer._hypers[1:3], betas, strict=True):
        spec.check(value)
    return betas[0], betas[1]


def _same(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two pairs of hyperparameters hold the same values (tensors and callables: the same objects)."""
    return all(x is y or (_is_number(x) and _is_number(y) and x == y) for x, y in zip(a, b, strict=True))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _single_tensor_adam(
    params: list[Tensor],
    grads: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    *,
    alpha: Tensor,
    one_minus_beta1: Tensor,
    one_minus_beta2: Tensor,
    epsilon: Tensor,
) -> None:
    for p, g, m, v in zip(params, grads, ms, vs, strict=True):
        m.add_((g - m).mul_(one_minus_beta1))  # 1. m = m + (g - m)(1-β₁)
        v.add_((g * g).sub_(v).mul_(one_minus_beta2))  # 2. v = v + (g² - v)(1-β₂)
        p.sub_((m * alpha).div_(sqrt(v).add_(epsilon)))  # 3. θ = θ - mα / (√v + ε̂)


def _multi_tensor_adam(
    params: list[Tensor],
    grads: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    *,
    alpha: Tensor,
    one_minus_beta1: Tensor,
    one_minus_beta2: Tensor,
    epsilon: Tensor,
    scratch: list[list[Tensor]],
) -> None:
    # Temporaries go into the two scratch lists (copy_ + in-place ops, no
    # allocation). addcdiv_ with value=-1 rounds as θ - q: the product by -1 is exact.
    tmp, denom = scratch
    torch._foreach_copy_(tmp, grads)
    torch._foreach_sub_(tmp, ms)
    torch._foreach_mul_(tmp, one_minus_beta1)
    torch._foreach_add_(ms, tmp)
    torch._foreach_copy_(tmp, grads)
    torch._foreach_mul_(tmp, grads)
    torch._foreach_sub_(tmp, vs)
    torch._foreach_mul_(tmp, one_minus_beta2)
    torch._foreach_add_(vs, tmp)
    torch._foreach_copy_(denom, vs)
    foreach_sqrt_(denom)
    # add_ of a bare 0-d tensor binds to the Scalar overload, which reads it on the host (a graph
    # break under torch.compile) and costs 2-10x the time on the CPU; a list of it broadcasts.
    torch._foreach_add_(denom, [epsilon] * len(denom))
    torch._foreach_copy_(tmp, ms)
    torch._foreach_mul_(tmp, alpha)
    torch._foreach_addcdiv_(params, tmp, denom, value=-1)


adam = functional(
    _single_tensor_adam,
    _multi_tensor_adam,
    scratch=2,
    doc="""Functional form of :class:`AdamOptimizer`'s dense update (scalars in the params' dtype).""",
)


def _sparse_adam(p, indices, values, m, v, *, alpha, hyper):
    # TF's _apply_sparse_shared: every row decays and moves; only the given rows
    # receive the gradient. The association differs from the dense kernel.
    m.mul_(hyper.beta1).index_add_(0, indices, values * (hyper.one - hyper.beta1))
    # TF's source scales the square, (g·g)(1-β₂); a TF1 session (Grappler, on by default) rewrites
    # that into g·(g(1-β₂)) where 1-β₂ is a constant of the graph: β₂ a number. (A tensor β₂, a
    # variable in TF, keeps the source's order.) The two differ by an ulp for a third of elements.
    if isinstance(hyper.value("beta2"), Tensor):
        scaled_square = (values * values) * (hyper.one - hyper.beta2)
    else:
        scaled_square = values * (values * (hyper.one - hyper.beta2))
    v.mul_(hyper.beta2).index_add_(0, indices, scaled_square)
    p.sub_((alpha * m).div_(sqrt(v).add_(hyper.epsilon)))
