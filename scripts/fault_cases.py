"""Hostile inputs against the optimizers and LossScaleOptimizer: each must fail loudly and change nothing.

Each case builds fresh objects, snapshots everything a step or a load could
change (parameters, gradients, the whole ``state_dict``), does one wrong thing,
and is classified:

- ``named``: an exception whose message names the argument or the value, and
  nothing changed;
- ``unnamed``: an exception that names neither, nothing changed;
- ``partial``: an exception, after something had changed;
- ``accepted``: no exception for a bad input (whether or not it changed anything);
- ``hang``: no answer within ``--timeout`` seconds.

Run: ``python scripts/fault_cases.py`` (``--show all`` lists every case, not
only the ones that are not ``named``). The exit status is 1 when any case is
not ``named``. The distributed faults (a rank's mistake under
CrossShardOptimizer, a frozen peer, AGN's RPC transport and checkpoints) need
real processes and are covered by the test suite instead; the gRPC families
run a real AGN server on 127.0.0.1 against hostile clients (``grpcio`` needed).
"""

from __future__ import annotations

import argparse
import builtins
import collections
import contextlib
import io
import math
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import torchgrad_compat.optim as optim
from torchgrad_compat import gradients, hessians
from torchgrad_compat.amp import LossScaleOptimizer

# Every optimizer with valid arguments; the numeric ones are the targets of the bad-value cases.
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "GradientDescentOptimizer": {"learning_rate": 0.1},
    "MomentumOptimizer": {"learning_rate": 0.1, "momentum": 0.9},
    "AdagradOptimizer": {"learning_rate": 0.1, "initial_accumulator_value": 0.1},
    "AdagradDAOptimizer": {
        "learning_rate": 0.1,
        "initial_gradient_squared_accumulator_value": 0.1,
        "l1_regularization_strength": 0.01,
        "l2_regularization_strength": 0.01,
    },
    "AdamOptimizer": {"learning_rate": 0.1, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "AdadeltaOptimizer": {"learning_rate": 0.1, "rho": 0.95, "epsilon": 1e-8},
    "RMSPropOptimizer": {"learning_rate": 0.1, "decay": 0.9, "momentum": 0.5, "epsilon": 1e-10},
    "FtrlOptimizer": {
        "learning_rate": 0.1,
        "learning_rate_power": -0.5,
        "initial_accumulator_value": 0.1,
        "l1_regularization_strength": 0.01,
        "l2_regularization_strength": 0.01,
        "l2_shrinkage_regularization_strength": 0.01,
    },
    "ProximalAdagradOptimizer": {
        "learning_rate": 0.1,
        "initial_accumulator_value": 0.1,
        "l1_regularization_strength": 0.01,
        "l2_regularization_strength": 0.01,
    },
    "ProximalGradientDescentOptimizer": {
        "learning_rate": 0.1,
        "l1_regularization_strength": 0.01,
        "l2_regularization_strength": 0.01,
    },
}
# Values that are wrong for every numeric argument, except where VALID_EXCEPTIONS says otherwise.
BAD_VALUES: dict[str, Callable[[], Any]] = {
    "nan": lambda: math.nan,
    "inf": lambda: math.inf,
    "-inf": lambda: -math.inf,
    "-1": lambda: -1.0,
    "1e39 (inf in float32)": lambda: 1e39,
    "'0.1' (a string)": lambda: "0.1",
    "[0.1] (a list)": lambda: [0.1],
    "tensor([0.1, 0.2])": lambda: torch.tensor([0.1, 0.2]),
    "tensor(nan)": lambda: torch.tensor(math.nan),
    "tensor(1) (int64)": lambda: torch.tensor(1),
    "meta tensor": lambda: torch.tensor(0.1, device="meta"),
}
VALID_EXCEPTIONS = {("learning_rate_power", "-1")}  # Ftrl's power is <= 0
# Keys in a param group (torch's names) that a scheduler or a user may write after construction.
GROUP_KEYS = {
    "learning_rate": "lr",
    "momentum": "momentum",
    "beta1": "beta1",
    "beta2": "beta2",
    "epsilon": "epsilon",
    "rho": "rho",
    "decay": "decay",
}


