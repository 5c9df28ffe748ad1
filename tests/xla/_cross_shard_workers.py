"""The rank side of tests/xla/test_cross_shard.py: checks that run inside every spawned process.

``run_checks`` joins a gloo process group on 127.0.0.1, runs the named checks in
order and reports ``(check, rank, traceback or None)`` for each. A check runs on
every rank and compares against a single-process reference computed in the same
process, so the parent only collects verdicts.
"""

from __future__ import annotations

import copy
import io
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _autograd import FailingBackward
from _fused_engine import small_chunks
from _procs import init_gloo
from torch import Tensor, nn

import torchgrad_compat.optim as tgo
from torchgrad_compat.xla import CrossShardOptimizer

STEPS = 3
LOCAL_BATCH = 4
TOKENS = 12


class Net(nn.Module):
    """A sparse embedding and two dense layers: dense and row-sparse gradients in one model."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(TOKENS, 3, sparse=True, dtype=dtype)
        self.hidden = nn.Linear(5, 6, dtype=dtype)
        self.out = nn.Linear(6, 1, dtype=dtype)

    def forward(self, tokens: Tensor, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(torch.cat([self.embedding(tokens), x], dim=1))))


def _global_batch(step: int, world: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    n = world * LOCAL_BATCH
    tokens = torch.randint(TOKENS, (n,), generator=gen)
    x = torch.randn(n, 2, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(n, 1, generator=gen, dtype=torch.float64).to(dtype)
    return tokens, x, y


def _shard_loss(model: Net, batch: tuple[Tensor, Tensor, Tensor], rank: int) -> Tensor:
    """Mean squared error over rank ``rank``'s slice of the global batch."""
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    tokens, x, y = (t[rows] for t in batch)
    return (model(tokens, x) - y).pow(2).mean()


def _members(rank: int, world: int, group_assignment: list[list[int]] | None) -> list[int]:
    if group_assignment is None:
        return list(range(world))
    return next(sorted(g) for g in group_assignment if rank in g)


def _gather_flat(model: nn.Module) -> list[Tensor]:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # Summation order differs from the single-process reference (per-shard sums, then across ranks).
    return {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}


def _dense(g: Tensor) -> Tensor:
    return g.to_dense() if g.is_sparse else g


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "tf_adam": lambda params: tgo.AdamOptimizer(params, learning_rate=0.05),
    "tf_momentum": lambda params: tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9),
    "torch_adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "torch_sgd": lambda params: torch.optim.SGD(params, lr=0.1),
}


def _train_against_reference(
    rank: int,
    world: int,
    *,
    optimizer: str,
    reduction: str,
    style: str,
    group_assignment: list[list[int]] | None = None,
    dtype: torch.dtype = torch.float64,
) -> None:
    """``STEPS`` steps on this rank's shard == one process on the (sub)group's full batch, every step."""
    model = Net(dtype)
    reference = copy.deepcopy(model)
    make = OPTIMIZERS[optimizer]
    opt = CrossShardOptimizer(
        make(model.parameters()), reduction=reduction, group_assignment=group_assignment
    )
    ref_opt = make(reference.parameters())
    members = _members(rank, world, group_assignment)
    tol = _tol(dtype)
    where = f"{optimizer}/{reduction}/{style}/{group_assignment}/{dtype} on rank {rank}"
    for step in range(STEPS):
        batch = _global_batch(step, world, dtype)
        ref_loss = sum(_shard_loss(reference, batch, m) for m in members)
        if reduction == "mean":
            ref_loss = ref_loss / len(members)
        ref_opt.zero_grad()
        ref_loss.backward()
        if style == "minimize":
            opt.minimize(lambda: _shard_loss(model, batch, rank))  # noqa: B023 (called at once)
        else:
            opt.zero_grad()
            _shard_loss(model, batch, rank).backward()
            # The reduction happened in backward: p.grad is already the (sub)group's gradient.
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(_dense(p.grad), _dense(q.grad), **tol, msg=f"grad, {where}")
            opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), **tol, msg=f"step {step}, {where}")
    everyone = _gather_flat(model)
    for m in members:
        assert torch.equal(everyone[m], everyone[rank]), f"rank {m} and rank {rank} differ bitwise, {where}"


