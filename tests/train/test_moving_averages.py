"""train.ExponentialMovingAverage against TensorFlow's: fixture bits, names, paths, state_dict, swaps."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import init_gloo, run_ranks

from torchgrad_compat import optim, train
from torchgrad_compat.train import ExponentialMovingAverage

FIXTURES = Path(__file__).parents[1] / "fixtures" / "train"
GENERATOR = Path(__file__).parents[2] / "scripts" / "make_tf_ema_fixtures.py"
FIXTURE = json.loads((FIXTURES / "ema.json").read_text())
CASES = {case["id"]: case for case in FIXTURE["cases"]}
TENSOR = "moments/mean"
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


# The update paths, as ExponentialMovingAverage's arguments: all give the loop's bits.
PATHS = {"foreach": {"foreach": True}, "loop": {"foreach": False}, "fused": {"fused": True}}


def _tensor(values: list[float], shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)


def _bits_equal(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return ours.dtype == theirs.dtype and torch.equal(ours, theirs)


class _Run:
    """One fixture case replayed with our optimizer and our EMA, step by step."""

    def __init__(self, case: dict[str, Any], path: str):
        self.case = case
        self.dtype = DTYPES[case["dtype"]]
        self.variables = {
            n: _tensor(v["value"], v["shape"], self.dtype).requires_grad_()
            for n, v in case["variables"].items()
        }
        self.global_step = torch.tensor(case["global_step0"], dtype=torch.int64)
        params = list(self.variables.values())
        if case["optimizer"] == "Momentum":
            self.opt = optim.MomentumOptimizer(params, learning_rate=0.05, momentum=0.9)
        else:
            self.opt = optim.GradientDescentOptimizer(params, learning_rate=0.05)
        kwargs = dict(case["kwargs"])
        if kwargs.pop("num_updates", False):
            kwargs["num_updates"] = self.global_step
        self.ema = ExponentialMovingAverage(**kwargs, **PATHS[path])
        # Before training, as TF's initializer: the shadows start at the initial values.
        self.ema.apply(self.variables)

    def step(self, record: dict[str, Any]) -> None:
        if self.dtype in (torch.float16, torch.bfloat16):
            # The optimizers' half-precision steps are not TF's bit for bit (their parity is
            # float32 and float64): the EMA averages TF's own variables here.
            with torch.no_grad():
                for n, v in self.variables.items():
                    v.copy_(_tensor(record["variables"][n], v.shape, self.dtype))
            self.global_step += 1
        else:
            self._optimizer_step(record)
        tensors = None
        if self.case["tensor"]:
            tensors = {TENSOR: _tensor(record["tensor"], self.case["tensor_shape"], self.dtype)}
        self.ema.apply(self.variables.values(), tensors=tensors)

    def _optimizer_step(self, record: dict[str, Any]) -> None:
        grads = [(_tensor(record["grads"][n], v.shape, self.dtype), v) for n, v in self.variables.items()]
        self.opt.apply_gradients(grads, global_step=self.global_step)


def _mismatches(run: _Run, k: int, record: dict[str, Any]) -> list[str]:
    bad = []
    for n, v in run.variables.items():
        if not _bits_equal(v.detach(), _tensor(record["variables"][n], v.shape, run.dtype)):
            bad.append(f"step {k + 1}: variable {n}")
    for n, values in record["averages"].items():
        shadow = run.ema.average(n)
        if shadow is None or not _bits_equal(shadow, _tensor(values, shadow.shape, run.dtype)):
            bad.append(f"step {k + 1}: average of {n}")
    state = run.ema.state_dict()
    for key, values in record["debias"].items():
        if not _bits_equal(state[key], _tensor(values, state[key].shape, run.dtype)):
            bad.append(f"step {k + 1}: {key}")
    return bad


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case_id", list(CASES))
def test_tensorflow_fixture_bit_for_bit(case_id, path):
    """50 steps of TF 1's optimizer + EMA graph: variables, shadows, biased and local_step, every bit."""
    case = CASES[case_id]
    run = _Run(case, path)
    bad = []
    for k, record in enumerate(case["steps"]):
        run.step(record)
        bad += _mismatches(run, k, record)
    assert not bad, f"{len(bad)} mismatches, first: {bad[:5]}"


