"""Real processes for the distributed tests: a free port on 127.0.0.1, and ranks run under a deadline.

Every rank is a spawned process that reports on a queue; whatever is still
alive when the group is done, or when the deadline passes, is killed, so a
hung collective fails its test instead of stalling the run.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    target: Callable[..., None],
    world: int,
    args: Callable[[int, int, Any], tuple],
    *,
    expected: int,
    deadline_s: float,
) -> list[Any]:
    """Run ``target(*args(rank, port, results))`` in ``world`` processes; what they put on ``results``.

    Returns once ``expected`` messages have arrived, every process has exited,
    or ``deadline_s`` has passed (then with what arrived so far).
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=args(rank, port, results), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    messages: list[Any] = []
    deadline = time.monotonic() + deadline_s
    try:
        while len(messages) < expected and time.monotonic() < deadline:
            try:
                messages.append(results.get(timeout=0.5))
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return messages


def torchrun(args: list[str], *, nproc: int, deadline_s: float, **popen: Any) -> tuple[int, str]:
    """``python -m torch.distributed.run`` with ``nproc`` processes on 127.0.0.1 and a free port.

    Returns the exit status and the combined output. Past ``deadline_s`` the
    whole process group is killed and the status is that of the kill.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen
    )
    try:
        output, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n(killed after {deadline_s} s)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 30.0) -> None:
    """A spawned rank joins its gloo group on 127.0.0.1 (loopback, one torch thread per rank)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
