"""``tf.compat.v1.train.ExponentialMovingAverage`` on torch tensors, with TF's exact numbers."""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..optim.wrapper import check_range, describe, fused_update
from . import _float32

__all__ = ["ExponentialMovingAverage"]

# TF averages these dtypes only (``apply`` raises TypeError for any other).
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# The foreach path works through a device/dtype group in batches of about this many elements:
# the difference it writes is read back while still in cache, so one update moves each shadow and
# each value through memory about once (a whole-list foreach op per line of the rule would
# stream the shadows three times and the difference three times).
_BATCH_ELEMENTS = 1 << 15

# What ``fused=True`` compiles: Inductor's C++ and Triton compute float16/bfloat16 ops in float32
# without rounding between them, so those shadows (and other devices) keep the foreach path.
_FUSED_DTYPES = (torch.float32, torch.float64)
_FUSED_DEVICES = ("cpu", "cuda")

Named = Mapping[str, Tensor] | Iterable[tuple[str, Tensor] | Tensor | str]


@dataclass
class _Average:
    """What the average of one name holds: its shadow and, for a zero-debiased tensor, TF's
    ``biased`` and ``local_step`` variables."""

    shadow: Tensor
    variable: Tensor | None  # None: a tensor value (TF's non-Variable input)
    biased: Tensor | None = None
    local_step: Tensor | None = None

    def __post_init__(self) -> None:
        # Read once: the update of every apply needs them, and the shadow never changes shape.
        self.sharded = isinstance(self.shadow, DTensor)
        self.local = _local(self.shadow)
        self.key = (self.local.device, self.local.dtype)
        self.numel = self.local.numel()