@pytest.mark.parametrize("case_id", list(CASES))
def test_names_are_tensorflows(case_id):
    case = CASES[case_id]
    run = _Run(case, "foreach")
    run.step(case["steps"][0])
    for n, tf_name in case["average_names"].items():
        assert run.ema.average_name(n) == tf_name
        if n in run.variables:
            assert run.ema.average_name(run.variables[n]) == tf_name
    assert sorted(run.ema.variables_to_restore()) == case["variables_to_restore"]
    restore = run.ema.variables_to_restore()
    assert all(restore[run.ema.average_name(v)] is v for v in run.variables.values())
    # Every entry of the state dict is one of TF's variables, under TF's name, and the EMA's are all there.
    ours = set(run.ema.state_dict())
    theirs = {n for n in case["global_variables"] if "/ExponentialMovingAverage" in n}
    assert ours == theirs


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tfs_zero_debias_leaves_variables_alone(dtype):
    """TF's zero_debias=True run gives its variables the averages of a plain run: TF debiases
    only tensors (here too)."""
    case = CASES[f"zero_debias_{dtype}"]
    assert case["kwargs"]["zero_debias"] is True
    plain = _Run({**case, "kwargs": {**case["kwargs"], "zero_debias": False}, "tensor": False}, "foreach")
    for k, record in enumerate(case["steps"]):
        plain.step(record)
        for n in plain.variables:
            tf_average = _tensor(record["averages"][n], plain.variables[n].shape, plain.dtype)
            assert _bits_equal(plain.ema.average(n), tf_average), f"step {k + 1}: {n}"


# ------------------------------------------------------------------------- foreach and dtypes


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (shape, dtype) in enumerate(
        [
            ((3, 4), torch.float32),
            ((70_000,), torch.float32),  # split into pieces by the foreach path
            ((200, 300), torch.float64),
            ((5, 7), torch.float16),
            ((40_000,), torch.bfloat16),
            ((0,), torch.float32),
        ]
        + [((17,), torch.float32)] * 40
    ):
        out[f"t{i}"] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    out["strided"] = torch.randn(9, 8, generator=g).t()  # not contiguous
    return out


