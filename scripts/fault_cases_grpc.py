"""The hostile-client families of ``fault_cases.py`` against AGN's gRPC server (run that script; this
module only builds cases).

A real ``GrpcServerHost`` on 127.0.0.1 (one ``zeros(3)`` parameter, gradient
descent with lr 1) against clients without the token, stalled or flooding
connections, huge requests (that server in its own process, its peak RSS
read from ``/proc``), and clients with the token that never joined or speak
under a dead worker's name. A case is named when the hostile client is
refused with an error naming why, nothing of the job changed, and an honest
call is still answered (else: a hang); memory the server held for a stranger,
or a stranger counted as a worker, is a change (partial).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import torch

import torchgrad_compat.optim as optim

_GRPC_TOKEN = "fault-cases-token-of-32-chars..."
_GRPC_WRONG = "fault-cases-token-of-32-chars..!"
_GRPC_METHOD = "/torchgrad_compat.agn.AGN/Request"
_GRPC_HONEST_S = 5.0  # one honest call's deadline
_GRPC_HELD_S = 60.0  # past fault_cases' --timeout: a server held that long is reported as a hang
_GRPC_RSS_BOUND = 64 << 20
_GRPC_SERVER = """
import sys, torch
from torchgrad_compat.agn.grpc_transport import GrpcServerHost
from torchgrad_compat.agn.server import ParameterServer, serve
from torchgrad_compat.optim import GradientDescentOptimizer
server = ParameterServer([torch.zeros(3)], lambda ps: GradientDescentOptimizer(ps, 1.0), 1)
host = GrpcServerHost("127.0.0.1:0", sys.argv[1])
host.start(server)
print(host.port, flush=True)
serve(server, host.is_alive, 0.1, host.peers)
"""


class _GrpcJob:
    """A parameter server for ``num_worker`` workers served over gRPC by this process until close()."""

    def __init__(self, num_worker: int = 1, lease: float = 0.3, idle_timeout: float = 30.0):
        from torchgrad_compat.agn.grpc_transport import GrpcServerHost
        from torchgrad_compat.agn.server import ParameterServer, serve

        self.server = ParameterServer(
            [torch.zeros(3)], lambda ps: optim.GradientDescentOptimizer(ps, 1.0), num_worker
        )
        self.lease = lease
        self.host = GrpcServerHost(
            "127.0.0.1:0", _GRPC_TOKEN, lease=lease, handshake_timeout=2.0, idle_timeout=idle_timeout
        )
        self.host.start(self.server)
        self.address = f"127.0.0.1:{self.host.port}"
        args = (self.server, self.host.is_alive, 0.05, self.host.peers)
        self.serving = threading.Thread(target=serve, args=args, daemon=True)
        self.serving.start()

    @property
    def watched(self) -> dict[str, Any]:
        return {
            "center": self.server.center,
            "optimizer": self.server.optimizer,
            "workers": self.server.workers,
        }

    def close(self) -> None:
        self.host.stop(self.server)


class GrpcStatus(Exception):
    """A call that ended with a gRPC status other than OK (the message: the code and its details)."""

    def __init__(self, code: Any, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code


def _grpc_call(address: str, method: str, worker: str, args: tuple, token: str | None = _GRPC_TOKEN) -> Any:
    """One request as a client would send it; the answer, or the error it carries raised."""
    import grpc

    from torchgrad_compat import agn

    buffer = io.BytesIO()
    torch.save((method, worker, args), buffer)
    metadata = () if token is None else (("agn-token", token),)
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        try:
            data = channel.unary_unary(_GRPC_METHOD)(
                buffer.getvalue(), timeout=_GRPC_HONEST_S, metadata=metadata
            )
        except grpc.RpcError as e:
            raise GrpcStatus(e.code(), e.details()) from None
    kind, answer = torch.load(io.BytesIO(data), weights_only=True)
    if kind != "ok":
        raise (getattr(agn, kind, None) or getattr(builtins, kind))(answer)
    return answer


def _grpc_still_serves(address: str) -> None:
    """Wait for an honest snapshot's answer: a held server keeps this asking until the case's timeout
    (then ``fault_cases`` counts a hang), or _GRPC_HELD_S when run on its own."""
    import grpc

    deadline = time.monotonic() + _GRPC_HELD_S
    while True:
        try:
            _grpc_call(address, "snapshot", "fault-cases-monitor", ())
            return
        except GrpcStatus as e:
            if e.code != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                raise


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _h2_call_headers(address: str, token: str | None) -> bytes:
    """HPACK literal fields (not indexed, no Huffman) of a gRPC call."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", _GRPC_METHOD), (":authority", address)]
    fields += [("content-type", "application/grpc"), ("te", "trailers")]
    fields += [] if token is None else [("agn-token", token)]
    return b"".join(b"\x00" + bytes([len(n)]) + n.encode() + bytes([len(v)]) + v.encode() for n, v in fields)


