"""Every private torch API this package relies on, in one place.

Each entry says what it serves and what happens when a torch release changes it: the numbers
stay right (a slower path is taken, or a check is made the long way), or, where no fallback
exists, the import of this module fails naming the API. ``tests/test_torch_internals.py`` checks
each one against the installed torch and names the one a release has changed.

``torch._foreach_*`` ops are not listed: they are the multi-tensor API torch's own optimizers
are written in, called by the rules' foreach paths as torch's are.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _default_to_fused_or_foreach, _global_optimizer_pre_hooks

# ---------------------------------------------------------------- tensors and autograd


# ``version(t)``: ``t._version``, autograd's count of in-place writes to ``t`` (kept tensors are
# trusted only while it stands still). An attrgetter, which ``map`` calls without a Python frame.
version: Callable[[Tensor], int] = operator.attrgetter("_version")

# ``set_grad_mode(enabled)``: grad mode on or off for this thread, as ``torch.set_grad_enabled``
# sets it (``torch._C._set_grad_enabled``, without the context manager object that function
# makes; that function where this torch lacks it).
set_grad_mode: Callable[[bool], Any] = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)


def sparse_rows(g: Tensor) -> Tensor:
    """The row indices of a row-sparse COO tensor, coalesced or not (``g._indices()[0]``:
    ``indices()`` refuses an uncoalesced tensor, whose duplicates TF sums in its own order)."""
    return g._indices()[0]


def sparse_values(g: Tensor) -> Tensor:
    """The values of a COO tensor, coalesced or not (``g._values()``)."""
    return g._values()


def sparse_indices(g: Tensor) -> Tensor:
    """The index matrix of a COO tensor, coalesced or not (``g._indices()``)."""
    return g._indices()


def sparse_nnz(g: Tensor) -> int:
    """The number of entries of a COO tensor, coalesced or not (``g._nnz()``)."""
    return g._nnz()


def current_graph_task_id() -> int | None:
    """The running backward pass (autograd's graph task), or None where torch does not say
    (``torch._C._current_graph_task_id``; without it the caller cannot tell passes apart)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else current()


def bump_versions(tensors: list[Tensor]) -> None:
    """Count an in-place write to each of ``tensors`` in autograd's version counters
    (``torch.autograd.graph.increment_version``), for writes autograd did not see."""
    torch.autograd.graph.increment_version(tensors)


# ---------------------------------------------------------------- torch.distributed.rpc


def rpc_agent_set() -> bool:
    """Whether this process has started torch's RPC (``rpc.api._is_current_rpc_agent_set``)."""
    from torch.distributed.rpc import api

    return api._is_current_rpc_agent_set()


def rpc_worker_names() -> list[str]:
    """The names of every member of this process's static RPC group
    (``rpc.api._get_current_rpc_agent().get_worker_infos()``)."""
    from torch.distributed.rpc import api

    return [info.name for info in api._get_current_rpc_agent().get_worker_infos()]


# ---------------------------------------------------------------- torch.optim


def default_foreach(params: list[Tensor]) -> bool:
    """torch.optim's default for ``foreach=None`` over ``params`` (``_default_to_fused_or_foreach``)."""
    _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(foreach)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer`` stepped (``_opt_called``, which they read to
    warn about a scheduler stepped first)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def no_step_pre_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs no pre-hook (its own or a global one) to change a gradient
    (``_optimizer_step_pre_hooks``, ``_global_optimizer_pre_hooks``)."""
    return not optimizer._optimizer_step_pre_hooks and not _global_optimizer_pre_hooks


# ---------------------------------------------------------------- torch.amp


def non_finite_check_and_unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """GradScaler's kernel: ``grads *= inv_scale`` in place, ``found_inf`` set to 1 where some
    element is not finite (``torch._amp_foreach_non_finite_check_and_unscale_``)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def update_scale_(
    scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth: float, backoff: float, interval: int
) -> Tensor:
    """GradScaler's update of a dynamic scale, on the device (``torch._amp_update_scale_``)."""
    return torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval)


# ---------------------------------------------------------------- tracing and dispatch


