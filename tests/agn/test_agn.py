"""AGN: the worker/server math in one process (direct transport), then real TensorPipe RPC processes.

The in-process tests drive :class:`LocalServerHost`, which clones every tensor
as a wire would; they pin TF contrib's golden numbers and the server's
contract. The RPC tests start one process group per scenario on 127.0.0.1
(rank 0 serves, the others are workers; tests/agn/_agn_workers.py), with RPC
timeouts of a few seconds, a deadline per group, and every leftover process
killed.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _agn_workers as workers
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _deadlines import scaled
from _procs import free_port, run_ranks, torchrun
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torchgrad_compat.optim as tgo
from torchgrad_compat.agn import (
    AGNCheckpointWarning,
    AGNError,
    AGNNameInUseError,
    AGNOptimizer,
    AGNServerFullError,
    AGNServerUnavailableError,
    AGNWorkerLostWarning,
    LocalEndpoint,
    LocalServerHost,
    ParameterServer,
    RpcEndpoint,
)
from torchgrad_compat.agn.server import serve


def _local(params: list[torch.Tensor], optimizer_fn: Any, num_worker: int, **kwargs: Any):
    server = ParameterServer(params, optimizer_fn, num_worker, **kwargs)
    host = LocalServerHost()
    host.start(server)
    return server, host


def _gd(params: list[torch.Tensor], lr: float = 1.0) -> tgo.GradientDescentOptimizer:
    return tgo.GradientDescentOptimizer(params, learning_rate=lr)


# ---------------------------------------------------------------------- TF's golden tests
def test_tf_golden_one_worker_period4():
    _, host = _local(workers.tf_vars(), workers.tf_adam, 1)
    trace = workers.one_worker_period4(host.endpoint("worker1"))
    assert [gs for _, _, gs in trace] == [0, 0, 0, 1, 1, 1, 1, 2]


def test_tf_golden_two_workers_period1_interleaved():
    server, host = _local(workers.tf_vars(partitioned=True), workers.tf_adam, 2)
    params = [workers.tf_vars(partitioned=True) for _ in range(2)]
    opts = [
        AGNOptimizer(workers.tf_adam(ps), 2, 1, server=host.endpoint(f"worker{i}"))
        for i, ps in enumerate(params)
    ]
    for k in range(6):
        opts[k % 2].apply_gradients(workers.tf_grads(params[k % 2]))
        expected = round(0.1 * (k + 1), 6)
        offsets = [0.0, 0.5, 0.0]
        for c, off in zip(server.center, offsets):
            assert torch.allclose(c, torch.full_like(c, off + expected), rtol=0, atol=1e-6), (k, c)
    assert server.global_step == 6 and [o.global_step for o in opts] == [5, 6]


# ---------------------------------------------------------------------- the algorithm
def test_push_is_the_mean_raw_gradient_and_local_slots_survive_the_pull():
    server, host = _local([torch.zeros(2)], _gd, 1)
    p = torch.zeros(2)
    local = tgo.MomentumOptimizer([p], learning_rate=0.5, momentum=0.9)
    opt = AGNOptimizer(local, 1, 4, server=host.endpoint("w"))
    grads = [
        torch.tensor([1.0, 2.0]),
        torch.tensor([3.0, -2.0]),
        torch.tensor([-1.0, 4.0]),
        torch.tensor([5.0, 0.0]),
    ]
    for g in grads[:3]:
        opt.apply_gradients([(g, p)])
        assert torch.equal(server.center[0], torch.zeros(2))
    assert not torch.equal(p, torch.zeros(2))
    opt.apply_gradients([(grads[3], p)])
    mean = torch.stack(grads).sum(0) / 4
    assert torch.equal(server.center[0], -mean)
    assert torch.equal(p, server.center[0])
    assert all(torch.equal(a, torch.zeros(2)) for a in opt._accumulators)
    assert torch.equal(opt.get_slot(p, "momentum"), _momentum_after(grads))
    assert opt.local_step == 4 and opt.global_step == 1


def _dense_as_tf(indices: np.ndarray, values: np.ndarray, rows: int) -> np.ndarray:
    """TF's dense form of an IndexedSlices (unsorted_segment_sum): from zero, each entry's values
    added to its row in the order given, in float32."""
    dense = np.zeros((rows, *values.shape[1:]), np.float32)
    for row, value in zip(indices, values):
        dense[row] = dense[row] + value
    return dense


@pytest.mark.parametrize("loss_scale", [None, "dynamic"])
def test_sparse_gradients_are_accumulated_as_tf_adds_their_dense_sums(loss_scale):
    # TF's worker adds each step's IndexedSlices to its accumulator as a dense tensor, the
    # duplicate rows summed first in the order given. A row holds a large value and, later, its
    # negation: what is left between them keeps the roundings of that order, and an accumulator
    # that took the entries one by one would keep others.
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(2):
        indices = rng.integers(0, 3, 24)
        values = rng.standard_normal((24, 2)).astype(np.float32)
        for row in range(3):
            at = np.flatnonzero(indices == row)
            values[at[0]] *= 2**20
            values[at[-1]] = -values[at[0]]
        steps.append((indices, values))
    server, host = _local([torch.zeros(3, 2)], _gd, 1)
    p = torch.zeros(3, 2)
    inner: Any = _gd([p])
    if loss_scale is not None:
        from torchgrad_compat.amp import LossScaleOptimizer

        inner = LossScaleOptimizer(inner, loss_scale=loss_scale)
    opt = AGNOptimizer(inner, 1, 2, server=host.endpoint("w"))
    for indices, values in steps:
        g = torch.sparse_coo_tensor(torch.tensor(indices)[None], torch.tensor(values), (3, 2))
        opt.apply_gradients([(g, p)])
    accumulated = _dense_as_tf(*steps[0], 3) + _dense_as_tf(*steps[1], 3)
    assert server.global_step == 1
    assert torch.equal(server.center[0], -torch.from_numpy(accumulated / np.float32(2)))


def _momentum_after(grads: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros(2)
    for g in grads:
        acc = acc * 0.9 + g
    return acc


def test_server_optimizer_state_advances_once_per_push():
    """Not TF's shared Adam: the server's beta1_power moves per push, the worker's per local step."""
    server, host = _local([torch.zeros(2)], lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.1), 1)
    p = torch.zeros(2)
    opt = AGNOptimizer(tgo.AdamOptimizer([p], learning_rate=0.1), 1, 2, server=host.endpoint("w"))
    for _ in range(6):
        opt.apply_gradients([(torch.ones(2), p)])
    server_power = server.optimizer.state_dict()["param_groups"][0]["beta1_power"]
    local_power = opt.inner_optimizer.state_dict()["param_groups"][0]["beta1_power"]
    assert math.isclose(server_power.item(), 0.9**4, rel_tol=1e-6)  # 3 pushes
    assert math.isclose(local_power.item(), 0.9**7, rel_tol=1e-6)  # 6 local steps


@pytest.mark.parametrize("inner", ["tgo", "torch"])
def test_step_and_apply_gradients_agree(inner):
    def make() -> tuple[torch.Tensor, AGNOptimizer, ParameterServer]:
        server, host = _local([torch.ones(3)], lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.5), 1)
        p = torch.ones(3, requires_grad=True)
        local = tgo.AdamOptimizer([p], learning_rate=0.1) if inner == "tgo" else torch.optim.Adam([p], lr=0.1)
        return p, AGNOptimizer(local, 1, 3, server=host.endpoint("w")), server

    (p1, o1, s1), (p2, o2, s2) = make(), make()
    for i in range(7):
        g = torch.tensor([1.0, -2.0, 0.5]) * (i + 1)
        p1.grad = g.clone()
        o1.step()
        o2.apply_gradients([(g.clone(), p2)])
    assert (
        torch.equal(p1, p2)
        and torch.equal(s1.center[0], s2.center[0])
        and o1.global_step == o2.global_step == 2
    )


