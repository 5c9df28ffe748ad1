"""A whole train step under a user's torch.compile: graphs and graph breaks against torch.optim.Adam's,
numbers against eager.

The step is compiled whole (forward, backward, ``opt.step()``, ``opt.zero_grad()``), without
``fullgraph``, under ``ExponentialLR``, after eager steps that leave what an eager step keeps
(the step replay, the kept metadata of the tensors). Graphs go to a backend that runs them as
captured, so that nothing is compiled and the counts come in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from optim_specs import SPECS, OptimSpec
from torch._dynamo.utils import counters

import torchgrad_compat.optim._numerics as optim_numerics

EAGER_FIRST = 2
COMPILED = 3
# Per optimizer, its configuration with the most options on (each option's term traced).
RICHEST = [(spec, list(spec.configs)[-1]) for spec in SPECS]
IDS = [f"{spec.name.removesuffix('Optimizer')}-{cid}" for spec, cid in RICHEST]
PATHS = {"foreach": {"foreach": True}, "fused": {"fused": True}}


class CountingBackend:
    """A dynamo backend that runs each graph as captured and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        self.graphs += 1
        return gm.forward


class NoUpdate(torch.optim.Optimizer):
    """An optimizer whose step changes nothing: the breaks a train step has without any update."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Callable[[], float] | None = None) -> None:
        return None


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(
    make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    backend: CountingBackend | None,
    then: Callable[[torch.optim.Optimizer], None] = lambda opt: None,
) -> tuple[list[torch.Tensor], int]:
    """The parameters after EAGER_FIRST eager steps and COMPILED more through ``backend`` (None:
    eager, after ``then(opt)``), and the graph breaks dynamo recorded in those."""
    model = _model()
    opt = make_opt(list(model.parameters()))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)) for _ in range(5)]

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for x, y in data[:EAGER_FIRST]:
        train_step(x, y)
        sched.step()
    torch._dynamo.reset()
    counters.clear()
    if backend is None:
        then(opt)
        step = train_step
    else:
        step = torch.compile(train_step, backend=backend)
    for x, y in data[EAGER_FIRST : EAGER_FIRST + COMPILED]:
        step(x, y)
        sched.step()
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return [p.detach().clone() for p in model.parameters()], breaks


@pytest.fixture(scope="module")
def torch_counts() -> tuple[int, int, int]:
    """Graphs and breaks of the train step with torch.optim.Adam(fused=True), and the breaks with
    an optimizer that updates nothing."""
    backend = CountingBackend()
    _, breaks = _train(lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True), backend)
    _, floor = _train(NoUpdate, CountingBackend())
    return backend.graphs, breaks, floor


def _to_loop(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        group["fused"], group["foreach"] = False, False


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("spec", "cid"), RICHEST, ids=IDS)
def test_compiled_train_step_breaks_no_more_than_torch_adam_and_is_eager(
    spec: OptimSpec, cid: str, path: str, torch_counts: tuple[int, int, int], monkeypatch
):
    # The graph runs torch's square root; the eager steps take it too (not numpy's, see
    # optim._numerics.sqrt). A traced fused step is its rule's loop, which the user's compile
    # fuses: the eager steps it is held to take the loop after the eager steps both share.
    monkeypatch.setattr(optim_numerics, "_numpy_view", lambda t: None)
    torch_graphs, torch_breaks, floor = torch_counts
    backend = CountingBackend()
    compiled, breaks = _train(lambda ps: spec.make(ps, cid, **PATHS[path]), backend)
    eager, _ = _train(
        lambda ps: spec.make(ps, cid, **PATHS[path]), None, _to_loop if path == "fused" else lambda opt: None
    )
    assert backend.graphs <= torch_graphs
    assert breaks <= torch_breaks
    # (The step itself breaks nothing: the breaks are those of a step that updates nothing.)
    assert breaks == floor
    for c, e in zip(compiled, eager, strict=True):
        assert torch.equal(c, e)
