"""AGN over gRPC: a real server process on 127.0.0.1 against honest workers and hostile clients.

The server (tests/agn/_agn_grpc_server.py) runs ``run_parameter_server`` with a
:class:`GrpcServerHost`; this process sends it garbage bytes, calls without
or with a wrong token and malformed payloads, then trains honest workers
against it: the server must refuse the first, keep serving, and count the
second exactly. Skipped when ``grpcio`` is not installed.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _deadlines import scaled
from _procs import free_port, torchrun

grpc = pytest.importorskip("grpc")

import _agn_grpc_server as grpc_server  # noqa: E402

import torchgrad_compat.optim as tgo  # noqa: E402
from torchgrad_compat.agn import AGNError, AGNOptimizer, AGNServerUnavailableError  # noqa: E402
from torchgrad_compat.agn.grpc_transport import GrpcEndpoint, GrpcServerHost  # noqa: E402

TOKEN = grpc_server.TOKEN
DEADLINE_S = 60


def _start_server(num_worker: int, **options: Any) -> tuple[Any, Any, str]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    proc = ctx.Process(target=grpc_server.serve, args=(address, num_worker, options, results), daemon=True)
    proc.start()
    host, port = address.split(":")
    deadline = time.monotonic() + scaled(DEADLINE_S)
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail(f"the gRPC server did not listen on {address} within {scaled(DEADLINE_S):.0f} s")
    return proc, results, address


def _result(proc: Any, results: Any) -> dict[str, Any]:
    try:
        outcome = results.get(timeout=scaled(DEADLINE_S))
    except queue.Empty:
        pytest.fail("the gRPC server did not report")
    finally:
        proc.join(timeout=scaled(10))
        if proc.is_alive():
            proc.kill()
    assert outcome.get("error") is None, outcome["error"]
    return outcome


def _garbage(address: str) -> None:
    host, port = address.split(":")
    for payload in (
        b"\x00" * 8,
        os.urandom(4096),
        b"GET / HTTP/1.1\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(64),
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(1)
            try:
                s.recv(1024)
            except OSError:
                pass


def test_grpc_server_refuses_garbage_and_strangers_and_keeps_serving():
    proc, results, address = _start_server(1)
    _garbage(address)
    for token in ("x" * 16 + "wrong", "y" * 32):
        stranger = GrpcEndpoint(address, "worker1", token)
        with pytest.raises(AGNError, match="refused 'join' from worker 'worker1': UNAUTHENTICATED"):
            stranger.join(1, [((3,), torch.float32)], startup_timeout=5)
        stranger.close()
    # The right token with payloads that are not requests.
    channel = grpc.insecure_channel(address)
    call = channel.unary_unary("/torchgrad_compat.agn.AGN/Request")
    for payload in (b"", os.urandom(512), grpc_server.encode(["not", "a", "request"])):
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=scaled(10), metadata=(("agn-token", TOKEN),))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    no_token = channel.unary_unary("/torchgrad_compat.agn.AGN/Request")
    with pytest.raises(grpc.RpcError) as info:
        no_token(grpc_server.encode(("snapshot", "worker1", ())), timeout=scaled(10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    _garbage(address)
    # The server is still there: an honest worker trains against it, every push counted once.
    p = torch.zeros(3)
    endpoint = GrpcEndpoint(address, "worker1", TOKEN)
    opt = AGNOptimizer(
        tgo.GradientDescentOptimizer([p], 1.0), 1, 1, server=endpoint, startup_timeout=scaled(30)
    )
    for _ in range(3):
        opt.apply_gradients([(torch.ones(3), p)])
    assert opt.finish() == 3 and p.tolist() == [-3.0] * 3
    endpoint.close()
    outcome = _result(proc, results)
    assert outcome["center"] == [[-3.0] * 3] and outcome["lost"] == []


def test_grpc_a_joined_worker_that_stops_heartbeating_is_lost_and_the_other_finishes():
    """worker3 never joins: it is not counted, and join_timeout ends the wait for it."""
    proc, results, address = _start_server(3, lease=scaled(2.0), join_timeout=scaled(10.0))
    alive, silent, early = (
        GrpcEndpoint(address, f"worker{k}", TOKEN, heartbeat_interval=0.2) for k in (1, 2, 3)
    )
    time.sleep(1)  # worker3 is connected, then dies before it joins
    early.close()
    p, q = torch.zeros(3), torch.zeros(3)
    opt = AGNOptimizer(tgo.GradientDescentOptimizer([p], 1.0), 3, 1, server=alive, startup_timeout=scaled(30))
    other = AGNOptimizer(
        tgo.GradientDescentOptimizer([q], 1.0), 3, 1, server=silent, startup_timeout=scaled(30)
    )
    other.apply_gradients([(torch.ones(3), q)])
    silent.close()  # as a killed worker: no more heartbeats
    opt.apply_gradients([(torch.ones(3), p)])
    time.sleep(0.5)
    opt.finish()
    alive.close()
    outcome = _result(proc, results)
    assert outcome["center"] == [[-2.0] * 3]
    assert len(outcome["lost"]) == 1, outcome["lost"]
    assert "['worker2'] stopped answering before finish(); 1 never joined" in outcome["lost"][0], outcome


def test_grpc_bad_arguments():
    with pytest.raises(ValueError, match="Invalid token value: 'short'; expected a secret string"):
        GrpcServerHost("127.0.0.1:0", "short")
    with pytest.raises(ValueError, match="certificate_chain and private_key go together"):
        GrpcServerHost("127.0.0.1:0", TOKEN, certificate_chain=b"x")
    with pytest.raises(ValueError, match="Invalid lease value: 0"):
        GrpcServerHost("127.0.0.1:0", TOKEN, lease=0)
    with pytest.raises(ValueError, match="Invalid worker value: ''"):
        GrpcEndpoint("127.0.0.1:1", "", TOKEN)


def test_grpc_a_worker_without_a_server_gives_up_within_startup_timeout():
    endpoint = GrpcEndpoint(f"127.0.0.1:{free_port()}", "worker1", TOKEN, timeout=1)
    start = time.monotonic()
    with pytest.raises(AGNServerUnavailableError, match="was not serving within startup_timeout=2"):
        AGNOptimizer(
            tgo.GradientDescentOptimizer([torch.zeros(1)], 1.0), 1, server=endpoint, startup_timeout=2
        )
    assert time.monotonic() - start < scaled(10)
    endpoint.close()


def test_grpc_over_tls_serves_workers_that_trust_its_certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    command = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=127.0.0.1",
    ]
    command += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
        timeout=scaled(60),
    )
    proc, results, address = _start_server(1, certificate=str(cert), key=str(key))
    plain = GrpcEndpoint(address, "worker1", TOKEN, timeout=2)
    with pytest.raises(AGNServerUnavailableError, match="was not serving within startup_timeout=2"):
        plain.join(1, [((3,), torch.float32)], startup_timeout=2)
    plain.close()
    endpoint = GrpcEndpoint(address, "worker1", TOKEN, root_certificates=cert.read_bytes())
    p = torch.zeros(3)
    opt = AGNOptimizer(
        tgo.GradientDescentOptimizer([p], 1.0), 1, 1, server=endpoint, startup_timeout=scaled(30)
    )
    opt.apply_gradients([(torch.ones(3), p)])
    assert opt.finish() == 1
    endpoint.close()
    assert _result(proc, results)["center"] == [[-1.0] * 3]


def test_train_agn_script_over_grpc_under_torchrun():
    """docs/agn.md's gRPC command: torchrun, one server and two workers with a shared token."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "train_agn.py"
    args = [str(script), "--steps", "60", "--transport", "grpc", "--grpc-port", str(free_port())]
    env = {**os.environ, "AGN_TOKEN": TOKEN}
    returncode, output = torchrun(args, nproc=3, deadline_s=120, env=env)
    assert returncode == 0, output
    before, after = (float(a) for a in re.findall(r"center accuracy (?:before|after) (\d\.\d+)", output))
    assert after > before + 0.3, output
    assert "worker1: step 60" in output and "worker2: step 60" in output, output


def test_grpc_a_failure_inside_the_server_reaches_the_worker_named_and_the_push_is_retried():
    proc, results, address = _start_server(1, fail_at=2)
    endpoint = GrpcEndpoint(address, "worker1", TOKEN)
    p = torch.zeros(3)
    opt = AGNOptimizer(
        tgo.GradientDescentOptimizer([p], 1.0), 1, 1, server=endpoint, startup_timeout=scaled(30)
    )
    opt.apply_gradients([(torch.ones(3), p)])
    with pytest.raises(AGNError, match="failed on 'push': RuntimeError: the server's optimizer failed"):
        opt.apply_gradients([(torch.ones(3), p)])
    opt.apply_gradients([(torch.ones(3), p)])  # the failed push goes again, then this one
    assert opt.finish() == 3
    endpoint.close()
    assert _result(proc, results)["center"] == [[-3.0] * 3]