def test_minimize_is_compute_gradients_then_apply_gradients():
    def run(style: str) -> tuple[torch.Tensor, ParameterServer]:
        server, host = _local([torch.ones(2)], _gd, 1)
        w = torch.ones(2, requires_grad=True)
        opt = AGNOptimizer(tgo.AdamOptimizer([w], 0.1), 1, 2, server=host.endpoint("w"))
        step = torch.tensor(0)
        for _ in range(4):
            if style == "minimize":
                opt.minimize(lambda: (w * w * torch.tensor([1.0, 3.0])).sum(), global_step=step)
            else:
                opt.apply_gradients([(2 * w.detach() * torch.tensor([1.0, 3.0]), w)], global_step=step)
        assert int(step) == 2
        return w.detach(), server

    (w1, s1), (w2, s2) = run("minimize"), run("apply")
    assert torch.equal(w1, w2) and torch.equal(s1.center[0], s2.center[0])


def test_parameters_without_gradient_are_not_pushed():
    server, host = _local([torch.zeros(1), torch.zeros(1)], lambda ps: torch.optim.Adam(ps, lr=0.1), 1)
    a, b = torch.zeros(1), torch.zeros(1)
    opt = AGNOptimizer(tgo.GradientDescentOptimizer([a, b], 0.1), 1, 1, server=host.endpoint("w"))
    opt.apply_gradients([(torch.ones(1), a), (None, b)])
    assert server.center[1].item() == 0.0 and server.center[0].item() != 0.0
    assert len(server.optimizer.state) == 1


def test_state_dict_round_trip_mid_period():
    _, host = _local([torch.zeros(2)], _gd, 3)
    p = torch.zeros(2)
    opt = AGNOptimizer(tgo.AdamOptimizer([p], 0.1), 3, 4, server=host.endpoint("w"))
    opt.apply_gradients([(torch.ones(2), p)])
    state = opt.state_dict()
    q = torch.zeros(2)
    other = AGNOptimizer(tgo.AdamOptimizer([q], 0.1), 3, 4, server=host.endpoint("w2"))
    assert set(state) == {"state", "param_groups"}
    other.load_state_dict(state)
    assert (
        other.local_step == 1 and torch.equal(other._accumulators[0], torch.ones(2)) and other._pending == {0}
    )
    # The earlier layout, built literally, loads the same.
    old = _old_layout({})(copy.deepcopy(state))
    r = torch.zeros(2)
    third = AGNOptimizer(tgo.AdamOptimizer([r], 0.1), 3, 4, server=host.endpoint("w3"))
    third.load_state_dict(old)
    assert (
        third.local_step == 1 and torch.equal(third._accumulators[0], torch.ones(2)) and third._pending == {0}
    )
    _assert_same_state(third.inner_optimizer.state_dict(), other.inner_optimizer.state_dict())


# ---------------------------------------------------------------------- the server's contract
def test_concurrent_pushes_are_applied_exactly_once_each():
    """4 threads × 200 pushes of 2**-k: the exact sum whatever the order, and exactly 800 updates."""
    server, host = _local([torch.zeros(4)], _gd, 4)
    pushes = 200

    def worker(k: int) -> None:
        p = torch.zeros(4)
        opt = AGNOptimizer(_gd([p]), 4, 1, server=host.endpoint(f"w{k}"))
        for _ in range(pushes):
            opt.apply_gradients([(torch.full((4,), -(2.0**-k)), p)])
        opt.finish()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=scaled(30))
    assert server.done and server.global_step == 4 * pushes
    assert torch.equal(server.center[0], torch.full((4,), pushes * sum(2.0**-k for k in range(4))))
    assert [r.pushes for r in server.workers.values()] == [pushes] * 4


def test_a_repeated_push_is_not_applied_twice_and_a_replaced_incarnation_is_refused():
    _, host = _local([torch.zeros(1)], _gd, 1)
    ep = host.endpoint("w")
    session, _, _ = ep.join(1, [((1,), torch.float32)], startup_timeout=1)
    ep.request("push", session, 1, {0: torch.ones(1)})
    center, step = ep.request("push", session, 1, {0: torch.ones(1)})
    assert step == 1 and center[0].item() == -1.0
    ep.join(1, [((1,), torch.float32)], session, startup_timeout=1)
    with pytest.raises(AGNError, match="incarnation 1 was replaced by 2"):
        ep.request("push", session, 2, {0: torch.ones(1)})


def test_a_worker_cannot_finish_push_or_rejoin_under_another_workers_name():
    server, host = _local([torch.zeros(1)], _gd, 2)
    p = torch.zeros(1)
    victim = AGNOptimizer(_gd([p]), 2, 1, server=host.endpoint("victim"))
    intruder = host.endpoint("victim")
    with pytest.raises(AGNNameInUseError, match="a worker named 'victim' is running"):
        intruder.join(2, [((1,), torch.float32)], startup_timeout=0.3)
    for session in [1, (1, "0" * 32), (1, None)]:
        with pytest.raises(AGNError, match="wrong session key; only the process that joined as 'victim'"):
            intruder.request("finish", session)
        with pytest.raises(AGNError, match="wrong session key"):
            intruder.request("push", session, 7, {0: torch.ones(1)})
    victim.apply_gradients([(torch.ones(1), p)])
    assert server.global_step == 1 and victim.finish() == 1
    host.dead.add("victim")  # a finished (or dead) worker's name may be taken by a restarted process
    AGNOptimizer(_gd([torch.zeros(1)]), 2, 1, server=host.endpoint("victim"))


@pytest.mark.parametrize("seq", [math.inf, "4", 0, True])
def test_a_push_number_that_is_not_a_positive_int_is_refused(seq):
    # A float inf was applied, and then every later push was answered as a repeat, unapplied.
    server, host = _local([torch.zeros(2)], _gd, 1)
    p = torch.zeros(2)
    opt = AGNOptimizer(_gd([p]), 1, 1, server=host.endpoint("w"))
    with pytest.raises(ValueError, match=r"Invalid seq value: .*expected the push's number"):
        opt._endpoint.request("push", opt._session, seq, {0: torch.ones(2)})
    opt.apply_gradients([(torch.ones(2), p)])
    assert server.global_step == 1


@pytest.mark.parametrize(
    ("push", "error", "match"),
    [
        (
            {0: torch.ones(3, 2)},
            ValueError,
            r"gradient 0 is tensor\(shape=\(3, 2\), dtype=torch.float32\), the center",
        ),
        ({0: torch.ones(2, 3, dtype=torch.float64)}, ValueError, "dtype=torch.float64"),
        ({1: torch.ones(2, 3)}, ValueError, "names parameter 1; the center has 1 parameters"),
        ({0: torch.ones(2, 3).to_sparse()}, TypeError, "must be a dense tensor"),
        ([torch.ones(2, 3)], TypeError, "non-empty dict of parameter index to tensor, got list$"),
        ({}, TypeError, "non-empty dict of parameter index to tensor, got 0 entries"),
    ],
)
def test_bad_pushes_are_refused_and_leave_the_server_unchanged(push, error, match):
    server, host = _local([torch.zeros(2, 3)], lambda ps: torch.optim.Adam(ps, lr=0.1), 1)
    p = torch.zeros(2, 3)
    opt = AGNOptimizer(_gd([p]), 1, 1, server=host.endpoint("w"))
    before = server.state_dict()
    with pytest.raises(error, match=match):
        opt._endpoint.request("push", opt._session, 5, push)
    after = server.state_dict()
    assert torch.equal(before["center"][0], after["center"][0]) and after["global_step"] == 0
    opt.apply_gradients([(torch.ones(2, 3), p)])
    assert server.global_step == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"communication_period": 0}, ValueError, "communication_period must be >= 1, got 0"),
        ({"communication_period": -3}, ValueError, "communication_period must be >= 1, got -3"),
        ({"communication_period": 2.0}, TypeError, "communication_period must be an int"),
        ({"num_worker": 0}, ValueError, "num_worker must be an int >= 1, got 0"),
        ({"num_worker": 2}, ValueError, "serves num_worker=1, worker 'w' has num_worker=2"),
    ],
)
def test_bad_worker_arguments(kwargs, error, match):
    _, host = _local([torch.zeros(2)], _gd, 1)
    args = {"num_worker": 1, "communication_period": 1, **kwargs}
    with pytest.raises(error, match=match):
        AGNOptimizer(_gd([torch.zeros(2)]), server=host.endpoint("w"), **args)


