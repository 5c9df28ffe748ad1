"""TF checkpoints in and out, checked against real TensorFlow runs continued across the checkpoint.

The fixtures in tests/fixtures/tf_checkpoint were written by
scripts/make_tf_checkpoint_fixtures.py (TF 2.21): each case trained a small
model (``dense/kernel`` in TF's [in, out] layout, ``dense/bias``, and
``embedding/embeddings`` with sparse gradients) for K steps, saved a checkpoint,
and trained M more steps. Here:

- load: a fresh torch model and optimizer load the checkpoint (the kernel
  transposed into torch's Linear layout), must then hold exactly what TF's own
  reader read, and after the same M steps must equal TF's K + M run;
- save: torch trains the first K steps itself and saves; the checkpoint must
  hold TF's names, shapes and dtypes and (at the parity tolerance) TF's values
  at step K; with TensorFlow available (``TORCHGRAD_COMPAT_TF_PYTHON``), TF's
  Saver restores it and continues, and must equal torch continuing;
- bad input: every way a load can be refused raises a named error listing the
  offending names and changes nothing, and ``strict=False`` loads the rest;
- suggest_var_map: by name, shape and order, ambiguity refused;
- train.py's model trained in TF (tests/fixtures/tf_train,
  scripts/make_tf_train_checkpoint.py): scripts/convert_tf_checkpoint.py and
  ``train.py --resume`` continue it as TF did.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _deadlines import scaled

import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer
from torchgrad_compat.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    list_tf_checkpoint,
    load_tf_checkpoint,
    save_tf_checkpoint,
)

# Where the optimizers keep optimizer-wide state (Adam's beta powers) is the package's business;
# the tests read it through the checkpoint module's one accessor, as the code under test does.
from torchgrad_compat.checkpoint._bundle import write_bundle
from torchgrad_compat.checkpoint._mapping import _optimizer_wide_state

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "tf_checkpoint"
GENERATOR = ROOT / "scripts" / "make_tf_checkpoint_fixtures.py"
MANIFEST: list[dict[str, Any]] = json.loads((FIXTURES / "manifest.json").read_text())
NAME_BASED = [case for case in MANIFEST if case["format"] == "name"]
# DESIGN.md's parity target, as in test_tf_parity.py.
TOLERANCE = {"float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}
ATTRIBUTE = "/.ATTRIBUTES/VARIABLE_VALUE"
KERNEL = "dense/kernel"  # TF [in, out]; held here as torch's Linear weight [out, in]


def _ids(cases: list[dict[str, Any]]) -> list[Any]:
    return [pytest.param(case, id=case["id"]) for case in cases]


@functools.cache
def _arrays(case_id: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / case_id / "arrays.npz") as npz:
        return {key: npz[key] for key in npz.files}


class Run:
    """A case's torch side: the three tensors (kernel in torch's layout) and the optimizer."""

    def __init__(self, case: dict[str, Any], init: bool):
        self.case = case
        arrays = _arrays(case["id"])
        dtype = getattr(torch, case["dtype"])
        self.tensors: dict[str, torch.Tensor] = {}
        for var, shape in case["variables"].items():
            value = torch.tensor(arrays[f"init/{var}"]) if init else torch.zeros(shape, dtype=dtype)
            self.tensors[var] = torch.nn.Parameter(value.T.contiguous() if var == KERNEL else value)
        cls = getattr(tgo, case["optimizer"])
        self.inner = cls(list(self.tensors.values()), **case["kwargs"])
        self.opt: Any = self.inner
        if case["loss_scale"]:
            self.opt = LossScaleOptimizer(self.inner, DynamicLossScale(**case["loss_scale"]))

    def var_map(self) -> dict[str, Any]:
        prefix = "model/" if self.case["format"] == "object" else ""
        return {prefix + var: (t, "transpose") if var == KERNEL else t for var, t in self.tensors.items()}

    def load(self) -> Any:
        return load_tf_checkpoint(
            FIXTURES / self.case["prefix"],
            self.var_map(),
            self.opt,
            optimizer_name=self.case["optimizer_name"],
        )

    def step(self, k: int) -> None:
        self.opt.apply_gradients(_pairs(self, k))

    def finals(self) -> dict[str, np.ndarray]:
        """Ours, keyed as the fixtures' ``final/...`` arrays, in TF's layout."""
        out = {}
        for var, t in self.tensors.items():
            tf_layout = (lambda x: x.T) if var == KERNEL else (lambda x: x)
            out[f"final/{var}"] = tf_layout(t.detach()).numpy().copy()
            for slot in self.inner.get_slot_names():
                out[f"final/{var}/{slot}"] = tf_layout(self.inner.get_slot(t, slot)).numpy().copy()
        for key, value in _optimizer_wide_state(self.inner)[0].items():
            if key != "global_step":  # AdagradDA's own step; TF's is the global step
                out[f"final/non_slot/{key}"] = value.numpy().copy()
        if self.case["loss_scale"]:
            out["final/loss_scale/current_loss_scale"] = self.opt.loss_scale().numpy().copy()
            out["final/loss_scale/good_steps"] = self.opt.loss_scale.good_steps.numpy().copy()
        return out


def _pairs(run: Run, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``k``'s (gradient, tensor) pairs: dense, the kernel's transposed, the embedding's row-sparse."""
    arrays = _arrays(run.case["id"])
    pairs = []
    for var, t in run.tensors.items():
        if f"grad/{var}/{k}" in arrays:
            grad = torch.tensor(arrays[f"grad/{var}/{k}"])
            pairs.append((grad.T.contiguous() if var == KERNEL else grad, t))
        else:
            indices = torch.tensor(arrays[f"grad/{var}/{k}/indices"])[None]
            values = torch.tensor(arrays[f"grad/{var}/{k}/values"])
            pairs.append((torch.sparse_coo_tensor(indices, values, t.shape, check_invariants=True), t))
    return pairs


def _assert_close(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], dtype: str) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype, f"{key}: dtype {ours[key].dtype}, TF's is {value.dtype}"
        np.testing.assert_allclose(ours[key], value, rtol=rtol, atol=atol, err_msg=key)


def _tf_finals(case: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v for k, v in _arrays(case["id"]).items() if k.startswith("final/")}


# ---------------------------------------------------------------------- reading TF's checkpoints
@pytest.mark.parametrize("case", _ids(MANIFEST))
def test_list_matches_tensorflow(case: dict[str, Any]) -> None:
    """Names, shapes and dtypes as TF's own reader saw them (``saved/...``), read without TF."""
    listed = list_tf_checkpoint(FIXTURES / case["prefix"])
    saved = {k[len("saved/") :]: v for k, v in _arrays(case["id"]).items() if k.startswith("saved/")}
    numeric = [entry for entry in listed if entry[2] != "string"]
    assert [name for name, _, _ in numeric] == sorted(saved)
    for name, shape, dtype in numeric:
        assert shape == saved[name].shape, name
        assert dtype == saved[name].dtype.name, name
    assert [entry for entry in listed if entry[2] == "string"] == (
        [("_CHECKPOINTABLE_OBJECT_GRAPH", (), "string")] if case["format"] == "object" else []
    )


@pytest.mark.parametrize("case", _ids(MANIFEST))
def test_load_then_continue_matches_tensorflow(case: dict[str, Any]) -> None:
    run = Run(case, init=False)
    info = run.load()
    arrays = _arrays(case["id"])
    saved = {k[len("saved/") :]: v for k, v in arrays.items() if k.startswith("saved/")}
    step_name = "step" + ATTRIBUTE if case["format"] == "object" else "global_step"
    assert info.global_step == case["steps_before"] == int(saved[step_name])
    assert info.unused == (["save_counter" + ATTRIBUTE] if case["format"] == "object" else [])
    assert info.loaded == sorted(set(saved) - set(info.unused))
    # What was loaded is exactly what TF's reader read (before any step).
    for var, t in run.tensors.items():
        expected = saved[_tf_name(case, var)]
        got = t.detach().T if var == KERNEL else t.detach()
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=var)
    for k in range(case["steps_before"] + 1, case["steps_before"] + case["steps_after"] + 1):
        run.step(k)
    _assert_close(run.finals(), _tf_finals(case), case["dtype"])


def _tf_name(case: dict[str, Any], var: str) -> str:
    return f"model/{var}{ATTRIBUTE}" if case["format"] == "object" else var


@pytest.mark.parametrize("case", _ids(NAME_BASED))
def test_loaded_slots_are_tensorflows(case: dict[str, Any]) -> None:
    """Every slot holds, bitwise, the variable TF named for it (``tf_slot_names``, from TF's graph)."""
    run = Run(case, init=False)
    run.load()
    saved = {k[len("saved/") :]: v for k, v in _arrays(case["id"]).items() if k.startswith("saved/")}
    for var, t in run.tensors.items():
        tf_slots = case["tf_slot_names"][var]
        assert sorted(tf_slots) == run.inner.get_slot_names()
        for slot, suffix in tf_slots.items():
            ours = run.inner.get_slot(t, slot)
            assert ours is not None, f"{var}: slot {slot!r} not made"
            ours = ours.T if var == KERNEL else ours
            np.testing.assert_array_equal(ours.numpy(), saved[f"{var}/{suffix}"], err_msg=f"{var} {slot}")
    for key, value in _optimizer_wide_state(run.inner)[0].items():
        np.testing.assert_array_equal(value.numpy(), saved[key], err_msg=key)
    if case["loss_scale"]:
        assert float(run.opt.loss_scale()) == saved["current_loss_scale"]
        assert int(run.opt.loss_scale.good_steps) == saved["good_steps"]


