"""Time loading a TF checkpoint: load_tf_checkpoint beside tf.train.load_checkpoint and torch.load.

    python scripts/bench_tf_checkpoint.py --quick
    python scripts/bench_tf_checkpoint.py --mb 400 --repeats 5 --tf-python /path/to/python-with-tensorflow

The checkpoint holds an Adam-trained model of ``--mb`` MB of float32 weights in
``--tensors`` equal tensors, with its two Adam slots (so three times that on
disk) and the beta powers, written by ``save_tf_checkpoint``. Three readers
load all of it:

- ours: ``load_tf_checkpoint(prefix, var_map, optimizer)`` into existing
  tensors and an Adam optimizer (reads, checks every CRC32C, copies);
- TF: ``tf.train.load_checkpoint(prefix)`` then ``get_tensor`` of every name
  (NumPy arrays; its CRC check included), in an interpreter that has
  TensorFlow (this one, or ``--tf-python``; skipped without one);
- torch: ``torch.load(weights_only=True)`` of a file ``torch.save`` wrote with
  the same tensors.

The files are read once before timing, so every reader works from the page
cache, and the readers take turns within each repeat. Writing is timed too:
``save_tf_checkpoint`` (which fsyncs its data file) beside ``torch.save`` of the
same tensors. The output is a Markdown table of the median seconds and the
throughput.
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

from torchgrad_compat.checkpoint import load_tf_checkpoint, save_tf_checkpoint
from torchgrad_compat.optim import AdamOptimizer

_TF_TIMER = """
import json, sys, time, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
prefix, repeats = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(repeats + 1):
    start = time.perf_counter()
    reader = tf.train.load_checkpoint(prefix)
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name)
    times.append(time.perf_counter() - start)
print(json.dumps(times[1:]))
"""


def _model(mb: int, tensors: int) -> list[torch.nn.Parameter]:
    numel = mb * 2**20 // 4 // tensors
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(numel, generator=generator)) for _ in range(tensors)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mb", type=int, default=200, help="MB of float32 weights (the file is 3x: Adam's slots)"
    )
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--tf-python", help="an interpreter with TensorFlow (default: TORCHGRAD_COMPAT_TF_PYTHON)"
    )
    parser.add_argument("--quick", action="store_true", help="16 MB, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.repeats = 16, 2

    params = _model(args.mb, args.tensors)
    opt = AdamOptimizer(params, learning_rate=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    var_map = {f"layer{i}/kernel": p for i, p in enumerate(params)}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "model.ckpt-1")
        save_tf_checkpoint(prefix, var_map, opt, global_step=1)
        torch_file = Path(tmp) / "model.pt"
        torch.save(
            {"model": {k: p.detach() for k, p in var_map.items()}, "optimizer": opt.state_dict()}, torch_file
        )
        size = sum(f.stat().st_size for f in Path(tmp).glob("model.ckpt-1.*"))
        for f in Path(tmp).iterdir():
            f.read_bytes()  # into the page cache

        targets = [torch.empty_like(p) for p in params]
        target_opt = AdamOptimizer(targets, learning_rate=1e-3)
        target_map = {k: t for k, t in zip(var_map, targets)}
        results: dict[str, list[float]] = {"load_tf_checkpoint (ours)": [], "torch.load": []}
        load_tf_checkpoint(prefix, target_map, target_opt)  # warm-up
        for _ in range(args.repeats):
            results["load_tf_checkpoint (ours)"] += _time(
                lambda: load_tf_checkpoint(prefix, target_map, target_opt), 1
            )
            results["torch.load"] += _time(lambda: torch.load(torch_file, weights_only=True), 1)
        python = _tf_python(args.tf_python)
        if python is not None:
            out = subprocess.run(
                [python, "-c", _TF_TIMER, prefix, str(args.repeats)],
                capture_output=True,
                text=True,
                check=True,
            )
            results["tf.train.load_checkpoint + get_tensor"] = json.loads(out.stdout.strip().splitlines()[-1])
        state = {"model": {k: p.detach() for k, p in var_map.items()}, "optimizer": opt.state_dict()}
        saves: dict[str, list[float]] = {"save_tf_checkpoint (ours)": [], "torch.save": []}
        for _ in range(args.repeats):
            saves["save_tf_checkpoint (ours)"] += _time(
                lambda: save_tf_checkpoint(prefix, var_map, opt, global_step=1), 1
            )
            saves["torch.save"] += _time(lambda: torch.save(state, torch_file), 1)

    what = f"{args.tensors} variables with Adam's two slots"
    threads = torch.get_num_threads()
    print(f"checkpoint: {size / 2**20:.0f} MiB ({what}), page cache warm, {threads} torch threads\n")
    print("| reader / writer | median s | GiB/s |")
    print("|---|---|---|")
    for name, times in {**results, **saves}.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.3f} | {size / 2**30 / median:.2f} |")
    if python is None:
        print("\n(TensorFlow not found: set TORCHGRAD_COMPAT_TF_PYTHON or --tf-python for its row)")


if __name__ == "__main__":
    main()