@pytest.mark.parametrize(
    ("pairs", "error", "match"),
    [
        (lambda p: [(torch.ones(2), torch.zeros(2))], ValueError, "does not manage variable"),
        (lambda p: [(torch.ones(2), p), (torch.ones(2), p)], ValueError, "appears more than once"),
        (lambda p: [(torch.ones(3), p)], ValueError, r"shape"),
        (lambda p: [torch.ones(2)], TypeError, "must hold .gradient, variable. pairs"),
    ],
    ids=["stranger", "twice", "shape", "not_a_pair"],
)
def test_bad_pairs_are_refused_before_any_local_step(pairs, error, match):
    server, host = _local([torch.zeros(2)], _gd, 1)
    p = torch.zeros(2)
    opt = AGNOptimizer(_gd([p]), 1, 1, server=host.endpoint("w"))
    with pytest.raises(error, match=match):
        opt.apply_gradients(pairs(p))
    assert opt.local_step == 0 and torch.equal(p, torch.zeros(2)) and server.global_step == 0


def test_bad_server_arguments_and_mismatched_parameters(tmp_path):
    with pytest.raises(ValueError, match="num_worker must be an int >= 1, got 0"):
        ParameterServer([torch.zeros(1)], _gd, 0)
    with pytest.raises(ValueError, match="params must hold at least one tensor"):
        ParameterServer([], _gd, 1)
    with pytest.raises(ValueError, match="checkpoint_every=2 needs a checkpoint_path"):
        ParameterServer([torch.zeros(1)], _gd, 1, checkpoint_every=2)
    _, host = _local([torch.zeros(2)], _gd, 1)
    with pytest.raises(ValueError, match=r"worker 'w' has parameters \[\(\(3,\), torch.float32\)\]"):
        AGNOptimizer(_gd([torch.zeros(3)]), 1, server=host.endpoint("w"))


def test_a_worker_waits_for_a_late_server_then_gives_up_with_a_clear_error():
    host = LocalServerHost()
    threading.Timer(0.3, host.start, args=(ParameterServer([torch.ones(1)], _gd, 1),)).start()
    p = torch.zeros(1)
    AGNOptimizer(_gd([p]), 1, server=host.endpoint("w"), startup_timeout=scaled(5))
    assert p.item() == 1.0
    start = time.monotonic()
    with pytest.raises(AGNServerUnavailableError, match="'ps' was not serving within startup_timeout=0.3 s"):
        AGNOptimizer(_gd([torch.zeros(1)]), 1, server=LocalServerHost().endpoint("w"), startup_timeout=0.3)
    assert time.monotonic() - start < scaled(2)


def test_the_server_runs_only_its_own_requests():
    server, host = _local([torch.zeros(1)], _gd, 1)
    ep = host.endpoint("w")
    for method in ("mark_dead", "_save", "__init__", "optimizer"):
        with pytest.raises(AGNError, match=r"serves only \('join', 'push', 'finish', 'snapshot'\), not"):
            ep.request(method)
    assert server.workers == {}


def test_serve_returns_when_workers_finish_or_die_and_reports_the_dead():
    server, host = _local([torch.zeros(1)], _gd, 2)
    p, q = torch.zeros(1), torch.zeros(1)
    a = AGNOptimizer(_gd([p]), 2, 1, server=host.endpoint("a"))
    AGNOptimizer(_gd([q]), 2, 1, server=host.endpoint("b"))
    a.apply_gradients([(torch.ones(1), p)])
    a.finish()
    host.dead.add("b")
    with pytest.warns(AGNWorkerLostWarning, match=r"worker\(s\) \['b'\] stopped answering"):
        center = serve(server, host.is_alive, 0.01)
    assert center[0].item() == -1.0


def test_a_worker_past_num_worker_waits_for_a_free_slot_and_is_served_to_the_end():
    server, host = _local([torch.zeros(1)], _gd, 2)
    p, q, r = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    a = AGNOptimizer(_gd([p]), 2, 1, server=host.endpoint("a"))
    b = AGNOptimizer(_gd([q]), 2, 1, server=host.endpoint("b"))
    full = r"serves num_worker=2, and workers \['a', 'b'\] are running or finished; worker 'c' would be"
    with pytest.raises(AGNServerFullError, match=full):
        AGNOptimizer(_gd([r]), 2, 1, server=host.endpoint("c"), startup_timeout=0.3)
    a.apply_gradients([(torch.ones(1), p)])
    # A process restarted under another name waits until the server finds the old one dead.
    joined: list[AGNOptimizer] = []
    joining = threading.Thread(
        target=lambda: joined.append(
            AGNOptimizer(_gd([r]), 2, 1, server=host.endpoint("a2"), startup_timeout=scaled(10))
        )
    )
    joining.start()
    time.sleep(0.3)
    assert not joined
    host.dead.add("a")
    server.mark_dead("a")
    joining.join(timeout=scaled(10))
    (a2,) = joined
    # When b finishes the server is not done: it serves a2 to the end (it used to return with
    # a2's pushes still coming).
    b.apply_gradients([(torch.ones(1), q)])
    b.finish()
    assert not server.done
    finisher = threading.Timer(0.2, lambda: (a2.apply_gradients([(torch.ones(1), r)]), a2.finish()))
    finisher.start()
    with pytest.warns(AGNWorkerLostWarning, match=r"\['a'\] stopped answering"):
        center = serve(server, host.is_alive, 0.01)
    finisher.join(timeout=scaled(10))
    assert server.global_step == 3 and center[0].item() == -3.0
    # Every slot is held by a finished worker: one more is refused at once.
    with pytest.raises(ValueError, match=r"workers \['a2', 'b'\] are running or finished; worker 'd'"):
        AGNOptimizer(_gd([torch.zeros(1)]), 2, 1, server=host.endpoint("d"), startup_timeout=10)


# ---------------------------------------------------------------------- checkpoints
def test_checkpoint_is_weights_only_and_a_restored_server_continues_bitwise(tmp_path):
    path = tmp_path / "ps.pt"
    adam = lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.1)  # noqa: E731
    pushes = [{0: torch.randn(5, generator=torch.Generator().manual_seed(i))} for i in range(7)]

    reference = ParameterServer([torch.zeros(5)], adam, 1)
    inc, _, _ = reference.join("w", 1, [((5,), torch.float32)])
    for seq, push in enumerate(pushes, 1):
        reference.push("w", inc, seq, push)

    first = ParameterServer([torch.zeros(5)], adam, 1, checkpoint_path=path, checkpoint_every=2)
    inc, _, _ = first.join("w", 1, [((5,), torch.float32)])
    for seq, push in enumerate(pushes[:5], 1):
        first.push("w", inc, seq, push)
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == 4 and sorted(saved) == [
        "center",
        "format",
        "global_step",
        "optimizer",
        "sha256",
    ]

    second = ParameterServer([torch.zeros(5)], adam, 1, restore_from=path)
    inc, center, step = second.join("w", 1, [((5,), torch.float32)])
    assert step == 4 and torch.equal(center[0], saved["center"][0])
    for seq, push in enumerate(pushes[4:], 1):
        second.push("w", inc, seq, push)
    assert torch.equal(second.center[0], reference.center[0]) and second.global_step == 7
    with pytest.raises(ValueError, match="holds parameters"):
        ParameterServer([torch.zeros(6)], adam, 1, restore_from=path)