# ---------------------------------------------------------------------- writing checkpoints TF reads
def _train_and_save(case: dict[str, Any], folder: Path) -> Run:
    run = Run(case, init=True)
    for k in range(1, case["steps_before"] + 1):
        run.step(k)
    save_tf_checkpoint(
        folder / case["id"] / f"model.ckpt-{case['steps_before']}",
        run.var_map(),
        run.opt,
        global_step=case["steps_before"],
        optimizer_name=case["optimizer_name"],
    )
    return run


@pytest.mark.parametrize("case", _ids(NAME_BASED))
def test_saved_checkpoint_is_tensorflows(case: dict[str, Any], tmp_path: Path) -> None:
    """Torch's first K steps, saved: TF's names, shapes, dtypes, and TF's values at step K."""
    _train_and_save(case, tmp_path)
    ours_prefix = tmp_path / case["id"] / f"model.ckpt-{case['steps_before']}"
    assert list_tf_checkpoint(ours_prefix) == list_tf_checkpoint(FIXTURES / case["prefix"])
    assert list_tf_checkpoint(tmp_path / case["id"]) == list_tf_checkpoint(ours_prefix)
    from torchgrad_compat.checkpoint._bundle import BundleReader

    reader = BundleReader(ours_prefix)
    rtol, atol = TOLERANCE[case["dtype"]]
    for name, value in _arrays(case["id"]).items():
        if name.startswith("saved/"):
            name = name[len("saved/") :]
            np.testing.assert_allclose(reader.read(name).numpy(), value, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.tf_live
def test_tensorflow_restores_and_continues(tmp_path: Path, tf_python: str) -> None:
    """TF's Saver restores what torch saved after K steps; its M more steps equal torch's."""
    runs = {case["id"]: _train_and_save(case, tmp_path) for case in NAME_BASED}
    result = subprocess.run(
        [tf_python, str(GENERATOR), "--restore", str(tmp_path), "--fixtures", str(FIXTURES)],
        capture_output=True,
        text=True,
        timeout=scaled(600),
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for case in NAME_BASED:
        run = runs[case["id"]]
        for k in range(case["steps_before"] + 1, case["steps_before"] + case["steps_after"] + 1):
            run.step(k)
        with np.load(tmp_path / case["id"] / "continued.npz") as npz:
            theirs = {key: npz[key] for key in npz.files}
        _assert_close(run.finals(), theirs, case["dtype"])


@pytest.mark.tf_live
def test_generator_reproduces_the_fixtures(run_tf_generator) -> None:
    tmp_path = run_tf_generator(GENERATOR)
    fresh = json.loads((tmp_path / "manifest.json").read_text())

    def without_version(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in entry.items() if k != "tf_version"} for entry in entries]

    assert without_version(fresh) == without_version(MANIFEST)
    for case in MANIFEST:
        rtol, atol = TOLERANCE[case["dtype"]]
        with np.load(tmp_path / case["id"] / "arrays.npz") as npz:
            regenerated = {key: npz[key] for key in npz.files}
        committed = _arrays(case["id"])
        assert sorted(regenerated) == sorted(committed), case["id"]
        for key, value in committed.items():
            np.testing.assert_allclose(
                regenerated[key], value, rtol=rtol, atol=atol, err_msg=f"{case['id']}/{key}"
            )
        assert list_tf_checkpoint(tmp_path / case["prefix"]) == list_tf_checkpoint(FIXTURES / case["prefix"])
    many = Path("many_variables") / "model.ckpt"
    assert list_tf_checkpoint(tmp_path / many) == list_tf_checkpoint(FIXTURES / many)
    conv = Path("conv")
    assert list_tf_checkpoint(tmp_path / conv) == list_tf_checkpoint(FIXTURES / conv)
    with np.load(tmp_path / conv / "io.npz") as fresh, np.load(FIXTURES / conv / "io.npz") as old:
        np.testing.assert_array_equal(fresh["x"], old["x"])
        np.testing.assert_allclose(fresh["y"], old["y"], rtol=1e-5, atol=1e-5)
    partitioned = Path("partitioned")
    assert list_tf_checkpoint(tmp_path / partitioned) == list_tf_checkpoint(FIXTURES / partitioned)
    with (
        np.load(tmp_path / partitioned / "values.npz") as fresh,
        np.load(FIXTURES / partitioned / "values.npz") as old,
    ):
        assert sorted(fresh.files) == sorted(old.files)
        for key in old.files:
            np.testing.assert_allclose(fresh[key], old[key], rtol=1e-5, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------------- round trip, paths
@pytest.mark.parametrize("case", _ids(NAME_BASED))
def test_save_then_load_is_bitwise(case: dict[str, Any], tmp_path: Path) -> None:
    run = _train_and_save(case, tmp_path)
    other = Run(case, init=False)
    info = load_tf_checkpoint(
        tmp_path / case["id"], other.var_map(), other.opt, optimizer_name=case["optimizer_name"]
    )
    assert info.global_step == case["steps_before"] and info.unused == []
    ours, theirs = run.finals(), other.finals()
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        np.testing.assert_array_equal(theirs[key], ours[key], err_msg=key)
    if isinstance(run.inner, tgo.AdagradDAOptimizer):
        assert int(_optimizer_wide_state(other.inner)[0]["global_step"]) == case["steps_before"]


def _copy_case(case: dict[str, Any], tmp_path: Path) -> Path:
    folder = tmp_path / case["id"]
    shutil.copytree(FIXTURES / case["id"], folder)
    return folder / Path(case["prefix"]).name


ADAM = next(c for c in NAME_BASED if c["id"] == "name-Adam-default-float32")


def test_path_forms(tmp_path: Path) -> None:
    prefix = _copy_case(ADAM, tmp_path)
    expected = list_tf_checkpoint(prefix)
    assert list_tf_checkpoint(prefix.parent) == expected
    assert list_tf_checkpoint(str(prefix) + ".index") == expected
    with pytest.raises(FileNotFoundError, match="no TensorFlow checkpoint at path"):
        list_tf_checkpoint(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="without a 'checkpoint' state file"):
        list_tf_checkpoint(tmp_path)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        list_tf_checkpoint(3)


def _snapshot(run: Run) -> list[torch.Tensor]:
    return (
        [t.detach().clone() for t in run.tensors.values()]
        + [s.clone() for t in run.tensors.values() for s in (run.inner.state.get(t) or {}).values()]
        + [v.clone() for v in _optimizer_wide_state(run.inner)[0].values()]
    )


def _unchanged(run: Run, before: list[torch.Tensor]) -> None:
    after = _snapshot(run)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert torch.equal(a, b)


def _stepped_run() -> Run:
    """A run whose optimizer already has slots (so a failed load could have half-written them)."""
    run = Run(ADAM, init=True)
    run.step(1)
    return run


@pytest.mark.parametrize("where", ["data", "index"])
def test_corrupt_bytes_raise_and_change_nothing(where: str, tmp_path: Path) -> None:
    prefix = _copy_case(ADAM, tmp_path)
    path = Path(f"{prefix}.data-00000-of-00001") if where == "data" else Path(f"{prefix}.index")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    run = _stepped_run()
    before = _snapshot(run)
    with pytest.raises(CorruptCheckpointError, match="CRC32C mismatch"):
        load_tf_checkpoint(prefix, run.var_map(), run.opt)
    _unchanged(run, before)


def _saved_with(tmp_path: Path, make: Any, corrupt: Any) -> tuple[Path, Any]:
    """A checkpoint of one step of ``make([w])`` whose state ``corrupt(opt)`` spoiled in place."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = make([w])
    w.grad = torch.ones(3)
    opt.step() if not isinstance(opt, LossScaleOptimizer) else opt.apply_gradients([(torch.ones(3), w)])
    corrupt(opt)
    prefix = tmp_path / "spoiled" / "model.ckpt"
    save_tf_checkpoint(prefix, {"w": w}, opt)
    return prefix, make


def _adam(ps: list[torch.Tensor]) -> tgo.Optimizer:
    return tgo.AdamOptimizer(ps, learning_rate=0.1)


def _adagrad_da(ps: list[torch.Tensor]) -> tgo.Optimizer:
    return tgo.AdagradDAOptimizer(ps, learning_rate=0.1)


def _lso(ps: list[torch.Tensor]) -> LossScaleOptimizer:
    return LossScaleOptimizer(tgo.AdamOptimizer(ps, learning_rate=0.1), DynamicLossScale(8.0, 2))


@pytest.mark.parametrize(
    ("make", "corrupt", "match"),
    [
        (
            _adam,
            lambda o: o.param_groups[0]["beta1_power"].fill_(float("nan")),
            r"beta1_power.*expected finite",
        ),
        (_adam, lambda o: o.param_groups[0]["beta1_power"].fill_(1.0), r"beta1_power value: 1.0; expected"),
        (_adam, lambda o: o.param_groups[0]["beta2_power"].fill_(-0.5), r"beta2_power value: -0.5; expected"),
        (
            _adagrad_da,
            lambda o: o.param_groups[0]["global_step"].fill_(-3),
            r"global_step value: -3.0; expected",
        ),
        (_lso, lambda o: o.loss_scale.variables()[0].fill_(0.0), r"current_loss_scale value: 0.0; expected"),
        (_lso, lambda o: o.loss_scale.variables()[1].fill_(-1), r"good_steps value: -1; expected"),
    ],
    ids=[
        "beta1_power-nan",
        "beta1_power-1",
        "beta2_power-negative",
        "global_step-negative",
        "scale-0",
        "steps-negative",
    ],
)
def test_optimizer_state_out_of_range_raises_and_changes_nothing(
    tmp_path: Path, make, corrupt, match
) -> None:
    """A checkpoint's beta powers, step or loss scale get the checks load_state_dict gives them."""
    prefix, make = _saved_with(tmp_path, make, corrupt)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = make([w])
    before = [t.clone() for t in [w.detach(), *opt.variables()]]
    with pytest.raises(CheckpointMismatchError, match=match):
        load_tf_checkpoint(prefix, {"w": w}, opt)
    after = [t.clone() for t in [w.detach(), *opt.variables()]]
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def test_truncated_index_raises(tmp_path: Path) -> None:
    prefix = _copy_case(ADAM, tmp_path)
    index = Path(f"{prefix}.index")
    index.write_bytes(index.read_bytes()[:-3])
    with pytest.raises(CorruptCheckpointError, match="not a TensorFlow checkpoint index"):
        list_tf_checkpoint(prefix)


def test_missing_name_raises_and_changes_nothing() -> None:
    run = _stepped_run()
    before = _snapshot(run)
    var_map = {**run.var_map(), "dense/other": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"not in the checkpoint: dense/other \(it holds"):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], var_map, run.opt)
    _unchanged(run, before)