def _h2_connection(address: str, opening: str, token: str | None) -> socket.socket:
    """A raw connection that sends ``opening`` and then nothing (see _grpc_connection_cases)."""
    host, port = address.split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(0x4, 0, 0)
    headers = _h2_call_headers(address, token)
    s.sendall(
        {
            "nothing": b"",
            "the preface": preface,
            "half a header block": preface + _h2_frame(0x1, 0, 1, headers[: len(headers) // 2]),
            "a call with 10 of 1000 message bytes": preface
            + _h2_frame(0x1, 0x4, 1, headers)
            + _h2_frame(0x0, 0, 1, b"\x00" + struct.pack(">I", 1000) + bytes(10)),
        }[opening]
    )
    return s


def _h2_ended(s: socket.socket, deadline: float) -> bool:
    """Whether the server ended stream 1 (trailers, RST_STREAM) or the connection before ``deadline``."""
    buffer = b""
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionError):
            return False
        if not chunk:
            return True
        buffer += chunk
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            if stream == 1 and (kind == 0x3 or (kind == 0x1 and flags & 0x1)):
                return True
            buffer = buffer[9 + int.from_bytes(buffer[:3], "big") :]
    return False


def _grpc_stranger_cases(Case: Any) -> list[Any]:
    """Calls without the right token: refused UNAUTHENTICATED, and the server serves on."""
    cases = []
    snapshot = ("snapshot", "stranger", ())
    for label, (method, token) in {
        "no token": (snapshot, None),
        "a wrong token of the same length": (snapshot, _GRPC_WRONG),
        "the token's first half": (snapshot, _GRPC_TOKEN[:16]),
        "an empty token": (snapshot, ""),
        "the token with a character more": (snapshot, _GRPC_TOKEN + "x"),
        "a join with a wrong token": (("join", "worker1", (1, [((3,), torch.float32)])), _GRPC_WRONG),
        "a push with no token": (("push", "worker1", ((1, "k"), 1, {0: torch.ones(3)})), None),
    }.items():

        def build(method=method, token=token):
            job = _GrpcJob()

            def call():
                try:
                    _grpc_call(job.address, *method, token=token)
                except Exception as e:
                    _grpc_still_serves(job.address)
                    raise e
                finally:
                    job.close()

            return job.watched, call

        cases.append(Case("gRPC: calls without the token", label, build, ("token",)))
    return cases


def _grpc_connection_cases(Case: Any) -> list[Any]:
    """24 raw connections (more than the server's 16 threads) that open and then stall."""
    cases = []
    for opening, token in (
        ("a call with 10 of 1000 message bytes", None),
        ("a call with 10 of 1000 message bytes", _GRPC_WRONG),
        ("nothing", None),
        ("the preface", None),
        ("half a header block", None),
    ):
        label = f"24 connections sending {opening}" + (", wrong token" if token else "")

        def build(opening=opening, token=token):
            job = _GrpcJob(idle_timeout=3.0)  # shorter bounds than the defaults (10 s, 30 s)

            def call():
                sockets = [_h2_connection(job.address, opening, token) for _ in range(24)]
                try:
                    _grpc_still_serves(job.address)
                    # A refused call ends at once; a connection that never completes its handshake
                    # is closed after handshake_timeout, one without a call after idle_timeout.
                    start = time.monotonic()
                    ended = sum(_h2_ended(s, start + 15) for s in sockets)
                    if ended == len(sockets):
                        raise ConnectionResetError(
                            f"the server ended all {ended} after {time.monotonic() - start:.1f} s"
                        )
                finally:
                    for s in sockets:
                        s.close()
                    job.close()

            return job.watched, call

        cases.append(Case("gRPC: stalled connections", label, build, ("ended",)))
    return cases


def _grpc_payload_cases(Case: Any) -> list[Any]:
    """Requests without the token far larger than the server should hold; a server in its own process."""

    def one_request(address: str, token: str | None) -> None:
        _grpc_call(address, "snapshot", "stranger", (bytes(300 << 20),), token=token)

    def flood(address: str, token: str | None) -> None:
        # Flow control ignored: each stream sends 4 MiB as fast as the socket takes it.
        sockets = [_h2_connection(address, "the preface", token) for _ in range(4)]
        try:
            for s in sockets:
                with contextlib.suppress(OSError):  # the server may drop a connection that ignores it
                    for stream in range(1, 64, 2):
                        message = b"\x00" + struct.pack(">I", 1 << 30)
                        s.sendall(
                            _h2_frame(0x1, 0x4, stream, _h2_call_headers(address, token))
                            + _h2_frame(0x0, 0, stream, message)
                            + _h2_frame(0x0, 0, stream, bytes(16384)) * 256
                        )
            ended = sum(_h2_ended(s, time.monotonic() + 2) for s in sockets)
        finally:
            for s in sockets:
                s.close()
        raise ConnectionResetError(f"the server ended the calls of {ended} of 4 connections")

    cases = []
    for label, token, attack in (
        ("a 300 MB request without a token", None, one_request),
        ("a 300 MB request with a wrong token", _GRPC_WRONG, one_request),
        ("4 connections x 32 calls x 4 MiB without a token", None, flood),
    ):

        def build(token=token, attack=attack):
            command = [sys.executable, "-c", _GRPC_SERVER, _GRPC_TOKEN]
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            address = f"127.0.0.1:{proc.stdout.readline().strip()}"
            held = torch.zeros(1)  # the server's peak RSS growth in MiB, when over _GRPC_RSS_BOUND

            def call():
                try:
                    _grpc_still_serves(address)
                    before = _peak_rss(proc.pid)
                    try:
                        attack(address, token)
                    except Exception as e:
                        _grpc_still_serves(address)
                        grown = _peak_rss(proc.pid) - before
                        if grown >= _GRPC_RSS_BOUND:
                            held.fill_(grown >> 20)
                        e.args = (f"{e} (server peak RSS +{grown >> 20} MiB)",)
                        raise
                finally:
                    proc.kill()
                    proc.wait(timeout=10)

            return held, call

        cases.append(Case("gRPC: huge requests without the token", label, build, ("token", "ended")))
    return cases


def _peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def _grpc_member_cases(Case: Any) -> list[Any]:
    """Clients with the token under names that never joined, or under a joined worker's name after it
    died: refused where they would act for a worker, never counted as one, never keeping one alive."""
    session = (1, "0" * 32)
    finish = ("finish", (session,))
    cases = []
    for label, requests in {
        "snapshots under a name that never joined, then its finish": [("snapshot", ()), finish],
        "heartbeats under a name that never joined": [("heartbeat", ())],
        "pushes under a name that never joined": [("push", (session, 1, {0: torch.ones(3)}))],
        "finishes under a name that never joined": [finish],
        "joins with another num_worker": [("join", (2, [((3,), torch.float32)], None, "n"))],
    }.items():

        def build(requests=requests):
            job = _GrpcJob()
            return job.watched, lambda: _as_stranger(job, "stranger", requests, dead=None)

        cases.append(
            Case("gRPC: clients that never joined", label, build, ("joined", "session", "num_worker"))
        )
    for label, requests in {
        "heartbeats without a session": [("heartbeat", ())],
        "heartbeats with a forged session": [("heartbeat", (session,))],
        "snapshots, then a finish": [("snapshot", ()), finish],
    }.items():

        def build(requests=requests):
            job = _GrpcJob(num_worker=2)  # worker1 joins and dies; the job waits for worker2
            _grpc_call(job.address, "join", "worker1", (2, [((3,), torch.float32)], None, "n"))
            watched = {"center": job.server.center, "optimizer": job.server.optimizer}
            return watched, lambda: _as_stranger(job, "worker1", requests, dead="worker1")

        cases.append(Case("gRPC: a dead worker's name", f"{label} under it", build, ("session",)))
    return cases


def _as_stranger(job: _GrpcJob, worker: str, requests: list[tuple[str, tuple]], dead: str | None) -> None:
    """Send ``requests`` under ``worker``'s name every third of a lease for 6 leases; raise the first
    refusal once the job is seen unharmed: still serving, not ended, and ``dead`` found dead while the
    stranger still speaks (else a name that never joined is given 6 more leases to be counted)."""
    refusal: Exception | None = None
    try:
        deadline = time.monotonic() + 6 * job.lease
        while True:
            for method, args in requests:
                try:
                    _grpc_call(job.address, method, worker, args)
                except Exception as e:
                    refusal = refusal or e
            if time.monotonic() >= deadline:
                break
            time.sleep(job.lease / 3)
        if dead is None:
            time.sleep(6 * job.lease)
        _grpc_still_serves(job.address)
        harmed = job.server.done or (dead is not None and dead not in job.server.dead_workers())
        if refusal is not None and not harmed:
            raise refusal
    finally:
        job.close()


def grpc_cases(Case: Any) -> list[Any]:
    """Every gRPC case as ``Case(section, name, build, names)``; none when grpcio is not installed."""
    try:
        import grpc  # noqa: F401
    except ImportError:
        print("grpcio is not installed: the gRPC families are skipped", file=sys.stderr)
        return []
    return [
        *_grpc_stranger_cases(Case),
        *_grpc_connection_cases(Case),
        *_grpc_payload_cases(Case),
        *_grpc_member_cases(Case),
    ]