# ---------------------------------------------------------------------- real RPC processes
# A group that has not reported by then (scaled) fails instead of stalling the run. Measured on
# 2 cores: 12-20 s quiet, 30-55 s under a load of 6-8 (the whole suite beside other jobs).
GROUP_DEADLINE_S = 120


def _run_group(world: int, scenario: str, **options: Any) -> dict[int, tuple[str | None, Any]]:
    """Start ``world`` processes ; ``{rank: (traceback or None, result)}`` of those that reported."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(world)
    messages = run_ranks(
        workers.run_process,
        world,
        lambda rank, port, results: (rank, world, port, scenario, options, results, barrier),
        expected=world,
        deadline_s=GROUP_DEADLINE_S,
    )
    return {rank: (error, result) for rank, error, result in messages}


def _ok(outcomes: dict[int, tuple[str | None, Any]], ranks: list[int]) -> list[Any]:
    missing = [r for r in ranks if r not in outcomes]
    assert not missing, f"no result from ranks {missing} (crashed or hung); got {outcomes}"
    failures = {r: outcomes[r][0] for r in ranks if outcomes[r][0] is not None}
    assert not failures, "\n".join(f"--- rank {r}:\n{e}" for r, e in failures.items())
    return [outcomes[r][1] for r in ranks]


@pytest.fixture(scope="module")
def one_worker_phases() -> tuple[Any, Any, Any]:
    server, worker = _ok(_run_group(2, "one_worker_phases"), [0, 1])
    return tuple(zip(server, worker, strict=True))


def test_rpc_tf_golden_one_worker_period4(one_worker_phases):
    server, worker = one_worker_phases[0]
    assert [gs for _, _, gs in worker] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert server["lost"] == [] and server["center"] == pytest.approx([0.2, 0.7], abs=1e-6)


@pytest.fixture(scope="module")
def golden_two_then_server_dies() -> tuple[Any, Any]:
    out = _run_group(3, "golden_two_then_server_dies", kill_after=5, abrupt_shutdown=True)
    assert 0 not in out, "the server was meant to die in the second phase"
    first, second = zip(*_ok(out, [1, 2]))
    return first, second


def test_rpc_tf_golden_two_workers_period1(golden_two_then_server_dies):
    seen = golden_two_then_server_dies[0]
    # Each worker saw the center move by 0.1 per push; 6 pushes in all.
    assert all(len(s) == 3 for s in seen) and max(max(s) for s in seen) == pytest.approx(0.6, abs=1e-6)


def test_rpc_bad_input_gets_clear_errors_and_the_server_keeps_serving(one_worker_phases):
    server, worker = one_worker_phases[1]
    errors = worker["errors"]
    assert errors["shape"].startswith("ValueError") and "shape=(3, 2)" in errors["shape"]
    assert "dtype=torch.float64" in errors["dtype"] and "names parameter 5" in errors["index"]
    assert errors["sparse"].startswith("TypeError") and errors["not_a_dict"].startswith("TypeError")
    assert "num_worker=2" in errors["join_num_worker"] and "(3,)" in errors["join_shape"]
    assert all("non-finite values" in errors[k] for k in ("nan", "inf")), errors
    assert "a worker named 'worker1' is running" in errors["intruder_join"], errors
    assert "over RPC a worker is named by its RPC name" in errors["custom_name"], errors
    assert all("wrong session key" in errors[k] for k in ("intruder_push", "intruder_finish")), errors
    assert worker["after"] == [[-1.0] * 3] * 2 and worker["global_step"] == 1
    assert server["center"] == [[[-1.0] * 3] * 2]


def test_rpc_concurrent_workers_late_server_late_worker_and_a_killed_worker():
    """3 workers; the server serves 1 s late, worker 1 joins after 5 updates, worker 3 dies after 3 pushes."""
    pushes = 20
    out = _run_group(
        4, "concurrent_one_dies", pushes=pushes, server_delay_s=1.0, late_worker_after=5, abrupt_shutdown=True
    )
    assert 3 not in out, "worker3 was meant to die"
    server, late, early = _ok(out, [0, 1, 2])
    assert len(server["lost"]) == 1 and "['worker3']" in server["lost"][0]
    assert late["joined_at"] >= 5, "worker 1 joins late and starts from the center of then"
    # Every push applied exactly once: 20 of 2**-1, 20 of 2**-2 and the dead worker's 3 of 2**-3.
    assert server["center"] == [[pushes * (0.5 + 0.25) + 3 * 0.125] * 3]
    assert max(late["finished_at"], early["finished_at"]) == 2 * pushes + 3


def test_rpc_a_server_that_stops_answering_gives_a_typed_error_in_time(one_worker_phases):
    server, worker = one_worker_phases[2]
    assert "AGN server 'ps' did not answer 'push' from worker 'worker1'" in worker["error"]
    assert "ran for more than" in worker["error"] or "timed out" in worker["error"]
    assert workers.RPC_TIMEOUT_S - 0.5 < worker["seconds"] < workers.RPC_TIMEOUT_S + scaled(3)
    # The slow update was applied once, after the worker gave up on it; the server went on.
    assert worker["finished_at"] == 2 and server["center"] == [[-2.0]]


def test_rpc_a_killed_server_gives_every_worker_a_typed_error_in_time(golden_two_then_server_dies):
    for result in golden_two_then_server_dies[1]:
        assert result["error"] is not None, "the worker did not notice the dead server"
        assert "AGN server 'ps' did not answer 'push' from worker 'worker" in result["error"]
        assert result["seconds"] < workers.RPC_TIMEOUT_S + scaled(3)


def test_rpc_server_restarted_from_a_checkpoint_continues(tmp_path):
    path = str(tmp_path / "ps.pt")
    out = _run_group(2, "checkpointed", pushes=5, pushes_after=3, checkpoint_path=path)
    (first, second), (before, after) = _ok(out, [0, 1])
    assert before["finished_at"] == 5 and after["joined_at"] == 4 and after["finished_at"] == 7
    # The checkpoint of update 4, then the second run's 3 pushes, replayed in one process: the same center.
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == 4
    reference = ParameterServer([torch.zeros(4)], workers.checkpoint_adam, 1, restore_from=path)
    inc, _, _ = reference.join("w", 1, [((4,), torch.float32)])
    for k in range(3):
        reference.push("w", inc, k + 1, {0: workers.checkpoint_push(k)})
    assert second["center"] == [reference.center[0].tolist()]
    assert first["center"] != second["center"]


def test_train_agn_script_under_torchrun(tmp_path):
    """docs/agn.md's command: torchrun, one server and two workers on 127.0.0.1; the center learns."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "train_agn.py"
    returncode, output = torchrun([str(script), "--steps", "60"], nproc=3, deadline_s=GROUP_DEADLINE_S)
    assert returncode == 0, output
    before, after = (float(a) for a in re.findall(r"center accuracy (?:before|after) (\d\.\d+)", output))
    assert after > before + 0.3, output
    assert re.search(r"worker1: step 60 .* global_step \d+", output) and "worker2: step 60" in output, output


# ---------------------------------------------------------------------- faults: checkpoints and poison
def test_checkpoint_path_in_a_missing_directory_is_refused_at_start(tmp_path):
    path = tmp_path / "missing" / "ps.pt"
    with pytest.raises(ValueError, match=r"Invalid checkpoint_path value: .*missing.*; expected a file in"):
        ParameterServer([torch.zeros(1)], _gd, 1, checkpoint_path=path, checkpoint_every=1)


