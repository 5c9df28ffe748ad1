"""Hyperparameters: their specs and range checks, and the 0-d tensors the update rules read.

TensorFlow converts a hyperparameter to a float32 tensor and then to the variable's dtype;
``HyperScalars`` reproduces that rounding. Python numbers become kept CPU tensors
(``number_tensor``), so a step does not make the same small tensors again.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._torch_internals import tracing_or_transforming, version

# Accepted numbers each Hyper remembers (a scheduler may produce a new lr at every step).
_ACCEPTED_PER_HYPER = 1024


def check_range(
    arg: str,
    value: float,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``arg`` unless ``value`` lies in the interval.

    Written as ``not (low <= value < high)`` so that NaN is rejected too.
    """
    if not _in_range(value, low, high, low_inclusive, high_inclusive):
        interval = _interval(low, high, low_inclusive, high_inclusive)
        raise ValueError(f"Invalid {arg} value: {value!r}; expected a value in {interval}")


def _in_range(value: float, low: float, high: float, low_inclusive: bool, high_inclusive: bool) -> bool:
    above = low <= value if low_inclusive else low < value
    below = value <= high if high_inclusive else value < high
    return above and below


def _interval(low: float, high: float, low_inclusive: bool, high_inclusive: bool) -> str:
    return f"{'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"


def _round_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (inf beyond its range); float32 without making a tensor."""
    if dtype == torch.float64:
        return value
    if dtype == torch.float32:
        try:
            return struct.unpack("f", struct.pack("f", value))[0]
        except OverflowError:
            return math.copysign(math.inf, value)
    return torch.tensor(value, dtype=torch.float64).to(dtype).item()


@dataclass(frozen=True)
class Hyper:
    """A numeric hyperparameter: its key in the param group, TF's argument name, its range.

    A value may be a Python number, a 0-d floating tensor or (as in TF) a
    zero-argument callable returning one of those, evaluated at every apply.
    """

    key: str
    arg: str
    low: float = -math.inf
    high: float = math.inf
    low_inclusive: bool = True
    high_inclusive: bool = False
    # A slot's initial value: TF fills the slot in the variable's dtype, not through float32.
    in_param_dtype: bool = False

    def __post_init__(self) -> None:
        # Numbers (with dtypes) that passed the check; not a field, so not part of eq or hash.
        object.__setattr__(self, "_accepted", set())

    def check(self, value: Any, dtypes: Iterable[torch.dtype] = ()) -> None:
        """Check ``value``'s type and range, as given and as the update sees it.

        A hyperparameter reaches the update as a float32 scalar (TF's
        conversion, see ``HyperScalars``; a float64 tensor keeps its precision
        for float64 parameters): a value in range as a Python float can leave
        it there (``1e39`` becomes inf, ``1 - 1e-10`` becomes 1.0), so the value
        rounded to float32 is checked too, for a float64 tensor as well. A
        slot's initial value is checked in ``dtypes``, those of the parameters
        whose slots it fills.
        """
        if callable(value) and not isinstance(value, Tensor):
            return
        if type(value) not in (float, int):
            self._check_number(value, dtypes)
            return
        # The common case, checked before every step: a number once accepted is not checked again.
        key = (value, frozenset(dtypes)) if self.in_param_dtype and dtypes else value
        if key not in self._accepted:
            self._check_number(value, dtypes)
            if len(self._accepted) < _ACCEPTED_PER_HYPER:
                self._accepted.add(key)

    def _check_number(self, value: Any, dtypes: Iterable[torch.dtype]) -> None:
        number = _to_float(self.arg, value)
        bounds = (self.low, self.high, self.low_inclusive, self.high_inclusive)
        if not _in_range(number, *bounds):
            raise ValueError(f"Invalid {self.arg} value: {value!r}; expected a value in {_interval(*bounds)}")
        for dtype in set(dtypes) if self.in_param_dtype else (torch.float32,):
            rounded = _round_to(number, dtype)
            if not _in_range(rounded, *bounds):
                where = (
                    "the parameter's dtype, where the slot lives"
                    if self.in_param_dtype
                    else "the precision the update uses"
                )
                raise ValueError(
                    f"Invalid {self.arg} value: {value!r}; expected a value in {_interval(*bounds)} "
                    f"once rounded to {str(dtype).removeprefix('torch.')}, {where} (it rounds to {rounded!r})"
                )


@dataclass(frozen=True)
class Flag:
    """A boolean hyperparameter (``use_nesterov``, ``centered``)."""

    key: str
    arg: str

    def check(self, value: Any, dtypes: Iterable[torch.dtype] = ()) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{self.arg} must be a bool, got {type(value).__name__}: {value!r}")


def _to_float(arg: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
        raise TypeError(
            f"{arg} must be a number, a 0-d floating tensor or a callable, "
            f"got {type(value).__name__}: {value!r}"
        )
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{arg} given as a tensor must be floating point, got dtype {value.dtype}")
        if value.layout != torch.strided:
            raise TypeError(f"{arg} given as a tensor must be dense (strided), got layout {value.layout}")
        if value.dim() != 0:
            # torch.optim raises ValueError for a tensor lr that is not one element.
            raise ValueError(f"Invalid {arg} value: {value!r}; expected a 0-d tensor")
        if value.is_meta:
            raise ValueError(f"Invalid {arg} value: {value!r}; a meta tensor holds no number to train with")
        return float(value.detach())
    return python_float(arg, value)


def python_float(arg: str, value: Any) -> float:
    """``float(value)`` of a Python number, with an error naming ``arg`` for an int too large for a float."""
    try:
        return float(value)
    except OverflowError:
        bits = value.bit_length()
        raise ValueError(f"Invalid {arg} value: an int of {bits} bits, too large for a float") from None


def float32_tensor(value: float | Tensor, device: torch.device) -> Tensor:
    """``value`` as a 0-d float32 tensor on ``device``.

    A Python number enters as the factor of a multiplication, not through
    ``torch.as_tensor``/``torch.tensor``: under ``torch.compile`` those specialise
    the graph on the number's value, so an LR scheduler changing a float ``lr``
    would recompile at every step until dynamo gives up and runs eagerly. A
    scalar operand is what dynamo (and inductor) keep symbolic, as for
    ``torch.optim``'s float ``lr``. ``1 * value`` rounds ``value`` to float32
    once, as a float32 conversion does; the final cast covers inductor, which
    passes the scalar in as a float64 tensor.
    """
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32)
    return number_tensor(value, torch.float32, device)


def number_tensor(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The Python number ``value`` rounded to float32, then cast to ``dtype``: a 0-d tensor on
    ``device``, made once on CPU and kept.

    An optimizer's hyperparameters are the same numbers at almost every step,
    and making one costs three small tensor ops (5 to 10 µs of host time each).
    The update rules only read them; a kept tensor that something wrote in
    place anyway (its version counter moved) is made again. Neither kept nor
    looked up under ``torch.compile`` (which traces the ops and would guard on
    the number), a dispatch mode (fake or meta tensors) or a functorch
    transform (whose tensors are wrappers). Not kept in inference mode (an
    inference tensor). Only CPU tensors are kept: on CUDA a tensor made on one
    stream and read on another needs synchronisation a cache cannot give
    (and XLA's tensors are lazy).
    """
    if device != _CPU or tracing_or_transforming():
        return _float32_number(value, device).to(dtype)
    # -0.0 == 0.0, but their tensors differ in sign; 2**64 (an int) is refused where 2.0**64 is not.
    key = (type(value), value, math.copysign(1.0, value), dtype)
    kept = _NUMBER_TENSORS.get(key)
    if kept is not None and version(kept[0]) == kept[1]:
        return kept[0]
    made = _float32_number(value, device).to(dtype)
    if type(made) is Tensor and made.device == device and not torch.is_inference_mode_enabled():
        if len(_NUMBER_TENSORS) >= _NUMBER_TENSORS_LIMIT:
            _NUMBER_TENSORS.clear()  # (a learning-rate schedule makes new numbers at every step)
            _NUMBER_TENSORS_BY_ID.clear()
        elif kept is not None:
            _NUMBER_TENSORS_BY_ID.pop(id(kept[0]), None)
        _NUMBER_TENSORS[key] = (made, version(made))
        _NUMBER_TENSORS_BY_ID[id(made)] = made
    return made


