"""The base class of the TF v1 optimizers: TensorFlow's API on torch.optim's bookkeeping.

``Optimizer`` owns everything that is not update math: argument validation, slot
creation, TF's ``compute_gradients`` / ``apply_gradients`` / ``minimize``, sparse
coalescing, optimizer-wide ("non-slot") state, ``get_slot``, ``state_dict`` and
DTensor parameters (FSDP2). Each optimizer file owns only its hyperparameters,
its slot initial values and its update rule, reached through four hooks:

- ``_init_slots(group, p)`` returns the slot tensors of a parameter;
- ``_init_non_slot(group, device)`` returns optimizer-wide state (Adam's beta powers);
- ``_apply_dense(group, params, grads, slots, non_slot, hyper)`` updates a list of
  parameters of one dtype and device;
- ``_apply_sparse(group, p, indices, values, slots, non_slot, hyper)`` updates the
  rows ``indices`` of one parameter;
- ``_finish(group, non_slot, hyper)`` runs once per apply, after every update
  (TF's ``_finish``: Adam advances its beta powers there).

``step()`` and ``apply_gradients()`` both end in ``_apply``: there is one update path.

Optimizer-wide state is kept as 0-d tensors inside each param group dict
(``group["beta1_power"]``), one set per group, so that every tool that saves or
moves only torch's ``state`` and ``param_groups`` (``torch.distributed.checkpoint``,
``ZeroRedundancyOptimizer``, Lightning) carries it. ``_non_slot_of`` is the one
accessor; the hooks receive a dict of it and ``_apply`` writes it back.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import itertools
import math
import operator
import struct
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _default_to_fused_or_foreach, _global_optimizer_pre_hooks

from ..gradients import check_aggregation_method, gradients

__all__ = [
    "Flag",
    "Hyper",
    "HyperScalars",
    "Optimizer",
    "check_range",
    "compute_gradients",
    "float32_tensor",
    "hooked_update",
    "pick_impl",
]

_VALID_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Where numpy's square root serves (see sqrt).
_NUMPY_SQRT_DTYPES = (torch.float32, torch.float64)
# The param-group keys of a LossScaleOptimizer's state (which it keeps in every group).
LOSS_SCALE_KEY_PREFIX = "loss_scale_"
# CPU foreach updates run over chunks of at most this many parameter bytes (see _chunks).
_CPU_CHUNK_BYTES = 512 * 1024
# Tensors per compiled call of a fused update (see _run_fused). Larger chunks call fewer times
# but compile for longer: Adam, cold Inductor cache, 22.5 s at 32 and 15.8 s at 16 (3.4 s warm),
# while a call costs ~16 µs of host time (63 calls for 1000 tensors: 1 ms).
FUSED_CHUNK = 16
_FUSED_DEVICES = ("cpu", "cuda")
# Graphs a fused update may compile per optimizer rule (dtypes, devices and options), for dynamo.
_FUSED_GRAPH_LIMIT = 64
# Elements of the rows of zeros a fused kernel is compiled on (see _FusedKernel._compile).
_FUSED_SIZE_HINT = 4096
# The tensors that fill up a last chunk.
_FUSED_FILLERS: dict[tuple[torch.device, torch.dtype, int, int], list[list[Tensor]]] = {}
# The largest row a fused kernel takes on a GPU: Triton kernels compiled for small sizes index
# in int32 (less a margin for the last block's offsets); larger rows take the reference loop.
_TRITON_ROW_LIMIT = 2**31 - 2**16
# CUDA graphs a fused plan keeps, one per set of gradient addresses (see _FusedPlan.step_graph).
_GRAPHS_PER_PLAN = 4
# True while Optimizer._apply runs: every row it hands the fused kernels has its parameter's
# shape (step() and apply_gradients check gradients; slots are made and loaded so).
_ROWS_FIT: contextvars.ContextVar[bool] = contextvars.ContextVar("_ROWS_FIT", default=False)
# Set by Optimizer._apply around one group's update: the kept metadata that step()'s census found
# the group's parameters and gradients (these lists) to have, and the kept metadata of the group's
# slots that its check of the slots found them to have (None without slots), with nothing run
# since that could change them (see _FusedPlan._holds_as_last_found).
_CENSUS_HELD: contextvars.ContextVar[
    tuple[_SameMeta, list[Tensor], list[Tensor], _SlotRecord | None] | None
] = contextvars.ContextVar("_CENSUS_HELD", default=None)
# Set by Optimizer._apply while it records a step to replay (see _StepReplay): each _run_fused call
# appends what it called, or None where it took another way than one plan's kernel calls.
_FUSED_CALLS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("_FUSED_CALLS", default=None)
# Set by LossScaleOptimizer around a step of ours whose fused kernels unscale the gradients in
# their own pass (see _unscaling).
_UNSCALING: contextvars.ContextVar[_Unscaling | None] = contextvars.ContextVar("_UNSCALING", default=None)
# The types of the param-group values a replayed step may depend on: values that cannot change in
# place, so that one found to be the very object it was is the value it was.
_REPLAYABLE_VALUES = (bool, int, float, str, type(None))
# Accepted numbers each Hyper remembers (a scheduler may produce a new lr at every step).
_ACCEPTED_PER_HYPER = 1024
# Chunk layouts whose scratch views an optimizer keeps (see Optimizer._scratch).
_SCRATCH_SETS = 256
# Param-group keys other optimizers read, which a group copied from their code may hold, and
# why the optimizers here do without them (see Optimizer._refuse_keys_it_would_not_read).
_FOREIGN_KEYS = {
    # torch.optim
    "weight_decay": "TensorFlow's v1 optimizers apply no weight decay (add it to the loss, as TF code does)",
    "decoupled_weight_decay": "TensorFlow's v1 optimizers apply no weight decay",
    "maximize": "TensorFlow's optimizers minimize (negate the loss instead)",
    "amsgrad": "TensorFlow's v1 Adam has no AMSGrad variant",
    "dampening": "TensorFlow's momentum has no dampening",
    "lr_decay": "TensorFlow's Adagrad has no learning-rate decay (use a torch.optim.lr_scheduler)",
    "differentiable": "its steps are not differentiable",
    "betas": "it is torch's pair (beta1, beta2), which only AdamOptimizer takes",
    "momentum_decay": "it is NAdam's, which TensorFlow's v1 optimizers do not have",
    "lambd": "it is ASGD's, which TensorFlow's v1 optimizers do not have",
    "t0": "it is ASGD's, which TensorFlow's v1 optimizers do not have",
    "etas": "it is Rprop's, which TensorFlow's v1 optimizers do not have",
    "step_sizes": "it is Rprop's, which TensorFlow's v1 optimizers do not have",
    # Keras
    "clipnorm": "it clips nothing (clip the gradients before step())",
    "clipvalue": "it clips nothing (clip the gradients before step())",
    "global_clipnorm": "it clips nothing (clip the gradients before step())",
    "use_ema": "it keeps no moving average of the weights",
    "ema_momentum": "it keeps no moving average of the weights",
}
# Names other code gives a hyperparameter that some optimizers here have under their own key.
_EQUIVALENT_KEYS = {
    "eps": "epsilon",
    "nesterov": "use_nesterov",
    "alpha": "decay",
    "beta_1": "beta1",
    "beta_2": "beta2",
}
_EQUIVALENT_NOTES = {
    "eps": " (TensorFlow's epsilon, which enters the update where TF puts it, not where torch puts eps)",
    "alpha": " (the decay of the mean square, torch's alpha)",
}
# Group keys of the wrappers' state (LossScaleOptimizer's, AGN's), in a group copied from one.
_WRAPPER_KEY_PREFIXES = (LOSS_SCALE_KEY_PREFIX, "agn_")


def _same_given_value(value: Any, given: Any) -> bool:
    """Whether a TF name in a group still holds the value given for it (a copy of it counts)."""
    if value is given:
        return True
    if isinstance(value, Tensor) and isinstance(given, Tensor):
        return (
            value.shape == given.shape
            and value.dtype == given.dtype
            and value.device == given.device
            and bool(torch.equal(value, given))
        )
    numbers = (int, float)
    return type(value) in numbers and type(given) in numbers and value == given


def _asks_for_nothing(value: Any) -> bool:
    """Whether a foreign hyperparameter's value leaves the update as it is (no decay, no clipping)."""
    return value is None or value is False or (type(value) in (int, float) and value == 0)


@functools.cache
def _library_hyper_keys() -> dict[str, str]:
    """Each group key and TF argument name of this package's optimizers: which of them have it."""
    from .. import optim  # (here, not at the top: the optimizers import this module)

    holders: dict[str, list[str]] = {}
    for name in optim.__all__:
        for spec in getattr(getattr(optim, name), "_hypers", ()):
            for key in {spec.key, spec.arg}:
                holders.setdefault(key, []).append(name)
    return {key: f"it is a hyperparameter of {', '.join(sorted(h))}" for key, h in holders.items()}


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
    return _number_tensor(value, torch.float32, device)