def test_a_failed_save_neither_fails_nor_repeats_the_push(tmp_path):
    """The directory vanishes mid-run: every push is applied exactly once, the server warns and retries."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    server, host = _local([torch.zeros(1)], _gd, 1, checkpoint_path=folder / "ps.pt", checkpoint_every=1)
    p = torch.zeros(1)
    opt = AGNOptimizer(_gd([p]), 1, 1, server=host.endpoint("w"))
    opt.apply_gradients([(torch.ones(1), p)])
    (folder / "ps.pt").unlink()
    folder.rmdir()
    with pytest.warns(AGNCheckpointWarning, match=r"could not save its checkpoint .*ps.pt at update 2"):
        opt.apply_gradients([(torch.ones(1), p)])
    with pytest.warns(AGNCheckpointWarning, match="at update 3"):
        opt.apply_gradients([(torch.ones(1), p)])
    assert server.global_step == 3 and server.center[0].item() == -3.0 and p.item() == -3.0
    folder.mkdir()
    opt.apply_gradients([(torch.ones(1), p)])
    assert torch.load(folder / "ps.pt", weights_only=True)["global_step"] == 4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_pushes_are_refused_and_leave_the_center_unchanged(bad):
    server, host = _local([torch.zeros(3)], lambda ps: torch.optim.Adam(ps, lr=0.1), 2)
    p = torch.zeros(3)
    opt = AGNOptimizer(_gd([p]), 2, 1, server=host.endpoint("w"))
    with pytest.raises(ValueError, match=r"push from worker 'w': gradient 0 has non-finite values"):
        opt.apply_gradients([(torch.tensor([1.0, bad, 1.0]), p)])
    assert server.global_step == 0 and torch.equal(server.center[0], torch.zeros(3))
    assert server.optimizer.state_dict()["state"] == {}


def test_a_refused_push_is_not_sent_again():
    """The worker gets the refusal once: its later pushes are applied and finish() answers (the
    refused push was kept as if its answer had been lost, and refused again at every period)."""
    server, host = _local([torch.zeros(2)], lambda ps: tgo.GradientDescentOptimizer(ps, 1.0), 1)
    p = torch.zeros(2)
    opt = AGNOptimizer(tgo.GradientDescentOptimizer([p], 0.0), 1, 1, server=host.endpoint("w"))
    with pytest.raises(ValueError, match="non-finite values"):
        opt.apply_gradients([(torch.tensor([float("nan"), 1.0]), p)])
    for _ in range(3):
        opt.apply_gradients([(torch.ones(2), p)])
    assert server.global_step == 3 and torch.equal(server.center[0], torch.full((2,), -3.0))
    assert opt.finish() == 3


def test_a_planted_symlink_beside_the_checkpoint_is_never_written_through(tmp_path):
    """Another user of the directory plants symlinks at the names a server might write first
    (``ps.pt.tmp``, the name the server used to write to): the server checks its path and saves
    through files of its own, and the symlinks' targets stay as they were."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "ps.pt"
    (tmp_path / "ps.pt.tmp").symlink_to(victim)
    _saved_checkpoint(tmp_path)
    assert victim.read_bytes() == b"precious"
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ps.pt", "ps.pt.tmp", "victim"]


def _saved_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "ps.pt"
    server = ParameterServer(
        [torch.zeros(4)], lambda ps: tgo.AdamOptimizer(ps, 0.1), 1, checkpoint_path=path, checkpoint_every=1
    )
    inc, _, _ = server.join("w", 1, [((4,), torch.float32)])
    server.push("w", inc, 1, {0: torch.arange(4.0)})
    return path


def test_a_checkpoint_with_flipped_bytes_is_refused(tmp_path):
    path = _saved_checkpoint(tmp_path)
    data = bytearray(path.read_bytes())
    center = torch.load(path, weights_only=True)["center"][0]
    # Flip the 4 bytes of one center value where they lie in the file: the file still loads.
    where = bytes(data).find(center.numpy().tobytes())
    assert where > 0
    for i in range(where + 4, where + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)
    with pytest.raises(ValueError, match=r"fails its checksum"):
        ParameterServer([torch.zeros(4)], _gd, 1, restore_from=path)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ValueError, match=r"cannot be read"):
        ParameterServer([torch.zeros(4)], _gd, 1, restore_from=path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s["center"][0].fill_(float("nan")), r"center\[0\] has non-finite values"),
        (lambda s: s.update(global_step=-5), r"global_step must be an int >= 0, got -5"),
        (
            lambda s: s["optimizer"]["param_groups"][0].update(lr=float("nan")),
            r"param_groups\[0\]\['lr'\] is nan",
        ),
        (
            lambda s: s["optimizer"]["param_groups"][0]["beta1_power"].fill_(float("nan")),
            r"param_groups\[0\]\['beta1_power'\] is tensor\(nan\)",
        ),
        (lambda s: s.pop("center"), r"misses keys \['center'\]"),
        (lambda s: s.pop("global_step"), r"misses keys \['global_step'\]"),
    ],
    ids=["nan_center", "negative_step", "nan_lr", "nan_beta1_power", "no_center", "no_global_step"],
)
def test_a_checkpoint_with_bad_values_is_refused_with_a_named_error(tmp_path, edit, match):
    from torchgrad_compat.agn.server import checkpoint_digest

    path = _saved_checkpoint(tmp_path)
    state = torch.load(path, weights_only=True)
    edit(state)
    state["sha256"] = checkpoint_digest(state)  # a consistent file with a bad value in it
    torch.save(state, path)
    with pytest.raises(ValueError, match=match):
        ParameterServer([torch.zeros(4)], lambda ps: tgo.AdamOptimizer(ps, 0.1), 1, restore_from=path)


# ---------------------------------------------------------------------- AGN around loss scaling
def _loss_scaled_worker(period: int, loss_scale: Any = "dynamic"):
    from torchgrad_compat.amp import LossScaleOptimizer

    server, host = _local([torch.zeros(2)], _gd, 1)
    w = torch.zeros(2, requires_grad=True)
    lso = LossScaleOptimizer(_gd([w], lr=0.1), loss_scale=loss_scale)
    return server, w, lso, AGNOptimizer(lso, 1, period, server=host.endpoint("w"))


def _scaled_step(w: torch.Tensor, lso: Any, opt: AGNOptimizer, slope: list[float]) -> None:
    opt.zero_grad()
    lso.get_scaled_loss((w * torch.tensor(slope)).sum()).backward()
    opt.step()


@pytest.mark.parametrize(
    ("key", "bad", "match"),
    [
        ("agn_applied", torch.tensor(-5.0), "Invalid agn_applied value: -5.0"),
        ("agn_applied", torch.tensor(1.5), "Invalid agn_applied value: 1.5"),
        ("agn_seen", None, "Invalid agn_seen value of parameter 0"),
        ("agn_seen", torch.tensor(2.0), "Invalid agn_seen value of parameter 0"),
    ],
)
def test_agn_around_loss_scaling_refuses_bad_counts_at_load_and_changes_nothing(key, bad, match):
    # The push is divided by the applied-step count: a wrong one would move the center wrongly.
    _, w, lso, opt = _loss_scaled_worker(4)
    _scaled_step(w, lso, opt, [1.0, 2.0])
    state = copy.deepcopy(opt.state_dict())
    if key == "agn_applied":
        for group in state["param_groups"]:
            group[key] = bad
    else:
        state["state"][0][key] = bad
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert opt.local_step == 1 and torch.equal(
        after["state"][0]["agn_accumulator"], before["state"][0]["agn_accumulator"]
    )