def _is_kept_number(value: Any) -> bool:
    """Whether ``value`` is a tensor :func:`number_tensor` keeps (whatever it holds now)."""
    return _NUMBER_TENSORS_BY_ID.get(id(value)) is value


def _float32_number(value: float, device: torch.device) -> Tensor:
    return torch.ones((), dtype=torch.float32, device=device).mul(value).to(torch.float32)


# The CPU tensors number_tensor made, and their versions then, by the number's type, value and
# sign, and the dtype.
_NUMBER_TENSORS: dict[tuple[type, Any, float, torch.dtype], tuple[Tensor, int]] = {}

# The same tensors by id (see _is_kept_number).
_NUMBER_TENSORS_BY_ID: dict[int, Tensor] = {}

_NUMBER_TENSORS_LIMIT = 1024

_CPU = torch.device("cpu")


class HyperScalars:
    """The hyperparameters of one param group as 0-d tensors of one dtype and device.

    TensorFlow converts every hyperparameter to a tensor (a Python number to
    float32; a tensor keeps its dtype) and then casts it to the variable's
    dtype; every scalar expression in a kernel (``1 - beta1``) is then
    evaluated in that dtype. ``hyper.beta1`` reproduces that rounding: float32
    first (except for a float64 tensor), then the parameter dtype, on the
    parameter's device, so the update math needs no host synchronisation.
    """

    def __init__(
        self, values: dict[str, Any], dtype: torch.dtype, device: torch.device, *, kept: bool = False
    ):
        self._values = values
        # kept: reused from step to step (a replayed step's), so it remembers the tensors it
        # handed out and their versions then (see unchanged).
        self._made: list[Tensor] | None = [] if kept else None
        self._versions: list[int] = []
        self.dtype = dtype
        self.device = device

    def __getattr__(self, name: str) -> Tensor:
        # (Called once per name: the tensor is then an attribute of its own.)
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._values:
            raise AttributeError(f"no hyperparameter named {name!r}")
        made = self.__dict__[name] = self._handed_out(self.tensor(self._values[name]))
        return made

    def _handed_out(self, made: Tensor) -> Tensor:
        if self._made is not None:
            self._made.append(made)
            self._versions.append(version(made))
        return made

    def unchanged(self) -> bool:
        """Whether nothing has written in place to a tensor it handed out (which a step that
        reuses it would then read), for one made with ``kept=True``."""
        if self._made is None:
            raise RuntimeError("HyperScalars.unchanged() needs kept=True: no versions were kept")
        return list(map(version, self._made)) == self._versions

    def tensor(self, value: float | Tensor) -> Tensor:
        """``value`` rounded to float32 (a float64 tensor keeps its precision), then cast to this
        dtype and device."""
        if isinstance(value, Tensor):
            if value.dtype == torch.float64:
                return value.to(device=self.device, dtype=self.dtype)
            return value.to(device=self.device, dtype=torch.float32).to(self.dtype)
        return number_tensor(value, self.dtype, self.device)

    @property
    def one(self) -> Tensor:
        one = self.__dict__.get("_one")
        if one is None:
            one = self.__dict__["_one"] = self._handed_out(number_tensor(1, self.dtype, self.device))
        return one

    def value(self, name: str) -> Any:
        """The evaluated Python-level value (a number or a tensor), for branching."""
        return self._values[name]

    def is_zero(self, name: str) -> bool:
        """Whether ``name`` is the Python number 0; a tensor value is not read on the host to find out."""
        value = self._values[name]
        return not isinstance(value, Tensor) and value == 0