def tracing_or_transforming() -> bool:
    """Whether ops run under ``torch.compile``'s tracing, a dispatch mode (fake or meta tensors) or
    a functorch transform (whose tensors are wrappers)."""
    return (
        torch.compiler.is_compiling()
        or bool(torch._C._len_torch_dispatch_stack())
        or torch._C._functorch.peek_interpreter_stack() is not None
    )


def dispatching_or_transforming() -> bool:
    """Whether ops run under a dispatch mode or a functorch transform (:func:`tracing_or_transforming`
    for a caller that knows it runs outside ``torch.compile``)."""
    return (
        bool(torch._C._len_torch_dispatch_stack()) or torch._C._functorch.peek_interpreter_stack() is not None
    )


def called_from_dcp_init() -> bool:
    """Whether ``torch.distributed.checkpoint``'s ``_init_optim_state`` is the caller (a few frames up).

    Wrappers' ``step`` and torch's step hooks may sit in between. Should torch
    rename the function, its zero-gradient step becomes an ordinary step again:
    Ftrl then refuses its ``lr`` of 0 (loudly), and the other optimizers take
    the step, whose state the checkpoint's then overwrites. Under
    ``torch.compile`` nothing is looked up (DCP does not compile its call).
    """
    if DCP_STATE_DICT not in sys.modules or torch.compiler.is_compiling():
        return False
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_init_optim_state" and frame.f_globals.get("__name__") == DCP_STATE_DICT:
            return True
        frame = frame.f_back
    return False


DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def triton_options(chunk: int) -> dict[str, Any]:
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
    # without them gets triton_rounds_as_eager's warning instead.
    known = inductor_options()
    options: dict[str, Any] = {}
    for name, value in (
        ("emulate_precision_casts", True),
        ("combo_kernels", True),
        ("eager_numerics.division_rounding", True),
        ("eager_numerics.disable_ftz", True),
        ("emulate_divison_rounding", True),
        # One combo kernel for the whole chunk (the default groups 8), without autotuning
        # each grouping at compile time.
        ("combo_kernel_max_num_nodes", chunk),
        ("combo_kernels_autotune", 0),
    ):
        if name in known:
            options[name] = value
    return options


def triton_rounds_as_eager(options: dict[str, Any]) -> bool:
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


@functools.cache
def tensor_guards() -> Any:
    """dynamo's ``TensorGuards`` where it tells apart what :class:`SameMeta` relies on, else None.

    Tried on ordinary tensors whatever the caller's mode (a first step may run under
    inference mode, whose tensors would all look alike).
    """
    try:
        with torch.inference_mode(False):
            return tensor_guards_tried()
    except Exception:  # absent or changed in this torch release
        return None


def tensor_guards_tried() -> Any:
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


# ---------------------------------------------------------------- Inductor and dynamo (the fused engine)


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any]) -> Any:
    """Inductor's compile of a captured graph, as a ``torch.compile`` backend calls it
    (``torch._inductor.compile``)."""
    return torch._inductor.compile(gm, example_inputs, options=options)


def compiled_fx_graph_type() -> type | None:
    """Inductor's ``CompiledFxGraph`` (``torch._inductor.output_code``), whose ``current_callable``
    is the generated ``call``; None where this torch has none (the kernels are then called
    through AOT autograd's wrappers, with more host time)."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return None
    return CompiledFxGraph


@contextlib.contextmanager
def fused_compile_settings(graph_limit: int) -> Iterator[None]:
    """dynamo's settings for a fused kernel's compile: no duck shaping (tensors that share a size
    get symbols of their own, ``torch.fx.experimental._config.use_duck_shape``) and a graph limit
    per function of ``graph_limit`` (``recompile_limit``)."""
    with (
        torch.fx.experimental._config.patch(use_duck_shape=False),
        torch._dynamo.config.patch(recompile_limit=graph_limit),
    ):
        yield


def inductor_options() -> dict[str, Any]:
    """Every Inductor option this torch knows, with its value (``torch._inductor.config``)."""
    return torch._inductor.config.get_config_copy()