def _number_tensor(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
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
    if device != _CPU or _tracing_or_transforming():
        return _float32_number(value, device).to(dtype)
    # -0.0 == 0.0, but their tensors differ in sign; 2**64 (an int) is refused where 2.0**64 is not.
    key = (type(value), value, math.copysign(1.0, value), dtype)
    kept = _NUMBER_TENSORS.get(key)
    if kept is not None and kept[0]._version == kept[1]:
        return kept[0]
    made = _float32_number(value, device).to(dtype)
    if type(made) is Tensor and made.device == device and not torch.is_inference_mode_enabled():
        if len(_NUMBER_TENSORS) >= _NUMBER_TENSORS_LIMIT:
            _NUMBER_TENSORS.clear()  # (a learning-rate schedule makes new numbers at every step)
            _NUMBER_TENSORS_BY_ID.clear()
        elif kept is not None:
            _NUMBER_TENSORS_BY_ID.pop(id(kept[0]), None)
        _NUMBER_TENSORS[key] = (made, made._version)
        _NUMBER_TENSORS_BY_ID[id(made)] = made
    return made


def _is_kept_number(value: Any) -> bool:
    """Whether ``value`` is a tensor :func:`_number_tensor` keeps (whatever it holds now)."""
    return _NUMBER_TENSORS_BY_ID.get(id(value)) is value


def _tracing_or_transforming() -> bool:
    """Whether ops run under ``torch.compile``'s tracing, a dispatch mode (fake or meta tensors) or
    a functorch transform (whose tensors are wrappers)."""
    return (
        torch.compiler.is_compiling()
        or bool(torch._C._len_torch_dispatch_stack())
        or torch._C._functorch.peek_interpreter_stack() is not None
    )


def _float32_number(value: float, device: torch.device) -> Tensor:
    return torch.ones((), dtype=torch.float32, device=device).mul(value).to(torch.float32)


# The CPU tensors _number_tensor made, and their versions then, by the number's type, value and
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

    def __init__(self, values: dict[str, Any], dtype: torch.dtype, device: torch.device):
        self._values = values
        self._cache: dict[str, Tensor] = {}
        self.dtype = dtype
        self.device = device

    def __getattr__(self, name: str) -> Tensor:
        if name.startswith("_"):
            raise AttributeError(name)
        cache = self._cache
        if name not in cache:
            if name not in self._values:
                raise AttributeError(f"no hyperparameter named {name!r}")
            cache[name] = self.tensor(self._values[name])
        return cache[name]

    def tensor(self, value: float | Tensor) -> Tensor:
        """``value`` rounded to float32 (a float64 tensor keeps its precision), then cast to this
        dtype and device."""
        if isinstance(value, Tensor):
            if value.dtype == torch.float64:
                return value.to(device=self.device, dtype=self.dtype)
            return value.to(device=self.device, dtype=torch.float32).to(self.dtype)
        return _number_tensor(value, self.dtype, self.device)

    @property
    def one(self) -> Tensor:
        if "one" not in self._cache:
            self._cache["one"] = _number_tensor(1, self.dtype, self.device)
        return self._cache["one"]

    def value(self, name: str) -> Any:
        """The evaluated Python-level value (a number or a tensor), for branching."""
        return self._values[name]

    def is_zero(self, name: str) -> bool:
        """Whether ``name`` is the Python number 0; a tensor value is not read on the host to find out."""
        value = self._values[name]
        return not isinstance(value, Tensor) and value == 0


def hooked_update(apply_gradients: Callable[..., None]) -> Callable[..., None]:
    """Wrap an ``apply_gradients`` as torch wraps ``step``: step pre/post hooks around it.

    ``register_step_pre_hook``/``register_step_post_hook`` (and the global ones)
    then fire on every update path: ``step``, ``apply_gradients`` and
    ``minimize`` (through ``apply_gradients``), once per update. The hooks get
    ``apply_gradients``'s arguments. The call also marks the optimizer as
    stepped for torch's LR schedulers, which otherwise warn that the scheduler
    stepped first.
    """
    hooked = torch.optim.Optimizer.profile_hook_step(apply_gradients)

    @functools.wraps(apply_gradients)
    def wrapper(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        self._opt_called = True  # type: ignore[attr-defined]  # read by torch.optim.lr_scheduler
        return hooked(self, *args, **kwargs)

    return wrapper


class Optimizer(torch.optim.Optimizer):
    """Base class of the TF v1 optimizers; a ``torch.optim.Optimizer``.

    Adds TensorFlow's API: ``compute_gradients``, ``apply_gradients``,
    ``minimize``, ``get_slot``, ``get_slot_names`` and ``variables``, and keeps
    torch's: ``step(closure)``, ``zero_grad``, param groups, LR schedulers (the
    learning rate lives in ``group["lr"]``) and ``state_dict``.

    Slots (TF's per-variable optimizer state) are the entries of ``self.state[p]``,
    keyed by TF's slot names. State TF keeps outside slots, once per optimizer,
    (Adam's ``beta1_power``/``beta2_power``, AdagradDA's step) is kept once per
    param group, as 0-d tensors in the group dict (``group["beta1_power"]``),
    and advanced once per ``step``/``apply_gradients`` call. ``state_dict()``
    therefore has exactly torch's two keys, ``state`` and ``param_groups``, and
    tools that copy only those (``torch.distributed.checkpoint``,
    ``ZeroRedundancyOptimizer``) lose nothing. ``load_state_dict`` also accepts
    the earlier layout, with the non-slot state under a top-level
    ``"non_slot_state"`` list.

    Parameters may be DTensors (``torch.distributed.fsdp.fully_shard``, tensor
    parallelism): every update rule here is elementwise, so each rank updates its
    local shard, with slots sharded like the parameter.

    Subclasses declare ``_hypers`` (their hyperparameters), ``_slots`` (slot
    names) and implement the hooks listed in this module's docstring.
    """

    GATE_NONE: ClassVar[int] = 0
    GATE_OP: ClassVar[int] = 1
    GATE_GRAPH: ClassVar[int] = 2

    _hypers: ClassVar[tuple[Hyper | Flag, ...]] = ()
    _slots: ClassVar[tuple[str, ...]] = ()
    # TF sums duplicate sparse indices before the update; GradientDescent does not.
    _coalesce_sparse: ClassVar[bool] = True
    # Ranges of loaded non-slot state, by key (Adam's beta powers lie in [0, 1)).
    _non_slot_ranges: ClassVar[tuple[Hyper, ...]] = ()
    # Instance attributes kept by pickling and deepcopy, beyond torch's three.
    _pickled_attributes: ClassVar[tuple[str, ...]] = ("_non_slot_keys", "_tf_names_given")
    # Truthy only inside _gradients_checked(): step() then skips its own check of every p.grad;
    # a (device, dtype) when that check found every parameter and gradient of it.
    _grads_checked: tuple[torch.device, torch.dtype] | bool = False
    # The kernel scalars a rule computes at every step (name -> its function of the group's
    # non-slot tensors and HyperScalars), which its _apply_dense takes from _derived and a
    # replayed step computes again the same way (see _StepReplay).
    _derived_scalars: ClassVar[dict[str, Callable[[dict[str, Tensor], HyperScalars], Tensor]]] = {}

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]):
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors "
                f"or dicts, but got {torch.typename(params)}"
            )
        # The group keys of the optimizer-wide state (the same in every group), from _init_non_slot.
        self._non_slot_keys: tuple[str, ...] = ()
        # Per group index, the values given under TF's names when the group was added or loaded
        # (``_check_tf_names_written_since``).
        self._tf_names_given: dict[int, dict[str, Any]] = {}
        defaults = {"foreach": None, "fused": None, **defaults}
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        # torch pickles only defaults, state and param_groups (its hooks may not
        # pickle); the attributes a subclass names travel too.
        return {**super().__getstate__(), **{name: getattr(self, name) for name in self._pickled_attributes}}

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the group's hyperparameters and parameters, then add it (as torch does)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        given = {arg: param_group[arg] for arg, _ in self._tf_renames() if arg in param_group}
        group = self._rename_tf_keys(dict(param_group))
        self._refuse_keys_it_would_not_read(group)
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for name, default in self.defaults.items():
            group.setdefault(name, default)
        dtypes = {p.dtype for p in params if isinstance(p, Tensor) and p.dtype in _VALID_DTYPES}
        for spec in self._hypers:
            spec.check(group[spec.key], dtypes)
        _check_path_flags(group)
        name = type(self).__name__
        first_at: dict[int, int] = {}
        for i, p in enumerate(params):
            if isinstance(p, Tensor) and first_at.setdefault(id(p), i) != i:
                # torch only warns; a parameter listed twice would be updated twice per step.
                raise ValueError(
                    f"{name}: parameter {i} of the group is parameter {first_at[id(p)]} again; list "
                    "each parameter once (it would be updated twice per step)"
                )
            if isinstance(p, Tensor) and p.is_inference():
                raise ValueError(
                    f"{name}: parameter {i} of the group is an inference tensor (made under "
                    "torch.inference_mode()), which a step cannot update in place; make it outside "
                    "inference mode, or clone it there"
                )
            if isinstance(p, Tensor) and p.layout == torch.strided and _is_expanded(p):
                raise ValueError(
                    f"{name}: parameter {i} of the group is an expanded view (strides {p.stride()}): "
                    "its elements share memory, which an in-place update cannot write; pass a "
                    "contiguous copy"
                )
            if isinstance(p, Tensor) and p.is_complex():
                raise ValueError(f"{name} does not support complex parameters (got dtype {p.dtype})")
            if isinstance(p, Tensor) and p.dtype not in _VALID_DTYPES:
                raise TypeError(
                    f"{name} supports parameters of dtype float16, bfloat16, float32 and "
                    f"float64 (TensorFlow's valid dtypes), got {p.dtype}"
                )
        if group["fused"]:
            _check_fused_devices(name, params)
        group["params"] = params
        super().add_param_group(group)
        added = self.param_groups[-1]
        device = added["params"][0].device if added["params"] else torch.device("cpu")
        # A group dict copied from another optimizer's param_groups may hold its
        # non-slot state: a new group starts fresh, as its slots do.
        non_slot = self._init_non_slot(added, device)
        added.update(non_slot)
        self._non_slot_keys = tuple(non_slot)
        self._mark_written(len(self.param_groups) - 1, added)
        self._tf_names_given[len(self.param_groups) - 1] = given

    def _mark_written(self, index: int, group: dict[str, Any]) -> None:
        """Remember the non-slot tensors this optimizer put in ``group`` (see ``_check_live_non_slot``)."""
        written = self.__dict__.setdefault("_written_non_slot", {})
        for key in self._non_slot_keys:
            written[index, key] = group[key]

    def _non_slot_of(self, group: dict[str, Any]) -> dict[str, Tensor]:
        """The optimizer-wide state of ``group`` (the one accessor; it lives in the group dict)."""
        return {key: group[key] for key in self._non_slot_keys}

    def _rename_tf_keys(self, group: dict[str, Any]) -> dict[str, Any]:
        """Move hyperparameters given under TF's argument names to their keys (``learning_rate`` -> ``lr``).

        A group dict is what users copy from TF code; a TF name torch does not
        know would otherwise sit unused beside the default.
        """
        for arg, key in self._tf_renames():
            if arg not in group:
                continue
            if key in group:
                raise ValueError(
                    f"param group gives both {arg!r} (TensorFlow's name) and {key!r} "
                    f"(its key in the group): {group[arg]!r} and {group[key]!r}; give one"
                )
            group[key] = group.pop(arg)
        return group

    @classmethod
    def _tf_renames(cls) -> tuple[tuple[str, str], ...]:
        """``(TF name, group key)`` of the hyperparameters whose key is not TF's name."""
        return tuple((spec.arg, spec.key) for spec in cls._hypers if spec.arg != spec.key)

    def _check_tf_names_written_since(self, index: int, group: dict[str, Any]) -> None:
        """Refuse a TF name written into a group after it was added (``group["learning_rate"] = x``).

        TF's names are moved to their keys when a group is added or loaded; one
        written later would sit beside the key the update reads. Kept: a TF name
        that still holds the value given when the group was added or loaded, as
        ``ZeroRedundancyOptimizer`` copies its own group (built from the
        constructor's ``learning_rate=``) into this optimizer's before each step.
        """
        given = self._tf_names_given.get(index, {})
        for arg, key in self._tf_renames():
            if arg not in group:
                continue
            value = group[arg]
            if arg in given and _same_given_value(value, given[arg]):
                given[arg] = value  # (the object seen now: the next step compares by identity)
                continue
            raise ValueError(
                f"{type(self).__name__}: param group {index} key {arg!r} (got {value!r}) was written "
                f"after the group was added and would not be read: this optimizer reads {arg} from "
                f"{key!r} (now {group.get(key)!r}); write {key!r} instead"
            )

    def _refuse_keys_it_would_not_read(self, group: dict[str, Any]) -> tuple[str, ...]:
        """Refuse a group key that asks for something this optimizer would silently not do.

        torch keeps a key its optimizer does not read and ignores it, so a group
        copied from torch or Keras code (``"eps"``, ``"weight_decay": 0.01``,
        ``"beta_1"``) or with a misspelled key (``"momentun"``) would train with
        the default in its place. Refused: a hyperparameter name of torch.optim,
        Keras or another optimizer here that this one does not have, unless its
        value is one that asks for nothing (None, False or 0), and any value of
        such a name where this optimizer has its own equivalent; and a key that
        differs only a little from one of this optimizer's keys or TF names. Other
        keys (a scheduler's ``initial_lr``, a user's ``"name"``) are kept, as torch keeps them.
        Returns the foreign keys kept because their values asked for nothing.
        """
        cls = type(self).__name__
        idle: list[str] = []
        own = {"params", *self.defaults, *(spec.key for spec in self._non_slot_ranges)}
        names = {*own, *(spec.arg for spec in self._hypers)}
        for key, value in group.items():
            if not isinstance(key, str) or key in names or key.startswith(_WRAPPER_KEY_PREFIXES):
                continue
            equivalent = _EQUIVALENT_KEYS.get(key)
            if equivalent is not None and equivalent in own:
                raise ValueError(
                    f"{cls}: param group key {key!r} (got {value!r}) is not read by this optimizer; "
                    f"its key is {equivalent!r}{_EQUIVALENT_NOTES.get(key, '')}"
                )
            if equivalent is not None:
                reason = f"it is another name of {equivalent!r}; {_library_hyper_keys()[equivalent]}"
            else:
                reason = _FOREIGN_KEYS.get(key) or _library_hyper_keys().get(key)
            if reason is not None:
                if _asks_for_nothing(value):
                    idle.append(key)
                    continue
                raise ValueError(
                    f"{cls}: param group key {key!r} (got {value!r}) is not read by this optimizer: {reason}"
                )
            close = difflib.get_close_matches(key.lower(), sorted(names - {"params"}), n=1, cutoff=0.85)
            if close:
                raise ValueError(
                    f"{cls}: param group key {key!r} (got {value!r}) is not a key of this optimizer; "
                    f"did you mean {close[0]!r}? (its keys: {sorted(own - {'params'})})"
                )
        return tuple(idle)

    def _recheck_group_keys(self, index: int, group: dict[str, Any]) -> None:
        """At a step, check a group again if keys were added since (a training loop's
        ``group["weight_decay"] = wd``) or a foreign key kept for its value of 0 now asks for something."""
        seen = self.__dict__.setdefault("_group_keys_seen", {})
        kept = seen.get(index)
        if kept is None or group.keys() != kept[0] or not all(_asks_for_nothing(group[k]) for k in kept[1]):
            seen[index] = (frozenset(group), self._refuse_keys_it_would_not_read(group))

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's optimizers fill flags missing from an older state_dict with their
        # defaults here (load_state_dict ends in __setstate__); so do these.
        state = dict(state)
        old_non_slot = state.pop("_non_slot", None)
        # (The slot dicts of the last step, which a loaded state replaces: not kept alive.)
        self.__dict__.pop("_slot_dicts_kept", None)
        self.__dict__.pop("_step_replay", None)
        super().__setstate__(state)
        if old_non_slot is not None:
            # An optimizer pickled whole by the earlier layout: its non-slot state moves into its groups.
            for group, non_slot in zip(self.param_groups, old_non_slot, strict=True):
                group.update(non_slot)
            self._non_slot_keys = tuple(old_non_slot[0]) if old_non_slot else ()
        self.__dict__.setdefault("_tf_names_given", {})  # (an optimizer pickled before it was kept)
        flags = ["foreach", "fused", *(spec.key for spec in self._hypers if isinstance(spec, Flag))]
        for group in self.param_groups:
            for key in flags:
                group.setdefault(key, self.defaults[key])

    # ------------------------------------------------------------------ hooks
    def _slot_names_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        """Slot names used by ``group``; RMSProp overrides it (``mg`` only when centered)."""
        return self._slots

    def _init_slots(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        return {}

    def _sync_aliases(self) -> None:
        """Reconcile group keys kept under two names (Adam's ``betas``), before an update or a save.

        What it does depends on the group values alone: a replayed step (see
        :class:`_StepReplay`), whose groups hold the very values reconciled at the
        step it replays, does not call it.
        """
        return None

    def _init_non_slot(self, group: dict[str, Any], device: torch.device) -> dict[str, Tensor]:
        return {}

    def _apply_dense(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        slots: list[dict[str, Tensor]],
        non_slot: dict[str, Tensor],
        hyper: HyperScalars,
    ) -> None:
        raise NotImplementedError

    def _apply_sparse(
        self,
        group: dict[str, Any],
        p: Tensor,
        indices: Tensor,
        values: Tensor,
        slots: dict[str, Tensor],
        non_slot: dict[str, Tensor],
        hyper: HyperScalars,
    ) -> None:
        raise NotImplementedError

    @staticmethod
    def _one_minus(key: str) -> Callable[[dict[str, Tensor], HyperScalars], Tensor]:
        """A derived scalar (see :attr:`_derived_scalars`): ``1 - hyperparameter`` in the group's dtype."""
        return lambda non_slot, hyper: hyper.one - getattr(hyper, key)

    def _derived(self, non_slot: dict[str, Tensor], hyper: HyperScalars) -> dict[str, Tensor]:
        """The scalars of :attr:`_derived_scalars`, for this group and bucket."""
        return {name: derive(non_slot, hyper) for name, derive in self._derived_scalars.items()}

    def _finish(self, group: dict[str, Any], non_slot: dict[str, Tensor], values: dict[str, Any]) -> None:
        return None

    @staticmethod
    def _advance(
        non_slot: dict[str, Tensor], key: str, op: Callable[[Tensor, Any], Tensor], operand: Any
    ) -> None:
        """``non_slot[key] = op(non_slot[key], operand)``: a new tensor, kept apart from the gradients.

        A new tensor, not an update in place: a ``state_dict()`` taken earlier
        (kept in memory, or gathered by FSDP's ``get_state_dict``) keeps the
        values it was taken with. On CUDA it comes from a memory pool of its own
        (see :func:`_apart_from_gradients`).
        """
        value = non_slot[key]
        with _apart_from_gradients(value.device):
            non_slot[key] = op(value, operand)

    # ------------------------------------------------------------------ torch API
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply ``p.grad`` of every parameter that has one (torch style).

        Parameters without a gradient are left untouched and get no slots. When
        no parameter has a gradient the call does nothing (torch's convention;
        TF's ``apply_gradients`` raises instead).

        ``torch.distributed.checkpoint`` makes the state of an optimizer that has
        none by calling ``step()`` with zero gradients and ``lr`` 0 (its
        ``_init_optim_state``), assuming such a step changes nothing. Here it
        would: Ftrl and AdagradDA compute the variable in closed form from the
        accumulators (and Ftrl refuses ``lr`` 0), every optimizer-wide counter
        would advance. That call only creates the slots, with their initial
        values, as TF's slot creation does.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # (DCP's first step takes the whole path.)
        replay = self.__dict__.get("_step_replay")
        if replay is not None and not _called_from_dcp_init() and replay.run(self):
            return loss
        grouped: dict[int, list[tuple[Tensor, Tensor]]] = {}
        lists: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        kinds: dict[int, tuple[torch.device, torch.dtype] | None] = {}
        shapes: dict[int, list[torch.Size]] = {}
        census_of: dict[int, _SameMeta] = {}
        checked = self._grads_checked
        compiling = torch.compiler.is_compiling()
        census = not compiling
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            # (Dynamo traces a comprehension, and breaks the graph at `map` over attrgetter.)
            grads = [p.grad for p in params] if compiling else list(map(_GRAD_OF, params))
            if compiling or not all(map(operator.is_not, grads, itertools.repeat(None))):
                params = [p for g, p in zip(grads, params, strict=True) if g is not None]
                grads = [g for g in grads if g is not None]
            if not grads:
                continue
            grouped[gi] = list(zip(grads, params, strict=True))
            lists[gi] = (params, grads)
            # torch checks shape, dtype and device when p.grad is assigned, but not when
            # p.grad.data is; a gradient that does not fit would fail halfway through the
            # update, or, in the fused kernels, be read past its end. One cheap pass covers
            # the usual case, and tells _apply the one device and dtype it updates; each
            # gradient is checked, with a named error, only when it fails (and for sparse
            # gradients, whose rows must be checked).
            if census:
                # (Read once: the check of the slots compares them with the last step's.) Also
                # after a wrapper's check: what it keeps lets the next step be replayed.
                shapes[gi], kind, same = self._census(gi, params, grads)
                if same is not None:
                    census_of[gi] = same
            else:
                kind = None
            if checked:
                if kind is None and isinstance(checked, tuple):
                    kinds[gi] = checked
                elif census:
                    kinds[gi] = kind
                continue
            if kind is None and not _grads_fit(grads, params):
                for g, p in grouped[gi]:
                    _check_grad(type(self).__name__, g, p)
            if census:
                kinds[gi] = kind  # (None: not one kind, which _apply need not find out again)
        if grouped:
            if _called_from_dcp_init():
                self._create_slots(grouped)
            else:
                self._apply(grouped, kinds, shapes, lists, census_of)
        return loss

    def _census(
        self, index: int, params: list[Tensor], grads: list[Tensor]
    ) -> tuple[list[torch.Size], tuple[torch.device, torch.dtype] | None, _SameMeta | None]:
        """The shapes of a group's parameters and :func:`_shared_kind` of its pairs, and the kept
        metadata of both that they were found with (None where none is kept).

        Kept from the last step when every parameter and gradient has the metadata
        it had then (:class:`_SameMeta`): a training loop's do, step after step.
        """
        return _kept_census(self.__dict__.setdefault("_census_kept", {}), index, params, grads)

    @contextmanager
    def _gradients_checked(self, kind: tuple[torch.device, torch.dtype] | None = None) -> Iterator[None]:
        """A ``step()`` inside this block does not check ``p.grad`` against its parameter.

        For a wrapper that has just checked every gradient as ``step()`` would, and
        steps at once, with nothing in between that could replace one: no step
        pre-hook (see :func:`_no_step_pre_hooks`). ``LossScaleOptimizer`` must check
        before it unscales in place; a second check costs about 0.5 ms per 1000
        gradients of host time. ``kind``: the device and dtype that the check found
        every parameter and gradient to have (see :func:`_shared_kind`), if one.
        The step still compares its tensors with the metadata kept from the last
        one (:meth:`_census`, one call), which is what lets it be replayed.
        """
        self._grads_checked = kind or True
        try:
            yield
        finally:
            self._grads_checked = False

    # ------------------------------------------------------------------ TF API
    def compute_gradients(
        self,
        loss: Tensor | Callable[[], Tensor],
        var_list: Sequence[Tensor] | None = None,
        gate_gradients: int = GATE_OP,
        aggregation_method: int | None = None,
        colocate_gradients_with_ops: bool = False,
        grad_loss: Tensor | None = None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """Gradients of ``loss`` for ``var_list`` (default: every parameter that requires grad, as
        TF's default is the trainable variables), as ``(grad, var)`` pairs.

        ``loss`` is a tensor or a zero-argument callable returning one; a
        non-scalar loss is summed (TF's default ``grad_ys`` of ones) unless
        ``grad_loss`` is given. A variable ``loss`` does not depend on gets
        ``None``. Unlike ``backward()``, nothing is accumulated into ``p.grad``,
        and as by ``backward()`` the loss's graph is freed: to differentiate one
        loss for two optimizers (a GAN's), pass a callable that computes it.
        ``gate_gradients`` and ``colocate_gradients_with_ops`` are validated and
        have no numerical effect in eager PyTorch.
        """
        return compute_gradients(
            loss,
            _trainable(self.param_groups) if var_list is None else var_list,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss,
        )

    @hooked_update
    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Tensor | None, Tensor]],
        global_step: Tensor | None = None,
        name: str | None = None,
    ) -> None:
        """Apply ``(grad, var)`` pairs, as TF's ``apply_gradients``.

        ``None`` gradients are skipped; if every gradient is ``None`` a
        ``ValueError`` names the variables. ``global_step``, a 0-d integer
        tensor, is incremented in place after the update. ``name`` is accepted
        for TF compatibility and unused.
        """
        pairs = list(grads_and_vars)
        if not pairs:
            raise ValueError("No variables provided.")
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"grads_and_vars must hold (gradient, variable) pairs, got {item!r}")
        if global_step is not None:
            _check_global_step(global_step)
        present = [(g, v) for g, v in pairs if g is not None]
        if not present:
            raise ValueError(f"No gradients provided for any variable: {[_describe(v) for _, v in pairs]}.")
        self._apply(self._validate_pairs(present))
        if global_step is not None:
            with torch.no_grad():
                global_step.add_(1)

    def minimize(
        self,
        loss: Tensor | Callable[[], Tensor],
        global_step: Tensor | None = None,
        var_list: Sequence[Tensor] | None = None,
        gate_gradients: int = GATE_OP,
        aggregation_method: int | None = None,
        colocate_gradients_with_ops: bool = False,
        name: str | None = None,
        grad_loss: Tensor | None = None,
    ) -> None:
        """``compute_gradients`` then ``apply_gradients``, as TF's ``minimize``."""
        grads_and_vars = self.compute_gradients(
            loss,
            var_list=var_list,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss,
        )
        if all(g is None for g, _ in grads_and_vars):
            raise ValueError(
                "No gradients provided for any variable, check your graph for ops that do not "
                f"support gradients, between variables {[_describe(v) for _, v in grads_and_vars]} "
                "and loss."
            )
        self.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, var: Tensor, name: str) -> Tensor | None:
        """The slot ``name`` of ``var``, or None (unknown name, unmanaged var, or before its first update)."""
        state = self.state.get(var)
        return None if state is None else state.get(name)

    def get_slot_names(self) -> list[str]:
        """The slot names this optimizer creates, sorted (as TF)."""
        names: set[str] = set()
        for group in self.param_groups:
            names.update(self._slot_names_for(group))
        return sorted(names)

    def variables(self) -> list[Tensor]:
        """Every optimizer-state tensor: slots (by parameter, then slot name), then non-slot state."""
        out: list[Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    out.extend(state[k] for k in sorted(state))
        for group in self.param_groups:
            non_slot = self._non_slot_of(group)
            out.extend(non_slot[k] for k in sorted(non_slot))
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict``: ``state`` (slots) and ``param_groups`` (with the non-slot state)."""
        self._sync_aliases()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict``, first checking all of it: a load is all or nothing.

        Raises ``ValueError`` or ``TypeError`` (and changes nothing) when the
        groups differ in number or size, a saved hyperparameter fails the
        constructor's checks, a saved slot is missing or not a floating tensor
        of the parameter's shape, or a group's non-slot state is missing, of the
        wrong shape or kind, not finite or out of range. A state dict in the
        earlier layout (non-slot state under a top-level ``"non_slot_state"``
        list, one dict per group) loads too.
        """
        state_dict = _merge_old_non_slot(type(self).__name__, state_dict)
        self._validate_state_dict(state_dict)
        current = [self._non_slot_of(group) for group in self.param_groups]
        super().load_state_dict(state_dict)
        # The loaded tensors, copied, in the kind and on the device this optimizer keeps them.
        for index, (group, ns) in enumerate(zip(self.param_groups, current, strict=True)):
            for key, value in ns.items():
                group[key] = group[key].detach().to(device=value.device, dtype=value.dtype).clone()
            self._mark_written(index, group)
            # A saved group may hold a TF name beside its key (one saved from ZeroRedundancyOptimizer's
            # local optimizer): the key's loaded value is the one read, and the name stays a copy.
            self._tf_names_given[index] = {arg: group[arg] for arg, _ in self._tf_renames() if arg in group}

    def _validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check everything ``load_state_dict`` will load (the non-slot state is in the groups)."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("state_dict must hold 'state' and 'param_groups' (from Optimizer.state_dict())")
        if len(saved_groups) != len(self.param_groups):
            # (torch's words, which its tools match, with the counts.)
            raise ValueError(
                f"loaded state dict has a different number of parameter groups: {len(saved_groups)}, "
                f"where this optimizer has {len(self.param_groups)}"
            )
        cls = type(self).__name__
        id_to_param: dict[Any, tuple[Tensor, dict[str, Any]]] = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if not isinstance(saved, dict) or "params" not in saved:
                raise ValueError(f"{cls}: loaded param group {i} must be a dict holding 'params'")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    f"of optimizer's group: group {i} holds {len(saved['params'])} parameters, "
                    f"this optimizer's {len(group['params'])}"
                )
            wrapper_keys = sorted(
                k for k in saved if isinstance(k, str) and k.startswith(LOSS_SCALE_KEY_PREFIX)
            )
            if wrapper_keys:
                # A LossScaleOptimizer takes these out before its wrapped optimizer loads the rest.
                raise ValueError(
                    f"{cls}: loaded param group {i} holds a LossScaleOptimizer's loss scale "
                    f"({wrapper_keys}); load it through a LossScaleOptimizer around this optimizer, or "
                    "delete those entries from every group to drop the scale"
                )
            missing = [spec.key for spec in self._hypers if isinstance(spec, Hyper) and spec.key not in saved]
            if missing:
                # torch's load would replace the group, and the step would look for them in vain.
                raise ValueError(
                    f"{cls}: loaded param group {i} lacks the hyperparameters {missing} "
                    f"(it holds {sorted(k for k in saved if k != 'params')}); "
                    "was it saved from another optimizer?"
                )
            merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
            _check_group_values(merged, self._hypers, {p.dtype for p in group["params"]})
            for pid, p in zip(saved["params"], group["params"], strict=True):
                id_to_param[pid] = (p, merged)
        loaded: list[tuple[str, Tensor]] = []
        for pid, slots in state_dict["state"].items():
            if pid not in id_to_param:
                raise ValueError(f"loaded state dict holds state for an unknown parameter id {pid!r}")
            p, group = id_to_param[pid]
            expected = self._slot_names_for(group)
            extra = sorted(set(slots) - set(expected))
            if extra:
                # Another optimizer's slots (RMSProp's "momentum" read as Momentum's) give wrong numbers.
                raise ValueError(
                    f"{cls}: loaded state of parameter {pid} holds {extra}, which are not slots of "
                    f"this optimizer (its slots: {list(expected)}); was it saved from another optimizer?"
                )
            for slot in expected:
                if slot not in slots:
                    raise ValueError(
                        f"{cls}: loaded state of parameter {pid} lacks slot {slot!r} "
                        f"(it holds {sorted(slots)}); was it saved from another optimizer?"
                    )
                value = slots[slot]
                if not isinstance(value, Tensor) or not value.is_floating_point():
                    raise TypeError(
                        f"{cls}: loaded slot {slot!r} of parameter {pid} must be a floating tensor, "
                        f"got {_describe(value)}"
                    )
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{cls}: loaded slot {slot!r} of parameter {pid} has shape "
                        f"{tuple(value.shape)}, expected the parameter's shape {tuple(p.shape)}"
                    )
                if value.layout != torch.strided:
                    raise TypeError(
                        f"{cls}: loaded slot {slot!r} of parameter {pid} must be a dense (strided) "
                        f"tensor, got layout {value.layout}"
                    )
                if value.dtype != p.dtype and not value.is_meta and _overflows(value, p.dtype):
                    # torch casts a loaded slot to its parameter's dtype; the cast would make the inf.
                    raise ValueError(
                        f"{cls}: loaded slot {slot!r} of parameter {pid} ({value.dtype}) holds finite "
                        f"values that overflow the parameter's dtype {p.dtype}, into which it is loaded"
                    )
                loaded.append((f"loaded slot {slot!r} of parameter {pid}", value))
        _check_no_shared_elements(cls, loaded)
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            missing = [key for key in self._non_slot_keys if key not in saved]
            if missing:
                raise ValueError(
                    f"{cls}: loaded param group {i} lacks the non-slot state {missing} "
                    f"(it holds {sorted(k for k in saved if k != 'params')}); "
                    "was it saved from another optimizer?"
                )
            for key, value in self._non_slot_of(group).items():
                self._check_loaded_non_slot(f"{key} (group {i})", key, saved[key], value)

    def _check_loaded_non_slot(self, name: str, key: str, value: Any, current: Tensor) -> None:
        """A loaded value of the non-slot state ``key`` (``name`` in errors), before it is stored.

        It must be of ``current``'s kind and shape, finite, and in the range
        ``_non_slot_ranges`` gives (Adam's beta powers in [0, 1)). Used by
        ``load_state_dict`` and by ``torchgrad_compat.checkpoint``.
        """
        _check_non_slot(type(self).__name__, name, value, current)
        for spec in self._non_slot_ranges:
            if spec.key == key:
                spec.check(float(value))

    # ------------------------------------------------------------------ the update path
    def _create_slots(
        self, grouped: dict[int, list[tuple[Tensor, Tensor]]], evaluated: list[dict[str, Any]] | None = None
    ) -> dict[int, list[dict[str, Any]]]:
        """Create the slots of parameters that have none yet, their initial values checked first;
        return each group's slot dicts, in the order of its pairs (empty without slots).

        ``evaluated`` holds each group's evaluated hyperparameters when an update
        follows; without it only the slots' initial values are evaluated.
        """
        if type(self)._init_slots is Optimizer._init_slots:
            # No slots: `state` stays empty, as torch's SGD leaves it.
            return {}
        initial_values = tuple(
            spec for spec in self._hypers if isinstance(spec, Hyper) and spec.in_param_dtype
        )
        state = self.state
        for gi, pairs in grouped.items():
            names = self._slot_names_for(self.param_groups[gi])
            if len(names) > len(self._slots):
                # A slot a group flag adds (RMSProp's "mg" when centered), switched on after the
                # first step: TF fixes it at construction, and the update would not find it.
                for _, p in pairs:
                    if state.get(p) and any(name not in state[p] for name in names):
                        raise ValueError(
                            f"{type(self).__name__}: parameter {_describe(p)} of param group {gi} has no "
                            f"slot {[n for n in names if n not in state[p]]}: the group's options were "
                            "changed after its first step (TF fixes them at construction)"
                        )
        # By identity, as the dict finds them (Tensor.__hash__ is id(), but a Python call per
        # lookup: 1.2 ms per 1000 parameters within a step, against 0.3 ms for this).
        # (Traced by dynamo as the plain lookups.)
        compiling = torch.compiler.is_compiling()
        reused = False
        if compiling:
            found = {gi: [state.get(p) for _, p in pairs] for gi, pairs in grouped.items()}
        else:
            found = self._slot_dicts_as_kept(grouped)
            reused = found is not None
            if found is None:
                by_id = {id(p): slots for p, slots in state.items()}
                found = {
                    gi: list(map(by_id.get, map(id, map(_SECOND, pairs)))) for gi, pairs in grouped.items()
                }
        missing = {
            gi: [p for (_, p), slots in zip(pairs, found[gi], strict=True) if not slots]
            if not all(found[gi])
            else []
            for gi, pairs in grouped.items()
        }
        for gi, params in missing.items():
            if params:
                values = (
                    evaluated[gi]
                    if evaluated is not None
                    else _evaluate(self.param_groups[gi], initial_values)
                )
                _check_slot_values(values, self._hypers, {p.dtype for p in params})
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            # Made as ordinary tensors: an inference tensor could not be updated by a later step
            # outside inference mode, which would raise after other slots had moved.
            with torch.inference_mode(False):
                self._init_missing_slots(missing)
        else:
            self._init_missing_slots(missing)
        for gi, params in missing.items():
            if params:
                found[gi] = [state.get(p, {}) for _, p in grouped[gi]]
        if not compiling and not (reused and not any(missing.values())):
            # (Taken from what was kept, with no slot made: what is kept is what it was.)
            params_of = {gi: list(map(_SECOND, pairs)) for gi, pairs in grouped.items()}
            self.__dict__["_slot_dicts_kept"] = (list(state), list(state.values()), params_of, found)
        return found

    def _slot_dicts_as_kept(
        self, grouped: dict[int, list[tuple[Tensor, Tensor]]]
    ) -> dict[int, list[dict[str, Any]]] | None:
        """The slot dicts :meth:`_create_slots` found at the last step, if ``state`` holds the very
        same keys and values, in the same order, and each group the very same parameters.

        Compared by identity in C (about 10 ns an entry), where finding them again costs a Python
        iteration over ``state`` and a lookup per parameter. Any change to ``state`` (a slot dict
        replaced or added, a loaded state dict) shows in its keys or values.
        """
        kept = self.__dict__.get("_slot_dicts_kept")
        if kept is None:
            return None
        keys, values, params_of, found = kept
        state = self.state
        if not _same_entries(state, keys, values) or params_of.keys() != grouped.keys():
            return None
        for gi, pairs in grouped.items():
            if not _same_objects(list(map(_SECOND, pairs)), params_of[gi]):
                return None
        return {gi: list(dicts) for gi, dicts in found.items()}

    def _check_slots_follow_params(
        self,
        found: dict[int, tuple[list[Tensor], tuple[torch.device, torch.dtype] | None]],
        shapes: dict[int, list[torch.Size]],
        grouped: dict[int, list[tuple[Tensor, Tensor]]],
    ) -> dict[int, _SlotRecord | None]:
        """Refuse a step where a parameter's slots differ from it in shape, dtype or device, before
        anything is updated; return, per group, the kept metadata its slots were found to have
        (None for a rule without slots; a group whose slots have none kept is left out).

        Slots are made in their parameter's shape, dtype and device, as TF's are.
        A parameter converted afterwards (``model.double()``, ``model.to(device)``)
        or given other memory (``p.data = torch.cat([p.data, rows])``, a view in
        another shape) keeps them as they were, and so does a slot replaced or
        given other memory (``opt.state[p]["m"] = ...``). The update paths then
        parted ways: with float32 slots of float64 variables (Adam) the loop,
        foreach and fused paths gave three different results, and with a slot of
        another shape the loop updated the parameters before the one that failed
        (a step half taken), foreach failed in torch's words, and the fused path,
        for a reshape of the same size, updated it in memory order. Reading every
        slot in Python at every step would cost as much as the check of the
        gradients, so a group's slots are read only when its parameters, their
        shapes, or their one device and dtype (see :func:`_shared_kind`; each
        one's, in groups that have none: mixed, sparse or sharded) differ from the
        last step that read them, when ``state`` holds other slot dicts, or when a
        slot's name or metadata differs from what it was then (:class:`_SlotRecord`:
        the names in one list, the metadata in one call over all of them). A
        parameter's slot dict missing one of the rule's slots (deleted or renamed) is
        refused too: the update would fail on it, after the groups before it.
        """
        if type(self)._init_slots is Optimizer._init_slots:
            return dict.fromkeys(found)
        seen = self.__dict__.setdefault("_slots_read_for", {})
        state = self.state
        cls = type(self).__name__
        as_kept = self._slot_dicts_as_kept(grouped)
        records: dict[int, _SlotRecord | None] = {}
        for gi, (params, kind) in found.items():
            shape_list = shapes[gi] if gi in shapes else list(map(_SHAPE_OF, params))
            if kind is not None:
                key: tuple[Any, ...] = (kind, list(map(id, params)), shape_list)
            else:
                each = (list(map(_DTYPE_OF, params)), list(map(_DEVICE_OF, params)))
                key = (None, list(map(id, params)), shape_list, *each)
            last = seen.get(gi)
            if last is not None and last[1] is not None and as_kept is not None and last[0] == key:
                if last[1].holds(as_kept[gi]):
                    records[gi] = last[1]
                    continue
            slots, dicts = [], []
            for p in params:
                slot_dict = state.get(p, {})
                dicts.append(slot_dict)
                # (Slots a group option adds, such as RMSProp's "mg", are left to _create_slots.)
                absent = [name for name in self._slots if name not in slot_dict] if slot_dict else []
                if absent:
                    raise ValueError(
                        f"{cls}: variable {_describe(p)} has slots {sorted(slot_dict)} but not "
                        f"{absent}: a slot was deleted from opt.state[p]. `del opt.state[p]` makes that "
                        "variable's slots again, from their initial values, at the next step"
                    )
                for name, slot in slot_dict.items():
                    if not isinstance(slot, Tensor):
                        continue
                    if slot.shape != p.shape:
                        raise ValueError(
                            f"{cls}: slot {name!r} of variable {_describe(p)} has shape "
                            f"{tuple(slot.shape)}: the variable was given memory of another shape after "
                            "its slots were made (as by p.data = ...), or the slot was replaced. A slot "
                            "keeps its variable's shape, as in TensorFlow; `del opt.state[p]` makes that "
                            "variable's slots again, from their initial values, at the next step"
                        )
                    if slot.dtype != p.dtype or slot.device != p.device:
                        raise TypeError(
                            f"{cls}: slot {name!r} of variable {_describe(p)} is {slot.dtype} on "
                            f"{slot.device}, but the variable is now {p.dtype} on {p.device}: it was "
                            "converted after its slots were made (as by model.double() or model.to()), "
                            "or the slot was replaced. A slot keeps its variable's dtype and device, as "
                            "in TensorFlow; opt.load_state_dict(opt.state_dict()) converts the slots to "
                            "the variables' dtypes and devices"
                        )
                    slots.append(slot)
            record = _SlotRecord.of(slots, dicts) if slots else None
            seen[gi] = (key, record)
            if record is not None or not slots:
                records[gi] = record
        return records

    def _init_missing_slots(self, missing: dict[int, list[Tensor]]) -> None:
        state = self.state
        for gi, params in missing.items():
            group = self.param_groups[gi]
            for p in params:
                slots = self._init_slots(group, p)
                if slots:
                    state[p] = slots

    def _check_live_non_slot(self, index: int, group: dict[str, Any]) -> None:
        """Check a group's non-slot state as the update is about to read it.

        It lives in the group dict, where tools write without going through
        ``load_state_dict`` (``ZeroRedundancyOptimizer.load_state_dict`` copies
        the saved group entries straight into its local optimizer), and so can
        code. A tensor this optimizer put there itself (at construction, load or
        its last update) is trusted. Any other is checked: its kind, and, as for
        hyperparameters (``_evaluate``), its range when it is a CPU tensor, read
        on the host without a device synchronisation.
        """
        cls = type(self).__name__
        ranges = {spec.key: spec for spec in self._non_slot_ranges}
        written = self.__dict__.get("_written_non_slot", {})
        for key in self._non_slot_keys:
            value = group.get(key)
            if written.get((index, key)) is value:
                continue
            if (
                not isinstance(value, Tensor)
                or value.dim() != 0
                or value.dtype == torch.bool
                or value.is_complex()
                or value.is_meta
            ):
                raise TypeError(
                    f"{cls}: the non-slot state {key!r} of param group {index} must be a 0-d real tensor, "
                    f"got {_describe(value) if key in group else 'nothing'}"
                )
            if value.device.type != "cpu":
                continue
            number = float(value)
            if key in ranges:
                ranges[key]._check_number(number, ())
            elif not math.isfinite(number):
                raise ValueError(f"Invalid {key} value: {number!r}; expected a finite number")

    def _update_path(self, group: dict[str, Any], params: list[Tensor]) -> tuple[bool, bool]:
        """``(foreach, fused)`` for a dense update of ``params``: at most one is True."""
        if group.get("fused"):
            return False, True
        return self._use_foreach(group, params), False

    def _use_foreach(self, group: dict[str, Any], params: list[Tensor]) -> bool:
        foreach = group["foreach"]
        if foreach is None:
            _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
        return bool(foreach)

    def _validate_pairs(self, pairs: list[tuple[Any, Any]]) -> dict[int, list[tuple[Tensor, Tensor]]]:
        """Check ``(grad, var)`` pairs from the caller and group them by param group index."""
        where = {id(p): i for i, group in enumerate(self.param_groups) for p in group["params"]}
        cls = type(self).__name__
        grouped: dict[int, list[tuple[Tensor, Tensor]]] = {}
        seen: set[int] = set()
        for g, p in pairs:
            if not isinstance(p, Tensor) or id(p) not in where:
                raise ValueError(f"{cls} does not manage variable {_describe(p)}; pass it in params")
            if id(p) in seen:
                raise ValueError(f"variable {_describe(p)} appears more than once in grads_and_vars")
            seen.add(id(p))
            _check_grad(cls, g, p)
            grouped.setdefault(where[id(p)], []).append((g, p))
        return grouped

    def _scratch(self, like: list[Tensor], count: int) -> list[list[Tensor]]:
        """``count`` lists of tensors shaped like ``like``, for a foreach update's temporaries.

        On CPU they are views into flat buffers kept between steps (one per
        dtype and list index, as large as the largest chunk, see ``_chunks``):
        a fresh list of temporaries costs more than the arithmetic on it,
        because freed pages go back to the OS and are faulted in again next
        step (measured here: an out-of-place foreach op over 100 tensors of 10k
        floats took 3.1 ms, copy_ into a kept list plus the in-place op
        0.34 ms). Elsewhere the caching allocator makes allocation cheap, so
        they live for one call only.
        """
        if like[0].device.type != "cpu":
            return [[torch.empty_like(t) for t in like] for _ in range(count)]
        dtype = like[0].dtype
        views = self.__dict__.setdefault("_scratch_views", {})
        layouts = _layouts(like)
        key = (dtype, count, tuple(t.shape for t in like), tuple(layouts))
        if key not in views:
            flats = self.__dict__.setdefault("_scratch_flats", {})
            numel = sum(t.numel() for t in like)
            current = flats.get(dtype, [])
            if len(current) < count or current[0].numel() < numel:
                size = max(numel, current[0].numel() if current else 0)
                flats[dtype] = [torch.empty(size, dtype=dtype) for _ in range(max(count, len(current)))]
                views.clear()  # views of the old buffers would keep them alive
            if len(views) >= _SCRATCH_SETS:
                views.clear()
            views[key] = [_views_of(flat, like, layouts) for flat in flats[dtype][:count]]
        return views[key]

    @torch.no_grad()
    def _apply(
        self,
        grouped: dict[int, list[tuple[Tensor, Tensor]]],
        kinds: dict[int, tuple[torch.device, torch.dtype] | None] | None = None,
        shapes: dict[int, list[torch.Size]] | None = None,
        lists: dict[int, tuple[list[Tensor], list[Tensor]]] | None = None,
        census_of: dict[int, _SameMeta] | None = None,
    ) -> None:
        """Update each group from its checked ``(grad, param)`` pairs, then run ``_finish`` once per group.

        ``kinds``: per group, the one device and dtype that the caller found every pair
        to have (:func:`_shared_kind`), or None where it found none; groups it did not
        look at are looked at here. ``shapes``: per group, the shapes of its pairs'
        parameters, where the caller has read them. ``lists``: per group, its pairs'
        parameters and gradients as two lists, where the caller has them.
        ``census_of``: per group, the kept metadata that step()'s census found them to
        have (see :meth:`_census`).
        """
        # (What a step did is kept only once it has been done; see _StepReplay.)
        self.__dict__.pop("_step_replay", None)
        self._sync_aliases()
        cls = type(self).__name__
        # One pass over the pairs: dense ones into (device, dtype) buckets of parameters and
        # gradients, sparse ones aside, every DTensor pair checked.
        dense: dict[int, dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]]] = {}
        sparse: dict[int, list[tuple[Tensor, Tensor]]] = {}
        sharded = False
        compiling = torch.compiler.is_compiling()
        in_pair_order: set[int] = set()  # groups whose one bucket lists the pairs' parameters in order
        # Per group, its pairs' parameters and their one (device, dtype), for the check of the slots.
        found: dict[int, tuple[list[Tensor], tuple[torch.device, torch.dtype] | None]] = {}
        shapes = shapes or {}
        for gi, pairs in grouped.items():
            if lists is not None and gi in lists:
                params, grads = lists[gi]
            else:
                grads, params = [g for g, _ in pairs], [p for _, p in pairs]
            # The usual case, read by `map` over the whole lists (0.28 ms per 1000 pairs, against
            # 0.43 ms for the loop below; nothing when the caller found it): one bucket, no sparse
            # gradient, no DTensor. Dynamo traces the loop into fewer graphs.
            if compiling:
                kind = None
            elif kinds is not None and gi in kinds:
                kind = kinds[gi]
            else:
                kind = _shared_kind(grads, params, checked=True)
            found[gi] = (params, kind)
            if kind is not None:
                dense[gi] = {kind: (params, grads)}
                in_pair_order.add(gi)
                continue
            buckets = dense[gi] = {}
            for g, p in pairs:
                if isinstance(p, DTensor) or isinstance(g, DTensor):
                    _check_dtensor_grad(cls, g, p)
                    sharded = True
                if g.is_sparse:
                    sparse.setdefault(gi, []).append((g, p))
                    continue
                key = (p.device, p.dtype)
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = ([], [])
                bucket[0].append(p)
                bucket[1].append(g)
        # Every group's values are checked before any group is updated: a step is all or nothing.
        evaluated = [_evaluate(group, self._hypers) for group in self.param_groups]
        if not torch.compiler.is_compiling():
            for i, group in enumerate(self.param_groups):
                self._check_live_non_slot(i, group)
                self._recheck_group_keys(i, group)
                self._check_tf_names_written_since(i, group)
            slot_records = self._check_slots_follow_params(found, shapes, grouped)
        else:
            slot_records = {}
        slots_of = self._create_slots(grouped, evaluated)
        state = self.state
        has_slots = type(self)._init_slots is not Optimizer._init_slots
        # Where nothing could have changed a parameter or gradient since step()'s census (no
        # callable hyperparameter ran; the update is this package's own code), the fused plan
        # need not check them again.
        census_of = (
            census_of
            if census_of and _own_update(type(self)) and not _any_callable(self.param_groups, self._hypers)
            else {}
        )
        calls = (
            []
            if len(census_of) == len(self.param_groups)
            and not sparse
            and not sharded
            and _StepReplay.may_follow(self, dense, in_pair_order, slot_records)
            else None
        )
        recording = None if calls is None else _FUSED_CALLS.set(calls)
        # (Not under the caller's torch.compile, where the rules run as the loop.)
        rows_fit = None if torch.compiler.is_compiling() else _ROWS_FIT.set(True)
        try:
            for gi, (group, values) in enumerate(zip(self.param_groups, evaluated, strict=True)):
                non_slot = self._non_slot_of(group)
                for (device, dtype), (bucket_params, bucket_grads) in dense.get(gi, {}).items():
                    hyper = HyperScalars(values, _compute_dtype(dtype), device)
                    # The fused kernel makes one pass over the whole bucket (see pick_impl), but
                    # half-precision parameters go through float32 working copies, made a chunk
                    # at a time so that they never hold the whole bucket.
                    whole = group.get("fused") and dtype not in _HALF_DTYPES
                    spans = [(0, len(bucket_params))] if whole else _chunks(bucket_params)
                    for start, end in spans:
                        params, grads = bucket_params[start:end], bucket_grads[start:end]
                        if not has_slots:
                            slots = [{}] * len(params)
                        elif gi in in_pair_order:
                            slots = slots_of[gi][start:end]
                        else:
                            slots = [state.get(p, {}) for p in params]
                        if sharded:
                            params, grads, slots = _local_shards(params, grads, slots)
                        held = (
                            _CENSUS_HELD.set((census_of[gi], params, grads, slot_records[gi]))
                            if gi in census_of and gi in slot_records and gi in in_pair_order and whole
                            else None
                        )
                        try:
                            with _working_precision(params, grads, slots) as (ps, gs, ss):
                                self._apply_dense(group, ps, gs, ss, non_slot, hyper)
                        finally:
                            if held is not None:
                                _CENSUS_HELD.reset(held)
                for g, p in sparse.get(gi, []):
                    if self._coalesce_sparse:
                        indices, grad_values = _summed_rows(g)
                    else:
                        indices, grad_values = g._indices()[0], g._values()
                    hyper = HyperScalars(values, _compute_dtype(p.dtype), p.device)
                    with _working_precision([p], [grad_values], [self.state.get(p, {})]) as (ps, gs, ss):
                        self._apply_sparse(group, ps[0], indices, gs[0], ss[0], non_slot, hyper)
                self._finish(group, non_slot, values)
                group.update(non_slot)
                self._mark_written(gi, group)
            if calls is not None:
                replay = _StepReplay.of(
                    self, calls, lists or {}, census_of, slot_records, slots_of, evaluated
                )
                if replay is not None:
                    self.__dict__["_step_replay"] = replay
        finally:
            if rows_fit is not None:
                _ROWS_FIT.reset(rows_fit)
            if recording is not None:
                _FUSED_CALLS.reset(recording)