@pytest.mark.parametrize("path", ["foreach", "fused"])
@pytest.mark.parametrize("num_updates", [None, 3])
def test_other_paths_are_the_loop_bit_for_bit(num_updates, path):
    """float32/float64 (compiled when fused), float16/bfloat16, strided, empty, tiny, split."""
    shadows = {}
    for other in (False, True):
        values = _mixed(0)
        ema = ExponentialMovingAverage(0.97, num_updates=num_updates, **PATHS[path if other else "loop"])
        ema.apply(values)
        for k in range(1, 6):
            moved = _mixed(k)
            with torch.no_grad():
                for n, v in values.items():
                    v.copy_(moved[n])
            ema.apply(values.values())
        shadows[other] = {n: ema.average(n).clone() for n in values}
    for n, s in shadows[False].items():
        assert _bits_equal(shadows[True][n], s), n
    # The shadows moved (a path that did nothing would pass the comparison too).
    assert not torch.equal(shadows[True]["t1"], _mixed(0)["t1"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_updates_in_compiled_kernels(dtype):
    """fused=True runs no eager op on contiguous float32/float64 shadows of two or more elements
    (the foreach path runs three per batch), bitwise the loop, one kernel for every decay."""
    g = torch.Generator().manual_seed(0)
    values = {f"p{i}": torch.randn(100 + i, generator=g, dtype=dtype) for i in range(20)}
    emas = {d: ExponentialMovingAverage(d, fused=True) for d in (0.9, 0.5)}
    loops = {d: ExponentialMovingAverage(d, foreach=False) for d in (0.9, 0.5)}
    for ema in (*emas.values(), *loops.values()):
        ema.apply(values)  # (fused: compiles the kernel, once per process and dtype)
    with torch.no_grad():
        for v in values.values():
            v.copy_(torch.randn(v.shape, generator=g, dtype=dtype))
    for decay, ema in emas.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ema.apply(values.values())
        ops = {e.name for e in prof.events() if e.name.startswith("aten::")}
        assert not ops & {"aten::sub", "aten::sub_", "aten::mul_", "aten::_foreach_sub"}, ops
        loops[decay].apply(values.values())
        for n, v in values.items():
            assert _bits_equal(ema.average(n), loops[decay].average(n)), (decay, n)
            assert not torch.equal(ema.average(n), v)  # (the shadows moved)


def test_shadows_take_the_variables_dtype_and_round_in_it():
    """float16/bfloat16 shadows round each op in their dtype (TF's shadows have the variable's dtype)."""
    for dtype in (torch.float16, torch.bfloat16):
        v = torch.tensor([1.0, -2.0, 3.0], dtype=dtype)
        ema = ExponentialMovingAverage(0.9)
        ema.apply({"v": v})
        v.copy_(torch.tensor([1.5, 0.25, -7.0]))
        ema.apply([v])
        s = ema.average(v)
        assert s.dtype == dtype
        c = torch.tensor(1 - torch.tensor(0.9, dtype=torch.float32).item(), dtype=torch.float32).to(dtype)
        expected = torch.tensor([1.0, -2.0, 3.0], dtype=dtype)
        expected -= (expected - v) * c
        assert torch.equal(s, expected)


def test_num_updates_is_cast_to_float32_as_tf_does():
    # Above 2**24 the cast rounds: n = 2**24 + 1 becomes 2**24, so (1 + n) / (10 + n) is
    # 16777216 / 16777226 in float32; the update with decay 1 keeps only that ratio.
    v = torch.zeros(1)
    ema = ExponentialMovingAverage(1.0, num_updates=2**24 + 1)
    ema.apply({"v": v})
    v.fill_(1.0)
    ema.apply([v])
    ratio = torch.tensor(16777216.0) / torch.tensor(16777226.0)
    assert ema.average(v).item() == (torch.tensor(1.0) - ratio).item()


# ------------------------------------------------------------------------------ state_dict


def _debiasing_run(steps: int) -> tuple[ExponentialMovingAverage, dict[str, Any]]:
    """A float64 model's EMA with num_updates and a zero-debiased tensor, after ``steps`` updates."""
    g = torch.Generator().manual_seed(7)
    model = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    ctx = {"model": model, "step": torch.tensor(0), "g": g}
    ema = ExponentialMovingAverage(0.99, num_updates=ctx["step"], zero_debias=True)
    ema.apply(model.named_parameters())
    _continue(ema, ctx, steps)
    return ema, ctx


def _continue(ema: ExponentialMovingAverage, ctx: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        with torch.no_grad():
            for p in ctx["model"].parameters():
                p.add_(torch.randn(p.shape, generator=ctx["g"], dtype=torch.float64))
        ctx["step"] += 1
        mean = torch.randn(3, generator=ctx["g"], dtype=torch.float64)
        ema.apply(ctx["model"].parameters(), tensors={"moments/mean": mean})


def _resumed(load) -> tuple[ExponentialMovingAverage, ExponentialMovingAverage]:
    """(10 updates uninterrupted, 5 updates saved, loaded by ``load(saved, fresh)`` into a fresh
    object, and 5 more)."""
    uninterrupted, _ = _debiasing_run(10)
    saved, ctx = _debiasing_run(5)
    fresh = ExponentialMovingAverage(0.99, num_updates=ctx["step"], zero_debias=True)
    # The apply that starts training makes the averages; the load replaces all of them.
    fresh.apply(ctx["model"].named_parameters(), tensors={"moments/mean": torch.ones(3, dtype=torch.float64)})
    load(saved, fresh)
    _continue(fresh, ctx, 5)
    return uninterrupted, fresh


def _torch_save_load(saved: ExponentialMovingAverage, fresh: ExponentialMovingAverage) -> None:
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))


def test_state_dict_resumes_bit_for_bit():
    uninterrupted, resumed = _resumed(_torch_save_load)
    assert uninterrupted.state_dict()["moments/mean/ExponentialMovingAverage/local_step"].item() == 10.0
    assert uninterrupted.state_dict().keys() == resumed.state_dict().keys()
    for key, value in uninterrupted.state_dict().items():
        assert _bits_equal(resumed.state_dict()[key], value), key


def test_dcp_loads_in_place_and_resumes_bit_for_bit(tmp_path):
    import torch.distributed.checkpoint as dcp

    def load(saved: ExponentialMovingAverage, fresh: ExponentialMovingAverage) -> None:
        dcp.save({"ema": saved.state_dict()}, checkpoint_id=tmp_path)
        target = {"ema": fresh.state_dict()}
        dcp.load(target, checkpoint_id=tmp_path)  # into the fresh object's own tensors

    uninterrupted, resumed = _resumed(load)
    for key, value in uninterrupted.state_dict().items():
        assert _bits_equal(resumed.state_dict()[key], value), key


def _snapshot(ema: ExponentialMovingAverage) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ema.state_dict().items()}


