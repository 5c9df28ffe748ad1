"""AGN over gRPC against hostile neighbours: stalled calls, huge unauthenticated requests, strangers.

Each test starts a real server process (tests/agn/_agn_grpc_server.py, one
``zeros(3)`` parameter, gradient descent with lr 1) on a free port of
127.0.0.1, attacks it with real sockets and gRPC channels, then trains an
honest worker against it: the attack must hold nothing the honest worker
needs, and the server must count exactly the honest pushes. Every wait is
bounded, and the server process is killed whatever happens.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _deadlines import scaled
from _procs import free_port

grpc = pytest.importorskip("grpc")

import _agn_grpc_server as grpc_server  # noqa: E402

import torchgrad_compat.optim as tgo  # noqa: E402
from torchgrad_compat.agn import AGNOptimizer, ParameterServer  # noqa: E402
from torchgrad_compat.agn.grpc_transport import GrpcEndpoint, GrpcServerHost  # noqa: E402

TOKEN = grpc_server.TOKEN
METHOD = "/torchgrad_compat.agn.AGN/Request"
WRONG = "wrong-token-of-32-characters...."
START_S = 60  # a spawned process importing torch on a loaded machine


@contextlib.contextmanager
def _server(num_worker: int, **options: Any) -> Iterator[tuple[Any, Any, str]]:
    """A server process listening on ``127.0.0.1:<free port>``; killed on the way out."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    proc = ctx.Process(target=grpc_server.serve, args=(address, num_worker, options, results), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + scaled(START_S)
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(address.split(":")[1])), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or not proc.is_alive():
                    pytest.fail(f"the gRPC server did not listen on {address} within {scaled(START_S):.0f} s")
                time.sleep(0.1)
        yield proc, results, address
    finally:
        proc.join(timeout=0.1)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=scaled(10))


def _result(results: Any, within: float) -> dict[str, Any]:
    """The server's report, waited for ``within`` seconds (scaled)."""
    try:
        outcome = results.get(timeout=scaled(within))
    except queue.Empty:
        pytest.fail(f"the gRPC server did not return within {scaled(within):.0f} s")
    assert outcome.get("error") is None, outcome["error"]
    return outcome


def _train(address: str, pushes: int, num_worker: int = 1, name: str = "worker1") -> list[float]:
    """An honest worker: join, ``pushes`` pushes of ones, finish; its parameter after that."""
    endpoint = GrpcEndpoint(address, name, TOKEN, timeout=scaled(5), heartbeat_interval=0.2)
    try:
        p = torch.zeros(3)
        opt = AGNOptimizer(
            tgo.GradientDescentOptimizer([p], 1.0), num_worker, 1, server=endpoint, startup_timeout=scaled(10)
        )
        for _ in range(pushes):
            opt.apply_gradients([(torch.ones(3), p)])
        assert opt.finish() >= pushes
        return p.tolist()
    finally:
        endpoint.close()


