"""The base class of the TF v1 optimizers: TensorFlow's API on torch.optim's bookkeeping.

``Optimizer`` owns everything that is not update math: TF's ``compute_gradients`` /
``apply_gradients`` / ``minimize``, the update path both driving styles share, and
optimizer-wide ("non-slot") state. Each optimizer file owns only its hyperparameters, its slot
initial values and its update rule, reached through these hooks:

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
``ZeroRedundancyOptimizer``, Lightning) carries it. ``non_slot_state`` is the one
accessor; the hooks receive a dict of it and ``_apply`` writes it back.

The bookkeeping lives in modules of its own: hyperparameters (``_hyper``), group keys
(``_group_keys``), slots (``_slots``), state loads (``_state_dict``), checks (``_checks``),
numerics (``_numerics``), memory (``_memory``), metadata guards (``_census``), the fused
engine (``_fused``) and step replay (``_replay``).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .._torch_internals import called_from_dcp_init, default_foreach, sparse_rows, sparse_values
from ._census import kept_census
from ._checks import (
    GRAD_OF,
    _check_dtensor_grad,
    _check_fused_devices,
    _local_shards,
    _shared_kind,
    check_global_step,
    check_grad,
    check_unscalable,
    describe,
    grads_fit,
)
from ._fused.graphs import _apart_from_gradients
from ._fused.run import FusedStep, Unscaling
from ._group_keys import (
    check_tf_names_written_since,
    recheck_group_keys,
    refuse_keys_it_would_not_read,
    register_optimizer,
    rename_tf_keys,
    tf_renames,
    with_named_arguments,
)
from ._hyper import (
    Flag,
    Hyper,
    HyperScalars,
    _any_callable,
    _check_path_flags,
    _evaluate,
)
from ._memory import (
    _chunks,
    is_expanded,
    scratch,
)
from ._numerics import _HALF_DTYPES, _VALID_DTYPES, _compute_dtype, _working_precision, summed_rows
from ._replay import _StepReplay
from ._slots import check_slots_follow_params, create_slots
from ._state_dict import _merge_old_non_slot, check_live_non_slot, check_loaded_non_slot, validate_state_dict
from ._tf_api import GATE_GRAPH, GATE_NONE, GATE_OP, compute_gradients, hooked_update, trainable

if TYPE_CHECKING:
    from ._census import SameMeta

# What torch's ``ParamsT`` accepts (tensors, param-group dicts, or ``named_parameters()``'s pairs),
# as one iterable of a union rather than a union of iterables: against the latter mypy cannot
# infer a list of param-group dicts whose values differ in type, the usual way of writing groups.
Params: TypeAlias = Iterable[Tensor | dict[str, Any] | tuple[str, Tensor]]


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

    GATE_NONE: ClassVar[int] = GATE_NONE
    GATE_OP: ClassVar[int] = GATE_OP
    GATE_GRAPH: ClassVar[int] = GATE_GRAPH

    _hypers: ClassVar[tuple[Hyper | Flag, ...]] = ()
    _slots: ClassVar[tuple[str, ...]] = ()
    # TF's slot names in the order TF creates them (a name-based checkpoint numbers a variable's
    # slots so: ``v/Adam`` is ``m``, ``v/Adam_1`` is ``v``), and TF's optimizer-wide variables
    # saved beside the model's; read by torchgrad_compat.checkpoint. A slot a group's options
    # leave out (RMSProp's ``mg`` when not centered) is skipped in the numbering.
    tf_slot_order: ClassVar[tuple[str, ...]] = ()
    tf_non_slot_names: ClassVar[tuple[str, ...]] = ()
    # TF sums duplicate sparse indices before the update; GradientDescent does not.
    _coalesce_sparse: ClassVar[bool] = True
    # Ranges of loaded non-slot state, by key (Adam's beta powers lie in [0, 1)).
    _non_slot_ranges: ClassVar[tuple[Hyper, ...]] = ()
    # Instance attributes kept by pickling and deepcopy, beyond torch's three.
    _pickled_attributes: ClassVar[tuple[str, ...]] = ("_non_slot_keys", "_tf_names_given")

    def __init__(self, params: Params, defaults: dict[str, Any]):
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors "
                f"or dicts, but got {torch.typename(params)}"
            )
        # The group keys of the optimizer-wide state (the same in every group), from _init_non_slot.
        self._non_slot_keys: tuple[str, ...] = ()
        # Per group index, the values given under TF's names when the group was added or loaded
        # (``check_tf_names_written_since``).
        self._tf_names_given: dict[int, dict[str, Any]] = {}
        defaults = {"foreach": None, "fused": None, **defaults}
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        # torch pickles only defaults, state and param_groups (its hooks may not
        # pickle); the attributes a subclass names travel too.
        return {**super().__getstate__(), **{name: getattr(self, name) for name in self._pickled_attributes}}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_optimizer(cls)
        if "__init__" in vars(cls):
            cls.__init__ = with_named_arguments(cls.__init__)  # type: ignore[method-assign]

    @classmethod
    def _overrides(cls, hook: str) -> bool:
        """Whether ``cls`` replaces the base class's ``hook`` (a rule with slots has its own
        ``_init_slots``)."""
        return getattr(cls, hook) is not getattr(Optimizer, hook)

    @classmethod
    def _own_rule(cls) -> bool:
        """Whether every class of ``cls``'s MRO below :class:`Optimizer` is this package's own (no
        user subclass whose update or slot creation could replace a gradient)."""
        return own_update(cls)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the group's hyperparameters and parameters, then add it (as torch does)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        given = {arg: param_group[arg] for arg, _ in tf_renames(type(self)) if arg in param_group}
        group = rename_tf_keys(self, dict(param_group))
        refuse_keys_it_would_not_read(self, group)
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
            if isinstance(p, Tensor) and p.layout == torch.strided and is_expanded(p):
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
        """Remember the non-slot tensors this optimizer put in ``group`` (see ``check_live_non_slot``)."""
        written = self.__dict__.setdefault("_written_non_slot", {})
        for key in self._non_slot_keys:
            written[index, key] = group[key]

    def non_slot_state(self, group: dict[str, Any]) -> dict[str, Tensor]:
        """The optimizer-wide ("non-slot") state of ``group``, by TF's names (Adam's
        ``beta1_power``/``beta2_power``); it lives in the group dict, and this is its one accessor."""
        return {key: group[key] for key in self._non_slot_keys}

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
    def slot_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The slots the variables of ``group`` get (RMSProp's ``mg`` only when centered)."""
        return self._slots

    def initial_slots(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """The slots ``p`` would get at its first update in ``group``, with their initial values (as
        TF's slot creation makes them), not stored; the TF checkpoint code writes them for
        variables that never stepped."""
        return self._init_slots(group, p)

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
        path: tuple[bool, FusedStep | None],
    ) -> None:
        """Update ``params`` (one device and dtype) from ``grads``. ``path``: ``(foreach, fused)``,
        the update path :meth:`_apply` chose, to hand the rule's functional form (``fused`` is
        what the step knows for the fused kernels, or None)."""
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
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grads_checked: tuple[torch.device, torch.dtype] | bool = False,
        unscaling: Unscaling | None = None,
    ) -> Any:
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

        Two keyword arguments serve wrappers that handle the gradients first
        (``LossScaleOptimizer``), as ``grad_scale`` and ``found_inf`` serve torch's
        ``GradScaler``:

        - ``grads_checked``: the caller has just checked every ``p.grad`` against its
          parameter as this call would, and nothing that could replace one runs in
          between (no step pre-hook): True, or the one device and dtype it found every
          parameter and gradient to have. The check (about 0.5 ms per 1000 gradients of
          host time) is not made twice.
        - ``unscaling``: every ``p.grad`` is the gradient times a loss scale, and the fused
          kernels multiply each by ``unscaling.inv_scale`` as they read it (writing it back
          unscaled) instead of a pass of its own; ``unscaling.started`` tells the caller,
          after an error, whether some were. Every group must be ``fused``, every gradient dense,
          float32 or float64, on the CPU and a tensor of its own (each is multiplied in place);
          that no two gradients are overlapping views of one buffer is the caller's to check
          (``LossScaleOptimizer`` does).
        """
        if unscaling is not None and not all(group.get("fused") for group in self.param_groups):
            raise ValueError(
                f"{type(self).__name__}.step(unscaling=...): every param group must be fused "
                "(fused=True), whose kernels unscale the gradients; unscale them before step() instead"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Under the caller's torch.compile, no replay, census or kept metadata: dynamo traces the
        # checks and the update as plain ops (what is kept would only guard or break its graph).
        compiling = torch.compiler.is_compiling()
        # (DCP's first step takes the whole path.)
        replay = None if compiling else self.__dict__.get("_step_replay")
        if replay is not None and not called_from_dcp_init() and replay.run(self, unscaling):
            return loss
        grouped: dict[int, list[tuple[Tensor, Tensor]]] = {}
        lists: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        kinds: dict[int, tuple[torch.device, torch.dtype] | None] = {}
        shapes: dict[int, list[torch.Size]] = {}
        census_of: dict[int, SameMeta] = {}
        checked = grads_checked
        census = not compiling
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            # (Dynamo traces a comprehension, and breaks the graph at `map` over attrgetter.)
            grads = [p.grad for p in params] if compiling else list(map(GRAD_OF, params))
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
            if kind is None and not grads_fit(grads, params):
                for g, p in grouped[gi]:
                    check_grad(type(self).__name__, g, p)
            if census:
                kinds[gi] = kind  # (None: not one kind, which _apply need not find out again)
        if grouped:
            if unscaling is not None:
                check_unscalable(type(self).__name__, kinds, lists)
            if called_from_dcp_init():
                create_slots(self, grouped)
            else:
                self._apply(grouped, kinds, shapes, lists, census_of, unscaling)
        return loss

    def _census(
        self, index: int, params: list[Tensor], grads: list[Tensor]
    ) -> tuple[list[torch.Size], tuple[torch.device, torch.dtype] | None, SameMeta | None]:
        """The shapes of a group's parameters and :func:`_shared_kind` of its pairs, and the kept
        metadata of both that they were found with (None where none is kept).

        Kept from the last step when every parameter and gradient has the metadata
        it had then (:class:`SameMeta`): a training loop's do, step after step.
        """
        return kept_census(self.__dict__.setdefault("_census_kept", {}), index, params, grads)

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
            trainable(self.param_groups) if var_list is None else var_list,
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
            check_global_step(global_step)
        present = [(g, v) for g, v in pairs if g is not None]
        if not present:
            raise ValueError(f"No gradients provided for any variable: {[describe(v) for _, v in pairs]}.")
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
                f"support gradients, between variables {[describe(v) for _, v in grads_and_vars]} "
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
            names.update(self.slot_names(group))
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
            non_slot = self.non_slot_state(group)
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
        validate_state_dict(self, state_dict)
        current = [self.non_slot_state(group) for group in self.param_groups]
        super().load_state_dict(state_dict)
        # The loaded tensors, copied, in the kind and on the device this optimizer keeps them.
        for index, (group, ns) in enumerate(zip(self.param_groups, current, strict=True)):
            for key, value in ns.items():
                group[key] = group[key].detach().to(device=value.device, dtype=value.dtype).clone()
            self._mark_written(index, group)
            # A saved group may hold a TF name beside its key (one saved from ZeroRedundancyOptimizer's
            # local optimizer): the key's loaded value is the one read, and the name stays a copy.
            self._tf_names_given[index] = {
                arg: group[arg] for arg, _ in tf_renames(type(self)) if arg in group
            }

    def check_loaded_non_slot(self, name: str, key: str, value: Any, current: Tensor) -> None:
        """Check a loaded value of the non-slot state ``key`` (``name`` in errors) before it is
        stored: of ``current``'s kind and shape, finite, in its range (Adam's beta powers in
        [0, 1)); as ``load_state_dict`` checks it. Used by ``torchgrad_compat.checkpoint``."""
        check_loaded_non_slot(self, name, key, value, current)

    # ------------------------------------------------------------------ the update path
    def _use_foreach(self, group: dict[str, Any], params: list[Tensor]) -> bool:
        foreach = group["foreach"]
        if foreach is None:
            foreach = default_foreach(params)
        return bool(foreach)

    def _validate_pairs(self, pairs: list[tuple[Any, Any]]) -> dict[int, list[tuple[Tensor, Tensor]]]:
        """Check ``(grad, var)`` pairs from the caller and group them by param group index."""
        where = {id(p): i for i, group in enumerate(self.param_groups) for p in group["params"]}
        cls = type(self).__name__
        grouped: dict[int, list[tuple[Tensor, Tensor]]] = {}
        seen: set[int] = set()
        for g, p in pairs:
            if not isinstance(p, Tensor) or id(p) not in where:
                raise ValueError(f"{cls} does not manage variable {describe(p)}; pass it in params")
            if id(p) in seen:
                raise ValueError(f"variable {describe(p)} appears more than once in grads_and_vars")
            seen.add(id(p))
            check_grad(cls, g, p)
            grouped.setdefault(where[id(p)], []).append((g, p))
        return grouped

    def _scratch(self, like: list[Tensor], count: int) -> list[list[Tensor]]:
        """``count`` lists of tensors shaped like ``like``, for a foreach update's temporaries (see
        :func:`scratch`)."""
        return scratch(self, like, count)

    @torch.no_grad()
    def _apply(
        self,
        grouped: dict[int, list[tuple[Tensor, Tensor]]],
        kinds: dict[int, tuple[torch.device, torch.dtype] | None] | None = None,
        shapes: dict[int, list[torch.Size]] | None = None,
        lists: dict[int, tuple[list[Tensor], list[Tensor]]] | None = None,
        census_of: dict[int, SameMeta] | None = None,
        unscaling: Unscaling | None = None,
    ) -> None:
        """Update each group from its checked ``(grad, param)`` pairs, then run ``_finish`` once per group.

        ``kinds``: per group, the one device and dtype that the caller found every pair
        to have (:func:`_shared_kind`), or None where it found none; groups it did not
        look at are looked at here. ``shapes``: per group, the shapes of its pairs'
        parameters, where the caller has read them. ``lists``: per group, its pairs'
        parameters and gradients as two lists, where the caller has them.
        ``census_of``: per group, the kept metadata that step()'s census found them to
        have (see :meth:`_census`). ``unscaling``: the fused kernels unscale the gradients (see
        :meth:`step`).
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
                check_live_non_slot(self, i, group)
                recheck_group_keys(self, i, group)
                check_tf_names_written_since(self, i, group)
            slot_records = check_slots_follow_params(self, found, shapes, grouped)
        else:
            slot_records = {}
        slots_of = create_slots(self, grouped, evaluated)
        state = self.state
        has_slots = self._overrides("_init_slots")
        # Where nothing could have changed a parameter or gradient since step()'s census (no
        # callable hyperparameter ran; the update is this package's own code), the fused plan
        # need not check them again.
        census_of = (
            census_of
            if census_of and own_update(type(self)) and not _any_callable(self.param_groups, self._hypers)
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
        # (Not under the caller's torch.compile, where the rules run as the loop.)
        in_step = not torch.compiler.is_compiling()
        for gi, (group, values) in enumerate(zip(self.param_groups, evaluated, strict=True)):
            non_slot = self.non_slot_state(group)
            for (device, dtype), (bucket_params, bucket_grads) in dense.get(gi, {}).items():
                hyper = HyperScalars(values, _compute_dtype(dtype), device)
                # The fused kernel makes one pass over the whole bucket (see run_fused), but
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
                    fused = None
                    if group.get("fused"):
                        held = (
                            (census_of[gi], params, grads, slot_records[gi])
                            if gi in census_of and gi in slot_records and gi in in_pair_order and whole
                            else None
                        )
                        fused = FusedStep(in_step, held, calls, unscaling)
                    self._update_bucket(group, params, grads, slots, non_slot, hyper, fused)
            for g, p in sparse.get(gi, []):
                if self._coalesce_sparse:
                    indices, grad_values = summed_rows(g)
                else:
                    indices, grad_values = sparse_rows(g), sparse_values(g)
                hyper = HyperScalars(values, _compute_dtype(p.dtype), p.device)
                with _working_precision([p], [grad_values], [self.state.get(p, {})]) as (ps, gs, ss):
                    self._apply_sparse(group, ps[0], indices, gs[0], ss[0], non_slot, hyper)
            self._end_group(gi, group, non_slot, values)
        if calls is not None:
            replay = _StepReplay.of(self, calls, lists or {}, census_of, slot_records, slots_of, evaluated)
            if replay is not None:
                self.__dict__["_step_replay"] = replay

    def _update_bucket(self, group, params, grads, slots, non_slot, hyper, fused: FusedStep | None) -> None:
        """Update one bucket of a group (parameters of one device and dtype) by the rule. A replayed
        step updates through it and :meth:`_end_group`: every scalar a rule computes is computed afresh."""
        path = (False, fused) if fused is not None else (self._use_foreach(group, params), None)
        if params[0].dtype not in _HALF_DTYPES:  # (no working copies to make: no context to enter)
            return self._apply_dense(group, params, grads, slots, non_slot, hyper, path)
        with _working_precision(params, grads, slots) as (ps, gs, ss):
            self._apply_dense(group, ps, gs, ss, non_slot, hyper, path)

    def _end_group(self, index: int, group: dict[str, Any], non_slot: dict[str, Tensor], values) -> None:
        """End a group's step: the rule's ``_finish`` (Adam's beta powers), its non-slot state
        written back to the group."""
        self._finish(group, non_slot, values)
        group.update(non_slot)
        self._mark_written(index, group)


@functools.cache
def own_update(cls: type) -> bool:
    """Whether every class of ``cls``'s MRO below :class:`Optimizer` is this package's own (no
    user subclass whose update or slot creation could replace a gradient)."""
    mro = cls.__mro__
    return all(c.__module__.startswith("torchgrad_compat.") for c in mro[: mro.index(Optimizer)])
