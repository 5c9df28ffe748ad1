"""What ``LossScaleOptimizer`` keeps and checks of the gradients between a scaled backward pass and
the step: the marks of what happened to them (:class:`_StepMarks`), the census of the usual
gradients, and the checks that each is a tensor of its own, read once."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .._torch_internals import version
from ..optim.wrapper import SameMeta, bytes_spanned

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_NBYTES_OF = operator.attrgetter("nbytes")
# One device and dtype.
_Kind = tuple[torch.device, torch.dtype]


class _StepMarks:
    """What has happened to ``p.grad`` since the last update, for ``step()`` to check.

    One object, held by reference: a proxy that copies the optimizer's
    ``__dict__`` (Lightning's ``LightningOptimizer``) reads and changes the same
    marks as the optimizer itself, so ``unscale_()`` through the proxy and
    ``step()`` through the optimizer agree.
    """

    __slots__ = ("backward_after_unscale", "found_inf", "left", "scaled_backward", "stepped", "unscaled")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """No gradients yet (construction, ``zero_grad()``)."""
        self.scaled_backward = False  # a backward pass went through get_scaled_loss's result
        self.stepped = False  # an update used the gradients since the last zero_grad()
        self.unscaled = False  # unscale_() (or a step() that raised) divided p.grad by the scale
        self.found_inf: Tensor | None = None  # then: its non-finite flag
        # and each p.grad as unscale_() left it, with its version then (see changed_since_unscale)
        self.left: list[tuple[Tensor | None, int]] = []
        self.backward_after_unscale = False  # and a scaled backward pass came after it

    def updated(self) -> None:
        """An update used the gradients: the next one needs a new scaled backward pass."""
        self.clear()
        self.stepped = True

    def leave(self, grads: list[Tensor | None]) -> None:
        """``unscale_()`` left ``p.grad`` so (one entry per parameter)."""
        self.left = [(g, -1 if g is None else version(g)) for g in grads]

    def changed_since_unscale(self, grads: list[Tensor | None]) -> bool:
        """Whether some ``p.grad`` was replaced or written in place since ``unscale_()`` (clipped,
        for one): its check of the gradients no longer speaks for them."""
        left = self.left
        if len(left) != len(grads):
            return True
        return any(
            g is not was or (g is not None and version(g) != v)
            for g, (was, v) in zip(grads, left, strict=True)
        )

    def record_scaled_backward(self, grad: Tensor) -> None:
        """The tensor hook on ``get_scaled_loss``'s result: a backward pass went through it."""
        self.scaled_backward = True
        if self.unscaled:
            self.backward_after_unscale = True

    def check_no_backward_after_unscale(self) -> None:
        """Refuse to step on gradients a scaled backward pass reached after ``unscale_()``.

        They are scaled (added to the unscaled ones, unless something such as
        ``model.zero_grad()`` cleared those), and ``step()`` would apply them
        as they are, multiplied by the scale.
        """
        if self.unscaled and self.backward_after_unscale:
            raise RuntimeError(
                "LossScaleOptimizer.step(): a backward pass through opt.get_scaled_loss(loss) came "
                "after unscale_(), so p.grad holds scaled gradients that step() would not divide by "
                "the scale. Call opt.zero_grad() (which also forgets unscale_()) before the next "
                "backward pass, or call unscale_() after the last one"
            )

    def check_scaled_backward(self, caller: str) -> None:
        """Refuse to unscale gradients that no backward pass through ``get_scaled_loss`` produced."""
        if self.scaled_backward:
            return
        if self.stepped:
            why = (
                "since the last step() (or apply_gradients()): a second step() would apply the same "
                "gradients again, and gradients of loss.backward() on the unscaled loss would be "
                "divided by the scale"
            )
        else:
            why = (
                "since zero_grad() (or since the optimizer was made): p.grad is not scaled (was "
                "loss.backward() called on the unscaled loss, e.g. by a trainer?), and unscaling it "
                "would divide the update by the scale"
            )
        raise RuntimeError(
            f"LossScaleOptimizer.{caller}(): no backward pass went through opt.get_scaled_loss(loss) "
            f"{why}. Call opt.zero_grad(), then opt.get_scaled_loss(loss).backward() (once per "
            "micro-batch when accumulating), then step(); or pass unscaled gradients to "
            "apply_gradients() (see opt.get_unscaled_gradients). A trainer that calls "
            "loss.backward() itself must scale the loss first: see the recipes in docs/amp.md."
        )


# torch optimizers whose fused kernels skip the whole update on device when handed
# ``found_inf`` (``_step_supports_amp_scaling``), each with what it needs to have
# created first: a skipped first step would create state, and for SGD with
# momentum that state is an uninitialised buffer, which the skip leaves in place.
_FUSED_SKIPPERS: dict[type[torch.optim.Optimizer], Callable[[torch.optim.Optimizer], bool]] = {
    torch.optim.Adam: lambda opt: _every_state_exists(opt, "exp_avg"),
    torch.optim.AdamW: lambda opt: _every_state_exists(opt, "exp_avg"),
    torch.optim.Adagrad: lambda opt: _every_state_exists(opt, "sum"),
    torch.optim.SGD: lambda opt: _every_state_exists(opt, "momentum_buffer", lambda g: g["momentum"] != 0),
}


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a torch fused optimizer that can apply-or-skip on ``found_inf`` now.

    Only the exact classes of ``_FUSED_SKIPPERS`` (a subclass may step
    differently), with ``fused=True``, and only once the state of every parameter
    with a gradient exists.
    """
    ready = _FUSED_SKIPPERS.get(type(optimizer))
    return ready is not None and getattr(optimizer, "_step_supports_amp_scaling", False) and ready(optimizer)


def _every_state_exists(
    optimizer: torch.optim.Optimizer,
    slot: str,
    needed: Callable[[dict[str, Any]], bool] = lambda group: True,
) -> bool:
    """Every parameter with a gradient, in a group that ``needed``, has a ``slot`` tensor."""
    return all(
        isinstance(optimizer.state.get(p, {}).get(slot), Tensor)
        for group in optimizer.param_groups
        if needed(group)
        for p in group["params"]
        if p.grad is not None
    )


class _UsualGrads:
    """What a step found when every parameter had a gradient, each a tensor of its own, dense,
    contiguous, fitting its parameter, all of one device and dtype (``kind``): kept, as its
    census is (:func:`~torchgrad_compat.optim.wrapper.kept_census`), while every parameter and
    gradient has the metadata it had then. With it the verdict of
    :func:`_each_at_its_own_address` at the addresses last seen, which the metadata and the
    addresses decide.

    At 1000 gradients of 16 elements, ``_unscale_grads`` then takes about 0.85 ms of host time
    against 1.5 ms for finding it all again, while the addresses stay (``zero_grad(set_to_none=
    False)``); new gradient tensors at every step (torch's default ``zero_grad()``) move them,
    and the sweep, 0.5 to 0.8 ms, runs again."""

    __slots__ = ("grad_starts", "kind", "meta", "own", "param_starts")

    def __init__(self, meta: SameMeta, kind: _Kind):
        self.meta, self.kind = meta, kind
        self.grad_starts: list[int] | None = None
        self.param_starts: list[int] | None = None
        self.own = False

    @staticmethod
    def kept(
        kept: dict[Any, Any], params: list[Tensor], every_grad: list[Tensor | None]
    ) -> _UsualGrads | None:
        """The record in ``kept`` if it holds for these parameters and gradients, and each
        gradient is in memory of its own; else None."""
        record = kept.get("usual")
        if record is None or not record.meta.holds([*params, *every_grad]):
            return None
        grad_starts, param_starts = list(map(Tensor.data_ptr, every_grad)), list(map(Tensor.data_ptr, params))
        if grad_starts != record.grad_starts or param_starts != record.param_starts:
            record.grad_starts, record.param_starts = grad_starts, param_starts
            record.own = _each_at_its_own_address(every_grad, params, grad_starts, param_starts)
        return record if record.own else None


def _each_at_its_own_address(
    grads: list[Tensor],
    params: list[Tensor],
    grad_starts: list[int] | None = None,
    param_starts: list[int] | None = None,
) -> bool:
    """Whether dense contiguous gradients of one device start at distinct addresses, none of them a
    parameter's, and none reaches into the next (views of one buffer may not overlap: unscaling in
    place would divide twice where they do), or all have none of their own (DTensors, whose local
    shards FSDP2 makes as views of one buffer that do not overlap). About 1 ms per 1000 gradients
    of host time, half of it the sweep. Empty tensors, which hold no memory (their address is 0 or
    another tensor's), are left out. ``grad_starts`` and ``param_starts``: their ``data_ptr()``s,
    where the caller has read them already."""
    starts = list(map(Tensor.data_ptr, grads)) if grad_starts is None else grad_starts
    addresses = set(starts)
    if addresses == {0}:
        return True
    if len(addresses) != len(grads) or not addresses.isdisjoint(
        map(Tensor.data_ptr, params) if param_starts is None else param_starts
    ):
        if all(map(_NBYTES_OF, grads)) and all(map(_NBYTES_OF, params)):
            return False
        return _each_at_its_own_address([g for g in grads if g.nbytes], [p for p in params if p.nbytes])
    # (Contiguous: each spans its nbytes from its start. In address order, none may reach the next;
    # read in Python: a tensor's bool would count as a host read of the step.)
    spans = sorted(zip(starts, map(_NBYTES_OF, grads), strict=True))
    ends = itertools.starmap(operator.add, spans)
    return all(map(operator.le, ends, itertools.islice(map(operator.itemgetter(0), spans), 1, None)))


def _each_memory_once(tensors: list[Tensor], names: list[str], params: list[Tensor]) -> list[Tensor]:
    """``tensors`` less those that are the same memory as an earlier one, to be unscaled in place once.

    Two sparse gradients can hold one buffer of values: the embeddings of tokens and of positions
    summed into one input (as transformers do) each get a view of the sum's gradient. Memory
    shared only in part cannot be unscaled once per element in place: refused. So is a gradient
    that starts where a parameter does (``p.grad = q.detach()``): unscaling it would change the
    parameter, on a skipped step too. (Only the start is compared with the parameters: a sweep
    over every parameter's span would cost about 3 ms per 1000 parameters a step.)
    """
    kept: dict[tuple[Any, ...], Tensor] = {}
    spans: list[tuple[str, int, int, int]] = []
    for i, t in enumerate(tensors):
        local = t.to_local() if isinstance(t, DTensor) else t  # (each rank's shard is its memory)
        start = local.data_ptr() if local.numel() else 0
        if not start:  # nothing to unscale twice, or no memory of its own to compare (a subclass)
            kept[len(kept), id(t)] = t
            continue
        key = (local.device, local.dtype, start, tuple(local.shape), local.stride())
        if key in kept:
            continue
        kept[key] = t
        spans.append((str(local.device), start, start + bytes_spanned(local), i))
    starts = {
        (str(p.device), p.data_ptr()): j
        for j, p in enumerate(params)
        if not isinstance(p, DTensor) and p.layout == torch.strided and p.numel()
    }
    for device, start, _, i in spans:
        if (j := starts.get((device, start))) is not None:
            raise ValueError(
                f"LossScaleOptimizer: {names[i]} and parameter {j} share memory, which unscaling in "
                "place would change (on a skipped step too); give each parameter a gradient of its own"
            )
    spans.sort()
    # A sweep in address order, each span against the furthest reach of those before it.
    far_device, far, far_i = None, 0, -1
    for device, start, end, i in spans:
        if device == far_device and start < far:
            raise ValueError(
                f"LossScaleOptimizer: {names[far_i]} and {names[i]} share memory, which unscaling "
                "in place would divide twice; give each parameter a gradient of its own"
            )
        if device != far_device or end > far:
            far_device, far, far_i = device, end, i
    return list(kept.values())


def _times(t: Tensor, inv_scale: Tensor) -> Tensor:
    """``t * inv_scale`` as torch's fused unscale kernel computes it (float32 math for half dtypes)."""
    inv_scale = inv_scale.to(t.device)
    if t.dtype in _HALF_DTYPES:
        return (t.float() * inv_scale).to(t.dtype)
    return t * inv_scale
