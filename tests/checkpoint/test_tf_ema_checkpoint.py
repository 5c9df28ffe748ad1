"""Moving averages (``ExponentialMovingAverage``) into and out of TF checkpoints: ``ema=``.

The fixture in tests/fixtures/tf_ema_checkpoint was written by
scripts/make_tf_ema_checkpoint_fixtures.py: a TF1 graph with ``dense/kernel``,
``dense/bias``, Momentum, and a zero-debiased ``ExponentialMovingAverage`` of
both variables and of the tensor ``moments/mean``, after 3 steps.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from torchgrad_compat.checkpoint import (
    CheckpointMismatchError,
    list_tf_checkpoint,
    load_tf_checkpoint,
    save_tf_checkpoint,
    suggest_var_map,
)
from torchgrad_compat.optim import MomentumOptimizer
from torchgrad_compat.train import ExponentialMovingAverage

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tf_ema_checkpoint"
GENERATOR = ROOT / "scripts" / "make_tf_ema_checkpoint_fixtures.py"
MOMENTUM_FIXTURE = ROOT / "tests" / "fixtures" / "tf_checkpoint" / "name-Momentum-default-float32"
SHADOWS = ("dense/kernel/ExponentialMovingAverage", "dense/bias/ExponentialMovingAverage")
MEAN = "moments/mean/ExponentialMovingAverage"


def _saved() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "arrays.npz") as npz:
        return {k.removeprefix("saved/"): npz[k] for k in npz.files if k.startswith("saved/")}


class Run:
    """torch's counterpart of the generator's graph; the EMA knows the variables by torch's names."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 4)
        self.opt = MomentumOptimizer(self.layer.parameters(), learning_rate=0.05, momentum=0.9)
        self.step = torch.tensor(0)
        self.ema = ExponentialMovingAverage(0.9, num_updates=self.step, zero_debias=True)
        self.ema.apply(self.layer.named_parameters(), tensors={"moments/mean": self.mean()})
        self.var_map = {"dense/kernel": (self.layer.weight, "transpose"), "dense/bias": self.layer.bias}

    def mean(self) -> torch.Tensor:
        return self.layer.weight.detach().T.mean(dim=1)

    def train_step(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for p in self.layer.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        self.opt.step()
        self.step += 1
        self.ema.apply(self.layer.named_parameters(), tensors={"moments/mean": self.mean()})

    def tf_values(self) -> dict[str, torch.Tensor]:
        """Everything the TF graph holds, by TF's names, in TF's layout."""
        w, b = self.layer.weight, self.layer.bias
        ema = self.ema.state_dict()
        return {
            "dense/kernel": w.detach().T,
            "dense/bias": b.detach(),
            "dense/kernel/Momentum": self.opt.state[w]["momentum"].T,
            "dense/bias/Momentum": self.opt.state[b]["momentum"],
            "dense/kernel/ExponentialMovingAverage": self.ema.average(w).T,
            "dense/bias/ExponentialMovingAverage": self.ema.average(b),
            MEAN: ema[MEAN],
            f"{MEAN}/biased": ema[f"{MEAN}/biased"],
            f"{MEAN}/local_step": ema[f"{MEAN}/local_step"],
        }

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the weights, the optimizer's state (none before its first step) and the EMA's."""
        out = {f"model/{k}": v.clone() for k, v in self.layer.state_dict().items()}
        out |= {f"ema/{k}": v.clone() for k, v in self.ema.state_dict().items()}
        for i, state in self.opt.state_dict()["state"].items():
            out |= {f"opt/{i}/{k}": v.clone() for k, v in state.items()}
        return out


def _assert_unchanged(run: Run, before: dict[str, torch.Tensor]) -> None:
    after = run.snapshot()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_loads_tensorflows_weights_slots_and_averages_bitwise() -> None:
    run = Run()
    info = load_tf_checkpoint(FIXTURE, run.var_map, run.opt, ema=run.ema)
    saved = _saved()
    assert info.global_step == 3 and info.unused == []
    assert sorted(info.loaded) == sorted(saved)
    for name, value in run.tf_values().items():
        assert torch.equal(value, torch.from_numpy(saved[name])), name


def test_without_ema_the_averages_are_left_unused() -> None:
    run = Run()
    before = run.ema.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    info = load_tf_checkpoint(FIXTURE, run.var_map, run.opt)
    assert info.unused == sorted([*SHADOWS, MEAN, f"{MEAN}/biased", f"{MEAN}/local_step"])
    for key, value in run.ema.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_saves_tensorflows_names_and_values(tmp_path: Path) -> None:
    run = Run()
    load_tf_checkpoint(FIXTURE, run.var_map, run.opt, ema=run.ema)
    prefix = save_tf_checkpoint(tmp_path / "model.ckpt-3", run.var_map, run.opt, ema=run.ema, global_step=3)
    assert list_tf_checkpoint(prefix) == list_tf_checkpoint(FIXTURE)
    copy = Run()
    load_tf_checkpoint(prefix, copy.var_map, copy.opt, ema=copy.ema)
    saved = _saved()
    for name, value in copy.tf_values().items():
        assert torch.equal(value, torch.from_numpy(saved[name])), name


def test_save_then_load_after_training_is_bitwise(tmp_path: Path) -> None:
    run = Run()
    for seed in range(3):
        run.train_step(seed)
    prefix = save_tf_checkpoint(tmp_path / "model.ckpt", run.var_map, run.opt, ema=run.ema)
    copy = Run()
    load_tf_checkpoint(prefix, copy.var_map, copy.opt, ema=copy.ema)
    for name, value in run.tf_values().items():
        assert torch.equal(copy.tf_values()[name], value), name


def test_a_var_map_of_aliases_carries_the_shadows(tmp_path: Path) -> None:
    """``model.state_dict()`` values are other tensor objects over the parameters' memory."""
    run = Run()
    aliases = run.layer.state_dict()
    var_map = {"dense/kernel": (aliases["weight"], "transpose"), "dense/bias": aliases["bias"]}
    info = load_tf_checkpoint(FIXTURE, var_map, ema=run.ema)
    assert set(SHADOWS) <= set(info.loaded)
    assert torch.equal(run.ema.average(run.layer.weight).T, torch.from_numpy(_saved()[SHADOWS[0]]))


def test_views_of_part_of_a_variable_take_the_same_view_of_its_shadow(tmp_path: Path) -> None:
    """TF's separate q and k kernels as row blocks of one torch weight: each shadow is the block of
    the weight's shadow, in TF's layout."""
    weight = torch.nn.Parameter(torch.randn(6, 3))
    ema = ExponentialMovingAverage(0.5)
    ema.apply({"in_proj_weight": weight})
    with torch.no_grad():
        weight.add_(1.0)
    ema.apply([weight])
    var_map = {"q/kernel": (weight[:3], "transpose"), "k/kernel": (weight[3:], "transpose")}
    prefix = save_tf_checkpoint(tmp_path / "model.ckpt", var_map, ema=ema)
    from torchgrad_compat.checkpoint._bundle import BundleReader

    reader = BundleReader(prefix)
    assert torch.equal(reader.read("q/kernel/ExponentialMovingAverage"), ema.average(weight)[:3].T)
    assert torch.equal(reader.read("k/kernel/ExponentialMovingAverage"), ema.average(weight)[3:].T)
    copy = torch.nn.Parameter(torch.zeros(6, 3))
    copy_ema = ExponentialMovingAverage(0.5)
    copy_ema.apply({"in_proj_weight": copy})
    copy_map = {"q/kernel": (copy[:3], "transpose"), "k/kernel": (copy[3:], "transpose")}
    load_tf_checkpoint(prefix, copy_map, ema=copy_ema)
    assert torch.equal(copy, weight) and torch.equal(copy_ema.average(copy), ema.average(weight))


def test_a_shadow_of_another_shape_raises_and_changes_nothing(tmp_path: Path) -> None:
    run = Run()
    run.train_step(seed=0)  # slots and averages of its own, which the failed load must keep
    saved = {name: torch.from_numpy(value) for name, value in _saved().items()}
    saved[SHADOWS[0]] = saved[SHADOWS[0]].T.contiguous()  # torch's layout, not TF's
    from torchgrad_compat.checkpoint._bundle import write_bundle

    write_bundle(str(tmp_path / "model.ckpt"), saved)
    before = run.snapshot()
    with pytest.raises(CheckpointMismatchError, match=SHADOWS[0]) as caught:
        load_tf_checkpoint(tmp_path / "model.ckpt", run.var_map, run.opt, ema=run.ema)
    assert list(caught.value.problems) == [SHADOWS[0]]
    _assert_unchanged(run, before)


def test_a_local_step_that_is_no_count_raises_and_changes_nothing(tmp_path: Path) -> None:
    run = Run()
    saved = {name: torch.from_numpy(value) for name, value in _saved().items()}
    saved[f"{MEAN}/local_step"] = torch.tensor(-1.0)
    from torchgrad_compat.checkpoint._bundle import write_bundle

    write_bundle(str(tmp_path / "model.ckpt"), saved)
    before = run.snapshot()
    with pytest.raises(CheckpointMismatchError, match="local_step"):
        load_tf_checkpoint(tmp_path / "model.ckpt", run.var_map, run.opt, ema=run.ema)
    _assert_unchanged(run, before)


def test_a_checkpoint_without_averages_raises_naming_each_and_changes_nothing() -> None:
    run = Run()
    before = run.snapshot()
    with pytest.raises(CheckpointMismatchError) as caught:
        load_tf_checkpoint(MOMENTUM_FIXTURE, run.var_map, run.opt, ema=run.ema)
    assert set(caught.value.problems) == {*SHADOWS, MEAN, f"{MEAN}/biased", f"{MEAN}/local_step"}
    _assert_unchanged(run, before)


def test_strict_false_leaves_the_averages_a_checkpoint_lacks() -> None:
    """A run trained without an EMA: its weights and slots load, the shadows keep their values."""
    run = Run()
    before = {k: v.clone() for k, v in run.ema.state_dict().items()}
    info = load_tf_checkpoint(MOMENTUM_FIXTURE, run.var_map, run.opt, ema=run.ema, strict=False)
    assert set(info.skipped) == {*SHADOWS, MEAN, f"{MEAN}/biased", f"{MEAN}/local_step"}
    assert all(why == "not in the checkpoint" for why in info.skipped.values())
    assert {"dense/kernel", "dense/kernel/Momentum"} <= set(info.loaded)
    for key, value in run.ema.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_an_average_of_a_variable_not_in_var_map_raises_and_changes_nothing(tmp_path: Path) -> None:
    run = Run()
    before = run.snapshot()
    var_map = {"dense/kernel": (run.layer.weight, "transpose")}
    with pytest.raises(ValueError, match="ema averages 'bias'.*var_map does not map"):
        load_tf_checkpoint(FIXTURE, var_map, run.opt, ema=run.ema)
    _assert_unchanged(run, before)
    with pytest.raises(ValueError, match="ema averages 'bias'"):
        save_tf_checkpoint(tmp_path / "model.ckpt", var_map, ema=run.ema)
    assert list(tmp_path.iterdir()) == []


def test_an_ema_not_yet_applied_raises_and_changes_nothing(tmp_path: Path) -> None:
    run = Run()
    before = run.snapshot()
    fresh = ExponentialMovingAverage(0.9)
    with pytest.raises(ValueError, match="holds no averages yet"):
        load_tf_checkpoint(FIXTURE, run.var_map, run.opt, ema=fresh)
    _assert_unchanged(run, before)
    with pytest.raises(ValueError, match="holds no averages yet"):
        save_tf_checkpoint(tmp_path / "model.ckpt", run.var_map, ema=fresh)
    assert list(tmp_path.iterdir()) == []


def test_inside_swapped_raises_and_changes_nothing(tmp_path: Path) -> None:
    """The variables hold the averages until the block ends: a save would write them as weights,
    a load's weights would be undone when it ends."""
    run = Run()
    run.train_step(seed=0)
    before = run.snapshot()
    with run.ema.swapped():
        with pytest.raises(RuntimeError, match="inside ema.swapped"):
            load_tf_checkpoint(FIXTURE, run.var_map, run.opt, ema=run.ema)
        with pytest.raises(RuntimeError, match="inside ema.swapped"):
            save_tf_checkpoint(tmp_path / "model.ckpt", run.var_map, run.opt, ema=run.ema)
    _assert_unchanged(run, before)
    assert list(tmp_path.iterdir()) == []


def test_bad_ema_arguments() -> None:
    run = Run()
    with pytest.raises(TypeError, match="ema must be a torchgrad_compat.train.ExponentialMovingAverage"):
        load_tf_checkpoint(FIXTURE, run.var_map, ema={"dense/kernel": run.layer.weight})
    object_based = ROOT / "tests" / "fixtures" / "tf_checkpoint" / "object-Momentum-default-float32"
    var_map = {"model/dense/kernel": (run.layer.weight, "transpose"), "model/dense/bias": run.layer.bias}
    with pytest.raises(ValueError, match="object-based"):
        load_tf_checkpoint(object_based, var_map, ema=run.ema)


def test_suggest_var_map_lists_the_averages_apart() -> None:
    run = Run()
    suggestion = suggest_var_map(FIXTURE, run.layer)
    assert sorted(suggestion) == ["dense/bias", "dense/kernel"]
    assert suggestion.unmatched_checkpoint == [] and suggestion.unmatched_module == []
    assert suggestion.averages == [
        (SHADOWS[1], (4,)),
        (SHADOWS[0], (3, 4)),
        (MEAN, (3,)),
        (f"{MEAN}/biased", (3,)),
        (f"{MEAN}/local_step", ()),
    ]
    assert "moving averages (load them with ema=): 5" in suggestion.report()
    info = load_tf_checkpoint(FIXTURE, suggestion, run.opt, ema=run.ema)
    assert info.unused == []
    with pytest.raises(ValueError, match="ema_name"):
        suggest_var_map(FIXTURE, run.layer, ema_name="a/b")


@pytest.mark.tf_live
def test_tensorflow_restores_the_averages_torch_saved(tmp_path: Path, tf_python: str) -> None:
    """TF1's Saver restores torch's checkpoint into a graph with an ExponentialMovingAverage:
    every variable, slot and average as torch holds it."""
    run = Run()
    load_tf_checkpoint(FIXTURE, run.var_map, run.opt, ema=run.ema)
    run.train_step(seed=7)  # values of torch's own, none of the fixture's
    prefix = save_tf_checkpoint(tmp_path / "model.ckpt-4", run.var_map, run.opt, ema=run.ema, global_step=4)
    result = subprocess.run(
        [tf_python, str(GENERATOR), "--restore", prefix],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with np.load(f"{prefix}.restored.npz") as npz:
        restored = {key: npz[key] for key in npz.files}
    ours = run.tf_values()
    assert sorted(restored) == sorted([*ours, "global_step"])
    assert int(restored["global_step"]) == 4
    for name, value in ours.items():
        assert np.array_equal(restored[name], value.numpy()), name


@pytest.mark.tf_live
def test_generator_reproduces_the_fixture(run_tf_generator) -> None:
    out = run_tf_generator(GENERATOR)
    assert list_tf_checkpoint(out) == list_tf_checkpoint(FIXTURE)
    with np.load(out / "arrays.npz") as fresh, np.load(FIXTURE / "arrays.npz") as old:
        assert sorted(fresh.files) == sorted(old.files)
        for key in old.files:
            assert np.array_equal(fresh[key], old[key]), key
