"""Time and size loading a TF checkpoint: load_tf_checkpoint beside tf.train.load_checkpoint and torch.load.

    python scripts/bench_tf_checkpoint.py                 # a 24 MB smoke run
    python scripts/bench_tf_checkpoint.py --mb 1024 --tensors 100 --repeats 3 --tf-python /path/to/tf/python

The checkpoint holds an Adam-trained model: ``--tensors`` equal float32
variables and their two Adam slots (so three tensors each) and the beta
powers, ``--mb`` MB in all, written by ``save_tf_checkpoint``. ``torch.save``
writes the same tensors (model and optimizer ``state_dict``) to a ``.pt`` file.
Three readers load all of it, each measurement in a fresh process:

- ours: ``load_tf_checkpoint(prefix, var_map, optimizer)`` into the model's
  tensors and an Adam optimizer that has not stepped (so its slots are made by
  the load); checks every CRC32C;
- TF: ``tf.train.load_checkpoint(prefix)`` then ``get_tensor`` of every name,
  keeping every array (its CRC check included), in an interpreter that has
  TensorFlow (this one, or ``--tf-python`` / ``TORCHGRAD_COMPAT_TF_PYTHON``;
  the column is left out without one);
- torch: ``torch.load(weights_only=True)`` of the ``.pt`` file.

Each process reports the load's wall time and its peak resident memory
(``VmHWM``), and its resident memory before it read anything (after its
imports; for ours, before the model's tensors are allocated, so every reader
ends holding one copy of the data): "added" is the difference, the memory the
load needed, to compare with the checkpoint's size (1.0x is one copy). The
files are read once first, so every reader works from the page cache. Writing
is timed too, in this process: ``save_tf_checkpoint`` (which fsyncs its data
file) beside ``torch.save``. Medians of ``--repeats`` runs, as a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchgrad_compat.checkpoint import save_tf_checkpoint
from torchgrad_compat.optim import AdamOptimizer

# Shared by the children: resident memory now and at its peak, in bytes (Linux's /proc).
_MEMORY = """
def _memory():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]
"""

_TF_CHILD = (
    _MEMORY
    + """
import json, sys, time, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
prefix = sys.argv[1]
before, _ = _memory()
start = time.perf_counter()
reader = tf.train.load_checkpoint(prefix)
arrays = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "before": before, "peak": _memory()[1]}))
"""
)

_TORCH_CHILD = (
    _MEMORY
    + """
import json, sys, time
import torch
from torchgrad_compat.checkpoint import load_tf_checkpoint
from torchgrad_compat.optim import AdamOptimizer
torch.set_num_threads(int(sys.argv[3]))
before, _ = _memory()
if sys.argv[1] == "torch":
    start = time.perf_counter()
    state = torch.load(sys.argv[2], weights_only=True)
else:
    # The model exists before its checkpoint is loaded: allocated (not timed), then filled.
    shapes = json.loads(sys.argv[4])
    targets = {name: torch.nn.Parameter(torch.empty(shape)) for name, shape in shapes.items()}
    opt = AdamOptimizer(list(targets.values()), learning_rate=1e-3)
    start = time.perf_counter()
    load_tf_checkpoint(sys.argv[2], targets, opt)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "before": before, "peak": _memory()[1]}))
"""
)


def _model(mb: float, tensors: int) -> list[torch.nn.Parameter]:
    numel = max(1, int(mb * 2**20 / 4 / 3 / tensors))  # three tensors per variable: it and Adam's m, v
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(numel, generator=generator)) for _ in range(tensors)]


def _child(command: list[str]) -> dict[str, float]:
    result = subprocess.run(
        command, capture_output=True, text=True, check=False, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    if result.returncode:
        raise RuntimeError(f"{command[0]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _tf_python(arg: str | None) -> str | None:
    if arg:
        return arg
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    return os.environ.get("TORCHGRAD_COMPAT_TF_PYTHON")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mb", type=float, default=24, help="MB of the checkpoint: the variables and Adam's two slots"
    )
    parser.add_argument("--tensors", type=int, default=12, help="variables (each with two slots)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each reader's process")
    parser.add_argument(
        "--tf-python", help="an interpreter with TensorFlow (default: TORCHGRAD_COMPAT_TF_PYTHON)"
    )
    parser.add_argument("--no-tf", action="store_true", help="leave TensorFlow's row out")
    args = parser.parse_args(argv)
    for name in ("mb", "tensors", "repeats", "threads"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")

    params = _model(args.mb, args.tensors)
    opt = AdamOptimizer(params, learning_rate=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    var_map = {f"layer{i}/kernel": p for i, p in enumerate(params)}
    shapes = json.dumps({name: list(p.shape) for name, p in var_map.items()})
    python = None if args.no_tf else _tf_python(args.tf_python)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "model.ckpt-1")
        save_tf_checkpoint(prefix, var_map, opt, global_step=1)
        torch_file = Path(tmp) / "model.pt"
        state = {"model": {k: p.detach() for k, p in var_map.items()}, "optimizer": opt.state_dict()}
        torch.save(state, torch_file)
        size = sum(f.stat().st_size for f in Path(tmp).glob("model.ckpt-1.*"))
        for f in Path(tmp).iterdir():
            f.read_bytes()  # into the page cache

        readers = {
            "load_tf_checkpoint (ours)": [
                sys.executable,
                "-c",
                _TORCH_CHILD,
                "ours",
                prefix,
                str(args.threads),
                shapes,
            ],
            "torch.load": [sys.executable, "-c", _TORCH_CHILD, "torch", str(torch_file), str(args.threads)],
        }
        if python is not None:
            readers["tf.train.load_checkpoint + get_tensor"] = [python, "-c", _TF_CHILD, prefix]
        loads: dict[str, list[dict[str, float]]] = {name: [] for name in readers}
        for _ in range(args.repeats):  # the readers take turns within each repeat
            for name, command in readers.items():
                loads[name].append(_child(command))
        saves = {
            "save_tf_checkpoint (ours)": _time(
                lambda: save_tf_checkpoint(prefix, var_map, opt, global_step=1), args.repeats
            ),
            "torch.save": _time(lambda: torch.save(state, torch_file), args.repeats),
        }

    mib = 2**20
    what = f"{args.tensors} variables with Adam's two slots"
    print(
        f"checkpoint: {size / mib:.0f} MiB ({what}), page cache warm, "
        f"{args.threads} torch thread(s), median of {args.repeats} fresh processes\n"
    )
    print("| reader / writer | median s | GiB/s | peak RSS MiB | added MiB | added / checkpoint |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in loads.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak"] for r in runs)
        added = statistics.median(r["peak"] - r["before"] for r in runs)
        print(
            f"| {name} | {seconds:.3f} | {size / 2**30 / seconds:.2f} | {peak / mib:.0f} | {added / mib:.0f} "
            f"| {added / size:.2f}x |"
        )
    for name, times in saves.items():
        seconds = statistics.median(times)
        print(f"| {name} | {seconds:.3f} | {size / 2**30 / seconds:.2f} | | | |")
    if python is None:
        print("\n(TensorFlow not found: set TORCHGRAD_COMPAT_TF_PYTHON or --tf-python for its row)")


if __name__ == "__main__":
    main()
