"""The functional form of every update rule, built by one helper from its reference loop and foreach path."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._fused.run import FusedStep, run_fused

__all__ = ["ScratchSource", "functional"]

# Where the foreach path's temporaries come from besides lists given outright: a function
# (params, count) -> count lists shaped like params (an optimizer passes its ``_scratch``).
ScratchSource = Callable[[list[Tensor], int], list[list[Tensor]]]

# Shared by every rule's functional form, as torch.optim shares ``_foreach_doc``/``_fused_doc``.
_foreach_doc = """foreach: True runs the multi-tensor path (``torch._foreach_*`` ops over whole
        lists), False the reference loop, one tensor at a time."""
_fused_doc = """fused: run the reference loop through kernels torch.compile generates, one
        pass over each parameter, its gradient and its slots (CPU and CUDA; see
        docs/fused.md); it takes precedence over ``foreach``."""
_scratch_doc = """scratch: the foreach path's temporaries, {count} of tensors shaped like
        ``params``, or a function ``(params, count)`` that returns them (an optimizer
        passes its own, which keeps them between steps); None allocates them for
        this call. The reference loop and the fused path ignore it."""
_COUNT_WORDS = {1: "one list", 2: "two lists", 3: "three lists"}


def functional(
    single: Callable[..., None],
    multi: Callable[..., None],
    *,
    scratch: int | Callable[..., int],
    doc: str,
) -> Callable[..., None]:
    """The public functional form of an update rule: its reference loop, its foreach path, or fused.

    ``single`` (``_single_tensor_<name>``) is the reference loop; its
    arguments, lists then keyword-only scalars, are the functional form's,
    followed by ``foreach``, ``fused`` and ``scratch``. ``multi`` takes the
    same arguments and ``scratch``, that many lists of temporaries: an int, or
    a function of the scalars (by keyword) where the count depends on them.
    ``doc`` describes the rule's arguments; the foreach/fused/scratch
    paragraphs are appended. ``fused`` runs ``single`` through
    :func:`run_fused`: True, or what ``Optimizer._apply`` knows of the step (a
    :class:`FusedStep`).
    """
    prefix = "_single_tensor_"
    if not single.__name__.startswith(prefix):
        raise ValueError(
            f"functional: the reference loop must be named {prefix}<name>, got {single.__name__!r}"
        )
    name = single.__name__.removeprefix(prefix)
    signature = inspect.signature(single)
    list_names = [n for n, p in signature.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    scalar_names = frozenset(n for n, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY)
    count = scratch

    def rule(
        *lists: list[Tensor],
        foreach: bool,
        fused: bool | FusedStep | None = False,
        scratch: list[list[Tensor]] | ScratchSource | None = None,
        **scalars: Any,
    ) -> None:
        # *lists/**scalars accept anything: a call that does not give the reference loop's
        # lists by position and its scalars by name is bound to its signature, which names
        # what is missing or unknown (cheaper than binding every step).
        if len(lists) != len(list_names) or scalars.keys() != scalar_names:
            lists, scalars = _bind(name, signature, list_names, lists, scalars)
        if fused:
            run_fused(single, fused if isinstance(fused, FusedStep) else None, *lists, **scalars)
        elif not foreach:
            single(*lists, **scalars)
        else:
            n = count if isinstance(count, int) else count(**scalars)
            multi(*lists, **scalars, scratch=_temporaries(name, lists[0], n, scratch))

    rule.__name__ = rule.__qualname__ = name
    rule.__module__ = single.__module__
    rule.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[
            *signature.parameters.values(),
            inspect.Parameter("foreach", inspect.Parameter.KEYWORD_ONLY, annotation="bool"),
            inspect.Parameter("fused", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool"),
            inspect.Parameter(
                "scratch",
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation="list[list[Tensor]] | ScratchSource | None",
            ),
        ],
        return_annotation="None",
    )
    words = (
        _COUNT_WORDS.get(count, f"{count} lists")
        if isinstance(count, int)
        else "lists (as many as described above)"
    )
    paths = "\n    ".join((_foreach_doc, _fused_doc, _scratch_doc.format(count=words)))
    rule.__doc__ = f"{inspect.cleandoc(doc)}\n\nArgs:\n    {paths}\n"
    return rule


def _bind(
    name: str,
    signature: inspect.Signature,
    list_names: list[str],
    lists: tuple[Any, ...],
    scalars: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``lists`` and ``scalars`` as the reference loop takes them, from a call that named lists by
    keyword; a missing or unknown argument is a TypeError naming the functional form."""
    try:
        bound = signature.bind(*lists, **scalars)
    except TypeError as e:
        raise TypeError(f"{name}(): {e}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    return tuple(arguments.pop(n) for n in list_names), arguments


def _temporaries(
    name: str, params: list[Tensor], count: int, scratch: list[list[Tensor]] | ScratchSource | None
) -> list[list[Tensor]]:
    if scratch is None:
        return [[torch.empty_like(p) for p in params] for _ in range(count)]
    if callable(scratch):
        return scratch(params, count)
    if len(scratch) != count:
        raise ValueError(f"{name}: the foreach path needs {count} scratch lists, got {len(scratch)}")
    return scratch
