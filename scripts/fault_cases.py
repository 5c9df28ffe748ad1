"""Hostile inputs against the optimizers, LossScaleOptimizer and TF checkpoints: each must fail loudly
and change nothing.

Each case builds fresh objects, snapshots everything a step or a load could
change (parameters, gradients, the whole ``state_dict``, the files of a
checkpoint's directory), does one wrong thing, and is classified:

- ``named``: an exception whose message names the argument, the value or (for
  a checkpoint) the file and the entry, and nothing changed;
- ``unharmed``: a hostile neighbour that needs no error (a symlink planted
  where a save puts its temporaries): no error, and nothing it points at changed;
- ``unnamed``: an exception that names neither, nothing changed;
- ``partial``: an exception, after something had changed;
- ``accepted``: no exception for a bad input (whether or not it changed anything);
- ``hang``: no answer within ``--timeout`` seconds.

The checkpoint cases are crafted from a checkpoint the package saved: index
entries with fields of the wrong wire type or out of range, keys twice or out
of order, block handles repeated or past the end, FIFOs and directories at a
file's path, bad state files; saves beside planted symlinks, a full disk,
names and prefixes that could not be read back. Their peak memory (traced
Python allocations) is in the table, and the largest crafted input is named
under it.

Run: ``python scripts/fault_cases.py`` (``--show all`` lists every case, not
only the failures). The exit status is 1 when any case is neither ``named``
nor ``unharmed``. The distributed faults (a rank's mistake under
CrossShardOptimizer, a frozen peer, AGN's RPC transport and checkpoints) need
real processes and are covered by the test suite instead; the gRPC families
run a real AGN server on 127.0.0.1 against hostile clients (``grpcio`` needed).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import signal
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fault_cases_checkpoint import checkpoint_cases  # (this script's folder is on sys.path)
from fault_cases_grpc import grpc_cases
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
    names: tuple[str, ...]  # a message naming all of these counts as named (any of them, if any_name)
    any_name: bool = True
    unharmed_if_no_error: bool = False  # a hostile neighbour: no error is right, if nothing changed
    traced: bool = False  # record the call's peak traced memory


class _Timeout(Exception):
    pass


def _snapshot(obj: Any) -> Any:
    if isinstance(obj, Path):  # a directory: every file's bytes, every symlink's target
        return {
            str(p.relative_to(obj)): f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes()
            for p in sorted(obj.rglob("*"))
            if p.is_symlink() or p.is_file()
        }
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


def _input_size(watched: Any) -> int:
    """The bytes of the files in the directories ``watched`` holds (a sparse file at its full size)."""
    folders = [
        w for w in (watched if isinstance(watched, (list, tuple)) else [watched]) if isinstance(w, Path)
    ]
    return sum(p.lstat().st_size for folder in folders for p in folder.rglob("*") if p.is_file())


def run_case(case: Case, timeout: int) -> tuple[str, str, int, int]:
    """(outcome, detail, peak traced bytes of the call (0 untraced), bytes of the crafted files)."""
    try:
        watched, call = case.build()
    except Exception as e:  # the package under test lacks what the case needs
        return "setup failed", f"{type(e).__name__}: {e}", 0, 0
    before, size = _snapshot(watched), _input_size(watched)

    def on_alarm(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout)
    error: BaseException | None = None
    peak = 0
    if case.traced:
        tracemalloc.start()
    try:
        call()
    except _Timeout:
        return "hang", f"no answer in {timeout} s", 0, size
    except Exception as e:
        error = e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if case.traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    changed = not _same(before, _snapshot(watched))
    if error is None:
        if case.unharmed_if_no_error and not changed:
            return "unharmed", "no error; nothing it must not touch changed", peak, size
        return "accepted", "no error; state changed" if changed else "no error", peak, size
    if changed:
        return "partial", f"state changed, then {type(error).__name__}: {error}", peak, size
    message = f"{type(error).__name__}: {error}"
    found = [n.lower() in str(error).lower() for n in case.names]
    if any(found) if case.any_name else all(found):
        return "named", message, peak, size
    return "unnamed", message, peak, size


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


def all_cases(scratch: Path) -> list[Case]:
    """Every case; the checkpoint cases craft their files under ``scratch``."""
    return [
        *_constructor_cases(),
        *_written_later_cases(),
        *_gradient_cases(),
        *_load_cases(),
        *_global_step_cases(),
        *_loss_scale_cases(),
        *_gradients_cases(),
        *checkpoint_cases(Case, scratch),
        *grpc_cases(Case),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=int, default=20, help="seconds before a case counts as a hang")
    parser.add_argument("--show", choices=("failures", "all"), default="failures")
    args = parser.parse_args()
    torch.manual_seed(0)
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    peaks: dict[str, int] = {}
    largest = (0, 0, "")  # (input bytes, peak, case)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for case in all_cases(Path(scratch)):
            outcome, detail, peak, size = run_case(case, args.timeout)
            outcomes[case.section][outcome] += 1
            if case.traced:
                peaks[case.section] = max(peaks.get(case.section, 0), peak)
                largest = max(largest, (size, peak, f"{case.section}: {case.name}"))
            if args.show == "all" or outcome not in ("named", "unharmed"):
                rows.append(
                    (outcome, case.section, case.name, detail.splitlines()[0][:140] if detail else "")
                )
    kinds = ["named", "unharmed", "unnamed", "partial", "accepted", "hang", "setup failed"]
    print(f"| section | cases | {' | '.join(kinds)} | peak MiB |")
    print(f"|---|---:|{'---:|' * len(kinds)}---:|")
    total: collections.Counter = collections.Counter()
    for section, counter in outcomes.items():
        total.update(counter)
        peak = f"{peaks[section] / 2**20:.1f}" if section in peaks else ""
        print(
            f"| {section} | {sum(counter.values())} | {' | '.join(str(counter[k]) for k in kinds)} | {peak} |"
        )
    print(f"| all | {sum(total.values())} | {' | '.join(str(total[k]) for k in kinds)} | |")
    if largest[2]:
        print(
            f"\nlargest crafted input: {largest[2]} ({largest[0] / 2**20:.1f} MiB of files), "
            f"peak {largest[1] / 2**10:.0f} KiB traced"
        )
    if rows:
        print()
        for outcome, section, name, detail in rows:
            print(f"{outcome:>12}  {section}: {name}  -- {detail}")
    return 0 if total["named"] + total["unharmed"] == sum(total.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