def _unchanged(ema: ExponentialMovingAverage, before: dict[str, torch.Tensor]) -> bool:
    return all(_bits_equal(ema.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize(
    "edit, exc, match",
    [
        (lambda sd: sd.pop("bias/ExponentialMovingAverage"), KeyError, "missing.*bias/Exp"),
        (
            lambda sd: sd.__setitem__("other/ExponentialMovingAverage", torch.zeros(1)),
            KeyError,
            "unknown.*other",
        ),
        (
            lambda sd: sd.__setitem__(
                "weight/ExponentialMovingAverage", torch.zeros(4, 3, dtype=torch.float64)
            ),
            ValueError,
            "weight/ExponentialMovingAverage.*shape=\\(4, 3\\)",
        ),
        (
            lambda sd: sd.__setitem__("bias/ExponentialMovingAverage", torch.zeros(3)),
            ValueError,
            "bias/ExponentialMovingAverage.*float32",
        ),
        (
            lambda sd: sd.__setitem__("bias/ExponentialMovingAverage", [0.0, 0.0, 0.0]),
            TypeError,
            "must be a tensor",
        ),
        (
            lambda sd: sd.__setitem__(
                "moments/mean/ExponentialMovingAverage/local_step", torch.tensor(-1.0, dtype=torch.float64)
            ),
            ValueError,
            "local_step.*-1.0",
        ),
    ],
    ids=["missing", "unknown", "shape", "dtype", "not_a_tensor", "negative_local_step"],
)
def test_a_refused_load_changes_nothing(edit, exc, match):
    ema, _ = _debiasing_run(3)
    before = _snapshot(ema)
    other, _ = _debiasing_run(6)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    edit(state)
    with pytest.raises(exc, match=match):
        ema.load_state_dict(state)
    assert _unchanged(ema, before)


# ------------------------------------------------------------------------------ swapping


def test_swapped_puts_the_averages_in_and_the_trained_values_back():
    model = torch.nn.Linear(3, 2)
    ema = ExponentialMovingAverage(0.5)
    ema.apply(model.named_parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.apply(model.parameters())
    trained = [p.detach().clone() for p in model.parameters()]
    with ema.swapped():
        for p in model.parameters():
            assert torch.equal(p, ema.average(p))
        with pytest.raises(RuntimeError, match="inside swapped"):
            ema.apply(model.parameters())
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained, strict=True))
    with pytest.raises(ZeroDivisionError), ema.swapped([model.weight]):
        assert torch.equal(model.weight, ema.average(model.weight))
        assert torch.equal(model.bias, trained[1])
        _ = 1 / 0
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained, strict=True))


