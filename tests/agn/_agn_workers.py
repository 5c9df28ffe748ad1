"""The process side of tests/agn/test_agn.py: AGN scenarios run in-process or in real RPC processes.

Each scenario is a pair of functions, one for the server and one per worker,
taking an ``endpoint(server)`` factory so the same code drives the in-process
transport and RPC. ``run_process`` joins a TensorPipe group on 127.0.0.1 and
reports ``(rank, traceback or None, result)`` on a queue.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc
from _deadlines import scaled
from torch import Tensor

import torchgrad_compat.optim as tgo
from torchgrad_compat.agn import (
    AGNError,
    AGNOptimizer,
    AGNServerNotReadyError,
    AGNServerUnavailableError,
    AGNWorkerLostWarning,
    RpcEndpoint,
    run_parameter_server,
)

# Every request of the RPC groups; the timeout some scenarios expect to fire, so a few seconds.
RPC_TIMEOUT_S = scaled(3.0)


# ---------------------------------------------------------------------- TF's golden tests
def tf_vars(partitioned: bool = False) -> list[Tensor]:
    """``v0 = 0.0``, ``v1 = 0.5`` (and the ``[2, 4]`` zeros variable of test2Worker1Period)."""
    vs = [torch.tensor(0.0), torch.tensor(0.5)]
    return [*vs, torch.zeros(2, 4)] if partitioned else vs


def tf_adam(params: list[Tensor]) -> tgo.AdamOptimizer:
    """TF's test optimizer: Adam(0.1, beta1=0, beta2=0) moves a variable by exactly 0.1 for gradient -1."""
    return tgo.AdamOptimizer(params, learning_rate=0.1, beta1=0.0, beta2=0.0)


def tf_grads(params: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    return [(torch.full_like(p, -1.0), p) for p in params]


def _near(actual: Tensor, expected: float) -> None:
    assert torch.allclose(actual, torch.full_like(actual, expected), rtol=0, atol=1e-6), (actual, expected)


def one_worker_period4(server: Any) -> list[tuple[list[float], list[float], int]]:
    """test1Workers2Period on one worker; ``server`` is the endpoint. Checks and returns the trace."""
    params = tf_vars()
    opt = AGNOptimizer(tf_adam(params), num_worker=1, communication_period=4, server=server)
    step = torch.tensor(0, dtype=torch.int64)
    trace = []
    expected = [((0.1, 0.6), (0.0, 0.5), 0), ((0.2, 0.7), (0.0, 0.5), 0), ((0.3, 0.8), (0.0, 0.5), 0)]
    expected += [((0.1, 0.6), (0.1, 0.6), 1), ((0.2, 0.7), (0.1, 0.6), 1), ((0.3, 0.8), (0.1, 0.6), 1)]
    expected += [((0.4, 0.9), (0.1, 0.6), 1), ((0.2, 0.7), (0.2, 0.7), 2)]
    for local, center_values, gs in expected:
        opt.apply_gradients(tf_grads(params), global_step=step)
        center, server_step = opt._endpoint.request("snapshot")
        for p, want in zip(params, local):
            _near(p, want)
        for c, want in zip(center, center_values):
            _near(c, want)
        assert opt.global_step == server_step == int(step) == gs, (
            opt.global_step,
            server_step,
            int(step),
            gs,
        )
        trace.append(([p.item() for p in params], [c.item() for c in center], opt.global_step))
    assert opt.local_step == 8
    opt.finish()
    return trace


def two_workers_period1(server: Any, rounds: int = 3) -> list[float]:
    """test2Worker1Period, one worker's side: each push moves every center value by +0.1."""
    params = tf_vars(partitioned=True)
    opt = AGNOptimizer(tf_adam(params), num_worker=2, communication_period=1, server=server)
    seen = []
    for _ in range(rounds):
        opt.apply_gradients(tf_grads(params))
        # Just after a pull, local == center, and the center moved by 0.1 per push so far.
        values = torch.cat([p.reshape(-1) for p in params]) - torch.tensor([0.0, 0.5] + [0.0] * 8)
        assert torch.allclose(values, values[0].expand_as(values), atol=1e-6), values
        _near(values[0], round(opt.global_step * 0.1, 6))
        seen.append(values[0].item())
    opt.finish()
    return seen


# ---------------------------------------------------------------------- RPC processes
def _gd(params: list[Tensor]) -> tgo.GradientDescentOptimizer:
    return tgo.GradientDescentOptimizer(params, learning_rate=1.0)


_BARRIER: Any = None


def next_phase() -> None:
    """Wait for every process of the group: one server's workers are done before the next server starts."""
    _BARRIER.wait(timeout=scaled(30))


def run_process(
    rank: int, world: int, port: int, scenario: str, options: dict[str, Any], results: Any, barrier: Any
) -> None:
    """Join the RPC group as ``ps`` (rank 0) or ``worker<rank>``, run ``scenario``, report the outcome."""
    global _BARRIER
    _BARRIER = barrier
    os.environ["TP_SOCKET_IFNAME"] = "lo"
    name = "ps" if rank == 0 else f"worker{rank}"
    error, result = None, None
    try:
        backend = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT_S
        )
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=backend)
        fn = SCENARIOS[scenario]
        result = fn(rank, world, options)
    except BaseException:
        error = traceback.format_exc()
    finally:
        results.put((rank, error, result))
        if rpc.api._is_current_rpc_agent_set():
            # A graceful shutdown waits for every process, a killed one too: scenarios with deaths skip it.
            graceful = error is None and not options.get("abrupt_shutdown", False)
            rpc.shutdown(graceful=graceful)


