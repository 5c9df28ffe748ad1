"""Each private torch API of ``torchgrad_compat._torch_internals``, checked against the installed torch.

A failure names the API a torch release has changed, and what of the package it serves. The
package itself does not fail with it where a fallback exists (a slower path, or a check made the
long way); these tests fail all the same, so that the change is seen.
"""

from __future__ import annotations

import inspect
import sys
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import torchgrad_compat._torch_internals as internals
from torchgrad_compat.optim import AdamOptimizer, GradientDescentOptimizer


def _named(api: str, serves: str) -> str:
    return f"torch {torch.__version__} changed {api}, which {serves}"


def test_version_counter_counts_in_place_writes():
    t = torch.zeros(3)
    before = internals.version(t)
    t.add_(1)
    assert internals.version(t) == before + 1, _named("Tensor._version", "kept hyperparameter tensors trust")
    internals.bump_versions([t])
    assert internals.version(t) == before + 2, _named(
        "torch.autograd.graph.increment_version", "the fused kernels' writes report to autograd through"
    )


def test_sparse_accessors_read_uncoalesced_tensors_as_given():
    g = torch.sparse_coo_tensor(torch.tensor([[2, 0, 2]]), torch.tensor([[1.0], [2.0], [3.0]]), (4, 1))
    assert not g.is_coalesced()
    what = "TF-ordered sums of duplicate sparse rows read"
    assert internals.sparse_rows(g).tolist() == [2, 0, 2], _named("Tensor._indices", what)
    assert internals.sparse_indices(g).tolist() == [[2, 0, 2]], _named("Tensor._indices", what)
    assert internals.sparse_values(g).flatten().tolist() == [1.0, 2.0, 3.0], _named("Tensor._values", what)
    assert internals.sparse_nnz(g) == 3, _named("Tensor._nnz", "CrossShardOptimizer's sparse sums read")


def test_current_graph_task_id_tells_a_backward_pass():
    seen = []
    w = torch.ones(2, requires_grad=True)
    w.register_hook(lambda g: seen.append(internals.current_graph_task_id()))
    (w * 2).sum().backward()
    assert seen and seen[0] is not None, _named(
        "torch._C._current_graph_task_id", "CrossShardOptimizer's overlapped reduction tells passes apart by"
    )
    assert internals.current_graph_task_id() in (None, -1), "outside a backward pass there is no graph task"


def test_default_foreach_is_torch_optims_choice():
    params = [torch.zeros(2)]
    assert internals.default_foreach(params) is False, _named(
        "torch.optim.optimizer._default_to_fused_or_foreach", "foreach=None picks the update path by"
    )


