"""A TF1 training loop (warm-up + cosine decay, global-norm clipping, optimizer, EMA) continued
across frameworks: TF's run continued by scripts/train.py, and train.py's continued by TF.

tests/fixtures/tf_train_loop: scripts/make_tf_train_checkpoint.py --loop trained train.py's model
in a TF1 graph with the loop train.py's flags (in the manifest) run, K steps, saved, M more.
The weights, the optimizer's slots and state, and the moving averages after the M continued
steps must be TF's: each is compared under its TF name, the continued torch state written out
by save_tf_checkpoint and read back, so that every entry of TF's checkpoint is compared.

train.py trains in float32 only; tests/fixtures/tf_train_loop_float64 is the same TF run in
float64 (--dtype float64), and the float64 tests run train.py's loop through the library's API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from torchgrad_compat.checkpoint import list_tf_checkpoint, load_tf_checkpoint, save_tf_checkpoint
from torchgrad_compat.train import ExponentialMovingAverage, clip_by_global_norm_

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
FIXTURE = ROOT / "tests" / "fixtures" / "tf_train_loop"
FIXTURE_64 = ROOT / "tests" / "fixtures" / "tf_train_loop_float64"
CASES = {case["optimizer"]: case for case in json.loads((FIXTURE / "manifest.json").read_text())["cases"]}
CASES_64 = {
    case["optimizer"]: case for case in json.loads((FIXTURE_64 / "manifest.json").read_text())["cases"]
}
# train.py's state_dict names -> TF's names, and whether TF's is the transpose.
TRAIN_MODEL_NAMES = {
    "embedding.weight": ("embedding/embeddings", False),
    "hidden.weight": ("dense/kernel", True),
    "hidden.bias": ("dense/bias", False),
    "output.weight": ("dense_1/kernel", True),
    "output.bias": ("dense_1/bias", False),
}
# As test_train_script_continues_a_tensorflow_run: the two frameworks' matmuls and softmaxes
# round differently, so the runs are not bitwise; they differ by at most 6e-8 absolute (weights,
# slots and averages, both directions, values up to ~1), the beta powers and the step not at all.
TOLERANCE = {"float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _script(name: str, *args: Any, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _ema_decay(case: dict[str, Any]) -> float:
    flags = case["train_py_flags"]
    return float(flags[flags.index("--ema") + 1])


def _as_tf_checkpoint(saved: Path, case: dict[str, Any], prefix: Path) -> None:
    """train.py's --save file as the TF checkpoint of the loop's graph: weights, slots, averages, step."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from train import Classifier, optimizer_settings
    finally:
        sys.path.remove(str(SCRIPTS))
    state = torch.load(saved, weights_only=True)
    model = Classifier()
    cls, hyperparameters = optimizer_settings(case["optimizer"], None)
    opt = cls(model.parameters(), **hyperparameters)
    ema = ExponentialMovingAverage(_ema_decay(case))
    ema.apply(model.named_parameters())
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    ema.load_state_dict(state["ema"])
    var_map = {
        tf_name: (model.get_parameter(name), "transpose") if transposed else model.get_parameter(name)
        for name, (tf_name, transposed) in TRAIN_MODEL_NAMES.items()
    }
    save_tf_checkpoint(prefix, var_map, opt, ema=ema, global_step=state["step"])


