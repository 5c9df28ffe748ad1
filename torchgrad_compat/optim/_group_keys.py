"""Which param-group keys an optimizer reads, and the keys it refuses.

A group dict is what users copy from TF, Keras or torch code. TF's argument names move to the
keys the update reads (``learning_rate`` to ``lr``); a key this optimizer would silently not
read (``weight_decay``, ``eps``, a misspelled one) is refused by name, at construction and at
any later step that finds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .optimizer import Optimizer

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# The param-group keys of a LossScaleOptimizer's state (which it keeps in every group).
LOSS_SCALE_KEY_PREFIX = "loss_scale_"

# Param-group keys other optimizers read, which a group copied from their code may hold, and
# why the optimizers here do without them (see refuse_keys_it_would_not_read).
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


# This package's optimizer classes by name, each added as it is defined (see register_optimizer).
_LIBRARY_OPTIMIZERS: dict[str, type] = {}


def register_optimizer(cls: type) -> None:
    """Remember ``cls`` if it is one of this package's optimizers (``Optimizer.__init_subclass__``)."""
    if cls.__module__.startswith("torchgrad_compat.optim."):
        _LIBRARY_OPTIMIZERS[cls.__name__] = cls


def _library_hyper_keys() -> dict[str, str]:
    """Each group key and TF argument name of this package's optimizers: which of them have it."""
    return _hyper_keys_of(tuple(sorted(_LIBRARY_OPTIMIZERS.items())))


@functools.cache
def _hyper_keys_of(classes: tuple[tuple[str, type], ...]) -> dict[str, str]:
    holders: dict[str, list[str]] = {}
    for name, cls in classes:
        for spec in getattr(cls, "_hypers", ()):
            for key in {spec.key, spec.arg}:
                holders.setdefault(key, []).append(name)
    return {key: f"it is a hyperparameter of {', '.join(sorted(h))}" for key, h in holders.items()}


def rename_tf_keys(opt: Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """Move hyperparameters given under TF's argument names to their keys (``learning_rate`` -> ``lr``).

    A group dict is what users copy from TF code; a TF name torch does not
    know would otherwise sit unused beside the default.
    """
    for arg, key in tf_renames(type(opt)):
        if arg not in group:
            continue
        if key in group:
            raise ValueError(
                f"param group gives both {arg!r} (TensorFlow's name) and {key!r} "
                f"(its key in the group): {group[arg]!r} and {group[key]!r}; give one"
            )
        group[key] = group.pop(arg)
    return group


def tf_renames(cls: type[Optimizer]) -> tuple[tuple[str, str], ...]:
    """``(TF name, group key)`` of the hyperparameters whose key is not TF's name."""
    return tuple((spec.arg, spec.key) for spec in cls._hypers if spec.arg != spec.key)


def check_tf_names_written_since(opt: Optimizer, index: int, group: dict[str, Any]) -> None:
    """Refuse a TF name written into a group after it was added (``group["learning_rate"] = x``).

    TF's names are moved to their keys when a group is added or loaded; one
    written later would sit beside the key the update reads. Kept: a TF name
    that still holds the value given when the group was added or loaded, as
    ``ZeroRedundancyOptimizer`` copies its own group (built from the
    constructor's ``learning_rate=``) into this optimizer's before each step.
    """
    given = opt._tf_names_given.get(index, {})
    for arg, key in tf_renames(type(opt)):
        if arg not in group:
            continue
        value = group[arg]
        if arg in given and _same_given_value(value, given[arg]):
            given[arg] = value  # (the object seen now: the next step compares by identity)
            continue
        raise ValueError(
            f"{type(opt).__name__}: param group {index} key {arg!r} (got {value!r}) was written "
            f"after the group was added and would not be read: this optimizer reads {arg} from "
            f"{key!r} (now {group.get(key)!r}); write {key!r} instead"
        )


def refuse_keys_it_would_not_read(opt: Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
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
    cls = type(opt).__name__
    idle: list[str] = []
    own = {"params", *opt.defaults, *(spec.key for spec in opt._non_slot_ranges)}
    names = {*own, *(spec.arg for spec in opt._hypers)}
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


def recheck_group_keys(opt: Optimizer, index: int, group: dict[str, Any]) -> None:
    """At a step, check a group again if keys were added since (a training loop's
    ``group["weight_decay"] = wd``) or a foreign key kept for its value of 0 now asks for something."""
    seen = opt.__dict__.setdefault("_group_keys_seen", {})
    kept = seen.get(index)
    if kept is None or group.keys() != kept[0] or not all(_asks_for_nothing(group[k]) for k in kept[1]):
        seen[index] = (frozenset(group), refuse_keys_it_would_not_read(opt, group))


def with_named_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (an optimizer's ``__init__``) refusing a keyword it does not take with an error that
    says which of its arguments is meant: ``AdamOptimizer(params, lr=1e-3)``, as typed by someone
    coming from ``torch.optim.Adam``, is told that the argument is ``learning_rate``."""
    parameters = inspect.signature(init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return init
    accepted = [name for name in parameters if name != "self"]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in parameters:
                raise TypeError(_unknown_argument(f"{type(self).__name__}()", name, accepted))
        init(self, *args, **kwargs)

    return checked


def _unknown_argument(call: str, name: str, accepted: list[str]) -> str:
    said = f"{call} got an unexpected keyword argument {name!r}"
    if name == "lr" and "learning_rate" in accepted:
        return f"{said}: its name here is TensorFlow's, learning_rate (kept as group['lr'], as torch's)"
    if name == "betas" and "beta1" in accepted:
        return f"{said}: pass TensorFlow's beta1= and beta2= (a param group may give betas=(beta1, beta2))"
    target = _EQUIVALENT_KEYS.get(name)
    if target in accepted:
        return f"{said}: its name here is {target}{_EQUIVALENT_NOTES.get(name, '')}"
    if name in _FOREIGN_KEYS:
        return f"{said}: {_FOREIGN_KEYS[name]}"
    close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.75)
    if close:
        return f"{said}; did you mean {close[0]!r}?"
    return f"{said}; it takes {', '.join(accepted)}"