def test_agn_around_loss_scaling_pushes_unscaled_gradients():
    server, w, lso, opt = _loss_scaled_worker(2)
    _scaled_step(w, lso, opt, [0.4, -1.0])
    _scaled_step(w, lso, opt, [1.2, 3.0])
    assert server.global_step == 1
    assert torch.allclose(server.center[0], -torch.tensor([0.8, 1.0]), rtol=0, atol=1e-6), server.center


def test_agn_around_loss_scaling_does_not_accumulate_skipped_steps():
    server, w, lso, opt = _loss_scaled_worker(3)
    _scaled_step(w, lso, opt, [1.0, 2.0])
    _scaled_step(w, lso, opt, [float("inf"), 5.0])  # skipped: the scale halves, nothing accumulates
    _scaled_step(w, lso, opt, [3.0, 4.0])
    assert float(lso.loss_scale()) == 2.0**14 and server.global_step == 1
    # The mean over the two applied steps.
    assert torch.equal(server.center[0], -torch.tensor([2.0, 3.0]))
    for _ in range(3):  # a period with only skipped steps pushes nothing
        _scaled_step(w, lso, opt, [float("nan"), 1.0])
    assert server.global_step == 1 and opt.local_step == 6


def test_agn_around_loss_scaling_tf_style_skips_like_the_loss_scale():
    server, w, lso, opt = _loss_scaled_worker(2)
    opt.apply_gradients([(torch.tensor([1.0, 1.0]), w)])
    opt.apply_gradients([(torch.tensor([float("inf"), 1.0]), w)])
    assert float(lso.loss_scale()) == 2.0**14
    assert server.global_step == 1 and torch.equal(server.center[0], -torch.tensor([1.0, 1.0]))


def test_agn_around_a_fixed_loss_scale_refuses_a_non_finite_push():
    server, w, lso, opt = _loss_scaled_worker(1, loss_scale=8.0)
    with pytest.raises(ValueError, match="non-finite values"):
        _scaled_step(w, lso, opt, [float("inf"), 1.0])
    assert server.global_step == 0 and torch.equal(server.center[0], torch.zeros(2))


# ---------------------------------------------------------------------- liveness
def test_a_known_worker_that_dies_before_joining_is_not_waited_for():
    server, host = _local([torch.zeros(1)], _gd, 2)
    host.known = ["a", "b"]
    p = torch.zeros(1)
    a = AGNOptimizer(_gd([p]), 2, 1, server=host.endpoint("a"))
    a.apply_gradients([(torch.ones(1), p)])
    a.finish()
    host.dead.add("b")  # never joined
    done = []
    thread = threading.Thread(target=lambda: done.append(serve(server, host.is_alive, 0.01, host.peers)))
    with pytest.warns(AGNWorkerLostWarning, match=r"\['b'\]"):
        thread.start()
        thread.join(timeout=scaled(10))
    assert done and done[0][0].item() == -1.0


def test_a_server_that_cannot_start_tells_its_workers_at_once(tmp_path):
    from torchgrad_compat.agn import run_parameter_server

    path = tmp_path / "ps.pt"
    path.write_bytes(b"not a checkpoint")
    host = LocalServerHost()
    host.known = ["w"]
    errors: list[str] = []

    def worker() -> None:
        start = time.monotonic()
        try:
            AGNOptimizer(_gd([torch.zeros(1)]), 1, server=host.endpoint("w"), startup_timeout=scaled(30))
        except AGNError as e:
            errors.append(f"{time.monotonic() - start:.1f} {type(e).__name__}: {e}")

    thread = threading.Timer(0.2, worker)
    thread.start()
    with pytest.raises(ValueError, match="cannot be read"):
        run_parameter_server(
            [torch.zeros(1)], _gd, 1, restore_from=path, transport=host, refuse_for=scaled(20)
        )
    thread.join(timeout=scaled(30))
    assert errors and "AGNError: AGN server 'ps' could not start: ValueError: AGN checkpoint" in errors[0]
    assert float(errors[0].split()[0]) < scaled(5), errors


def test_a_server_torn_down_by_sigterm_saves_its_center_first(tmp_path):
    from torchgrad_compat.agn import run_parameter_server

    path = tmp_path / "ps.pt"
    host = LocalServerHost()

    def worker() -> None:
        p = torch.zeros(1)
        opt = AGNOptimizer(_gd([p]), 1, 1, server=host.endpoint("w"), startup_timeout=scaled(10))
        for _ in range(3):
            opt.apply_gradients([(torch.ones(1), p)])
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=worker)
    thread.start()
    with pytest.raises(SystemExit):
        run_parameter_server(
            [torch.zeros(1)], _gd, 1, checkpoint_path=path, checkpoint_every=100, transport=host
        )
    thread.join(timeout=scaled(10))
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == 3 and saved["center"][0].item() == -3.0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_rpc_a_corrupt_checkpoint_reaches_workers_at_once_and_an_early_death_ends_the_wait(tmp_path):
    corrupt = tmp_path / "ps.pt"
    corrupt.write_bytes(b"\x00" * 64)
    out = _run_group(3, "cannot_start_then_early_death", corrupt=str(corrupt), abrupt_shutdown=True)
    assert 2 not in out, "worker2 was meant to die before it joined"
    (refused, server), (told, finished) = _ok(out, [0, 1])
    assert "cannot be read" in refused and "could not start: ValueError: AGN checkpoint" in told["error"]
    assert told["seconds"] < scaled(30), told  # startup_timeout=60 (scaled): it did not wait for it
    assert finished == 1 and server["center"] == [[-1.0]]
    assert len(server["lost"]) == 1 and "['worker2']" in server["lost"][0]


# ---------------------------------------------------------------------- init_rpc_from_env
_INIT_RPC = """
import sys, time
import torch.distributed.rpc as rpc
from torchgrad_compat.agn import init_rpc_from_env
name = init_rpc_from_env(startup_timeout=float(sys.argv[1]))
print("up", name, flush=True)
time.sleep(float(sys.argv[2]))
rpc.shutdown()
"""


