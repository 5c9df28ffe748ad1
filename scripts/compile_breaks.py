"""Count the graphs and graph breaks of a whole train step under a user's ``torch.compile``.

    python scripts/compile_breaks.py
    python scripts/compile_breaks.py --optimizer adam momentum --paths fused foreach --steps 20
    python scripts/compile_breaks.py --backend inductor --optimizer adam

A small MLP's train step (forward, backward, ``opt.step()``, ``opt.zero_grad()``) is compiled
whole, without ``fullgraph``, and run for ``--steps`` steps under ``ExponentialLR``, once per
optimizer: ``torch.optim.Adam`` (fused, foreach) as the yardstick, and each of ours with
``fused=True``, ``foreach=True`` and the loop (``foreach=False``). Dynamo is reset between
runs. ``--eager-first N`` runs N eager steps first, so that the compiled ones find what an
eager step keeps (the step replay, the kept metadata).

The table gives the graphs dynamo compiled, the graph breaks it recorded (each time it traced
one, recompilations included), and the largest difference of the parameters from the same
steps run eagerly (0 is bitwise).

The default backend hands each graph back to run as captured (cheap to compile on a small
CPU); ``--backend inductor`` compiles them as a user's ``torch.compile`` does. With the
counting backend, graphs run torch's own square root where an eager step of ours takes
numpy's correctly rounded one (see ``torchgrad_compat.optim._numerics``), so a last-ulp
difference there is the square root, not the capture; ``--torch-sqrt`` makes the eager run
take torch's too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

import torchgrad_compat.optim as tgo
import torchgrad_compat.optim._numerics as optim_numerics

# name -> factory of (params, lr) with the path's options added.
OURS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "gradient_descent": lambda ps, **kw: tgo.GradientDescentOptimizer(ps, 0.1, **kw),
    "momentum": lambda ps, **kw: tgo.MomentumOptimizer(ps, 0.05, 0.9, **kw),
    "adagrad": lambda ps, **kw: tgo.AdagradOptimizer(ps, 0.1, **kw),
    "adagrad_da": lambda ps, **kw: tgo.AdagradDAOptimizer(
        ps, 0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.002, **kw
    ),
    "adam": lambda ps, **kw: tgo.AdamOptimizer(ps, 0.01, **kw),
    "adadelta": lambda ps, **kw: tgo.AdadeltaOptimizer(ps, 1.0, **kw),
    "rmsprop": lambda ps, **kw: tgo.RMSPropOptimizer(ps, 0.01, momentum=0.5, centered=True, **kw),
    "ftrl": lambda ps, **kw: tgo.FtrlOptimizer(
        ps,
        0.1,
        l1_regularization_strength=0.001,
        l2_regularization_strength=0.002,
        l2_shrinkage_regularization_strength=0.003,
        **kw,
    ),
    "proximal_adagrad": lambda ps, **kw: tgo.ProximalAdagradOptimizer(
        ps, 0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.002, **kw
    ),
    "proximal_gradient_descent": lambda ps, **kw: tgo.ProximalGradientDescentOptimizer(
        ps, 0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.002, **kw
    ),
}
PATHS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "loop": {"foreach": False},
}
TORCH: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "torch Adam fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "torch Adam foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
}


class CountingBackend:
    """A dynamo backend that runs each graph as captured and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        self.graphs += 1
        return gm.forward


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(steps)]


def train(
    make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    steps: int,
    backend: object | None,
    eager_first: int = 0,
) -> list[torch.Tensor]:
    """The parameters after ``eager_first`` eager train steps then ``steps`` more, compiled through
    ``backend`` (None: eager too). Dynamo's counters start after the eager ones."""
    model = make_model(0)
    opt = make_opt(list(model.parameters()))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = batches(eager_first + steps)
    for x, y in data[:eager_first]:
        train_step(x, y)
        sched.step()
    counters.clear()
    step = train_step if backend is None else torch.compile(train_step, backend=backend)
    for x, y in data[eager_first:]:
        step(x, y)
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


def count(
    make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    steps: int,
    backend_name: str,
    eager_first: int,
) -> dict[str, object]:
    torch._dynamo.reset()
    backend = CountingBackend() if backend_name == "count" else backend_name
    compiled = train(make_opt, steps, backend, eager_first)
    graphs = backend.graphs if isinstance(backend, CountingBackend) else counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    reasons = sorted(counters["graph_break"].items(), key=lambda item: -item[1])
    torch._dynamo.reset()
    eager = train(make_opt, steps, None, eager_first)
    diff = max((c - e).abs().max().item() for c, e in zip(compiled, eager, strict=True))
    return {"graphs": graphs, "breaks": breaks, "diff": diff, "reasons": reasons}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--optimizer", nargs="+", choices=sorted(OURS), default=sorted(OURS))
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=list(PATHS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--eager-first", type=int, default=0, help="eager steps before the compiled ones (what they keep)"
    )
    parser.add_argument("--backend", choices=("count", "inductor", "aot_eager"), default="count")
    parser.add_argument("--no-torch", action="store_true", help="leave out torch.optim.Adam")
    parser.add_argument("--torch-sqrt", action="store_true", help="eager steps take torch's square root")
    parser.add_argument("--reasons", action="store_true", help="list each run's graph-break reasons")
    args = parser.parse_args()
    if args.torch_sqrt:
        optim_numerics._numpy_view = lambda t: None
    runs: list[tuple[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]] = []
    if not args.no_torch:
        runs += list(TORCH.items())
    for name in args.optimizer:
        for path in args.paths:
            runs.append((f"{name} {path}", lambda ps, f=OURS[name], kw=PATHS[path]: f(ps, **kw)))
    print(
        f"{args.steps} compiled steps after {args.eager_first} eager ones, ExponentialLR(gamma=0.9), "
        f"backend {args.backend}, torch {torch.__version__}\n"
    )
    print("| optimizer | graphs | graph breaks | max diff from eager |")
    print("|---|---:|---:|---:|")
    details = []
    for label, make_opt in runs:
        found = count(make_opt, args.steps, args.backend, args.eager_first)
        print(
            f"| {label} | {found['graphs']} | {found['breaks']} | {found['diff']:.3g} |",
            flush=True,
        )
        details.append((label, found["reasons"]))
    if args.reasons:
        for label, reasons in details:
            print(f"\n{label}:")
            for reason, times in reasons:
                print(f"  {times} x {' '.join(reason.split())[:300]}")


if __name__ == "__main__":
    main()