def test_wrong_optimizer_name_lists_missing_slots() -> None:
    run = _stepped_run()
    before = _snapshot(run)
    with pytest.raises(ValueError, match="dense/bias/Other, dense/bias/Other_1"):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], run.var_map(), run.opt, optimizer_name="Other")
    _unchanged(run, before)


def test_shape_mismatch_after_layout_raises_and_changes_nothing() -> None:
    run = _stepped_run()
    before = _snapshot(run)
    var_map = run.var_map()
    var_map[KERNEL] = run.tensors[KERNEL]  # the transpose forgotten
    with pytest.raises(ValueError, match=r"dense/kernel: checkpoint shape \[3, 4\], tensor shape \[4, 3\]"):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], var_map, run.opt)
    _unchanged(run, before)


def test_dtype_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="dense/bias: checkpoint dtype float32, tensor dtype torch.float64"):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], {"dense/bias": torch.zeros(4, dtype=torch.float64)})


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ((torch.zeros(3, 4), "flip"), ValueError, "layout must be 'transpose' or a dim permutation"),
        ((torch.zeros(3, 4), (0, 0)), ValueError, "is not a permutation of the tensor's 2 dims"),
        ((torch.zeros(3, 4), ("a", 0)), ValueError, "is not a permutation of the tensor's 2 dims"),
        ((torch.zeros(3, 4, 1), "transpose"), ValueError, "'transpose' needs a 2-D tensor, got 3-D"),
        (np.zeros((3, 4)), TypeError, r"var_map\['dense/kernel'\] must be a torch.Tensor, got ndarray"),
        ((torch.zeros(3, 4), "transpose", 1), TypeError, "must be a tensor or \\(tensor, layout\\)"),
    ],
)
def test_bad_var_map_values(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], {KERNEL: value})


def test_bad_arguments() -> None:
    prefix = FIXTURES / ADAM["prefix"]
    with pytest.raises(TypeError, match="var_map must be a mapping"):
        load_tf_checkpoint(prefix, [torch.zeros(3)])
    w = torch.zeros(4)
    with pytest.raises(ValueError, match="var_map gives the same tensor for 'a' and 'b'"):
        load_tf_checkpoint(prefix, {"a": w, "b": w})
    with pytest.raises(TypeError, match="optimizer must be one of torchgrad_compat.optim's optimizers"):
        load_tf_checkpoint(prefix, {"dense/bias": w}, torch.optim.SGD([w], lr=0.1))
    with pytest.raises(ValueError, match="is a directory"):
        save_tf_checkpoint(FIXTURES, {"dense/bias": w})
    with pytest.raises(TypeError, match="global_step must be an int"):
        save_tf_checkpoint(FIXTURES / "x" / "y", {"dense/bias": w}, global_step=1.5)


def test_variables_without_optimizer_leave_slots_unused() -> None:
    bias = torch.zeros(4)
    info = load_tf_checkpoint(FIXTURES / ADAM["prefix"], {"dense/bias": bias})
    np.testing.assert_array_equal(bias.numpy(), _arrays(ADAM["id"])["saved/dense/bias"])
    assert info.loaded == ["dense/bias", "global_step"]
    assert "dense/bias/Adam" in info.unused and "beta1_power" in info.unused


def test_adagrad_da_global_step_tensor_is_loaded_and_saved(tmp_path: Path) -> None:
    """An AdagradDA given TF's global step as a tensor reads it: the load sets it, the save writes it."""
    case = next(c for c in NAME_BASED if c["id"] == "name-AdagradDA-default-float32")
    run = Run(case, init=False)
    global_step = torch.tensor(0)
    run.inner = run.opt = tgo.AdagradDAOptimizer(
        list(run.tensors.values()), global_step=global_step, **case["kwargs"]
    )
    run.load()
    assert int(global_step) == case["steps_before"]
    for k in range(case["steps_before"] + 1, case["steps_before"] + case["steps_after"] + 1):
        run.opt.apply_gradients(_pairs(run, k), global_step=global_step)
    _assert_close(run.finals(), _tf_finals(case), case["dtype"])
    with pytest.raises(ValueError, match="global_step=2 disagrees with AdagradDAOptimizer's step 6"):
        save_tf_checkpoint(tmp_path / "model.ckpt", run.var_map(), run.opt, global_step=2)
    save_tf_checkpoint(tmp_path / "model.ckpt", run.var_map(), run.opt)
    assert ("global_step", (), "int64") in list_tf_checkpoint(tmp_path)


def test_multiple_param_groups_share_optimizer_wide_state() -> None:
    run = Run(ADAM, init=False)
    tensors = list(run.tensors.values())
    run.inner = run.opt = tgo.AdamOptimizer(
        [{"params": tensors[:1]}, {"params": tensors[1:]}], **ADAM["kwargs"]
    )
    run.load()
    saved = _arrays(ADAM["id"])
    for group_state in _optimizer_wide_state(run.inner):
        np.testing.assert_array_equal(group_state["beta1_power"].numpy(), saved["saved/beta1_power"])


def test_cross_shard_optimizer_is_seen_through() -> None:
    """A CrossShardOptimizer adds no state of its own: the slots are its inner optimizer's."""
    from torchgrad_compat.xla import CrossShardOptimizer

    run = Run(ADAM, init=False)
    with pytest.warns(UserWarning, match="no torch.distributed process group"):
        run.opt = CrossShardOptimizer(run.inner)
    run.load()
    for k in range(ADAM["steps_before"] + 1, ADAM["steps_before"] + ADAM["steps_after"] + 1):
        run.step(k)
    _assert_close(run.finals(), _tf_finals(ADAM), ADAM["dtype"])


def test_load_is_a_write_autograd_sees() -> None:
    bias = torch.nn.Parameter(torch.zeros(4))
    version = bias._version
    load_tf_checkpoint(FIXTURES / ADAM["prefix"], {"dense/bias": bias})
    assert bias._version > version


def test_save_refuses_what_tf_cannot_hold(tmp_path: Path) -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = tgo.AdamOptimizer([{"params": [a]}, {"params": [b], "beta1": 0.5}])
    with pytest.raises(ValueError, match="the param groups hold different beta1_power"):
        save_tf_checkpoint(tmp_path / "model.ckpt", {"a": a, "b": b}, opt)
    opt = tgo.AdamOptimizer([a, b])
    with pytest.raises(ValueError, match="two tensors would be saved as 'a/Adam'"):
        save_tf_checkpoint(tmp_path / "model.ckpt", {"a": a, "a/Adam": b}, opt)
    assert not list(tmp_path.iterdir())


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(3, 4)
        self.embedding = torch.nn.Embedding(6, 3)
        self.head = torch.nn.Linear(4, 2)  # not in the checkpoint
        self.norm = torch.nn.BatchNorm1d(4)  # its buffers, not in the checkpoint


@pytest.mark.parametrize("case", _ids([c for c in MANIFEST if c["id"].endswith("-Adam-default-float32")]))
def test_suggest_var_map_matches_by_name_and_shape(case: dict[str, Any]) -> None:
    from torchgrad_compat.checkpoint import suggest_var_map

    model = _Model()
    prefix = "model/" if case["format"] == "object" else ""
    suggested = suggest_var_map(FIXTURES / case["prefix"], model)
    assert suggested == {
        f"{prefix}dense/bias": model.dense.bias,
        f"{prefix}dense/kernel": (model.dense.weight, "transpose"),
        f"{prefix}embedding/embeddings": model.embedding.weight,
    }
    info = load_tf_checkpoint(FIXTURES / case["prefix"], suggested, tgo.AdamOptimizer(model.parameters()))
    assert info.unused == (["save_counter" + ATTRIBUTE] if case["format"] == "object" else [])


def test_suggest_var_map_refuses_ambiguity_listing_the_candidates() -> None:
    from torchgrad_compat.checkpoint import AmbiguousVarMapError, suggest_var_map

    model = torch.nn.Module()
    model.dense = torch.nn.Linear(4, 4)  # the checkpoint's kernel is [3, 4]: no layout fits
    model.outer = torch.nn.Module()
    model.outer.embedding = torch.nn.Embedding(6, 3)
    model.other = torch.nn.Module()
    model.other.embedding = torch.nn.Embedding(6, 3)  # two equally good matches
    with pytest.raises(AmbiguousVarMapError, match="give these pairs in var_map yourself") as caught:
        suggest_var_map(FIXTURES / ADAM["prefix"], model)
    assert caught.value.candidates == {
        "embedding/embeddings": ["outer.embedding.weight", "other.embedding.weight"]
    }
    assert "embedding/embeddings [6, 3]: outer.embedding.weight, other.embedding.weight" in str(caught.value)
    del model.other
    suggested = suggest_var_map(FIXTURES / ADAM["prefix"], model)
    assert suggested == {"dense/bias": model.dense.bias, "embedding/embeddings": model.outer.embedding.weight}
    assert suggested.unmatched_checkpoint == [("dense/kernel", (3, 4))]
    assert suggested.unmatched_module == [("dense.weight", (4, 4))]


