"""``fused=True``: a rule's reference loop run as compiled kernels over whole lists."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .kernel import _FusedKernel
from .plan import _FusedPlan

if TYPE_CHECKING:
    from .._census import SameMeta, _SlotRecord


class FusedStep:
    """What a step of ``Optimizer._apply`` hands the fused kernels of one bucket besides its
    tensors (None for a functional call from elsewhere).

    - ``in_step``: every row has its parameter's shape (``step()`` and ``apply_gradients``
      checked the gradients; slots are made and loaded so), which the plan need not check again;
    - ``held``: the kept metadata that the step's census found the bucket's parameters and
      gradients (these very lists) to have, and that its check of the slots found (None without
      slots), with nothing run since that could change them (see ``_FusedPlan._holds_as_last_found``);
    - ``calls``: the step is recorded for replay: each call appends what it ran, or None where it
      took another way than one plan's kernel calls;
    - ``unscaling``: the kernels unscale the gradients in their own pass (``LossScaleOptimizer``,
      see :func:`_unscaling`);
    - ``replaying``: the call recorded for the step being replayed (see ``_StepReplay``), whose
      tensors are the very ones its plan was made for: it serves if the rule asks for that kernel
      again (see :class:`RecordedCall`).
    """

    __slots__ = ("calls", "held", "in_step", "replaying", "unscaling")

    def __init__(
        self,
        in_step: bool,
        held: tuple[SameMeta, list[Tensor], list[Tensor], _SlotRecord | None] | None = None,
        calls: list[Any] | None = None,
        unscaling: Unscaling | None = None,
        replaying: RecordedCall | None = None,
    ):
        self.in_step, self.held, self.calls, self.unscaling = in_step, held, calls, unscaling
        self.replaying = replaying


def run_fused(
    single: Callable[..., None], step: FusedStep | None, *lists: list[Tensor], **scalars: Any
) -> None:
    """Run the reference loop ``single`` over ``lists`` (params, grads, slots) as compiled kernels.

    ``step``: what ``Optimizer._apply`` knows of this call (see :class:`FusedStep`); None for a
    functional call, whose rows are checked in full.

    Inductor turns the loop's ops on one tensor into one loop over its
    elements, so each element of a parameter, its gradient and its slots is
    read once and written once (C++/OpenMP on CPU, Triton on CUDA); the
    arithmetic is the reference's, op for op. Compiling over the whole list
    costs minutes for a thousand tensors, so the kernel takes ``FUSED_CHUNK``
    tensors at a time, flattened, with symbolic sizes: one graph serves every
    chunk, step, learning rate (hyperparameters are 0-d tensor inputs) and
    loaded checkpoint, and is called directly (see :class:`_FusedKernel`).
    The last chunk is filled up with small tensors of zeros kept for that
    purpose (what the update makes of them is thrown away). Tensors the kernel
    cannot take flattened (see :func:`_layouts`) or with fewer than two elements
    (torch.compile specialises sizes 0 and 1) go through the reference loop
    itself. Inside a caller's own ``torch.compile`` the loop is traced into
    the caller's graph instead, and with grad mode on it runs as it is. How
    the tensors are split and flattened is kept between steps (see
    :class:`_FusedPlan`). On CUDA, a step's kernel calls are replayed as one
    CUDA graph while the gradients stay where they were (see :class:`_StepGraph`).
    """
    replaying = step.replaying if step is not None else None
    unscaling = step.unscaling if step is not None else None
    if replaying is not None and unscaling is None and replaying.made_with(single, scalars):
        replaying.plan.call(replaying.kernel, lists, scalars)
        return
    for name, value in scalars.items():
        # The kernels read each tensor hyperparameter as one value (the optimizers' are 0-d); one
        # of another shape, which the loop would broadcast, would be read as its first element.
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(
                f"fused update: {name} must be a tensor of one element, got shape {tuple(value.shape)}"
            )
    if unscaling is not None:
        single = _unscaling(single)
        scalars = {**scalars, "inv_scale": unscaling.inv_scale}
        unscaling.started = True
    calls = step.calls if step is not None else None
    if calls is not None:
        calls.append(None)  # (replaced below where the step can be replayed)
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        # The kernels are compiled for no_grad (as optimizers step). With grad mode on, the
        # functional form does what the loop does: refuse in-place updates of leaves that
        # require grad, record the others for autograd.
        single(*lists, **scalars)
        return
    if not lists[0]:
        return
    given = scalars
    scalars = _distinct_scalars(scalars)
    kernel = _FusedKernel.of(single, lists, scalars)
    if replaying is not None and replaying.kernel is kernel:
        replaying.plan.call(kernel, lists, scalars)
        return
    plan = _FusedPlan.of(single, lists, kernel, scalars, step)
    if plan.loop_rows:
        single(*[[lst[i] for i in plan.loop_rows] if lst else [] for lst in lists], **scalars)
    if not plan.chunks:
        return
    if plan.on_cuda and kernel.direct is not None:
        graph = plan.step_graph(kernel, lists, scalars)
        if graph is not None:
            graph.replay(scalars)
            return
    plan.call(kernel, lists, scalars)
    if calls is not None and plan.as_they_are:
        as_given = unscaling is None and scalars is given
        calls[-1] = (RecordedCall(kernel, plan, single if as_given else None, given), lists)


class RecordedCall:
    """A fused call of a step recorded for replay (see ``_StepReplay``): its kernel and plan, and
    the rule and scalars it was made with.

    A replayed step calls the rule again, which computes its scalars afresh; where it passes the
    very objects it passed then (the hyperparameters' kept tensors, Python numbers, flags), the
    kernel is the one found then and nothing is looked up or checked again. ``single`` is None
    where that cannot be told by identity (the kernels unscaled the gradients, or two scalars
    were one tensor, which the kernel got a copy of).
    """

    __slots__ = ("kernel", "plan", "scalars", "single")

    def __init__(
        self,
        kernel: _FusedKernel,
        plan: _FusedPlan,
        single: Callable[..., None] | None,
        scalars: dict[str, Any],
    ):
        self.kernel, self.plan, self.single, self.scalars = kernel, plan, single, scalars

    def made_with(self, single: Callable[..., None], scalars: dict[str, Any]) -> bool:
        """Whether a call of ``single`` with ``scalars`` is this call again: the same function and
        the same scalar objects under the same names."""
        recorded = self.scalars
        if single is not self.single or len(scalars) != len(recorded):
            return False
        for name, value in scalars.items():
            if recorded.get(name, _MISSING) is not value:
                return False
        return True


_MISSING = object()


class Unscaling:
    """What a loss scale hands the fused kernels of one step that unscale its gradients (see
    ``Optimizer.step``'s ``unscaling``): the inverse of the loss scale (a 0-d float32 tensor), and
    whether a kernel has started (then some gradients are unscaled: a new backward pass is needed)."""

    __slots__ = ("inv_scale", "started")

    def __init__(self, inv_scale: Tensor):
        self.inv_scale, self.started = inv_scale, False


@functools.cache
def _unscaling(single: Callable[..., None]) -> Callable[..., None]:
    """The rule ``single`` after ``g *= inv_scale`` for every gradient, in place.

    Fused, each gradient element is read once, multiplied, written back (so that
    ``p.grad`` ends unscaled, as after torch's check-and-unscale kernel) and used
    by the update in the same pass: float32 math for float32 gradients, float64
    for float64 ones (the float32 scalar is widened), which are the products that
    kernel makes. A kernel of its own per rule (the function is kept).
    """

    def unscaled(
        params: list[Tensor], grads: list[Tensor], *slots: list[Tensor], inv_scale: Tensor, **scalars: Any
    ) -> None:
        for g in grads:
            g.mul_(inv_scale)
        single(params, grads, *slots, **scalars)

    unscaled.__name__ = unscaled.__qualname__ = f"unscaled{single.__name__}"
    return unscaled


def _distinct_scalars(scalars: dict[str, Any]) -> dict[str, Any]:
    """``scalars`` with no tensor under two names (the later ones cloned).

    Dynamo makes one graph input of a tensor that two arguments share (a user's
    0-d tensor passed as both ``learning_rate`` and ``momentum``); the kernel,
    kept for every later step and optimizer of its rule, would then read one
    value for both.
    """
    seen: set[int] = set()
    distinct: dict[str, Any] | None = None
    for name, value in scalars.items():
        if isinstance(value, Tensor):
            if id(value) in seen:
                distinct = distinct or dict(scalars)
                distinct[name] = value.clone()
            seen.add(id(value))
    return scalars if distinct is None else distinct
