"""The scripts users run: train.py trains (the loss falls), fault_cases.py finds every error named,
tf_checkpoint_table.py reports every TF checkpoint case within tolerance."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _deadlines import scaled

TRAIN = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
SUMMARY = re.compile(r"^done: .* training loss (\d+\.\d+) -> (\d+\.\d+), held-out accuracy", re.MULTILINE)


# Adam (the default run, see adam_run): the dense rule and its non-lazy sparse rule, torch
# style; Ftrl: a variable computed from its accumulators, with l1, TF style; Momentum under
# bfloat16 autocast with dynamic loss scaling. Each run costs ~3 s, mostly importing torch, so
# three are enough here; tests/ covers every optimizer.
@pytest.mark.parametrize(
    ("optimizer", "style", "extra"),
    [("ftrl", "tf", []), ("momentum", "torch", ["--loss-scale", "dynamic"])],
)
def test_train_script_reduces_loss(optimizer: str, style: str, extra: list[str]) -> None:
    first, last = _train("--optimizer", optimizer, "--style", style, "--steps", "30", *extra)
    assert last < 0.8 * first


@pytest.fixture(scope="module")
def adam_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[float, float, Path]:
    """scripts/train.py's default run (Adam, torch style) for 30 steps, saved: its first and last
    loss, and its checkpoint."""
    saved = tmp_path_factory.mktemp("adam") / "whole.pt"
    return (*_train("--steps", "30", "--save", str(saved)), saved)


def test_train_script_reduces_loss_with_adam(adam_run: tuple[float, float, Path]) -> None:
    first, last, _ = adam_run
    assert last < 0.8 * first


def _train(*args: str, timeout: float = 60) -> tuple[float, float]:
    """Run scripts/train.py within ``timeout`` s (scaled); (first, last) loss from its summary line."""
    result = subprocess.run(
        [sys.executable, str(TRAIN), *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        check=False,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    assert result.returncode == 0, result.stderr
    match = SUMMARY.search(result.stdout)
    assert match, f"no summary line in:\n{result.stdout}"
    return float(match[1]), float(match[2])


def _run_script(script: Path, args: list[str], *, timeout: float) -> str:
    """Run ``python script *args``; its stdout, once it has exited with 0 (else its output's ends)."""
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
@pytest.mark.parametrize("style", ["torch", "tf"])
def test_train_script_on_xla_prints_the_cpu_numbers(style: str) -> None:
    """One XLA replica (dense embedding gradient) against the CPU, to the 4 printed digits."""
    on_xla = _train("--device", "xla", "--style", style, "--steps", "30", timeout=300)
    on_cpu = _train("--style", style, "--steps", "30")
    assert on_xla == on_cpu


def test_every_hostile_case_gets_a_named_error_and_changes_nothing() -> None:
    """scripts/fault_cases.py: bad hyperparameters, gradients, loads and loss-scaling misuse."""
    script = TRAIN.with_name("fault_cases.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=scaled(300), check=False
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # Every case named, or (a hostile neighbour that needs no error) unharmed.
    total = re.search(r"^\| all \| (\d+) \| (\d+) \| (\d+) \|", result.stdout, re.MULTILINE)
    assert total and int(total.group(1)) == int(total.group(2)) + int(total.group(3)) > 700, result.stdout


def test_tf_checkpoint_table_reports_every_case_within_tolerance() -> None:
    """scripts/tf_checkpoint_table.py: a row per fixture case, all within the parity tolerance."""
    import json

    script = TRAIN.with_name("tf_checkpoint_table.py")
    result = subprocess.run(
        [sys.executable, str(script), "--no-tf"],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    manifest = json.loads((TRAIN.parents[1] / "tests/fixtures/tf_checkpoint/manifest.json").read_text())
    rows = re.findall(
        r"^\| ((?:name|object)-\S+) \| .* \| (\S+) \(\S+\) \| (.*) \| — \|$", result.stdout, re.M
    )
    assert [row[0] for row in rows] == [case["id"] for case in manifest]
    assert all(float(tf_to_torch) < 1e-6 for _, tf_to_torch, _ in rows)
    assert "over tolerance" not in result.stdout
    train_rows = re.findall(r"^\| ([a-z_]+) \| (\S+) \(\S+\) \|$", result.stdout, re.M)
    assert len(train_rows) == 10 and all(float(delta) < 1e-6 for _, delta in train_rows), result.stdout


def test_tf_checkpoint_bench_smoke() -> None:
    """scripts/bench_tf_checkpoint.py on a 0.3 MB checkpoint: a row per reader and writer, with memory."""
    _tf_checkpoint_bench(["--no-tf"], {"load_tf_checkpoint (ours)", "torch.load"})


@pytest.mark.tf_live
def test_tf_checkpoint_bench_smoke_with_tensorflow(tf_python: str) -> None:
    """With TensorFlow, its reader has a row too."""
    _tf_checkpoint_bench(
        ["--tf-python", tf_python],
        {"load_tf_checkpoint (ours)", "torch.load", "tf.train.load_checkpoint + get_tensor"},
    )


def _tf_checkpoint_bench(args: list[str], expected: set[str]) -> None:
    script = TRAIN.with_name("bench_tf_checkpoint.py")
    args = ["--mb", "0.3", "--tensors", "3", "--repeats", "1", *args]
    stdout = _run_script(script, args, timeout=scaled(300))
    readers = dict(
        re.findall(r"^\| ([^|]+?) \| [\d.]+ \| [\d.]+ \| (\d+) \| -?\d+ \| -?[\d.]+x \|$", stdout, re.M)
    )
    assert set(readers) == expected, stdout
    assert all(int(peak) > 0 for peak in readers.values())
    assert re.search(r"^\| save_tf_checkpoint \(ours\) \| [\d.]+ \|", stdout, re.M), stdout


def test_train_script_resumes_bitwise(tmp_path: Path, adam_run: tuple[float, float, Path]) -> None:
    """--save after 15 steps, --resume for 15 more: the weights of 30 steps in one run, bitwise."""
    import torch

    _train("--steps", "15", "--save", str(tmp_path / "half.pt"))
    _train("--resume", str(tmp_path / "half.pt"), "--steps", "15", "--save", str(tmp_path / "resumed.pt"))
    whole = torch.load(adam_run[2], weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert whole["step"] == resumed["step"] == 30
    assert all(torch.equal(whole["model"][k], resumed["model"][k]) for k in whole["model"])


# A TF1 training loop's other parts: a cosine decay after a linear warm-up, clipping by the global
# norm, a moving average of the weights.
LOOP = [
    "--decay",
    "cosine",
    "--warmup-steps",
    "3",
    "--decay-steps",
    "8",
    "--clip-norm",
    "0.5",
    "--ema",
    "0.9",
]


@pytest.mark.parametrize("extra", [[], ["--loss-scale", "dynamic"]], ids=["bare", "loss-scale"])
def test_train_script_with_decay_clipping_and_ema_resumes_bitwise(tmp_path: Path, extra: list[str]) -> None:
    """With --decay, --clip-norm and --ema: the TF style prints the torch style's numbers, and 4
    steps, --save, --resume for 4 more end with the weights, optimizer state and averages of 8
    steps in one run, bitwise, at the decay's learning rate of step 8."""
    import torch

    from torchgrad_compat import train

    whole = _train("--steps", "8", *LOOP, *extra, "--save", str(tmp_path / "whole.pt"))
    if not extra:
        assert _train("--steps", "8", "--style", "tf", *LOOP) == whole
    _train("--steps", "4", *LOOP, *extra, "--save", str(tmp_path / "half.pt"))
    _train(
        "--resume",
        str(tmp_path / "half.pt"),
        "--steps",
        "4",
        *LOOP,
        *extra,
        "--save",
        str(tmp_path / "resumed.pt"),
    )
    one, two = (torch.load(tmp_path / f, weights_only=True) for f in ("whole.pt", "resumed.pt"))
    assert one["step"] == two["step"] == 8
    for part in ("model", "ema"):
        assert one[part].keys() == two[part].keys()
        assert all(torch.equal(one[part][k], two[part][k]) for k in one[part])
    assert any(
        not torch.equal(one["ema"][f"{k}/ExponentialMovingAverage"], v) for k, v in one["model"].items()
    )
    lr = train.linear_warmup(0.01, train.cosine_decay(0.01, None, 8, alpha=0.01), 3).at(8)
    assert [g["lr"] for g in two["optimizer"]["param_groups"]] == [lr]
    assert torch.equal(one["optimizer"]["state"][0]["m"], two["optimizer"]["state"][0]["m"])


def test_amp_bench_smoke() -> None:
    """scripts/bench_amp.py: a row per inner optimizer, with the bare step, both loss scales and
    GradScaler. Ours on its foreach path: the fused one's first step compiles a kernel (~14 s of
    CPU), which tests/amp and tests/optim/test_fused.py check."""
    script = TRAIN.with_name("bench_amp.py")
    inner = ["AdamOptimizer (ours, foreach)", "torch Adam (fused)"]
    args = ["--workload", "1M", "--warmup", "1", "--repeats", "2", "--inner", *inner]
    stdout = _run_script(script, args, timeout=scaled(300))
    overhead = r"\*{0,2}[+-][\d.]+%\*{0,2}"
    rows = re.findall(rf"^\| (.+?) \| [\d.]+(?: \| [\d.]+ \| {overhead}){{3}} \|$", stdout, re.M)
    assert rows == inner, stdout


def test_amp_bench_checks_smoke() -> None:
    """scripts/bench_amp.py --checks: a time for each gradient pass, after the compiled read-only
    check was seen to catch an infinity (the script raises otherwise)."""
    script = TRAIN.with_name("bench_amp.py")
    stdout = _run_script(script, ["--checks", "--quick"], timeout=scaled(300))
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \|$", stdout, re.M)
    assert [name.split(",")[0].split(":")[0] for name, _ in rows] == [
        "torch check-and-unscale",
        "read-only check",
        "floor",
    ], stdout
    assert all(float(ms) > 0 for _, ms in rows)


def test_clip_bench_smoke() -> None:
    """scripts/bench_clip.py: a row per workload with both clips, both norms and the floor."""
    script = TRAIN.with_name("bench_clip.py")
    args = ["--workload", "1M", "--warmup", "1", "--repeats", "2", "--threads", "1"]
    stdout = _run_script(script, args, timeout=300)
    number = r"[\d.]+"
    ratio = r"\*{0,2}[\d.]+x\*{0,2}"
    row = rf"^\| 1M \(100 x 10,000\) \| {number} \(\d+%\) \| {number} \(\d+%\) \| {ratio} \| {number} "
    row += rf"\| {number} \| {ratio} \| {number} \| \d+% \|$"
    assert re.search(row, stdout, re.M), stdout


def test_decay_bench_smoke() -> None:
    """scripts/bench_decay.py: a row per decay with DecayLR, torch's scheduler, the callable and
    ``at``; a training-step row per learning-rate style with the decay's cost."""
    script = TRAIN.with_name("bench_decay.py")
    args = ["--quick", "--inner", "5", "--decay", "exponential", "--train-decay", "cosine"]
    args += ["--optimizer", "GradientDescentOptimizer", "--threads", "1", "--clock", "cpu"]
    stdout = _run_script(script, args, timeout=scaled(120))
    cell = r"[\d.]+ \(\d+%\)"
    decays = re.findall(
        rf"^\| (\w+) \| (\w+) \| {cell} \| {cell} \| [+-][\d.]+ \| [\d.]+x \| {cell} \| {cell} \|$",
        stdout,
        re.M,
    )
    assert decays == [("exponential", "ExponentialLR"), ("cosine", "CosineAnnealingLR")], stdout
    row = r"^\| GradientDescentOptimizer \| ([^|]+) \| \d+ \(\d+%\) "
    row += r"\| (—|[+-]\d+) \| (—|[\d.]+) \| (—|[\d.]+%) \|$"
    steps = re.findall(row, stdout, re.M)
    assert [name for name, *_ in steps] == [
        "constant lr",
        "DecayLR",
        "torch CosineAnnealingLR",
        "constant lr, TF style",
        "decay callable, TF style",
    ], stdout
    assert [cost == "—" for _, cost, _, _ in steps] == [True, False, False, True, False], stdout
    assert all(float(alone) > 0 for _, _, alone, _ in steps if alone != "—"), stdout


def test_ema_bench_smoke() -> None:
    """scripts/bench_ema.py --no-fused (whose first update would compile a kernel): a row with our
    foreach and loop updates, AveragedModel, the bare lerp and the floor, and their ratios."""
    script = TRAIN.with_name("bench_ema.py")
    args = ["--workload", "1M", "--warmup", "1", "--repeats", "2", "--threads", "1", "--no-fused"]
    stdout = _run_script(script, args, timeout=scaled(120))
    cell = r"[\d.]+ \(\d+%\)"
    row = rf"^\| 1M \| — \| {cell} \| {cell} \| {cell} \| {cell} \| {cell} \| — \| \*{{0,2}}[\d.]+x\*{{0,2}} "
    row += r"\| — \| — \|$"
    assert re.search(row, stdout, re.M), stdout
