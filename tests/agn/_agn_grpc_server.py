"""The server process of tests/agn/test_agn_grpc.py: ``run_parameter_server`` behind a ``GrpcServerHost``."""

from __future__ import annotations

import io
import traceback
import warnings
from typing import Any

import torch
from _deadlines import scaled

import torchgrad_compat.optim as tgo
from torchgrad_compat.agn import AGNWorkerLostWarning, run_parameter_server

TOKEN = "a-test-token-of-32-characters..."


def encode(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class _FailsAt(tgo.GradientDescentOptimizer):
    """Gradient descent (lr 1) whose update ``at`` raises instead (0: never)."""

    def __init__(self, params: list[torch.Tensor], at: int):
        super().__init__(params, learning_rate=1.0)
        self._calls, self._at = 0, at

    def apply_gradients(self, *args: Any, **kwargs: Any) -> None:
        self._calls += 1
        if self._calls == self._at:
            raise RuntimeError("the server's optimizer failed")
        super().apply_gradients(*args, **kwargs)


def serve(address: str, num_worker: int, options: dict[str, Any], results: Any) -> None:
    """Serve ``num_worker`` workers (GD, lr 1, one zeros(3) parameter); report the center and the lost."""
    from torchgrad_compat.agn.grpc_transport import GrpcServerHost

    try:
        tls = {}
        if "certificate" in options:
            with open(options["certificate"], "rb") as c, open(options["key"], "rb") as k:
                tls = {"certificate_chain": c.read(), "private_key": k.read()}
        host = GrpcServerHost(address, TOKEN, lease=options.get("lease", scaled(10.0)), **tls)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AGNWorkerLostWarning)
            center = run_parameter_server(
                [torch.zeros(3)],
                lambda ps: _FailsAt(ps, options.get("fail_at", 0)),
                num_worker,
                liveness_interval=0.2,
                transport=host,
                join_timeout=options.get("join_timeout"),
            )
        lost = [str(w.message) for w in caught if issubclass(w.category, AGNWorkerLostWarning)]
        results.put({"center": [c.tolist() for c in center], "lost": lost, "error": None})
    except BaseException:
        results.put({"error": traceback.format_exc()})
