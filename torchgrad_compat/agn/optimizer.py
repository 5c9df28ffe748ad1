"""AGNOptimizer: the worker side of TF contrib's ``AGNOptimizer`` (Accumulated Gradient Normalization)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..amp.loss_scale import found_non_finite
from ..amp.loss_scale_optimizer import LossScaleOptimizer
from ..optim.wrapper import (
    OptimizerWrapper,
    called_from_dcp_init,
    check_global_step,
    check_grad,
    describe,
    grads_fit,
    summed_rows,
)
from .transport import RpcEndpoint, ServerEndpoint

__all__ = ["AGNOptimizer"]


class AGNOptimizer(OptimizerWrapper):
    r"""Apply ``optimizer`` locally; every ``communication_period`` steps, push the mean gradient and pull.

    With :math:`\theta` the local parameters, :math:`a` the accumulator,
    :math:`\tau` = ``communication_period`` and :math:`c` the server's center
    parameters, one local step with gradient :math:`g` is::

        1. θ ← optimizer(θ, g)                 the wrapped optimizer, local slots
        2. a ← a + g                            the raw gradient
        3. local_step ← local_step + 1
        if local_step % τ == 0:
        4.   push a / τ:   c ← server_optimizer(c, a / τ)   atomically on the server
        5.   global_step ← the server's update count (+1 for this push)
        6.   θ ← c;  a ← 0                     pull; local slots are kept

    At construction the worker joins the server and copies the center into its
    parameters (TF's ``get_init_op``). A worker may join at any time; it starts
    from whatever the center is then.

    Differences from TF contrib:

    1. The server builds its own optimizer (``optimizer_fn`` of
       :func:`run_parameter_server`), so the server's slots and non-slot state
       (Adam's ``beta1_power``) advance once per push and the worker's once per
       local step. TF shares one Adam object between both applies, so its beta
       powers advance twice on a communication step.
    2. ``global_step`` is a Python int (the server's update count, shared by all
       workers as TF's PS-side variable is); a ``global_step`` tensor passed to
       ``apply_gradients``/``minimize`` is incremented once per communication.
    3. A parameter that got no gradient during a period is not pushed (TF pushes
       only the variables of the ``apply_gradients`` call); every parameter is
       pulled.
    4. No custom getter: the local parameters are the wrapped optimizer's, and
       the center lives in the server process.

    Around a :class:`~torchgrad_compat.amp.LossScaleOptimizer` with a dynamic
    scale, the accumulated gradients are the unscaled ones (``step()`` calls
    its ``unscale_()`` first), a step it skips (a non-finite gradient) adds
    nothing, and the push is the mean over the steps it applied; a period in
    which every step was skipped pushes nothing. The decision stays on the
    device (no host read per local step); the counts are read at the push.
    The server refuses non-finite pushes, so with a fixed scale (which applies
    non-finite gradients, as TF) such a period raises ``ValueError``.

    ``state_dict()`` has torch's two keys: the wrapped optimizer's ``state`` and
    ``param_groups``, with ``agn_local_step``/``agn_global_step`` in every group
    and each parameter's ``agn_accumulator``/``agn_pending`` beside its slots, so
    ``torch.distributed.checkpoint`` keeps the worker's state; a worker
    checkpointed mid-period resumes its period. The earlier ``{"optimizer": ...,
    "agn": ...}`` layout still loads.

    Args:
        optimizer: the local optimizer (this package's or a ``torch.optim`` one).
        num_worker: number of workers; must equal the server's ``num_worker``.
        communication_period: local steps between pushes (int >= 1).
        server: the server's RPC name, or a :class:`ServerEndpoint` of another
            transport.
        timeout: seconds per request to the server (default: RPC's timeout).
        startup_timeout: seconds to wait for the server to start serving.

    Raises:
        ValueError: ``communication_period < 1``, ``num_worker < 1``, no
            parameters, or parameters/``num_worker`` that do not match the server.
        AGNServerUnavailableError: the server did not answer (at start-up
            within ``startup_timeout``, later within ``timeout``).

    Example::

        opt = AGNOptimizer(AdamOptimizer(model.parameters(), 1e-3), num_worker=2, communication_period=4)
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        opt.finish()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_worker: int,
        communication_period: int = 10,
        *,
        server: str | ServerEndpoint = "ps",
        timeout: float | None = None,
        startup_timeout: float = 60.0,
    ):
        super().__init__(optimizer)
        if isinstance(communication_period, bool) or not isinstance(communication_period, int):
            raise TypeError(f"communication_period must be an int, got {describe(communication_period)}")
        if communication_period < 1:
            raise ValueError(f"communication_period must be >= 1, got {communication_period}")
        if isinstance(num_worker, bool) or not isinstance(num_worker, int) or num_worker < 1:
            raise ValueError(f"num_worker must be an int >= 1, got {num_worker!r}")
        params = self._all_params()
        if not params:
            raise ValueError("the wrapped optimizer has no parameters; AGN needs at least one")
        self.num_worker = num_worker
        self.communication_period = communication_period
        self._endpoint = (
            server if isinstance(server, ServerEndpoint) else RpcEndpoint(server, timeout=timeout)
        )
        self._params = params
        self._accumulators = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        self._pending: set[int] = set()  # parameters with a gradient since the last push
        # Under dynamic loss scaling: steps applied this period, and per parameter whether an applied
        # step gave it a gradient (device tensors, read once per push).
        self._loss_scaled = (
            isinstance(optimizer, LossScaleOptimizer) and optimizer.loss_scale.checks_gradients
        )
        device = params[0].device
        self._applied = torch.zeros((), device=device) if self._loss_scaled else None
        self._seen = [torch.zeros((), device=device) for _ in params] if self._loss_scaled else []
        self.local_step = 0
        self.global_step = 0
        self._seq = 0
        # Pushes whose answer did not arrive, oldest first (each period's stays a push of its own).
        self._unacked: list[tuple[int, dict[int, Tensor]]] = []
        specs = [(tuple(p.shape), p.dtype) for p in params]
        self._session, center, self.global_step = self._endpoint.join(
            num_worker, specs, startup_timeout=startup_timeout
        )
        self._pull(center)
        self._mirror(self._wrapper_state())

    def __repr__(self) -> str:
        return (
            f"AGNOptimizer({self._optimizer!r}, num_worker={self.num_worker}, "
            f"communication_period={self.communication_period}, server={self._endpoint.server!r})"
        )

    # ------------------------------------------------------------------ the algorithm
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local step from ``p.grad`` (steps 1-3), then a communication every period (4-6)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params()
        if called_from_dcp_init():
            # torch.distributed.checkpoint creating the state of a fresh optimizer with a
            # zero-gradient step (see Optimizer.step): not a training step, so nothing is
            # counted, accumulated or pushed to the server.
            self._optimizer.step()
            return loss
        if self._loss_scaled:
            # p.grad holds scaled gradients until unscale_() divides them in place; step() reuses its check.
            self._optimizer.unscale_()
        grads = [p.grad for p in self._params]
        # Each gradient is checked against its parameter before it is added: one that does not fit
        # would be broadcast into the accumulator before the wrapped optimizer refused it.
        present = [p for g, p in zip(grads, self._params, strict=True) if g is not None]
        present_grads = [g for g in grads if g is not None]
        if not grads_fit(present_grads, present):
            for g, p in zip(present_grads, present, strict=True):
                check_grad(type(self).__name__, g, p)
        # Accumulate first: the wrapped optimizer may not be the last to read p.grad.
        self._accumulate(grads)
        self._optimizer.step()
        self._count_step()
        return loss

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Tensor | None, Tensor]],
        global_step: Tensor | None = None,
        name: str | None = None,
    ) -> None:
        """Apply ``(grad, var)`` pairs locally, accumulate them, and communicate every period.

        ``global_step`` (a 0-d integer tensor) is incremented once per communication.
        """
        pairs = list(grads_and_vars)
        if global_step is not None:
            check_global_step(global_step)
        self._check_params()
        grads, _ = self._grads_by_param(pairs)
        self._apply_inner(pairs, name=name)
        self._accumulate(grads)
        if self._count_step() and global_step is not None:
            with torch.no_grad():
                global_step.add_(1)

    def finish(self) -> int:
        """Send a push still unacknowledged, then tell the server this worker is done; its ``global_step``."""
        self._send_unacked()
        return self._endpoint.request("finish", self._session)

    def _accumulate(self, grads: list[Tensor | None]) -> None:
        if self._loss_scaled:
            self._accumulate_unless_skipped(grads)
            return
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is not None:
                    if g.is_sparse:
                        # TF adds the dense sum of the rows (duplicates summed first, see summed_rows).
                        self._accumulators[i].index_add_(0, *summed_rows(g))
                    else:
                        self._accumulators[i].add_(g)
                    self._pending.add(i)

    def _accumulate_unless_skipped(self, grads: list[Tensor | None]) -> None:
        """Add the (unscaled) gradients only if the loss scale applies this step: the same flag, on device."""
        assert self._applied is not None
        lso: Any = self._optimizer
        with torch.no_grad():
            applied = 1 - found_non_finite(grads, lso.loss_scale.device).reshape(())
            self._applied.add_(applied.to(self._applied.device))
            for i, g in enumerate(grads):
                if g is None:
                    continue
                keep = applied.to(g.device).bool()
                if g.is_sparse:
                    rows, values = summed_rows(g)
                    kept = torch.where(keep, values, torch.zeros_like(values))
                    self._accumulators[i].index_add_(0, rows, kept)
                else:
                    self._accumulators[i].add_(torch.where(keep, g, torch.zeros_like(g)))
                torch.maximum(self._seen[i], applied.to(self._seen[i].device), out=self._seen[i])
                self._pending.add(i)

    def _count_step(self) -> bool:
        """Count a local step; push and pull when it completes a period. Whether it pushed."""
        self.local_step += 1
        if self.local_step % self.communication_period:
            return False
        # This period's push is taken before anything is sent: should an earlier unanswered push
        # fail again, the two stay two pushes, each divided by its own period.
        pushed = self._take_push()
        if pushed:
            self._seq += 1
            self._unacked.append((self._seq, pushed))
        self._send_unacked()
        return bool(pushed)

    def _take_push(self) -> dict[int, Tensor]:
        """The period's normalized gradients, by parameter index; the accumulators start over."""
        pending, divisor = sorted(self._pending), self.communication_period
        if self._applied is not None:
            counts = torch.stack([self._applied, *self._seen]).tolist()  # the one host read per period
            divisor = int(counts[0])
            pending = [i for i in pending if counts[1 + i]]
        pushed = {i: self._accumulators[i] / divisor for i in pending}
        with torch.no_grad():
            for a in [*self._accumulators, *self._seen]:
                a.zero_()
            if self._applied is not None:
                self._applied.zero_()
        self._pending.clear()
        return pushed

    def _send_unacked(self) -> None:
        """Send the pushes the server has not acknowledged yet, in order, and pull the center it answers.

        A push whose answer did not arrive (a timeout, a dropped connection) is
        sent again with the same sequence number at the next communication or
        at ``finish()``; the server applies a sequence number at most once, so
        the push counts once whether or not the first attempt reached it.
        """
        while self._unacked:
            seq, pushed = self._unacked[0]
            try:
                center, self.global_step = self._endpoint.request("push", self._session, seq, pushed)
            except (ValueError, TypeError):
                # Refused (a NaN, a shape that does not fit): it never will be accepted, and kept it
                # would be sent again, and refused, at every later communication and at finish().
                self._unacked.pop(0)
                raise
            self._unacked.pop(0)
            self._pull(center)

    def _pull(self, center: list[Tensor]) -> None:
        with torch.no_grad():
            for p, c in zip(self._params, center, strict=True):
                p.copy_(c)

    def _check_params(self) -> None:
        if self._all_params() != self._params:
            raise ValueError(
                "AGNOptimizer's parameters changed after construction (add_param_group?); the server's "
                "center has a fixed parameter list"
            )

    # ------------------------------------------------------------------ checkpoints
    # State dict layout: ``agn_local_step``, ``agn_global_step`` (and ``agn_applied``
    # around a loss-scaling optimizer) in every param group; ``agn_accumulator``,
    # ``agn_pending`` (and ``agn_seen``) beside each parameter's slots in ``state``.
    def _wrapper_state(self) -> dict[str, Any]:
        """``local_step``, ``global_step`` (and the applied-step count), kept in every param group."""
        out: dict[str, Any] = {"agn_local_step": self.local_step, "agn_global_step": self.global_step}
        if self._applied is not None:
            out["agn_applied"] = self._applied.clone()
        return out

    def _wrapper_keys(self, saved_group: dict[str, Any]) -> set[str]:
        return {k for k in saved_group if k.startswith("agn_")} or set(self._wrapper_state())

    def _wrapper_param_state(self) -> dict[int, dict[str, Any]]:
        """Each parameter's accumulator and pending flag (and its seen flag), by parameter index."""
        out: dict[int, dict[str, Any]] = {}
        for i, a in enumerate(self._accumulators):
            out[i] = {"agn_accumulator": a.clone(), "agn_pending": i in self._pending}
            if self._applied is not None:
                out[i]["agn_seen"] = self._seen[i].clone()
        return out

    def _values_from_old_layout(
        self, state_dict: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """The earlier layout, ``{"optimizer": ..., "agn": {...}}``, as group and per-parameter keys."""
        agn = state_dict.get("agn")
        if agn is None:
            raise ValueError(f"AGNOptimizer.load_state_dict expects key 'agn', got keys {sorted(state_dict)}")
        self._check_agn_state(agn)
        extra = {"agn_local_step": agn["local_step"], "agn_global_step": agn["global_step"]}
        per_param: dict[int, dict[str, Any]] = {}
        for i, a in enumerate(agn["accumulators"]):
            per_param[i] = {"agn_accumulator": a, "agn_pending": i in set(agn["pending"])}
            if self._applied is not None:
                per_param[i]["agn_seen"] = agn["seen"][i]
        if self._applied is not None:
            extra["agn_applied"] = agn["applied"]
        return extra, per_param

    def _load_wrapper(self, values: dict[str, Any], per_param: dict[int, dict[str, Any]]) -> None:
        """Check the worker state, then load it (the wrapped optimizer's is loaded by the base)."""
        count = len(self._accumulators)
        agn: dict[str, Any] = {
            "local_step": values.get("agn_local_step"),
            "global_step": values.get("agn_global_step"),
            "accumulators": [per_param.get(i, {}).get("agn_accumulator") for i in range(count)],
            "pending": [i for i in range(count) if per_param.get(i, {}).get("agn_pending")],
        }
        if self._applied is not None:
            agn["applied"] = values.get("agn_applied")
            agn["seen"] = [per_param.get(i, {}).get("agn_seen") for i in range(count)]
        self._check_agn_state(agn)
        with torch.no_grad():
            for a, saved in zip(self._accumulators, agn["accumulators"], strict=True):
                a.copy_(saved)
        self.local_step = int(agn["local_step"])
        self.global_step = int(agn["global_step"])
        self._pending = set(agn["pending"])
        if self._applied is not None:
            with torch.no_grad():
                self._applied.copy_(agn["applied"])
                for s, saved in zip(self._seen, agn["seen"], strict=True):
                    s.copy_(saved)

    def _check_agn_state(self, agn: Any) -> None:
        """Raise, naming the entry, unless ``agn`` is a worker state this optimizer can load."""
        keys = {"local_step", "global_step", "accumulators", "pending"}
        if not isinstance(agn, dict) or not keys <= set(agn):
            held = sorted(agn) if isinstance(agn, dict) else describe(agn)
            raise ValueError(f"AGNOptimizer: loaded 'agn' state must hold {sorted(keys)}, got {held}")
        for key in ("local_step", "global_step"):
            value = agn[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Invalid {key} value: {value!r}; expected an int >= 0")
        saved = agn["accumulators"]
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self._accumulators):
            raise ValueError(
                f"AGNOptimizer: loaded accumulators must be a list of {len(self._accumulators)} tensors "
                f"(one per parameter), got {describe(saved)}"
            )
        for i, (a, s) in enumerate(zip(self._accumulators, saved, strict=True)):
            if not isinstance(s, Tensor) or s.shape != a.shape or not s.is_floating_point():
                raise ValueError(
                    f"AGNOptimizer: loaded accumulator {i} must be a floating tensor of shape "
                    f"{tuple(a.shape)}, got {describe(s)}"
                )
            if not bool(torch.isfinite(s).all()):  # read once, at load: it would be pushed to the server
                raise ValueError(f"Invalid accumulator {i} value: {s!r}; expected finite numbers")
        pending = agn["pending"]
        if not isinstance(pending, (list, tuple, set)) or not all(
            isinstance(i, int) and 0 <= i < len(self._accumulators) for i in pending
        ):
            raise ValueError(
                f"Invalid pending value: {pending!r}; expected parameter indices in "
                f"[0, {len(self._accumulators)})"
            )
        if self._applied is not None:
            applied, seen = agn.get("applied"), agn.get("seen")
            if not isinstance(applied, Tensor) or applied.numel() != 1:
                raise ValueError(
                    "AGNOptimizer around a loss-scaling optimizer: loaded 'agn' state must hold 'applied', "
                    f"a one-element tensor, got {describe(applied)}"
                )
            if not isinstance(seen, (list, tuple)) or len(seen) != len(self._seen):
                raise ValueError(
                    f"AGNOptimizer: loaded 'seen' must be a list of {len(self._seen)} one-element tensors, "
                    f"got {describe(seen)}"
                )
            # Read at load (the push divides by the count): whole numbers in range, or a wrong mean.
            count = float(applied.detach().reshape(()))
            if not (count.is_integer() and 0 <= count <= self.communication_period):
                raise ValueError(
                    f"Invalid agn_applied value: {count!r}; expected a whole number of steps in "
                    f"[0, {self.communication_period}] (the steps applied this period)"
                )
            for i, flag in enumerate(seen):
                if not (
                    isinstance(flag, Tensor) and flag.numel() == 1 and float(flag.reshape(())) in (0.0, 1.0)
                ):
                    raise ValueError(
                        f"Invalid agn_seen value of parameter {i}: {describe(flag)}; expected 0 or 1"
                    )
