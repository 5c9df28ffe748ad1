"""TensorFlow v1's loss scales as state machines on tensors: ``tf.compat.v1.mixed_precision.LossScale``,
``FixedLossScale`` and ``DynamicLossScale``.

A loss scale holds its state in tensors on one device and advances it there:
:meth:`LossScale.update_from_found_inf` takes a device-side flag ("some gradient
was non-finite") and returns a device-side "apply this step" flag without any
host synchronisation, so that :class:`~torchgrad_compat.amp.LossScaleOptimizer`
can fuse the check into the unscaling pass and synchronise once per step.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._torch_internals import sparse_values, update_scale_
from ..optim.wrapper import check_range, python_float, summed_rows

__all__ = ["DynamicLossScale", "FixedLossScale", "LossScale", "as_loss_scale", "found_non_finite"]

_FLOAT32_MAX = torch.finfo(torch.float32).max
_INT64_MAX = torch.iinfo(torch.int64).max


class LossScale(abc.ABC):
    """Base class of the loss scales: the current scale, and how it reacts to the gradients.

    Calling a loss scale gives its current value as a 0-d float32 tensor (a
    snapshot). ``update(grads)`` advances the state on the *unscaled* gradients of
    one step and returns whether that step should be applied; ``None``
    gradients are ignored and a sparse gradient is judged by its values.

    Subclasses implement ``update_from_found_inf`` (the state machine, on
    device), ``get_config``, ``state_dict``/``load_state_dict`` and ``to``, and
    set ``checks_gradients = False`` when the gradients never change the
    outcome (then ``update`` does not read them).
    """

    # Whether update() needs to look at the gradients; FixedLossScale does not (TF).
    checks_gradients: ClassVar[bool] = True
    # Whether the scale may be below 1 (so that unscaling multiplies by more than 1). Known on
    # the host without reading the scale: a dynamic scale below 1 only grows or backs off to 1.
    may_be_below_one: bool = False

    def __init__(self, scale: float):
        self._scale = torch.tensor(scale, dtype=torch.float32)

    def __call__(self) -> Tensor:
        """The current loss scale, a 0-d float32 tensor on :attr:`device`."""
        return self._scale.clone()

    @property
    def device(self) -> torch.device:
        """Where the state lives (the wrapping optimizer moves it to its parameters' device)."""
        return self._scale.device

    def update(self, grads: Iterable[Tensor | None]) -> bool:
        """Advance the state on one step's unscaled ``grads``; return whether to apply them.

        One host synchronisation when ``checks_gradients`` (the returned bool).
        """
        if not self.checks_gradients:
            return True
        return bool(self.update_from_found_inf(found_non_finite(grads, self.device)))

    @abc.abstractmethod
    def update_from_found_inf(self, found_inf: Tensor) -> Tensor:
        """Advance the state given ``found_inf`` (> 0: some gradient was NaN or ±inf).

        ``found_inf`` is a float32 tensor of one element on :attr:`device`;
        returns a 0-d bool tensor "apply this step", without synchronising.
        """

    def variables(self) -> list[Tensor]:
        """The state tensors that change during training (TF's loss-scale weights)."""
        return []

    def to(self, device: torch.device | str) -> LossScale:
        """Move the state to ``device``; returns ``self``."""
        self._scale = self._scale.to(device)
        return self

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as TF's ``get_config``."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScale:
        return cls(**config)

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Configuration and state: Python numbers, strings and tensors (``weights_only``-loadable)."""

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, configuration included; nothing changes if it is invalid."""

    def _check_class(self, state_dict: Any) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        saved = state_dict.get("class")
        if saved != type(self).__name__:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict got the state of {saved!r}; "
                f"the state must come from a {type(self).__name__}"
            )