def test_swapping_what_is_not_averaged_is_refused_and_changes_nothing():
    model = torch.nn.Linear(3, 2)
    ema = ExponentialMovingAverage(0.5)
    ema.apply({"weight": model.weight})
    ema.apply([], tensors={"mean": torch.ones(2)})
    before = model.weight.detach().clone()
    with pytest.raises(KeyError, match="not averaged"), ema.swapped([model.weight, model.bias]):
        pass
    with (
        pytest.raises(KeyError, match="'mean' is averaged as a tensor"),
        ema.swapped([("mean", torch.ones(2))]),
    ):
        pass
    with pytest.raises(KeyError, match="no variable named 'nope'"), ema.swapped(["nope"]):
        pass
    assert torch.equal(model.weight, before)
    assert ema.average(model.bias) is None
    assert ema.average("nope") is None
    with pytest.raises(KeyError, match="not averaged here"):
        ema.average_name(model.bias)
    assert ema.average_name("bias") == "bias/ExponentialMovingAverage"


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"decay": -0.1}, ValueError, "decay value: -0.1"),
        ({"decay": 1.5}, ValueError, "decay value: 1.5"),
        ({"decay": math.nan}, ValueError, "decay value: nan"),
        ({"decay": math.inf}, ValueError, "decay value: inf"),
        ({"decay": True}, TypeError, "decay must be"),
        ({"decay": torch.ones(2)}, TypeError, "decay must be"),
        ({"decay": 0.9, "num_updates": -1}, ValueError, "num_updates value: -1"),
        ({"decay": 0.9, "num_updates": torch.tensor(-3)}, ValueError, "num_updates value: -3"),
        ({"decay": 0.9, "num_updates": 1.0}, TypeError, "num_updates must be"),
        ({"decay": 0.9, "num_updates": torch.tensor(1.0)}, TypeError, "num_updates must be"),
        ({"decay": 0.9, "zero_debias": 1}, TypeError, "zero_debias must be"),
        ({"decay": 0.9, "name": ""}, TypeError, "name must be"),
        ({"decay": 0.9, "fused": 1}, TypeError, "fused must be a bool, got int"),
        ({"decay": 0.9, "fused": True, "foreach": True}, RuntimeError, "fused=True and foreach=True"),
    ],
    ids=lambda x: repr(x)[:40],
)
def test_bad_arguments_are_refused_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ExponentialMovingAverage(**kwargs)


_A = torch.ones(2)
_X = torch.zeros(2)
_SAME_TWICE = {"x": _X, "y": _X}
_A_AS_B = {"b": _A}


@pytest.mark.parametrize(
    "var_list, tensors, exc, match",
    [
        (
            {"b": torch.zeros(2), "i": torch.zeros(2, dtype=torch.int64)},
            None,
            TypeError,
            r"var_list\['i'\].*bfloat16",
        ),
        (
            {"b": torch.zeros(2), "c": torch.zeros(2, dtype=torch.complex64)},
            None,
            TypeError,
            r"var_list\['c'\]",
        ),
        ([torch.zeros(2)], None, TypeError, r"var_list\[0\].*has no name"),
        ({"b": torch.zeros(2), "a": torch.zeros(3)}, None, ValueError, r"var_list\['a'\].*shape=\(3,\)"),
        (
            {"b": torch.zeros(2), "a": torch.zeros(2, dtype=torch.float64)},
            None,
            ValueError,
            r"var_list\['a'\].*float64",
        ),
        ({"b": torch.zeros(2)}, {"b": torch.zeros(2)}, ValueError, "both in var_list and in tensors"),
        ({"b": torch.zeros(2)}, {"m": torch.zeros(2)}, ValueError, r"tensors\['m'\].*averaged as a variable"),
        (
            {"b": torch.zeros(2), "t": torch.zeros(2)},
            None,
            ValueError,
            r"var_list\['t'\].*averaged as a tensor",
        ),
        (torch.zeros(2), None, TypeError, "var_list must be a collection"),
        ({"b": torch.zeros(2)}, [torch.zeros(2)], TypeError, "tensors must be a mapping"),
        (_SAME_TWICE, None, ValueError, r"var_list\['y'\] is the tensor averaged as 'x'"),
        (_A_AS_B, None, ValueError, r"var_list\['b'\] is the tensor averaged as 'a'"),
    ],
    ids=[
        "int",
        "complex",
        "unnamed",
        "shape",
        "dtype",
        "twice",
        "variable_as_tensor",
        "tensor_as_variable",
        "tensor",
        "list",
        "same_tensor_twice",
        "a_as_b",
    ],
)
def test_bad_input_to_apply_changes_nothing(var_list, tensors, exc, match):
    ema = ExponentialMovingAverage(0.5, zero_debias=True)
    ema.apply({"a": _A, "m": torch.ones(2)}, tensors={"t": torch.ones(2)})
    before = _snapshot(ema)
    with pytest.raises(exc, match=match):
        ema.apply(var_list, tensors=tensors)
    assert _unchanged(ema, before)
    assert set(ema.state_dict()) == set(before)