@functools.cache
def _own_update(cls: type) -> bool:
    """Whether every class of ``cls``'s MRO below :class:`Optimizer` is this package's own (no
    user subclass whose update or slot creation could replace a gradient)."""
    mro = cls.__mro__
    return all(c.__module__.startswith("torchgrad_compat.") for c in mro[: mro.index(Optimizer)])


class _ReplayedGroup(NamedTuple):
    """What :class:`_StepReplay` keeps of one param group."""

    group: dict[str, Any]
    keys: list[Any]
    values: list[Any]
    everyone: list[Tensor]  # the group's parameters, as listed
    has_grad: list[bool]  # whether each had a gradient
    params: list[Tensor]  # those that had one: the ones updated
    census: _SameMeta  # of the updated parameters and their gradients
    slot_record: _SlotRecord | None
    dicts: list[dict[str, Any]]  # the updated parameters' slot dicts
    names: list[str | None]  # the slot in each slot list of the call (None: an empty list)
    kernel: _FusedKernel
    plan: _FusedPlan
    scalars: dict[str, Any]
    versions: list[tuple[Tensor, int]]  # the scalars' tensors, and their versions then
    derives: bool  # whether some scalars are ones the rule computes at every step (see of())
    evaluated: dict[str, Any]  # the group's hyperparameters as the step evaluated them


