"""TF's API beside torch's: ``compute_gradients`` (gradients of a loss for a list of variables,
as ``(grad, var)`` pairs, on ``torch.autograd``) and ``apply_gradients`` as torch's hooks see a
``step`` (shared by the optimizers and their wrappers)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .._torch_internals import mark_stepped
from ..gradients import check_aggregation_method, gradients
from ._checks import describe
from ._numerics import _VALID_DTYPES

# TF's gate_gradients values (``Optimizer.GATE_NONE`` ...): validated, without effect in eager torch.
GATE_NONE = 0
GATE_OP = 1
GATE_GRAPH = 2


def trainable(param_groups: list[dict[str, Any]]) -> list[Tensor]:
    """The parameters that require grad: TF's default ``var_list``, its trainable variables."""
    return [p for group in param_groups for p in group["params"] if p.requires_grad]


def compute_gradients(
    loss: Tensor | Callable[[], Tensor],
    var_list: Sequence[Tensor],
    *,
    gate_gradients: int = GATE_OP,
    aggregation_method: int | None = None,
    colocate_gradients_with_ops: bool = False,
    grad_loss: Tensor | None = None,
) -> list[tuple[Tensor | None, Tensor]]:
    """TF's ``Optimizer.compute_gradients`` for an explicit ``var_list``; the wrappers share it."""
    if gate_gradients not in (GATE_NONE, GATE_OP, GATE_GRAPH):
        raise ValueError(
            "gate_gradients must be one of: Optimizer.GATE_NONE, Optimizer.GATE_OP, "
            f"Optimizer.GATE_GRAPH. Not {gate_gradients!r}"
        )
    check_aggregation_method(aggregation_method)
    if isinstance(var_list, Tensor):
        # Iterating a tensor yields its rows, which are not leaves of the loss's graph.
        raise TypeError(
            f"var_list must be a list of tensors, got a single tensor {describe(var_list)}; pass [tensor]"
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
            raise ValueError(f"var_list[{i}] must be a tensor that requires grad, got {describe(v)}")
        if v.dtype not in _VALID_DTYPES:
            # TF's _assert_valid_dtypes: its optimizers take floating variables only.
            raise ValueError(
                f"var_list[{i}] has dtype {v.dtype}; the optimizers take {[str(d) for d in _VALID_DTYPES]}"
            )
    if grad_loss is not None and (not isinstance(grad_loss, Tensor) or grad_loss.shape != loss.shape):
        raise ValueError(
            f"grad_loss must be a tensor of the loss's shape {tuple(loss.shape)}, got {describe(grad_loss)}"
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
        gate_gradients=gate_gradients == GATE_OP,
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
        mark_stepped(self)  # (read by torch.optim.lr_scheduler)
        return hooked(self, *args, **kwargs)

    return wrapper