def _serve(world: int, options: dict[str, Any], params: list[Tensor], fn: Callable, **kwargs: Any) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AGNWorkerLostWarning)
        center = run_parameter_server(params, fn, num_worker=world - 1, liveness_interval=0.2, **kwargs)
    lost = [str(w.message) for w in caught if issubclass(w.category, AGNWorkerLostWarning)]
    return {"center": [c.tolist() for c in center], "lost": lost}


def one_worker_phases(rank: int, world: int, options: dict[str, Any]) -> Any:
    """Three servers one after the other in one group (process start-up is the slow part)."""
    first = golden_one(rank, world, options)
    next_phase()
    second = bad_input(rank, world, options)
    next_phase()
    return first, second, server_hangs(rank, world, options)


def server_hangs(rank: int, world: int, options: dict[str, Any]) -> Any:
    """The server's second update takes RPC_TIMEOUT_S + 1 s (scaled): the worker gets a typed error."""
    if rank == 0:
        return _serve(world, options, [torch.zeros(1)], lambda ps: _SlowAt(ps, 2, RPC_TIMEOUT_S + scaled(1)))
    p = torch.zeros(1)
    opt = AGNOptimizer(_gd([p]), 1, 1, server="ps")
    start = time.monotonic()
    try:
        for _ in range(3):
            start = time.monotonic()
            opt.apply_gradients([(torch.ones(1), p)])
    except AGNServerUnavailableError as e:
        error, seconds = str(e), time.monotonic() - start
    else:
        error, seconds = None, None
    time.sleep(scaled(1))  # finish() then waits at most ~1 s (scaled) for the slow update to release the lock
    return {"error": error, "seconds": seconds, "finished_at": opt.finish()}


def golden_two_then_server_dies(rank: int, world: int, options: dict[str, Any]) -> Any:
    first = golden_two(rank, world, options)
    next_phase()
    return first, server_dies(rank, world, options)


def golden_one(rank: int, world: int, options: dict[str, Any]) -> Any:
    if rank == 0:
        return _serve(world, options, tf_vars(), tf_adam)
    return one_worker_period4("ps")


def golden_two(rank: int, world: int, options: dict[str, Any]) -> Any:
    if rank == 0:
        return _serve(world, options, tf_vars(partitioned=True), tf_adam)
    return two_workers_period1("ps")


def concurrent_one_dies(rank: int, world: int, options: dict[str, Any]) -> Any:
    """Worker k pushes ``2**-k`` (GD, lr 1, period 1), so any arrival order sums exactly.

    The server starts serving ``server_delay_s`` late (workers wait), worker 1
    joins once the server has applied ``late_worker_after`` updates, and the last
    worker kills itself (SIGKILL) after 3 pushes; the others push ``pushes``
    times and finish.
    """
    if rank == 0:
        time.sleep(options["server_delay_s"])
        return _serve(world, options, [torch.zeros(3)], _gd)
    if rank == 1:
        _wait_for_updates(options["late_worker_after"])
    p = torch.zeros(3)
    opt = AGNOptimizer(_gd([p]), world - 1, 1, server="ps")
    joined_at = opt.global_step
    for i in range(options["pushes"]):
        if rank == world - 1 and i == 3:
            os.kill(os.getpid(), 9)
        opt.apply_gradients([(torch.full((3,), -(2.0**-rank)), p)])
        time.sleep(0.01)
    return {"joined_at": joined_at, "finished_at": opt.finish()}