# ---------------------------------------------------------------- checks
def check_full_batch_equivalence(rank: int, world: int) -> None:
    for reduction in ("mean", "sum"):
        for style in ("minimize", "step"):
            for optimizer in ("tf_adam", "torch_adagrad"):
                _train_against_reference(rank, world, optimizer=optimizer, reduction=reduction, style=style)
    _train_against_reference(
        rank, world, optimizer="tf_adam", reduction="mean", style="step", dtype=torch.float32
    )


def check_fused_as_the_reference_loop(rank: int, world: int) -> None:
    """A fused inner optimizer steps as the same run with ``foreach=False``, bitwise."""
    # Chunks of 4 tensors, as in tests/optim/test_fused.py: quick to compile.
    with small_chunks():
        runs = []
        for path in ({"fused": True}, {"foreach": False}):
            model = Net(torch.float32)
            opt = CrossShardOptimizer(tgo.AdamOptimizer(model.parameters(), learning_rate=0.05, **path))
            trace = []
            for step in range(STEPS):
                batch = _global_batch(step, world, torch.float32)
                opt.zero_grad()
                _shard_loss(model, batch, rank).backward()
                opt.step()
                trace.append([p.detach().clone() for p in model.parameters()])
            everyone = _gather_flat(model)
            assert all(torch.equal(e, everyone[rank]) for e in everyone), f"{path}: ranks differ bitwise"
            runs.append(trace)
    for step, (fused, loop) in enumerate(zip(*runs, strict=True)):
        for f, r in zip(fused, loop, strict=True):
            assert torch.equal(f, r), f"step {step} on rank {rank}"


def check_subgroups_full_batch_equivalence(rank: int, world: int) -> None:
    groups = [[0, 1], [2, 3]]
    for reduction in ("mean", "sum"):
        for style in ("minimize", "step"):
            for optimizer in ("tf_momentum", "torch_sgd"):
                _train_against_reference(
                    rank,
                    world,
                    optimizer=optimizer,
                    reduction=reduction,
                    style=style,
                    group_assignment=groups,
                )


def check_subgroups_that_trained_apart_take_a_group_added_later(rank: int, world: int) -> None:
    """Subgroups [[0, 1], [2, 3]] sum their own gradients, so after a step their replicas hold
    different values: a group added later (the same on every rank) is compared, not those."""
    first = nn.Parameter(torch.ones(2))
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([first], 0.1), group_assignment=[[0, 1], [2, 3]])
    ((rank + 1.0) * first.sum()).backward()  # subgroup sums 3 and 7
    opt.step()
    later = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": later, "lr": 0.1})
    for _ in range(2):
        opt.zero_grad()
        ((rank + 1.0) * (first.sum() + later.sum())).backward()
        opt.step()
    mean = torch.tensor(1.5 if rank < 2 else 3.5)  # the subgroup's mean of rank + 1
    lr = torch.tensor(0.1)
    want_first, want_later = torch.ones(2), torch.ones(3)
    for _ in range(3):
        want_first = want_first - mean * lr
    for _ in range(2):
        want_later = want_later - mean * lr
    assert torch.equal(first.detach(), want_first), (first, want_first)
    assert torch.equal(later.detach(), want_later), (later, want_later)
    # A later group whose values differ across the world is still refused, on every rank.
    other = nn.Parameter(torch.full((2,), float(rank)))
    opt.add_param_group({"params": other, "lr": 0.1})
    opt.zero_grad()
    ((rank + 1.0) * (first.sum() + later.sum() + other.sum())).backward()
    _expect_error(
        RuntimeError,
        ["parameter 0 of param group 2", "different values", "after add_param_group"],
        opt.step,
    )
    _group_still_usable(world)


