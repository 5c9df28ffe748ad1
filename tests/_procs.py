"""Real processes for the distributed tests: a free port on 127.0.0.1, and ranks run under a deadline.

Every rank is a spawned process that reports on a queue; whatever is still
alive when the group is done, or when it has been silent past its bound, is
killed, so a hung collective fails its test instead of stalling the run. The
bounds are those of a quiet machine, stretched by ``_deadlines.scaled``.
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

from _deadlines import scaled


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Seconds a spawned process may take to start and import torch, on a quiet machine (~3 s here),
# with a margin for a loaded one beyond what the measured time scale covers.
STARTUP_S = 20.0


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
    or the group has sent nothing for ``scaled(deadline_s)`` (then with what
    arrived so far). A message is progress: a group that reports as it goes
    (one message per check) is not taken for hung because the whole of it is
    slow, and a hung one is caught ``scaled(deadline_s)`` after its last message.
    The first message may take ``scaled(STARTUP_S)`` longer: a spawned process
    starts an interpreter and imports torch before it can report anything.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=args(rank, port, results), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    messages: list[Any] = []
    silence_s = scaled(deadline_s)
    deadline = time.monotonic() + silence_s + scaled(STARTUP_S)
    try:
        while len(messages) < expected and time.monotonic() < deadline:
            try:
                messages.append(results.get(timeout=0.5))
                deadline = time.monotonic() + silence_s
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

    Returns the exit status and the combined output. Past ``scaled(deadline_s)``
    the whole process group is killed and the status is that of the kill.
    """
    deadline_s = scaled(deadline_s)
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
        output += f"\n(killed after {deadline_s:.0f} s)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


def init_gloo(rank: int, world: int, port: int, timeout_s: float | None = None) -> None:
    """A spawned rank joins its gloo group on 127.0.0.1 (loopback, one torch thread per rank).

    ``timeout_s`` is the group's timeout as given; by default gloo's 30 s, scaled.
    """
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
        timeout=timedelta(seconds=scaled(30.0) if timeout_s is None else timeout_s),
    )