@dataclass
class Case:
    section: str
    name: str
    build: Callable[[], tuple[Any, Callable[[], Any]]]  # () -> (what to snapshot, the wrong call)
    names: tuple[str, ...]  # a message naming any of these counts as named


class _Timeout(Exception):
    pass


def _snapshot(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().clone() if obj.device.type != "meta" else obj
    if isinstance(obj, torch.optim.Optimizer):
        return _snapshot(obj.state_dict())
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_snapshot(v) for v in obj]
    return obj


def _grads(params: list[Tensor]) -> list[Any]:
    return [None if p.grad is None else p.grad for p in params]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.device.type == "meta" or b.device.type == "meta":
            return a.device == b.device
        if a.is_sparse or b.is_sparse:
            return a.is_sparse == b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
        return (
            bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def run_case(case: Case, timeout: int) -> tuple[str, str]:
    try:
        watched, call = case.build()
    except Exception as e:  # the package under test lacks what the case needs
        return "setup failed", f"{type(e).__name__}: {e}"
    before = _snapshot(watched)

    def on_alarm(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout)
    error: BaseException | None = None
    try:
        call()
    except _Timeout:
        return "hang", f"no answer in {timeout} s"
    except Exception as e:
        error = e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    changed = not _same(before, _snapshot(watched))
    if error is None:
        return "accepted", "no error; state changed" if changed else "no error"
    if changed:
        return "partial", f"state changed, then {type(error).__name__}: {error}"
    message = f"{type(error).__name__}: {error}"
    if any(n.lower() in str(error).lower() for n in case.names):
        return "named", message
    return "unnamed", message


# ---------------------------------------------------------------------------- the cases
def _params(dtype: torch.dtype = torch.float32) -> list[Tensor]:
    return [
        torch.nn.Parameter(torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=dtype)),
        torch.nn.Parameter(torch.tensor([0.25, -1.5, 2.0, 4.0], dtype=dtype)),
    ]


def _stepped(cls_name: str, dtype: torch.dtype = torch.float32) -> tuple[torch.optim.Optimizer, list[Tensor]]:
    """An optimizer after one step, so slots and optimizer-wide state exist."""
    params = _params(dtype)
    opt = getattr(optim, cls_name)(params, **OPTIMIZERS[cls_name])
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return opt, params


def _constructor_cases() -> list[Case]:
    cases = []
    for cls_name, valid in OPTIMIZERS.items():
        for arg in valid:
            for label, make in BAD_VALUES.items():
                if (arg, label) in VALID_EXCEPTIONS:
                    continue

                def build(cls_name=cls_name, arg=arg, make=make):
                    kwargs = {**OPTIMIZERS[cls_name], arg: make()}
                    return [], lambda: getattr(optim, cls_name)(_params(), **kwargs)

                cases.append(Case("constructor", f"{cls_name}({arg}={label})", build, (arg,)))
    return cases


def _written_later_cases() -> list[Case]:
    cases = []
    for cls_name, valid in OPTIMIZERS.items():
        for arg in valid:
            if arg not in GROUP_KEYS:
                continue
            for label in (
                "nan",
                "inf",
                "-1",
                "1e39 (inf in float32)",
                "'0.1' (a string)",
                "tensor([0.1, 0.2])",
            ):

                def build(cls_name=cls_name, arg=arg, make=BAD_VALUES[label]):
                    opt, params = _stepped(cls_name)
                    opt.param_groups[0][GROUP_KEYS[arg]] = make()
                    return (opt, params), opt.step

                names = (arg, GROUP_KEYS[arg])
                cases.append(
                    Case("written after construction", f"{cls_name}: {GROUP_KEYS[arg]}={label}", build, names)
                )
    return cases


BAD_GRADS: dict[str, Callable[[Tensor], Any]] = {
    "wrong shape": lambda p: torch.ones(p.numel() + 1),
    "float64 on a float32 variable": lambda p: torch.ones_like(p, dtype=torch.float64),
    "int64": lambda p: torch.ones_like(p, dtype=torch.int64),
    "meta device": lambda p: torch.ones_like(p, device="meta"),
    "a list": lambda p: [1.0] * p.numel(),
    "sparse, row 9 of 4": lambda p: torch.sparse_coo_tensor(
        [[9]], torch.ones(1), (4,), check_invariants=False
    ),
    "sparse, row -1": lambda p: torch.sparse_coo_tensor([[-1]], torch.ones(1), (4,), check_invariants=False),
    "sparse, wrong dense shape": lambda p: torch.sparse_coo_tensor(
        [[1]], torch.ones(1, 3), (4, 3), check_invariants=False
    ),
}