def bad_input(rank: int, world: int, options: dict[str, Any]) -> Any:
    """Malformed pushes and joins get clear errors; the server keeps serving (the push after them works)."""
    if rank == 0:
        return _serve(world, options, [torch.zeros(2, 3)], _gd)
    p = torch.zeros(2, 3)
    opt = AGNOptimizer(tgo.GradientDescentOptimizer([p], learning_rate=1.0), 1, 1, server="ps")
    errors = {}
    bad = {
        "shape": {0: torch.ones(3, 2)},
        "dtype": {0: torch.ones(2, 3, dtype=torch.float64)},
        "index": {5: torch.ones(2, 3)},
        "sparse": {0: torch.ones(2, 3).to_sparse()},
        "not_a_dict": [torch.ones(2, 3)],
        "nan": {0: torch.full((2, 3), float("nan"))},
        "inf": {0: torch.full((2, 3), float("inf"))},
    }
    for label, push in bad.items():
        try:
            opt._endpoint.request("push", opt._session, 100, push)
        except (ValueError, TypeError) as e:
            errors[label] = f"{type(e).__name__}: {e}"
    for label, kwargs in {"num_worker": {"num_worker": 2}, "shape": {"shape": (3,)}}.items():
        q = torch.zeros(kwargs.get("shape", (2, 3)))
        try:
            AGNOptimizer(tgo.GradientDescentOptimizer([q], 1.0), kwargs.get("num_worker", 1), 1, server="ps")
        except ValueError as e:
            errors[f"join_{label}"] = f"{type(e).__name__}: {e}"
    # Another caller using this worker's name, over RPC: no join, push or finish in its place.
    try:  # the server probes liveness by RPC to the worker's name: another name would look dead
        RpcEndpoint("ps", worker="trainer-a")
    except ValueError as e:
        errors["custom_name"] = f"{type(e).__name__}: {e}"
    intruder = RpcEndpoint("ps")
    intruder.worker = "worker1"  # (a forged name: RpcEndpoint takes none but its RPC name)
    for label, call in {
        "intruder_join": lambda: intruder.join(1, [((2, 3), torch.float32)], startup_timeout=0.5),
        "intruder_push": lambda: intruder.request(
            "push", (opt._session[0], "0" * 32), 100, {0: torch.ones(2, 3)}
        ),
        "intruder_finish": lambda: intruder.request("finish", (opt._session[0], "0" * 32)),
    }.items():
        try:
            call()
        except AGNError as e:
            errors[label] = f"{type(e).__name__}: {e}"
    opt.apply_gradients([(torch.ones(2, 3), p)])
    return {"errors": errors, "after": p.tolist(), "global_step": opt.global_step, "finished": opt.finish()}


def _wait_for_updates(count: int) -> None:
    """Poll the server (``snapshot``) until it has applied ``count`` updates (within 30 s, scaled)."""
    timeout = scaled(30.0)
    endpoint = RpcEndpoint("ps")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if endpoint.request("snapshot")[1] >= count:
                return
        except AGNServerNotReadyError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"the server did not reach {count} updates in {timeout:.0f} s")


def server_dies(rank: int, world: int, options: dict[str, Any]) -> Any:
    """The server dies (SIGKILL) mid-run; each worker must raise AGNServerUnavailableError in time."""
    if rank == 0:
        p = [torch.zeros(3)]

        def gd_then_die(params: list[Tensor]) -> tgo.GradientDescentOptimizer:
            return _KillAfter(params, options["kill_after"], world - 1)

        return _serve(world, options, p, gd_then_die)
    p = torch.zeros(3)
    opt = AGNOptimizer(tgo.GradientDescentOptimizer([p], learning_rate=1.0), world - 1, 1, server="ps")
    start = None
    try:
        for _ in range(10_000):
            start = time.monotonic()
            opt.apply_gradients([(torch.full((3,), -float(rank)), p)])
            time.sleep(0.01)
    except AGNServerUnavailableError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "global_step": opt.global_step}
    return {"error": None}


