"""AGN: the worker/server math in one process (direct transport), then real TensorPipe RPC processes.

The in-process tests drive :class:`LocalServerHost`, which clones every tensor
as a wire would; they pin TF contrib's golden numbers and the server's
contract. The RPC tests start one process group per scenario on 127.0.0.1
(rank 0 serves, the others are workers; tests/_agn_workers.py), with RPC
timeouts of a few seconds, a deadline per group, and every leftover process
killed.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _agn_workers as workers
import pytest
import torch
from _procs import free_port, run_ranks

import torchgrad_compat.optim as tgo
from torchgrad_compat.agn import (
    AGNError,
    AGNOptimizer,
    AGNServerUnavailableError,
    AGNWorkerLostWarning,
    LocalServerHost,
    ParameterServer,
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
    server_power = server.optimizer.state_dict()["non_slot_state"][0]["beta1_power"]
    local_power = opt.inner_optimizer.state_dict()["non_slot_state"][0]["beta1_power"]
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
    _, host = _local([torch.zeros(2)], _gd, 1)
    p = torch.zeros(2)
    opt = AGNOptimizer(tgo.AdamOptimizer([p], 0.1), 1, 4, server=host.endpoint("w"))
    opt.apply_gradients([(torch.ones(2), p)])
    state = opt.state_dict()
    q = torch.zeros(2)
    other = AGNOptimizer(tgo.AdamOptimizer([q], 0.1), 1, 4, server=host.endpoint("w2"))
    other.load_state_dict(state)
    assert (
        other.local_step == 1 and torch.equal(other._accumulators[0], torch.ones(2)) and other._pending == {0}
    )


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
        t.join(timeout=30)
    assert server.done and server.global_step == 4 * pushes
    assert torch.equal(server.center[0], torch.full((4,), pushes * sum(2.0**-k for k in range(4))))
    assert [r.pushes for r in server.workers.values()] == [pushes] * 4


def test_a_repeated_push_is_not_applied_twice_and_a_replaced_incarnation_is_refused():
    _, host = _local([torch.zeros(1)], _gd, 1)
    ep = host.endpoint("w")
    incarnation, _, _ = ep.join(1, [((1,), torch.float32)], startup_timeout=1)
    ep.request("push", incarnation, 1, {0: torch.ones(1)})
    center, step = ep.request("push", incarnation, 1, {0: torch.ones(1)})
    assert step == 1 and center[0].item() == -1.0
    ep.join(1, [((1,), torch.float32)], startup_timeout=1)
    with pytest.raises(AGNError, match="incarnation 1 was replaced by 2"):
        ep.request("push", incarnation, 2, {0: torch.ones(1)})


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
        opt._endpoint.request("push", opt._incarnation, 5, push)
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
    AGNOptimizer(_gd([p]), 1, server=host.endpoint("w"), startup_timeout=5)
    assert p.item() == 1.0
    start = time.monotonic()
    with pytest.raises(AGNServerUnavailableError, match="'ps' was not serving within startup_timeout=0.3 s"):
        AGNOptimizer(_gd([torch.zeros(1)]), 1, server=LocalServerHost().endpoint("w"), startup_timeout=0.3)
    assert time.monotonic() - start < 2


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
    assert saved["global_step"] == 4 and sorted(saved) == ["center", "format", "global_step", "optimizer"]

    second = ParameterServer([torch.zeros(5)], adam, 1, restore_from=path)
    inc, center, step = second.join("w", 1, [((5,), torch.float32)])
    assert step == 4 and torch.equal(center[0], saved["center"][0])
    for seq, push in enumerate(pushes[4:], 1):
        second.push("w", inc, seq, push)
    assert torch.equal(second.center[0], reference.center[0]) and second.global_step == 7
    with pytest.raises(ValueError, match="holds parameters"):
        ParameterServer([torch.zeros(6)], adam, 1, restore_from=path)


# ---------------------------------------------------------------------- real RPC processes
# A group that has not reported by then fails instead of stalling the run.
GROUP_DEADLINE_S = 40


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
    assert workers.RPC_TIMEOUT_S - 0.5 < worker["seconds"] < workers.RPC_TIMEOUT_S + 3
    # The slow update was applied once, after the worker gave up on it; the server went on.
    assert worker["finished_at"] == 2 and server["center"] == [[-2.0]]


def test_rpc_a_killed_server_gives_every_worker_a_typed_error_in_time(golden_two_then_server_dies):
    for result in golden_two_then_server_dies[1]:
        assert result["error"] is not None, "the worker did not notice the dead server"
        assert "AGN server 'ps' did not answer 'push' from worker 'worker" in result["error"]
        assert result["seconds"] < workers.RPC_TIMEOUT_S + 3


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
    """README's command: torchrun, one server and two workers on 127.0.0.1; the center learns."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_agn.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]
    command += [
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        "--steps",
        "60",
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=GROUP_DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output
    before, after = (float(a) for a in re.findall(r"center accuracy (?:before|after) (\d\.\d+)", output))
    assert after > before + 0.3, output
    assert re.search(r"worker1: step 60 .* global_step \d+", output) and "worker2: step 60" in output, output


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"accumulators": [torch.ones(3)]}, r"accumulator 0 must be a floating tensor of shape \(2,\)"),
        ({"accumulators": []}, "list of 1 tensors"),
        ({"accumulators": [torch.tensor([1.0, math.nan])]}, "Invalid accumulator 0 value"),
        ({"local_step": -1}, "Invalid local_step value: -1"),
        ({"pending": [5]}, r"Invalid pending value: \[5\]"),
    ],
    ids=["shape", "count", "nan", "local_step", "pending"],
)
def test_load_state_dict_checks_the_worker_state_before_loading_anything(change, match):
    _, host = _local([torch.zeros(2)], _gd, 1)
    p = torch.zeros(2)
    opt = AGNOptimizer(tgo.AdamOptimizer([p], 0.1), 1, 4, server=host.endpoint("w"))
    opt.apply_gradients([(torch.ones(2), p)])
    state = opt.state_dict()
    q = torch.zeros(2)
    other = AGNOptimizer(tgo.AdamOptimizer([q], 0.5), 1, 4, server=host.endpoint("w2"))
    with pytest.raises(ValueError, match=match):
        other.load_state_dict({**state, "agn": {**state["agn"], **change}})
    # Neither the wrapped optimizer nor the worker state was loaded half-way.
    assert not other.inner_optimizer.state and other.param_groups[0]["lr"] == 0.5
    assert (
        other.local_step == 0 and not other._pending and torch.equal(other._accumulators[0], torch.zeros(2))
    )
