"""The ten optimizers on an XLA device (torch_xla, ``PJRT_DEVICE=CPU``) against the same run on the CPU.

Skipped when torch_xla is not installed (it needs its own torch release). XLA
compiles each step into one program and may fuse a multiply and an add, so the
comparison is at the float32 parity tolerance rather than bitwise.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from optim_specs import OptimSpec, spec_configs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed"
)

SPEC_CONFIGS = spec_configs()
STEPS = 4


def _run(spec: OptimSpec, cid: str, device: torch.device, foreach: bool) -> list[torch.Tensor]:
    """``STEPS`` TF-style steps from fixed gradients; the parameters and slots, on the CPU."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in ((4, 3), (5,))]
    opt = spec.make(params, cid, foreach=foreach)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen).to(device) for p in params]
        opt.apply_gradients(list(zip(grads, params)))
    slots = [opt.state[p][name] for p in params for name in sorted(opt.state[p])]
    return [t.detach().cpu() for t in params + slots]


@pytest.mark.parametrize("foreach", [False, True], ids=["reference", "foreach"])
@pytest.mark.parametrize(
    ("spec", "cid"),
    SPEC_CONFIGS,
    ids=[f"{s.name.removesuffix('Optimizer')}-{c}" for s, c in SPEC_CONFIGS],
)
def test_optimizer_on_xla_matches_cpu(monkeypatch, spec: OptimSpec, cid: str, foreach: bool):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    import torch_xla

    expected = _run(spec, cid, torch.device("cpu"), foreach=False)
    actual = _run(spec, cid, torch_xla.device(), foreach=foreach)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_reduced_gradients_come_from_the_all_reduce(monkeypatch):
    """Every per-parameter sum is computed from the all-reduce, not from the buffer before it.

    One replica's sum equals its own gradient, so the values cannot tell; the traced
    graph can: with ``XLA_ALWAYS_ALLREDUCE=1`` torch_xla traces the collective even
    for one replica, and each parameter's result must depend on it. (The in-place
    list form of ``xm.all_reduce`` left these views reading the unreduced buffer, and
    several replicas then trained on their own shards only.)
    """
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")
    import torch_xla

    from torchgrad_compat.xla._collective import XlaCollective
    from torchgrad_compat.xla._reducer import GradientReducer

    device = torch_xla.device()
    params = [torch.zeros(3, device=device), torch.zeros(2, 2, device=device)]
    reducer = GradientReducer(params, XlaCollective(), bucket_cap_bytes=1024, first_bucket_cap_bytes=1024)
    grads = [torch.arange(3.0).to(device), torch.ones(2, 2).to(device)]
    for average in (False, True):
        sums = reducer.reduce(grads, average=average)
        for i, summed in enumerate(sums):
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([summed])
            assert "all-reduce" in hlo, f"parameter {i} (average={average}): no all-reduce in\n{hlo}"
        assert torch.equal(sums[0].cpu(), torch.arange(3.0)) and torch.equal(sums[1].cpu(), torch.ones(2, 2))


def test_non_finite_gradients_are_found_on_xla(monkeypatch):
    """NaN as well as inf: XLA's max drops NaN, so an inf-norm check would call NaN finite."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    import torch_xla

    from torchgrad_compat.amp import LossScaleOptimizer
    from torchgrad_compat.amp.loss_scale import found_non_finite
    from torchgrad_compat.optim import GradientDescentOptimizer

    device = torch_xla.device()
    finite = torch.tensor([1.0, -2.0]).to(device)
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads = [finite, torch.tensor([3.0, bad, 1.0]).to(device)]
        assert found_non_finite(grads, device).cpu().item() == 1.0, bad
    assert found_non_finite([finite], device).cpu().item() == 0.0

    # TF style around LossScaleOptimizer: the NaN step is skipped, the scale halves.
    w = torch.tensor([1.0, 2.0]).to(device).requires_grad_()
    opt = LossScaleOptimizer(GradientDescentOptimizer([w], learning_rate=0.5), loss_scale="dynamic")
    opt.apply_gradients([(torch.tensor([float("nan"), 1.0]).to(device), w)])
    assert torch.equal(w.detach().cpu(), torch.tensor([1.0, 2.0]))
    assert opt.loss_scale().cpu().item() == 2.0**14