class _StepReplay:
    """The kernel calls of a fused ``step()``, made again by the next ``step()`` while everything
    that decided them is as it was.

    A training loop's steps differ in the values of the gradients, parameters and
    slots, and in nothing a step's checks and decisions read: the groups, their
    hyperparameters, which tensors are updated and their metadata. On a CPU whose
    caches the backward pass has filled with other data, those checks (the group
    dicts, the hyperparameters' ranges, the state's slots, the fused plan and
    kernel lookups: some forty Python functions) cost about as much as the
    kernels over a million parameters. A step replayed reads the gradients,
    checks that the same parameters have one, that those and their gradients have
    the metadata the last step found (:class:`_SameMeta`, one call), that each
    group dict holds the very objects it held then (values that cannot change in
    place: numbers, flags, strings; the same parameters in the same order), that
    ``state`` holds the same slot dicts with slots of the same names and metadata
    (:class:`_SlotRecord`), and that the hyperparameter tensors were not written in
    place; then it makes the same kernel calls over this step's tensors (a slot
    replaced in its dict is read where it is now). Any difference, or any mode that
    changes how a step runs (``torch.compile``, inference mode, a dispatch mode or
    functorch transform), and the step takes
    the whole path, which makes a new record or none.

    Recorded only where that path depends on nothing else: a step's census found
    each group's parameters and gradients (dense, of one device, the CPU, and one
    dtype, not half) and its check of the slots found them, ``fused`` is on, the
    rule is this package's own, and each of its kernel's scalars is a hyperparameter
    made by :func:`_number_tensor` or one the rule computes at every step by a
    function it names (:attr:`Optimizer._derived_scalars`: RMSProp's ``1 - decay``,
    Adam's ``alpha`` from its beta powers), which the replay calls again. A rule's
    optimizer-wide state (Adam's beta powers, new tensors at every step) is then
    advanced by its ``_finish``, as the whole path does, and the record takes the
    new tensors as the group's values. Rules whose scalars depend on options
    computed otherwise (the proximal rules' and Ftrl's regularization, AdagradDA's
    step) are not replayed.
    """

    __slots__ = ("_groups", "_inv_scale", "_state_keys", "_state_values")

    def __init__(
        self,
        groups: list[_ReplayedGroup],
        state_keys: list[Any],
        state_values: list[Any],
        inv_scale: Tensor | None,
    ):
        self._groups, self._state_keys, self._state_values = groups, state_keys, state_values
        # The inverse loss scale its kernels unscaled the gradients by (see _unscaling), if any.
        self._inv_scale = inv_scale

    @staticmethod
    def may_follow(
        optimizer: Optimizer,
        dense: dict[int, dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]]],
        in_pair_order: set[int],
        slot_records: dict[int, _SlotRecord | None],
    ) -> bool:
        """Whether a step over these groups (each with its one bucket) may be recorded for
        replay: see the class docstring."""
        cls = type(optimizer)
        has_slots = cls._init_slots is not Optimizer._init_slots
        # (This package's rules keep non-slot state that _finish advances from the group alone;
        # the kernel scalars they compute from it are checked to be derived ones by of().)
        if (
            optimizer._non_slot_keys
            or cls._finish is not Optimizer._finish
            or cls._sync_aliases is not Optimizer._sync_aliases
        ) and not _own_update(cls):
            return False
        non_slot = set(optimizer._non_slot_keys)
        for gi, group in enumerate(optimizer.param_groups):
            buckets = dense.get(gi)
            if (
                buckets is None
                or gi not in in_pair_order
                or not group.get("fused")
                # (A rule with slots needs their record: none is made at the step that makes them.)
                or gi not in slot_records
                or (slot_records[gi] is not None) != has_slots
            ):
                return False
            ((device, dtype),) = buckets
            if device.type != "cpu" or dtype in _HALF_DTYPES:
                return False
            # (A wrapper's keys, such as the loss scale's state tensors, are not read by the rule;
            # the non-slot tensors are the ones the last step put there, checked by identity.)
            if not all(
                _replayable(v)
                for k, v in group.items()
                if k != "params" and k not in non_slot and not k.startswith(_WRAPPER_KEY_PREFIXES)
            ):
                return False
        return True

    @classmethod
    def of(
        cls,
        optimizer: Optimizer,
        calls: list[Any],
        lists: dict[int, tuple[list[Tensor], list[Tensor]]],
        census_of: dict[int, _SameMeta],
        slot_records: dict[int, _SlotRecord | None],
        slots_of: dict[int, list[dict[str, Any]]],
        evaluated: list[dict[str, Any]],
    ) -> _StepReplay | None:
        """The record of the step just taken, whose fused calls were ``calls`` (one per group, in
        order), or None where a call cannot be derived again from the groups and slots alone.

        A scalar that is not a kept hyperparameter tensor must be one the rule computes at each
        step (:attr:`Optimizer._derived_scalars`: Adam's ``alpha`` from its beta powers, its
        ``1 - beta1``): a replay computes it again from the group's non-slot tensors and its
        hyperparameters as this step evaluated them (the group values being the very same
        objects), and ends each group with ``_finish`` as the step did."""
        groups = optimizer.param_groups
        derivable = type(optimizer)._derived_scalars
        if len(calls) != len(groups) or any(call is None for call in calls):
            return None
        records = []
        for gi, (group, (kernel, plan, rows, scalars)) in enumerate(zip(groups, calls, strict=True)):
            params, grads = lists[gi]
            everyone = list(group["params"])
            has_grad = list(map(operator.is_not, map(_GRAD_OF, everyone), itertools.repeat(None)))
            if not (
                _same_objects(list(itertools.compress(everyone, has_grad)), params)
                and _same_objects(rows[0], params)
                and _same_objects(rows[1], grads)
            ):
                return None
            dicts = slots_of.get(gi, [])
            names: list[str | None] = []
            for slots in rows[2:]:
                if not slots:  # (a slot the group's options leave out, RMSProp's "mg")
                    names.append(None)
                    continue
                # (The one name it is under: a tensor under two names could be either's.)
                found = [n for n, t in dicts[0].items() if t is slots[0]] if dicts else []
                if len(found) != 1 or not _same_objects(slots, [d[found[0]] for d in dicts]):
                    return None
                names.append(found[0])
            versions = []
            for name, value in scalars.items():
                if name in derivable:
                    continue
                if isinstance(value, Tensor):
                    if not _is_kept_number(value):
                        return None
                    versions.append((value, value._version))
                elif type(value) not in _REPLAYABLE_VALUES:
                    return None
            records.append(
                _ReplayedGroup(
                    group,
                    list(group),
                    list(group.values()),
                    everyone,
                    has_grad,
                    list(params),
                    census_of[gi],
                    slot_records[gi],
                    dicts,
                    names,
                    kernel,
                    plan,
                    scalars,
                    versions,
                    not derivable.keys().isdisjoint(scalars),
                    evaluated[gi],
                )
            )
        state = optimizer.state
        unscaling = _UNSCALING.get()
        return cls(records, list(state), list(state.values()), unscaling and unscaling.inv_scale)

    def run(self, optimizer: Optimizer) -> bool:
        """Take the step as recorded if everything it depends on is as it was; else change nothing
        and return False."""
        if torch.is_inference_mode_enabled() or _tracing_or_transforming():
            return False
        # (Kernels that unscale the gradients by this inverse scale, or that do not: as recorded.)
        unscaling = _UNSCALING.get()
        if (unscaling and unscaling.inv_scale) is not self._inv_scale:
            return False
        groups = optimizer.param_groups
        if len(groups) != len(self._groups) or not _same_entries(
            optimizer.state, self._state_keys, self._state_values
        ):
            return False
        calls = []
        for group, kept in zip(groups, self._groups, strict=True):
            if (
                group is not kept.group
                or list(group) != kept.keys
                or not _same_objects(list(group.values()), kept.values)
                or not _same_objects(group["params"], kept.everyone)
                or kept.plan.chunk_size != FUSED_CHUNK
            ):
                return False
            grads = list(map(_GRAD_OF, kept.everyone))
            has_grad = list(map(operator.is_not, grads, itertools.repeat(None)))
            if has_grad != kept.has_grad:
                return False
            if len(kept.params) != len(grads):
                grads = list(itertools.compress(grads, has_grad))
            params, dicts, slot_record = kept.params, kept.dicts, kept.slot_record
            if not kept.census.holds([*params, *grads]):
                return False
            if slot_record is not None and not slot_record.holds(dicts):
                return False
            if not all(t._version == v for t, v in kept.versions):
                return False
            slots = [list(map(operator.itemgetter(name), dicts)) if name else [] for name in kept.names]
            scalars = kept.scalars
            if kept.derives:
                hyper = HyperScalars(kept.evaluated, _compute_dtype(params[0].dtype), params[0].device)
                scalars = {**scalars, **optimizer._derived(optimizer._non_slot_of(group), hyper)}
            calls.append((kept.plan, kept.kernel, (params, grads, *slots), scalars))
        if unscaling is not None:
            unscaling.started = True
        for plan, kernel, lists, scalars in calls:
            plan.call(kernel, lists, scalars)
        # The rest of the step, for rules with non-slot state: as Optimizer._apply ends a group.
        if type(optimizer)._finish is not Optimizer._finish:
            for gi, (group, kept) in enumerate(zip(groups, self._groups, strict=True)):
                non_slot = optimizer._non_slot_of(group)
                optimizer._finish(group, non_slot, kept.evaluated)
                group.update(non_slot)
                optimizer._mark_written(gi, group)
                kept.values[:] = group.values()
        return True


def _replayable(value: Any) -> bool:
    """Whether ``value`` cannot change in place: a number, flag, string or None, or a tuple of them
    (Adam's ``betas``)."""
    if type(value) is tuple:
        return all(type(v) in _REPLAYABLE_VALUES for v in value)
    return type(value) in _REPLAYABLE_VALUES


def _any_callable(groups: list[dict[str, Any]], hypers: tuple[Hyper | Flag, ...]) -> bool:
    """Whether some group's hyperparameter is a callable, which :func:`_evaluate` calls."""
    keys = [spec.key for spec in hypers if isinstance(spec, Hyper)]
    return any(callable(v) and not isinstance(v, Tensor) for group in groups for v in map(group.get, keys))