def check_subgroup_divisor(rank: int, world: int) -> None:
    """Rank r's gradient is r + 1: the sums and means of the probe in reliability.md (1.5 and 3.5)."""
    cases = [
        (None, "sum", [10.0] * 4),
        (None, "mean", [2.5] * 4),
        ([[0, 1], [2, 3]], "sum", [3.0, 3.0, 7.0, 7.0]),
        ([[0, 1], [2, 3]], "mean", [1.5, 1.5, 3.5, 3.5]),
        ([[3, 0], [1, 2]], "mean", [2.5, 2.5, 2.5, 2.5]),
        ([[0, 2], [1, 3]], "sum", [4.0, 6.0, 4.0, 6.0]),
    ]
    for groups, reduction, expected in cases:
        for style in ("minimize", "step"):
            w = nn.Parameter(torch.zeros(3))
            opt = CrossShardOptimizer(
                tgo.GradientDescentOptimizer([w], 1.0), reduction, group_assignment=groups
            )
            loss = (rank + 1.0) * w.sum()
            if style == "minimize":
                opt.minimize(loss)
            else:
                loss.backward()
                opt.step()
            want = torch.full((3,), -expected[rank])
            assert torch.equal(w.detach(), want), (groups, reduction, style, w, want)


def check_missing_gradients(rank: int, world: int) -> None:
    """A gradient on rank 0 only: updated identically everywhere. No gradient anywhere: untouched."""
    for style in ("minimize", "step"):
        w = nn.Parameter(torch.ones(2))
        only_rank0 = nn.Parameter(torch.ones(2))
        unused = nn.Parameter(torch.ones(2))
        opt = CrossShardOptimizer(tgo.AdamOptimizer([w, only_rank0, unused], learning_rate=0.5), "sum")
        loss = w.sum() + (3.0 * only_rank0.sum() if rank == 0 else 0.0)
        if style == "minimize":
            opt.minimize(loss)
        else:
            loss.backward()
            assert torch.equal(only_rank0.grad, torch.full((2,), 3.0)), only_rank0.grad
            assert unused.grad is None
            opt.step()
        # Adam's first step moves every coordinate with a nonzero gradient by learning_rate.
        assert torch.allclose(w.detach(), torch.full((2,), 0.5)), w
        assert torch.allclose(only_rank0.detach(), torch.full((2,), 0.5)), (style, only_rank0)
        assert torch.equal(unused.detach(), torch.ones(2)) and opt.get_slot(unused, "m") is None
        assert opt.get_slot(only_rank0, "m") is not None


def check_add_param_group(rank: int, world: int) -> None:
    """A group added later is checked across ranks and reduced like the first ones (sum: 1 + 2 = 3)."""
    first, later = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    opt = CrossShardOptimizer(torch.optim.SGD([first], lr=1.0), "sum")
    opt.add_param_group({"params": later, "lr": 0.5})
    ((rank + 1.0) * (first.sum() + later.sum())).backward()
    opt.step()
    total = world * (world + 1) / 2
    assert torch.equal(first.detach(), torch.full((2,), -total)), first
    assert torch.equal(later.detach(), torch.full((3,), -0.5 * total)), later
    shape = (4,) if rank == 0 else (5,)
    _expect_error(
        RuntimeError,
        ["parameter 2", "param group 2, index 0", "shape (4,)", "shape (5,)"],
        lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(shape))]}),
    )
    assert len(opt.param_groups) == 2  # nothing was added


def check_sparse_and_dense_mixed(rank: int, world: int) -> None:
    """Rank 0 hands a sparse gradient, the others a dense one, for the same variable: a dense sum."""
    p = nn.Parameter(torch.zeros(4, 2))
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([p], 1.0), "sum")
    if rank == 0:
        grad = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), torch.ones(3, 2), (4, 2))
    else:
        grad = torch.full((4, 2), float(rank))
    opt.apply_gradients([(grad, p)])
    others = sum(range(1, world))
    want = -torch.tensor([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]) - others
    assert torch.equal(p.detach(), want), p