def _any_callable(groups: list[dict[str, Any]], hypers: tuple[Hyper | Flag, ...]) -> bool:
    """Whether some group's hyperparameter is a callable, which :func:`_evaluate` calls."""
    keys = [spec.key for spec in hypers if isinstance(spec, Hyper)]
    return any(callable(v) and not isinstance(v, Tensor) for group in groups for v in map(group.get, keys))


def _evaluate(group: dict[str, Any], hypers: tuple[Hyper | Flag, ...]) -> dict[str, Any]:
    """The group's hyperparameter values, callables evaluated (TF's ``_call_if_callable``), checked.

    A value may have changed since the constructor checked it (an LR scheduler,
    ``group["lr"] = ...``, a callable), so each is checked again before it is
    used, with the constructor's ranges (a number already accepted costs a
    cache lookup). Slot initial values are checked in the parameter dtype by
    ``_apply``, when they fill new slots. Numbers and CPU tensors are read on
    the host, which costs no device synchronisation; a tensor on an
    accelerator is checked when set (constructor, ``add_param_group``,
    ``load_state_dict``) but not at every step, as reading it would stall the
    device. Inside ``torch.compile`` the re-check is left out too: host-side
    checks of a value the compiled graph keeps symbolic would break the graph
    or specialise it on every value.
    """
    compiling = torch.compiler.is_compiling()
    values: dict[str, Any] = {}
    for spec in hypers:
        value = group[spec.key]
        if isinstance(spec, Hyper) and callable(value) and not isinstance(value, Tensor):
            if spec.key == "lr" and "initial_lr" in group:
                # torch's schedulers set initial_lr and then multiply group["lr"]; they would fail
                # on the callable later, in their own code, with an operand error.
                raise RuntimeError(
                    f"learning_rate is a callable ({value!r}) and a torch.optim.lr_scheduler drives this "
                    "group (it set 'initial_lr'); pass a number or a 0-d tensor to use a scheduler, "
                    "or put the schedule inside the callable"
                )
            value = value()
        if not compiling and not (isinstance(value, Tensor) and value.device.type not in ("cpu", "meta")):
            spec.check(value)
        values[spec.key] = value
    return values


def _check_slot_values(
    values: dict[str, Any], hypers: tuple[Hyper | Flag, ...], dtypes: set[torch.dtype]
) -> None:
    """Check the slot initial values about to fill new slots of ``dtypes`` (see ``Hyper.in_param_dtype``)."""
    for spec in hypers:
        if isinstance(spec, Hyper) and spec.in_param_dtype:
            value = values[spec.key]
            if not (isinstance(value, Tensor) and value.device.type != "cpu"):
                spec.check(value, dtypes)


def _check_group_values(
    group: dict[str, Any], hypers: tuple[Hyper | Flag, ...], dtypes: set[torch.dtype]
) -> None:
    """Check a param group's hyperparameters as the constructor does (``load_state_dict``)."""
    for spec in hypers:
        if spec.key in group:
            spec.check(group[spec.key], dtypes)
    _check_path_flags(group)


def _check_path_flags(group: dict[str, Any]) -> None:
    """``foreach`` and ``fused``: None or a bool each, not both True (torch's rules and words)."""
    for key in ("foreach", "fused"):
        if group.get(key) is not None and not isinstance(group[key], bool):
            raise TypeError(f"{key} must be None or a bool, got {group[key]!r}")
    if group.get("foreach") and group.get("fused"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
