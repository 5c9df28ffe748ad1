"""How close a run continued across a TF checkpoint stays to TensorFlow's, per optimizer and direction.

    python scripts/tf_checkpoint_table.py                      # TF -> torch from the fixtures
    python scripts/tf_checkpoint_table.py --tf-python /path/to/python-with-tensorflow   # and torch -> TF

Every case of tests/fixtures/tf_checkpoint (scripts/make_tf_checkpoint_fixtures.py:
a Dense kernel and bias and a sparsely trained embedding, K steps, a checkpoint,
M more steps) gives one row:

- **TF -> torch**: torch loads TF's checkpoint, runs steps K+1..K+M with the
  case's gradients, and is compared with TF's run (the fixture);
- **torch saved at K**: torch runs steps 1..K itself and saves; its checkpoint
  is compared with TF's at step K, tensor by tensor (name-based cases);
- **torch -> TF**: TF's ``Saver`` restores torch's checkpoint in the case's
  graph and runs steps K+1..K+M (``make_tf_checkpoint_fixtures.py --restore``,
  in an interpreter with TensorFlow: ``--tf-python`` or
  ``TORCHGRAD_COMPAT_TF_PYTHON``), and is compared with torch continuing.

A second table does the same for train.py's model trained in TF
(tests/fixtures/tf_train, scripts/make_tf_train_checkpoint.py): for each of the
ten optimizers, torch loads TF's checkpoint (``suggest_var_map`` finds the
names), runs train.py's steps K+1..K+M on train.py's batches, and its weights
are compared with TF's.

Each number is the largest absolute difference over every variable, slot,
optimizer-wide value and loss-scale value, then the largest relative one
(|Δ| / max(|reference|, 1e-30) where the reference is not 0). The output is a
Markdown table; the exit status is 1 if any difference exceeds the parity
tolerance (float32 rtol 1e-5 + atol 1e-6, float64 1e-10 + 1e-12).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer
from torchgrad_compat.checkpoint import load_tf_checkpoint, save_tf_checkpoint, suggest_var_map
from torchgrad_compat.checkpoint._bundle import BundleReader
from torchgrad_compat.checkpoint._mapping import _optimizer_wide_state

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "dense/kernel"  # TF's [in, out]; torch's Linear weight is its transpose
TOLERANCE = {"float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}


class Run:
    """One case's torch side: its three tensors (kernel in torch's layout) and its optimizer."""

    def __init__(self, case: dict[str, Any], arrays: dict[str, np.ndarray], init: bool):
        self.case, self.arrays = case, arrays
        dtype = getattr(torch, case["dtype"])
        self.tensors = {}
        for var, shape in case["variables"].items():
            value = torch.tensor(arrays[f"init/{var}"]) if init else torch.zeros(shape, dtype=dtype)
            self.tensors[var] = torch.nn.Parameter(value.T.contiguous() if var == KERNEL else value)
        self.inner = getattr(tgo, case["optimizer"])(list(self.tensors.values()), **case["kwargs"])
        self.opt: Any = self.inner
        if case["loss_scale"]:
            self.opt = LossScaleOptimizer(self.inner, DynamicLossScale(**case["loss_scale"]))

    def var_map(self) -> dict[str, Any]:
        prefix = "model/" if self.case["format"] == "object" else ""
        return {prefix + v: (t, "transpose") if v == KERNEL else t for v, t in self.tensors.items()}

    def steps(self, first: int, last: int) -> None:
        for k in range(first, last + 1):
            pairs = []
            for var, t in self.tensors.items():
                if f"grad/{var}/{k}" in self.arrays:
                    grad = torch.tensor(self.arrays[f"grad/{var}/{k}"])
                    pairs.append((grad.T.contiguous() if var == KERNEL else grad, t))
                else:
                    indices = torch.tensor(self.arrays[f"grad/{var}/{k}/indices"])[None]
                    values = torch.tensor(self.arrays[f"grad/{var}/{k}/values"])
                    sparse = torch.sparse_coo_tensor(indices, values, t.shape, check_invariants=True)
                    pairs.append((sparse, t))
            self.opt.apply_gradients(pairs)

    def finals(self) -> dict[str, np.ndarray]:
        """Everything TF's ``final/...`` arrays hold, in TF's layout."""
        out = {}
        for var, t in self.tensors.items():
            layout = (lambda x: x.T) if var == KERNEL else (lambda x: x)
            out[f"final/{var}"] = layout(t.detach()).numpy()
            for slot in self.inner.get_slot_names():
                out[f"final/{var}/{slot}"] = layout(self.inner.get_slot(t, slot)).numpy()
        for key, value in _optimizer_wide_state(self.inner)[0].items():
            if key != "global_step":
                out[f"final/non_slot/{key}"] = value.numpy()
        if self.case["loss_scale"]:
            out["final/loss_scale/current_loss_scale"] = self.opt.loss_scale().numpy()
            out["final/loss_scale/good_steps"] = self.opt.loss_scale.good_steps.numpy()
        return out


def differences(ours: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> tuple[float, float, bool]:
    """(max |Δ|, max relative |Δ|, within the parity tolerance) over the reference's keys."""
    if sorted(ours) != sorted(reference):
        raise KeyError(f"keys differ: {sorted(set(ours) ^ set(reference))}")
    worst = worst_rel = 0.0
    ok = True
    for key, ref in reference.items():
        ref64, ours64 = np.asarray(ref, np.float64), np.asarray(ours[key], np.float64)
        delta = np.abs(ours64 - ref64)
        worst = max(worst, float(delta.max(initial=0)))
        nonzero = ref64 != 0
        if nonzero.any():
            worst_rel = max(worst_rel, float((delta[nonzero] / np.abs(ref64[nonzero])).max()))
        dtype = "float64" if ref.dtype == np.float64 else "float32"
        rtol, atol = TOLERANCE[dtype]
        ok = ok and bool(np.all(delta <= atol + rtol * np.abs(ref64)))
    return worst, worst_rel, ok