def _read_all(prefix: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, by its TF name."""
    tensors = {
        name: torch.empty(shape, dtype=getattr(torch, dtype))
        for name, shape, dtype in list_tf_checkpoint(prefix)
    }
    load_tf_checkpoint(prefix, tensors)
    return {name: tensor.numpy() for name, tensor in tensors.items()}


def _assert_matches_tf(ours: dict[str, np.ndarray], reference: Path, dtype: str = "float32") -> None:
    with np.load(reference) as npz:
        theirs = {key.removeprefix("final/"): npz[key] for key in npz.files if key.startswith("final/")}
    assert sorted(ours) == sorted(theirs)
    assert any(name.endswith("/ExponentialMovingAverage") for name in ours)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        rtol, atol = TOLERANCE[dtype]
        np.testing.assert_allclose(ours[name], value, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("optimizer", sorted(CASES))
def test_train_script_continues_a_tensorflow_loop(optimizer: str, tmp_path: Path) -> None:
    """TF -> torch: TF's checkpoint of step K, converted with --ema, resumed with the loop's flags."""
    case = CASES[optimizer]
    converted, continued = tmp_path / "converted.pt", tmp_path / "continued.pt"
    out = _script(
        "convert_tf_checkpoint.py",
        FIXTURE / optimizer,
        converted,
        "--optimizer",
        optimizer,
        "--ema",
        _ema_decay(case),
        cwd=tmp_path,
    )
    assert f"at global step {case['steps_before']}; unused: none" in out
    flags = ["--optimizer", optimizer, *case["train_py_flags"]]
    out = _script(
        "train.py",
        "--resume",
        converted,
        *flags,
        "--steps",
        case["steps_after"],
        "--save",
        continued,
        cwd=tmp_path,
    )
    assert f"resumed {converted} at step {case['steps_before']}" in out
    _as_tf_checkpoint(continued, case, tmp_path / "ours" / "model.ckpt")
    _assert_matches_tf(_read_all(tmp_path / "ours" / "model.ckpt"), FIXTURE / optimizer / "reference.npz")


def test_the_loop_fixture_clips() -> None:
    """The fixture's clip norm is below every step's global norm: clipping scaled each update."""
    for optimizer, case in CASES.items():
        clip_norm = float(case["train_py_flags"][case["train_py_flags"].index("--clip-norm") + 1])
        steps = case["steps_before"] + case["steps_after"]
        with np.load(FIXTURE / optimizer / "reference.npz") as npz:
            norms = [float(npz[f"global_norm/{k}"]) for k in range(1, steps + 1)]
        assert min(norms) > clip_norm, (optimizer, norms)


@pytest.mark.tf_live
@pytest.mark.parametrize("optimizer", sorted(CASES))
def test_tensorflow_continues_a_train_script_loop(optimizer: str, tmp_path: Path, tf_python: str) -> None:
    """torch -> TF: train.py's run of step K, written by save_tf_checkpoint, restored by TF's graph
    of the same loop and trained M more steps, ends where train.py's own continuation does."""
    case = CASES[optimizer]
    before, after = case["steps_before"], case["steps_after"]
    flags = ["--optimizer", optimizer, *case["train_py_flags"]]
    _script("train.py", "--export-batches", tmp_path / "batches.npz", "--steps", before + after, cwd=tmp_path)
    _script("train.py", *flags, "--steps", before, "--save", tmp_path / "k.pt", cwd=tmp_path)
    _script(
        "train.py",
        *flags,
        "--resume",
        tmp_path / "k.pt",
        "--steps",
        after,
        "--save",
        tmp_path / "km.pt",
        cwd=tmp_path,
    )
    _as_tf_checkpoint(tmp_path / "k.pt", case, tmp_path / "k" / f"model.ckpt-{before}")
    result = subprocess.run(
        [
            tf_python,
            str(SCRIPTS / "make_tf_train_checkpoint.py"),
            "--batches",
            tmp_path / "batches.npz",
            "--loop",
            "--optimizer",
            optimizer,
            "--restore",
            tmp_path / "k" / f"model.ckpt-{before}",
            "--out",
            tmp_path / "tf",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    _as_tf_checkpoint(tmp_path / "km.pt", case, tmp_path / "km" / "model.ckpt")
    _assert_matches_tf(
        _read_all(tmp_path / "km" / "model.ckpt"), tmp_path / "tf" / optimizer / "reference.npz"
    )


def _train_py() -> Any:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import train
    finally:
        sys.path.remove(str(SCRIPTS))
    return train


class _Float64Loop:
    """train.py's model and loop (--style torch) in float64, through the library's API: the
    decay of the global step, clip_by_global_norm_, the optimizer, then the moving averages."""

    def __init__(self, case: dict[str, Any], checkpoint: Path | None = None) -> None:
        train = self.train = _train_py()
        self.args = train.parse_args(["--optimizer", case["optimizer"], *case["train_py_flags"]])
        torch.manual_seed(self.args.seed)
        self.model = train.Classifier().double()
        cls, hyperparameters = train.optimizer_settings(case["optimizer"], None)
        self.opt = cls(self.model.parameters(), **hyperparameters)
        self.global_step = torch.zeros((), dtype=torch.int64)
        self.ema = ExponentialMovingAverage(self.args.ema, num_updates=self.global_step)
        self.ema.apply(self.model.named_parameters())
        self.var_map = {
            tf_name: (self.model.get_parameter(name), "transpose")
            if transposed
            else self.model.get_parameter(name)
            for name, (tf_name, transposed) in TRAIN_MODEL_NAMES.items()
        }
        start = 0
        if checkpoint is not None:
            info = load_tf_checkpoint(checkpoint, self.var_map, self.opt, ema=self.ema)
            start = info.global_step
        self.global_step.fill_(start)
        self.schedule = train.decay_schedule(self.args, self.opt, hyperparameters["learning_rate"], start)
        self.train_set, _ = train.make_datasets(self.args.seed)
        self.batches = train.batch_indices(self.args.seed)
        for _ in range(start):
            next(self.batches)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            data = self.train_set.batch(next(self.batches))
            loss = F.cross_entropy(self.model(data.features.double(), data.tokens), data.labels)
            self.opt.zero_grad()
            loss.backward()
            clip_by_global_norm_(self.model.parameters(), self.args.clip_norm)
            self.opt.step()
            self.global_step += 1
            self.schedule.step()
            self.ema.apply(self.model.named_parameters())

    def save(self, prefix: Path) -> None:
        save_tf_checkpoint(prefix, self.var_map, self.opt, ema=self.ema, global_step=int(self.global_step))


@pytest.mark.parametrize("optimizer", sorted(CASES_64))
def test_the_loop_in_float64_continues_a_tensorflow_run(optimizer: str, tmp_path: Path) -> None:
    """TF -> torch in float64: TF's checkpoint of step K loaded (weights, slots, averages, step)
    and continued M steps by train.py's loop, run in float64."""
    case = CASES_64[optimizer]
    assert case["dtype"] == "float64"
    loop = _Float64Loop(case, FIXTURE_64 / optimizer)
    assert int(loop.global_step) == case["steps_before"]
    loop.run(case["steps_after"])
    loop.save(tmp_path / "model.ckpt")
    _assert_matches_tf(
        _read_all(tmp_path / "model.ckpt"), FIXTURE_64 / optimizer / "reference.npz", "float64"
    )


@pytest.mark.tf_live
@pytest.mark.parametrize("optimizer", sorted(CASES_64))
def test_tensorflow_continues_the_loop_in_float64(optimizer: str, tmp_path: Path, tf_python: str) -> None:
    """torch -> TF in float64: the loop's state at step K, restored by TF's float64 graph and
    trained M more steps, ends where the torch loop's own continuation does."""
    case = CASES_64[optimizer]
    before, after = case["steps_before"], case["steps_after"]
    _train_py().export_batches(tmp_path / "batches.npz", 0, before + after)
    loop = _Float64Loop(case)
    loop.run(before)
    loop.save(tmp_path / "k" / f"model.ckpt-{before}")
    loop.run(after)
    loop.save(tmp_path / "km" / "model.ckpt")
    result = subprocess.run(
        [
            tf_python,
            str(SCRIPTS / "make_tf_train_checkpoint.py"),
            "--batches",
            tmp_path / "batches.npz",
            "--loop",
            "--dtype",
            "float64",
            "--optimizer",
            optimizer,
            "--restore",
            tmp_path / "k" / f"model.ckpt-{before}",
            "--out",
            tmp_path / "tf",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference = tmp_path / "tf" / optimizer / "reference.npz"
    _assert_matches_tf(_read_all(tmp_path / "km" / "model.ckpt"), reference, "float64")
