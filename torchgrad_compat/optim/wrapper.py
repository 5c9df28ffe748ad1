"""What optimizers that wrap another are built from: ``OptimizerWrapper``, and the checks and
numerics they share with the optimizers.

``LossScaleOptimizer``, ``CrossShardOptimizer``, ``AGNOptimizer``, the TF checkpoint code and
``torchgrad_compat.train`` use this package through this module and the ``Optimizer`` class alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._torch_internals import called_from_dcp_init, no_step_pre_hooks
from ._census import SameMeta, kept_census
from ._checks import DEVICE_OF, DTYPE_OF, GRAD_OF, check_global_step, check_grad, describe, grads_fit
from ._fused.run import Unscaling, run_fused
from ._group_keys import LOSS_SCALE_KEY_PREFIX
from ._hyper import check_range, number_tensor, python_float
from ._memory import bytes_spanned, check_no_shared_elements, is_expanded
from ._numerics import sqrt, summed_rows
from ._tf_api import compute_gradients, hooked_update, trainable
from .optimizer import own_update

__all__ = [
    "DEVICE_OF",
    "DTYPE_OF",
    "GRAD_OF",
    "LOSS_SCALE_KEY_PREFIX",
    "OptimizerWrapper",
    "SameMeta",
    "Unscaling",
    "bytes_spanned",
    "called_from_dcp_init",
    "check_global_step",
    "check_grad",
    "check_no_shared_elements",
    "check_range",
    "compute_gradients",
    "describe",
    "fused_update",
    "grads_fit",
    "hooked_update",
    "is_expanded",
    "kept_census",
    "no_step_pre_hooks",
    "number_tensor",
    "own_update",
    "python_float",
    "sqrt",
    "summed_rows",
]


def fused_update(
    single: Callable[..., None],
    targets: list[Tensor],
    sources: list[Tensor],
    *more: list[Tensor],
    **scalars: Any,
) -> None:
    """Run the elementwise reference loop ``single(targets, sources, *more, **scalars)`` as the
    optimizers' ``fused=True`` kernels: compiled by Inductor (C++ on CPU, Triton on CUDA), one
    pass over each row's elements, the loop's arithmetic op for op (bitwise on CPU in float32
    and float64; float16/bfloat16 ops are computed in float32 there, so callers that round in
    those dtypes keep their own path for them).

    The lists are rows: entry ``i`` of every list is one tensor of the same number of
    elements, and every list has one dtype and the device of ``targets``.

    - ``targets`` (what an optimizer's parameters are): written in place. The kernels take them
      flat, so each row must be contiguous (or channels-last) as its ``sources`` row is; rows
      that are not, or of fewer than two elements, go through ``single`` itself. Their
      autograd versions are bumped. How the rows split into calls is kept under ``targets[0]``
      (or ``more[0][0]``) and used again while every row keeps its size and layout.
    - ``sources`` (the gradients): read only, never kept; they may move between calls.
    - ``more`` (the slots): written in place, as ``targets``.
    - ``scalars``: keyword arguments, each a Python value (one kernel per distinct value) or a
      tensor of one element read at every call (one kernel for all values).

    ``single`` must be a function kept for the life of the process (kernels are kept per
    function, dtypes, device and scalar kinds) that updates each row elementwise, reading
    each target, source and slot element once, with no row depending on another. The first
    call for a kernel compiles it (seconds on CPU; Inductor's disk cache keeps it for later
    processes). With grad mode on, or inside a caller's ``torch.compile``, ``single`` runs as
    it is.

    Raises:
        ValueError: a row does not fit its target (size, dtype, device, shape), or a tensor
            scalar has more than one element.
        RuntimeError: a target or slot is an inference tensor, outside inference mode.
    """
    run_fused(single, None, targets, sources, *more, **scalars)


_TORCH_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class OptimizerWrapper(torch.optim.Optimizer):
    """An optimizer that wraps another (this package's or torch's own) and shares its state.

    ``param_groups``, ``state`` and ``defaults`` *are* the wrapped optimizer's, so
    LR schedulers, ``zero_grad`` and ``add_param_group`` act on it, and
    ``learning_rate`` (alias ``lr``) reads and sets the learning rate of every
    group. TF's API works whatever is wrapped: ``compute_gradients``,
    ``get_slot``, ``get_slot_names`` and ``variables`` read the wrapped
    optimizer, and gradients reach a torch optimizer, which has no
    ``apply_gradients``, through ``.grad`` for one ``step()``.

    Subclasses implement ``step`` and ``apply_gradients`` and extend
    ``state_dict`` / ``load_state_dict`` with their own state.
    """

    GATE_NONE: ClassVar[int] = 0
    GATE_OP: ClassVar[int] = 1
    GATE_GRAPH: ClassVar[int] = 2

    _pickled_attributes: ClassVar[tuple[str, ...]] = ("_optimizer",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A wrapper's apply_gradients fires the wrapper's step hooks, as its step()
        # does once torch has patched it (see hooked_update).
        if "apply_gradients" in cls.__dict__:
            cls.apply_gradients = hooked_update(cls.__dict__["apply_gradients"])  # type: ignore[method-assign]

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}: "
                f"{optimizer!r}"
            )
        self._optimizer = optimizer
        # torch.optim.Optimizer.__init__ would build param groups of its own: set up only its hooks.
        for name in _TORCH_HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # ------------------------------------------------------------------ shared state
    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @property
    def learning_rate(self) -> Any:
        """The first param group's learning rate; setting it sets every group's."""
        return self.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        for group in self.param_groups:
            group["lr"] = value

    lr = learning_rate

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._pickled_attributes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in _TORCH_HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._optimizer!r})"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)
        self._mirror(self._wrapper_state())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ TF's read API
    def get_slot(self, var: Tensor, name: str) -> Tensor | None:
        """The wrapped optimizer's slot ``name`` of ``var`` (for torch's: its state entry), or None."""
        if hasattr(self._optimizer, "get_slot"):
            return self._optimizer.get_slot(var, name)
        state = self._optimizer.state.get(var)
        return None if state is None else state.get(name)

    def get_slot_names(self) -> list[str]:
        if hasattr(self._optimizer, "get_slot_names"):
            return self._optimizer.get_slot_names()
        names = {k for s in self._optimizer.state.values() for k, v in s.items() if isinstance(v, Tensor)}
        return sorted(names)

    def variables(self) -> list[Tensor]:
        """The wrapped optimizer's state tensors (subclasses add their own)."""
        if hasattr(self._optimizer, "variables"):
            return list(self._optimizer.variables())
        return [
            v for s in self._optimizer.state.values() for _, v in sorted(s.items()) if isinstance(v, Tensor)
        ]

    # ------------------------------------------------------------------ gradients
    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _grads_by_param(self, pairs: list[Any]) -> tuple[list[Tensor | None], dict[int, None]]:
        """``(grad, var)`` pairs as one gradient (or None) per parameter of :meth:`_all_params`.

        Also returns the indices of the listed variables, in the pairs' order
        (an ordered set).
        Every pair is checked before the caller acts on any: a pair shape, a
        variable the wrapped optimizer manages, listed once, a gradient that fits it.
        """
        params = self._all_params()
        where = {id(p): i for i, p in enumerate(params)}
        grads: list[Tensor | None] = [None] * len(params)
        listed: dict[int, None] = {}
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"grads_and_vars must hold (gradient, variable) pairs, got {item!r}")
            g, v = item
            if not isinstance(v, Tensor) or id(v) not in where:
                raise ValueError(
                    f"{type(self._optimizer).__name__} does not manage variable {describe(v)}; "
                    f"{type(self).__name__} takes the wrapped optimizer's parameters only"
                )
            i = where[id(v)]
            if i in listed:
                raise ValueError(f"variable {describe(v)} appears more than once in grads_and_vars")
            if g is not None:
                check_grad(type(self).__name__, g, v)
            grads[i] = g
            listed[i] = None
        return grads, listed

    def compute_gradients(
        self,
        loss: Tensor | Callable[[], Tensor],
        var_list: Sequence[Tensor] | None = None,
        gate_gradients: int = 1,
        aggregation_method: int | None = None,
        colocate_gradients_with_ops: bool = False,
        grad_loss: Tensor | None = None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """The wrapped optimizer's ``compute_gradients`` (TF's, over its parameters for a torch optimizer).

        Delegating lets wrappers compose: around a CrossShardOptimizer, the loss
        is also scaled by ``1/num_shards``.
        """
        kwargs = {
            "gate_gradients": gate_gradients,
            "aggregation_method": aggregation_method,
            "colocate_gradients_with_ops": colocate_gradients_with_ops,
            "grad_loss": grad_loss,
        }
        if hasattr(self._optimizer, "compute_gradients"):
            return self._optimizer.compute_gradients(loss, var_list=var_list, **kwargs)
        var_list = trainable(self.param_groups) if var_list is None else var_list
        return compute_gradients(loss, var_list, **kwargs)

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Tensor | None, Tensor]],
        global_step: Tensor | None = None,
        name: str | None = None,
    ) -> None:
        """Apply ``(grad, var)`` pairs: each wrapper does its part, then ``_apply_inner``."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply_gradients")

    def minimize(
        self,
        loss: Tensor | Callable[[], Tensor],
        global_step: Tensor | None = None,
        var_list: Sequence[Tensor] | None = None,
        gate_gradients: int = 1,
        aggregation_method: int | None = None,
        colocate_gradients_with_ops: bool = False,
        name: str | None = None,
        grad_loss: Tensor | None = None,
    ) -> None:
        """This wrapper's ``compute_gradients`` then its ``apply_gradients``, as TF's ``minimize``.

        With no gradient at all, ``apply_gradients`` raises (after any
        collective a distributed wrapper needs, so no replica is left waiting).
        """
        grads_and_vars = self.compute_gradients(
            loss,
            var_list=var_list,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss,
        )
        self.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def _apply_inner(
        self,
        grads_and_vars: Iterable[tuple[Tensor | None, Tensor]],
        global_step: Tensor | None = None,
        name: str | None = None,
    ) -> None:
        """Apply ``(grad, var)`` pairs with the wrapped optimizer.

        An optimizer with ``apply_gradients`` gets the pairs. A torch optimizer
        gets them as ``.grad`` for one ``step()`` (variables without a gradient
        have ``.grad = None`` meanwhile, so torch skips them); the previous
        ``.grad`` values are put back afterwards.
        """
        inner = self._optimizer
        if hasattr(inner, "apply_gradients"):
            inner.apply_gradients(grads_and_vars, global_step=global_step, name=name)
            return
        pairs = list(grads_and_vars)
        if global_step is not None:
            check_global_step(global_step)
        managed = {id(p) for p in self._all_params()}
        for _, v in pairs:
            if id(v) not in managed:
                raise ValueError(f"{type(inner).__name__} does not manage variable {describe(v)}")
        if all(g is None for g, _ in pairs):
            raise ValueError(f"No gradients provided for any variable: {[describe(v) for _, v in pairs]}.")
        saved = [(p, p.grad) for p in self._all_params()]
        try:
            for p, _ in saved:
                p.grad = None
            for g, v in pairs:
                v.grad = g
            inner.step()
        finally:
            for p, g in saved:
                p.grad = g
        if global_step is not None:
            with torch.no_grad():
                global_step.add_(1)

    # ------------------------------------------------------------------ checkpoints
    def _wrapper_state(self) -> dict[str, Any]:
        """This wrapper's optimizer-wide state (copies), by param-group key; none by default."""
        return {}

    def _wrapper_param_state(self) -> dict[int, dict[str, Any]]:
        """This wrapper's per-parameter state (copies), by parameter index, then ``state`` key."""
        return {}

    def _load_wrapper(self, values: dict[str, Any], per_param: dict[int, dict[str, Any]]) -> None:
        """Check, then restore, what the two methods above returned; on error raise and change nothing."""

    def _values_from_old_layout(
        self, state_dict: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """The wrapper's state from a state dict of the earlier ``{"optimizer": ..., ...}`` layout."""
        return {}, {}

    def state_dict(self) -> dict[str, Any]:
        """torch's two keys: the wrapped optimizer's ``state`` and ``param_groups``, with the wrapper's state.

        Optimizer-wide wrapper state (the loss scale and its counter) is a copy
        in every param group, per-parameter state (AGN's accumulators) sits
        beside the wrapped optimizer's slots, so tools that keep only
        ``state`` and ``param_groups`` (``torch.distributed.checkpoint``,
        frameworks) keep it too.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        inner = self._optimizer.state_dict()
        extra = self._wrapper_state()
        groups = [{**group, **{k: _copy(v) for k, v in extra.items()}} for group in inner["param_groups"]]
        state = dict(inner["state"])
        for index, values in self._wrapper_param_state().items():
            state[index] = {**state.get(index, {}), **values}
        self._mirror(extra)
        state_dict = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            # torch's contract: a hook may return a replacement.
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _mirror(self, extra: dict[str, Any]) -> None:
        """Copy the wrapper's group keys into the live param groups too.

        ``torch.distributed.checkpoint`` with ``flatten_optimizer_state_dict``
        rebuilds the groups from the keys the live groups hold. The values
        there are a snapshot, taken at construction and at every
        ``state_dict()``, ``load_state_dict()`` and ``add_param_group()``; the
        wrapper's own attributes (``loss_scale``, ``local_step``) are the truth.
        """
        for group in self.param_groups:
            group.update({k: _copy(v) for k, v in extra.items()})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (or the earlier ``{"optimizer": ...}`` layout); all or nothing."""
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"{type(self).__name__}.load_state_dict expects a dict, got {describe(state_dict)}"
            )
        state_dict = state_dict.copy()  # (as torch's: hooks may change it, the caller's stays)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if "optimizer" in state_dict and "param_groups" not in state_dict:
            inner = state_dict["optimizer"]
            extra, per_param = self._values_from_old_layout(state_dict)
        else:
            inner, extra, per_param = self._split(state_dict)
        previous = self._wrapper_state(), self._wrapper_param_state()
        self._load_wrapper(extra, per_param)
        try:
            self._optimizer.load_state_dict(inner)
        except Exception:
            self._load_wrapper(*previous)
            raise
        self._mirror(extra)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _split(
        self, state_dict: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[int, dict[str, Any]]]:
        """The wrapped optimizer's state dict, and this wrapper's state taken out of it."""
        cls = type(self).__name__
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or not groups or not isinstance(state, dict):
            raise ValueError(
                f"{cls}.load_state_dict expects the dict from its state_dict(), with 'state' and "
                f"'param_groups'; got keys {sorted(state_dict)}"
            )
        first = groups[0] if isinstance(groups[0], dict) else {}
        keys = self._wrapper_keys(first)
        missing = sorted(k for k in keys if k not in first)
        if missing:
            raise ValueError(
                f"{cls}: loaded param group 0 lacks this wrapper's state {missing}; "
                "was it saved from another optimizer?"
            )
        extra = {k: first[k] for k in keys}
        for i, group in enumerate(groups[1:], start=1):
            # (Kept in every group so that tools which save only the groups keep it: one state.)
            if not isinstance(group, dict):
                continue
            for key in sorted(keys):
                if key not in group or not _same_state(group[key], extra[key]):
                    found = repr(group[key]) if key in group else "nothing"
                    raise ValueError(
                        f"{cls}: loaded param group {i} holds {found} for {key!r} where group 0 holds "
                        f"{extra[key]!r}; this wrapper's state is one, kept alike in every group"
                    )
        groups = [{k: v for k, v in g.items() if k not in keys} if isinstance(g, dict) else g for g in groups]
        param_keys = self._wrapper_param_keys()
        # Saved parameter ids are ints from state_dict(), or names from DCP's
        # set_state_dict; either way the i-th id listed in the groups is parameter i.
        position = {
            pid: i
            for i, pid in enumerate(pid for g in groups if isinstance(g, dict) for pid in g.get("params", []))
        }
        per_param: dict[int, dict[str, Any]] = {}
        inner_state: dict[Any, Any] = {}
        for pid, values in state.items():
            if isinstance(values, dict) and param_keys and pid in position:
                per_param[position[pid]] = {k: v for k, v in values.items() if k in param_keys}
                values = {k: v for k, v in values.items() if k not in param_keys}
                if not values:
                    continue
            inner_state[pid] = values
        return {**state_dict, "state": inner_state, "param_groups": groups}, extra, per_param

    def _wrapper_keys(self, saved_group: dict[str, Any]) -> set[str]:
        """The keys of this wrapper's state in a saved param group (by default: those it saves)."""
        return set(self._wrapper_state())

    def _wrapper_param_keys(self) -> set[str]:
        """The ``state`` keys of :meth:`_wrapper_param_state`."""
        return {key for values in self._wrapper_param_state().values() for key in values}


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _same_state(a: Any, b: Any) -> bool:
    """Whether two loaded values of a wrapper's state are the same (tensors: same values)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and not a.is_meta
            and not b.is_meta
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # values that cannot be compared are not the same
        return False