def _no_step_pre_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs no pre-hook (its own or a global one) to change a gradient."""
    return not optimizer._optimizer_step_pre_hooks and not _global_optimizer_pre_hooks


def _called_from_dcp_init() -> bool:
    """Whether ``torch.distributed.checkpoint``'s ``_init_optim_state`` is the caller (a few frames up).

    Wrappers' ``step`` and torch's step hooks may sit in between. Should torch
    rename the function, its zero-gradient step becomes an ordinary step again:
    Ftrl then refuses its ``lr`` of 0 (loudly), and the other optimizers take
    the step, whose state the checkpoint's then overwrites. Under
    ``torch.compile`` nothing is looked up (DCP does not compile its call).
    """
    if torch.compiler.is_compiling() or _DCP_STATE_DICT not in sys.modules:
        return False
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_init_optim_state" and frame.f_globals.get("__name__") == _DCP_STATE_DICT:
            return True
        frame = frame.f_back
    return False


_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _check_dtensor_grad(cls: str, g: Tensor, p: Tensor) -> None:
    """A DTensor parameter's gradient must be a dense DTensor laid out as it (see ``_local_shards``)."""
    if g.is_sparse:
        raise ValueError(
            f"{cls}: sparse gradients of DTensor parameters are not supported (variable {_describe(p)}); "
            "FSDP2 and tensor parallelism produce dense gradients"
        )
    if (
        not isinstance(p, DTensor)
        or not isinstance(g, DTensor)
        or g.placements != p.placements
        or g.device_mesh != p.device_mesh
    ):

        def layout(t: Tensor) -> str:
            return (
                f"placements {t.placements} on {t.device_mesh}"
                if isinstance(t, DTensor)
                else "a plain tensor"
            )

        raise ValueError(
            f"{cls}: the gradient of {_describe(p)} ({layout(p)}) must be laid out as its variable, with the "
            f"same placements and mesh; got {layout(g)}"
        )


def _local_shards(
    params: list[Tensor], grads: list[Tensor], slots: list[dict[str, Tensor]]
) -> tuple[list[Tensor], list[Tensor], list[dict[str, Tensor]]]:
    """The local shards of DTensor parameters, gradients and slots; plain tensors as given.

    Every update rule of this package is elementwise, so a rank updating its
    own shard computes exactly what the unsharded update computes for those
    elements, with no communication. That needs the gradient laid out as the
    parameter (FSDP2's reduce-scattered ``Shard(0)`` gradients are); a
    ``Partial`` gradient (not yet reduced) or another layout is refused
    before anything changes (``_check_dtensor_grad``). The
    slots were made by ``*_like(param)`` and are sharded as the parameter.
    Working on the local tensors also keeps the foreach path's scratch buffers
    (plain tensors, see ``Optimizer._scratch``) and 0-d hyperparameter tensors
    out of DTensor's dispatch, which refuses to mix them.
    """
    if not any(isinstance(p, DTensor) for p in params):
        return params, grads, slots
    local_params = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    local_slots = [{k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()} for s in slots]
    return local_params, local_grads, local_slots


def pick_impl(
    single: Callable[..., None],
    multi: Callable[..., None],
    *,
    foreach: bool,
    params: list[Tensor],
    scratch: list[list[Tensor]] | None,
    count: int,
    fused: bool = False,
) -> Callable[..., None]:
    """An optimizer's functional dispatch: its reference loop, its foreach path bound to scratch, or fused.

    ``scratch`` holds ``count`` lists of tensors shaped like ``params`` for the
    foreach path's temporaries (:meth:`Optimizer._scratch` keeps them between
    steps); None makes fresh ones. ``fused`` runs the reference loop itself
    through ``torch.compile`` (see :func:`_run_fused`).
    """
    if fused:
        return functools.partial(_run_fused, single)
    if not foreach:
        return single
    if scratch is None:
        scratch = [[torch.empty_like(p) for p in params] for _ in range(count)]
    return functools.partial(multi, scratch=scratch)