def _gradient_cases() -> list[Case]:
    """A good gradient for the first variable, a bad one for the second: nothing may move."""
    cases = []
    for cls_name in OPTIMIZERS:
        for label, make in BAD_GRADS.items():
            # torch itself refuses to assign a dense p.grad of another shape, dtype or device,
            # but not to replace the .data of one it holds.
            modes = ["apply_gradients"]
            if label.startswith("sparse, row"):
                modes.append("step")
            elif label in ("wrong shape", "float64 on a float32 variable"):
                modes.append("step, through p.grad.data")
            for mode in modes:

                def build(cls_name=cls_name, make=make, mode=mode):
                    opt, params = _stepped(cls_name)
                    good, bad = torch.full_like(params[0], 0.5), make(params[1])
                    if mode == "apply_gradients":
                        return (opt, params), lambda: opt.apply_gradients(
                            [(good, params[0]), (bad, params[1])]
                        )
                    if mode == "step":
                        params[0].grad, params[1].grad = good, bad
                    else:
                        params[0].grad, params[1].grad = good, torch.zeros_like(params[1])
                        params[1].grad.data = bad
                    return (opt, params), opt.step

                names = ("grad", "shape", "dtype", "index", "indices", "device", "sparse")
                cases.append(Case("gradients", f"{cls_name}.{mode}: {label}", build, names))
        for label, make_pairs in {
            "a variable twice": lambda ps: [(torch.ones_like(ps[0]), ps[0])] * 2,
            "a variable it does not manage": lambda ps: [(torch.ones(3), torch.nn.Parameter(torch.ones(3)))],
            "no gradient at all": lambda ps: [(None, p) for p in ps],
        }.items():

            def build(cls_name=cls_name, make_pairs=make_pairs):
                opt, params = _stepped(cls_name)
                return (opt, params), lambda: opt.apply_gradients(make_pairs(params))

            cases.append(
                Case("gradients", f"{cls_name}.apply_gradients: {label}", build, ("variable", "gradient"))
            )
    return cases


def _mutate(sd: Any, key: str, value: Any) -> None:
    """Set every entry named ``key`` in the nested ``sd`` to ``value``; there must be one."""
    if not _replace(sd, key, value):
        raise LookupError(f"the state_dict holds no {key!r}")


def _replace(sd: Any, key: str, value: Any) -> int:
    count = 0
    if isinstance(sd, dict):
        for k in list(sd):
            if k == key:
                sd[k] = value
                count += 1
            else:
                count += _replace(sd[k], key, value)
    elif isinstance(sd, list):
        for v in sd:
            count += _replace(v, key, value)
    return count


