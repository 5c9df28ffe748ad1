"""``run_parameter_server``: a :class:`ParameterServer` served through a transport until its workers end.

The server (``server.py``) knows nothing of the network and the transports
(``transport.py``) nothing of when a job ends; this module joins the two.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .errors import AGNCheckpointWarning
from .server import ParameterServer, serve
from .transport import RpcServerHost

__all__ = ["run_parameter_server"]


def run_parameter_server(
    params: Iterable[Tensor],
    optimizer_fn: Callable[[list[Tensor]], torch.optim.Optimizer],
    num_worker: int,
    *,
    name: str = "ps",
    checkpoint_path: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    restore_from: str | os.PathLike[str] | None = None,
    liveness_interval: float = 1.0,
    transport: Any = None,
    refuse_for: float = 30.0,
    join_timeout: float | None = None,
) -> list[Tensor]:
    """Serve AGN workers until each of ``num_worker`` has called ``finish()`` or died; the final center.

    Call on the server process after RPC is initialised (``name`` is this
    process's RPC name, which workers pass as ``server=``). Workers may join at
    any time, before or after other workers' updates, and are served
    concurrently; see :class:`ParameterServer` for the guarantees. A worker that
    dies is reported with :class:`AGNWorkerLostWarning`; one the transport
    knows of (an RPC group member) that dies before it joins counts as dead.
    Over gRPC only a worker that joined counts (a client with the token that
    only reads or never joins does not), so ``join_timeout`` bounds the wait
    for a worker that dies before it joins.

    A server that is torn down while serving (``SIGTERM``, as torchrun sends
    when another process of the job fails; ``Ctrl-C``; an error) writes a
    last checkpoint to ``checkpoint_path`` first, if it has one.

    A server that cannot start (a corrupt ``restore_from``, a bad argument)
    answers every request with that error, so workers raise :class:`AGNError`
    at once instead of waiting ``startup_timeout``; it does so until each
    worker the transport knows of has asked or died, at most ``refuse_for``
    seconds, then raises.

    Args:
        params: the initial center parameters (copied).
        optimizer_fn: builds the server's optimizer over the center copies.
        num_worker: how many workers must finish (or die) before this returns.
        name: the server's name, this process's RPC name.
        checkpoint_path, checkpoint_every: save the server state every
            ``checkpoint_every`` updates (0: never).
        restore_from: a checkpoint to continue from.
        liveness_interval: seconds between probes of the running workers.
        transport: the server side of a transport (default: RPC,
            :class:`~torchgrad_compat.agn.transport.RpcServerHost`).
        refuse_for: seconds a server that could not start keeps telling workers why.
        join_timeout: seconds after which the server waits no longer for
            workers that have not joined (None: as long as it takes; over RPC a
            worker that dies is noticed anyway, over gRPC one that never joined
            is not). They are counted in the ``AGNWorkerLostWarning``.

    Raises:
        ValueError: ``num_worker < 1``, an empty ``params``, or ``name`` is not
            this process's RPC name.
    """
    host = RpcServerHost() if transport is None else transport
    try:
        if not (isinstance(liveness_interval, (int, float)) and liveness_interval > 0):
            raise ValueError(f"liveness_interval must be a number > 0, got {liveness_interval!r}")
        if not (isinstance(refuse_for, (int, float)) and refuse_for >= 0):
            raise ValueError(f"Invalid refuse_for value: {refuse_for!r}; expected a number >= 0")
        if join_timeout is not None and not (isinstance(join_timeout, (int, float)) and join_timeout > 0):
            raise ValueError(f"Invalid join_timeout value: {join_timeout!r}; expected None or a number > 0")
        server = ParameterServer(
            params,
            optimizer_fn,
            num_worker,
            name=name,
            checkpoint_path=checkpoint_path,
            checkpoint_every=checkpoint_every,
            restore_from=restore_from,
        )
    except Exception as e:
        _refuse_until_told(
            host, name, f"AGN server {name!r} could not start: {type(e).__name__}: {e}", refuse_for
        )
        raise
    serving = False
    try:
        # SIGTERM becomes an exception from before the first request can arrive.
        with _terminate_as_exit():
            host.start(server)
            serving = True
            return serve(server, host.is_alive, liveness_interval, host.peers, join_timeout)
    except BaseException:
        if serving and checkpoint_path is not None:
            _last_save(server)
        raise
    finally:
        host.stop(server)


def _last_save(server: ParameterServer) -> None:
    """Save a server that is being torn down; a failure is reported, not raised over the reason it stops."""
    try:
        server.save()
    except Exception as e:
        warnings.warn(
            f"AGN server {server.name!r} could not save its last checkpoint at update {server.global_step} "
            f"({type(e).__name__}: {e})",
            AGNCheckpointWarning,
            stacklevel=3,
        )


def _refuse_until_told(host: Any, name: str, reason: str, refuse_for: float) -> None:
    """Answer every request to ``name`` with ``reason`` until each known worker asked or died (bounded)."""
    peers = set(host.peers())
    told = host.refuse(name, reason)
    deadline = time.monotonic() + refuse_for
    try:
        while time.monotonic() < deadline and any(w not in told and host.is_alive(w) for w in peers):
            time.sleep(0.05)
    finally:
        host.stop_refusing(name)


class _Terminated(SystemExit):
    """SIGTERM arrived while serving."""


class _terminate_as_exit:
    """Turn SIGTERM into an exception in the main thread while serving, so the server saves before it dies."""

    def __enter__(self) -> None:
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._raise)

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise _Terminated(128 + signum)