def test_a_stepped_optimizer_keeps_the_scheduler_quiet():
    w = torch.nn.Parameter(torch.ones(2))
    opt = GradientDescentOptimizer([w], 0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    w.grad = torch.ones(2)
    opt.apply_gradients([(w.grad, w)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            scheduler.step()
        except UserWarning as warning:
            pytest.fail(_named("Optimizer._opt_called", f"apply_gradients tells LR schedulers by: {warning}"))


def test_step_pre_hooks_are_seen():
    w = torch.nn.Parameter(torch.ones(2))
    opt = GradientDescentOptimizer([w], 0.1)
    assert internals.no_step_pre_hooks(opt)
    handle = opt.register_step_pre_hook(lambda *args: None)
    assert not internals.no_step_pre_hooks(opt), _named(
        "Optimizer._optimizer_step_pre_hooks", "LossScaleOptimizer's kept gradient check depends on"
    )
    handle.remove()
    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        assert not internals.no_step_pre_hooks(opt), _named(
            "torch.optim.optimizer._global_optimizer_pre_hooks",
            "LossScaleOptimizer's kept gradient check depends on",
        )
    finally:
        handle.remove()


def test_amp_kernels_unscale_and_update_as_gradscaler():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    found, inv = torch.zeros(1), torch.tensor(0.5)
    internals.non_finite_check_and_unscale_(grads, found, inv)
    what = "LossScaleOptimizer's check and unscale"
    assert grads[0].tolist() == [1.0, 2.0] and found.item() == 1.0, _named(
        "torch._amp_foreach_non_finite_check_and_unscale_", what
    )
    scale, tracker = torch.tensor(8.0), torch.zeros((), dtype=torch.int32)
    internals.update_scale_(scale, tracker, torch.zeros(1), 2.0, 0.5, 1)
    assert scale.item() == 16.0, _named("torch._amp_update_scale_", "DynamicLossScale's update runs")


@pytest.mark.parametrize("check", ["tracing_or_transforming", "dispatching_or_transforming"])
def test_tracing_and_transforms_are_recognised(check: str):
    recognised = getattr(internals, check)
    assert not recognised()
    seen = []

    def f(x):
        seen.append(recognised())
        return x * 2

    torch.func.vmap(f)(torch.ones(2, 2))
    what = "kept number tensors and step replay avoid"
    assert seen == [True], _named("torch._C._functorch.peek_interpreter_stack", what)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert recognised(), _named("torch._C._len_torch_dispatch_stack", what)


@pytest.mark.parametrize("mode", [True, False])
def test_grad_mode_is_set_as_torch_sets_it(mode: bool):
    with torch.set_grad_enabled(not mode):
        internals.set_grad_mode(mode)
        assert torch.is_grad_enabled() is mode, _named(
            "torch._C._set_grad_enabled", "a replayed step turns grad mode off with"
        )
        w = torch.ones(2, requires_grad=True)
        assert (w * 2).requires_grad is mode


def test_dcp_init_is_recognised():
    state_dict = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    assert hasattr(state_dict, "_init_optim_state"), _named(
        "torch.distributed.checkpoint.state_dict._init_optim_state",
        "the zero-gradient step DCP takes to make state is recognised by",
    )
    assert "step" in inspect.getsource(state_dict._init_optim_state)
    w = torch.nn.Parameter(torch.ones(2))
    opt = AdamOptimizer([w], 0.1)
    assert internals.DCP_STATE_DICT in sys.modules
    state_dict._init_optim_state(opt)
    assert opt.get_slot(w, "m") is not None and torch.equal(w.detach(), torch.ones(2)), _named(
        "_init_optim_state", "must only create slots (called_from_dcp_init looks for it by name)"
    )
    assert opt.param_groups[0]["beta1_power"].item() == pytest.approx(0.9)


def test_tensor_guards_tell_metadata_apart():
    assert internals.tensor_guards() is not None, _named(
        "torch._C._dynamo.guards.TensorGuards", "the kept checks of a step's tensors (SameMeta) use"
    )


def test_inductor_entry_points_exist():
    assert callable(getattr(torch._inductor, "compile", None)), _named(
        "torch._inductor.compile", "fused=True compiles its kernels with"
    )
    assert internals.compiled_fx_graph_type() is not None, _named(
        "torch._inductor.output_code.CompiledFxGraph", "the fused kernels' direct calls are found through"
    )
    with internals.fused_compile_settings(8):
        assert not torch.fx.experimental._config.use_duck_shape, _named(
            "torch.fx.experimental._config.use_duck_shape", "fused kernels compile with"
        )
        assert torch._dynamo.config.recompile_limit == 8, _named(
            "torch._dynamo.config.recompile_limit", "fused kernels compile with"
        )
    assert "combo_kernels" in internals.inductor_options(), _named(
        "torch._inductor.config.combo_kernels", "fused=True on CUDA launches one kernel per chunk with"
    )


def test_rpc_agent_queries_exist():
    api = pytest.importorskip("torch.distributed.rpc.api")
    for name in ("_is_current_rpc_agent_set", "_get_current_rpc_agent"):
        assert hasattr(api, name), _named(f"torch.distributed.rpc.api.{name}", "AGN's RPC transport uses")
    assert internals.rpc_agent_set() is False  # (no RPC started in this process)
