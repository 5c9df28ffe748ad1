"""AGNOptimizer: the worker side of TF contrib's ``AGNOptimizer`` (Accumulated Gradient Normalization)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..optim._base import _check_global_step, _describe
from ..optim._wrapper import OptimizerWrapper
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
            raise TypeError(f"communication_period must be an int, got {_describe(communication_period)}")
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
        self.local_step = 0
        self.global_step = 0
        self._seq = 0
        specs = [(tuple(p.shape), p.dtype) for p in params]
        self._incarnation, center, self.global_step = self._endpoint.join(
            num_worker, specs, startup_timeout=startup_timeout
        )
        self._pull(center)

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
        grads = [p.grad for p in self._params]
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
            _check_global_step(global_step)
        self._check_params()
        grads, _ = self._grads_by_param(pairs)
        self._apply_inner(pairs, name=name)
        self._accumulate(grads)
        if self._count_step() and global_step is not None:
            with torch.no_grad():
                global_step.add_(1)

    def finish(self) -> int:
        """Tell the server this worker is done; the server's ``global_step``."""
        return self._endpoint.request("finish", self._incarnation)

    def _accumulate(self, grads: list[Tensor | None]) -> None:
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is not None:
                    self._accumulators[i].add_(g)
                    self._pending.add(i)

    def _count_step(self) -> bool:
        """Count a local step; push and pull when it completes a period. Whether it did."""
        self.local_step += 1
        if self.local_step % self.communication_period:
            return False
        pushed = {i: self._accumulators[i] / self.communication_period for i in sorted(self._pending)}
        if pushed:
            self._seq += 1
            center, self.global_step = self._endpoint.request("push", self._incarnation, self._seq, pushed)
            self._pull(center)
        with torch.no_grad():
            for a in self._accumulators:
                a.zero_()
        self._pending.clear()
        return bool(pushed)

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
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus ``local_step``, ``global_step`` and the accumulators."""
        state = super().state_dict()
        state["agn"] = {
            "local_step": self.local_step,
            "global_step": self.global_step,
            "accumulators": [a.clone() for a in self._accumulators],
            "pending": sorted(self._pending),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and the worker's; everything is checked first."""
        agn = state_dict.get("agn")
        if agn is None:
            raise ValueError(f"AGNOptimizer.load_state_dict expects key 'agn', got keys {sorted(state_dict)}")
        self._check_agn_state(agn)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for a, saved in zip(self._accumulators, agn["accumulators"], strict=True):
                a.copy_(saved)
        self.local_step = int(agn["local_step"])
        self.global_step = int(agn["global_step"])
        self._pending = set(agn["pending"])

    def _check_agn_state(self, agn: Any) -> None:
        """Raise, naming the entry, unless ``agn`` is a worker state this optimizer can load."""
        keys = {"local_step", "global_step", "accumulators", "pending"}
        if not isinstance(agn, dict) or not keys <= set(agn):
            held = sorted(agn) if isinstance(agn, dict) else _describe(agn)
            raise ValueError(f"AGNOptimizer: loaded 'agn' state must hold {sorted(keys)}, got {held}")
        for key in ("local_step", "global_step"):
            value = agn[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Invalid {key} value: {value!r}; expected an int >= 0")
        saved = agn["accumulators"]
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self._accumulators):
            raise ValueError(
                f"AGNOptimizer: loaded accumulators must be a list of {len(self._accumulators)} tensors "
                f"(one per parameter), got {_describe(saved)}"
            )
        for i, (a, s) in enumerate(zip(self._accumulators, saved, strict=True)):
            if not isinstance(s, Tensor) or s.shape != a.shape or not s.is_floating_point():
                raise ValueError(
                    f"AGNOptimizer: loaded accumulator {i} must be a floating tensor of shape "
                    f"{tuple(a.shape)}, got {_describe(s)}"
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