def train_model_rows(folder: Path) -> dict[str, tuple[float, float, bool]]:
    """Per optimizer: train.py's model loaded from TF's checkpoint, stepped on, against TF's weights."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train  # a script beside this one

    torch.set_num_threads(1)
    rows = {}
    for case in json.loads((folder / "manifest.json").read_text())["cases"]:
        model = train.Classifier()
        cls, hyperparameters = train.optimizer_settings(case["optimizer"], None)
        opt = cls(model.parameters(), **hyperparameters)
        var_map = suggest_var_map(folder / case["prefix"], model)
        load_tf_checkpoint(folder / case["prefix"], var_map, opt)
        train_set, _ = train.make_datasets(0)
        batches = train.batch_indices(0)
        for _ in range(case["steps_before"]):
            next(batches)
        for _ in range(case["steps_after"]):
            opt.zero_grad()
            train.loss_on(model, train_set.batch(next(batches))).backward()
            opt.step()
        ours, reference = {}, {}
        with np.load(folder / case["optimizer"] / "reference.npz") as npz:
            for tf_name, value in var_map.items():
                tensor, layout = value if isinstance(value, tuple) else (value, None)
                ours[tf_name] = (tensor.detach().T if layout == "transpose" else tensor.detach()).numpy()
                reference[tf_name] = npz[f"final/{tf_name}"]
        rows[case["optimizer"]] = differences(ours, reference)
    return rows


def _tf_python(arg: str | None) -> str | None:
    if arg:
        return arg
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    return os.environ.get("TORCHGRAD_COMPAT_TF_PYTHON")


def _cell(result: tuple[float, float, bool] | None) -> str:
    if result is None:
        return "—"
    worst, rel, ok = result
    return f"{worst:.1e} ({rel:.1e})" + ("" if ok else " **over tolerance**")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures", type=Path, default=ROOT / "tests" / "fixtures" / "tf_checkpoint")
    parser.add_argument(
        "--tf-python", help="an interpreter with TensorFlow (default: TORCHGRAD_COMPAT_TF_PYTHON)"
    )
    parser.add_argument("--tf-train", type=Path, default=ROOT / "tests" / "fixtures" / "tf_train")
    parser.add_argument("--no-tf", action="store_true", help="leave the torch -> TF column out")
    args = parser.parse_args(argv)
    manifest = json.loads((args.fixtures / "manifest.json").read_text())
    python = None if args.no_tf else _tf_python(args.tf_python)

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        continuing: dict[str, Run] = {}
        for case in manifest:
            with np.load(args.fixtures / case["id"] / "arrays.npz") as npz:
                arrays = {key: npz[key] for key in npz.files}
            k, m = case["steps_before"], case["steps_after"]
            run = Run(case, arrays, init=False)
            load_tf_checkpoint(
                args.fixtures / case["prefix"], run.var_map(), run.opt, optimizer_name=case["optimizer_name"]
            )
            run.steps(k + 1, k + m)
            finals = {key: v for key, v in arrays.items() if key.startswith("final/")}
            row = rows[case["id"]] = {"case": case, "tf_to_torch": differences(run.finals(), finals)}
            if case["format"] != "name":
                continue
            mine = Run(case, arrays, init=True)
            mine.steps(1, k)
            prefix = Path(tmp) / case["id"] / f"model.ckpt-{k}"
            save_tf_checkpoint(
                prefix, mine.var_map(), mine.opt, global_step=k, optimizer_name=case["optimizer_name"]
            )
            reader = BundleReader(prefix)
            saved = {n[len("saved/") :]: v for n, v in arrays.items() if n.startswith("saved/")}
            row["saved_at_k"] = differences({n: reader.read(n).numpy() for n in saved}, saved)
            continuing[case["id"]] = mine
        if python is not None:
            result = subprocess.run(
                [
                    python,
                    str(ROOT / "scripts" / "make_tf_checkpoint_fixtures.py"),
                    "--restore",
                    tmp,
                    "--fixtures",
                    str(args.fixtures),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
            )
            if result.returncode:
                sys.stderr.write(result.stderr[-4000:])
                return 2
            for case_id, mine in continuing.items():
                case = rows[case_id]["case"]
                mine.steps(case["steps_before"] + 1, case["steps_before"] + case["steps_after"])
                with np.load(Path(tmp) / case_id / "continued.npz") as npz:
                    rows[case_id]["torch_to_tf"] = differences(
                        mine.finals(), {key: npz[key] for key in npz.files}
                    )

    print(
        "max |Δ| (max relative |Δ|) over every variable, slot and optimizer-wide value: after the M steps "
        "that follow the checkpoint, or (saved at K) in the checkpoint\n"
    )
    print("| case | optimizer | dtype | format | TF → torch | torch saved at K vs TF | torch → TF |")
    print("|---|---|---|---|---|---|---|")
    failed = False
    for case_id, row in rows.items():
        case = row["case"]
        cells = [row.get(key) for key in ("tf_to_torch", "saved_at_k", "torch_to_tf")]
        failed = failed or any(cell is not None and not cell[2] for cell in cells)
        name = case["optimizer"].removesuffix("Optimizer")
        print(
            f"| {case_id} | {name} | {case['dtype']} | {case['format']} | "
            + " | ".join(_cell(cell) for cell in cells)
            + " |"
        )
    print("\nThe largest |Δ| per optimizer, over its cases (name- and object-based, renamed, loss scale):\n")
    columns = [f"{d}, {t}" for d in ("TF → torch", "torch → TF") for t in ("float32", "float64")]
    print("| optimizer | " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|")
    summary: dict[str, dict[tuple[str, str], float]] = {}
    for row in rows.values():
        case = row["case"]
        cells = summary.setdefault(case["optimizer"].removesuffix("Optimizer"), {})
        for direction in ("tf_to_torch", "torch_to_tf"):
            if row.get(direction) is not None:
                key = (direction, case["dtype"])
                cells[key] = max(cells.get(key, 0.0), row[direction][0])
    for name, cells in summary.items():
        values = [cells.get((d, t)) for d in ("tf_to_torch", "torch_to_tf") for t in ("float32", "float64")]
        print(f"| {name} | " + " | ".join("—" if v is None else f"{v:.1e}" for v in values) + " |")
    train_rows = train_model_rows(args.tf_train)
    print("\ntrain.py's model trained in TF, continued in torch: max |Δ| (max relative |Δ|) of the weights\n")
    print("| optimizer | TF → torch, float32 |")
    print("|---|---:|")
    for name, cell in train_rows.items():
        failed = failed or not cell[2]
        print(f"| {name} | {_cell(cell)} |")
    if python is None:
        print("\n(torch → TF needs TensorFlow: --tf-python or TORCHGRAD_COMPAT_TF_PYTHON)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
