"""The functional dispatch every update rule uses: its reference loop, its foreach path, or fused."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ._fused.run import FusedStep, run_fused


def pick_impl(
    single: Callable[..., None],
    multi: Callable[..., None],
    *,
    foreach: bool,
    params: list[Tensor],
    scratch: list[list[Tensor]] | None,
    count: int,
    fused: bool | FusedStep = False,
) -> Callable[..., None]:
    """An optimizer's functional dispatch: its reference loop, its foreach path bound to scratch, or fused.

    ``scratch`` holds ``count`` lists of tensors shaped like ``params`` for the
    foreach path's temporaries (:meth:`Optimizer._scratch` keeps them between
    steps); None makes fresh ones. ``fused`` runs the reference loop itself
    through ``torch.compile`` (see :func:`run_fused`): True, or what ``Optimizer._apply`` knows
    of the step (a :class:`FusedStep`).
    """
    if fused:
        return functools.partial(run_fused, single, fused if isinstance(fused, FusedStep) else None)
    if not foreach:
        return single
    if scratch is None:
        scratch = [[torch.empty_like(p) for p in params] for _ in range(count)]
    return functools.partial(multi, scratch=scratch)