def _keras_named_checkpoint(folder: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """A checkpoint with Keras's default layer names (dense, dense_1, ...), written from torch."""
    save_tf_checkpoint(folder / "model.ckpt", {name: torch.zeros(shape) for name, shape in shapes.items()})
    return folder


def test_suggest_var_map_by_shape_then_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dense/dense_1 vs hidden/output: shapes decide; two identical 8x8 layers: TF's numbering
    (dense_2 before dense_10) against the module's order decides, and the report says how."""
    from torchgrad_compat.checkpoint import suggest_var_map

    folder = _keras_named_checkpoint(
        tmp_path,
        {
            "embedding/embeddings": (10, 3),
            "dense/kernel": (3, 8),
            "dense/bias": (8,),
            "dense_2/kernel": (8, 8),
            "dense_2/bias": (8,),
            "dense_10/kernel": (8, 8),
            "dense_10/bias": (8,),
            "dense_11/kernel": (8, 2),
            "dense_11/bias": (2,),
            "global_step": (),
        },
    )
    model = torch.nn.Module()
    model.embedding = torch.nn.Embedding(10, 3)
    model.hidden = torch.nn.Linear(3, 8)
    model.block_a = torch.nn.Linear(8, 8)
    model.block_b = torch.nn.Linear(8, 8)
    model.output = torch.nn.Linear(8, 2)
    suggested = suggest_var_map(folder, model, verbose=True)
    assert suggested == {
        "embedding/embeddings": model.embedding.weight,
        "dense/kernel": (model.hidden.weight, "transpose"),
        "dense/bias": model.hidden.bias,
        "dense_2/kernel": (model.block_a.weight, "transpose"),  # square, and still transposed
        "dense_2/bias": model.block_a.bias,
        "dense_10/kernel": (model.block_b.weight, "transpose"),
        "dense_10/bias": model.block_b.bias,
        "dense_11/kernel": (model.output.weight, "transpose"),
        "dense_11/bias": model.output.bias,
    }
    how = {m.tf_name: m.how for m in suggested.matches}
    assert how["embedding/embeddings"] == "name"
    assert how["dense/kernel"] == how["dense_11/bias"] == "shape"
    assert how["dense_2/kernel"] == how["dense_10/bias"] == "order"
    printed = capsys.readouterr().out
    assert "dense_10/kernel [8, 8] -> block_b.weight [8, 8] (by order, layout 'transpose')" in printed
    assert "checkpoint variables left out: 0" in printed and "module tensors left out: 0" in printed
    # Three identical TF layers for two modules: order cannot decide, so it is refused.
    from torchgrad_compat.checkpoint import AmbiguousVarMapError

    folder2 = _keras_named_checkpoint(
        tmp_path / "b", {"dense_1/kernel": (8, 8), "dense_2/kernel": (8, 8), "dense_3/kernel": (8, 8)}
    )
    with pytest.raises(AmbiguousVarMapError) as caught:
        suggest_var_map(folder2, model)
    assert caught.value.candidates["dense_1/kernel"] == ["block_a.weight", "block_b.weight"]


def test_suggest_var_map_two_variables_one_tensor_is_ambiguous(tmp_path: Path) -> None:
    from torchgrad_compat.checkpoint import AmbiguousVarMapError, suggest_var_map

    folder = _keras_named_checkpoint(tmp_path, {"a/dense/bias": (4,), "b/dense/bias": (4,)})
    model = torch.nn.Module()
    model.dense = torch.nn.Linear(3, 4)
    with pytest.raises(AmbiguousVarMapError) as caught:
        suggest_var_map(folder, model)
    assert sorted(caught.value.candidates) == ["a/dense/bias", "b/dense/bias"]
    assert "dense.bias (also the best match of b/dense/bias)" in caught.value.candidates["a/dense/bias"]


def test_index_of_many_blocks_with_shared_key_prefixes() -> None:
    """TF's index of 600 variables spans many table blocks with prefix-compressed keys."""
    from torchgrad_compat.checkpoint._bundle import BundleReader

    prefix = FIXTURES / "many_variables" / "model.ckpt"
    expected = {
        f"block_{i // 10}/layer_with_a_long_name_{i % 10}/kernel": (i, (i % 7 + 1, 3)) for i in range(600)
    }
    assert list_tf_checkpoint(prefix) == [(name, expected[name][1], "float32") for name in sorted(expected)]
    reader = BundleReader(prefix)
    for name, (value, shape) in expected.items():
        assert torch.equal(reader.read(name), torch.full(shape, float(value))), name


def test_many_variables_round_trip(tmp_path: Path) -> None:
    tensors = [torch.randn(i % 7 + 1, 3, dtype=torch.float64) for i in range(600)]
    var_map = {f"block_{i // 10}/layer_{i % 10}/kernel": t for i, t in enumerate(tensors)}
    save_tf_checkpoint(tmp_path / "model.ckpt", var_map)
    loaded = {name: torch.zeros_like(t) for name, t in var_map.items()}
    info = load_tf_checkpoint(tmp_path, loaded)
    assert info.unused == [] and info.global_step is None
    for name, t in var_map.items():
        assert torch.equal(loaded[name], t), name


def test_save_before_the_first_step_writes_initial_slots(tmp_path: Path) -> None:
    """TF creates slots with the graph; a saved optimizer that has not stepped holds their initial values."""
    w = torch.nn.Parameter(torch.ones(2, 3))
    opt = tgo.AdagradOptimizer([w], learning_rate=0.1, initial_accumulator_value=0.25)
    save_tf_checkpoint(tmp_path / "model.ckpt", {"w": (w, "transpose")}, opt, global_step=0)
    assert list_tf_checkpoint(tmp_path) == [
        ("global_step", (), "int64"),
        ("w", (3, 2), "float32"),
        ("w/Adagrad", (3, 2), "float32"),
    ]
    assert not opt.state  # saving made no state
    w2 = torch.nn.Parameter(torch.zeros(2, 3))
    fresh = tgo.AdagradOptimizer([w2], learning_rate=0.1)
    load_tf_checkpoint(tmp_path, {"w": (w2, "transpose")}, fresh)
    assert torch.equal(w2.detach(), w.detach())
    assert torch.equal(fresh.get_slot(w2, "accumulator"), torch.full((2, 3), 0.25))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_load_and_save(tmp_path: Path) -> None:
    run = Run(ADAM, init=False)
    model = {name: torch.nn.Parameter(t.detach().to("cuda")) for name, t in run.tensors.items()}
    opt = tgo.AdamOptimizer(list(model.values()), **ADAM["kwargs"])
    var_map = {name: (t, "transpose") if name == KERNEL else t for name, t in model.items()}
    load_tf_checkpoint(FIXTURES / ADAM["prefix"], var_map, opt)
    saved = _arrays(ADAM["id"])
    np.testing.assert_array_equal(model["dense/bias"].detach().cpu().numpy(), saved["saved/dense/bias"])
    assert opt.get_slot(model[KERNEL], "m").device.type == "cuda"
    save_tf_checkpoint(tmp_path / "model.ckpt-3", var_map, opt, global_step=3)
    assert list_tf_checkpoint(tmp_path) == list_tf_checkpoint(FIXTURES / ADAM["prefix"])


def test_unwritable_dtype_leaves_no_files(tmp_path: Path) -> None:
    var_map = {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    with pytest.raises(TypeError, match="cannot write tensor 'b' of dtype torch.float8_e4m3fn"):
        save_tf_checkpoint(tmp_path / "model.ckpt", var_map)
    assert not list(tmp_path.iterdir())


def test_state_file_names_the_latest_checkpoint(tmp_path: Path) -> None:
    first, second = torch.ones(2), torch.full((2,), 2.0)
    save_tf_checkpoint(tmp_path / "model.ckpt-1", {"w": first})
    save_tf_checkpoint(tmp_path / 'modèle "b".ckpt-2', {"w": second})
    w = torch.zeros(2)
    load_tf_checkpoint(tmp_path, {"w": w})
    assert torch.equal(w, second)
    assert (tmp_path / "checkpoint").read_text("utf-8") == (
        'model_checkpoint_path: "modèle \\"b\\".ckpt-2"\n'
        'all_model_checkpoint_paths: "model.ckpt-1"\n'
        'all_model_checkpoint_paths: "modèle \\"b\\".ckpt-2"\n'
    )
    # Text format may also C-escape the UTF-8 bytes, as octal.
    octal = "".join(f"\\{byte:03o}" for byte in "è".encode())
    (tmp_path / "checkpoint").write_text(f'model_checkpoint_path: "mod{octal}le \\"b\\".ckpt-2"\n')
    assert list_tf_checkpoint(tmp_path) == [("w", (2,), "float32")]


PARTITIONED = FIXTURES / "partitioned" / "model.ckpt"


def test_partitioned_variables_are_assembled() -> None:
    """TF stores a partitioned variable (and its slots) in pieces under binary keys; they read as one."""
    with np.load(FIXTURES / "partitioned" / "values.npz") as npz:
        saved = {key[len("saved/") :]: npz[key] for key in npz.files}
    assert list_tf_checkpoint(PARTITIONED) == [
        (name, saved[name].shape, saved[name].dtype.name) for name in sorted(saved)
    ]
    np.testing.assert_array_equal(saved["counts"].ravel(), np.arange(20000, dtype=np.float32))
    emb = torch.nn.Parameter(torch.zeros(200, 3))
    counts = torch.zeros(20000, 1)
    opt = tgo.AdamOptimizer([emb])
    info = load_tf_checkpoint(PARTITIONED, {"emb": emb, "counts": counts}, opt)
    assert info.unused == []
    np.testing.assert_array_equal(emb.detach().numpy(), saved["emb"])
    np.testing.assert_array_equal(counts.numpy(), saved["counts"])
    np.testing.assert_array_equal(opt.get_slot(emb, "m").numpy(), saved["emb/Adam"])
    np.testing.assert_array_equal(opt.get_slot(emb, "v").numpy(), saved["emb/Adam_1"])


def test_a_corrupt_piece_raises(tmp_path: Path) -> None:
    folder = tmp_path / "partitioned"
    shutil.copytree(FIXTURES / "partitioned", folder)
    from torchgrad_compat.checkpoint._bundle import BundleReader

    piece = BundleReader(folder / "model.ckpt")._pieces["counts", ((10000, 10000), (0, 1))]
    data = folder / "model.ckpt.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[piece.offset + 5] ^= 0x10
    data.write_bytes(bytes(raw))
    counts = torch.zeros(20000, 1)
    emb = torch.zeros(200, 3)
    with pytest.raises(CorruptCheckpointError, match="CRC32C mismatch in tensor"):
        load_tf_checkpoint(folder / "model.ckpt", {"emb": emb, "counts": counts})
    assert not counts.any() and not emb.any()


def test_pieces_that_overlap_are_refused() -> None:
    """Pieces counted by their elements alone passed one piece listed twice for one left out: the
    rows of the missing piece kept torch.empty's memory. In bounds, disjoint and complete."""
    import dataclasses

    from torchgrad_compat.checkpoint._bundle import BundleReader

    with BundleReader(str(PARTITIONED)) as reader:
        entry = reader.entries["counts"]
        first = entry.slices[0]
        reader.entries["counts"] = dataclasses.replace(entry, slices=(first, first))
        with pytest.raises(CorruptCheckpointError, match="overlap"):
            reader.verify("counts")
        outside = ((15000, 10000), (0, 1))
        reader._pieces["counts", outside] = reader._pieces["counts", entry.slices[1]]
        reader.entries["counts"] = dataclasses.replace(entry, slices=(first, outside))
        with pytest.raises(CorruptCheckpointError, match="outside its shape"):
            reader.verify("counts")


def _write_adam_checkpoint(path: Path, **extra: torch.Tensor) -> None:
    write_bundle(
        str(path),
        {
            "w": torch.full((3,), 7.0),
            "w/Adam": torch.full((3,), 0.5),
            "w/Adam_1": torch.full((3,), 0.25),
            "beta1_power": torch.tensor(0.729),
            "beta2_power": torch.tensor(0.997),
            **extra,
        },
    )


def test_beta_powers_of_two_adams_in_one_graph_are_chosen_not_guessed(tmp_path: Path) -> None:
    """TF1 names the beta powers of a graph's second Adam beta1_power_1, whatever its name=: the
    bare names may be another optimizer's (a GAN's generator's, read by its discriminator), so
    a checkpoint holding both is refused until non_slot_suffix says which."""
    prefix = tmp_path / "model.ckpt"
    _write_adam_checkpoint(prefix, beta1_power_1=torch.tensor(0.125), beta2_power_1=torch.tensor(0.729))
    w = torch.nn.Parameter(torch.zeros(3))
    opt = tgo.AdamOptimizer([w], 0.1)
    with pytest.raises(CheckpointMismatchError, match=r"beta1_power: ambiguous.*\['beta1_power_1'\]"):
        load_tf_checkpoint(prefix, {"w": w}, opt)
    assert not w.detach().any() and not opt.state
    for suffix, powers in (("_1", (0.125, 0.729)), ("", (0.729, 0.997))):
        load_tf_checkpoint(prefix, {"w": w}, opt, non_slot_suffix=suffix)
        group = opt.param_groups[0]
        assert (float(group["beta1_power"]), float(group["beta2_power"])) == pytest.approx(powers)
    with pytest.raises(ValueError, match="non_slot_suffix must be"):
        load_tf_checkpoint(prefix, {"w": w}, opt, non_slot_suffix="1")


def test_loss_scales_of_two_optimizers_in_one_graph_are_chosen_not_guessed(tmp_path: Path) -> None:
    """TF1 names a graph's second loss-scale optimizer's state current_loss_scale_1 and
    good_steps_1 (float32 and int64, as TF 2.21 writes them): the bare names may be the other
    optimizer's, so a checkpoint holding both is refused until loss_scale_suffix says which."""
    prefix = tmp_path / "model.ckpt"
    write_bundle(
        str(prefix),
        {
            "w": torch.full((3,), 7.0),
            "current_loss_scale": torch.tensor(4.0),
            "good_steps": torch.tensor(1, dtype=torch.int64),
            "current_loss_scale_1": torch.tensor(1024.0),
            "good_steps_1": torch.tensor(2, dtype=torch.int64),
        },
    )
    w = torch.nn.Parameter(torch.zeros(3))
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w], 0.1), DynamicLossScale(8.0, 10))
    ambiguous = r"current_loss_scale: ambiguous.*\['current_loss_scale_1'\]"
    with pytest.raises(CheckpointMismatchError, match=ambiguous):
        load_tf_checkpoint(prefix, {"w": w}, opt)
    assert not w.detach().any() and float(opt.loss_scale()) == 8.0
    for suffix, (scale, good_steps) in (("_1", (1024.0, 2)), ("", (4.0, 1))):
        load_tf_checkpoint(prefix, {"w": w}, opt, loss_scale_suffix=suffix)
        assert (float(opt.loss_scale()), int(opt.loss_scale.good_steps)) == (scale, good_steps)
    with pytest.raises(ValueError, match="loss_scale_suffix must be"):
        load_tf_checkpoint(prefix, {"w": w}, opt, loss_scale_suffix="1")