def check_few_collectives(rank: int, world: int) -> None:
    """200 parameter tensors travel in one bucket: one all-reduce, started inside backward()."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(100)])
    opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    calls = []
    all_reduce = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].numel())
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        model(torch.randn(2, 4)).sum().backward()
        in_backward = len(calls)
        opt.step()
        after_step = len(calls)
        opt.minimize(model(torch.randn(2, 4)).sum())
        in_minimize = len(calls) - after_step
    finally:
        dist.all_reduce = all_reduce
    assert (in_backward, after_step, in_minimize) == (1, 1, 1), (calls, in_backward, after_step, in_minimize)
    # The bucket holds every gradient and two presence counters per tensor.
    assert calls[0] == sum(p.numel() for p in model.parameters()) + 2 * 200, calls


def check_accumulation(rank: int, world: int) -> None:
    """no_sync() for all but the last micro-batch; a second backward with "sum" raises on every rank."""
    for reduction in ("mean", "sum"):
        model = Net(torch.float64)
        reference = copy.deepcopy(model)
        opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reduction)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        first, second = _global_batch(0, world, torch.float64), _global_batch(1, world, torch.float64)
        with opt.no_sync():
            _shard_loss(model, first, rank).backward()
        _shard_loss(model, second, rank).backward()
        opt.step()
        ref_loss = sum(_shard_loss(reference, b, m) for b in (first, second) for m in range(world))
        (ref_loss / world if reduction == "mean" else ref_loss).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12)
        opt.zero_grad()
        _shard_loss(model, first, rank).backward()
        if reduction == "sum":
            try:
                _shard_loss(model, second, rank).backward()
            except RuntimeError as error:
                assert "no_sync" in str(error), error
            else:
                raise AssertionError("a second backward pass with reduction='sum' did not raise")
        else:
            # DDP's semantics: each pass reduces what p.grad holds, which adds up to the mean of both.
            _shard_loss(model, second, rank).backward()
            reference.zero_grad()
            both = sum(_shard_loss(reference, b, m) for b in (first, second) for m in range(world))
            (both / world).backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(_dense(p.grad), _dense(q.grad), rtol=1e-10, atol=1e-12)
        opt.zero_grad()


def check_state_dict_resume(rank: int, world: int) -> None:
    """Save after 2 steps, load into a fresh wrapper around a fresh optimizer, continue: bitwise equal."""
    model, twin = Net(torch.float64), Net(torch.float64)
    opt = CrossShardOptimizer(tgo.AdamOptimizer(model.parameters(), learning_rate=0.05))
    for step in range(2):
        opt.minimize(_shard_loss(model, _global_batch(step, world, torch.float64), rank))
    twin.load_state_dict(model.state_dict())
    resumed = CrossShardOptimizer(tgo.AdamOptimizer(twin.parameters(), learning_rate=0.05))
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    assert set(opt.state_dict()) == {"state", "param_groups"}
    for step in range(2, 4):
        batch = _global_batch(step, world, torch.float64)
        opt.minimize(_shard_loss(model, batch, rank))
        resumed.minimize(_shard_loss(twin, batch, rank))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for p in model.parameters():
        assert opt.get_slot(p, "m") is opt.inner_optimizer.get_slot(p, "m")
    assert opt.get_slot_names() == ["m", "v"] and len(opt.variables()) == 2 * 5 + 2


def check_a_backward_pass_that_raised_midway_stops_the_next_step(rank: int, world: int) -> None:
    """The pass raised after a bucket went on the wire: going on would pair the replicas'
    collectives wrongly (a silent drift), so every later step and pass refuses, on every rank."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([a, b], 0.1), "sum", bucket_cap_mb=1e-9)
    # a's node is made last, so autograd reaches it (and launches its bucket) before b's fails.
    loss = FailingBackward.apply(b).sum() + (a * 2).sum()
    _expect_error(RuntimeError, ["backward failed on purpose"], loss.backward)
    words = ["earlier backward pass raised", "buckets on the wire", "Restart the processes"]
    _expect_error(RuntimeError, words, opt.step)
    _expect_error(RuntimeError, words, lambda: (a * 3).sum().backward())
    assert torch.equal(a.detach(), torch.ones(3)) and torch.equal(b.detach(), torch.ones(3))