class _SlowAt(tgo.GradientDescentOptimizer):
    """Gradient descent whose update ``at`` takes ``seconds``."""

    def __init__(self, params: list[Tensor], at: int, seconds: float):
        super().__init__(params, learning_rate=1.0)
        self._left, self._seconds = at, seconds

    def apply_gradients(self, *args: Any, **kwargs: Any) -> None:
        self._left -= 1
        if self._left == 0:
            time.sleep(self._seconds)
        super().apply_gradients(*args, **kwargs)


class _KillAfter(tgo.GradientDescentOptimizer):
    """Gradient descent that dies (SIGKILL) at update ``kill_after``, later if a worker has not pushed yet.

    Worker ``k`` pushes gradients of value ``-k``, so the server knows who has
    pushed: a worker that has not joined yet when the server dies would wait
    for it as for a late server (``startup_timeout``), not see it die mid-run.
    """

    def __init__(self, params: list[Tensor], kill_after: int, num_worker: int):
        super().__init__(params, learning_rate=1.0)
        self._left = kill_after
        self._num_worker = num_worker
        self._seen: set[float] = set()

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> None:
        grads_and_vars = list(grads_and_vars)
        self._seen.add(grads_and_vars[0][0].reshape(-1)[0].item())
        self._left -= 1
        if self._left <= 0 and len(self._seen) == self._num_worker:
            os.kill(os.getpid(), 9)
        super().apply_gradients(grads_and_vars, *args, **kwargs)


def checkpointed(rank: int, world: int, options: dict[str, Any]) -> Any:
    """Adam on the server, checkpointed every 2 updates; a second server restored from the file continues.

    One worker pushes ``pushes`` times to the first server, then joins the
    second (retrying while it starts) and pushes ``pushes_after`` times.
    """
    path = options["checkpoint_path"]
    if rank == 0:
        first = _serve(
            world, options, [torch.zeros(4)], checkpoint_adam, checkpoint_path=path, checkpoint_every=2
        )
        next_phase()
        second = _serve(world, options, [torch.zeros(4)], checkpoint_adam, restore_from=path)
        return first, second
    before = _checkpoint_worker(options["pushes"])
    next_phase()
    return before, _checkpoint_worker(options["pushes_after"])


def checkpoint_adam(params: list[Tensor]) -> tgo.AdamOptimizer:
    return tgo.AdamOptimizer(params, learning_rate=0.1)


def checkpoint_push(k: int) -> Tensor:
    """Push ``k`` of :func:`_checkpoint_worker`: the mean of its two local gradients."""
    return (_checkpoint_grad(2 * k) + _checkpoint_grad(2 * k + 1)) / 2


def _checkpoint_grad(i: int) -> Tensor:
    return (torch.arange(4.0) - 1.5) * (1 + i % 3)


def _checkpoint_worker(pushes: int) -> dict[str, Any]:
    p = torch.zeros(4)
    opt = AGNOptimizer(tgo.GradientDescentOptimizer([p], learning_rate=0.01), 1, 2, server="ps")
    joined = opt.global_step
    for i in range(2 * pushes):
        opt.apply_gradients([(_checkpoint_grad(i), p)])
    return {"joined_at": joined, "finished_at": opt.finish()}


def cannot_start_then_early_death(rank: int, world: int, options: dict[str, Any]) -> Any:
    """A server with a corrupt checkpoint tells every worker at once; then a worker dies before it joins."""
    if rank == 0:
        try:
            run_parameter_server(
                [torch.zeros(1)], _gd, world - 1, restore_from=options["corrupt"], refuse_for=scaled(20)
            )
        except ValueError as e:
            refused = str(e)
    else:
        start = time.monotonic()
        try:
            AGNOptimizer(_gd([torch.zeros(1)]), world - 1, 1, server="ps", startup_timeout=scaled(60))
        except AGNError as e:
            refused = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    next_phase()
    if rank == 0:
        return refused, _serve(world, options, [torch.zeros(1)], _gd)
    if rank == world - 1:
        os.kill(os.getpid(), 9)
    p = torch.zeros(1)
    opt = AGNOptimizer(_gd([p]), world - 1, 1, server="ps")
    opt.apply_gradients([(torch.ones(1), p)])
    return refused, opt.finish()


SCENARIOS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {
    "one_worker_phases": one_worker_phases,
    "golden_two_then_server_dies": golden_two_then_server_dies,
    "concurrent_one_dies": concurrent_one_dies,
    "checkpointed": checkpointed,
    "cannot_start_then_early_death": cannot_start_then_early_death,
}
