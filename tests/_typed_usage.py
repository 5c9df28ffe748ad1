"""The public API used as README and docs use it, written to pass ``mypy --strict`` and ``pyright``
against an installed (not editable) torchgrad_compat: what a user's type checker sees through
``py.typed``. ``tests/test_typed_usage.py`` runs it and checks it; CI (``.ci/run``) checks it
against a fresh install.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from torchgrad_compat import gradients, hessian_vector_product, hessians, optim, train
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer
from torchgrad_compat.optim import AdagradOptimizer, AdamOptimizer, MomentumOptimizer
from torchgrad_compat.xla import CrossShardOptimizer


def torch_style() -> None:
    model = torch.nn.Linear(4, 1)
    opt = AdamOptimizer(model.parameters(), learning_rate=1e-3)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    named = AdamOptimizer(model.named_parameters(), learning_rate=1e-3, epsilon=1e-7)
    names: list[str] = named.param_groups[0]["param_names"]
    assert names == ["weight", "bias"]


def tf_style() -> None:
    model = torch.nn.Linear(4, 1)
    opt = AdamOptimizer(model.parameters(), learning_rate=1e-3)
    global_step = torch.tensor(0)
    opt.minimize(lambda: model(torch.randn(8, 4)).pow(2).mean(), global_step=global_step)
    grads_and_vars: list[tuple[Tensor | None, Tensor]] = opt.compute_gradients(
        model(torch.randn(8, 4)).pow(2).mean()
    )
    opt.apply_gradients(grads_and_vars, global_step=global_step)
    slot: Tensor | None = opt.get_slot(model.weight, "m")
    slot_names: list[str] = opt.get_slot_names()
    assert slot is not None and slot_names == ["m", "v"] and int(global_step) == 2


def param_groups_and_sparse() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = MomentumOptimizer(
        [
            {"params": model[0].parameters()},
            {"params": model[2].parameters(), "learning_rate": 0.01},
        ],
        learning_rate=0.1,
        momentum=0.9,
        use_nesterov=True,
    )
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    global_step = torch.tensor(0)

    def staircase_lr() -> float:
        return 0.1 * 0.5 ** (int(global_step) // 100)

    adagrad = AdagradOptimizer(embedding.parameters(), learning_rate=staircase_lr)
    adagrad.minimize(lambda: embedding(torch.tensor([0, 2])).pow(2).sum(), global_step=global_step)


def loss_scaling() -> None:
    model = torch.nn.Linear(4, 1)
    global_step = torch.tensor(0)
    opt = LossScaleOptimizer(AdamOptimizer(model.parameters(), learning_rate=1e-3))
    x = torch.randn(8, 4)

    def loss_fn() -> Tensor:
        y: Tensor = model(x)  # nn.Module's __call__ returns Any
        return y.pow(2).mean()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn()
    opt.get_scaled_loss(loss).backward()
    opt.step()
    opt.zero_grad()
    scaled_fn: Callable[[], Tensor] = opt.get_scaled_loss(loss_fn)
    scaled_fn().backward()
    opt.unscale_()
    train.clip_by_global_norm_(model.parameters(), clip_norm=1.0)
    opt.step()
    opt.zero_grad()
    opt.minimize(loss_fn, global_step=global_step)
    scale: Tensor = opt.loss_scale()
    fixed = LossScaleOptimizer(AdamOptimizer(model.parameters()), loss_scale=128.0)
    dynamic = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=DynamicLossScale(initial_loss_scale=2**10)
    )
    unscaled: list[Tensor | None] = fixed.get_unscaled_gradients([torch.ones(2), None])
    assert scale.dtype == torch.float32 and unscaled[1] is None and dynamic.loss_scale() == 2**10


def decays_and_clipping() -> None:
    w = torch.zeros(3, requires_grad=True)
    global_step = torch.zeros((), dtype=torch.int64)
    learning_rate = train.exponential_decay(0.1, global_step, 1000, 0.96, staircase=True)
    opt = optim.MomentumOptimizer([w], learning_rate=learning_rate, momentum=0.9)
    opt.minimize(lambda: (w - 1).square().sum(), global_step=global_step)
    current: float = learning_rate().item()
    at: float = learning_rate.at(500)

    adam = optim.AdamOptimizer([w], learning_rate=1e-3)
    scheduler = train.DecayLR(adam, train.cosine_decay(1e-3, None, decay_steps=100, alpha=0.1))
    (w - 1).square().sum().backward()
    adam.step()
    scheduler.step()

    decayed = train.polynomial_decay(5e-5, global_step, 10000, end_learning_rate=0.0, power=1.0)
    warm = train.linear_warmup(5e-5, decayed, 1000)
    optim.AdamOptimizer([torch.zeros(3, requires_grad=True)], learning_rate=warm)
    grads = [torch.tensor([3.0, 4.0]), None, torch.tensor([12.0])]
    clipped, norm = train.clip_by_global_norm(grads, clip_norm=6.5)
    first: Tensor | None = clipped[0]
    assert current > 0 and at > 0 and first is not None and float(norm) == 13.0


def cross_shard() -> None:
    model = torch.nn.Linear(4, 1)
    with warnings.catch_warnings():  # no process group: a local step, and TF's warning about it
        warnings.simplefilter("ignore")
        opt = CrossShardOptimizer(optim.GradientDescentOptimizer(model.parameters(), learning_rate=0.1))
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        pairs = opt.compute_gradients(model(torch.randn(8, 4)).pow(2).mean())
        opt.apply_gradients(pairs)
    opt.zero_grad()


def tf_gradients() -> None:
    a = torch.tensor(0.0, requires_grad=True)
    b = 2 * a
    ga: list[Tensor | None] = gradients(a + b, [a, b])
    partial = gradients(a + b, [a, b], stop_gradients=[a, b])
    x = torch.randn(3, 2, requires_grad=True)
    (h,) = hessians((x**3).sum(), [x])
    (hv,) = hessian_vector_product((x**3).sum(), [x], [torch.ones(3, 2)])
    assert ga[0] is not None and partial[0] is not None and h is not None and hv is not None
    assert h.shape == (3, 2, 3, 2)


def main() -> None:
    torch_style()
    tf_style()
    param_groups_and_sparse()
    loss_scaling()
    decays_and_clipping()
    cross_shard()
    tf_gradients()


if __name__ == "__main__":
    main()