def _load_cases() -> list[Case]:
    cases = []
    for cls_name in OPTIMIZERS:
        corruptions: dict[str, tuple[Callable[[dict, torch.optim.Optimizer], None], tuple[str, ...]]] = {
            "lr=nan": (
                lambda sd, o: _mutate(sd["param_groups"], "lr", math.nan),
                ("lr", "learning_rate", "nan"),
            ),
            "lr='fast'": (
                lambda sd, o: _mutate(sd["param_groups"], "lr", "fast"),
                ("lr", "learning_rate", "fast"),
            ),
            "one group too many": (
                lambda sd, o: sd["param_groups"].append(dict(sd["param_groups"][0])),
                ("group",),
            ),
            "a parameter too few": (lambda sd, o: sd["param_groups"][0]["params"].pop(), ("group", "size")),
            "state for an unknown id": (lambda sd, o: sd["state"].update({99: {}}), ("99", "unknown")),
        }
        slots = sorted(next(iter(_stepped(cls_name)[0].state.values()), {}))
        for slot in slots:
            corruptions[f"slot {slot!r} missing"] = (lambda sd, o, s=slot: sd["state"][1].pop(s), (slot,))
            corruptions[f"slot {slot!r} of the wrong shape"] = (
                lambda sd, o, s=slot: sd["state"][1].__setitem__(s, torch.zeros(5)),
                (slot, "shape"),
            )
            corruptions[f"slot {slot!r} an int tensor"] = (
                lambda sd, o, s=slot: sd["state"][1].__setitem__(s, torch.zeros(4, dtype=torch.int64)),
                (slot, "float"),
            )
        if cls_name == "AdamOptimizer":
            for label, value in {
                "[0.5]": [0.5],
                "nan": torch.tensor(math.nan),
                "1.5": torch.tensor(1.5),
            }.items():
                corruptions[f"beta1_power={label}"] = (
                    lambda sd, o, v=value: _mutate(sd, "beta1_power", v),
                    ("beta1_power",),
                )
            for key, value in {"beta2": 5.0, "epsilon": -1.0}.items():
                corruptions[f"{key}={value}"] = (
                    lambda sd, o, k=key, v=value: _mutate(sd["param_groups"], k, v),
                    (key,),
                )
        for label, (corrupt, names) in corruptions.items():

            def build(cls_name=cls_name, corrupt=corrupt):
                opt, params = _stepped(cls_name)
                sd = opt.state_dict()
                bad = {
                    "state": {k: dict(v) for k, v in sd["state"].items()},
                    **{k: v for k, v in sd.items() if k != "state"},
                }
                bad["param_groups"] = [dict(g, params=list(g["params"])) for g in sd["param_groups"]]
                corrupt(bad, opt)
                return (opt, params), lambda: opt.load_state_dict(bad)

            cases.append(Case("load_state_dict", f"{cls_name}: {label}", build, names))
    return cases


def _global_step_cases() -> list[Case]:
    cases = []
    for label, make in {
        "uint8 (wraps at 256)": lambda: torch.tensor(0, dtype=torch.uint8),
        "int16": lambda: torch.tensor(0, dtype=torch.int16),
        "float32": lambda: torch.tensor(0.0),
        "bool": lambda: torch.tensor(False),
        "two elements": lambda: torch.zeros(2, dtype=torch.int64),
        "a Python int": lambda: 0,
    }.items():

        def build(make=make):
            opt, params = _stepped("GradientDescentOptimizer")
            step = make()
            return (opt, params), lambda: opt.apply_gradients(
                [(torch.ones_like(p), p) for p in params], global_step=step
            )

        cases.append(Case("global_step", f"apply_gradients(global_step={label})", build, ("global_step",)))
    return cases


def _loss_scale_cases() -> list[Case]:
    def lso(loss_scale: Any = "dynamic") -> tuple[LossScaleOptimizer, list[Tensor]]:
        params = _params()
        return LossScaleOptimizer(optim.AdamOptimizer(params, learning_rate=0.1), loss_scale), params

    cases = []
    for label, grad in {
        "a finite gradient of the wrong shape": lambda: torch.ones(5),
        "a gradient of the wrong shape holding inf": lambda: torch.full((5,), math.inf),
        "a float64 gradient holding inf": lambda: torch.full((4,), math.inf, dtype=torch.float64),
    }.items():

        def build(grad=grad):
            opt, params = lso()
            pairs = [(torch.ones_like(params[0]), params[0]), (grad(), params[1])]
            return (opt, params), lambda: opt.apply_gradients(pairs)

        cases.append(
            Case("LossScaleOptimizer", f"apply_gradients with {label}", build, ("shape", "dtype", "grad"))
        )

    def step_without_scaled_loss():
        opt, params = lso()
        (params[0].sum() + params[1].sum()).backward()
        return (opt, params), opt.step

    def second_step_on_the_same_gradients():
        opt, params = lso()
        opt.get_scaled_loss(params[0].sum() + params[1].sum()).backward()
        opt.step()
        return (opt, params), opt.step

    cases.append(
        Case(
            "LossScaleOptimizer",
            "step() after a backward of the unscaled loss",
            step_without_scaled_loss,
            ("get_scaled_loss",),
        )
    )
    cases.append(
        Case(
            "LossScaleOptimizer",
            "a second step() on the same gradients",
            second_step_on_the_same_gradients,
            ("get_scaled_loss", "zero_grad"),
        )
    )
    for value in (0.0, -2.0, math.nan, math.inf, "big"):

        def build(value=value):
            return [], lambda: lso(value)

        cases.append(Case("LossScaleOptimizer", f"loss_scale={value!r}", build, ("loss_scale", str(value))))
    return cases