def check_a_sparse_gradient_that_is_not_row_sparse_is_refused(rank: int, world: int) -> None:
    """Only the row indices are gathered: a 2-sparse-dim gradient would be summed into whole rows."""
    w = nn.Parameter(torch.zeros(2, 3))
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([w], 1.0), "sum")
    w.grad = torch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.tensor([5.0]), (2, 3))
    _expect_error(ValueError, ["parameter 0 has 2 sparse dims", "row-sparse"], opt.step)
    assert not w.detach().any()
    w.grad = w.grad.to_dense()
    opt.step()  # the group is still in step: nothing was sent
    assert w[1, 2] == -5.0 * world and w.detach().count_nonzero() == 1


def check_a_parameter_unfrozen_after_construction_is_summed(rank: int, world: int) -> None:
    """Frozen when the hooks were made: its first gradient is summed at step(), later ones in backward."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3), requires_grad=False)
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([a, b], 1.0), "sum")
    ((rank + 1.0) * a.sum()).backward()  # rank r's gradient is r + 1
    opt.step()
    b.requires_grad_(True)
    for _ in range(2):
        opt.zero_grad()
        # b's branch made first: autograd reaches a (and sends its bucket) before b's gradient exists.
        ((rank + 1.0) * b.sum() + (rank + 1.0) * a.sum()).backward()
        opt.step()
    total = world * (world + 1) / 2
    assert torch.equal(a.detach(), torch.full((2,), -3 * total)), a
    assert torch.equal(b.detach(), torch.full((3,), -2 * total)), b


def check_complex_parameters_are_refused_on_every_rank(rank: int, world: int) -> None:
    z = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    words = ["parameter 1 is complex (torch.complex64)", "view_as_real"]
    _expect_error(
        TypeError,
        words,
        lambda: CrossShardOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1)), z], lr=0.1)),
    )


def _expect_error(kind: type[Exception], words: list[str], build: Callable[[], Any]) -> None:
    try:
        build()
    except kind as error:
        for word in words:
            assert word in str(error), (word, str(error))
    else:
        raise AssertionError(f"expected {kind.__name__} mentioning {words}")


def check_mismatched_parameters(rank: int, world: int) -> None:
    """Different parameters or settings on one rank: the same clear RuntimeError on every rank."""
    last = world - 1
    extra = [nn.Parameter(torch.zeros(2))] if rank == last else []
    params = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(5)), *extra]
    _expect_error(
        RuntimeError,
        ["rank 0 has 2 parameters", f"rank {last} has 3", "parameter 2", "shape (2,)"],
        lambda: CrossShardOptimizer(torch.optim.SGD(params, lr=0.1)),
    )
    shape = (5,) if rank == last else (6,)
    params = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(shape))]
    _expect_error(
        RuntimeError,
        ["parameter 1", f"rank {last}", "shape (5,)", "shape (6,)", "param group 0, index 1"],
        lambda: CrossShardOptimizer(tgo.AdamOptimizer(params)),
    )
    dtype = torch.float64 if rank == last else torch.float32
    params = [nn.Parameter(torch.zeros(3, dtype=dtype))]
    _expect_error(
        RuntimeError,
        ["parameter 0", "float64", "float32"],
        lambda: CrossShardOptimizer(tgo.AdamOptimizer(params)),
    )
    reduction = "sum" if rank == last else "mean"
    params = [nn.Parameter(torch.zeros(3))]
    _expect_error(
        RuntimeError,
        ["reduction differs", f"'sum' on rank {last}"],
        lambda: CrossShardOptimizer(tgo.AdamOptimizer(params), reduction),
    )
    # The process group is intact: nothing was left half-issued.
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert ok.item() == world


def check_mismatched_group_assignment(rank: int, world: int) -> None:
    groups = [[0, 1], [2, 3]] if rank == 0 else [[0, 2], [1, 3]]
    params = [nn.Parameter(torch.zeros(3))]
    _expect_error(
        RuntimeError,
        ["group_assignment differs", "[[0, 1], [2, 3]] on rank 0", "[[0, 2], [1, 3]] on rank 1"],
        lambda: CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), group_assignment=groups),
    )


def check_invalid_arguments_before_any_collective(rank: int, world: int) -> None:
    """Bad arguments raise on every rank before any collective (the group stays usable)."""
    params = [nn.Parameter(torch.zeros(3))]
    too_many = [list(range(world)), [world, world + 1]]
    cases = [
        (
            ValueError,
            "range(" + str(world) + ")",
            [[0, 1], [2, 3], [3, 3]] if world == 4 else [[0, 0], [1, 1]],
        ),
        (ValueError, "range(" + str(world) + ")", too_many),
        (ValueError, "must be equal", [[0], list(range(1, world))]),
        (TypeError, "list of lists", list(range(world))),
        (TypeError, "integer ranks", [[float(r) for r in range(world)]]),
    ]
    for kind, word, groups in cases:
        _expect_error(
            kind,
            [word, repr(groups)],
            lambda: CrossShardOptimizer(tgo.AdamOptimizer(params), group_assignment=groups),  # noqa: B023
        )
    _expect_error(ValueError, ["'max'"], lambda: CrossShardOptimizer(tgo.AdamOptimizer(params), "max"))
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert ok.item() == world


def _group_still_usable(world: int) -> None:
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert ok.item() == world


def check_invalid_argument_on_one_rank(rank: int, world: int) -> None:
    """One rank's bad argument: every rank raises the same error instead of waiting for it."""
    last = world - 1
    params = [nn.Parameter(torch.zeros(3))]
    reduction = "max" if rank == last else "mean"
    _expect_error(
        ValueError,
        [f"rank {last}", "'max'", "every rank raises"],
        lambda: CrossShardOptimizer(tgo.AdamOptimizer(params), reduction),
    )
    groups = [[0, 0], list(range(1, world))] if rank == last else None
    _expect_error(
        ValueError,
        [f"rank {last}", f"range({world})"],
        lambda: CrossShardOptimizer(tgo.AdamOptimizer(params), group_assignment=groups),
    )
    cap = "big" if rank == 0 else None
    _expect_error(
        TypeError,
        ["rank 0", "bucket_cap_mb"],
        lambda: CrossShardOptimizer(tgo.AdamOptimizer(params), bucket_cap_mb=cap),
    )
    _group_still_usable(world)