def _run_fused(single: Callable[..., None], *lists: list[Tensor], **scalars: Any) -> None:
    """Run the reference loop ``single`` over ``lists`` (params, grads, slots) as compiled kernels.

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
    for name, value in scalars.items():
        # The kernels read each tensor hyperparameter as one value (the optimizers' are 0-d); one
        # of another shape, which the loop would broadcast, would be read as its first element.
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(
                f"fused update: {name} must be a tensor of one element, got shape {tuple(value.shape)}"
            )
    unscaling = _UNSCALING.get()
    if unscaling is not None:
        single = _unscaling(single)
        scalars = {**scalars, "inv_scale": unscaling.inv_scale}
        unscaling.started = True
    calls = _FUSED_CALLS.get()
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
    scalars = _distinct_scalars(scalars)
    kernel = _FusedKernel.of(single, lists, scalars)
    plan = _FusedPlan.of(single, lists, kernel, scalars)
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
        calls[-1] = (kernel, plan, lists, scalars)


class _Unscaling:
    """What ``LossScaleOptimizer`` hands the fused kernels of one step that unscale its gradients:
    the inverse of the loss scale (a 0-d float32 tensor), and whether a kernel has started."""

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


class _FusedKernel:
    """``single`` compiled for chunks of ``FUSED_CHUNK`` flat rows, called without dynamo's per-call work.

    Through ``torch.compile`` a call over 32 rows of four tensors cost 160 µs
    of host time, whatever the sizes: dynamo's guards, the size of every
    input read back through a Python call, Inductor's check of every input's
    size and stride. The kernel itself, for tiny tensors, is 2 µs. So the
    graph is compiled once, through ``torch.compile`` with a backend that
    keeps Inductor's compiled function (without the size checks), and each
    later call hands that function its inputs directly, in the order of the
    graph's placeholders: 16 µs a call. The graph is compiled on tensors of
    zeros (see :meth:`_compile`) and the order read from that call: each
    tensor input is found among its tensors by identity, and each symbolic
    size through the tensor it is the size of. The guards
    dynamo would check are what the caller guarantees: rows are 1-D,
    contiguous, of at least two elements, and of the dtypes, device and
    options of this kernel's key (see :meth:`of`). Should the graph take an
    input that cannot be placed so (a torch release that lifts something
    else), every call goes through ``torch.compile`` as usual. Below that
    function sits Inductor's generated Python (:func:`_generated_call`), and on
    CPU below that one C++ function, which calls go to where they can
    (:func:`_kernel_alone`).
    """

    _compiled: ClassVar[dict[Any, _FusedKernel]] = {}

    def __init__(self, single: Callable[..., None], device: torch.device):
        self.device = device
        self.layout: list[tuple[str, Any]] | None = None
        self.direct: Callable[..., Any] | None = None
        # Inductor's generated ``call``, under ``direct``'s wrappers (see :func:`_generated_call`).
        # It leaves autograd's version counters of what it writes to the caller.
        self.inner: Callable[[list[Any]], Any] | None = None
        # On CPU, the one C++ function ``inner`` calls, taken alone (see :func:`_kernel_alone`).
        self.alone: Callable[..., Any] | None = None
        # Where each argument of what a call goes to (``alone``, ``inner`` or ``direct``) comes
        # from, as ``layout`` says it (see :meth:`_FusedPlan.call`).
        self.call_layout: list[tuple[str, Any]] | None = None
        self._captured: tuple[torch.fx.GraphModule, list[Any], Callable[..., Any]] | None = None
        self._tried = False
        self._through_dynamo = torch.compile(single, dynamic=True, fullgraph=True, backend=self._backend)

    @classmethod
    def of(
        cls, single: Callable[..., None], lists: tuple[list[Tensor], ...], scalars: dict[str, Any]
    ) -> _FusedKernel:
        """The kernel for this rule, chunk size, device, dtypes and options (compiled at its first call)."""
        key = (
            single,
            FUSED_CHUNK,
            lists[0][0].device,
            tuple(lst[0].dtype if lst else None for lst in lists),
            tuple(
                (name, (v.dtype, v.device, v.dim()) if isinstance(v, Tensor) else v)
                for name, v in sorted(scalars.items())
            ),
        )
        kernel = cls._compiled.get(key)
        if kernel is None:
            kernel = cls._compiled[key] = cls(single, lists[0][0].device)
        return kernel

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        options = {"size_asserts": False}
        if self.device.type == "cuda":
            options.update(_triton_options())
            if not _triton_rounds_as_eager(options):
                warnings.warn(
                    "fused=True on CUDA: this torch's Inductor has no option that turns off Triton's "
                    "contraction of a multiply and an add into one fused multiply-add, so the fused "
                    "update rounds once where the reference loop rounds twice (its last bits differ)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        compiled = torch._inductor.compile(gm, example_inputs, options=options)
        self._captured = (gm, list(example_inputs), compiled)
        return compiled

    def ready(self, lists: tuple[list[Tensor], ...], scalars: dict[str, Any]) -> None:
        """Compile, if not tried yet, for lists of the dtypes and device of ``lists``."""
        if self.direct is None and not self._tried:
            self._compile(lists, scalars)

    def _compile(self, lists: Sequence[list[Tensor]], scalars: dict[str, Any]) -> None:
        """Compile on rows of zeros shaped as ``_FUSED_SIZE_HINT`` (the user's tensors are not touched).

        Inductor's C++ makes a loop OpenMP-parallel only if the sizes it
        compiles for are large enough, and its disk cache does not key on
        them: a kernel first compiled for small tensors would run on one
        thread for every size, in every later process (Adam, 10M parameters
        in 1000 tensors, 2 threads: 19.7 ms a step against 13.6 ms). So
        the sizes it sees are always the same.
        """
        self._tried = True
        like = [lst[0] if lst else None for lst in lists]
        dummies = [
            [torch.zeros(_FUSED_SIZE_HINT + i, dtype=t.dtype, device=t.device) for i in range(FUSED_CHUNK)]
            if t is not None
            else []
            for t in like
        ]
        self._through_dynamo_patched(dummies, scalars)
        if self._captured is not None:
            gm, inputs, compiled = self._captured
            self._captured = None
            self.layout = _placeholder_layout(gm, inputs, dummies, scalars)
            if self.layout is not None:
                self.direct = compiled
                self.call_layout = self.layout
                self.inner = _generated_call(self, compiled, like, scalars)
                if self.inner is not None and self.device.type == "cpu":
                    alone = _kernel_alone(self, self.inner, like, scalars)
                    if alone is not None:
                        self.alone, self.call_layout = alone

    def _through_dynamo_patched(self, lists: list[list[Tensor]], scalars: dict[str, Any]) -> None:
        # Without duck shaping, tensors that happen to share a size get their own symbols, so
        # that the graph does not depend on it. Each option an optimizer's rule tests in Python
        # (Ftrl's l1, l2, shrinkage, power) and each dtype is a graph of its own: more than
        # dynamo's default limit of 8 per function, which fullgraph turns into an error.
        with (
            torch.fx.experimental._config.patch(use_duck_shape=False),
            torch._dynamo.config.patch(**{_recompile_limit_name(): _FUSED_GRAPH_LIMIT}),
        ):
            self._through_dynamo(*lists, **scalars)


def _generated_call(
    kernel: _FusedKernel, compiled: Callable[..., Any], like: list[Tensor | None], scalars: dict[str, Any]
) -> Callable[[list[Any]], Any] | None:
    """The ``call`` Inductor generated for ``compiled`` (``kernel``'s, placed by its layout), if
    calling it alone gives the same rows.

    Between ``compiled`` and that function sit AOT autograd's runtime wrappers:
    8 of a call's 19 µs of host time, for a call over 16 tiny rows (CPU). What
    they do for this graph, which updates its inputs in place and returns
    nothing, is to bump the version counters of the inputs it writes: the plan
    does that for its rows once per step (:meth:`_FusedPlan.call`). Found by
    watching one call of ``compiled`` reach Inductor's compiled graph with the
    same inputs, and kept only if that function, called alone on random rows,
    writes the very values ``compiled`` writes on a copy of them. Else (another
    torch release's wrappers, a graph that leaves a write to them) None.
    """
    graph_type = getattr(getattr(torch._inductor, "output_code", None), "CompiledFxGraph", None)
    if graph_type is None or any(t is not None and not t.is_floating_point() for t in like):
        return None
    with _PROBE_LOCK:
        return _probed_call(kernel, compiled, like, scalars, graph_type)


# One probe at a time: each patches CompiledFxGraph.__call__ for the whole process.
_PROBE_LOCK = threading.Lock()


def _probed_call(
    kernel: _FusedKernel,
    compiled: Callable[..., Any],
    like: list[Tensor | None],
    scalars: dict[str, Any],
    graph_type: Any,
) -> Callable[[list[Any]], Any] | None:
    rows = _probe_rows(like)
    copies = [[r.clone() for r in lst] for lst in rows]
    seen: list[tuple[Any, list[Any]]] = []
    original = graph_type.__call__
    probing = threading.get_ident()

    def watched(graph: Any, inputs: list[Any]) -> Any:
        if threading.get_ident() == probing:  # (compiled code other threads run meanwhile)
            seen.append((graph, list(inputs)))
        return original(graph, inputs)

    arguments = _probe_arguments(kernel.layout, rows, scalars)
    graph_type.__call__ = watched
    try:
        compiled(*arguments)
    except Exception:  # the probe only chooses how later calls are made; they still go through compiled
        return None
    finally:
        graph_type.__call__ = original
    if len(seen) != 1 or not _same_arguments(seen[0][1], arguments):
        return None
    generated = getattr(seen[0][0], "current_callable", None)
    if generated is None:
        return None
    try:
        generated(_probe_arguments(kernel.layout, copies, scalars))
    except Exception:
        return None
    return generated if _same_rows(rows, copies) else None


def _kernel_alone(
    kernel: _FusedKernel,
    generated: Callable[[list[Any]], Any],
    like: list[Tensor | None],
    scalars: dict[str, Any],
) -> tuple[Callable[..., Any], list[tuple[str, Any]]] | None:
    """The one C++ function that ``generated`` (Inductor's ``call`` on CPU) hands the rows to, and
    where each of its arguments comes from (as :attr:`_FusedKernel.layout` says it), if calling
    it alone gives the same rows.

    ``generated`` is Python: it unpacks its inputs, reads each row's size back
    through ``Tensor.size()`` and passes everything on to that function. With the
    cache cold, as it is after a model's backward pass, that took 35 to 40 µs a
    call over 16 rows (0.27 ms of a step over 100 rows of 10,000 floats, where the
    kernels themselves took 0.5 ms); the chunk knows the sizes already. Found by
    recording the calls ``generated`` makes to the compiled functions of its module
    during one call on rows of distinct sizes: exactly one must be made, and each of
    its arguments must be one of the inputs (by identity) or the size of exactly one
    row. Kept only if that function, called alone so, writes on random rows the very
    values ``generated`` writes on a copy of them. Else (a graph of several kernels or
    of buffers of its own, another torch release's code) None, and calls go through
    ``generated``.
    """
    code, namespace = getattr(generated, "__code__", None), getattr(generated, "__globals__", None)
    if code is None or not isinstance(namespace, dict):
        return None
    names = [n for n in code.co_names if isinstance(namespace.get(n), types.BuiltinFunctionType)]
    rows = _probe_rows(like)
    arguments = _probe_arguments(kernel.layout, rows, scalars)
    seen: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    probing = threading.get_ident()

    def recorded(function: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any) -> Any:
            if threading.get_ident() == probing:  # (other threads running this graph meanwhile)
                seen.append((function, args))
            return function(*args)

        return record

    with _PROBE_LOCK:
        originals = {n: namespace[n] for n in names}
        namespace.update({n: recorded(f) for n, f in originals.items()})
        try:
            generated(list(arguments))
        except Exception:
            return None
        finally:
            namespace.update(originals)
    if len(seen) != 1:
        return None
    function, args = seen[0]
    at = {id(a): k for k, a in enumerate(arguments) if isinstance(a, Tensor)}
    rows_of_size: dict[int, list[int]] = {}
    for i, t in enumerate(rows[0]):
        rows_of_size.setdefault(t.numel(), []).append(i)
    layout: list[tuple[str, Any]] = []
    for a in args:
        if isinstance(a, Tensor) and id(a) in at:
            layout.append(kernel.layout[at[id(a)]])
        elif type(a) is int and len(rows_of_size.get(a, ())) == 1:
            layout.append(("size", rows_of_size[a][0]))
        else:
            return None
    if {where for kind, where in layout if kind == "size"} != set(range(len(rows[0]))):
        return None
    rows, copies = _probe_rows(like), _probe_rows(like)
    try:
        generated(_probe_arguments(kernel.layout, rows, scalars))
        function(*_probe_arguments(layout, copies, scalars))
    except Exception:
        return None
    return (function, layout) if _same_rows(rows, copies) else None


def _probe_rows(like: list[Tensor | None]) -> list[list[Tensor]]:
    """A chunk's rows for a probe of a compiled kernel: random, every row of its own size."""
    generator = torch.Generator().manual_seed(0)
    return [
        [
            torch.rand(_FUSED_SIZE_HINT + i, generator=generator, dtype=t.dtype).add_(0.5).to(t.device)
            for i in range(FUSED_CHUNK)
        ]
        if t is not None
        else []
        for t in like
    ]


def _probe_arguments(
    layout: list[tuple[str, Any]], lists: list[list[Tensor]], scalars: dict[str, Any]
) -> list[Any]:
    """Arguments placed as ``layout`` says, for a chunk of all of ``lists``'s rows."""
    return [
        lists[where[0]][where[1]]
        if kind == "row"
        else scalars[where]
        if kind == "scalar"
        else lists[0][where].numel()
        for kind, where in layout
    ]


def _same_rows(rows: list[list[Tensor]], copies: list[list[Tensor]]) -> bool:
    return all(
        torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())
        for lst, copied in zip(rows, copies, strict=True)
        for a, b in zip(lst, copied, strict=True)
    )


if torch.torch_version.TorchVersion(torch.__version__) >= (2, 5):
    _bump_versions = torch.autograd.graph.increment_version
else:  # torch 2.4 takes one tensor a call

    def _bump_versions(tensors: list[Tensor]) -> None:
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def _same_objects(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _same_entries(mapping: dict[Any, Any], keys: list[Any], values: list[Any]) -> bool:
    """Whether ``mapping`` holds the very ``keys`` and ``values``, in that order (by identity, in C)."""
    return (
        len(mapping) == len(keys)
        and all(map(operator.is_, mapping, keys))
        and all(map(operator.is_, mapping.values(), values))
    )


def _same_arguments(seen: list[Any], given: list[Any]) -> bool:
    return len(seen) == len(given) and all(
        a is b or (type(a) is int and type(b) is int and a == b) for a, b in zip(seen, given, strict=True)
    )


def _placeholder_layout(
    gm: torch.fx.GraphModule, inputs: list[Any], lists: list[list[Tensor]], scalars: dict[str, Any]
) -> list[tuple[str, Any]] | None:
    """Where each input of a compiled chunk comes from, or None where one cannot be placed.

    ``("row", (j, i))``: ``lists[j][i]``; ``("scalar", name)``: the keyword
    argument; ``("size", i)``: the length of row ``i``. Every row must have
    its size as an input (a size the graph took as a constant would hold for
    no other chunk).
    """
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return None
    rows = {id(t): (j, i) for j, lst in enumerate(lists) for i, t in enumerate(lst)}
    names = {id(v): name for name, v in scalars.items() if isinstance(v, Tensor)}
    size_row: dict[Any, int] = {}
    for node, value in zip(placeholders, inputs, strict=True):
        fake = node.meta.get("example_value")
        if isinstance(value, Tensor) and id(value) in rows and isinstance(fake, Tensor) and fake.dim() == 1:
            if isinstance(fake.shape[0], torch.SymInt):
                size_row.setdefault(fake.shape[0].node.expr, rows[id(value)][1])
    layout: list[tuple[str, Any]] = []
    for node, value in zip(placeholders, inputs, strict=True):
        fake = node.meta.get("example_value")
        if isinstance(value, Tensor) and id(value) in rows:
            layout.append(("row", rows[id(value)]))
        elif isinstance(value, Tensor) and id(value) in names:
            layout.append(("scalar", names[id(value)]))
        elif isinstance(fake, torch.SymInt) and fake.node.expr in size_row:
            layout.append(("size", size_row[fake.node.expr]))
        else:
            return None
    sized = {where for kind, where in layout if kind == "size"}
    if sized != set(range(len(lists[0]))):
        return None
    return layout


class _KeptByIdentity:
    """Values kept under objects, found by the object's identity; an entry goes with its object.

    torch's ``WeakIdKeyDictionary`` makes a reference object and runs three Python methods at
    each lookup (10 µs of a fused step's host time); here a lookup is one ``dict.get`` by ``id``
    and one dereference, compared with the key the caller holds.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, key: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else default

    def __getitem__(self, key: Any) -> Any:
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            raise KeyError(key)
        return entry[1]

    def __setitem__(self, key: Any, value: Any) -> None:
        entries, at = self._entries, id(key)

        def forget(ref: weakref.ref[Any]) -> None:
            entry = entries.get(at)
            if entry is not None and entry[0] is ref:
                del entries[at]

        entries[at] = (weakref.ref(key, forget), value)

    def values(self) -> list[Any]:
        return [value for _, value in self._entries.values()]


class _FusedPlan:
    """How ``_run_fused`` splits one bucket's lists into kernel chunks, kept between steps.

    A plan partitions the rows between the kernels and the loop, groups the
    kernel rows into chunks of ``FUSED_CHUNK`` (the last one filled up with kept
    tensors), and keeps, per kernel, where each argument of each chunk's call is
    taken from (see :meth:`call`). How the rows reach the kernel depends on it:

    - On CPU the call goes to the one C++ function of the generated code (see
      :func:`_kernel_alone`), which reads where each row starts and takes the
      sizes from the chunk: every tensor goes in as it is, this step's. Such a
      plan holds none of the user's tensors and depends on their metadata alone
      (sizes, layouts, dtypes): memory moved under a tensor (``p.data = ...``, a
      loaded checkpoint's slots) is where the next call reads and writes.
    - Otherwise (CUDA, or a graph whose C++ function cannot be called alone)
      the kernel takes flat rows. Flattening a tensor (``view(-1).detach()``:
      an alias that is not a view, because the graph would guard on a view's
      base) costs about as much host time as a call spends per tensor, so the
      plan holds flat aliases of the parameters and slots, and is used again
      while every parameter and slot has the same ``data_ptr`` and every alias
      is where it was (memory freed under it, by
      ``untyped_storage().resize_(0)``, is not). Holding the aliases keeps that
      memory allocated, so a tensor at the same ``data_ptr`` and size is the
      same bytes, whatever object carries it. So does a plan with rows in the
      loop, whose partition depends on which rows share memory. Gradients are
      flattened every step: holding last step's would keep their memory
      allocated while the next backward makes new ones.

    Either way a plan is used again only while every tensor has the size and
    layout (see :func:`_layouts`) it had when the plan was made. It lives as
    long as the tensor it is kept under: the bucket's first slot (the
    optimizer's own: a plan goes with its optimizer or a loaded state), or, for
    rules without slots, its first parameter. Memory a plan holds that its
    tensors no longer use (after ``p.data = ...``) is let go at the next fused
    step over that bucket.
    """

    _kept: ClassVar[_KeptByIdentity] = _KeptByIdentity()

    def __init__(
        self,
        single: Callable[..., None],
        lists: tuple[list[Tensor], ...],
        signature: Any,
        kernel: _FusedKernel,
        scalars: dict[str, Any],
    ):
        self.single, self.signature, self.chunk_size = single, signature, FUSED_CHUNK
        params = lists[0]
        layouts = zip(*signature[2], strict=True)  # per row, of each non-empty list (see _layouts)
        # Triton indexes in 32 bits for the sizes the kernels are compiled for; Inductor guards
        # that, but the direct calls skip its guards, so larger rows take the loop.
        largest = _TRITON_ROW_LIMIT if params[0].device.type != "cpu" else math.inf
        fits = [
            2 <= p.numel() <= largest and bool(row[0]) and row.count(row[0]) == len(row)
            for p, row in zip(params, layouts, strict=True)
        ]
        if not all(fits):
            # The loop's rows are updated before the kernels': one sharing memory with a kernel
            # row (weights tied through a transpose) would see the updates in another order.
            for i in _rows_sharing_memory(params, [not f for f in fits]):
                fits[i] = False
        self.loop_rows = [i for i, f in enumerate(fits) if not f]
        kernel_rows = [i for i, f in enumerate(fits) if f]
        # Row indices of each chunk (of at most FUSED_CHUNK; the last one filled up).
        self.chunks = [
            kernel_rows[start : start + FUSED_CHUNK] for start in range(0, len(kernel_rows), FUSED_CHUNK)
        ]
        if self.chunks:
            kernel.ready(lists, scalars)
        # Whether the kernel's C++ function is called alone (as it was when the plan was made).
        self.alone = kernel.alone is not None
        # Whether the rows go in as they are (no alias held, see above).
        self.as_they_are = self.alone and not self.loop_rows
        # Each call's arguments are picked from one list made at each step: every list's rows,
        # then these constants (the fillers of each list, the rows' sizes, a filler's size),
        # then the scalars.
        self.filled = fill = _fillers_by_list(lists, -len(kernel_rows) % FUSED_CHUNK)
        # Where each list's rows start in that list (an empty list takes no place).
        self.starts = list(itertools.accumulate(map(len, lists), initial=0))
        self.constants: list[Any] = [t for f in fill.values() for t in f]
        self.constants += [p.numel() for p in params] + [2]
        # The aliases of the user's tensors where they do not go in as they are (None for the loop's
        # rows), and where they were: memory freed under them moves them to null.
        self.sources: list[list[Tensor | None]] = []
        if not self.as_they_are:
            self.sources = [
                [_flat(t) if f else None for t, f in zip(lst, fits, strict=True)] if lst and j != 1 else []
                for j, lst in enumerate(lists)
            ]
        self.aliases = [t for lst in self.sources for t in lst if t is not None]
        self.alias_addresses = list(map(Tensor.data_ptr, self.aliases))
        # Kernel rows of more than one dimension, whose gradients are flattened for a kernel that
        # takes flat rows: contiguous ones, and those dense in a channels-last format.
        self.raveled = [i for i in kernel_rows if signature[2][0][i] is True and params[i].dim() != 1]
        self.channels_last = [i for i in kernel_rows if signature[2][0][i] is not True]
        self.on_cuda = params[0].device.type == "cuda"
        self._calls: dict[int, tuple[list[Callable[[list[Any]], tuple[Any, ...]]], list[str]]] = {}
        self.graphs: list[_StepGraph] = []  # the latest first
        # The gradients' addresses at the last steps that replayed no graph, the latest first.
        self._recent: list[list[int]] = []
        self._capture_failed = False
        # The metadata of every tensor of the lists the plan was last found to hold for, and
        # whether that was within step() (see _holds_as_last_found).
        self.found_for: tuple[_SameMeta | None, bool] = (None, True)
        # Where step() had checked the parameters, gradients and slots then: the kept metadata
        # its census found them to have, and that its check of the slots found (see _CENSUS_HELD).
        self.found_with: tuple[_SameMeta, _SlotRecord | None] | None = None

    def call(self, kernel: _FusedKernel, lists: tuple[list[Tensor], ...], scalars: dict[str, Any]) -> None:
        """Run ``kernel`` over every chunk: one step of the update for the kernel's rows.

        The plan may have been made for another kernel of the rule (other scalars): one that
        is called alone if this one is.
        """
        kernel.ready(lists, scalars)
        if kernel.call_layout is None:
            # No placed inputs: through torch.compile, a chunk of flat rows at a time.
            pool = self._pool(kernel, lists)
            for lst in self._chunk_lists(pool):
                kernel._through_dynamo_patched(lst, scalars)
            return
        getters, names = self._calls.get(id(kernel)) or self._getters(kernel)
        pool = self._pool(kernel, lists)
        pool += map(scalars.__getitem__, names)
        # (What the kernels make of the fillers is never read: each element is updated on its own.)
        if kernel.alone is not None:
            for get in getters:
                kernel.alone(*get(pool))
        elif kernel.inner is not None:
            for get in getters:
                kernel.inner(list(get(pool)))
        else:
            for get in getters:
                kernel.direct(*get(pool))
            return
        # The generated code leaves autograd's version counters of what it writes to its caller.
        if self.as_they_are:
            _bump_versions(list(itertools.chain(lists[0], *lists[2:])))
        else:
            _bump_versions(self.aliases)
        if "inv_scale" in scalars:  # (the gradients, unscaled in place: see _unscaling)
            _bump_versions(lists[1])

    def _pool(self, kernel: _FusedKernel, lists: tuple[list[Tensor], ...]) -> list[Any]:
        """This step's rows of every list, then :attr:`constants` (the scalars go last)."""
        if self.as_they_are:
            pool = list(itertools.chain.from_iterable(lists))
        else:
            grads = list(lists[1])
            if kernel.alone is None:
                # Flat, as the kernel takes them (in memory order, as the row's parameter and
                # slots; ravel would copy a channels-last gradient in logical order).
                for i in self.raveled:
                    grads[i] = grads[i].ravel()
                for i in self.channels_last:
                    grads[i] = grads[i].as_strided((grads[i].numel(),), (1,))
            pool = list(
                itertools.chain.from_iterable(grads if j == 1 else lst for j, lst in enumerate(self.sources))
            )
        pool += self.constants
        return pool

    def _getters(
        self, kernel: _FusedKernel
    ) -> tuple[list[Callable[[list[Any]], tuple[Any, ...]]], list[str]]:
        """Per chunk, what picks the arguments of ``kernel``'s call from the step's pool (see
        :meth:`_pool`), and the names of the scalars at its end."""
        assert kernel.call_layout is not None
        names = sorted({where for kind, where in kernel.call_layout if kind == "scalar"})
        starts = self.starts
        base = starts[-1]
        filler_at, k = {}, base
        for j, f in self.filled.items():
            filler_at[j], k = k, k + len(f)
        sizes_at, filler_size_at = k, base + len(self.constants) - 1
        scalars_at = base + len(self.constants)
        getters = []
        for rows in self.chunks:
            real = len(rows)
            at = []
            for kind, where in kernel.call_layout:
                if kind == "row":
                    j, i = where
                    at.append(starts[j] + rows[i] if i < real else filler_at[j] + i - real)
                elif kind == "scalar":
                    at.append(scalars_at + names.index(where))
                else:
                    at.append(sizes_at + rows[where] if where < real else filler_size_at)
            getters.append(operator.itemgetter(*at))
        self._calls[id(kernel)] = getters, names
        return getters, names

    def _chunk_lists(self, pool: list[Any]) -> Iterator[list[list[Tensor]]]:
        """Each chunk's flat rows of every list, filled up (for calls through torch.compile)."""
        starts = self.starts
        for rows in self.chunks:
            yield [
                [pool[start + i] for i in rows] + self.filled[j][: FUSED_CHUNK - len(rows)]
                if j in self.filled
                else []
                for j, start in enumerate(starts[:-1])
            ]

    def step_graph(
        self, kernel: _FusedKernel, lists: tuple[list[Tensor], ...], scalars: dict[str, Any]
    ) -> _StepGraph | None:
        """The CUDA graph of :meth:`call` for gradients at these addresses, or None (call the kernels).

        A graph is captured at a step whose gradients are where they were at one
        of the last few steps that replayed none: the caching allocator hands a
        training loop's gradients the same memory from step to step, or a few
        sets of it in turn (state that an optimizer replaces at every step
        moves the small allocations around). A plan keeps the last
        ``_GRAPHS_PER_PLAN`` graphs. One that cannot be captured here is not
        tried again for this plan.
        """
        if self._capture_failed or torch.cuda.is_current_stream_capturing() or not _caching_allocator():
            return None
        grads = lists[1]
        if any(isinstance(v, Tensor) and v.device != grads[0].device for v in scalars.values()):
            # A CPU scalar (a functional caller's) is read on the host as the kernel is launched:
            # a graph would keep the value it was captured with.
            return None
        addresses = list(map(Tensor.data_ptr, grads))
        for graph in self.graphs:
            if graph.kernel is kernel and graph.addresses == addresses:
                return graph
        if addresses not in self._recent:
            self._recent = [addresses, *self._recent[: _GRAPHS_PER_PLAN - 1]]
            return None
        self._recent.remove(addresses)
        try:
            graph = _StepGraph(self, kernel, lists, scalars, addresses)
        except Exception as error:  # a capture refused on this device or driver: the kernels still work
            self._capture_failed = True
            self.graphs = []
            warnings.warn(
                f"fused=True on CUDA: the step could not be captured as a CUDA graph ({error}); "
                "the kernels are launched one call at a time, with the same numbers and more host time",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        self.graphs = [graph, *self.graphs[: _GRAPHS_PER_PLAN - 1]]
        return graph

    @classmethod
    def of(
        cls,
        single: Callable[..., None],
        lists: tuple[list[Tensor], ...],
        kernel: _FusedKernel,
        scalars: dict[str, Any],
    ) -> _FusedPlan:
        """The kept plan for ``lists`` if it still holds, else a new one (kept in its place)."""
        kept = [lists[0], *lists[2:]]
        key = next((lst[0] for lst in lists[2:] if lst), lists[0][0])
        plan = cls._kept.get(key)
        in_step = _ROWS_FIT.get()
        held = _CENSUS_HELD.get()
        if held is not None and not (lists[0] is held[1] and lists[1] is held[2]):
            held = None
        alone = kernel.alone is not None
        if (
            plan is not None
            and plan.single is single
            and plan.alone == alone
            and plan._holds_as_last_found(lists, kept, in_step, held)
        ):
            if held is not None:
                # (Found now with these records, whether or not it was last time.)
                plan.found_with = (held[0], held[3])
            return plan
        # Addresses and sizes of parameters and slots, layout of every tensor (gradients too).
        signature = (
            [list(map(Tensor.data_ptr, lst)) for lst in kept],
            [list(map(Tensor.numel, lst)) for lst in kept],
            [_layouts(lst) for lst in lists if lst],
            torch.is_inference_mode_enabled(),
        )
        # The kernels read and write each row as its parameter's size and its list's dtype: a
        # row that differs would be read past its end. Gradients are new at every step, and
        # checked here again although step() checked them: a TF-style callable hyperparameter,
        # evaluated since, or a subclass's own update can have replaced one. Their devices are
        # left to the optimizers, which check every gradient against its parameter.
        _check_rows_fit("gradient", lists[1], signature[1][0], every_step=True)
        # So are parameters and slots (a plan kept may not depend on which tensors they are).
        _check_rows_fit("parameter", lists[0], signature[1][0])
        for lst in lists[2:]:
            _check_rows_fit("slot", lst, signature[1][0])
        if not signature[3]:
            _refuse_inference_rows(lists)
        if not in_step:
            # Called as a functional form: rows are flattened, so one of its parameter's size
            # in another shape would be applied where the loop refuses it.
            _check_row_shapes(lists)
        if (
            plan is None
            or plan.single is not single
            or plan.alone != alone
            or plan.chunk_size != FUSED_CHUNK
            or not plan._made_for(signature)
        ):
            plan = cls._kept[key] = cls(single, lists, signature, kernel, scalars)
        plan.found_for = (_SameMeta.of([t for lst in lists for t in lst]), in_step)
        plan.found_with = (held[0], held[3]) if held is not None else None
        return plan

    def _holds_as_last_found(
        self,
        lists: tuple[list[Tensor], ...],
        kept: list[list[Tensor]],
        in_step: bool,
        held: tuple[_SameMeta, list[Tensor], list[Tensor], _SlotRecord | None] | None,
    ) -> bool:
        """Whether every tensor of ``lists`` is as when :meth:`of` last found this plan to hold,
        without reading each one's properties in Python (:class:`_SameMeta`).

        The gradients included, so that they passed that step's checks of them; and, for a plan
        that holds aliases, parameters and slots at the same addresses and the aliases where they
        were. A plan found within ``step()`` is not taken for a functional call, which checks
        rows step() had already checked. ``held``: step() found the parameters, gradients and
        slots to have the metadata it kept (see :data:`_CENSUS_HELD`); if it kept that when the
        plan was last found, none is read again.
        """
        same, found_in_step = self.found_for
        if same is None or not (in_step or not found_in_step) or self.chunk_size != FUSED_CHUNK:
            return False
        if self.signature[3] != torch.is_inference_mode_enabled():
            return False
        if not (
            held is not None
            and self.found_with is not None
            and self.found_with[0] is held[0]
            and self.found_with[1] is held[3]
        ) and not same.holds([t for lst in lists for t in lst]):
            return False
        if self.as_they_are:
            return True
        return [list(map(Tensor.data_ptr, lst)) for lst in kept] == self.signature[
            0
        ] and self._aliases_in_place()

    def _made_for(self, signature: Any) -> bool:
        """Whether the plan was made for tensors of ``signature`` (see :meth:`of`): the same sizes
        and layouts, and, for a plan that holds aliases, the same addresses, its aliases where
        they were."""
        if self.signature[1:] != signature[1:]:
            return False
        return self.as_they_are or (self.signature[0] == signature[0] and self._aliases_in_place())

    def _aliases_in_place(self) -> bool:
        """Whether the plan's aliases are where they were made (memory freed under a tensor moves
        its alias to null)."""
        return list(map(Tensor.data_ptr, self.aliases)) == self.alias_addresses


class _StepGraph:
    """A plan's kernel calls for one step on CUDA, captured as one CUDA graph and replayed at later steps.

    On a GPU the fused step is bound by the host: 63 calls a step for 1000
    tensors, each through Inductor's launcher. A replay is one launch. What the
    captured kernels read and write is fixed by address: the parameters,
    slots and fillers the plan holds (a plan holds while they stay where they
    are), the gradients (a graph is replayed only while every gradient is at
    the address it was captured with, and the plan checks their sizes, dtypes
    and layout at every step), and the hyperparameters, which are copied into
    tensors of the graph's own before each replay. The kernels are the same as
    the direct calls', so a replay gives their numbers bit for bit.
    """

    def __init__(
        self,
        plan: _FusedPlan,
        kernel: _FusedKernel,
        lists: tuple[list[Tensor], ...],
        scalars: dict[str, Any],
        addresses: list[int],
    ):
        self.kernel, self.addresses = kernel, addresses
        self.names = [name for name, v in scalars.items() if isinstance(v, Tensor)]
        self.written = plan.aliases
        self.replays = 0
        device = lists[1][0].device
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.device(device), torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                # Made during the capture, from the graph's own memory pool: memory kept from the
                # pool the gradients come from would move them, and no graph would be replayed.
                self.inputs = [torch.empty_like(scalars[name]) for name in self.names]
                captured = {**scalars, **dict(zip(self.names, self.inputs, strict=True))}
                plan.call(kernel, lists, captured)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        self.graph = graph

    def replay(self, scalars: dict[str, Any]) -> None:
        torch._foreach_copy_(self.inputs, [scalars[name] for name in self.names])
        self.graph.replay()
        _bump_versions(self.written)
        self.replays += 1


# Per CUDA device, the memory pool of the optimizer-wide state that a step replaces (None: the
# allocator refused one).
_STATE_POOLS: dict[torch.device, Any] = {}


@functools.cache
def _caching_allocator() -> bool:
    """Whether CUDA memory comes from torch's own caching allocator (``backend:native``).

    The graph replay and the private pool rest on how that allocator hands out
    memory. Under ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` a capture of
    the fused step aborted the process (torch 2.11, H100), so there the kernels
    are launched one call at a time. The backend is fixed when the process starts.
    """
    return torch.cuda.get_allocator_backend() == "native"


@contextmanager
def _apart_from_gradients(device: torch.device) -> Iterator[None]:
    """Allocate, on CUDA, from a memory pool kept for optimizer-wide state, not the default one.

    State a step replaces (Adam's beta powers) lives until the next step. Taken
    from the pool the backward pass takes the gradients from, it moves the
    blocks the caching allocator hands the next gradients, so they would land
    somewhere else at every step (in turn over six sets of addresses, in a
    loop of 100 ``Linear`` layers), and the fused step's CUDA graph would
    never be replayed. In a torch release without ``torch.cuda.use_mem_pool``,
    with an allocator that has no such pools, inside a CUDA graph capture and
    under ``torch.compile``, the default pool is used.
    """
    if (
        device.type != "cuda"
        or not hasattr(torch.cuda, "use_mem_pool")
        or torch.compiler.is_compiling()
        or torch.cuda.is_current_stream_capturing()
        or not _caching_allocator()
    ):
        yield
        return
    if device not in _STATE_POOLS:
        try:
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool, device=device):
                pass
        except RuntimeError:  # a release or build whose allocator refuses private pools
            pool = None
        _STATE_POOLS[device] = pool
    pool = _STATE_POOLS[device]
    if pool is None:
        yield
        return
    with torch.cuda.use_mem_pool(pool, device=device):
        yield


def _rows_sharing_memory(params: list[Tensor], marked: list[bool]) -> list[int]:
    """The rows not ``marked`` whose memory overlaps, directly or through others, a marked row's."""
    spans = []
    for i, p in enumerate(params):
        if p.numel():
            start = p.data_ptr()
            spans.append((str(p.device), start, start + _bytes_spanned(p), i))
    spans.sort()
    found: list[int] = []
    cluster: list[int] = []
    end, device = -1, ""
    for dev, start, stop, i in [*spans, ("", -1, -1, -1)]:
        if dev != device or start >= end:  # a new cluster of overlapping rows begins
            if any(marked[j] for j in cluster):
                found.extend(j for j in cluster if not marked[j])
            cluster, end, device = [], stop, dev
        cluster.append(i)
        end = max(end, stop)
    return found


def _check_row_shapes(lists: tuple[list[Tensor], ...]) -> None:
    """Every gradient and slot has its parameter's shape, as the reference loop's ops require."""
    shapes = list(map(_SHAPE_OF, lists[0]))
    for j, lst in enumerate(lists[1:], start=1):
        if lst and list(map(_SHAPE_OF, lst)) != shapes:
            what = "gradient" if j == 1 else "slot"
            i = next(i for i, (t, shape) in enumerate(zip(lst, shapes, strict=True)) if t.shape != shape)
            raise ValueError(
                f"fused update: {what} {i} ({_describe(lst[i])}) does not fit: its parameter has "
                f"shape {tuple(shapes[i])}"
            )


def _refuse_inference_rows(lists: tuple[list[Tensor], ...]) -> None:
    """Refuse, as the loop's in-place ops do, parameters or slots made under ``torch.inference_mode()``
    when updating outside it (the kernels write to them unchecked)."""
    for j, lst in enumerate(lists):
        if j != 1 and any(map(Tensor.is_inference, lst)):
            i = next(i for i, t in enumerate(lst) if t.is_inference())
            what = "parameter" if j == 0 else "slot"
            raise RuntimeError(
                f"fused update: {what} {i} is an inference tensor (made under torch.inference_mode()); "
                "it cannot be updated in place outside inference mode. Make a clone of it first"
            )


def _layouts(tensors: list[Tensor]) -> list[bool | str]:
    """Per tensor, how a fused kernel can take it flat: True if contiguous, the name of a
    channels-last format it is dense in (a 4-D or 5-D tensor), else False.

    A row whose parameter, gradient and slots are all dense in the same format is
    updated in memory order: element ``k`` of each is the same logical element.
    """
    layouts: list[bool | str] = list(map(Tensor.is_contiguous, tensors))
    if all(layouts):
        return layouts
    return [layout or _channels_last(t) for layout, t in zip(layouts, tensors, strict=True)]


def _channels_last(t: Tensor) -> str | bool:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return False


def _flat(t: Tensor) -> Tensor:
    """A 1-D alias of ``t``'s elements in memory order (``t`` contiguous or dense in a
    channels-last format)."""
    if t.is_contiguous():
        return t.view(-1).detach()
    return t.as_strided((t.numel(),), (1,)).detach()


def _bytes_spanned(t: Tensor) -> int:
    """The bytes from a non-empty tensor's first element to the end of its last (its strides' reach)."""
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def _overflows(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether some finite value of ``t`` becomes infinite cast to ``dtype`` (one host read)."""
    return bool((torch.isfinite(t) & ~torch.isfinite(t.to(dtype))).any())


def _is_expanded(t: Tensor) -> bool:
    """Whether a dense tensor is an expanded view: a stride of 0 over a dim of more than one element."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape, strict=True))


def _check_no_shared_elements(cls: str, targets: list[tuple[str, Tensor]]) -> None:
    """Refuse tensors about to be written that share memory, within one (an expanded view) or with
    another: loaded slots (the update writes each element once, and torch refuses the in-place ops
    halfway through) and the targets of a checkpoint load (the later copy would overwrite the
    earlier)."""
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for name, t in targets:
        if isinstance(t, DTensor):
            t = t.to_local()  # each rank's shard is its own memory
        if t.is_meta or t.numel() == 0:
            continue
        if _is_expanded(t):
            raise ValueError(
                f"{cls}: {name} is an expanded view (strides {t.stride()}): its elements share "
                "memory; pass a contiguous copy"
            )
        start = t.storage_offset() * t.element_size()
        end = start + _bytes_spanned(t)
        spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, end, name, t))
    for ranges in spans.values():
        ranges.sort(key=lambda r: r[:2])
        # Runs of spans that overlap (a sweep); within a run, the elements themselves are compared:
        # even and odd columns of one matrix overlap in span but share no element.
        run, reach = [], 0
        for r in [*ranges, None]:
            if r is None or r[0] >= reach:
                if len(run) > 1 and (shared := _first_shared_pair(run)):
                    raise ValueError(f"{cls}: {shared[0]} and {shared[1]} share memory; each needs its own")
                run, reach = [], 0
            if r is not None:
                run.append(r)
                reach = max(reach, r[1])


def _first_shared_pair(run: list[tuple[int, int, str, Tensor]]) -> tuple[str, str] | None:
    """The names of two views of one storage (spans in bytes, by start) that share an element, or None."""
    size = run[0][3].element_size()
    if any(t.element_size() != size or start % size for start, _, _, t in run):
        return run[0][2], run[1][2]  # views of one storage in two element sizes: not compared
    base = run[0][0] // size
    taken = torch.zeros(-(-max(end for _, end, _, _ in run) // size) - base, dtype=torch.bool)
    for k, (start, _, name, t) in enumerate(run):
        view = taken.as_strided(t.shape, t.stride(), start // size - base)
        if view.any():
            for earlier_start, _, earlier, e in run[:k]:
                mine = torch.zeros_like(taken)
                mine.as_strided(e.shape, e.stride(), earlier_start // size - base).fill_(True)
                if (mine.as_strided(t.shape, t.stride(), start // size - base)).any():
                    return earlier, name
        view.fill_(True)
    return None


def _check_rows_fit(what: str, rows: list[Tensor], numels: list[int], every_step: bool = False) -> None:
    """Every row of a fused update's list has its parameter's size, and the dtype and device of
    the list's first row (the functional forms take lists from anywhere).

    ``every_step``: the check made at every step, on sizes and dtypes only (0.1 ms per 1000
    rows, against 0.25 ms with devices); any failure is then explained in full.
    """
    if not rows:
        return
    if len(rows) != len(numels):
        raise ValueError(f"fused update: {len(rows)} {what}s for {len(numels)} parameters")
    first = rows[0]
    if every_step:
        fits = len(set(map(_DTYPE_OF, rows))) == 1
    else:
        fits = all(t.dtype == first.dtype and t.device == first.device for t in rows)
    if not fits or list(map(Tensor.numel, rows)) != numels:
        for i, t in enumerate(rows):
            if t.numel() != numels[i] or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"fused update: {what} {i} ({_describe(t)} on {t.device}) does not fit: its "
                    f"parameter has {numels[i]} elements, and {what} 0 is {first.dtype} on {first.device}"
                )


_DTYPE_OF = operator.attrgetter("dtype")
_GRAD_OF = operator.attrgetter("grad")
_SHAPE_OF = operator.attrgetter("shape")
_DEVICE_OF = operator.attrgetter("device")
_LAYOUT_OF = operator.attrgetter("layout")
_SECOND = operator.itemgetter(1)


def _triton_options() -> dict[str, Any]:
    """Inductor options for a fused kernel on CUDA: eager CUDA's roundings, one launch per chunk.

    By default Triton contracts ``a * b + c`` into one fused multiply-add
    (one rounding where the reference makes two: GradientDescent's
    ``p - g·lr`` then differs from the loop in a quarter of the elements,
    by up to 11657 ulp where it cancels), divides with the approximate
    ``div.full.f32`` and may flush float32 subnormals to zero.
    ``emulate_precision_casts`` turns the contraction off; the others are
    named ``eager_numerics.*`` in recent torch, ``emulate_divison_rounding``
    (sic) in older releases. Under these the kernels equal the loop on CUDA
    bit for bit, for every rule but Ftrl with ``learning_rate_power != -0.5``
    (Triton's ``pow`` is not CUDA's).

    Without combo kernels each tensor of a chunk is a launch of its own: a
    thousand launches per step, host-bound (Adam, 10M parameters in 1000
    tensors, H100: 32.9 ms a step, 15.1 ms with combo kernels).
    """
    # Only the options this torch has: an unknown name would fail the compile, where a release
    # without them gets _triton_rounds_as_eager's warning instead.
    known = torch._inductor.config.get_config_copy()
    options: dict[str, Any] = {}
    for name, value in (
        ("emulate_precision_casts", True),
        ("combo_kernels", True),
        ("eager_numerics.division_rounding", True),
        ("eager_numerics.disable_ftz", True),
        ("emulate_divison_rounding", True),
        # One combo kernel for the whole chunk (the default groups 8), without autotuning
        # each grouping at compile time.
        ("combo_kernel_max_num_nodes", FUSED_CHUNK),
        ("combo_kernels_autotune", 0),
    ):
        if name in known:
            options[name] = value
    return options


def _triton_rounds_as_eager(options: dict[str, Any]) -> bool:
    """Whether Inductor, under ``options``, generates Triton kernels without multiply-add
    contraction and with division rounded to nearest, as read from its own code generator."""
    try:
        from torch._inductor.codegen.triton import TritonKernel, TritonOverrides
    except ImportError:
        return False

    class _Float32(str):
        dtype = torch.float32

    meta_common = getattr(TritonKernel, "triton_meta_common", None)
    if meta_common is None:
        return False
    with torch._inductor.config.patch(options):
        no_contraction = meta_common().get("enable_fp_fusion") is False
        division = TritonOverrides.truediv(_Float32("x"), _Float32("y"))
    return no_contraction and "div_rn" in division


def _recompile_limit_name() -> str:
    """dynamo's per-function graph limit, ``recompile_limit`` (``cache_size_limit`` in older torch)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def _filler(like: Tensor, count: int) -> list[list[Tensor]]:
    """``count`` lists of ``FUSED_CHUNK`` two-element tensors on ``like``'s device and dtype.

    Each has storage of its own: inputs that alias one another would make the
    compiled graph depend on how many of them a call takes. They are made
    outside inference mode, whatever the caller's, since every later step
    zeroes them in place.
    """
    key = (like.device, like.dtype, count, FUSED_CHUNK)
    if key not in _FUSED_FILLERS:
        with torch.inference_mode(False):
            _FUSED_FILLERS[key] = [
                [torch.zeros(2, dtype=like.dtype, device=like.device) for _ in range(FUSED_CHUNK)]
                for _ in range(count)
            ]
    return _FUSED_FILLERS[key]


def _fillers_by_list(lists: tuple[list[Tensor], ...], missing: int) -> dict[int, list[Tensor]]:
    """``missing`` fillers for each non-empty list, in that list's dtype (the kernel reads each
    list's rows as its dtype), none shared between two lists."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, lst in enumerate(lists):
        if lst:
            by_dtype.setdefault(lst[0].dtype, []).append(j)
    fill: dict[int, list[Tensor]] = {}
    for indices in by_dtype.values():
        made = _filler(lists[indices[0]][0], len(indices))
        fill.update((j, f[:missing]) for j, f in zip(indices, made, strict=True))
    return fill


def _views_of(flat: Tensor, like: list[Tensor], layouts: list[bool | str]) -> list[Tensor]:
    """Consecutive views of ``flat`` shaped like ``like``, laid out as them where ``layouts`` (see
    :func:`_layouts`) names a channels-last format (a foreach op over operands of two layouts takes
    a slower path: Adam's foreach step over ResNet-18's shapes in channels-last, 360 ms against 160 ms)."""
    views, offset = [], 0
    for t, layout in zip(like, layouts, strict=True):
        piece = flat[offset : offset + t.numel()]
        if isinstance(layout, str):
            views.append(piece.as_strided(t.shape, t.stride()))
        else:
            views.append(piece.view(t.shape))
        offset += t.numel()
    return views


def _numpy_view(t: Tensor) -> np.ndarray | None:
    """``t``'s memory as a numpy array, where numpy's square root may stand in for torch's: a
    plain float32 or float64 CPU tensor that autograd is not to record an operation on, outside
    ``torch.compile`` (see :func:`sqrt`)."""
    if (
        torch.compiler.is_compiling()
        or (t.requires_grad and torch.is_grad_enabled())
        or t.dtype not in _NUMPY_SQRT_DTYPES
        or t.device.type != "cpu"
        or type(t) not in (Tensor, torch.nn.Parameter)
    ):
        return None
    return t.detach().numpy()


def sqrt(t: Tensor) -> Tensor:
    """``√t``, correctly rounded, as TensorFlow's square root and the code Inductor generates.

    torch's eager CPU ``sqrt`` is not correctly rounded in every release: torch 2.13 is an ulp off
    for about 17% of float32 inputs and 1.3% of float64 ones (on an AVX-512 CPU), and rules that
    subtract square roots (Ftrl's ``√n - √a``) carry that ulp far beyond TF's numbers. On the CPU
    numpy's, the processor's instruction, serves instead; elsewhere (CUDA), for a tensor that
    requires grad with grad mode on, and inside ``torch.compile`` (which generates a correctly
    rounded one) torch's own.
    """
    src = _numpy_view(t)
    if src is None:
        return t.sqrt()
    out = torch.empty_like(t)
    np.sqrt(src, out=out.numpy())
    return out


def sqrt_(t: Tensor) -> Tensor:
    """:func:`sqrt` in place; ``t``. Its version counter moves, as with ``t.sqrt_()``: autograd
    refuses a backward pass through an operation that saved it before."""
    src = _numpy_view(t)
    if src is None:
        return t.sqrt_()
    np.sqrt(src, out=src)
    torch.autograd.graph.increment_version(t)
    return t


def foreach_sqrt_(tensors: list[Tensor]) -> None:
    """:func:`sqrt_` over a list (``torch._foreach_sqrt_`` where that one serves)."""
    if not tensors or _numpy_view(tensors[0]) is None:
        torch._foreach_sqrt_(tensors)
        return
    for t in tensors:
        sqrt_(t)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def _chunks(params: list[Tensor]) -> Iterator[tuple[int, int]]:
    """Split a CPU bucket into runs of at most ``_CPU_CHUNK_BYTES`` of parameters (at least one each),
    given as ``(start, end)`` indices into ``params``.

    A foreach op streams its whole list through memory before the next op
    starts; over a chunk that fits in cache the dozen ops of an update reuse
    the data while it is hot (measured, Adam on 10M float32 parameters in 1000
    tensors, one thread: 88 ms unchunked, 52 ms in 1-4 MiB chunks). A chunk's
    parameters, gradients, slots and scratch together should fit in L2: on a
    2 MiB-L2 Xeon, 512 KiB chunks beat 2 MiB ones by 10-25% (Adam 5.80 -> 4.74
    ms, RMSProp 4.83 -> 3.89 ms, 1M parameters in 100 tensors) and 128 KiB
    ones lose again to the per-chunk overhead. Other devices get the whole
    bucket: one kernel launch per op is what they want.
    """
    if params[0].device.type != "cpu":
        yield 0, len(params)
        return
    start, size = 0, 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if size and size + nbytes > _CPU_CHUNK_BYTES:
            yield start, i
            start, size = i, 0
        size += nbytes
    yield start, len(params)


@contextmanager
def _working_precision(
    params: list[Tensor], grads: list[Tensor], slots: list[dict[str, Tensor]]
) -> Iterator[tuple[list[Tensor], list[Tensor], list[dict[str, Tensor]]]]:
    """The tensors an update works on: float32 working copies for half-precision parameters.

    float16/bfloat16 parameters are updated through float32 copies (of
    parameter, gradient and slots), with float32 hyperparameters, and rounded
    back once when stored, as torch's fused kernels do. TensorFlow instead casts
    the hyperparameters to the half dtype, where ``bfloat16(1 - 0.999) == 0`` and
    ``float16(1e-8) == 0``: its bfloat16 Adam never updates ``v``.
    """
    if params[0].dtype not in _HALF_DTYPES:
        yield params, grads, slots
        return
    wide_params = [p.float() for p in params]
    wide_slots = [{k: v.float() for k, v in s.items()} for s in slots]
    yield wide_params, [g.float() for g in grads], wide_slots
    for p, wide in zip(params, wide_params, strict=True):
        p.copy_(wide)
    for s, wide in zip(slots, wide_slots, strict=True):
        for k, v in s.items():
            v.copy_(wide[k])


def _trainable(param_groups: list[dict[str, Any]]) -> list[Tensor]:
    """The parameters that require grad: TF's default ``var_list``, its trainable variables."""
    return [p for group in param_groups for p in group["params"] if p.requires_grad]


def compute_gradients(
    loss: Tensor | Callable[[], Tensor],
    var_list: Sequence[Tensor],
    *,
    gate_gradients: int = 1,
    aggregation_method: int | None = None,
    colocate_gradients_with_ops: bool = False,
    grad_loss: Tensor | None = None,
) -> list[tuple[Tensor | None, Tensor]]:
    """TF's ``Optimizer.compute_gradients`` for an explicit ``var_list``; the wrappers share it."""
    if gate_gradients not in (Optimizer.GATE_NONE, Optimizer.GATE_OP, Optimizer.GATE_GRAPH):
        raise ValueError(
            "gate_gradients must be one of: Optimizer.GATE_NONE, Optimizer.GATE_OP, "
            f"Optimizer.GATE_GRAPH. Not {gate_gradients!r}"
        )
    check_aggregation_method(aggregation_method)
    if isinstance(var_list, Tensor):
        # Iterating a tensor yields its rows, which are not leaves of the loss's graph.
        raise TypeError(
            f"var_list must be a list of tensors, got a single tensor {_describe(var_list)}; pass [tensor]"
        )
    if callable(loss) and not isinstance(loss, Tensor):
        with torch.enable_grad():
            loss = loss()
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss must be a tensor or a callable returning one, got {type(loss).__name__}")
    var_list = list(var_list)
    if not var_list:
        raise ValueError("No variables to optimize.")
    for i, v in enumerate(var_list):
        if not isinstance(v, Tensor) or not v.requires_grad:
            raise ValueError(f"var_list[{i}] must be a tensor that requires grad, got {_describe(v)}")
        if v.dtype not in _VALID_DTYPES:
            # TF's _assert_valid_dtypes: its optimizers take floating variables only.
            raise ValueError(
                f"var_list[{i}] has dtype {v.dtype}; the optimizers take {[str(d) for d in _VALID_DTYPES]}"
            )
    if grad_loss is not None and (not isinstance(grad_loss, Tensor) or grad_loss.shape != loss.shape):
        raise ValueError(
            f"grad_loss must be a tensor of the loss's shape {tuple(loss.shape)}, got {_describe(grad_loss)}"
        )
    if grad_loss is not None and grad_loss.dtype != loss.dtype:
        raise TypeError(f"grad_loss has dtype {grad_loss.dtype}; it must have the loss's dtype {loss.dtype}")
    # TF passes gate_gradients=(gate_gradients == GATE_OP) to tf.gradients. Like
    # loss.backward(), the graph is freed and the gradients are plain tensors.
    grads = gradients(
        loss,
        var_list,
        grad_ys=grad_loss,
        colocate_gradients_with_ops=colocate_gradients_with_ops,
        gate_gradients=gate_gradients == Optimizer.GATE_OP,
        aggregation_method=aggregation_method,
        create_graph=False,
        retain_graph=False,
    )
    if all(g is None for g in grads) and any(isinstance(v, DTensor) for v in var_list):
        # FSDP2 computes with all-gathered copies of its sharded parameters and hands
        # their gradients back only through its backward hooks.
        raise ValueError(
            "No gradients reached the DTensor variables: parameters sharded by FSDP2 (fully_shard) get "
            "their gradients through loss.backward(), not torch.autograd.grad; use loss.backward() "
            "then step() (apply_gradients takes the resulting p.grad too)"
        )
    return list(zip(grads, var_list, strict=True))


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


def _check_fused_devices(cls: str, params: list[Any]) -> None:
    for p in params:
        if isinstance(p, Tensor) and p.device.type not in _FUSED_DEVICES:
            raise RuntimeError(
                f"{cls}: `fused=True` requires parameters on {' or '.join(_FUSED_DEVICES)} "
                f"(the devices torch.compile generates kernels for), got one on {p.device}"
            )


def _check_non_slot(cls: str, name: str, value: Any, current: Tensor) -> None:
    """A loaded non-slot tensor must match the kind and shape of ``current`` and be finite.

    It is read on the host once, at load time: a NaN beta power would turn
    every later update into NaN.
    """
    if (
        not isinstance(value, Tensor)
        or value.shape != current.shape
        or value.dtype.is_floating_point != current.dtype.is_floating_point
        or value.dtype == torch.bool
    ):
        kind = "floating" if current.dtype.is_floating_point else "integer"
        raise TypeError(
            f"{cls}: loaded non-slot state {name} must be a {kind} tensor of shape "
            f"{tuple(current.shape)}, got {_describe(value)}"
        )
    if value.is_meta or not bool(torch.isfinite(value).all()):
        raise ValueError(f"Invalid {name} value: {value!r}; expected finite numbers")


def _merge_old_non_slot(cls: str, state_dict: Any) -> Any:
    """A state dict of the earlier layout (top-level ``"non_slot_state"``) in the current one.

    Each group's non-slot dict moves into its param group; anything else is
    returned as given, for ``_validate_state_dict`` to judge.
    """
    if not isinstance(state_dict, dict) or "non_slot_state" not in state_dict:
        return state_dict
    state_dict = dict(state_dict)
    old, groups = state_dict.pop("non_slot_state"), state_dict.get("param_groups")
    if not isinstance(groups, list):
        return state_dict
    if (
        not isinstance(old, list)
        or len(old) != len(groups)
        or not all(isinstance(ns, dict) and isinstance(g, dict) for ns, g in zip(old, groups, strict=True))
    ):
        raise ValueError(
            f"{cls}: loaded 'non_slot_state' (the earlier layout) must be a list of one dict per "
            f"parameter group ({len(groups)}), got {_describe(old)}"
        )
    state_dict["param_groups"] = [{**g, **ns} for g, ns in zip(groups, old, strict=True)]
    return state_dict


def _shared_kind(
    grads: list[Tensor],
    params: list[Tensor],
    checked: bool = False,
    param_shapes: list[torch.Size] | None = None,
) -> tuple[torch.device, torch.dtype] | None:
    """The one device and dtype of every parameter and gradient, when every gradient is dense and
    strided with its parameter's shape and none of them is a DTensor; else None.

    ``checked``: each gradient is known to fit its parameter (shape, dtype, device), so only the
    parameters' devices and dtypes are read. ``param_shapes``: the parameters' shapes, where the
    caller has read them. Read by ``map`` over whole lists, attribute by
    attribute: in the usual case it replaces both :func:`_grads_fit` and a second reading
    of the devices and dtypes to group the update by them.
    """
    # (First what a group of several dtypes or devices fails at, before the costlier reads.)
    dtypes = set(map(_DTYPE_OF, params))
    if len(dtypes) != 1 or len(devices := set(map(_DEVICE_OF, params))) != 1:
        return None
    if set(map(_LAYOUT_OF, grads)) != {torch.strided}:
        return None
    if any(issubclass(t, DTensor) for t in {*map(type, params), *map(type, grads)}):
        return None
    if not checked and list(map(_SHAPE_OF, grads)) != (
        list(map(_SHAPE_OF, params)) if param_shapes is None else param_shapes
    ):
        return None
    if not checked and (set(map(_DEVICE_OF, grads)) != devices or set(map(_DTYPE_OF, grads)) != dtypes):
        return None
    return devices.pop(), dtypes.pop()


def _kept_census(
    kept: dict[Any, Any], key: Any, params: list[Tensor], grads: list[Tensor]
) -> tuple[list[torch.Size], tuple[torch.device, torch.dtype] | None, _SameMeta | None]:
    """The shapes of ``params`` and :func:`_shared_kind` of the pairs, and the metadata they were
    found with, taken from ``kept[key]`` while every tensor has that metadata; else read again and
    kept there (None where nothing can be kept)."""
    found = kept.get(key)
    if found is not None and found[0].holds([*params, *grads]):
        return found[1], found[2], found[0]
    shape_list = list(map(_SHAPE_OF, params))
    kind = _shared_kind(grads, params, param_shapes=shape_list)
    same = _SameMeta.of([*params, *grads]) if kind is not None else None
    kept[key] = (same, shape_list, kind) if same is not None else None
    return shape_list, kind, same


class _SameMeta:
    """Whether a list of tensors has, tensor by tensor, the metadata of the list it was made from.

    Compared in one C++ call: each tensor's Python type, dtype, device, sizes,
    strides, ``requires_grad`` and dispatch keys (which tell sparse, inference,
    conjugated and negated tensors and ``__torch_dispatch__`` subclasses such as
    DTensor from a dense tensor). That is every property the checks of a step
    read from a parameter, gradient or slot but its address, and what lets a
    step whose tensors are as at the last one skip those reads: they cost
    about 1 µs per tensor in Python, against 0.08 µs here. The call is dynamo's
    own check of a compiled function's tensor inputs (``TensorGuards``), a
    private API: where this torch lacks it or it does not pass a check of what
    it tells apart (:func:`_tensor_guards`), :meth:`of` gives None and the
    callers read every tensor as before.
    """

    __slots__ = ("_check", "_count")

    def __init__(self, check: Callable[..., bool], count: int):
        self._check, self._count = check, count

    @classmethod
    def of(cls, tensors: Sequence[Tensor]) -> _SameMeta | None:
        guards = _tensor_guards()
        if guards is None:
            return None
        try:
            check = guards(
                *tensors,
                dynamic_dims_sizes=None,
                dynamic_dims_strides=None,
                tensor_check_names=["t"] * len(tensors),
            ).check
        except Exception:  # a tensor it cannot describe: the caller reads every tensor
            return None
        return cls(check, len(tensors))

    def holds(self, tensors: Sequence[Tensor]) -> bool:
        return len(tensors) == self._count and bool(self._check(*tensors))


class _SlotRecord:
    """What a check of a group's slots found: each parameter's slot names, in its dict's order,
    and their metadata (:class:`_SameMeta`)."""

    __slots__ = ("_meta", "_names")

    def __init__(self, meta: _SameMeta, names: list[str]):
        self._meta, self._names = meta, names

    @classmethod
    def of(cls, slots: list[Tensor], dicts: list[dict[str, Any]]) -> _SlotRecord | None:
        """The record of ``slots``, every tensor of the slot ``dicts`` in their order."""
        meta = _SameMeta.of(slots)
        return None if meta is None else cls(meta, list(itertools.chain.from_iterable(dicts)))

    def holds(self, dicts: list[dict[str, Any] | None]) -> bool:
        """Whether the slot dicts (of the group's parameters, in order; None or empty for one that
        has none) hold slots of the very names and metadata found then (a value that is not a
        tensor fails the check)."""
        present = list(filter(None, dicts))
        return list(itertools.chain.from_iterable(present)) == self._names and self._meta.holds(
            list(itertools.chain.from_iterable(map(dict.values, present)))
        )


@functools.cache
def _tensor_guards() -> Any:
    """dynamo's ``TensorGuards`` where it tells apart what :class:`_SameMeta` relies on, else None.

    Tried on ordinary tensors whatever the caller's mode (a first step may run under
    inference mode, whose tensors would all look alike).
    """
    try:
        with torch.inference_mode(False):
            return _tensor_guards_tried()
    except Exception:  # absent or changed in this torch release
        return None


def _tensor_guards_tried() -> Any:
    from torch._C._dynamo.guards import TensorGuards

    like = torch.zeros(2, 3)
    check = TensorGuards(
        like, dynamic_dims_sizes=None, dynamic_dims_strides=None, tensor_check_names=["t"]
    ).check
    others = [
        torch.zeros(3, 2),
        torch.zeros(2, 3, 1),
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(3, 2).t(),
        torch.zeros(2, 3).requires_grad_(),
        torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False),
        torch.zeros(2, 3).to_sparse(),
        None,
    ]
    with torch.inference_mode():
        others.append(torch.zeros(2, 3))
    return TensorGuards if check(torch.ones(2, 3)) and not any(check(t) for t in others) else None


def _grads_fit(grads: list[Tensor], params: list[Tensor]) -> bool:
    """Whether every gradient is dense and strided, with its parameter's shape, dtype and device,
    pair by pair: where :func:`_shared_kind` finds no one kind (parameters of several devices or
    dtypes in one group), or where it is not needed; ``_check_grad`` then names what is wrong."""
    strided = torch.strided
    return all(
        g.layout == strided and g.shape == p.shape and g.dtype == p.dtype and g.device == p.device
        for g, p in zip(grads, params, strict=True)
    )


def _check_grad(cls: str, g: Any, p: Tensor) -> None:
    if not isinstance(g, Tensor):
        raise TypeError(
            f"Gradient must be a Tensor or None, got {type(g).__name__} for variable {_describe(p)}"
        )
    if g.shape != p.shape:
        raise ValueError(
            f"{cls}: gradient shape {tuple(g.shape)} does not match variable shape {tuple(p.shape)}"
        )
    if g.dtype != p.dtype:
        raise TypeError(f"{cls}: gradient dtype {g.dtype} does not match variable dtype {p.dtype}")
    if g.device != p.device:
        raise ValueError(f"{cls}: gradient on {g.device} but variable on {p.device}")
    if g.is_sparse:
        if g.sparse_dim() != 1:
            raise ValueError(
                f"{cls}: sparse gradients must be row-sparse (sparse_dim 1, as from "
                f"nn.Embedding(sparse=True) or TF's IndexedSlices), got sparse_dim {g.sparse_dim()}"
            )
        _check_rows(cls, g, p)
    elif g.layout != torch.strided:
        raise ValueError(f"{cls}: gradient layout {g.layout} is not supported (strided or sparse COO)")


def _check_rows(cls: str, g: Tensor, p: Tensor) -> None:
    """Refuse a sparse gradient whose row indices fall outside ``p``.

    torch builds sparse tensors without checking their indices
    (``check_invariants=False``), and an index past the end fails only inside
    the update, after other parameters were changed. Reading the bounds is one
    host synchronisation per sparse gradient; the sparse path already pays one
    to coalesce. A gradient marked coalesced must also have its rows sorted and unique:
    ``coalesce()`` trusts the mark, and duplicate rows would then be updated as if
    each came alone (one pass over the indices, in the same read).
    """
    rows = g._indices()[0]
    if rows.numel() == 0:
        return
    checks = [*torch.aminmax(rows)]
    if g.is_coalesced():
        checks.append((rows[1:] <= rows[:-1]).any().to(rows.dtype))
    low, high, *unsorted = (int(x) for x in torch.stack(checks).tolist())
    if low < 0 or high >= p.shape[0]:
        bad = low if low < 0 else high
        raise ValueError(
            f"{cls}: sparse gradient row index {bad} is out of range for variable {_describe(p)} "
            f"(valid rows: 0 to {p.shape[0] - 1})"
        )
    if any(unsorted):
        raise ValueError(
            f"{cls}: sparse gradient for variable {_describe(p)} is marked coalesced, but its row "
            "indices are not sorted and unique; build it without is_coalesced=True (or call "
            "coalesce() on an unmarked one)"
        )


def one_element_rows(p: Tensor) -> bool:
    """Whether each row of ``p`` holds one element (a 1-D parameter, or rows of shape (1,)): TF's
    sparse kernels take such a variable (``inner_dim == 1``) through scalar C++ code, whose
    roundings the sparse rules follow there."""
    return math.prod(p.shape[1:]) == 1


def _summed_rows(g: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of the row-sparse gradient ``g``, sorted and unique, and their values, with the
    values of a row given more than once summed as TensorFlow sums them.

    TF's optimizers sum the duplicates of an ``IndexedSlices`` with ``unsorted_segment_sum``:
    from zero, adding each row's values in the order they are given. ``coalesce()`` adds them
    in that order only up to 16 entries; past that its sort moves them, and the sums differ in
    their last bits (more where the values cancel). On the CPU they are added here in the
    order given (``index_add_`` into zeros goes through the rows in order); half-precision
    values in float32, rounded once (TF rounds each addition to the half dtype). On other
    devices, where TF's sum runs in no set order either, ``coalesce()`` sums them. A gradient
    marked coalesced (rows sorted and unique, see :func:`_check_rows`) is taken as it is.
    """
    if g.is_coalesced() or g.device.type != "cpu":
        g = g.coalesce()
        return g._indices()[0], g._values()
    values = g._values()
    rows, where = torch.unique(g._indices()[0], return_inverse=True)
    wide = values.float() if values.dtype in _HALF_DTYPES else values
    summed = wide.new_zeros((rows.numel(), *values.shape[1:]))
    summed.index_add_(0, where, wide)
    return rows, summed.to(values.dtype)


# int32 and int64, as TF's global_step; narrower integers wrap within a training run (uint8 at 256 steps).
_GLOBAL_STEP_DTYPES = (torch.int32, torch.int64)


def _check_global_step(global_step: Any) -> None:
    if not isinstance(global_step, Tensor) or global_step.dim() != 0 or global_step.dtype.is_floating_point:
        raise TypeError(f"global_step must be a 0-d integer tensor, got {_describe(global_step)}")
    if global_step.dtype not in _GLOBAL_STEP_DTYPES:
        raise TypeError(
            "global_step must be a 0-d int32 or int64 tensor (as TensorFlow's), got "
            f"{_describe(global_step)}; a narrower integer wraps around during training"
        )
    if global_step.is_meta:
        raise ValueError(f"Invalid global_step value: {_describe(global_step)}; a meta tensor holds no count")
    if global_step.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"Invalid global_step value: {_describe(global_step)} is an inference tensor (made under "
            "torch.inference_mode()), which cannot be incremented in place outside inference mode"
        )


def _describe(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
    return f"{type(v).__name__}: {v!r}"