def _gradients_cases() -> list[Case]:
    x = torch.randn(3, requires_grad=True)
    cases = []
    for value in (0, -1, 1.5, "2", math.nan):

        def build(value=value):
            return [x], lambda: hessians((x**3).sum(), [x], chunk_size=value)

        cases.append(Case("gradients/hessians", f"hessians(chunk_size={value!r})", build, ("chunk_size",)))

    def single_tensor_var_list():
        opt, params = _stepped("GradientDescentOptimizer")
        return (opt, params), lambda: opt.compute_gradients(params[0].sum(), var_list=params[0])

    cases.append(
        Case(
            "gradients/hessians",
            "compute_gradients(var_list=<one tensor>)",
            single_tensor_var_list,
            ("var_list",),
        )
    )
    cases.append(
        Case(
            "gradients/hessians",
            "gradients(ys, xs, grad_ys of the wrong shape)",
            lambda: ([x], lambda: gradients([x.sum()], [x], grad_ys=[torch.ones(2)])),
            ("grad_ys", "shape"),
        )
    )
    return cases


# ---------------------------------------------------------------------------- hostile gRPC clients
# A real GrpcServerHost on 127.0.0.1 (one zeros(3) parameter, gradient descent with lr 1) against
# clients without the token, stalled or flooding connections, huge requests, and clients with the
# token that never joined. A case is named when the hostile client is refused with an error naming
# why, nothing of the job changed, and an honest call is still answered within _GRPC_HONEST_S
# (else: hang); memory or a stranger counted as a worker is a change (partial).
_GRPC_TOKEN = "fault-cases-token-of-32-chars..."
_GRPC_WRONG = "fault-cases-token-of-32-chars..!"
_GRPC_METHOD = "/torchgrad_compat.agn.AGN/Request"
_GRPC_HONEST_S = 5.0
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
    """An honest snapshot is answered within _GRPC_HONEST_S, else the server counts as held (hang)."""
    import grpc

    try:
        _grpc_call(address, "snapshot", "fault-cases-monitor", ())
    except GrpcStatus as e:
        if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise _Timeout from e
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


def _grpc_stranger_cases() -> list[Case]:
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


def _grpc_connection_cases() -> list[Case]:
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


def _grpc_payload_cases() -> list[Case]:
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


def _grpc_member_cases() -> list[Case]:
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


def _grpc_hostile_cases() -> list[Case]:
    try:
        import grpc  # noqa: F401
    except ImportError:
        print("grpcio is not installed: the gRPC families are skipped", file=sys.stderr)
        return []
    return [*_grpc_stranger_cases(), *_grpc_connection_cases(), *_grpc_payload_cases(), *_grpc_member_cases()]


def all_cases() -> list[Case]:
    return [
        *_constructor_cases(),
        *_written_later_cases(),
        *_gradient_cases(),
        *_load_cases(),
        *_global_step_cases(),
        *_loss_scale_cases(),
        *_gradients_cases(),
        *_grpc_hostile_cases(),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=int, default=20, help="seconds before a case counts as a hang")
    parser.add_argument("--show", choices=("failures", "all"), default="failures")
    args = parser.parse_args()
    torch.manual_seed(0)
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    rows = []
    for case in all_cases():
        outcome, detail = run_case(case, args.timeout)
        outcomes[case.section][outcome] += 1
        if args.show == "all" or outcome != "named":
            rows.append((outcome, case.section, case.name, detail.splitlines()[0][:140] if detail else ""))
    kinds = ["named", "unnamed", "partial", "accepted", "hang", "setup failed"]
    print(f"| section | cases | {' | '.join(kinds)} |")
    print(f"|---|---:|{'---:|' * len(kinds)}")
    total: collections.Counter = collections.Counter()
    for section, counter in outcomes.items():
        total.update(counter)
        print(f"| {section} | {sum(counter.values())} | {' | '.join(str(counter[k]) for k in kinds)} |")
    print(f"| all | {sum(total.values())} | {' | '.join(str(total[k]) for k in kinds)} |")
    if rows:
        print()
        for outcome, section, name, detail in rows:
            print(f"{outcome:>12}  {section}: {name}  -- {detail}")
    return 0 if total["named"] == sum(total.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