def test_repeated_applies_see_new_data_and_renamed_tensors():
    a, b = torch.ones(3), torch.ones(3)
    ema = ExponentialMovingAverage(0.5)
    ema.apply({"a": a, "b": b})
    ema.apply([a, b])
    a.data = torch.full((3,), 3.0)  # new storage, same shape: read, not a stale view
    ema.apply([a, b])
    assert torch.equal(ema.average(a), torch.full((3,), 2.0))
    a.data = torch.ones(4)
    with pytest.raises(ValueError, match=r"var_list\['a'\].*shape=\(4,\)"):
        ema.apply([a, b])
    assert torch.equal(ema.average("a"), torch.full((3,), 2.0))
    a.data = torch.ones(3)
    ema.apply([a, b])
    c = torch.full((3,), 4.0)
    ema.apply({"a": c, "b": b})  # the name now belongs to c
    assert torch.equal(ema.average(c), torch.full((3,), 2.75))
    assert ema.average(a) is None
    with pytest.raises(TypeError, match=r"var_list\[0\].*no name"):
        ema.apply([a, b])


def test_a_decay_tensor_gone_out_of_range_is_refused_at_apply():
    decay = torch.tensor(0.5)
    v = torch.ones(2)
    ema = ExponentialMovingAverage(decay)
    ema.apply({"v": v})
    v.fill_(3.0)
    decay.fill_(1.5)
    with pytest.raises(ValueError, match="decay value: 1.5"):
        ema.apply([v])
    assert torch.equal(ema.average(v), torch.ones(2))
    decay.fill_(0.5)
    ema.apply([v])
    assert torch.equal(ema.average(v), torch.full((2,), 2.0))


def test_exported_from_train():
    assert train.ExponentialMovingAverage is ExponentialMovingAverage
    assert "ExponentialMovingAverage" in train.__all__


# ------------------------------------------------------------------------------ DTensor


def _dtensor_worker(rank: int, world: int, port: int, results: Any) -> None:
    import traceback

    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        init_gloo(rank, world, port)
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        full = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(3, generator=g)}
        steps = [{n: torch.randn(t.shape, generator=g) for n, t in full.items()} for _ in range(4)]
        plain = {n: t.clone() for n, t in full.items()}
        sharded = {n: distribute_tensor(t.clone(), mesh, [Shard(0)]) for n, t in full.items()}
        ema_plain, ema_sharded = ExponentialMovingAverage(0.9), ExponentialMovingAverage(0.9)
        ema_plain.apply(plain)
        ema_sharded.apply(sharded)
        for values in steps:
            for n in full:
                plain[n].copy_(values[n])
                sharded[n].to_local().copy_(distribute_tensor(values[n], mesh, [Shard(0)]).to_local())
            ema_plain.apply(plain.values())
            ema_sharded.apply(sharded.values())
        for n in full:
            gathered = ema_sharded.average(n).full_tensor()
            assert torch.equal(gathered, ema_plain.average(n)), n
        before = {k: v.full_tensor() for k, v in ema_sharded.state_dict().items()}
        try:
            ema_sharded.load_state_dict({k: v.full_tensor() for k, v in ema_sharded.state_dict().items()})
            raise AssertionError("a plain tensor was loaded into a DTensor shadow")
        except ValueError as e:
            assert "expected placements" in str(e), e
        assert all(torch.equal(v.full_tensor(), before[k]) for k, v in ema_sharded.state_dict().items())
        with ema_sharded.swapped():
            assert torch.equal(sharded["w"].full_tensor(), ema_plain.average("w"))
        assert torch.equal(sharded["w"].full_tensor(), plain["w"])
        dist.destroy_process_group()
        results.put((rank, None))
    except Exception:
        results.put((rank, traceback.format_exc()))


def test_dtensor_shards_average_as_the_whole_tensor():
    """Two gloo ranks, Shard(0) DTensors: each rank averages its shard; gathered, the plain run's bits."""
    messages = run_ranks(
        _dtensor_worker, 2, lambda rank, port, results: (rank, 2, port, results), expected=2, deadline_s=120
    )
    assert sorted(r for r, _ in messages) == [0, 1], f"verdicts: {messages}"
    errors = [e for _, e in messages if e is not None]
    assert not errors, "\n".join(errors)


@pytest.mark.tf_live
def test_generator_reproduces_the_fixtures(run_tf_generator) -> None:
    """Rerun real TensorFlow: the committed fixtures are what the generator writes today."""
    out = run_tf_generator(GENERATOR)
    assert json.loads((out / "ema.json").read_text()) == FIXTURE
