"""AGN over gRPC: a transport that authenticates its peers and survives malformed input.

The same four requests as over ``torch.distributed.rpc`` (``join``, ``push``,
``finish``, ``snapshot``), through one gRPC method; the AGN code does not
change. Needs ``grpcio`` (``pip install grpcio``).

Trust model: a peer that presents the token is trusted as a client of this
job; any other is a stranger and can make the server hold very little.

* Every call carries a shared secret token (gRPC metadata ``agn-token``). A
  server interceptor compares it, in constant time, with the call's headers
  alone, before the server reads any byte of the message: a call without it,
  or with a wrong one, is answered ``UNAUTHENTICATED`` at once. Its message is
  never received (a 300 MB request costs the server no memory), and a call
  that declares a message and then stalls holds no thread. Bytes that are not
  gRPC (HTTP/2) are dropped by gRPC itself.
* What a stranger's connection can hold is bounded: at most
  ``MAX_STREAMS_PER_CONNECTION`` calls at once, each allowed to send
  ``STREAM_WINDOW_BYTES`` (64 KiB) of its message before its token is
  accepted (HTTP/2 flow control: a peer that sends more loses its
  connection); a connection that has not finished its HTTP/2 (or TLS)
  handshake within ``handshake_timeout`` seconds (default 10) is closed, and
  so is one without a call for ``idle_timeout`` seconds (default 30; a
  worker's channel reconnects by itself). The number of connections is not
  capped: on a shared host another user can still spend the server's CPU or
  file descriptors; the token keeps the job's data, threads and memory to
  the job.
* Payloads are decoded with ``torch.load(weights_only=True)``: tensors, numbers,
  strings, dtypes and plain containers, never code. A payload that does not
  decode, or is not a request, gets ``INVALID_ARGUMENT``. An authenticated
  request may be up to ``max_message_bytes`` long (a push holds every
  parameter).
* With ``certificate_chain``/``private_key`` on the server and
  ``root_certificates`` on the workers the channel is TLS, so neither the
  token nor the tensors can be read or changed on the wire. Without TLS the
  token travels in clear: use that on loopback or a trusted network only.
* The server listens on the given address only.

Workers and liveness: a name is a worker once it has joined; a client that
only reads (``snapshot``) or calls under a name that never joined is not
counted toward ``num_worker``, cannot be declared dead and cannot end the job.
A joined worker's endpoint sends a heartbeat every ``heartbeat_interval``
seconds carrying its session; the server counts it alive while it has heard,
within ``lease`` seconds, a join, push, finish or heartbeat of that session,
so no other client can keep a dead worker alive under its name. A worker that
dies before it joins was never counted: ``run_parameter_server(...,
join_timeout=s)`` bounds the wait for workers that never join.
"""

from __future__ import annotations

import hmac
import io
import math
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
import torch

from .errors import AGNError, AGNServerUnavailableError
from .transport import _ANSWER_ERRORS, ServerEndpoint, ServerHost, _error_answer, _handle, check_seconds

if TYPE_CHECKING:
    from .server import ParameterServer

__all__ = ["GrpcEndpoint", "GrpcServerHost"]

_METHOD = "/torchgrad_compat.agn.AGN/Request"
_TOKEN_KEY = "agn-token"
_HEARTBEAT = "heartbeat"  # handled by the host, never reaches the parameter server
_WORKER_REQUESTS = ("join", "push", "finish")  # answered only for the session of a joined worker

MAX_STREAMS_PER_CONNECTION = 32  # a worker's channel carries two at most (a request and a heartbeat)
STREAM_WINDOW_BYTES = 1 << 16  # what a connection may send of a call's message before it is accepted