def test_a_loaded_scale_below_one_has_its_unscaled_gradients_checked(tmp_path: Path) -> None:
    """TF accepts a dynamic scale below 1 (initial_loss_scale=0.5, saved before it grew). A gradient
    finite when scaled and inf once unscaled skips the step and backs the scale off to TF's floor
    of 1, as TF does, and as after load_state_dict."""
    prefix = tmp_path / "model.ckpt"
    write_bundle(
        str(prefix),
        {
            "w": torch.tensor([0.6]),
            "current_loss_scale": torch.tensor(0.5),
            "good_steps": torch.tensor(1, dtype=torch.int64),
        },
    )
    w = torch.nn.Parameter(torch.zeros(1))
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w], 0.1), "dynamic")
    load_tf_checkpoint(prefix, {"w": w}, opt)
    opt.get_scaled_loss((4.0 * w * 1e38).sum()).backward()  # grad 2e38 scaled, 4e38 (inf) unscaled
    opt.step()
    assert w.item() == pytest.approx(0.6) and float(opt.loss_scale()) == 1.0


@pytest.mark.parametrize(
    ("step", "words"),
    [
        (torch.tensor([4, 5]), r"global_step: checkpoint shape \[2\], a global step is a scalar"),
        (torch.tensor(-3), r"global_step: value -3, a global step is >= 0"),
    ],
)
def test_a_global_step_that_is_no_step_raises_before_anything_is_written(
    step: torch.Tensor, words: str, tmp_path: Path
) -> None:
    prefix = tmp_path / "model.ckpt"
    _write_adam_checkpoint(prefix, global_step=step)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = tgo.AdamOptimizer([w], 0.1)
    with pytest.raises(CheckpointMismatchError, match=words):
        load_tf_checkpoint(prefix, {"w": w}, opt)
    assert not w.detach().any() and not opt.state


def test_a_global_step_past_an_int32_tensor_raises_instead_of_wrapping(tmp_path: Path) -> None:
    """TF's int64 step copied into AdagradDA's int32 global_step would wrap negative (T < 0)."""
    prefix = tmp_path / "model.ckpt"
    v = torch.nn.Parameter(torch.zeros(2))
    step = torch.tensor(0, dtype=torch.int32)
    bundle = {"v": torch.ones(2), "v/AdagradDA": torch.ones(2), "v/AdagradDA_1": torch.ones(2)}
    write_bundle(str(prefix), {**bundle, "global_step": torch.tensor(2**31 + 5, dtype=torch.int64)})
    opt = tgo.AdagradDAOptimizer([v], 0.1, global_step=step)
    with pytest.raises(
        CheckpointMismatchError, match="value 2147483653 does not fit the tensor's dtype torch.int32"
    ):
        load_tf_checkpoint(prefix, {"v": v}, opt)
    assert int(step) == 0 and not v.detach().any()


def test_conv_and_dense_layouts_give_tensorflows_output() -> None:
    """A Conv2D kernel (TF's HWIO -> torch's OIHW) and a Dense kernel, found by suggest_var_map,
    loaded into torch layers: the model's output on TF's input is TF's output."""
    from torchgrad_compat.checkpoint import suggest_var_map

    model = torch.nn.Module()
    model.conv = torch.nn.Conv2d(3, 4, 3)
    model.dense = torch.nn.Linear(64, 5)
    var_map = suggest_var_map(FIXTURES / "conv", model)
    assert {name: value[1] for name, value in var_map.items() if isinstance(value, tuple)} == {
        "conv/kernel": (3, 2, 0, 1),
        "dense/kernel": "transpose",
    }
    opt = tgo.MomentumOptimizer(model.parameters(), learning_rate=0.01, momentum=0.9)
    assert load_tf_checkpoint(FIXTURES / "conv", var_map, opt).unused == []
    with np.load(FIXTURES / "conv" / "io.npz") as npz:
        x, y = torch.tensor(npz["x"]), npz["y"]
    with torch.no_grad():
        hidden = model.conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).reshape(2, -1)  # TF flattens NHWC
        ours = model.dense(hidden).numpy()
    np.testing.assert_allclose(ours, y, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- bad input, strict and partial loads
def test_slots_of_another_optimizer_raise_and_change_nothing() -> None:
    """Momentum reading an Adam run: the named error lists every slot it lacks; nothing is loaded."""
    from torchgrad_compat.checkpoint import CheckpointMismatchError

    run = Run(ADAM, init=True)
    run.inner = run.opt = tgo.MomentumOptimizer(list(run.tensors.values()), learning_rate=0.1, momentum=0.9)
    run.step(1)
    before = _snapshot(run)
    with pytest.raises(CheckpointMismatchError, match="nothing was loaded") as caught:
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], run.var_map(), run.opt)
    assert sorted(caught.value.problems) == sorted(f"{v}/Momentum" for v in run.tensors)
    assert set(caught.value.problems.values()) == {"not in the checkpoint"}
    _unchanged(run, before)