def _first_step_error(
    rank: int,
    world: int,
    make: Callable[[list[Tensor]], torch.optim.Optimizer],
    init: Tensor,
    words: list[str],
) -> None:
    """Both driving styles raise ``words`` on every rank at the first step, and change nothing."""
    for style in ("minimize", "step"):
        w = nn.Parameter(init.clone())
        opt = CrossShardOptimizer(make([w]))
        try:
            if style == "minimize":
                opt.minimize((w * w).sum())
            else:
                (w * w).sum().backward()
                opt.step()
        except RuntimeError as error:
            for word in words:
                assert word in str(error), (style, word, str(error))
        else:
            raise AssertionError(f"{style}: expected a RuntimeError mentioning {words}")
        assert torch.equal(w.detach(), init), style
    _group_still_usable(world)


def check_different_steps_across_ranks(rank: int, world: int) -> None:
    """Ranks that would take different steps raise together at the first step, before any update."""
    last = world - 1
    same = torch.tensor([1.0, -2.0, 3.0])
    lr = 0.2 if rank == last else 0.1
    _first_step_error(
        rank, world, lambda ps: tgo.AdamOptimizer(ps, learning_rate=lr), same, ["'lr' differs", "0.1", "0.2"]
    )
    # A TF-style callable learning rate is compared by the value it gives (its name is the same).
    _first_step_error(
        rank,
        world,
        lambda ps: tgo.AdamOptimizer(ps, learning_rate=lambda: lr),
        same,
        ["'lr' differs", "giving 0.1 on rank 0", f"giving 0.2 on rank {last}"],
    )
    cls = tgo.MomentumOptimizer if rank == last else tgo.GradientDescentOptimizer
    _first_step_error(
        rank,
        world,
        lambda ps: cls(ps, 0.1, momentum=0.9) if cls is tgo.MomentumOptimizer else cls(ps, 0.1),
        same,
        ["wrapped optimizer differs", "GradientDescentOptimizer", "MomentumOptimizer"],
    )
    init = same + (1e-7 if rank == last else 0.0)
    _first_step_error(
        rank,
        world,
        lambda ps: tgo.GradientDescentOptimizer(ps, 0.1),
        init,
        ["parameter 0", "different values", f"rank {last}", "same seed"],
    )


