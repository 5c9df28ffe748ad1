"""How AGN workers reach their parameter server: an abstract transport, an in-process one, and RPC.

The AGN math lives in ``optimizer.py`` (worker) and ``server.py`` (server); a
transport only carries four requests, ``join``, ``push``, ``finish`` and ``snapshot``, with
their arguments (ints, names, tensors) and answers, and tells the server which
workers are still alive. A new transport implements :class:`ServerEndpoint`
(worker side) and :class:`ServerHost` (server side) and nothing else changes.

:class:`RpcEndpoint` / :class:`RpcServerHost` use ``torch.distributed.rpc``
(TensorPipe). Trust model: torch RPC has no authentication or encryption and a
peer can make this process run any importable function (PyTorch's SECURITY.md:
"for internal communication only … not built for use in untrusted
environments or networks"). Use it on a trusted network only. The server's own
entry point dispatches to the four requests above and nothing else, which
limits what AGN itself exposes but is no security boundary. For a shared host
or network, ``grpc_transport.py`` authenticates every call.
"""

from __future__ import annotations

import fcntl
import math
import os
import secrets
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from .._torch_internals import rpc_agent_set, rpc_worker_names
from .errors import (
    AGNError,
    AGNNameInUseError,
    AGNServerFullError,
    AGNServerNotReadyError,
    AGNServerUnavailableError,
)

if TYPE_CHECKING:
    from .server import ParameterServer

__all__ = [
    "LocalEndpoint",
    "LocalServerHost",
    "RpcEndpoint",
    "RpcServerHost",
    "ServerEndpoint",
    "ServerHost",
    "init_rpc_from_env",
]

# The only server methods a request may name.
REQUESTS = ("join", "push", "finish", "snapshot")


def check_seconds(arg: str, value: Any) -> None:
    """Refuse a wait that is not a finite number of seconds > 0 (0, inf or NaN would not bound it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"Invalid {arg} value: {value!r}; expected a finite number of seconds > 0")


class ServerEndpoint(ABC):
    """A worker's connection to one AGN server: ``request(method, *args)`` returns the server's answer.

    Errors the server raises on purpose (``ValueError``, ``TypeError``,
    :class:`AGNError`) reach the caller as they are; a server that cannot be
    reached raises :class:`AGNServerUnavailableError` naming it.
    """

    server: str
    worker: str

    @abstractmethod
    def request(self, method: str, *args: Any) -> Any:
        """Send one request and wait for its answer."""

    def join(
        self,
        num_worker: int,
        specs: Any,
        session: Any = None,
        *,
        startup_timeout: float,
    ) -> Any:
        """``request("join", ...)``, retried for up to ``startup_timeout`` s while the server is not ready.

        Also retried while the name is in use, or every slot is held while a worker
        runs: a restarted worker waits for the server to find its previous process dead.
        """
        check_seconds("startup_timeout", startup_timeout)
        deadline = time.monotonic() + startup_timeout
        # One token for every attempt: an attempt whose answer was lost made a session, which the
        # next attempt gets back instead of finding the name in use.
        nonce = secrets.token_hex(16)
        while True:
            try:
                return self.request("join", num_worker, specs, session, nonce)
            except (AGNNameInUseError, AGNServerFullError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
            except (AGNServerNotReadyError, AGNServerUnavailableError) as e:
                if time.monotonic() >= deadline:
                    raise AGNServerUnavailableError(
                        f"AGN server {self.server!r} was not serving within "
                        f"startup_timeout={startup_timeout} s (worker {self.worker!r}); last error: {e}"
                    ) from e
                time.sleep(0.05)


class ServerHost(ABC):
    """The server side of a transport: makes a :class:`ParameterServer` reachable and probes workers."""

    @abstractmethod
    def start(self, server: ParameterServer) -> None:
        """Start answering requests for ``server``."""

    @abstractmethod
    def stop(self, server: ParameterServer) -> None:
        """Stop answering; later requests raise :class:`AGNServerUnavailableError`."""

    @abstractmethod
    def is_alive(self, worker: str) -> bool:
        """Whether ``worker`` still answers (a worker that does not is marked dead)."""

    def peers(self) -> list[str]:
        """The workers this transport knows of, joined or not (probed, so that one dying early ends)."""
        return []

    @abstractmethod
    def refuse(self, name: str, reason: str) -> set[str]:
        """Answer every request to the server ``name`` with :class:`AGNError` (``reason``) until
        :meth:`stop_refusing`; the set of workers told so far, filled in as they ask."""

    @abstractmethod
    def stop_refusing(self, name: str) -> None:
        """End :meth:`refuse`."""


def _handle(
    server: ParameterServer | None,
    name: str,
    method: str,
    worker: str,
    args: tuple,
    refusal: tuple[str, set[str]] | None = None,
) -> Any:
    """Run one request on ``server``: the single entry point every transport goes through."""
    if method not in REQUESTS:
        raise AGNError(f"AGN server {name!r} serves only {REQUESTS}, not {method!r}")
    if refusal is not None:
        reason, told = refusal
        told.add(worker)
        raise AGNError(reason)
    if server is None:
        raise AGNServerNotReadyError(f"no AGN server {name!r} is serving in this process yet")
    return getattr(server, method)(worker, *args)


# ---------------------------------------------------------------------- in process
def _copy(value: Any) -> Any:
    """Clone the tensors in a request or answer, as a wire would: no aliasing between worker and server."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