def test_extra_slots_from_another_optimizer_are_refused() -> None:
    """Momentum told the slots are named "Adam" would read Adam's m as its momentum: Adam_1 betrays it."""
    from torchgrad_compat.checkpoint import CheckpointMismatchError

    run = Run(ADAM, init=False)
    run.inner = run.opt = tgo.MomentumOptimizer(list(run.tensors.values()), learning_rate=0.1, momentum=0.9)
    with pytest.raises(CheckpointMismatchError) as caught:
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], run.var_map(), run.opt, optimizer_name="Adam")
    assert sorted(caught.value.problems) == sorted(f"{v}/Adam_1" for v in run.tensors)
    assert "MomentumOptimizer does not have" in str(caught.value)
    assert not run.inner.state and not run.tensors["dense/bias"].any()


def test_centered_rmsprop_checkpoint_into_plain_rmsprop_is_refused() -> None:
    from torchgrad_compat.checkpoint import CheckpointMismatchError

    case = next(c for c in NAME_BASED if c["id"] == "name-RMSProp-centered-float32")
    run = Run(case, init=False)
    run.inner = run.opt = tgo.RMSPropOptimizer(list(run.tensors.values()), learning_rate=0.1, momentum=0.9)
    with pytest.raises(CheckpointMismatchError, match="RMSPropOptimizer does not have") as caught:
        run.load()
    assert sorted(caught.value.problems) == sorted(f"{v}/RMSProp_2" for v in run.tensors)


def test_partial_load_of_another_optimizers_run() -> None:
    """strict=False: the weights load, Momentum's slots (absent) are skipped and say why."""
    run = Run(ADAM, init=False)
    run.inner = run.opt = tgo.MomentumOptimizer(list(run.tensors.values()), learning_rate=0.1, momentum=0.9)
    info = load_tf_checkpoint(FIXTURES / ADAM["prefix"], run.var_map(), run.opt, strict=False)
    assert info.loaded == sorted([*run.tensors, "global_step"])
    assert info.skipped == {f"{v}/Momentum": "not in the checkpoint" for v in run.tensors}
    assert sorted(info.unused) == sorted(
        [
            *(f"{v}/Adam" for v in run.tensors),
            *(f"{v}/Adam_1" for v in run.tensors),
            "beta1_power",
            "beta2_power",
        ]
    )
    saved = _arrays(ADAM["id"])
    np.testing.assert_array_equal(run.tensors["dense/bias"].detach().numpy(), saved["saved/dense/bias"])
    assert not run.inner.state  # no slot loaded: the first step makes them, as in TF


def _truncate_data(prefix: Path, keep: int) -> None:
    data = Path(f"{prefix}.data-00000-of-00001")
    data.write_bytes(data.read_bytes()[:keep])


def test_truncated_data_shard_raises_listing_the_tensors_and_changes_nothing(tmp_path: Path) -> None:
    prefix = _copy_case(ADAM, tmp_path)
    from torchgrad_compat.checkpoint._bundle import BundleReader

    entries = BundleReader(prefix).entries
    cut = entries["dense/kernel/Adam"].offset + 1  # this tensor and every one after it are cut
    past = sorted(n for n, e in entries.items() if e.offset + e.size > cut)
    _truncate_data(prefix, cut)
    run = _stepped_run()
    before = _snapshot(run)
    with pytest.raises(
        CorruptCheckpointError, match="truncated; tensor 'dense/kernel/Adam' runs past"
    ) as caught:
        load_tf_checkpoint(prefix, run.var_map(), run.opt)
    assert sorted(caught.value.problems) == past
    _unchanged(run, before)


def test_bad_crc_lists_the_tensor(tmp_path: Path) -> None:
    prefix = _copy_case(ADAM, tmp_path)
    from torchgrad_compat.checkpoint._bundle import BundleReader

    entry = BundleReader(prefix).entries["dense/bias/Adam_1"]
    data = Path(f"{prefix}.data-00000-of-00001")
    raw = bytearray(data.read_bytes())
    raw[entry.offset] ^= 0x40
    data.write_bytes(bytes(raw))
    run = _stepped_run()
    before = _snapshot(run)
    with pytest.raises(CorruptCheckpointError) as caught:
        load_tf_checkpoint(prefix, run.var_map(), run.opt)
    assert list(caught.value.problems) == ["dense/bias/Adam_1"]
    assert "CRC32C mismatch in tensor 'dense/bias/Adam_1'" in str(caught.value)
    _unchanged(run, before)
    # strict=False loads the rest; the corrupt slot keeps its value and the reason is given.
    slot_before = run.inner.get_slot(run.tensors["dense/bias"], "v").clone()
    info = load_tf_checkpoint(prefix, run.var_map(), run.opt, strict=False)
    assert (
        list(info.skipped) == ["dense/bias/Adam_1"] and "CRC32C mismatch" in info.skipped["dense/bias/Adam_1"]
    )
    assert torch.equal(run.inner.get_slot(run.tensors["dense/bias"], "v"), slot_before)
    np.testing.assert_array_equal(
        run.inner.get_slot(run.tensors["dense/bias"], "m").numpy(),
        _arrays(ADAM["id"])["saved/dense/bias/Adam"],
    )


def _with_entries(prefix: Path, out: Path, extra: dict[str, int]) -> Path:
    """A copy of the checkpoint at ``prefix`` whose index also lists scalar entries of raw TF dtype enums.

    Stands in for what TF writes for a resource or variant tensor (an iterator's state,
    say): an index entry whose dtype has no torch counterpart.
    """
    from torchgrad_compat.checkpoint import _bundle as b
    from torchgrad_compat.checkpoint import _table

    reader = b.BundleReader(prefix)
    with open(f"{prefix}.index", "rb") as index:
        table = _table.read_table(index, "test")
    for name, enum in extra.items():
        table.append((name.encode(), _table.varint_field(1, enum) + _table.length_delimited(2, b"")))
    table.sort(key=lambda kv: kv[0])
    out.mkdir(parents=True)
    Path(f"{out}/model.ckpt.index").write_bytes(_table.build_table(table))
    shutil.copy(reader.data_file(0), f"{out}/model.ckpt.data-00000-of-00001")
    return out / "model.ckpt"


def test_resource_and_variant_entries_are_listed_and_refused(tmp_path: Path) -> None:
    from torchgrad_compat.checkpoint import CheckpointMismatchError

    prefix = _with_entries(
        FIXTURES / ADAM["prefix"], tmp_path / "ckpt", {"iterator": 21, "handle": 20, "future": 99}
    )
    listed = {name: dtype for name, _, dtype in list_tf_checkpoint(prefix)}
    assert (listed["iterator"], listed["handle"], listed["future"]) == (
        "variant",
        "resource",
        "dtype_enum_99",
    )
    run = Run(ADAM, init=False)
    var_map = {**run.var_map(), "iterator": torch.zeros(()), "future": torch.zeros(())}
    with pytest.raises(CheckpointMismatchError) as caught:
        load_tf_checkpoint(prefix, var_map, run.opt)
    assert caught.value.problems == {
        "future": "checkpoint dtype dtype_enum_99 has no torch dtype",
        "iterator": "checkpoint dtype variant has no torch dtype",
    }
    assert not run.inner.state
    info = load_tf_checkpoint(prefix, var_map, run.opt, strict=False)
    assert sorted(info.skipped) == ["future", "iterator"] and "handle" in info.unused
    _assert_loaded_is_tensorflows(run)


def _assert_loaded_is_tensorflows(run: Run) -> None:
    saved = _arrays(run.case["id"])
    for var, t in run.tensors.items():
        got = t.detach().T if var == KERNEL else t.detach()
        np.testing.assert_array_equal(got.numpy(), saved[f"saved/{var}"], err_msg=var)


def test_strict_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="strict must be a bool, got str: 'no'"):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], {}, strict="no")