def _init_rpc_process(
    rank: int, world: int, port: int, startup_timeout: float, hold: float
) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    env.update(MASTER_PORT=str(port), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("TP_SOCKET_IFNAME", None)
    command = [sys.executable, "-c", _INIT_RPC, str(startup_timeout), str(hold)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _listening(pid: int) -> list[str]:
    """``address:port`` of every TCP socket that process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing (the process is still starting up)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                assert len(address) == width
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if table == "tcp" else socket.AF_INET6
                found.append(f"{socket.inet_ntop(family, words)}:{int(port, 16)}")
    return found


def test_init_rpc_from_env_gives_up_within_startup_timeout():
    proc = _init_rpc_process(1, 2, free_port(), startup_timeout=2, hold=0)
    start = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=scaled(60))
    finally:
        proc.kill()
    assert proc.returncode != 0 and time.monotonic() - start < scaled(30), output
    assert "AGNServerUnavailableError: AGN rendezvous at 127.0.0.1:" in output, output
    assert "(rank 1 of 2) did not complete within startup_timeout=2.0 s" in output, output


def test_init_rpc_from_env_listens_on_the_configured_address_only():
    port = free_port()
    # Each process holds its group for 4 s (scaled) after it is up, while the test reads its sockets.
    procs = [_init_rpc_process(0, 2, port, startup_timeout=scaled(60), hold=scaled(4))]
    try:
        deadline = time.monotonic() + scaled(30)
        while not _listening(procs[0].pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        store = _listening(procs[0].pid)
        assert store == [f"127.0.0.1:{port}"], store
        procs.append(_init_rpc_process(1, 2, port, startup_timeout=scaled(60), hold=scaled(4)))
        for proc in procs:
            lines = iter(proc.stdout.readline, "")  # torch may warn first
            assert any(line.startswith("up") for line in lines), proc.communicate(timeout=scaled(30))[0]
        every = [address for proc in procs for address in _listening(proc.pid)]
        assert every and all(a.startswith("127.0.0.1:") for a in every), every
        outputs = [proc.communicate(timeout=scaled(30))[0] for proc in procs]
        assert all(proc.returncode == 0 for proc in procs), outputs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------- scripts/train_agn.py under faults
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_agn.py"


def _wait_for_line(proc: subprocess.Popen, pattern: str, lines: list[str], timeout: float) -> re.Match:
    """Read ``proc``'s output into ``lines`` until a line matches ``pattern`` (a reader thread bounds it)."""
    found: list[re.Match] = []

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)
            if not found and (match := re.search(pattern, line)):
                found.append(match)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, f"no line matching {pattern!r} within {timeout} s:\n{''.join(lines)}"
    return found[0]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_train_agn_a_killed_worker_leaves_no_process_stuck():
    """Three processes started by hand (no torchrun): worker2 is killed mid-run; the other two exit."""
    port = free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=str(port), PYTHONPATH=str(SCRIPT.parents[1]))
        command = [sys.executable, str(SCRIPT), "--steps", "400", "--rpc-timeout", str(scaled(5))]
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        lines: list[str] = []
        pid = int(
            _wait_for_line(procs[2], r"worker2: joined at global_step \d+ \(pid (\d+)\)", lines, scaled(60))[
                1
            ]
        )
        os.kill(pid, signal.SIGKILL)
        outputs = [proc.communicate(timeout=scaled(GROUP_DEADLINE_S))[0] for proc in procs[:2]]
        assert [proc.returncode for proc in procs[:2]] == [0, 0], outputs
        assert "worker(s) ['worker2'] stopped answering" in outputs[0], outputs[0]
        assert "worker1: step 400 " in outputs[1], outputs[1]
    finally:
        for proc in procs:
            _kill_group(proc)


def test_train_agn_under_torchrun_a_killed_worker_still_leaves_a_checkpoint(tmp_path):
    """torchrun tears the job down when a worker dies (SIGTERM): the server saves its center first."""
    path = tmp_path / "ps.pt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "3",
        "--master-addr",
        "127.0.0.1",
    ]
    command += ["--master-port", str(free_port()), str(SCRIPT), "--steps", "400", "--checkpoint", str(path)]
    command += ["--checkpoint-every", "1000000"]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        lines: list[str] = []
        pid = int(
            _wait_for_line(proc, r"worker2: joined at global_step \d+ \(pid (\d+)\)", lines, scaled(60))[1]
        )
        _wait_for_line(proc, r"worker2: step 100 ", lines, scaled(60))
        os.kill(pid, signal.SIGKILL)
        output = "".join(lines) + proc.communicate(timeout=scaled(GROUP_DEADLINE_S))[0]
        assert proc.returncode != 0, output
    finally:
        _kill_group(proc)
    assert path.exists(), output
    restored = ParameterServer(
        [torch.zeros(32, 16), torch.zeros(32), torch.zeros(4, 32), torch.zeros(4)],
        lambda ps: tgo.AdamOptimizer(ps, 0.01),
        2,
        restore_from=path,
    )
    assert restored.global_step > 0


class _LosesAnswers(LocalEndpoint):
    """Applies the next ``lose`` pushes on the server, then raises as if their answers were lost."""

    lose = 0

    def request(self, method: str, *args: Any) -> Any:
        answer = super().request(method, *args)
        if method == "push" and self.lose:
            self.lose -= 1
            raise AGNServerUnavailableError("AGN server 'ps' did not answer 'push' (the answer was lost)")
        return answer


def test_a_push_whose_answer_was_lost_is_sent_again_and_counted_once():
    server, host = _local([torch.zeros(1)], _gd, 1)
    endpoint = _LosesAnswers(host, "w")
    p = torch.zeros(1)
    opt = AGNOptimizer(_gd([p]), 1, 1, server=endpoint)
    endpoint.lose = 1
    with pytest.raises(AGNServerUnavailableError, match="answer was lost"):
        opt.apply_gradients([(torch.ones(1), p)])
    assert server.center[0].item() == -1.0
    opt.apply_gradients([(torch.full((1,), 2.0), p)])  # sends the lost push again (ignored), then its own
    assert server.global_step == 2 and server.center[0].item() == -3.0 and p.item() == -3.0
    endpoint.lose = 1
    with pytest.raises(AGNServerUnavailableError):
        opt.apply_gradients([(torch.full((1,), 4.0), p)])
    assert opt.finish() == 3 and server.center[0].item() == -7.0


def test_join_timeout_bounds_the_wait_for_workers_that_never_make_contact():
    from torchgrad_compat.agn import run_parameter_server

    host = LocalServerHost()

    def worker() -> None:
        p = torch.zeros(1)
        opt = AGNOptimizer(_gd([p]), 3, 1, server=host.endpoint("w"), startup_timeout=scaled(10))
        opt.apply_gradients([(torch.ones(1), p)])
        opt.finish()

    thread = threading.Thread(target=worker)
    thread.start()
    start = time.monotonic()
    with pytest.warns(AGNWorkerLostWarning, match=r"2 never joined within join_timeout=1.5 s"):
        center = run_parameter_server(
            [torch.zeros(1)], _gd, 3, transport=host, liveness_interval=0.05, join_timeout=1.5
        )
    thread.join(timeout=scaled(10))
    assert center[0].item() == -1.0 and 1.5 <= time.monotonic() - start < scaled(10)
    with pytest.raises(ValueError, match="Invalid join_timeout value: 0"):
        run_parameter_server([torch.zeros(1)], _gd, 1, transport=LocalServerHost(), join_timeout=0)


def test_a_restarted_worker_takes_its_name_back_once_the_server_finds_the_old_process_dead():
    server, host = _local([torch.zeros(1)], _gd, 1)
    p = torch.zeros(1)
    old = AGNOptimizer(_gd([p]), 1, 1, server=host.endpoint("w"))
    old.apply_gradients([(torch.ones(1), p)])
    # The old process "dies"; the liveness probe finds out a little later than the restart.
    threading.Timer(0.5, server.mark_dead, args=("w",)).start()
    start = time.monotonic()
    restarted = AGNOptimizer(
        _gd([torch.zeros(1)]), 1, 1, server=host.endpoint("w"), startup_timeout=scaled(10)
    )
    assert 0.4 < time.monotonic() - start < scaled(5) and restarted.global_step == 1
    with pytest.raises(AGNError, match="incarnation 1 was replaced by 2"):
        old.apply_gradients([(torch.ones(1), p)])


def _assert_same_state(a, b):
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert all(torch.equal(a["state"][key][k], b["state"][key][k]) for k in b["state"][key])
    for x, y in zip(a["param_groups"], b["param_groups"], strict=True):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)


def _set_param_state(key, value):
    def change(state):
        state["state"][0][key] = value
        return state

    return change


def _drop_param_state(key):
    def change(state):
        del state["state"][0][key]
        return state

    return change


def _set_group(key, value):
    def change(state):
        state["param_groups"][0][key] = value
        return state

    return change


def _old_layout(agn_change):
    """The earlier layout, ``{"optimizer": ..., "agn": {...}}``, built literally, with ``agn_change``."""

    def change(state):
        accumulator = state["state"][0]["agn_accumulator"]
        inner = {
            "state": {0: {k: v for k, v in state["state"][0].items() if not k.startswith("agn_")}},
            "param_groups": [{k: v for k, v in state["param_groups"][0].items() if not k.startswith("agn_")}],
        }
        agn = {"local_step": 1, "global_step": 0, "accumulators": [accumulator], "pending": [0]}
        return {"optimizer": inner, "agn": {**agn, **agn_change}}

    return change