class LocalServerHost(ServerHost):
    """A server in this process; workers reach it through :meth:`endpoint` (tests, single-process runs)."""

    def __init__(self) -> None:
        self._server: ParameterServer | None = None
        self._stopped = False
        self._refusal: tuple[str, set[str]] | None = None
        self.dead: set[str] = set()
        self.known: list[str] = []  # what peers() reports

    def start(self, server: ParameterServer) -> None:
        self._server = server

    def stop(self, server: ParameterServer) -> None:
        self._stopped = True

    def is_alive(self, worker: str) -> bool:
        return worker not in self.dead

    def peers(self) -> list[str]:
        return list(self.known)

    def refuse(self, name: str, reason: str) -> set[str]:
        self._refusal = (reason, set())
        return self._refusal[1]

    def stop_refusing(self, name: str) -> None:
        self._refusal = None
        self._stopped = True

    def endpoint(self, worker: str, server: str = "ps") -> LocalEndpoint:
        return LocalEndpoint(self, worker, server)

    def _request(self, name: str, method: str, worker: str, args: tuple) -> Any:
        if self._stopped:
            raise AGNServerUnavailableError(f"AGN server {name!r} has stopped (worker {worker!r})")
        return _copy(_handle(self._server, name, method, worker, _copy(args), self._refusal))


class LocalEndpoint(ServerEndpoint):
    def __init__(self, host: LocalServerHost, worker: str, server: str = "ps"):
        self._host = host
        self.worker = worker
        self.server = server

    def request(self, method: str, *args: Any) -> Any:
        return self._host._request(self.server, method, self.worker, args)


# ---------------------------------------------------------------------- torch.distributed.rpc
_SERVERS: dict[str, ParameterServer] = {}
_STOPPED: set[str] = set()
_REFUSED: dict[str, tuple[str, set[str]]] = {}  # servers that could not start: why, and who was told
_IN_FLIGHT: dict[str, int] = {}  # requests being handled, per server name
_SERVERS_LOCK = threading.Lock()


# Errors a server raises on purpose travel back as an answer, not as an RPC exception (which
# torch also logs on the server, a traceback per refused request); only these types are rebuilt.
_ANSWER_ERRORS = {
    e.__name__: e
    for e in (
        AGNServerNotReadyError,
        AGNServerUnavailableError,
        AGNNameInUseError,
        AGNServerFullError,
        AGNError,
        ValueError,
        TypeError,
    )
}


def _error_answer(error: Exception, name: str, method: str) -> tuple[str, str]:
    """``error`` as an answer the worker rebuilds: the closest of ``_ANSWER_ERRORS``, else an AGNError.

    Any other failure of the server (its optimizer raising, say) reaches the
    worker named as such, not as a connection that did not answer.
    """
    for kind, cls in _ANSWER_ERRORS.items():  # most specific first
        if isinstance(error, cls):
            return kind, str(error)
    return "AGNError", f"AGN server {name!r} failed on {method!r}: {type(error).__name__}: {error}"