class FixedLossScale(LossScale):
    """A loss scale that never changes, as TF's ``FixedLossScale``.

    ``update`` always says "apply" without looking at the gradients: TensorFlow
    applies non-finite gradients under a fixed scale, and so does this.

    Differences from TensorFlow: NaN and infinite values, which TF accepts, are
    rejected; a non-number is a ``TypeError`` (TF: ``ValueError``).

    Args:
        loss_scale_value: the scale, a Python number in ``[1, float32 max]``.

    Raises:
        TypeError: ``loss_scale_value`` is not a number.
        ValueError: ``loss_scale_value`` is below 1, NaN or infinite.
    """

    checks_gradients = False

    def __init__(self, loss_scale_value: float):
        self._loss_scale_value = _checked_fixed_value("loss_scale_value", loss_scale_value)
        super().__init__(self._loss_scale_value)

    def update_from_found_inf(self, found_inf: Tensor) -> Tensor:
        return torch.ones((), dtype=torch.bool, device=self.device)

    def get_config(self) -> dict[str, Any]:
        return {"loss_scale_value": self._loss_scale_value}

    def state_dict(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "loss_scale_value": self._loss_scale_value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_class(state_dict)
        value = _checked_fixed_value("loss_scale_value", state_dict.get("loss_scale_value"))
        self._loss_scale_value = value
        self._scale.fill_(value)

    def __repr__(self) -> str:
        return f"FixedLossScale({self._loss_scale_value})"


class DynamicLossScale(LossScale):
    r"""A loss scale that backs off on overflow and grows while gradients stay finite, as TF's.

    State: the scale :math:`S` (float32, starts at ``initial_loss_scale``) and
    the good-step counter :math:`n` (int64, starts at 0). With :math:`P` =
    ``increment_period`` and :math:`m` = ``multiplier`` (float32), each update:

    - every gradient finite: :math:`n \leftarrow n + 1`; when :math:`n \ge P`,
      :math:`n \leftarrow 0` and :math:`S \leftarrow S m` *if* that product is
      finite in float32 (otherwise :math:`S` stays, and :math:`n` resets anyway);
    - some NaN or ±inf: :math:`S \leftarrow \max(S / m, 1)` and :math:`n \leftarrow 0`;
      the floor of 1 also raises a scale that started below 1.

    The step is applied iff every gradient is finite. All of this runs on the
    state's device, in float32 for :math:`S` (TF's variable dtype).

    Differences from ``torch.amp.GradScaler``: it starts at ``2**15`` (torch:
    ``2**16``), never falls below 1 (torch has no floor), divides by the
    multiplier on backoff (torch multiplies by ``backoff_factor``), and counts
    good steps in int64.

    Differences from TensorFlow: TF's constructor accepts a ``multiplier`` of 1 or
    less, an ``initial_loss_scale`` of 0, below 0 or infinite, and an
    ``increment_period`` of 0 or a fraction; each is refused here.

    Args:
        initial_loss_scale: the first scale, a Python number in ``(0, float32 max]``.
        increment_period: finite steps in a row before the scale grows, an int ``>= 1``.
        multiplier: growth and backoff factor, a Python number ``> 1`` in float32.

    Raises:
        TypeError: an argument is not a Python number (``increment_period``: not an int).
        ValueError: an argument is out of range, NaN or infinite.

    Example:
        >>> scale = DynamicLossScale(initial_loss_scale=4, increment_period=2)
        >>> [scale.update([g]) for g in (torch.ones(2), torch.ones(2), torch.tensor([float("nan")]))]
        [True, True, False]
        >>> float(scale()), int(scale.good_steps)
        (4.0, 0)
    """

    def __init__(
        self, initial_loss_scale: float = 2**15, increment_period: int = 2000, multiplier: float = 2.0
    ):
        initial_loss_scale, increment_period, multiplier = _checked_dynamic_config(
            initial_loss_scale, increment_period, multiplier
        )
        super().__init__(initial_loss_scale)
        self.may_be_below_one = _float32(initial_loss_scale) < 1.0
        self._initial_loss_scale = initial_loss_scale
        self._increment_period = increment_period
        self._multiplier_value = multiplier
        self._good_steps = torch.zeros((), dtype=torch.int64)
        # A device tensor, not a Python number: CUDA turns ``x / number`` into
        # ``x * (1 / number)``, which rounds differently from TF's division.
        self._multiplier = torch.tensor(multiplier, dtype=torch.float32)

    @property
    def initial_loss_scale(self) -> float:
        return self._initial_loss_scale

    @property
    def increment_period(self) -> int:
        return self._increment_period

    @property
    def multiplier(self) -> float:
        return self._multiplier_value

    @property
    def good_steps(self) -> Tensor:
        """The good-step counter, a 0-d int64 tensor (a snapshot)."""
        return self._good_steps.clone()

    def update_from_found_inf(self, found_inf: Tensor) -> Tensor:
        if self._torch_update_is_exact():
            return self._update_as_grad_scaler(found_inf)
        scale = self._scale
        non_finite = found_inf.reshape(()) > 0
        good_steps = torch.where(non_finite, 0, self._good_steps + 1)
        grow = good_steps >= self._increment_period
        grown = scale * self._multiplier
        backed_off = torch.clamp_min(scale / self._multiplier, 1.0)
        kept_or_grown = torch.where(grow & torch.isfinite(grown), grown, scale)
        scale.copy_(torch.where(non_finite, backed_off, kept_or_grown))
        self._good_steps.copy_(torch.where(grow, 0, good_steps))
        return ~non_finite

    def _torch_update_is_exact(self) -> bool:
        """Whether GradScaler's one-kernel update, with a floor and a capped counter around it,
        is TF's rule bit for bit here: a multiplier that is a power of two (so that multiplying
        by its reciprocal divides exactly), a period that fits the kernel's int32 counter, a CPU
        or CUDA scale."""
        return (
            math.frexp(self._multiplier_value)[0] == 0.5
            and self._increment_period < 2**31
            and self._scale.device.type in ("cpu", "cuda")
        )

    def _update_as_grad_scaler(self, found_inf: Tensor) -> Tensor:
        """TF's rule in 8 small kernels instead of 17 (on the CPU, 24 µs a step instead of 48).

        ``torch._amp_update_scale_`` (GradScaler's update) backs off by multiplying by the
        reciprocal of the multiplier, grows when its counter reaches the period, and keeps the
        scale when growing would overflow, as TF does. Around it: the counter it takes is TF's,
        capped at ``period - 1`` (a loaded counter at or past the period grows at the next finite
        step in both), and the scale after a backoff is raised to 1 as TF's ``max(scale / m, 1)``:
        the maximum with the flag, which is 1 exactly then and 0 otherwise.
        """
        flag = (found_inf.reshape(()) > 0).to(torch.float32)
        counter = self.__dict__.get("_counter")
        if counter is None or counter.device != self._scale.device:
            # An ordinary tensor even when made under inference_mode, which a later update
            # outside it could not write.
            with torch.inference_mode(False):
                counter = self._counter = torch.zeros((), dtype=torch.int32, device=self._scale.device)
        counter.copy_(self._good_steps.clamp(-(2**31), self._increment_period - 1))
        m = self._multiplier_value
        update_scale_(self._scale, counter, flag, m, 1 / m, self._increment_period)
        torch.maximum(self._scale, flag, out=self._scale)
        self._good_steps.copy_(counter)
        return flag == 0

    def variables(self) -> list[Tensor]:
        return [self._scale, self._good_steps]

    def to(self, device: torch.device | str) -> DynamicLossScale:
        super().to(device)
        self._good_steps = self._good_steps.to(device)
        self._multiplier = self._multiplier.to(device)
        return self

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_loss_scale": self._initial_loss_scale,
            "increment_period": self._increment_period,
            "multiplier": self._multiplier_value,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "class": type(self).__name__,
            **self.get_config(),
            "current_loss_scale": self._scale.clone(),
            "good_steps": self._good_steps.clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_class(state_dict)
        missing = {"initial_loss_scale", "increment_period", "multiplier", "current_loss_scale", "good_steps"}
        missing -= set(state_dict)
        if missing:
            raise ValueError(f"DynamicLossScale.load_state_dict: the state lacks {sorted(missing)}")
        config = _checked_dynamic_config(
            state_dict["initial_loss_scale"], state_dict["increment_period"], state_dict["multiplier"]
        )
        scale = _checked_state_tensor("current_loss_scale", state_dict["current_loss_scale"], floating=True)
        good_steps = _checked_state_tensor("good_steps", state_dict["good_steps"], floating=False)
        scale32 = float(scale.to(torch.float32))
        if not (0 < scale32 <= _FLOAT32_MAX):
            raise ValueError(
                f"Invalid current_loss_scale value: {float(scale)!r}; expected a finite value > 0 "
                "in float32 (the scale's dtype)"
            )
        if int(good_steps) < 0:
            raise ValueError(f"Invalid good_steps value: {int(good_steps)}; expected a value >= 0")
        self._initial_loss_scale, self._increment_period, self._multiplier_value = config
        self._multiplier.fill_(self._multiplier_value)
        self._scale.copy_(scale)
        self._good_steps.copy_(good_steps)
        self.may_be_below_one = scale32 < 1.0

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(current_loss_scale={float(self._scale)}, "
            f"num_good_steps={int(self._good_steps)}, initial_loss_scale={self._initial_loss_scale}, "
            f"increment_period={self._increment_period}, multiplier={self._multiplier_value})"
        )


def as_loss_scale(loss_scale: str | float | LossScale) -> LossScale:
    """``"dynamic"`` → ``DynamicLossScale()``, a number → ``FixedLossScale``, a ``LossScale`` → itself.

    TF's ``loss_scale.get``, except that None raises here (TF's optimizer raises it).
    """
    if isinstance(loss_scale, LossScale):
        return loss_scale
    if loss_scale is None:
        raise ValueError("loss_scale cannot be None; pass 'dynamic', a number >= 1 or a LossScale")
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return DynamicLossScale()
        raise ValueError(
            f"Invalid loss_scale value: {loss_scale!r}; expected 'dynamic', a number >= 1 or a LossScale"
        )
    return FixedLossScale(_checked_fixed_value("loss_scale", loss_scale))


def found_non_finite(grads: Iterable[Tensor | None], device: torch.device | str) -> Tensor:
    """A float32 tensor of one element on ``device``: 1 if any gradient holds NaN or ±inf, else 0.

    Reads the gradients without changing them and without synchronising.
    ``None`` entries are skipped. A sparse gradient is judged by its values (as
    TF judges an ``IndexedSlices``); an uncoalesced float16 one also by the
    sums of its duplicate rows, as the optimizers make them, which can overflow
    where the summands did not.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        if g is None:
            continue
        if not isinstance(g, Tensor):
            raise TypeError(f"gradients must be tensors or None, got {type(g).__name__}: {g!r}")
        checked = [g]
        if g.is_sparse:
            checked = [sparse_values(g)]
            if g.dtype == torch.float16 and not g.is_coalesced():
                checked.append(summed_rows(g)[1])
        for t in checked:
            # The infinity norm of an empty tensor is undefined; it has nothing to check.
            if t.numel():
                groups.setdefault((t.device, t.dtype), []).append(t)
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for (where, _), tensors in groups.items():
        largest = torch.stack(_largest_magnitudes(tensors, where))
        found = torch.maximum(found, (~torch.isfinite(largest).all()).to(found))
    return found


def _largest_magnitudes(tensors: list[Tensor], device: torch.device) -> tuple[Tensor, ...]:
    """max |x| of each tensor: NaN and ±inf propagate, and, unlike a sum, it cannot overflow.

    On XLA only whether it is finite: 0, or inf for a tensor holding NaN or ±inf.
    """
    if device.type == "xla":
        # XLA's max (and so its inf-norm) returns the largest number and drops NaN: a NaN gradient
        # would pass as finite. Its isfinite does not, and XLA fuses the whole check anyway.
        return tuple(torch.where(torch.isfinite(t).all(), 0.0, math.inf) for t in tensors)
    if device.type == "cpu":
        # torch's CPU foreach_norm(inf) loops tensor by tensor unvectorised: 2.9 ms for
        # 1M float32 in 100 tensors on one thread, against 0.4 ms for abs then max.
        return torch._foreach_max(torch._foreach_abs(tensors))
    # Elsewhere it is one read-only fused pass, without abs's temporary copy.
    return torch._foreach_norm(tensors, ord=math.inf)


def _number(arg: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{arg} must be a Python number, got {type(value).__name__}: {value!r}")
    return python_float(arg, value)


def _checked_fixed_value(arg: str, value: Any) -> float:
    value = _number(arg, value)
    check_range(arg, value, 1.0, _FLOAT32_MAX, high_inclusive=True)
    return value


def _checked_dynamic_config(
    initial_loss_scale: Any, increment_period: Any, multiplier: Any
) -> tuple[float, int, float]:
    initial = _number("initial_loss_scale", initial_loss_scale)
    check_range("initial_loss_scale", initial, 0.0, _FLOAT32_MAX, low_inclusive=False, high_inclusive=True)
    if _float32(initial) == 0.0:
        raise ValueError(f"Invalid initial_loss_scale value: {initial!r}; it rounds to 0 in float32")
    if isinstance(increment_period, bool) or not isinstance(increment_period, numbers.Integral):
        raise TypeError(
            f"increment_period must be an int, got {type(increment_period).__name__}: {increment_period!r}"
        )
    period = int(increment_period)
    check_range("increment_period", period, 1, _INT64_MAX, high_inclusive=True)
    factor = _number("multiplier", multiplier)
    check_range("multiplier", factor, 1.0, _FLOAT32_MAX, low_inclusive=False, high_inclusive=True)
    if _float32(factor) == 1.0:
        raise ValueError(f"Invalid multiplier value: {factor!r}; it rounds to 1 in float32")
    return initial, period, factor


def _checked_state_tensor(name: str, value: Any, *, floating: bool) -> Tensor:
    kind = "floating-point" if floating else "integer"
    if (
        not isinstance(value, Tensor)
        or value.numel() != 1
        or value.is_floating_point() != floating
        or value.is_complex()
        or value.dtype == torch.bool
    ):
        raise ValueError(f"Invalid {name} in the loaded state: expected a 0-d {kind} tensor, got {value!r}")
    return value.reshape(())


def _float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()