def test_load_holds_one_tensor_beside_the_targets(tmp_path: Path) -> None:
    """Validation streams the bytes; the copy reads one tensor at a time: Python's heap peaks at
    about one tensor's bytes, not at the checkpoint's (tracemalloc sees ``bytes`` read from files)."""
    import tracemalloc

    tensors = [torch.nn.Parameter(torch.randn(50_000)) for _ in range(12)]  # 200 kB each
    opt = tgo.AdamOptimizer(tensors)
    for t in tensors:
        t.grad = torch.ones_like(t)
    opt.step()
    var_map = {f"layer{i}/kernel": t for i, t in enumerate(tensors)}
    save_tf_checkpoint(tmp_path / "model.ckpt", var_map, opt)
    targets = [torch.nn.Parameter(torch.zeros(50_000)) for _ in range(12)]
    target_opt = tgo.AdamOptimizer(targets)
    target_map = dict(zip(var_map, targets))
    total = 3 * 12 * 50_000 * 4  # 7.2 MB: the variables and both slots
    tracemalloc.start()
    try:
        load_tf_checkpoint(tmp_path, target_map, target_opt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 50_000 * 4 + 100_000 < total / 10, f"peak {peak} bytes of a {total}-byte checkpoint"
    assert all(torch.equal(a, b) for a, b in zip(targets, tensors))


# ---------------------------------------------------------------------- train.py's model, trained in TF
# tests/fixtures/tf_train: scripts/make_tf_train_checkpoint.py trained train.py's model in a TF1
# graph (Keras's default names, a sparsely trained embedding) for K steps on train.py's batches,
# saved, and trained M more. scripts/convert_tf_checkpoint.py + train.py --resume must continue it.
TF_TRAIN = ROOT / "tests" / "fixtures" / "tf_train"
TF_TRAIN_CASES = {
    case["optimizer"]: case for case in json.loads((TF_TRAIN / "manifest.json").read_text())["cases"]
}
# train.py's state_dict names -> TF's names, and whether TF's is the transpose.
TRAIN_MODEL_NAMES = {
    "embedding.weight": ("embedding/embeddings", False),
    "hidden.weight": ("dense/kernel", True),
    "hidden.bias": ("dense/bias", False),
    "output.weight": ("dense_1/kernel", True),
    "output.bias": ("dense_1/bias", False),
}


def _script(name: str, *args: Any, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _convert_and_continue(folder: Path, optimizer: str, tmp_path: Path) -> dict[str, np.ndarray]:
    """Convert TF's checkpoint, continue it with train.py for M steps; the weights, in TF's layout."""
    case = TF_TRAIN_CASES[optimizer]
    converted, continued = tmp_path / "converted.pt", tmp_path / "continued.pt"
    out = _script(
        "convert_tf_checkpoint.py", folder / optimizer, converted, "--optimizer", optimizer, cwd=tmp_path
    )
    assert "dense/kernel [24, 32] -> hidden.weight [32, 24] (by shape, layout 'transpose')" in out
    assert "embedding/embeddings [100, 8] -> embedding.weight [100, 8] (by name)" in out
    assert f"at global step {case['steps_before']}; unused: none" in out
    args = (
        "--resume",
        converted,
        "--optimizer",
        optimizer,
        "--steps",
        case["steps_after"],
        "--save",
        continued,
    )
    out = _script("train.py", *args, cwd=tmp_path)
    assert f"resumed {converted} at step {case['steps_before']}" in out
    state = torch.load(continued, weights_only=True)
    assert state["step"] == case["steps_before"] + case["steps_after"]
    return {
        tf_name: (state["model"][name].T if transposed else state["model"][name]).numpy()
        for name, (tf_name, transposed) in TRAIN_MODEL_NAMES.items()
    }


# Three of the ten (a subprocess pair each costs seconds): Adam's non-lazy sparse rule and beta
# powers, AdagradDA's step from the global step, Ftrl's l1. All ten agree to 2.4e-7 (docs/checkpoint.md).
@pytest.mark.parametrize("optimizer", ["adam", "adagrad_da", "ftrl"])
def test_train_script_continues_a_tensorflow_run(optimizer: str, tmp_path: Path) -> None:
    ours = _convert_and_continue(TF_TRAIN, optimizer, tmp_path)
    with np.load(TF_TRAIN / optimizer / "reference.npz") as npz:
        for name, value in ours.items():
            np.testing.assert_allclose(value, npz[f"final/{name}"], rtol=1e-5, atol=1e-6, err_msg=name)


def test_converter_refuses_another_models_checkpoint(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "convert_tf_checkpoint.py"),
            FIXTURES / ADAM["prefix"],
            "x.pt",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode != 0
    assert "not every variable was matched" in result.stderr and "dense/kernel [3, 4]" in result.stdout
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.tf_live
def test_tf_train_generator_reproduces_the_fixture(tmp_path: Path, tf_python: str) -> None:
    """TF's run of train.py's model on train.py's batches, regenerated: the fixture; train.py continues it."""
    steps = TF_TRAIN_CASES["adam"]["steps_before"] + TF_TRAIN_CASES["adam"]["steps_after"]
    _script("train.py", "--export-batches", tmp_path / "batches.npz", "--steps", steps, cwd=tmp_path)
    fresh = tmp_path / "fresh"
    result = subprocess.run(
        [
            tf_python,
            str(ROOT / "scripts" / "make_tf_train_checkpoint.py"),
            "--batches",
            tmp_path / "batches.npz",
            "--out",
            fresh,
        ],
        capture_output=True,
        text=True,
        timeout=scaled(600),
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads((fresh / "manifest.json").read_text())["cases"] == list(TF_TRAIN_CASES.values())
    for optimizer, case in TF_TRAIN_CASES.items():
        assert list_tf_checkpoint(fresh / case["prefix"]) == list_tf_checkpoint(TF_TRAIN / case["prefix"])
        with (
            np.load(fresh / optimizer / "reference.npz") as new,
            np.load(TF_TRAIN / optimizer / "reference.npz") as old,
        ):
            assert sorted(new.files) == sorted(old.files)
            for key in old.files:
                np.testing.assert_allclose(
                    new[key], old[key], rtol=1e-5, atol=1e-6, err_msg=f"{optimizer} {key}"
                )
    ours = _convert_and_continue(fresh, "adam", tmp_path)
    with np.load(fresh / "adam" / "reference.npz") as npz:
        for name, value in ours.items():
            np.testing.assert_allclose(value, npz[f"final/{name}"], rtol=1e-5, atol=1e-6, err_msg=name)


def test_missing_data_shard_lists_every_tensor(tmp_path: Path) -> None:
    prefix = _copy_case(ADAM, tmp_path)
    Path(f"{prefix}.data-00000-of-00001").unlink()
    run = _stepped_run()
    before = _snapshot(run)
    with pytest.raises(CorruptCheckpointError, match="data-00000-of-00001: missing; tensor") as caught:
        load_tf_checkpoint(prefix, run.var_map(), run.opt)
    assert sorted(caught.value.problems) == sorted(n for n, _, _ in list_tf_checkpoint(prefix))
    _unchanged(run, before)
    info = load_tf_checkpoint(prefix, run.var_map(), run.opt, strict=False)
    assert info.loaded == [] and info.global_step is None and len(info.skipped) == 12
    _unchanged(run, before)


def test_converter_weights_only_starts_another_optimizer_fresh(tmp_path: Path) -> None:
    """--weights-only: TF's Adam run's weights, a fresh Momentum optimizer, step 0."""
    out = _script(
        "convert_tf_checkpoint.py",
        TF_TRAIN / "adam",
        tmp_path / "w.pt",
        "--optimizer",
        "momentum",
        "--weights-only",
        cwd=tmp_path,
    )
    assert "at global step 5; unused: beta1_power, beta2_power, dense/bias/Adam" in out
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    assert state["step"] == 0 and state["optimizer"]["state"] == {} and state["optimizer_name"] == "momentum"
    from torchgrad_compat.checkpoint._bundle import BundleReader

    reader = BundleReader(TF_TRAIN / TF_TRAIN_CASES["adam"]["prefix"])
    assert torch.equal(state["model"]["hidden.weight"], reader.read("dense/kernel").T)
    assert torch.equal(state["model"]["embedding.weight"], reader.read("embedding/embeddings"))


def test_a_checkpoint_renamed_over_mid_load_is_not_mixed_in(tmp_path: Path, monkeypatch: Any) -> None:
    """The checks and the copies read the same open files: a new checkpoint saved under the same
    prefix between the two (TF renames its files into place) does not leak into the load."""
    from torchgrad_compat.checkpoint import _load

    old = {"w": torch.full((1000,), 1.0), "b": torch.full((10,), 1.0)}
    save_tf_checkpoint(tmp_path / "model.ckpt", old)
    validate = _load._validate

    def validate_then_overwrite(*args: Any) -> Any:
        result = validate(*args)
        save_tf_checkpoint(
            tmp_path / "model.ckpt", {"w": torch.full((1000,), 2.0), "b": torch.full((10,), 2.0)}
        )
        return result

    monkeypatch.setattr(_load, "_validate", validate_then_overwrite)
    loaded = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    load_tf_checkpoint(tmp_path / "model.ckpt", loaded)
    assert torch.equal(loaded["w"], old["w"]) and torch.equal(loaded["b"], old["b"])


def test_suggest_var_map_a_match_by_shape_narrows_the_others(tmp_path: Path) -> None:
    """A bias-only TF layer fits both Linear layers, until the other TF layer, which fits one of
    them alone, has taken it; a tensor is never given twice."""
    from torchgrad_compat.checkpoint import AmbiguousVarMapError, suggest_var_map

    folder = _keras_named_checkpoint(tmp_path / "a", {"a/bias": (8,), "b/kernel": (5, 8), "b/bias": (8,)})
    model = torch.nn.Module()
    model.first = torch.nn.Linear(3, 8)
    model.second = torch.nn.Linear(5, 8)
    suggested = suggest_var_map(folder, model)
    assert suggested == {
        "a/bias": model.first.bias,
        "b/bias": model.second.bias,
        "b/kernel": (model.second.weight, "transpose"),
    }
    # Two 8x8 layers and a third that fits only one of their two modules: it takes that one,
    # and the two left for the one module left are refused, not both given it.
    folder = _keras_named_checkpoint(
        tmp_path / "b", {"x/kernel": (8, 8), "y/kernel": (8, 8), "z/kernel": (8, 8), "z/bias": (8,)}
    )
    model = torch.nn.Module()
    model.first = torch.nn.Linear(8, 8, bias=False)
    model.second = torch.nn.Linear(8, 8)
    with pytest.raises(AmbiguousVarMapError) as caught:
        suggest_var_map(folder, model)
    assert caught.value.candidates == {"x/kernel": ["first.weight"], "y/kernel": ["first.weight"]}


def _aliased(var_map: dict[str, Any]) -> dict[str, Any]:
    """``var_map`` with every tensor replaced by ``.detach()`` (what ``model.state_dict()`` gives)."""
    return {k: (v[0].detach(), v[1]) if isinstance(v, tuple) else v.detach() for k, v in var_map.items()}


def test_aliases_of_the_parameters_load_and_save_their_slots(tmp_path: Path) -> None:
    # Taken as they were, aliases carried the variables but left the slots behind (with Adam's
    # beta powers loaded): the next step was far from TF's.
    run, control = Run(ADAM, init=False), Run(ADAM, init=False)
    load_tf_checkpoint(FIXTURES / ADAM["prefix"], _aliased(run.var_map()), run.opt)
    control.load()
    for t, c in zip(run.tensors.values(), control.tensors.values(), strict=True):
        assert (
            torch.equal(t, c)
            and run.inner.state[t]
            and all(torch.equal(run.inner.state[t][k], v) for k, v in control.inner.state[c].items())
        )
    save_tf_checkpoint(tmp_path / "ckpt", _aliased(run.var_map()), run.opt, global_step=3)
    assert {name for name, _, _ in list_tf_checkpoint(tmp_path / "ckpt")} == {
        name for name, _, _ in list_tf_checkpoint(FIXTURES / ADAM["prefix"])
    }


def test_views_of_part_of_a_parameter_take_the_same_views_of_its_slots(tmp_path: Path) -> None:
    # TF's separate q, k, v kernels as row blocks of one in_proj_weight: each block's slots are
    # the same rows of the parameter's slots, loaded and saved with it.
    gen = torch.Generator().manual_seed(0)
    parts = {n: torch.nn.Parameter(torch.randn(2, 3, generator=gen)) for n in "qkv"}
    tf_side = tgo.AdamOptimizer(list(parts.values()), 0.1)
    for p in parts.values():
        p.grad = p.detach() * 2
    tf_side.step()
    save_tf_checkpoint(tmp_path / "qkv", {f"{n}/kernel": p for n, p in parts.items()}, tf_side, global_step=1)
    in_proj = torch.nn.Parameter(torch.zeros(6, 3))
    opt = tgo.AdamOptimizer([in_proj], 0.1)
    var_map = {f"{n}/kernel": in_proj[2 * i : 2 * i + 2] for i, n in enumerate("qkv")}
    load_tf_checkpoint(tmp_path / "qkv", var_map, opt)
    for slot in ("m", "v"):
        expected = torch.cat([tf_side.state[p][slot] for p in parts.values()])
        assert torch.equal(opt.state[in_proj][slot], expected)
    assert torch.equal(in_proj.detach(), torch.cat([p.detach() for p in parts.values()]))
    save_tf_checkpoint(tmp_path / "back", var_map, opt, global_step=1)
    assert list_tf_checkpoint(tmp_path / "back") == list_tf_checkpoint(tmp_path / "qkv")
    # A transposed view (instead of the "transpose" layout) takes the transposed slots.
    run, control = Run(ADAM, init=False), Run(ADAM, init=False)
    var_map = run.var_map()
    var_map[KERNEL] = run.tensors[KERNEL].T
    load_tf_checkpoint(FIXTURES / ADAM["prefix"], var_map, run.opt)
    control.load()
    ours, theirs = run.inner.state[run.tensors[KERNEL]], control.inner.state[control.tensors[KERNEL]]
    assert all(torch.equal(ours[k], theirs[k]) for k in ("m", "v"))


def test_a_view_whose_slots_cannot_follow_is_refused_and_changes_nothing() -> None:
    run = _stepped_run()
    before = _snapshot(run)
    var_map = run.var_map()
    # A float32 parameter read as int32 bits: no slot view can follow it.
    var_map[KERNEL] = run.tensors[KERNEL].view(torch.int32).T
    with pytest.raises(ValueError, match=r"var_map\['dense/kernel'\] is a view of part of a parameter"):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], var_map, run.opt, strict=False)
    _unchanged(run, before)


def test_load_targets_sharing_memory_are_refused() -> None:
    # np.copyto into an expanded view writes each element several times; overlapping targets
    # keep whichever was copied last.
    bias = next(k for k, v in ADAM["variables"].items() if len(v) == 1)
    n = ADAM["variables"][bias][0]
    with pytest.raises(ValueError, match=rf"var_map\['{bias}'\] is an expanded view"):
        load_tf_checkpoint(FIXTURES / ADAM["prefix"], {bias: torch.zeros(1).expand(n)}, strict=False)
    columns = torch.zeros(n, 2)  # even and odd columns: overlapping spans, no shared element
    load_tf_checkpoint(FIXTURES / ADAM["prefix"], {bias: columns[:, 0], "other": columns[:, 1]}, strict=False)
    assert columns[:, 0].any() and not columns[:, 1].any()
    base = torch.zeros(2, n)
    with pytest.raises(ValueError, match="share memory; each needs its own"):
        load_tf_checkpoint(
            FIXTURES / ADAM["prefix"], {bias: base[0], "other": base.view(-1)[1 : n + 1]}, strict=False
        )


# TF1 names an optimizer's state after the scope its update was built in (a variable scope
# prefixes the slots too, a name scope only the optimizer-wide state), and numbers a graph's
# second Adam's beta powers beta1_power_1. Per layout of tests/checkpoint/_tf_scoped_graphs.py: each
# variable's load/save keywords.
SCOPED = Path(__file__).parent / "_tf_scoped_graphs.py"
SCOPED_LAYOUTS: dict[str, dict[str, dict[str, Any]]] = {
    "variable": {"g/w": {"scope": "train"}},
    "name": {"g/w": {"scope": "train"}},
    "gan": {"g/w": {"scope": "g_train"}, "d/w": {"scope": "d_train"}},
    "gan_suffix": {"g/w": {"non_slot_suffix": ""}, "d/w": {"non_slot_suffix": "_1"}},
    "gan_one_scope": {
        "g/w": {"scope": "train", "non_slot_suffix": ""},
        "d/w": {"scope": "train", "non_slot_suffix": "_1"},
    },
}


def _run_scoped(tf_python: str, *args: Any) -> dict[str, Any]:
    result = subprocess.run(
        [tf_python, str(SCOPED), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.tf_live
@pytest.mark.parametrize("layout", SCOPED_LAYOUTS)
def test_scoped_and_paired_optimizers_load_continue_and_go_back(
    layout: str, tmp_path: Path, tf_python: str
) -> None:
    tf_run = _run_scoped(tf_python, "write", layout, tmp_path, 2)  # 2 steps, saved, 2 more
    grads = {v: torch.tensor(g, dtype=torch.float64) for v, g in tf_run["grads"].items()}
    runs = {}
    for name, kwargs in SCOPED_LAYOUTS[layout].items():
        p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
        opt = tgo.AdamOptimizer([p], 0.1)
        info = load_tf_checkpoint(tmp_path / "tf.ckpt", {name: p}, opt, **kwargs)
        assert len(info.loaded) == 5, info.loaded  # the variable, m, v, and the two beta powers
        runs[name] = (p, opt, kwargs)
        if "non_slot_suffix" in kwargs:  # left out, the two optimizers' beta powers are ambiguous
            unsuffixed = {k: v for k, v in kwargs.items() if k != "non_slot_suffix"}
            with pytest.raises(CheckpointMismatchError, match="beta1_power: ambiguous"):
                load_tf_checkpoint(tmp_path / "tf.ckpt", {name: p}, opt, **unsuffixed)

    def step(k: int) -> None:
        for name, (p, opt, _) in runs.items():
            p.grad = grads[name][k].clone()
            opt.step()

    def compare(tf_finals: dict[str, Any]) -> None:
        for name, (p, opt, kwargs) in runs.items():
            scope = f"{kwargs['scope']}/" if "scope" in kwargs else ""
            slot_scope = "" if layout == "name" else scope
            suffix = kwargs.get("non_slot_suffix", "")
            ours = {
                name: p,
                f"{slot_scope}{name}/Adam": opt.state[p]["m"],
                f"{slot_scope}{name}/Adam_1": opt.state[p]["v"],
                f"{scope}beta1_power{suffix}": opt.param_groups[0]["beta1_power"],
                f"{scope}beta2_power{suffix}": opt.param_groups[0]["beta2_power"],
            }
            for tf_name, value in ours.items():
                theirs = np.asarray(tf_finals[tf_name])
                np.testing.assert_allclose(value.detach().numpy(), theirs, rtol=1e-12, err_msg=tf_name)

    for k in (2, 3):
        step(k)
    compare(tf_run["finals"])
    # Back to TF: each optimizer saved under its TF names into one checkpoint.
    for i, (name, (p, opt, kwargs)) in enumerate(runs.items()):
        save_tf_checkpoint(
            tmp_path / "torch.ckpt",
            {name: p},
            opt,
            global_step=4,
            scoped_slots=layout != "name",
            append=i > 0,
            **kwargs,
        )
    restored = _run_scoped(tf_python, "restore", layout, tmp_path, 2, 4)  # steps 4 and 5
    for k in (4, 5):
        step(k)
    compare(restored["finals"])


def test_save_append_refuses_a_name_written_twice(tmp_path: Path) -> None:
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    save_tf_checkpoint(tmp_path / "ckpt", {"p": p}, tgo.AdamOptimizer([p], 0.1), global_step=1)
    before = list_tf_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="already holds 'beta1_power'; give this optimizer its TF names"):
        save_tf_checkpoint(tmp_path / "ckpt", {"q": q}, tgo.AdamOptimizer([q], 0.1), append=True)
    assert list_tf_checkpoint(tmp_path / "ckpt") == before
    with pytest.raises(ValueError, match="holds global_step 1, this save gives 2"):
        save_tf_checkpoint(tmp_path / "ckpt", {"q": q}, global_step=2, append=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        save_tf_checkpoint(tmp_path / "other", {"q": q}, append=True)
    with pytest.raises(ValueError, match="scope must be a TF scope name"):
        save_tf_checkpoint(tmp_path / "ckpt", {"q": q}, scope="train/")