def _rpc_request(name: str, method: str, worker: str, args: tuple) -> tuple[str, Any]:
    """The function workers call over RPC, run on the server: ``("ok", answer)`` or ``(error type, text)``."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(name)
        stopped = name in _STOPPED
        refusal = _REFUSED.get(name)
        _IN_FLIGHT[name] = _IN_FLIGHT.get(name, 0) + 1
    try:
        if server is None and stopped and refusal is None:
            raise AGNServerUnavailableError(f"AGN server {name!r} has stopped serving")
        return "ok", _handle(server, name, method, worker, args, refusal)
    except Exception as e:
        return _error_answer(e, name, method)
    finally:
        with _SERVERS_LOCK:
            _IN_FLIGHT[name] -= 1


def _ping() -> bool:
    return True


class RpcServerHost(ServerHost):
    """Serve over ``torch.distributed.rpc``; call after ``rpc.init_rpc`` on the process named like the server.

    Args:
        ping_timeout: seconds a running worker has to answer a liveness probe
            (default: the RPC agent's timeout).
        linger: seconds :meth:`stop` waits after the last request was handled,
            so its answer (the last ``finish()``) leaves before the caller
            shuts RPC down; TensorPipe drops unsent answers on a non-graceful
            ``rpc.shutdown``.
    """

    def __init__(self, ping_timeout: float | None = None, linger: float = 0.5):
        if ping_timeout is not None:
            check_seconds("ping_timeout", ping_timeout)
        self._ping_timeout = ping_timeout
        self._linger = linger

    def start(self, server: ParameterServer) -> None:
        me = rpc.get_worker_info().name
        if me != server.name:
            raise ValueError(
                f"name must be this process's RPC name {me!r} (workers send to it), got {server.name!r}"
            )
        with _SERVERS_LOCK:
            if server.name in _SERVERS:
                raise ValueError(f"an AGN server named {server.name!r} is already serving in this process")
            _SERVERS[server.name] = server
            _STOPPED.discard(server.name)

    def stop(self, server: ParameterServer) -> None:
        with _SERVERS_LOCK:
            _SERVERS.pop(server.name, None)
            _STOPPED.add(server.name)
        deadline = time.monotonic() + 10 * self._linger
        while time.monotonic() < deadline:
            with _SERVERS_LOCK:
                if not _IN_FLIGHT.get(server.name):
                    break
            time.sleep(0.01)
        time.sleep(self._linger)

    def is_alive(self, worker: str) -> bool:
        timeout = rpc.api.UNSET_RPC_TIMEOUT if self._ping_timeout is None else self._ping_timeout
        try:
            return rpc.rpc_sync(worker, _ping, timeout=timeout)
        except RuntimeError:
            return False

    def peers(self) -> list[str]:
        """Every other member of this static RPC group."""
        me = rpc.get_worker_info().name
        return sorted(name for name in rpc_worker_names() if name != me)

    def refuse(self, name: str, reason: str) -> set[str]:
        told: set[str] = set()
        with _SERVERS_LOCK:
            _REFUSED[name] = (reason, told)
        return told

    def stop_refusing(self, name: str) -> None:
        with _SERVERS_LOCK:
            _REFUSED.pop(name, None)
            _STOPPED.add(name)
        time.sleep(self._linger)  # the last refusal's answer leaves before the caller shuts RPC down


class RpcEndpoint(ServerEndpoint):
    """Reach the AGN server named ``server`` over ``torch.distributed.rpc``.

    Args:
        server: the server process's RPC name.
        worker: this worker's name: this process's RPC name (the default; the server
            probes a worker's liveness by RPC to it, so no other is accepted).
        timeout: seconds per request (default: the RPC agent's timeout).
    """

    def __init__(self, server: str, worker: str | None = None, timeout: float | None = None):
        if not isinstance(server, str) or not server:
            raise ValueError(f"server must be the AGN server's RPC name, got {server!r}")
        if timeout is not None:
            check_seconds("timeout", timeout)  # (torch's RPC takes 0 for no timeout at all)
        if not rpc_agent_set():
            raise RuntimeError(
                "AGN over RPC needs torch.distributed.rpc.init_rpc (or init_rpc_from_env) first"
            )
        self.server = server
        own = rpc.get_worker_info().name
        if worker is not None and worker != own:
            # The server probes a worker's liveness by RPC to that name: another would look dead.
            raise ValueError(
                f"Invalid worker value: {worker!r}; over RPC a worker is named by its RPC name ({own!r})"
            )
        self.worker = own
        self._timeout = rpc.api.UNSET_RPC_TIMEOUT if timeout is None else timeout
        try:
            rpc.get_worker_info(server)
        except RuntimeError as e:
            raise ValueError(f"server {server!r} is not a member of this RPC group: {e}") from e

    def request(self, method: str, *args: Any) -> Any:
        try:
            kind, answer = rpc.rpc_sync(
                self.server,
                _rpc_request,
                args=(self.server, method, self.worker, args),
                timeout=self._timeout,
            )
        except RuntimeError as e:
            # TensorPipe reports a dead peer with texts like "eof (this error originated at ...)".
            raise AGNServerUnavailableError(
                f"AGN server {self.server!r} did not answer {method!r} from worker {self.worker!r} "
                f"(dead, stopped or slower than the RPC timeout): {e}"
            ) from e
        if kind != "ok":
            raise _ANSWER_ERRORS[kind](answer)
        return answer


def init_rpc_from_env(
    *,
    server_rank: int = 0,
    server_name: str = "ps",
    rpc_timeout: float = 60.0,
    startup_timeout: float = 60.0,
) -> str:
    """Initialise RPC from torchrun's environment; this process's name (``server_name`` or ``worker<rank>``).

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (default ``127.0.0.1``) and
    ``MASTER_PORT``, which ``torchrun`` sets for every process it starts
    (``torchrun --nproc-per-node 3 script.py``: rank 0 serves, ranks 1 and 2
    train); without them it raises ``RuntimeError`` saying so, and a value that
    is not an int in range raises ``ValueError`` naming the variable. The
    rendezvous must complete within ``startup_timeout`` seconds (every process
    started and reachable), else :class:`AGNServerUnavailableError` names the
    address.

    Nothing listens on more than the configured address: rank 0 hosts the
    rendezvous store on ``MASTER_ADDR`` only (not on every interface, as
    ``env://`` does), and TensorPipe listens on the interface that reaches
    ``MASTER_ADDR`` (``TP_SOCKET_IFNAME``, unless already set; IPv4). Under
    torchrun the store is torchrun's own (``TORCHELASTIC_USE_AGENT_STORE``), and
    every rank is its client. Listening on one address is not authentication:
    see the trust model in this module's docstring.
    """
    check_seconds("startup_timeout", startup_timeout)
    check_seconds("rpc_timeout", rpc_timeout)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_rpc_from_env reads RANK, WORLD_SIZE and MASTER_PORT from the environment, and "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: launch every process "
            "with torchrun, which sets them (e.g. `torchrun --nproc-per-node 3 script.py`: rank 0 "
            "serves, the others train), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each "
            "process yourself"
        )
    world_size = _env_int("WORLD_SIZE", 1, 1 << 31)
    rank = _env_int("RANK", 0, world_size)
    port = _env_int("MASTER_PORT", 1, 1 << 16)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    interface = _interface_towards(addr, port)
    if interface is not None:
        os.environ.setdefault("TP_SOCKET_IFNAME", interface)
    name = server_name if rank == server_rank else f"worker{rank}"
    store = _rendezvous_store(addr, port, rank, world_size, startup_timeout)
    key = f"agn://store{id(store)}"
    _STORES[key] = (store, rank, world_size)
    options = rpc.TensorPipeRpcBackendOptions(init_method=key, rpc_timeout=rpc_timeout)
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    finally:
        _STORES.pop(key, None)
    return name


def _env_int(name: str, low: int, high: int) -> int:
    """The environment variable ``name`` as an int in ``[low, high)``."""
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not low <= number < high:
        raise ValueError(
            f"Invalid {name} value: {value!r} (from the environment); expected an int in [{low}, {high})"
        )
    return number


# Stores made by init_rpc_from_env, handed to rpc.init_rpc through torch's rendezvous registry.
_STORES: dict[str, tuple[dist.Store, int, int]] = {}


def _store_rendezvous(url: str, **kwargs: Any) -> Any:
    """torch's rendezvous handler for ``agn://``: the store init_rpc_from_env made (``url`` gains a query)."""
    yield _STORES[url.split("?", 1)[0]]
    raise RuntimeError("an agn:// rendezvous cannot be repeated; call init_rpc_from_env again")


dist.register_rendezvous_handler("agn", _store_rendezvous)


def _rendezvous_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The rendezvous TCPStore: rank 0 hosts it on ``addr`` only, the others join; within ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    where = f"{addr}:{port} (rank {rank} of {world_size})"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        if rank != 0 or agent_store:
            return dist.TCPStore(addr, port, world_size, False, timeout)
        listener = socket.create_server((addr, port), family=_family(addr), backlog=128)
        # The store takes the listening socket over: it accepts on this address only.
        return dist.TCPStore(
            addr, port, world_size, True, timeout, wait_for_workers=True, master_listen_fd=listener.detach()
        )
    except (OSError, RuntimeError) as e:  # DistStoreError (a RuntimeError) on timeout
        raise AGNServerUnavailableError(
            f"AGN rendezvous at {where} did not complete within startup_timeout={timeout_s} s: {e}"
        ) from e


def _family(addr: str) -> socket.AddressFamily:
    return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][0]


def _interface_towards(addr: str, port: int) -> str | None:
    """The name of the local IPv4 interface this host uses to reach ``addr`` (None: not found)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, port))  # UDP: picks the route, sends nothing
            local = probe.getsockname()[0]
    except OSError:
        return None
    for _, interface in socket.if_nameindex():
        if _ipv4_address(interface) == local:
            return interface
    return None


def _ipv4_address(interface: str) -> str | None:
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])