def check_a_group_added_later_is_compared_at_the_next_step(rank: int, world: int) -> None:
    """A group added after training began, with another learning rate on one rank: the next
    update raises on every rank and changes nothing (else that group would drift apart)."""
    last = world - 1
    first = nn.Parameter(torch.ones(2))
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([first], 0.1))
    (first * first).sum().backward()
    opt.step()
    later = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": later, "lr": 0.2 if rank == last else 0.1})
    opt.zero_grad()
    ((first * first).sum() + (later * later).sum()).backward()
    before = [first.detach().clone(), later.detach().clone()]
    _expect_error(
        RuntimeError,
        ["param group 1's 'lr' differs", "after add_param_group", "0.1 on rank 0", f"0.2 on rank {last}"],
        opt.step,
    )
    assert torch.equal(first.detach(), before[0]) and torch.equal(later.detach(), before[1])
    _group_still_usable(world)


def check_dcp_state_dict_leaves_the_first_step_check(rank: int, world: int) -> None:
    """torch.distributed.checkpoint's get_state_dict steps a fresh optimizer with zero gradients to
    make its state: on parameters a load will overwrite, so ranks may differ there (a per-rank
    seed), and the check of the first real update is still to come."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    w = nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(10 + rank)))
    opt = CrossShardOptimizer(tgo.AdamOptimizer([w], learning_rate=0.1))
    get_state_dict(nn.ParameterList([w]), opt)  # different values on the ranks: no error
    assert set(opt.state[w]) == {"m", "v"}
    init = w.detach().clone()
    try:
        opt.minimize((w * w).sum())
    except RuntimeError as error:
        assert "different values" in str(error), str(error)
    else:
        raise AssertionError("the first update on different parameters was not refused")
    assert torch.equal(w.detach(), init)
    _group_still_usable(world)


CHECKS: dict[str, Callable[[int, int], None]] = {
    name.removeprefix("check_"): fn for name, fn in globals().items() if name.startswith("check_")
}


def run_checks(rank: int, world: int, port: int, names: list[str], results: Any) -> None:
    """Entry point of a spawned rank: one gloo group on 127.0.0.1, then every named check."""
    init_gloo(rank, world, port)
    try:
        for name in names:
            try:
                CHECKS[name](rank, world)
                results.put((name, rank, None))
            except Exception:
                results.put((name, rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def frozen_peer(rank: int, world: int, port: int, timeout_s: float, results: Any) -> None:
    """The last rank stops answering after construction; the others report how their step ended."""
    import time

    init_gloo(rank, world, port, timeout_s)
    w = nn.Parameter(torch.ones(3))
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([w], 0.1))
    if rank == world - 1:
        time.sleep(3 * timeout_s)  # frozen: alive, holding its connections, never reaching the step
        os._exit(0)
    start = time.monotonic()
    try:
        opt.minimize((w * w).sum())
        results.put((rank, None, time.monotonic() - start))
    except Exception as error:
        results.put((rank, f"{type(error).__name__}: {error}", time.monotonic() - start))
    results.close()
    results.join_thread()  # flushed before os._exit, which skips the teardown the peer would hang
    os._exit(0)