def _agn_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _agn_train(model: torch.nn.Module, opt: AGNOptimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _save_two_keys(model, opt, tmp_path):
    sd = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "state": sd["state"], "param_groups": sd["param_groups"]}, buffer
    )
    return buffer.getvalue()


def _load_two_keys(model, opt, saved):
    loaded = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict({"state": loaded["state"], "param_groups": loaded["param_groups"]})


def _dcp_save(model, opt, tmp_path):
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _dcp_load(model, opt, path):
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


@pytest.mark.parametrize(
    ("save", "load"), [(_save_two_keys, _load_two_keys), (_dcp_save, _dcp_load)], ids=["torch.save", "dcp"]
)
def test_worker_resumes_bitwise_through_torch_tools(save, load, tmp_path):
    """Checkpointed mid-period, a worker continues as the uninterrupted one: same pushes, same parameters."""
    period, split, steps = 3, 4, 8
    adam = lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.1)  # noqa: E731

    def worker(host, name, seed=0):
        model = _agn_model(seed)
        return model, AGNOptimizer(adam(list(model.parameters())), 1, period, server=host.endpoint(name))

    _, host_a = _local([p.detach().clone() for p in _agn_model().parameters()], adam, 1)
    model_a, opt_a = worker(host_a, "a")
    _agn_train(model_a, opt_a, range(steps))

    server_b, host_b = _local([p.detach().clone() for p in _agn_model().parameters()], adam, 1)
    model_b, opt_b = worker(host_b, "b")
    _agn_train(model_b, opt_b, range(split))
    saved = save(model_b, opt_b, tmp_path)
    server_b.mark_dead("b")  # its process stops; another takes over from the checkpoint
    model_c, opt_c = worker(host_b, "c", seed=1)
    load(model_c, opt_c, saved)
    assert opt_c.local_step == split and opt_c._pending
    _agn_train(model_c, opt_c, range(split, steps))

    assert opt_c.local_step == opt_a.local_step and opt_c.global_step == opt_a.global_step
    for x, y in zip(
        [*model_c.parameters(), *opt_c.variables(), *opt_c._accumulators],
        [*model_a.parameters(), *opt_a.variables(), *opt_a._accumulators],
        strict=True,
    ):
        assert torch.equal(x, y)


def test_dcp_state_initialisation_is_not_a_training_step():
    """DCP's get_state_dict steps a fresh optimizer with zero gradients: no local step, no push."""
    adam = lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.1)  # noqa: E731
    server, host = _local([p.detach().clone() for p in _agn_model().parameters()], adam, 1)
    model = _agn_model()
    opt = AGNOptimizer(adam(list(model.parameters())), 1, 1, server=host.endpoint("w"))
    get_state_dict(model, opt)
    assert server.global_step == 0 and opt.local_step == 0 and not opt._pending
    assert opt.get_slot(model.weight, "m") is not None  # the state DCP asked for exists


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            _set_param_state("agn_accumulator", torch.ones(3)),
            r"accumulator 0 must be a floating tensor of shape \(2,\)",
        ),
        (_drop_param_state("agn_accumulator"), r"accumulator 0 must be a floating tensor of shape \(2,\)"),
        (_set_param_state("agn_accumulator", torch.tensor([1.0, math.nan])), "Invalid accumulator 0 value"),
        (_set_group("agn_local_step", -1), "Invalid local_step value: -1"),
        (_old_layout({"accumulators": []}), "list of 1 tensors"),
        (_old_layout({"pending": [5]}), r"Invalid pending value: \[5\]"),
        (_old_layout({"local_step": -1}), "Invalid local_step value: -1"),
    ],
    ids=["shape", "missing", "nan", "local_step", "old-count", "old-pending", "old-local_step"],
)
def test_load_state_dict_checks_the_worker_state_before_loading_anything(change, match):
    _, host = _local([torch.zeros(2)], _gd, 2)
    p = torch.zeros(2)
    opt = AGNOptimizer(tgo.AdamOptimizer([p], 0.1), 2, 4, server=host.endpoint("w"))
    opt.apply_gradients([(torch.ones(2), p)])
    state = opt.state_dict()
    q = torch.zeros(2)
    other = AGNOptimizer(tgo.AdamOptimizer([q], 0.5), 2, 4, server=host.endpoint("w2"))
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(change(copy.deepcopy(state)))
    # Neither the wrapped optimizer nor the worker state was loaded half-way.
    assert not other.inner_optimizer.state and other.param_groups[0]["lr"] == 0.5
    assert (
        other.local_step == 0 and not other._pending and torch.equal(other._accumulators[0], torch.zeros(2))
    )


class _Unreachable(LocalEndpoint):
    """Raises for the next ``down`` pushes as if the server were unreachable (nothing applied)."""

    down = 0

    def request(self, method: str, *args: Any) -> Any:
        if method == "push" and self.down:
            self.down -= 1
            raise AGNServerUnavailableError("AGN server 'ps' did not answer 'push' (unreachable)")
        return super().request(method, *args)


def test_a_push_that_fails_twice_stays_a_push_of_its_own_period():
    # Each period's push is taken before the earlier one is sent again: two periods are not merged
    # into one push divided by one period.
    server, host = _local([torch.zeros(1)], _gd, 1)
    endpoint = _Unreachable(host, "w")
    p = torch.zeros(1)
    opt = AGNOptimizer(_gd([p]), 1, communication_period=2, server=endpoint)
    for step in range(8):
        endpoint.down = 2 if step in (1, 3) else 0
        with contextlib.suppress(AGNServerUnavailableError):
            opt.apply_gradients([(torch.ones(1), p)])
    assert opt.finish() == 4
    assert server.global_step == 4 and server.center[0].item() == -4.0  # four pushes of 1.0, none of 2.0


def test_a_gradient_that_does_not_fit_is_refused_before_it_is_accumulated():
    _, host = _local([torch.zeros(3)], _gd, 1)
    p = torch.zeros(3, requires_grad=True)
    opt = AGNOptimizer(_gd([p]), 1, communication_period=2, server=host.endpoint("w"))
    p.grad = torch.ones(3)
    p.grad.data = torch.ones(1)  # (torch checks p.grad = ..., not p.grad.data = ...)
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    assert opt.local_step == 0 and not opt.state_dict()["state"][0]["agn_accumulator"].any()


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "10", True])
def test_waits_that_would_not_be_bounded_are_refused(value):
    _, host = _local([torch.zeros(1)], _gd, 1)
    with pytest.raises(ValueError, match=r"Invalid startup_timeout value: .*finite number of seconds > 0"):
        AGNOptimizer(_gd([torch.zeros(1)]), 1, 1, server=host.endpoint("w"), startup_timeout=value)
    with pytest.raises(ValueError, match=r"Invalid timeout value"):
        RpcEndpoint("ps", timeout=value)


class _LosesFirstJoinAnswer(LocalEndpoint):
    """The server registers the first join, but its answer is lost on the way back."""

    lost = False

    def request(self, method: str, *args: Any) -> Any:
        answer = super().request(method, *args)
        if method == "join" and not self.lost:
            self.lost = True
            raise AGNServerUnavailableError("AGN server 'ps' did not answer 'join' (the answer was lost)")
        return answer


def test_a_join_whose_answer_was_lost_gets_its_session_on_the_retry():
    # It used to find its own name in use until startup_timeout: the first attempt had made a session.
    server, host = _local([torch.zeros(1)], _gd, 1)
    p = torch.zeros(1)
    opt = AGNOptimizer(_gd([p]), 1, 1, server=_LosesFirstJoinAnswer(host, "w"), startup_timeout=scaled(5))
    assert server.workers["w"].incarnation == 1
    opt.apply_gradients([(torch.ones(1), p)])
    assert server.global_step == 1 and opt.finish() == 1
