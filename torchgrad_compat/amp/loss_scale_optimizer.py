"""``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer`` around any torch optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, overload

import torch
import torch.distributed as dist
from torch import Tensor

from .._torch_internals import non_finite_check_and_unscale_, sparse_indices, sparse_values
from ..optim import Optimizer
from ..optim.wrapper import (
    DEVICE_OF,
    DTYPE_OF,
    GRAD_OF,
    LOSS_SCALE_KEY_PREFIX,
    OptimizerWrapper,
    Unscaling,
    called_from_dcp_init,
    check_global_step,
    check_grad,
    describe,
    grads_fit,
    is_expanded,
    kept_census,
    no_step_pre_hooks,
    number_tensor,
    own_update,
)
from ._grads import (
    _each_at_its_own_address,
    _each_memory_once,
    _Kind,
    _skips_on_device,
    _StepMarks,
    _times,
    _UsualGrads,
)
from .loss_scale import LossScale, as_loss_scale, found_non_finite

__all__ = ["LossScaleOptimizer"]


class LossScaleOptimizer(OptimizerWrapper):
    r"""Loss scaling around any ``torch.optim.Optimizer``, with TensorFlow v1's rules.

    The loss is multiplied by the scale :math:`S` before the backward pass, so
    that small float16 gradients do not flush to zero, and every gradient by
    :math:`1/S` (a float32 reciprocal) after it. With a
    :class:`~torchgrad_compat.amp.DynamicLossScale` (``loss_scale="dynamic"``)
    each step is decided on the unscaled gradients:

    - all finite: the wrapped optimizer applies them, and the scale's
      good-step counter advances (the scale grows every ``increment_period``);
    - any NaN or ±inf: the whole update is skipped, so parameters, slots and
      optimizer-wide state (Adam's beta powers, AdagradDA's step, a
      ``global_step`` passed to ``apply_gradients``) stay as they were, and
      :math:`S \leftarrow \max(S/m, 1)`.

    A fixed scale (a number, or a :class:`~torchgrad_compat.amp.FixedLossScale`)
    never skips: as in TensorFlow, non-finite gradients are applied.

    Two ways to drive it, with the same numbers:

    - torch: ``opt.zero_grad(); opt.get_scaled_loss(loss).backward(); opt.step()``.
      ``step()`` divides every ``p.grad`` by :math:`S` in place with torch's fused
      check-and-unscale kernel (one pass that also finds non-finite values),
      updates the scale on device, and synchronises with the host once, to
      apply or skip. Around torch's fused Adam, AdamW, SGD and Adagrad
      (``fused=True``) it does not synchronise at all: their kernels take the
      non-finite flag and skip on device (GradScaler's protocol), as soon as
      their state exists (Adam's, and SGD's with momentum, after their first
      step); their step hooks then run on skipped steps too. With a fixed
      scale, which checks nothing, around this package's optimizers with
      ``fused=True`` (every group; dense float32 or float64 gradients on the
      CPU, each in memory of its own) there is no pass of its own: the
      optimizer's kernels multiply each gradient by :math:`1/S` in their pass,
      write it back and use it, with the same numbers. To clip the gradients,
      call ``opt.unscale_()`` first.

      ``step()`` and ``unscale_()`` raise unless a backward pass went through
      ``get_scaled_loss``'s result since the last update (several, when
      accumulating micro-batches): gradients of the unscaled loss (a trainer
      calling ``loss.backward()`` itself) would be divided by the scale, and a
      second ``step()`` on the same gradients would apply them again. The
      result of ``get_scaled_loss`` carries a tensor hook that records the
      backward pass; ``step()``, ``apply_gradients`` and ``zero_grad()`` clear it.
    - TF: ``compute_gradients(loss)`` returns unscaled gradients;
      ``apply_gradients(grads_and_vars, global_step)`` takes unscaled gradients,
      updates the scale and applies or skips; ``minimize`` does both.

    Under ``torch.distributed`` (initialised, world size > 1) the non-finite
    flag is all-reduced (MAX) over the default process group before the
    decision, so every rank skips and backs off together, whether the
    gradients were reduced before (DDP) or are reduced by the wrapped optimizer
    (``CrossShardOptimizer``). Every rank must then call ``step`` /
    ``apply_gradients`` the same number of times.

    ``param_groups``, ``state``, ``get_slot``, ``get_slot_names``,
    ``learning_rate``/``lr`` and ``zero_grad`` are the wrapped optimizer's;
    ``variables()`` adds the scale and the counter. ``state_dict()`` has
    torch's two keys, ``state`` and ``param_groups``: the wrapped optimizer's,
    with the loss scale's state in every param group (``loss_scale_class``,
    ``loss_scale_current_loss_scale``, ``loss_scale_good_steps``, ...), so a
    resumed run continues the same scale sequence, also through tools that keep
    only those two keys (``torch.distributed.checkpoint``). The earlier
    ``{"optimizer": ..., "loss_scale": ...}`` layout still loads.

    Differences from TensorFlow:
        1. It wraps any torch optimizer, and has the torch-style ``step`` and ``unscale_``.
        2. An uncoalesced float16 sparse gradient is also checked after its
           duplicate rows are summed (TF checks only the rows as given).
        3. float64, float16 and bfloat16 gradients are accepted (TF's optimizer rejects
           every gradient that is not float32: it multiplies by the float32 reciprocal of
           the scale without a cast). float64 ones are multiplied by that float32
           reciprocal, as torch's unscale kernel does: exact for a power-of-two scale, within
           about 5e-8 relative otherwise; half-precision ones in float32, rounded once.
        4. ``load_state_dict`` restores the loss scale's settings with its state, over
           the constructor's (as ``GradScaler.load_state_dict``); a TF checkpoint holds
           the scale and its counter only (``load_tf_checkpoint`` loads those).

    Differences from ``torch.amp.GradScaler``: TF's dynamic rule (see
    ``DynamicLossScale``: floor of 1, initial ``2**15``); the scale belongs
    to the optimizer and its ``state_dict``; ranks always agree; one call,
    ``step()``, unscales, decides, applies and updates the scale; float16 sparse
    gradients are checked after unscaling, so only sums that overflow once
    unscaled cause a skip.

    Args:
        optimizer: the optimizer to wrap; not a ``LossScaleOptimizer``, nor a
            wrapper around one.
        loss_scale: ``"dynamic"`` (``DynamicLossScale()``), a number ``>= 1``
            (a fixed scale) or a ``LossScale``. Its state moves to the device
            of the first parameter.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer, or is (or wraps) a
            ``LossScaleOptimizer``; ``loss_scale`` has the wrong type.
        ValueError: ``loss_scale`` is None, an unknown string, or a number below 1.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        >>> opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1))
        >>> opt.get_scaled_loss((w * w).sum()).backward()
        >>> opt.step()
        >>> w.detach(), float(opt.loss_scale())
        (tensor([ 0.8000, -0.8000]), 32768.0)
        >>> opt.zero_grad()
        >>> opt.get_scaled_loss(w.sum() * float("inf")).backward()
        >>> opt.step()  # skipped: w is unchanged and the scale halves
        >>> w.detach(), float(opt.loss_scale())
        (tensor([ 0.8000, -0.8000]), 16384.0)
    """

    _pickled_attributes: ClassVar[tuple[str, ...]] = ("_optimizer", "_loss_scale")

    def __init__(self, optimizer: torch.optim.Optimizer, loss_scale: str | float | LossScale = "dynamic"):
        wrapped: Any = optimizer
        while wrapped is not None:
            if isinstance(wrapped, LossScaleOptimizer):
                inside = "" if wrapped is optimizer else f" (found inside {type(optimizer).__name__})"
                raise TypeError(f"LossScaleOptimizer cannot wrap another LossScaleOptimizer{inside}")
            wrapped = getattr(wrapped, "inner_optimizer", None)
        super().__init__(optimizer)
        self._loss_scale = as_loss_scale(loss_scale)
        params = self._all_params()
        if params:
            self._loss_scale.to(params[0].device)
        self._marks = _StepMarks()
        self._mirror(self._wrapper_state())

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A copy starts with no scaled backward pass: gradients copied along are not stepped blindly.
        self._marks = _StepMarks()

    @property
    def loss_scale(self) -> LossScale:
        """The ``LossScale``; ``opt.loss_scale()`` is the current scale."""
        return self._loss_scale

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self._optimizer!r}, loss_scale={self._loss_scale!r})"

    # ------------------------------------------------------------------ scaling
    @overload
    def get_scaled_loss(self, loss: Tensor) -> Tensor: ...
    @overload
    def get_scaled_loss(self, loss: Callable[[], Tensor]) -> Callable[[], Tensor]: ...
    def get_scaled_loss(self, loss: Tensor | Callable[[], Tensor]) -> Tensor | Callable[[], Tensor]:
        """``loss`` times the current scale (cast to the loss's dtype, as TF).

        A zero-argument callable gives a callable that scales its result, reading
        the scale when it is called.

        A backward pass through the result (``backward()``, or ``torch.autograd.grad``)
        is what ``step()`` and ``unscale_()`` require since the last update: the
        result carries a tensor hook that records it.
        """
        return self._scaled_loss(loss, mark=True)

    def get_unscaled_gradients(self, grads: Iterable[Tensor | None]) -> list[Tensor | None]:
        """Each gradient times ``1 / scale``, out of place; None stays None, sparse stays sparse.

        float16/bfloat16 gradients are multiplied in float32 and rounded once,
        as torch's fused unscale kernel does, so both driving styles agree bitwise.
        """
        inv_scale = torch.reciprocal(self._loss_scale())
        unscaled: list[Tensor | None] = []
        for g in grads:
            if g is None:
                unscaled.append(None)
            elif not isinstance(g, Tensor):
                raise TypeError(f"gradients must be tensors or None, got {type(g).__name__}: {g!r}")
            elif g.is_sparse:
                values = _times(sparse_values(g), inv_scale)
                unscaled.append(
                    torch.sparse_coo_tensor(
                        sparse_indices(g),
                        values,
                        g.shape,
                        is_coalesced=g.is_coalesced(),
                        check_invariants=False,
                    )
                )
            else:
                unscaled.append(_times(g, inv_scale))
        return unscaled

    def _scaled_loss(
        self, loss: Tensor | Callable[[], Tensor], *, mark: bool
    ) -> Tensor | Callable[[], Tensor]:
        """``get_scaled_loss``; with ``mark``, a backward pass through the result is recorded."""
        if callable(loss) and not isinstance(loss, Tensor):
            return lambda: self._scaled(loss(), mark=mark)
        return self._scaled(loss, mark=mark)

    def _scaled(self, loss: Any, *, mark: bool) -> Tensor:
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss must be a tensor or a callable returning one, got {type(loss).__name__}")
        scaled = loss * self._loss_scale().to(device=loss.device, dtype=loss.dtype)
        if mark and scaled.requires_grad:
            scaled.register_hook(self._marks.record_scaled_backward)
        return scaled

    # ------------------------------------------------------------------ torch style
    @torch.no_grad()
    def unscale_(self) -> None:
        """Divide every ``p.grad`` by the scale in place now, e.g. to clip them before ``step()``.

        ``step()`` then uses the non-finite check made here, unless a gradient
        was written or replaced since (clipped, for one): then ``step()`` checks
        them again as they are, and skips the update if one is not finite (TF
        decides on the gradients it applies, and TF's ``clip_by_global_norm``
        turns every gradient into NaN when their norm is not finite).
        ``zero_grad()`` forgets it.

        Raises:
            RuntimeError: ``unscale_()`` was already called since the last
                ``step()``/``zero_grad()``, no parameter has a gradient, or no
                backward pass went through ``get_scaled_loss`` since the last update.
        """
        marks = self._marks
        if marks.unscaled:
            raise RuntimeError(
                "LossScaleOptimizer.unscale_() has already been called since the last step() or "
                "zero_grad(); the gradients are unscaled already"
            )
        marks.found_inf, _, _ = self._unscale_grads("unscale_")
        marks.unscaled = True
        marks.leave(list(map(GRAD_OF, self._all_params())))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale ``p.grad`` in place (unless ``unscale_()`` did), update the scale, apply or skip.

        One host synchronisation, for the decision, or none around a fused
        torch optimizer that can skip on device (see the class docstring).

        ``closure``, if given, must compute the loss and call
        ``opt.get_scaled_loss(loss).backward()``; its result is returned.

        The gradients must come from a backward pass through
        ``get_scaled_loss(loss)`` since the last update (several, when
        accumulating): gradients of the unscaled loss would be divided by the
        scale, and gradients already stepped would be applied twice.

        If the wrapped optimizer's ``step`` raises, the scale and its counter
        are restored and ``p.grad`` stays unscaled, as after ``unscale_()``:
        calling ``step()`` again does what the failed call would have done.
        Where the wrapped optimizer's kernels unscale the gradients (a fixed
        scale, see the class docstring), ``p.grad`` stays scaled if it raised
        before they ran; if it raised after some did, some gradients may be
        unscaled and the next ``step()`` asks for a new backward pass.

        Raises:
            RuntimeError: no parameter has a gradient, or no backward pass went
                through ``get_scaled_loss`` since the last update (the loss was
                not scaled, or these gradients were already stepped); raised
                before any collective and before the scale changes.
            ValueError, TypeError: a ``p.grad`` does not fit its parameter
                (shape, dtype, device, sparse layout); raised before anything changes.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if called_from_dcp_init():
            # torch.distributed.checkpoint creating a fresh optimizer's state (see
            # Optimizer.step): not a training step, so the scale and its counter stay.
            self._optimizer.step()
            return loss
        marks = self._marks
        marks.check_no_backward_after_unscale()
        with torch.no_grad():
            # Unscaled by this call (not by an earlier unscale_(), after which anything may
            # have replaced a gradient): every p.grad was just checked against its parameter.
            checked = not marks.unscaled
            kind = unscaling = None
            if checked:
                marks.found_inf, kind, unscaling = self._unscale_grads("step")
                marks.unscaled = unscaling is None
            found_inf = marks.found_inf
            if not checked and found_inf is not None:
                grads = list(map(GRAD_OF, self._all_params()))
                if marks.changed_since_unscale(grads):
                    found_inf = torch.maximum(found_inf, found_non_finite(grads, found_inf.device))
            try:
                with self._scale_restored_on_error():
                    if found_inf is not None and _skips_on_device(self._optimizer):
                        self._advance(found_inf)
                        self._step_skipping_on_device(found_inf)
                    elif self._should_apply(found_inf):
                        self._inner_step(checked, kind, unscaling)
            except BaseException:
                if unscaling is not None and unscaling.started:
                    # Some of the wrapped optimizer's kernels may have unscaled their gradients:
                    # a new backward pass is needed (see step()).
                    marks.clear()
                raise
            marks.updated()
        return loss

    def _inner_step(
        self,
        checked: bool,
        kind: tuple[torch.device, torch.dtype] | None = None,
        unscaling: Unscaling | None = None,
    ) -> None:
        """The wrapped optimizer's ``step()``; one of ours skips its own check of the gradients
        when this call has just made it (``checked``, which found them all of ``kind`` if not
        None) and no step pre-hook runs in between. ``unscaling``: its fused kernels unscale the
        gradients (see :meth:`_unscaled_inside`)."""
        inner = self._optimizer
        if unscaling is not None or (checked and isinstance(inner, Optimizer) and no_step_pre_hooks(inner)):
            inner.step(grads_checked=kind or True, unscaling=unscaling)
        else:
            inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; also forgets an ``unscale_()`` not yet stepped."""
        super().zero_grad(set_to_none=set_to_none)
        self._marks.clear()

    def _unscale_grads(
        self, caller: str
    ) -> tuple[Tensor | None, tuple[torch.device, torch.dtype] | None, Unscaling | None]:
        """Multiply every ``p.grad`` by ``1/scale`` in place; return the non-finite flag, the one
        device and dtype of every parameter and gradient if they have one (see ``_shared_kind``),
        and, where the wrapped optimizer's kernels are to unscale them in their own pass instead
        (see :meth:`_unscaled_inside`), what to hand them.

        The flag is None when the loss scale does not look at gradients (a
        fixed scale), so that no collective and no synchronisation follow.
        """
        params = self._all_params()
        compiling = torch.compiler.is_compiling()
        # (Dynamo traces a comprehension, and breaks the graph at `map` over attrgetter.)
        every_grad = [p.grad for p in params] if compiling else list(map(GRAD_OF, params))
        kept = self.__dict__.setdefault("_census_kept", {})
        record = None if compiling else _UsualGrads.kept(kept, params, every_grad)
        if record is not None:
            # What the last step found of them holds: every parameter has a gradient, each in
            # memory of its own.
            self._marks.check_scaled_backward(caller)
            grads, kind, single, own, distinct = every_grad, record.kind, record.kind, True, True
        else:
            grads, kind, single, distinct = self._sort_grads(caller, params, every_grad, kept)
            own = single is not None and _each_at_its_own_address(grads, params)
        device = self._loss_scale.device
        inv_scale = torch.reciprocal(self._loss_scale())
        # (Not a tensor that is two parameters' gradient: each kernel would unscale it.)
        if caller == "step" and own and distinct and self._unscaled_inside(kind):
            # (A kept tensor of the same value: a step of ours replayed reads the same one.)
            return None, kind, Unscaling(number_tensor(inv_scale.item(), torch.float32, kind[0]))
        # The fused kernel needs its flag and inverse scale on the gradients' device, and on CUDA
        # one dtype per call for its multi-tensor path.
        by_device: dict[torch.device, dict[torch.dtype, list[Tensor]]] = {}
        summed_later: list[Tensor] = []
        if own and not single[1].is_complex:
            by_device[single[0]] = {single[1]: grads}
        else:
            unscaled: list[Tensor] = []
            # Which parameter each gradient is of, for an error (the first, for one shared by two).
            owner = {id(p.grad): i for i, p in reversed(list(enumerate(params)))}
            names = [f"p.grad of parameter {owner[id(g)]}" for g in grads]
            for g in grads:
                if g.is_sparse:
                    if g.dtype == torch.float16 and not g.is_coalesced():
                        summed_later.append(g)
                    g = sparse_values(g)
                if g.is_complex():
                    # torch's kernel takes real dtypes: the real view is the same memory.
                    g = torch.view_as_real(g)
                unscaled.append(g)
            for g in _each_memory_once(unscaled, names, params):
                by_device.setdefault(g.device, {}).setdefault(g.dtype, []).append(g)
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        for grad_device, by_dtype in by_device.items():
            here = grad_device == device
            found_here = found_inf if here else torch.zeros(1, dtype=torch.float32, device=grad_device)
            inv_here = inv_scale if here else inv_scale.to(grad_device)
            for tensors in by_dtype.values():
                non_finite_check_and_unscale_(tensors, found_here, inv_here)
            if not here:
                found_inf = torch.maximum(found_inf, found_here.to(device))
        if summed_later:
            # Checked after unscaling: only rows whose unscaled sum overflows float16 skip the step.
            found_inf = torch.maximum(found_inf, found_non_finite(summed_later, device))
        if self._loss_scale.may_be_below_one:
            # The kernel checks before it multiplies; by 1/scale > 1 a finite gradient can overflow,
            # and TF judges the unscaled gradients. (Never the case once the scale is >= 1.)
            found_inf = torch.maximum(found_inf, found_non_finite(grads, device))
        return (found_inf if self._loss_scale.checks_gradients else None), kind, None

    def _sort_grads(
        self, caller: str, params: list[Tensor], every_grad: list[Tensor | None], kept: dict[Any, Any]
    ) -> tuple[list[Tensor], _Kind | None, _Kind | None, bool]:
        """The gradients to unscale (each tensor once), the one device and dtype of every parameter
        and gradient if they have one and all are usual (dense, contiguous, fitting their parameter,
        see ``_shared_kind``), the one device and dtype of the gradients if all are usual
        (DTensors included), and whether no tensor is the gradient of two parameters. Raises,
        naming the parameter, on a gradient that does not fit."""
        present = [p for g, p in zip(every_grad, params, strict=True) if g is not None]
        if not present:
            raise RuntimeError(
                "LossScaleOptimizer: no parameter has a gradient; call "
                "opt.get_scaled_loss(loss).backward() before step() or unscale_()"
            )
        self._marks.check_scaled_backward(caller)
        # (One per parameter that has one.)
        paired: list[Tensor] = [g for g in every_grad if g is not None]
        # One tensor that is the gradient of two parameters is unscaled once. (Keyed by id:
        # Tensor.__hash__ is a Python call, 0.5 ms per 1000 gradients.)
        distinct = len(set(map(id, paired))) == len(paired)
        grads = paired if distinct else list({id(g): g for g in paired}.values())
        # One cheap pass for the usual case (dense, contiguous, fitting its parameter, all of one
        # device and dtype); the parameter-by-parameter checks, which name what is wrong, run only
        # when it fails.
        # (Kept from the last step while every parameter and gradient has the metadata it had then.)
        compiling = torch.compiler.is_compiling()
        _, kind, same = (None, None, None) if compiling else kept_census(kept, 0, present, paired)
        fit = kind is not None or grads_fit(paired, present)
        if not (fit and all(map(Tensor.is_contiguous, grads))):
            self._check_grads(params)
            return grads, None, None, distinct
        if same is not None and distinct and len(present) == len(params):
            kept["usual"] = _UsualGrads(same, kind)
        # All of one device and dtype: what _shared_kind found, or, for DTensors (FSDP2's shards),
        # which it leaves out, the same read here.
        single = kind
        if kind is None and len(dtypes := set(map(DTYPE_OF, grads))) == 1:
            if len(devices := set(map(DEVICE_OF, grads))) == 1:
                single = devices.pop(), dtypes.pop()
        return grads, kind, single, distinct

    def _unscaled_inside(self, kind: _Kind | None) -> bool:
        """Whether the wrapped optimizer can unscale gradients of ``kind``, each in memory of its
        own, inside its own fused pass.

        Where nothing needs the check first (a fixed scale), around this package's own
        optimizers with ``fused`` on in every group and no step pre-hook, over dense
        float32 or float64 gradients of the CPU (see
        :func:`~torchgrad_compat.optim._fused.run._unscaling`): the gradient is then read once
        for the update, not once more before it. Elsewhere (CUDA and half precision
        included) torch's check-and-unscale kernel makes a pass of its own.
        """
        inner = self._optimizer
        return (
            not self._loss_scale.checks_gradients
            and kind is not None
            and kind[0].type == "cpu"
            and kind[1] in (torch.float32, torch.float64)
            and isinstance(inner, Optimizer)
            and own_update(type(inner))
            and all(group.get("fused") for group in inner.param_groups)
            and no_step_pre_hooks(inner)
        )

    def _check_grads(self, params: list[Tensor]) -> None:
        """Check every ``p.grad`` against its parameter, raising on the first that does not fit.

        torch checks ``p.grad = ...`` but not ``p.grad.data = ...``. A sparse
        gradient must be row-sparse; a dense one must not be an expanded view,
        which cannot be unscaled in place.
        """
        for i, p in enumerate(params):
            g = p.grad
            if g is None:
                continue
            check_grad(type(self).__name__, g, p)
            # An expanded view (stride 0) shares one element between many: it cannot be unscaled in place.
            if not g.is_sparse and is_expanded(g):
                raise RuntimeError(
                    f"LossScaleOptimizer: p.grad of parameter {i} {describe(p)} is an expanded view "
                    f"(strides {g.stride()}) and cannot be unscaled in place; assign "
                    "p.grad = p.grad.contiguous() before step() or unscale_()"
                )

    # ------------------------------------------------------------------ TF style
    def compute_gradients(
        self,
        loss: Tensor | Callable[[], Tensor],
        var_list: Sequence[Tensor] | None = None,
        gate_gradients: int = 1,
        aggregation_method: int | None = None,
        colocate_gradients_with_ops: bool = False,
        grad_loss: Tensor | None = None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """The wrapped optimizer's ``compute_gradients`` of the scaled loss, then unscaled (TF).

        Its backward pass does not count for ``step()``: it leaves ``p.grad`` alone.
        """
        grads_and_vars = super().compute_gradients(
            self._scaled_loss(loss, mark=False),
            var_list=var_list,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss,
        )
        grads = self.get_unscaled_gradients([g for g, _ in grads_and_vars])
        return list(zip(grads, [v for _, v in grads_and_vars], strict=True))

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Tensor | None, Tensor]],
        global_step: Tensor | None = None,
        name: str | None = None,
    ) -> None:
        """Update the scale on the (already unscaled) gradients; apply them unless one is non-finite.

        On a skipped step nothing of the wrapped optimizer changes and
        ``global_step`` is not incremented (TF v1). Every pair is checked
        (variable, gradient shape, dtype, device) before the scale changes; if
        the wrapped optimizer raises, the scale and its counter are restored.
        """
        pairs = list(grads_and_vars)
        self._check_pairs(pairs, global_step)
        grads = [g for g, _ in pairs]
        found_inf = (
            found_non_finite(grads, self._loss_scale.device) if self._loss_scale.checks_gradients else None
        )
        with self._scale_restored_on_error():
            if self._should_apply(found_inf):
                self._apply_inner(pairs, global_step=global_step, name=name)
        # Gradients of a scaled backward pass, unscaled and passed here, are used up: step() on
        # the same p.grad would apply them again.
        self._marks.updated()

    def _check_pairs(self, pairs: list[Any], global_step: Any) -> None:
        """Every pair, before anything changes: the shared checks, including each gradient's
        shape and dtype (a misshapen gradient holding an inf must raise, not skip the step)."""
        if not pairs:
            raise ValueError("No variables provided.")
        self._grads_by_param(pairs)
        if all(g is None for g, _ in pairs):
            raise ValueError(f"No gradients provided for any variable: {[describe(v) for _, v in pairs]}.")
        if global_step is not None:
            check_global_step(global_step)

    @contextlib.contextmanager
    def _scale_restored_on_error(self) -> Iterator[None]:
        """Put the loss scale's state back if the block raises (e.g. the wrapped optimizer's step).

        A copy of the state tensors (the scale and the counter: two scalars, on
        device, no synchronisation) is taken before the block.
        """
        variables = self._loss_scale.variables()
        saved = [v.clone() for v in variables]
        try:
            yield
        except BaseException:
            for v, before in zip(variables, saved, strict=True):
                v.copy_(before)
            raise

    # ------------------------------------------------------------------ the decision
    def _should_apply(self, found_inf: Tensor | None) -> bool:
        """Agree across ranks, advance the scale on device, and synchronise once to decide.

        ``found_inf`` None: the loss scale does not look at gradients (apply).
        """
        if found_inf is None:
            return True
        apply = self._advance(found_inf)
        if apply.device.type == "xla":
            # Run the step so far as one graph before the read: reading a pending XLA tensor runs
            # the part of the graph it needs, and the step's end would then run that part again.
            import torch_xla

            torch_xla.sync()
        return bool(apply)

    def _advance(self, found_inf: Tensor) -> Tensor:
        """Make ``found_inf`` (0 or 1) the maximum over the ranks, in place, and advance the
        scale on it; return the device-side "apply" flag, unread.

        The ranks are torch_xla's replicas when the flag is on an XLA device, else the
        default ``torch.distributed`` group: every replica skips when one has a non-finite
        gradient, since the cross-replica sum would carry it to all of them.
        """
        if found_inf.device.type == "xla":
            import torch_xla.core.xla_model as xm
            import torch_xla.runtime as xr

            if xr.world_size() > 1:
                # Out of place, then copy_: see XlaCollective.all_reduce_sum.
                found_inf.copy_(xm.all_reduce(xm.REDUCE_MAX, found_inf))
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return self._loss_scale.update_from_found_inf(found_inf)

    def _step_skipping_on_device(self, found_inf: Tensor) -> None:
        """Step the wrapped fused optimizer with ``found_inf``: its kernel applies or skips.

        This is GradScaler's protocol: the flag is an attribute for one ``step()``.
        Its kernels skip when the flag is exactly 1, as ``found_inf`` is here
        (1.0 or 0.0, also after the MAX all-reduce).
        """
        inner: Any = self._optimizer
        inner.found_inf = found_inf.reshape(())
        try:
            inner.step()
        finally:
            del inner.found_inf

    # ------------------------------------------------------------------ state
    def variables(self) -> list[Tensor]:
        """The wrapped optimizer's state tensors, then the loss scale's (TF's order)."""
        return super().variables() + self._loss_scale.variables()

    def _wrapper_state(self) -> dict[str, Any]:
        """The loss scale's ``state_dict()``, keys prefixed ``loss_scale_`` (kept in every param group)."""
        return {LOSS_SCALE_KEY_PREFIX + k: v for k, v in self._loss_scale.state_dict().items()}

    def _wrapper_keys(self, saved_group: dict[str, Any]) -> set[str]:
        # Whatever loss scale was saved (its class is among the keys); LossScale.load_state_dict judges it.
        return {k for k in saved_group if k.startswith(LOSS_SCALE_KEY_PREFIX)} or set(self._wrapper_state())

    def _load_wrapper(self, values: dict[str, Any], per_param: dict[int, dict[str, Any]]) -> None:
        self._loss_scale.load_state_dict(
            {k.removeprefix(LOSS_SCALE_KEY_PREFIX): v for k, v in values.items()}
        )

    def _values_from_old_layout(
        self, state_dict: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        if not isinstance(state_dict.get("loss_scale"), dict):
            raise ValueError(
                "LossScaleOptimizer.load_state_dict: a state dict of the earlier layout must hold "
                f"'optimizer' and 'loss_scale'; got keys {sorted(state_dict)}"
            )
        return {LOSS_SCALE_KEY_PREFIX + k: v for k, v in state_dict["loss_scale"].items()}, {}