# ---------------------------------------------------------------------- HTTP/2 by hand
def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _header(name: str, value: str) -> bytes:
    """An HPACK literal field, not indexed, no Huffman (names and values under 127 bytes)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS = 0x0, 0x1, 0x3, 0x4
_END_STREAM, _END_HEADERS = 0x1, 0x4


def _call_headers(address: str, token: str | None) -> bytes:
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", METHOD),
        (":authority", address),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if token is not None:
        fields.append(("agn-token", token))
    return b"".join(_header(n, v) for n, v in fields)


def _connect(address: str) -> socket.socket:
    host, port = address.split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(_PREFACE + _frame(_SETTINGS, 0, 0))
    return s


def _stalled_call(address: str, token: str | None) -> socket.socket:
    """A connection with one call whose message declares 1000 bytes and sends 10, then nothing."""
    s = _connect(address)
    message = b"\x00" + struct.pack(">I", 1000) + b"\x00" * 10
    s.sendall(_frame(_HEADERS, _END_HEADERS, 1, _call_headers(address, token)) + _frame(_DATA, 0, 1, message))
    return s


def _flood(address: str, streams: int, per_stream: int) -> socket.socket:
    """A connection opening ``streams`` calls without a token, each sending ``per_stream`` bytes of a
    message that declares 1 GiB, as fast as the socket takes them (flow control ignored)."""
    s = _connect(address)
    block = _call_headers(address, None)
    with contextlib.suppress(OSError):  # the server may end the connection for ignoring flow control
        for k in range(streams):
            stream = 2 * k + 1
            s.sendall(
                _frame(_HEADERS, _END_HEADERS, stream, block)
                + _frame(_DATA, 0, stream, b"\x00" + struct.pack(">I", 1 << 30))
            )
            s.sendall(_frame(_DATA, 0, stream, bytes(16384)) * (per_stream // 16384))
    return s


def _stream_ended(s: socket.socket, within: float) -> bool:
    """Whether the server ended stream 1 (trailers or RST_STREAM) within ``within`` seconds."""
    buffer = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return False
        if not chunk:
            return True  # the server closed the connection: nothing of the call is held either
        buffer += chunk
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags = buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            if stream == 1 and (kind == _RST_STREAM or (kind == _HEADERS and flags & _END_STREAM)):
                return True
            buffer = buffer[9 + length :]
    return False


def test_stalled_unauthenticated_calls_are_refused_at_once_and_hold_nothing():
    """24 calls (the server has 16 threads) without a token or with a wrong one, stalled mid-message."""
    with _server(1) as (_, results, address):
        stalled = [_stalled_call(address, token) for token in (None, WRONG) for _ in range(12)]
        try:
            ended = sum(_stream_ended(s, within=scaled(5 if i == 0 else 0.5)) for i, s in enumerate(stalled))
            assert ended == len(stalled), f"the server left {len(stalled) - ended} stalled calls open"
            start = time.monotonic()
            assert _train(address, 2) == [-2.0] * 3
            assert time.monotonic() - start < scaled(10)
        finally:
            for s in stalled:
                s.close()
        assert _result(results, 20)["center"] == [[-2.0] * 3]


def test_connections_that_never_make_a_call_are_closed():
    """24 each: nothing sent, the preface alone, half a header block; closed after the bounds."""
    host = GrpcServerHost("127.0.0.1:0", TOKEN, handshake_timeout=1.0, idle_timeout=2.0)
    server = ParameterServer([torch.zeros(3)], lambda ps: tgo.GradientDescentOptimizer(ps, 1.0), 1)
    host.start(server)
    address = f"127.0.0.1:{host.port}"
    sockets: list[socket.socket] = []
    try:
        half = _call_headers(address, None)
        for _ in range(24):
            sockets.append(socket.create_connection(("127.0.0.1", host.port), timeout=5))
            sockets.append(_connect(address))
            sockets.append(_connect(address))
            sockets[-1].sendall(_frame(_HEADERS, 0, 1, half[: len(half) // 2]))
        start, within = time.monotonic(), scaled(10)
        open_ = [
            i % 3 for i, s in enumerate(sockets) if not _stream_ended(s, start + within - time.monotonic())
        ]
        assert not open_, f"still open after {within:.0f} s: {len(open_)} (kinds {sorted(set(open_))})"
    finally:
        for s in sockets:
            s.close()
        host.stop(server)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def test_an_unauthenticated_300_mb_request_is_refused_before_it_is_received():
    """Two 300 MB requests (no token, wrong token), then 4 connections x 32 calls x 4 MiB without one."""
    payload_bytes = 300 << 20
    with _server(1) as (proc, results, address):
        channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)])
        try:
            call = channel.unary_unary(METHOD)
            snapshot = grpc_server.encode(("snapshot", "monitor", ()))
            call(
                snapshot, timeout=scaled(10), metadata=(("agn-token", TOKEN),)
            )  # the server's paths warmed up
            before = _peak_rss(proc.pid)
            payload = bytes(payload_bytes)
            for metadata in ((), (("agn-token", WRONG),)):
                start = time.monotonic()
                with pytest.raises(grpc.RpcError) as info:
                    call(payload, timeout=scaled(15), metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
                assert time.monotonic() - start < scaled(10)
            del payload
            # Received whole, one request alone would add 300 MB (286 MiB; 1 GiB seen).
            grown = _peak_rss(proc.pid) - before
            floods = [_flood(address, 32, 4 << 20) for _ in range(4)]
            for s in floods:
                s.close()
            # 512 MiB declared by the flood, of which 64 KiB per call may arrive before a token
            # (8 MiB); the rest of the bound is the allocator's and gRPC's own, seen up to 102 MiB
            # on a loaded machine.
            flooded = _peak_rss(proc.pid) - before
        finally:
            channel.close()
        assert grown < 64 << 20, f"two 300 MB requests grew the server's peak RSS by {grown >> 20} MiB"
        assert flooded < 192 << 20, f"the flood grew the server's peak RSS by {flooded >> 20} MiB"
        assert _train(address, 1) == [-1.0] * 3
        assert _result(results, 20)["center"] == [[-1.0] * 3]


def test_a_client_that_never_joined_is_no_worker_and_cannot_end_the_job():
    """A client with the token that only reads (snapshot), heartbeats or is refused, then goes away."""
    with _server(1, lease=scaled(0.5)) as (_, results, address):
        channel = grpc.insecure_channel(address)
        try:
            call = channel.unary_unary(METHOD)
            metadata = (("agn-token", TOKEN),)
            for request in (("snapshot", "monitor", ()), ("heartbeat", "monitor", ())):
                call(grpc_server.encode(request), timeout=scaled(10), metadata=metadata)
            refused = call(
                grpc_server.encode(("finish", "stranger", ((1, "x"),))), timeout=scaled(10), metadata=metadata
            )
            assert grpc_server.decode(refused)[0] == "AGNError"
        finally:
            channel.close()
        time.sleep(scaled(2.5))  # five leases and more than three probes: a counted name would be dead by now
        assert results.empty(), results.get()
        assert _train(address, 2) == [-2.0] * 3
        outcome = _result(results, 20)
        assert outcome["center"] == [[-2.0] * 3] and outcome["lost"] == []


def test_a_stranger_cannot_keep_a_dead_worker_alive():
    """worker1 joins and dies; while a client with the token heartbeats and reads under its name,
    worker2 trains and finishes, and the server ends with worker1 lost."""
    with _server(2, lease=scaled(0.5)) as (_, results, address):
        endpoint = GrpcEndpoint(address, "worker1", TOKEN, timeout=scaled(5), heartbeat_interval=0.2)
        p = torch.zeros(3)
        AGNOptimizer(
            tgo.GradientDescentOptimizer([p], 1.0), 2, 1, server=endpoint, startup_timeout=scaled(10)
        )
        endpoint.close()  # dies without finish(): its heartbeats stop
        stop = threading.Event()
        stranger = threading.Thread(target=_pose_as, args=(address, "worker1", stop), daemon=True)
        stranger.start()
        try:
            assert _train(address, 1, num_worker=2, name="worker2") == [-1.0] * 3
            outcome = _result(results, 15)
        finally:
            stop.set()
            stranger.join(timeout=scaled(10))
        assert outcome["center"] == [[-1.0] * 3]
        assert len(outcome["lost"]) == 1 and "['worker1']" in outcome["lost"][0], outcome["lost"]


def _pose_as(address: str, worker: str, stop: threading.Event) -> None:
    """Heartbeat and read under ``worker``'s name (with the token) until ``stop``, at most 60 s (scaled)."""
    channel = grpc.insecure_channel(address)
    call = channel.unary_unary(METHOD)
    deadline = time.monotonic() + scaled(60)
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            for request in (("heartbeat", worker, ()), ("snapshot", worker, ())):
                with contextlib.suppress(grpc.RpcError):  # the server has gone: the test says why
                    call(grpc_server.encode(request), timeout=scaled(5), metadata=(("agn-token", TOKEN),))
            stop.wait(0.1)
    finally:
        channel.close()