class ExponentialMovingAverage:
    r"""Moving averages of tensors, exactly as TensorFlow v1's ``tf.train.ExponentialMovingAverage``.

    With :math:`d` = ``decay`` rounded to float32, :math:`n` = ``num_updates``
    cast to float32, :math:`s` a shadow and :math:`v` the value it averages,
    each :meth:`apply` computes, in float32 op by op,

    .. math::
        d' &= \min\left(d, \frac{1 + n}{10 + n}\right)
            && \text{(only with num\_updates)} \\
        c &= 1 - d' && \text{(then cast to the shadow's dtype)} \\
        s &\leftarrow s - (s - v)\,c && \text{(three roundings, in the shadow's dtype)}

    A variable's shadow starts as a copy of the variable, at the first
    :meth:`apply` that names it, and has its dtype, device and layout
    (float16/bfloat16 variables get float16/bfloat16 shadows, as in TF). A
    *tensor* (TF's non-Variable input, e.g. a batch's moments; pass it as
    ``tensors=``) gets a shadow that starts at zero; with ``zero_debias=True``
    TF keeps ``biased`` (starting at 0) and ``local_step`` (0, in the value's
    dtype) beside it and sets

    .. math::
        b &\leftarrow b - (b - v)\,c, \qquad t \leftarrow t + 1 \\
        s &= b \,/\, (1 - (1 - c)^t).

    As in TF, ``zero_debias`` has no effect on variables.

    Names. A shadow is known by its variable's name, and the TF name of a
    shadow is ``<name>/<ema name>`` (``average_name``), of the debiasing
    variables ``<name>/<ema name>/biased`` and ``.../local_step``. The first
    ``apply`` naming a variable takes names from ``model.named_parameters()``
    or a ``{name: tensor}`` map; later calls, ``average``, ``average_name``
    and ``swapped`` also take the tensor itself or its name.

    Differences from TensorFlow:
        1. ``apply`` needs ``var_list`` (TF defaults to the graph's trainable
           variables) and names for new variables; it returns None (TF: an op).
        2. A variable's shadow starts from its value at the first ``apply``
           naming it (TF 2's eager behaviour; in a TF 1 graph, the value when
           the initializer runs). Call ``apply`` once before training, as TF's
           documentation does, to start from the initial weights.
        3. Bad input is refused before anything changes, with an error naming
           it: ``decay`` outside [0, 1] or not finite, a negative
           ``num_updates``, a value whose shape or dtype differs from its shadow.
        4. ``name`` only names (the shadows' suffix); ``variables_to_restore``
           maps the averaged variables alone (TF adds the graph's other ones).

    Differences from ``torch.optim.swa_utils.AveragedModel`` with
    ``get_ema_multi_avg_fn(decay)``, which computes ``lerp(s, v, 1 - decay)``:
        1. The decay is rounded to float32 and :math:`1 - d` is computed there,
           then cast (torch: a Python double).
        2. The update rounds three times, in TF's order (torch's ``lerp`` makes
           one fused multiply-add): 1.2x to 1.3x the time of ``AveragedModel``'s
           update with foreach ops, 0.7x with ``fused=True`` (float32, CPU).
        3. ``num_updates`` and ``zero_debias`` are TF's.

    Args:
        decay: in [0, 1]; a number, or a 0-d floating tensor read at every ``apply``.
        num_updates: None, an int, or a 0-d integer tensor (e.g. the ``global_step``
            an optimizer increments) read at every ``apply``; ``>= 0``.
        zero_debias: debias the averages of tensors given as ``tensors=`` (TF's rule).
        name: the suffix of the shadows' TF names.
        foreach: update the shadows of variables in batches of foreach ops (the
            default) or one tensor at a time; both give the same bits.
        fused: update the float32 and float64 shadows of variables on CPU or CUDA
            with compiled kernels, one pass over each shadow and its variable, as the
            optimizers' ``fused=True`` does (bitwise the loop; the first ``apply``
            compiles a kernel per dtype and device: seconds). float16 and bfloat16
            shadows and ``tensors=`` take the other paths.

    Raises:
        ValueError: ``decay`` or ``num_updates`` is out of range.
        TypeError: an argument has the wrong type.
        RuntimeError: ``fused=True`` with ``foreach=True``.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> ema = ExponentialMovingAverage(decay=0.99)
        >>> ema.apply(model.named_parameters())  # shadows start at the initial weights
        >>> ema.average_name(model.weight)
        'weight/ExponentialMovingAverage'
    """

    def __init__(
        self,
        decay: float | Tensor,
        num_updates: int | Tensor | None = None,
        zero_debias: bool = False,
        name: str = "ExponentialMovingAverage",
        *,
        foreach: bool | None = None,
        fused: bool = False,
    ):
        _check_decay(decay)
        _check_num_updates(num_updates)
        if not isinstance(zero_debias, bool):
            raise TypeError(f"zero_debias must be a bool, got {describe(zero_debias)}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {describe(name)}")
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(f"foreach must be None or a bool, got {describe(foreach)}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {describe(fused)}")
        if fused and foreach:
            raise RuntimeError("ExponentialMovingAverage: fused=True and foreach=True cannot both be set")
        self._decay = decay
        self._num_updates = num_updates
        self._zero_debias = zero_debias
        self._name = name
        self._foreach = foreach is not False
        self._fused = fused
        self._averages: dict[str, _Average] = {}
        self._name_of: dict[int, str] = {}  # id(variable) -> name; the variable is held in _averages
        self._swapped = False
        # (ids of the tensors of the last apply, in order; their averages), when all were tensors.
        self._last: tuple[tuple[int, ...], list[_Average]] | None = None
        self._rate: _RateOf | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def is_swapped(self) -> bool:
        """Whether a :meth:`swapped` block is running: the variables hold their averages, and
        their trained values come back when it ends (so a load into them now would be undone)."""
        return self._swapped

    def __repr__(self) -> str:
        return (
            f"ExponentialMovingAverage(decay={self._decay!r}, num_updates={self._num_updates!r}, "
            f"zero_debias={self._zero_debias}, name={self._name!r}, averages={len(self._averages)})"
        )

    # ----------------------------------------------------------------------------------- apply

    @torch.no_grad()
    def apply(self, var_list: Named, *, tensors: Mapping[str, Tensor] | None = None) -> None:
        """Update the averages of ``var_list`` (variables) and ``tensors`` (TF's non-Variable
        values), making the shadows of those seen for the first time.

        ``var_list``: ``model.named_parameters()``, a ``{name: tensor}`` map, or an
        iterable of ``(name, tensor)`` pairs, tensors and names already averaged.
        ``tensors``: ``{name: tensor}`` of values whose shadows start at zero.

        Raises:
            TypeError: a value is not a floating tensor of TF's dtypes, or a new variable
                comes without a name.
            ValueError: a value does not fit its shadow, a name is given twice or as both a
                variable and a tensor, or ``decay``/``num_updates`` is out of range.
            RuntimeError: inside :meth:`swapped`.
        """
        if self._swapped:
            raise RuntimeError(
                "ExponentialMovingAverage.apply inside swapped(): the variables hold the averages "
                "now; apply after the with block, when the trained values are back"
            )
        entries = _entries(var_list, "var_list")
        last = self._last
        if (
            tensors is None
            and last is not None
            and last[0] == tuple(map(id, entries))
            and all(map(_fits, entries, last[1]))
        ):
            # The tensors of the last call again, unchanged: their names and shadows are known.
            self._update(list(zip(last[1], entries, strict=True)), self._rate_of(self._one_minus_decay()))
            return
        variables = self._named_variables(entries, "var_list")
        values = dict(_pairs(tensors, "tensors")) if tensors is not None else {}
        for name, value in values.items():
            if name in variables:
                raise ValueError(f"apply: {name!r} is given both in var_list and in tensors")
            self._check_value(f"tensors[{name!r}]", name, value, variable=False)
        c32 = self._one_minus_decay()
        # Everything is checked: from here on, nothing raises for the user's input.
        for name, value in variables.items():
            self._hold(name, value, variable=True)
        for name, value in values.items():
            self._hold(name, value, variable=False)
        rate = self._rate_of(c32)
        averages = self._averages
        helds = [averages[name] for name in variables]
        self._update(list(zip(helds, variables.values(), strict=True)), rate)
        if all(isinstance(e, Tensor) for e in entries):
            self._last = (tuple(map(id, entries)), helds)
        for name, value in values.items():
            self._update_tensor(averages[name], value, rate)

    def _named_variables(self, entries: list[Any], arg: str) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        seen: dict[int, str] = {}
        averages = self._averages
        for name, value in self._resolve(entries, arg, new_ok=True):
            if name in out:
                raise ValueError(f"apply: {arg} names {name!r} twice")
            held = averages.get(name)
            # The full check (and its message) only where the quick one does not pass.
            if held is None or held.variable is None or not _fits(value, held):
                self._check_value(f"{arg}[{name!r}]", name, value, variable=True)
            # One shadow per tensor, as TF keeps one per variable.
            other = seen.setdefault(id(value), self._name_of.get(id(value), name))
            if other != name:
                raise ValueError(
                    f"apply: {arg}[{name!r}] is the tensor averaged as {other!r} (one tensor, one average)"
                )
            out[name] = value
        return out

    def _resolve(self, entries: list[Any], arg: str, *, new_ok: bool) -> Iterator[tuple[str, Tensor]]:
        """(name, variable) for each entry: a pair, a map item, a held tensor or a held name."""
        name_of = self._name_of
        for i, entry in enumerate(entries):
            if isinstance(entry, Tensor):
                name = name_of.get(id(entry))
                if name is None:
                    raise (TypeError if new_ok else KeyError)(
                        f"{arg}[{i}]: {describe(entry)} is not averaged by this ExponentialMovingAverage "
                        "and has no name; give its name the first time, e.g. apply(model.named_parameters())"
                    )
                yield name, entry
            elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
                name, value = entry
                if not new_ok and name not in self._averages:
                    raise KeyError(f"{arg}: {name!r} is not averaged by this ExponentialMovingAverage")
                yield name, value
            elif isinstance(entry, str):
                held = self._averages.get(entry)
                if held is None or held.variable is None:
                    raise KeyError(f"{arg}[{i}]: no variable named {entry!r} is averaged here")
                yield entry, held.variable
            else:
                raise TypeError(
                    f"{arg}[{i}] must be a tensor, a name or a (name, tensor) pair, got {describe(entry)}"
                )

    def _check_value(self, arg: str, name: str, value: Any, *, variable: bool) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"{arg} must be a tensor, got {describe(value)}")
        if value.dtype not in _DTYPES:
            raise TypeError(
                f"{arg}: the values averaged must be bfloat16, float16, float32 or float64 (as in "
                f"TensorFlow), got {describe(value)}"
            )
        if value.layout != torch.strided:
            raise TypeError(f"{arg}: only dense tensors are averaged, got one of layout {value.layout}")
        held = self._averages.get(name)
        if held is None:
            return
        if (held.variable is not None) != variable:
            kind = "a variable" if held.variable is not None else "a tensor (tensors=)"
            raise ValueError(f"{arg}: {name!r} is averaged as {kind}; give it the same way")
        shadow = held.shadow
        if (
            value.shape != shadow.shape
            or value.dtype != shadow.dtype
            or value.device != shadow.device
            or isinstance(value, DTensor) != isinstance(shadow, DTensor)
            or (isinstance(value, DTensor) and value.placements != shadow.placements)
        ):
            raise ValueError(
                f"{arg}: {describe(value)} on {value.device} does not fit its average "
                f"{describe(shadow)} on {shadow.device} ({_layout(shadow)})"
            )

    def _hold(self, name: str, value: Tensor, *, variable: bool) -> None:
        held = self._averages.get(name)
        if held is None:
            if variable:
                shadow = value.detach().clone(memory_format=torch.preserve_format)
            else:
                shadow = torch.zeros_like(value.detach(), memory_format=torch.preserve_format)
            held = self._averages[name] = _Average(shadow, value if variable else None)
            if not variable and self._zero_debias:
                held.biased = torch.zeros_like(shadow)
                held.local_step = torch.zeros((), dtype=shadow.dtype, device=held.local.device)
        if variable and held.variable is not value:
            # A name re-pointed to another tensor of the same shape (a model built again).
            if held.variable is not None:
                self._name_of.pop(id(held.variable), None)
                self._last = None
            held.variable = value
        if variable:
            self._name_of[id(value)] = name

    def _one_minus_decay(self) -> float:
        """TF's float32 ``1 - min(decay, (1 + n) / (10 + n))``, checking the values read now."""
        decay = _check_decay(self._decay)
        d = ctypes.c_float(decay).value  # convert_to_tensor(decay, float32): rounding, no flush
        if self._num_updates is not None:
            n = _num_updates_float32(_check_num_updates(self._num_updates))
            d = _float32.minimum(d, _float32.div(_float32.add(1.0, n), _float32.add(10.0, n)))
        return _float32.sub(1.0, d)

    def _rate_of(self, c32: float) -> _RateOf:
        # Kept while the rate stays (a constant decay, or num_updates past the decay's ratio).
        if self._rate is None or self._rate.c32 != c32:
            self._rate = _RateOf(c32)
        return self._rate

    def _update(self, pairs: list[tuple[_Average, Tensor]], rate: _RateOf) -> None:
        """The variables' update, ``s - (s - v)c`` rounded op by op: the reference loop, compiled
        kernels over each (device, dtype) group that has them (``fused``), or foreach ops over each
        group in cache-sized batches, with the same bits."""
        if not self._foreach and not self._fused:
            for held, value in pairs:
                _shrink_toward([held.local], [_local(value)], rate=rate.of(held.local.dtype))
            return
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for held, value in pairs:
            v = value.to_local() if held.sharded else value
            lists = groups.get(held.key)
            if lists is None:
                lists = groups[held.key] = ([], [])
            s = held.local
            if (
                held.numel > _BATCH_ELEMENTS
                and not self._fused_for(held.key)
                and s.is_contiguous()
                and v.is_contiguous()
            ):
                lists[0].extend(s.view(-1).split(_BATCH_ELEMENTS))
                lists[1].extend(v.view(-1).split(_BATCH_ELEMENTS))
            else:
                lists[0].append(s)
                lists[1].append(v)
        for (device, dtype), (ss, vs) in groups.items():
            # A 0-d tensor, not a number: foreach's per-tensor multiplication by a number wraps it
            # in a new tensor each time (4x the time of the multiplication for small tensors), and
            # the fused kernel reads it as an input (one kernel for every decay).
            c = rate.tensor(dtype, device)
            if self._fused_for((device, dtype)):
                fused_update(_shrink_toward, ss, vs, rate=c)
                continue
            for lo, hi in _batches(ss):
                diff = torch._foreach_sub(ss[lo:hi], vs[lo:hi])
                torch._foreach_mul_(diff, c)
                torch._foreach_sub_(ss[lo:hi], diff)

    def _fused_for(self, key: tuple[torch.device, torch.dtype]) -> bool:
        return self._fused and key[1] in _FUSED_DTYPES and key[0].type in _FUSED_DEVICES

    def _update_tensor(self, held: _Average, value: Tensor, rate: _RateOf) -> None:
        shadow, value = held.local, _local(value)
        c = rate.of(shadow.dtype)
        if held.biased is None:
            shadow.sub_((shadow - value).mul_(c))
            return
        biased, local_step = _local(held.biased), held.local_step
        assert local_step is not None
        biased.sub_((biased - value).mul_(c))
        # The count is read back, not mirrored on the host: DCP loads into local_step in place.
        step = _in_dtype(float(local_step) + 1.0, shadow.dtype)
        local_step.fill_(step)
        power = _in_dtype(_pow(_in_dtype(1.0 - c, shadow.dtype), step, shadow.dtype), shadow.dtype)
        factor = _in_dtype(1.0 - power, shadow.dtype)
        # A 0-d divisor on the device: CUDA divides by a host scalar as a multiplication by its
        # reciprocal, which rounds otherwise.
        torch.div(biased, torch.full((), factor, dtype=shadow.dtype, device=shadow.device), out=shadow)

    # ------------------------------------------------------------------------- the averages

    def average(self, var: Tensor | str) -> Tensor | None:
        """The shadow holding the average of ``var`` (a tensor or a name), or None if ``var`` is not
        averaged, as in TF."""
        held = self._averages.get(self._key(var, "var"))
        return None if held is None else held.shadow

    def average_name(self, var: Tensor | str) -> str:
        """TF's name of the shadow of ``var``: ``<name>/<ema name>``; for a name not averaged (yet),
        the name its shadow will have.

        Raises:
            KeyError: ``var`` is a tensor this object does not average (it has no name here).
        """
        key = self._key(var, "var")
        if key is None:
            raise KeyError(
                f"average_name: {describe(var)} is not averaged here, so it has no name; pass its name"
            )
        return f"{key}/{self._name}"

    def _key(self, var: Any, arg: str) -> str | None:
        if isinstance(var, str):
            return var
        if isinstance(var, Tensor):
            return self._name_of.get(id(var))
        raise TypeError(f"{arg} must be a tensor or a name, got {describe(var)}")

    def variables_to_restore(self, moving_avg_variables: Named | None = None) -> dict[str, Tensor]:
        """``{average_name(v): v}`` for the averaged variables (all, or ``moving_avg_variables``):
        restoring a checkpoint's shadows into the model's own tensors, as TF's ``Saver`` does
        with this map."""
        if moving_avg_variables is None:
            pairs = [(n, h.variable) for n, h in self._averages.items() if h.variable is not None]
        else:
            entries = _entries(moving_avg_variables, "moving_avg_variables")
            pairs = list(self._resolve(entries, "moving_avg_variables", new_ok=False))
        return {f"{name}/{self._name}": var for name, var in pairs}

    @contextlib.contextmanager
    def swapped(self, var_list: Named | None = None) -> Iterator[None]:
        """Within the ``with`` block the variables (all averaged ones, or ``var_list``) hold their
        averages; on leaving it, even by an exception, their trained values are back (a copy of
        them is kept meanwhile).

        Raises:
            KeyError: an entry of ``var_list`` is not a variable averaged here.
            RuntimeError: already inside ``swapped``.
        """
        if self._swapped:
            raise RuntimeError("ExponentialMovingAverage.swapped: already swapped (the blocks do not nest)")
        if var_list is None:
            names = [n for n, h in self._averages.items() if h.variable is not None]
        else:
            names = [n for n, _ in self._resolve(_entries(var_list, "var_list"), "var_list", new_ok=False)]
            for n in names:
                if self._averages[n].variable is None:
                    raise KeyError(f"swapped: {n!r} is averaged as a tensor; there is no variable to swap")
        variables = [_local(self._averages[n].variable) for n in names]
        shadows = [_local(self._averages[n].shadow) for n in names]
        with torch.no_grad():
            trained = [v.clone() for v in variables]
            _copy(variables, shadows)
        self._swapped = True
        try:
            yield
        finally:
            with torch.no_grad():
                _copy(variables, trained)
            self._swapped = False

    # ------------------------------------------------------------------------- state_dict

    def state_dict(self) -> dict[str, Tensor]:
        """TF's variables of this object by their TF names: the shadows
        (``<name>/<ema name>``) and, for zero-debiased tensors, ``.../biased`` and
        ``.../local_step``. The tensors themselves (as torch's state dicts), so that
        ``torch.distributed.checkpoint`` can load into them in place."""
        out: dict[str, Tensor] = {}
        for name, held in self._averages.items():
            key = f"{name}/{self._name}"
            out[key] = held.shadow
            if held.biased is not None and held.local_step is not None:
                out[f"{key}/biased"] = held.biased
                out[f"{key}/local_step"] = held.local_step
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy a :meth:`state_dict` into the averages this object holds (make them first, with the
        ``apply`` that starts training). Everything is checked before anything changes.

        Raises:
            KeyError: a name is missing or unknown.
            TypeError: an entry is not a tensor.
            ValueError: an entry's shape or dtype differs from the average's, or ``local_step``
                is not a count.
            RuntimeError: inside :meth:`swapped`.
        """
        if self._swapped:
            raise RuntimeError(
                "ExponentialMovingAverage.load_state_dict inside swapped(); load after the block"
            )
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {describe(state_dict)}")
        mine = self.state_dict()
        missing = [k for k in mine if k not in state_dict]
        unknown = [k for k in state_dict if k not in mine]
        if missing or unknown:
            raise KeyError(
                f"load_state_dict: missing {missing[:5]}{' …' if len(missing) > 5 else ''}, unknown "
                f"{unknown[:5]}{' …' if len(unknown) > 5 else ''} (this object holds {len(mine)} entries; "
                "apply the same variables and tensors first)"
            )
        for key, own in mine.items():
            given = state_dict[key]
            if not isinstance(given, Tensor):
                raise TypeError(f"load_state_dict: {key!r} must be a tensor, got {describe(given)}")
            if given.shape != own.shape or given.dtype != own.dtype:
                raise ValueError(f"load_state_dict: {key!r} is {describe(given)}, expected {describe(own)}")
            if isinstance(given, DTensor) != isinstance(own, DTensor):
                raise ValueError(f"load_state_dict: {key!r} is {_layout(given)}, expected {_layout(own)}")
            if key.endswith("/local_step"):
                step = float(given)
                if not (step >= 0 and math.isfinite(step) and step == math.floor(step)):
                    raise ValueError(f"load_state_dict: {key!r} is {step!r}, expected a count >= 0")
        for key, own in mine.items():
            if state_dict[key] is not own:
                own.copy_(state_dict[key])


# ------------------------------------------------------------------------------- helpers


def _shrink_toward(shadows: list[Tensor], values: list[Tensor], *, rate: Tensor | float) -> None:
    """TF's update of each shadow, ``s - (s - v) * rate`` in three roundings: the reference loop,
    and what ``fused=True`` compiles (the shadows written, the values read)."""
    for s, v in zip(shadows, values, strict=True):
        s.sub_((s - v).mul_(rate))


class _RateOf:
    """TF's ``1 - decay`` (float32) cast to each shadow dtype, as a Python number exact in it."""

    def __init__(self, c32: float):
        self.c32 = c32
        self._of: dict[torch.dtype, float] = {}
        self._tensors: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def of(self, dtype: torch.dtype) -> float:
        c = self._of.get(dtype)
        if c is None:
            c = self._of[dtype] = float(torch.tensor(self.c32, dtype=torch.float32).to(dtype))
        return c

    def tensor(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``of(dtype)`` as a 0-d tensor on ``device`` (only read: the foreach multiplications')."""
        c = self._tensors.get((dtype, device))
        if c is None:
            c = self._tensors[dtype, device] = torch.full((), self.of(dtype), dtype=dtype, device=device)
        return c


def _in_dtype(x: float, dtype: torch.dtype) -> float:
    """``x`` (exact in float64) rounded to ``dtype``, as TF's op of that dtype rounds it."""
    if dtype == torch.float64:
        return x
    if dtype == torch.float32:
        return _float32.f32(x)
    return float(torch.tensor(x, dtype=torch.float64).to(dtype))


def _pow(base: float, exponent: float, dtype: torch.dtype) -> float:
    """TF's 0-d ``pow``: the C library's ``pow`` (float64) or ``powf`` (float32, and float16/bfloat16
    before the result is rounded to them)."""
    if dtype == torch.float64:
        return math.pow(base, exponent)
    return _float32.pow(base, exponent)


def _num_updates_float32(n: int) -> float:
    # TF casts the integer straight to float32 (round to nearest even); int -> double -> float could
    # round twice above 2**53.
    return float(torch.tensor(n, dtype=torch.int64).to(torch.float32))


def _check_decay(decay: Any) -> float:
    if isinstance(decay, Tensor):
        if decay.dim() != 0 or not decay.dtype.is_floating_point:
            raise TypeError(f"decay must be a number or a 0-d floating tensor, got {describe(decay)}")
        value = float(decay)
    elif isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise TypeError(f"decay must be a number or a 0-d floating tensor, got {describe(decay)}")
    else:
        value = float(decay)
    check_range("decay", value, 0.0, 1.0, high_inclusive=True)
    return value


def _check_num_updates(num_updates: Any) -> int:
    if num_updates is None:
        return 0
    if isinstance(num_updates, Tensor):
        if num_updates.dim() != 0 or num_updates.dtype.is_floating_point or num_updates.dtype == torch.bool:
            raise TypeError(
                f"num_updates must be None, an int or a 0-d integer tensor, got {describe(num_updates)}"
            )
        value = int(num_updates)
    elif isinstance(num_updates, bool) or not isinstance(num_updates, int):
        raise TypeError(
            f"num_updates must be None, an int or a 0-d integer tensor, got {describe(num_updates)}"
        )
    else:
        value = num_updates
    if value < 0:
        raise ValueError(f"Invalid num_updates value: {value!r}; expected a count >= 0")
    return value


def _pairs(named: Any, arg: str) -> list[tuple[str, Tensor]]:
    if not isinstance(named, Mapping):
        raise TypeError(f"{arg} must be a mapping of names to tensors, got {describe(named)}")
    out = []
    for name, value in named.items():
        if not isinstance(name, str):
            raise TypeError(f"{arg}: names must be str, got {describe(name)}")
        out.append((name, value))
    return out


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (each rank averages its own; the rule is elementwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _layout(t: Tensor) -> str:
    return f"placements {t.placements}" if isinstance(t, DTensor) else "a plain tensor"


def _entries(var_list: Any, arg: str) -> list[Any]:
    if isinstance(var_list, (Tensor, str)):
        raise TypeError(f"{arg} must be a collection of tensors, got {describe(var_list)}")
    try:
        return list(var_list.items() if isinstance(var_list, Mapping) else var_list)
    except TypeError:
        raise TypeError(f"{arg} must be a collection of tensors, got {describe(var_list)}") from None


def _fits(value: Any, held: _Average) -> bool:
    """``value`` has its shadow's shape, dtype, device, layout and placements (the quick check)."""
    shadow = held.shadow
    if not (
        isinstance(value, Tensor)
        and value.shape == shadow.shape
        and value.dtype == shadow.dtype
        and value.layout == torch.strided
        and value.device == shadow.device
    ):
        return False
    if held.sharded:
        return isinstance(value, DTensor) and value.placements == shadow.placements
    kind = type(value)
    return kind is Tensor or kind is torch.nn.Parameter or not isinstance(value, DTensor)


def _batches(tensors: list[Tensor]) -> Iterator[tuple[int, int]]:
    """Consecutive index ranges of ``tensors`` of about ``_BATCH_ELEMENTS`` elements each."""
    lo, size = 0, 0
    for i, t in enumerate(tensors):
        size += t.numel()
        if size >= _BATCH_ELEMENTS:
            yield lo, i + 1
            lo, size = i + 1, 0
    if lo < len(tensors):
        yield lo, len(tensors)


def _copy(dst: list[Tensor], src: list[Tensor]) -> None:
    if dst:
        torch._foreach_copy_(dst, src)
