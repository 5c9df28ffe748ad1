"""Adam's optimizer-wide state, against an independent numpy float32 re-implementation.

The reference follows the ApplyAdam kernel's association order (tf_semantics.md,
Appendix A), which TF 2.21's CPU kernel matches bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchgrad_compat.optim import AdamOptimizer

f32 = np.float32


def _numpy_adam_step(var, m, v, g, lr, b1, b2, eps, b1p, b2p):
    one = f32(1)
    alpha = f32(f32(f32(lr) * np.sqrt(one - b2p)) / (one - b1p))
    m = m + (g - m) * (one - f32(b1))
    v = v + (g * g - v) * (one - f32(b2))
    var = var - (m * alpha) / (np.sqrt(v) + f32(eps))
    return var, m, v


def test_beta_powers_are_float32_running_products():
    p = torch.zeros(3, requires_grad=True)
    opt = AdamOptimizer([p], learning_rate=0.1)
    b1p, b2p = f32(0.9), f32(0.999)
    for _ in range(1000):
        opt.apply_gradients([(torch.ones(3), p)])
        b1p, b2p = f32(b1p * f32(0.9)), f32(b2p * f32(0.999))
    non_slot = opt.state_dict()["param_groups"][0]
    assert non_slot["beta1_power"].dtype == torch.float32
    assert non_slot["beta2_power"].item() == float(b2p)
    assert non_slot["beta1_power"].item() == float(b1p)
    # TF's value, 0.36770025 (tf_semantics.md §0 #2), not 0.999 ** 1001 in double.
    assert non_slot["beta2_power"].item() == pytest.approx(0.999**1001, rel=2e-5)


@pytest.mark.parametrize("foreach", [False, True], ids=["reference", "foreach"])
def test_step_count_is_optimizer_wide(foreach):
    """A parameter that first gets a gradient at step 3 is corrected with t = 3, not t = 1."""
    rng = np.random.default_rng(0)
    p0_np = rng.standard_normal(4).astype(f32)
    p1_np = rng.standard_normal(4).astype(f32)
    p0 = torch.tensor(p0_np, requires_grad=True)
    p1 = torch.tensor(p1_np, requires_grad=True)
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    opt = AdamOptimizer([p0, p1], learning_rate=lr, beta1=b1, beta2=b2, epsilon=eps, foreach=foreach)
    m0 = v0 = np.zeros(4, f32)
    m1 = v1 = np.zeros(4, f32)
    b1p, b2p = f32(b1), f32(b2)
    for step in range(5):
        g0 = rng.standard_normal(4).astype(f32)
        g1 = rng.standard_normal(4).astype(f32)
        pairs = [(torch.tensor(g0), p0)]
        p0_np, m0, v0 = _numpy_adam_step(p0_np, m0, v0, g0, lr, b1, b2, eps, b1p, b2p)
        if step >= 2:
            pairs.append((torch.tensor(g1), p1))
            p1_np, m1, v1 = _numpy_adam_step(p1_np, m1, v1, g1, lr, b1, b2, eps, b1p, b2p)
        opt.apply_gradients(pairs)
        b1p, b2p = f32(b1p * f32(b1)), f32(b2p * f32(b2))
        # Bitwise: the same fp32 operations in the same order as the kernel.
        np.testing.assert_array_equal(p0.detach().numpy(), p0_np)
        np.testing.assert_array_equal(p1.detach().numpy(), p1_np)
    np.testing.assert_array_equal(opt.get_slot(p1, "m").numpy(), m1)
    np.testing.assert_array_equal(opt.get_slot(p1, "v").numpy(), v1)


def test_epsilon_is_added_to_sqrt_v_not_to_the_corrected_one():
    """One step from zero state: TF moves by lr·g/(|g| + ε·...), torch.optim.Adam differs for a large ε."""
    g = torch.tensor([0.5])
    ours = torch.zeros(1, requires_grad=True)
    AdamOptimizer([ours], learning_rate=0.1, epsilon=1.0).apply_gradients([(g, ours)])
    theirs = torch.zeros(1, requires_grad=True)
    theirs.grad = g.clone()
    torch.optim.Adam([theirs], lr=0.1, eps=1.0).step()
    # TF: α = 0.1·√(1-0.999)/(1-0.9); m = 0.05; v = 0.00025; Δ = mα/(√v + 1)
    alpha = 0.1 * np.sqrt(1 - f32(0.999)) / (1 - f32(0.9))
    expected = -(0.05 * alpha) / (np.sqrt(0.00025) + 1.0)
    assert ours.item() == pytest.approx(expected, rel=1e-5)
    assert abs(theirs.item() - ours.item()) > 1e-3  # torch: -0.1·0.5/(0.5 + 1) = -0.0333


@pytest.mark.parametrize("betas", [0.5, (0.9,), (0.9, 0.999, 0.1)], ids=["number", "one", "three"])
def test_betas_that_are_no_pair_are_named_when_set_between_steps(betas) -> None:
    """A scheduler or user writing group["betas"]: the error names betas, and nothing moves."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = AdamOptimizer([p], 0.1)
    p.grad = torch.ones(3)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["betas"] = betas
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\)"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("tensor_beta2", [False, True], ids=["number", "tensor"])
def test_sparse_v_scales_the_square_as_a_tf1_session_does(tensor_beta2):
    # TF's sparse Adam is made of graph ops: (g·g)(1-β₂) in its source, which a TF1 session's
    # Grappler rewrites into g·(g(1-β₂)) when β₂ is a number (a constant of the graph). A tensor
    # β₂, a variable in TF, keeps the source's order. The two orders differ for these values.
    g = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    c = np.float32(1) - np.float32(0.99999)
    expected = (g * g) * c if tensor_beta2 else g * (g * c)
    assert not np.array_equal(g * (g * c), (g * g) * c)
    p = torch.zeros(2, 8)
    beta2 = torch.tensor(0.99999) if tensor_beta2 else 0.99999
    opt = AdamOptimizer([p], learning_rate=0.5, beta2=beta2)
    opt.apply_gradients([(torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.from_numpy(g), (2, 8)), p)])
    assert np.array_equal(opt.get_slot(p, "v").numpy(), expected)
