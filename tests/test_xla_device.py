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