def _encode(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _decode(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def _server_options(max_message_bytes: int, handshake_timeout: float, idle_timeout: float) -> list[Any]:
    return [
        *_channel_options(max_message_bytes),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        # A call's flow-control window opens past 64 KiB only once its handler asks for the message,
        # which a refused call never does; with BDP probing gRPC would offer 4 MiB to every stream.
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.server_handshake_timeout_ms", math.ceil(handshake_timeout * 1000)),
        ("grpc.max_connection_idle_ms", math.ceil(idle_timeout * 1000)),
    ]


def _refuse(requests: Any, context: grpc.ServicerContext) -> None:
    """The handler of a call without the token: it never reads the request it was handed."""
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "AGN server: missing or wrong token")


# Request-streaming, so gRPC hands it the request as an iterator it never advances: a unary
# handler would first wait for the whole message, holding a thread while a stranger stalls.
_REFUSAL = grpc.stream_unary_rpc_method_handler(_refuse)


class _TokenCheck(grpc.ServerInterceptor):
    """Compare the token in a call's headers before anything else of the call is read."""

    def __init__(self, token: bytes):
        self._token = token

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        presented = dict(details.invocation_metadata or ()).get(_TOKEN_KEY, "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._token):
            return continuation(details)
        return _REFUSAL


def _check_token(token: Any) -> bytes:
    if not isinstance(token, str) or len(token) < 16:
        raise ValueError(
            f"Invalid token value: {token!r}; expected a secret string of at least 16 characters"
        )
    return token.encode()


class GrpcServerHost(ServerHost):
    """Serve AGN workers over gRPC on ``address`` (``"host:port"``; port 0 picks one, see :attr:`port`).

    Args:
        address: where to listen, e.g. ``"127.0.0.1:29600"``; only there.
        token: the shared secret every worker presents (>= 16 characters).
        certificate_chain, private_key: PEM bytes; both given: TLS.
        lease: seconds without a word from a joined worker's session after which it counts as dead.
        max_message_bytes: the largest authenticated request or answer (a push holds every parameter).
        threads: authenticated requests served at once (a refused call holds one for
            no longer than it takes to refuse it).
        linger: seconds :meth:`stop` lets the last answers leave.
        handshake_timeout: seconds a new connection has to complete its HTTP/2
            (and TLS) handshake before it is closed.
        idle_timeout: seconds a connection may go without a call before it is
            closed (a worker's channel reconnects at its next request).
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        lease: float = 10.0,
        max_message_bytes: int = 1 << 30,
        threads: int = 16,
        linger: float = 0.5,
        handshake_timeout: float = 10.0,
        idle_timeout: float = 30.0,
    ):
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain and private_key go together (TLS), got only one of them")
        if not (isinstance(lease, (int, float)) and lease > 0):
            raise ValueError(f"Invalid lease value: {lease!r}; expected a number of seconds > 0")
        check_seconds("handshake_timeout", handshake_timeout)
        check_seconds("idle_timeout", idle_timeout)
        self._address = address
        self._token = _check_token(token)
        self._credentials = (
            None
            if certificate_chain is None
            else grpc.ssl_server_credentials([(private_key, certificate_chain)])
        )
        self._lease = lease
        self._max_message_bytes = max_message_bytes
        self._threads = threads
        self._linger = linger
        self._bounds = (handshake_timeout, idle_timeout)
        self._grpc: grpc.Server | None = None
        self._server: ParameterServer | None = None
        self._name = "ps"
        self._stopped = False
        self._refusal: tuple[str, set[str]] | None = None
        self._heard: dict[str, float] = {}
        self._lock = threading.Lock()
        self.port: int | None = None

    # ------------------------------------------------------------------ ServerHost
    def start(self, server: ParameterServer) -> None:
        self._listen()
        with self._lock:
            self._server, self._name, self._stopped = server, server.name, False

    def stop(self, server: ParameterServer) -> None:
        with self._lock:
            self._server, self._stopped = None, True
        self._close()

    def is_alive(self, worker: str) -> bool:
        with self._lock:
            heard = self._heard.get(worker)
        return heard is not None and time.monotonic() - heard < self._lease

    def refuse(self, name: str, reason: str) -> set[str]:
        self._listen()
        told: set[str] = set()
        with self._lock:
            self._name, self._refusal = name, (reason, told)
        return told

    def stop_refusing(self, name: str) -> None:
        with self._lock:
            self._refusal, self._stopped = None, True
        self._close()

    # ------------------------------------------------------------------ gRPC
    def _listen(self) -> None:
        if self._grpc is not None:
            return
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._threads),
            interceptors=[_TokenCheck(self._token)],
            options=_server_options(self._max_message_bytes, *self._bounds),
        )
        handler = grpc.unary_unary_rpc_method_handler(self._request)
        service, method = _METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
        if self._credentials is None:
            port = server.add_insecure_port(self._address)
        else:
            port = server.add_secure_port(self._address, self._credentials)
        if port == 0:
            raise ValueError(f"Invalid address value: {self._address!r}; gRPC could not listen there")
        server.start()
        self._grpc, self.port = server, port

    def _close(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=self._linger).wait()
            self._grpc = None

    def _request(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        """One authenticated call (``_TokenCheck`` let it through): the payload's shape, then the request."""
        try:
            method, worker, args = _decode(data)
            if not (isinstance(method, str) and isinstance(worker, str) and isinstance(args, tuple)):
                raise TypeError("not (method, worker, args)")
        except Exception as e:  # anything torch.load or the unpacking raises on bytes from outside
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"AGN server: malformed request ({e})")
        with self._lock:
            server, refusal, stopped = self._server, self._refusal, self._stopped
        try:
            if method == _HEARTBEAT:
                answer = self._heartbeat(server, worker, args)
            else:
                if server is None and stopped:
                    raise AGNServerUnavailableError(f"AGN server {self._name!r} has stopped serving")
                answer = _handle(server, self._name, method, worker, args, refusal)
        except Exception as e:
            return _encode(_error_answer(e, self._name, method))
        if method in _WORKER_REQUESTS:  # it succeeded, so it came from the worker's own session
            with self._lock:
                self._heard[worker] = time.monotonic()
        return _encode(("ok", answer))

    def _heartbeat(self, server: ParameterServer | None, worker: str, args: tuple) -> None:
        """Count ``worker`` alive if the heartbeat carries its current session (args: ``(session,)``)."""
        if server is None or len(args) != 1 or not server.holds(worker, args[0]):
            raise AGNError(
                f"AGN server {self._name!r}: a heartbeat for {worker!r} must carry the session of a "
                "running worker of that name"
            )
        with self._lock:
            self._heard[worker] = time.monotonic()


class GrpcEndpoint(ServerEndpoint):
    """A worker's connection to a :class:`GrpcServerHost` at ``address``.

    Args:
        address: the server's ``"host:port"``.
        worker: this worker's name (unique among the workers).
        token: the shared secret of the server.
        server: the server's name, for messages.
        root_certificates: PEM bytes of the CA that signed the server's
            certificate: the channel is TLS. None: plain TCP.
        timeout: seconds per request.
        heartbeat_interval: seconds between heartbeats, sent once this endpoint has
            joined (keep it well under the server's ``lease``).
        max_message_bytes: the largest request or answer.
    """

    def __init__(
        self,
        address: str,
        worker: str,
        token: str,
        *,
        server: str = "ps",
        root_certificates: bytes | None = None,
        timeout: float = 60.0,
        heartbeat_interval: float = 2.0,
        max_message_bytes: int = 1 << 30,
    ):
        if not isinstance(worker, str) or not worker:
            raise ValueError(f"Invalid worker value: {worker!r}; expected this worker's name")
        self.server = server
        self.worker = worker
        self._address = address
        self._metadata = ((_TOKEN_KEY, token),)
        _check_token(token)
        check_seconds("timeout", timeout)
        check_seconds("heartbeat_interval", heartbeat_interval)
        self._timeout = timeout
        options = _channel_options(max_message_bytes)
        if root_certificates is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._call = self._channel.unary_unary(_METHOD)
        self._session: Any = None  # from the last join answered: what a heartbeat carries
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_interval,), daemon=True)
        self._heartbeat.start()

    def request(self, method: str, *args: Any) -> Any:
        try:
            data = self._call(
                _encode((method, self.worker, args)), timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
                raise AGNError(
                    f"AGN server {self.server!r} at {self._address} refused {method!r} from worker "
                    f"{self.worker!r}: {code.name}: {e.details()}"
                ) from e
            raise AGNServerUnavailableError(
                f"AGN server {self.server!r} at {self._address} did not answer {method!r} from worker "
                f"{self.worker!r} (dead, stopped or slower than timeout={self._timeout} s): "
                f"{code.name}: {e.details()}"
            ) from e
        kind, answer = _decode(data)
        if kind != "ok":
            raise _ANSWER_ERRORS[kind](answer)
        if method == "join":
            self._session = answer[0]
        return answer

    def close(self) -> None:
        """Stop the heartbeat and close the channel."""
        self._closed.set()
        self._channel.close()

    def _beat(self, interval: float) -> None:
        while not self._closed.wait(interval):
            if self._session is None:  # a name counts as a worker only once it has joined
                continue
            try:
                self.request(_HEARTBEAT, self._session)
            except (AGNError, ValueError):  # the server is away or refuses: the next request says so
                pass
