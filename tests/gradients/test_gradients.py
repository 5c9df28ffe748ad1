"""Tests of torchgrad_compat.gradients: TF fixtures, torch.autograd.functional properties, errors.

The fixtures were written by scripts/make_tf_gradient_fixtures.py with real
TensorFlow (tf.compat.v1.gradients / hessians in graph mode). Each TF builder
there has a PyTorch twin here under the same case name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _autograd import FailingBackward
from _deadlines import scaled
from torch import Tensor

import torchgrad_compat.optim as tgo
from torchgrad_compat.gradients import (
    AggregationMethod,
    UnconnectedGradients,
    gradients,
    hessian_vector_product,
    hessians,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gradients"
GENERATOR = Path(__file__).parents[2] / "scripts" / "make_tf_gradient_fixtures.py"
GRADIENT_CASES = json.loads((FIXTURES / "tf_gradients.json").read_text())["cases"]
HESSIAN_CASES = json.loads((FIXTURES / "tf_hessians.json").read_text())["cases"]
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# TF and torch evaluate sin/tanh/matmul with different kernels; largest differences
# measured on this CPU vs the fixtures: float32 ≤ 2.4e-7 absolute, float64 ≤ 4.5e-16 absolute.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}


# ---------------------------------------------------------------------- torch twins of the TF builders
def _mlp(v: dict[str, Tensor]) -> list[Tensor]:
    hidden = torch.tanh(v["w1"] @ v["x"] + v["b1"])
    return [(v["w2"] * hidden).sum(), torch.sigmoid(v["w1"] @ v["x"])]


def _stop_doc(v: dict[str, Tensor], stop: bool) -> dict[str, Any]:
    b = 2.0 * v["a"]
    call = {"ys": v["a"] + b, "xs": [v["a"], b]}
    return call | ({"stop_gradients": [v["a"], b]} if stop else {})


def _stop_chain(v: dict[str, Tensor]) -> dict[str, Any]:
    h = v["x"] * v["x"]
    return {"ys": torch.sin(h) + h * v["x"], "xs": [v["x"], h], "stop_gradients": [h]}


def _stop_only_x(v: dict[str, Tensor]) -> dict[str, Any]:
    h = v["x"] * v["x"]
    return {"ys": torch.sin(h) + h, "xs": [h], "stop_gradients": [h]}


def _stop_blocks_all(v: dict[str, Tensor], zero: bool) -> dict[str, Any]:
    h = v["x"] * v["x"]
    call = {"ys": torch.sin(h), "xs": [v["x"]], "stop_gradients": [h]}
    return call | ({"unconnected_gradients": "zero"} if zero else {})


def _stop_split(v: dict[str, Tensor]) -> dict[str, Any]:
    a, b = torch.split(v["x"] * 1.0, [1, 2])
    y = 3.0 * a.sum() + (b * b).sum() + v["x"].sum()
    return {"ys": y, "xs": [v["x"], a, b], "stop_gradients": [a]}


def _unconnected(v: dict[str, Tensor], mode: Any) -> dict[str, Any]:
    return {"ys": v["x"] * v["x"], "xs": [v["x"], v["z"]], "unconnected_gradients": mode}


def _two_gathers(v: dict[str, Tensor]) -> dict[str, Any]:
    p = v["params"]
    y = (2.0 * F.embedding(torch.tensor([0, 0, 2]), p, sparse=True)).sum()
    y = y + F.embedding(torch.tensor([4, 0]), p, sparse=True).sum()
    return {"ys": y, "xs": [p]}


GRADIENT_BUILDERS: dict[str, Callable[[dict[str, Tensor]], dict[str, Any]]] = {
    "two_ys": lambda v: {"ys": [v["x"] * v["x"], 2.0 * v["x"]], "xs": [v["x"]]},
    "y_is_x": lambda v: {"ys": [v["x"], v["x"] * v["x"]], "xs": [v["x"]]},
    "grad_ys": lambda v: {
        "ys": [v["x"] * v["x"], torch.tanh(v["w"] @ v["x"])],
        "xs": [v["x"], v["w"]],
        "grad_ys": [v["gy0"], v["gy1"]],
    },
    "grad_ys_partial": lambda v: {
        "ys": [v["x"] * v["x"], torch.tanh(v["w"] @ v["x"])],
        "xs": [v["x"], v["w"]],
        "grad_ys": [v["gy0"], None],
    },
    "mlp": lambda v: {"ys": _mlp(v), "xs": [v["w1"], v["b1"], v["w2"], v["x"]]},
    "mlp_tree": lambda v: {
        "ys": _mlp(v),
        "xs": [v["w1"], v["b1"], v["w2"], v["x"]],
        "aggregation_method": AggregationMethod.EXPERIMENTAL_TREE,
    },
    "stop_doc": lambda v: _stop_doc(v, stop=True),
    "stop_doc_total": lambda v: _stop_doc(v, stop=False),
    "stop_chain": _stop_chain,
    "stop_blocks_all": lambda v: _stop_blocks_all(v, zero=False),
    "stop_blocks_all_zero": lambda v: _stop_blocks_all(v, zero=True),
    "stop_split": _stop_split,
    "stop_only_x": _stop_only_x,
    "stop_leaf_in_xs": lambda v: {
        "ys": (torch.sin(v["x"]) * v["x"]).sum(),
        "xs": [v["x"]],
        "stop_gradients": [v["x"]],
    },
    "unconnected_none": lambda v: _unconnected(v, "none"),
    "unconnected_zero": lambda v: _unconnected(v, "zero"),
    "unconnected_enum": lambda v: _unconnected(v, UnconnectedGradients.ZERO),
    "second_order": lambda v: {
        "ys": gradients((v["x"] ** 3 * torch.sin(v["x"])).sum(), v["x"])[0],
        "xs": [v["x"]],
    },
    "sparse_gather": lambda v: {
        "ys": (F.embedding(torch.tensor([0, 0, 2]), v["params"], sparse=True) * v["w"]).sum(),
        "xs": [v["params"]],
    },
    "sparse_two_gathers": _two_gathers,
}


def _coupled(v: dict[str, Tensor]) -> Tensor:
    return (torch.tanh(v["w"] @ v["x"]) ** 2).sum() + (v["x"] ** 3).sum()


HESSIAN_BUILDERS: dict[str, Callable[[dict[str, Tensor]], dict[str, Any]]] = {
    "hess_vector": lambda v: {
        "ys": (v["x"] ** 3 * torch.sin(v["x"])).sum() + v["x"] @ (v["a"] @ v["x"]),
        "xs": [v["x"]],
    },
    "hess_multi_xs": lambda v: {"ys": _coupled(v), "xs": [v["x"], v["w"]]},
    "hess_multi_ys": lambda v: {
        "ys": [torch.tanh(v["w"] @ v["x"]).sum(), v["x"] * v["x"] * v["x"]],
        "xs": [v["x"], v["w"]],
    },
    "hess_scalar_x": lambda v: {"ys": v["x"] ** 4, "xs": [v["x"]]},
    "hess_linear": lambda v: {"ys": (3.0 * v["x"]).sum(), "xs": [v["x"]]},
}


def _inputs(case: dict[str, Any]) -> dict[str, Tensor]:
    dtype = DTYPES[case["dtype"]]
    return {
        k: torch.tensor(a["data"], dtype=dtype).reshape(a["shape"]).requires_grad_(not k.startswith("gy"))
        for k, a in case["inputs"].items()
    }


def _options(call: dict[str, Any]) -> dict[str, Any]:
    """The options the fixture recorded, for checking that a twin matches its TF builder."""
    options = {}
    if "aggregation_method" in call:
        options["aggregation_method"] = call["aggregation_method"]
    if "unconnected_gradients" in call:
        mode = call["unconnected_gradients"]
        options["unconnected_gradients"] = mode.value if isinstance(mode, UnconnectedGradients) else mode
    return options


def _expected_dense(entry: dict[str, Any], dtype: torch.dtype) -> Tensor:
    if "indices" in entry:
        dense = torch.zeros(entry["dense_shape"], dtype=dtype)
        values = torch.tensor(entry["values"]["data"], dtype=dtype).reshape(entry["values"]["shape"])
        return dense.index_add_(0, torch.tensor(entry["indices"]), values)
    return torch.tensor(entry["data"], dtype=dtype).reshape(entry["shape"])


def _assert_matches_tf(got: list[Tensor | None], expected: list[Any], dtype: torch.dtype) -> None:
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if e is None:
            assert g is None, f"entry {i}: TF gives None, got {g}"
            continue
        assert g is not None, f"entry {i}: TF gives a value, got None"
        assert g.dtype == dtype
        if "indices" in e:
            # TF gives IndexedSlices; ours is an uncoalesced sparse COO tensor with the same rows.
            assert g.is_sparse and list(g.shape) == e["dense_shape"]
            assert sorted(g._indices()[0].tolist()) == sorted(e["indices"])
            g = g.to_dense()
        torch.testing.assert_close(g.detach(), _expected_dense(e, dtype), **TOLERANCE[dtype])


def test_every_tensorflow_case_has_a_torch_twin() -> None:
    assert {c.rsplit("-", 1)[0] for c in GRADIENT_CASES} == set(GRADIENT_BUILDERS)
    assert {c.rsplit("-", 1)[0] for c in HESSIAN_CASES} == set(HESSIAN_BUILDERS)
    assert {c["dtype"] for c in [*GRADIENT_CASES.values(), *HESSIAN_CASES.values()]} == set(DTYPES)


@pytest.mark.parametrize("case_id", sorted(GRADIENT_CASES))
def test_gradients_match_tensorflow(case_id: str) -> None:
    case = GRADIENT_CASES[case_id]
    call = GRADIENT_BUILDERS[case_id.rsplit("-", 1)[0]](_inputs(case))
    assert _options(call) == case["options"]
    _assert_matches_tf(gradients(**call), case["expected"], DTYPES[case["dtype"]])


def test_sparse_gather_keeps_tensorflow_indices_and_values() -> None:
    case = GRADIENT_CASES["sparse_gather-float64"]
    (g,) = gradients(**GRADIENT_BUILDERS["sparse_gather"](_inputs(case)))
    expected = case["expected"][0]
    assert g.layout == torch.sparse_coo and not g.is_coalesced()
    assert g._indices()[0].tolist() == expected["indices"] == [0, 0, 2]
    values = torch.tensor(expected["values"]["data"], dtype=torch.float64).reshape(
        expected["values"]["shape"]
    )
    torch.testing.assert_close(g._values(), values, rtol=1e-12, atol=0)


@pytest.mark.parametrize("case_id", sorted(HESSIAN_CASES))
def test_hessians_match_tensorflow(case_id: str) -> None:
    case = HESSIAN_CASES[case_id]
    call = HESSIAN_BUILDERS[case_id.rsplit("-", 1)[0]](_inputs(case))
    got = hessians(**call)
    if "error" in case:
        # TF raises "None values not supported" for a linear ys; the Hessian is zeros.
        assert case["error"]["type"] == "ValueError"
        assert [h.shape for h in got] == [x.shape + x.shape for x in call["xs"]]
        assert all(not h.any() for h in got)
        return
    _assert_matches_tf(got, case["expected"], DTYPES[case["dtype"]])


# ---------------------------------------------------------------- properties vs torch.autograd.functional
def _f_vector(x: Tensor) -> Tensor:
    return torch.stack([(x**3).sum() * torch.sin(x).sum(), torch.tanh(x).prod(), (x.exp() * x).sum()])


def _f_matrix(x: Tensor) -> Tensor:
    return torch.tanh(x @ x.T) * x.sum()


def _f_scalar(x: Tensor) -> Tensor:
    return torch.sin(x) * x**3


FUNCTIONS = {
    "vector": (_f_vector, (6,)),
    "matrix": (_f_matrix, (2, 3)),
    "scalar_x": (_f_scalar, ()),
}


def _leaf(shape: tuple[int, ...], seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5).requires_grad_()


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_gradients_equal_vjp(name: str) -> None:
    f, shape = FUNCTIONS[name]
    x = _leaf(shape, 0)
    y = f(x)
    w = torch.rand(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, (vjp,) = torch.autograd.functional.vjp(f, (x,), w)
    torch.testing.assert_close(gradients(y, x, grad_ys=w)[0], vjp, rtol=1e-12, atol=1e-14)
    # default grad_ys: ones, i.e. the gradient of sum(y)
    _, (vjp_ones,) = torch.autograd.functional.vjp(f, (x,), torch.ones_like(y))
    torch.testing.assert_close(gradients(y, x)[0], vjp_ones, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_hessians_equal_functional_hessian(name: str, chunk_size: int | None) -> None:
    f, shape = FUNCTIONS[name]
    x = _leaf(shape, 2)
    (h,) = hessians(f(x), x, chunk_size=chunk_size)
    expected = torch.autograd.functional.hessian(lambda t: f(t).sum(), x)
    assert h.shape == x.shape + x.shape
    torch.testing.assert_close(h, expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 4, 100])
def test_hessians_without_a_graph_match_in_chunks(chunk_size: int | None) -> None:
    f, shape = FUNCTIONS[sorted(FUNCTIONS)[0]]
    x = _leaf(shape, 2)
    (h,) = hessians(f(x), x, chunk_size=chunk_size, create_graph=False)
    expected = torch.autograd.functional.hessian(lambda t: f(t).sum(), x)
    assert not h.requires_grad
    torch.testing.assert_close(h, expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
@pytest.mark.parametrize("create_graph", [True, False])
def test_hessians_of_an_empty_x_are_empty_as_in_tf(chunk_size: int | None, create_graph: bool) -> None:
    """TF's ``tf.hessians`` of an x of shape (2, 0) gives a (2, 0, 2, 0) tensor (checked in TF 2.21)."""
    x = torch.zeros(2, 0, dtype=torch.float64, requires_grad=True)
    (h,) = hessians((x * x).sum(), x, chunk_size=chunk_size, create_graph=create_graph)
    assert h.shape == (2, 0, 2, 0) and h.dtype == torch.float64


_PEAK_RSS = """
import resource, sys, torch
from torchgrad_compat import hessians
n, chunk = int(sys.argv[1]), int(sys.argv[2])
x = torch.randn(n, requires_grad=True)
y = torch.tanh(torch.randn(16, n) @ x).sum() + (x**3).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
hessians(y, x, chunk_size=chunk, create_graph=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux")
@pytest.mark.parametrize("chunk_size", [1, 64])
def test_hessians_chunk_size_bounds_memory_beyond_the_result(chunk_size: int) -> None:
    # A fresh process, so the peak RSS belongs to this call. The n x n identity and the stacked
    # rows each cost another n x n buffer; without them the growth is the result plus the chunks.
    n = 3000
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(n), str(chunk_size)],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    result_bytes = n * n * 4
    growth = int(out.stdout.split()[-1])
    assert growth < 1.5 * result_bytes, (
        f"peak RSS grew {growth / 2**20:.0f} MiB for a {result_bytes / 2**20:.0f} MiB Hessian"
    )


def test_hessians_run_one_vectorized_backward_pass_per_x(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    grad = torch.autograd.grad

    def counting_grad(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("grad_outputs"))
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    x = _leaf((16,), 16)
    hessians((x**3).sum(), x)
    assert len(calls) == 2  # the first derivative, then all 16 rows in one vmapped pass
    calls.clear()
    hessians((x**3).sum(), x, chunk_size=1)
    assert len(calls) == 17  # TF's algorithm: one pass per row


def test_xs_may_be_any_iterable_of_tensors() -> None:
    layer = torch.nn.Linear(3, 2)
    loss = layer(torch.ones(4, 3)).pow(2).sum()
    expected = torch.autograd.grad(loss, list(layer.parameters()), retain_graph=True)
    for g, e in zip(gradients(loss, layer.parameters()), expected, strict=True):
        torch.testing.assert_close(g, e)


def test_sparse_embedding_gradient_is_sparse_coo() -> None:
    emb = torch.nn.Embedding(6, 3, sparse=True)
    dense = torch.nn.Embedding(6, 3)
    dense.weight.data.copy_(emb.weight.data)
    idx = torch.tensor([[1, 4], [1, 0]])
    (g,) = gradients((emb(idx) ** 2).sum(), emb.weight)
    (expected,) = gradients((dense(idx) ** 2).sum(), dense.weight)
    assert g.layout == torch.sparse_coo and sorted(g._indices()[0].tolist()) == [0, 1, 1, 4]
    torch.testing.assert_close(g.to_dense(), expected)


def test_hessians_per_x_blocks_and_hvp_over_all_xs() -> None:
    a, b = _leaf((3,), 3), _leaf((2, 2), 4)

    def f(a: Tensor, b: Tensor) -> Tensor:
        return (torch.tanh(b @ a[:2]) * a.sum()).sum() + (a**4).sum()

    (haa, hab), (_, hbb) = torch.autograd.functional.hessian(f, (a, b))
    ha, hb = hessians(f(a, b), [a, b])
    torch.testing.assert_close(ha, haa, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(hb, hbb, rtol=1e-12, atol=1e-13)
    va, vb = _leaf((3,), 5).detach(), _leaf((2, 2), 6).detach()
    _, expected = torch.autograd.functional.hvp(f, (a, b), (va, vb))
    got = hessian_vector_product(f(a, b), [a, b], [va, vb])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-13)
    # the cross blocks contribute to H v but are not in hessians()
    assert hab.abs().max() > 1e-3


def test_results_can_be_differentiated_again() -> None:
    x = _leaf((4,), 7)
    y = (x**4).sum()
    (g,) = gradients(y, x)
    (gg,) = gradients(g, x)
    (h,) = hessians(y, x)
    (hh,) = gradients(h.sum(), x)
    torch.testing.assert_close(gg, 12 * x**2)
    torch.testing.assert_close(h, torch.diag(12 * x**2))
    torch.testing.assert_close(hh, 24 * x)
    (hv,) = hessian_vector_product(y, x, torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(gradients(hv.sum(), x)[0], 24 * x)


def test_create_graph_false_and_no_grad_give_plain_tensors() -> None:
    x = _leaf((3,), 8)
    y = (x**3).sum()
    assert not gradients(y, x, create_graph=False)[0].requires_grad
    with torch.no_grad():
        assert not gradients(y, x)[0].requires_grad
        assert not hessians(y, x)[0].requires_grad
        assert not hessian_vector_product(y, x, torch.ones(3))[0].requires_grad
        torch.testing.assert_close(hessians(y, x)[0], torch.diag(6 * x))
    assert hessians(y, x)[0].requires_grad


def test_graph_is_kept_and_grad_is_not_accumulated() -> None:
    x = _leaf((3,), 9)
    y = torch.sin(x).sum()
    first = gradients(y, x, create_graph=False)[0]
    second = gradients(y, x, create_graph=False)[0]
    torch.testing.assert_close(first, second)
    assert x.grad is None
    gradients(y, x, create_graph=False, retain_graph=False)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        gradients(y, x, create_graph=False)


def test_constant_ys_and_unconnected_hessians() -> None:
    x, z = _leaf((2,), 10), _leaf((3,), 11)
    constant = torch.ones(2)
    assert gradients(constant, x) == [None]
    assert gradients([constant, x.sum()], [z, x], unconnected_gradients="zero")[0].equal(torch.zeros(3))
    # sum(ys) does not depend on z: None, as gradients gives; linear in x: zeros.
    hx, hz = hessians((2 * x).sum(), [x, z])
    assert hz is None and hx.equal(torch.zeros(2, 2, dtype=torch.float64))
    hvx, hvz = hessian_vector_product((2 * x).sum(), [x, z], [torch.ones(2), torch.ones(3)])
    assert hvz is None and hvx.equal(torch.zeros(2, dtype=torch.float64))


def test_stop_gradients_hooks_are_removed() -> None:
    x = _leaf((3,), 12)
    h = x * x
    y = torch.sin(h).sum()
    assert gradients(y, x, stop_gradients=[h]) == [None]
    torch.testing.assert_close(gradients(y, x)[0], torch.cos(h) * 2 * x)


def test_stop_gradients_hooks_are_removed_after_an_error() -> None:
    x = _leaf((3,), 13)
    h = x * x
    y = FailingBackward.apply(h).sum()
    with pytest.raises(RuntimeError, match="backward failed on purpose"):
        gradients(y, x, stop_gradients=[h])
    torch.testing.assert_close(gradients(h.sum(), x)[0], 2 * x)


class _CubeWithHostSync(torch.autograd.Function):
    """x**3 whose backward reads a value on the host (.item()), which vmap cannot batch."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        ctx.save_for_backward(t)
        return t**3

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (t,) = ctx.saved_tensors
        scale = 3.0 if g.abs().max().item() >= 0 else 0.0
        return g * scale * t * t


def test_hessians_unbatchable_backward_suggests_chunk_size_one() -> None:
    x = _leaf((3,), 14)
    y = (_CubeWithHostSync.apply(x) * x).sum()
    with pytest.raises(RuntimeError, match="pass chunk_size=1"):
        hessians(y, x)
    (h,) = hessians(y, x, chunk_size=1)
    torch.testing.assert_close(h, torch.diag(12 * x**2))


def test_aggregation_and_unconnected_constants() -> None:
    assert (AggregationMethod.ADD_N, AggregationMethod.DEFAULT) == (0, 0)
    assert (AggregationMethod.EXPERIMENTAL_TREE, AggregationMethod.EXPERIMENTAL_ACCUMULATE_N) == (1, 2)
    assert UnconnectedGradients("zero") is UnconnectedGradients.ZERO
    assert UnconnectedGradients.NONE == "none"


# ---------------------------------------------------------------------- errors
def _errors() -> list[tuple[str, Callable[[], Any], type[Exception], str]]:
    x = _leaf((3,), 15)
    y = (x * x).sum()
    vec = x * 2
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sparse_y = emb(torch.tensor([1, 1])).pow(2).sum()
    return [
        (
            "x_without_grad",
            lambda: gradients(y, [x, torch.ones(3)]),
            ValueError,
            r"xs\[1\] does not require grad",
        ),
        ("x_not_tensor", lambda: gradients(y, [x, 1.0]), TypeError, r"xs\[1\] must be a torch.Tensor"),
        ("y_not_tensor", lambda: gradients([y, "y"], x), TypeError, r"ys\[1\] must be a torch.Tensor"),
        ("stop_not_tensor", lambda: gradients(y, x, stop_gradients=[3]), TypeError, r"stop_gradients\[0\]"),
        (
            "grad_ys_count",
            lambda: gradients(y, x, grad_ys=[None, None]),
            ValueError,
            "Passed 2 grad_ys for 1 ys",
        ),
        (
            "grad_ys_shape",
            lambda: gradients(vec, x, grad_ys=torch.ones(2)),
            ValueError,
            r"grad_ys\[0\] has shape \(2,\)",
        ),
        (
            "grad_ys_bool",
            lambda: gradients(vec, x, grad_ys=torch.ones(3, dtype=torch.bool)),
            TypeError,
            r"grad_ys\[0\]",
        ),
        ("grad_ys_object", lambda: gradients(vec, x, grad_ys=[object()]), TypeError, r"grad_ys\[0\] must be"),
        (
            "complex_y_without_grad_ys",
            lambda: gradients(x.to(torch.complex128), x),
            TypeError,
            "complex tensors must set grad_ys",
        ),
        (
            "aggregation_unknown",
            lambda: gradients(y, x, aggregation_method=7),
            ValueError,
            "aggregation_method specified 7",
        ),
        (
            "aggregation_bool",
            lambda: gradients(y, x, aggregation_method=True),
            ValueError,
            "aggregation_method",
        ),
        (
            "unconnected_unknown",
            lambda: gradients(y, x, unconnected_gradients="NONE"),
            ValueError,
            "unconnected_gradients: 'NONE'",
        ),
        ("gate_not_bool", lambda: gradients(y, x, gate_gradients="yes"), TypeError, "gate_gradients"),
        ("colocate_not_bool", lambda: gradients(y, x, colocate_gradients_with_ops=1), TypeError, "colocate"),
        ("name_not_str", lambda: gradients(y, x, name=3), TypeError, "name must be a str"),
        ("create_graph_not_bool", lambda: gradients(y, x, create_graph=1), TypeError, "create_graph"),
        ("chunk_size_zero", lambda: hessians(y, x, chunk_size=0), ValueError, "Invalid chunk_size value: 0"),
        (
            "chunk_size_str",
            lambda: hessians(y, x, chunk_size="4"),
            TypeError,
            "chunk_size must be None or an int",
        ),
        (
            "hessian_sparse",
            lambda: hessians(sparse_y, emb.weight),
            ValueError,
            r"xs\[0\] is torch.sparse_coo",
        ),
        ("hvp_count", lambda: hessian_vector_product(y, x, [x, x]), ValueError, "same length"),
        (
            "hvp_shape",
            lambda: hessian_vector_product(y, x, torch.ones(2)),
            ValueError,
            r"v\[0\] must have the shape",
        ),
        (
            # Cast to x's dtype, its imaginary part would be dropped with a warning only.
            "hvp_complex_v",
            lambda: hessian_vector_product(y, x, torch.ones(x.shape, dtype=torch.complex64)),
            TypeError,
            r"v\[0\] must be real or integer as xs\[0\] \(torch.float64\), got torch.complex64",
        ),
        (
            "hvp_bool_v",
            lambda: hessian_vector_product(y, x, torch.ones(x.shape, dtype=torch.bool)),
            TypeError,
            r"v\[0\] must be real or integer",
        ),
    ]


@pytest.mark.parametrize("label", [e[0] for e in _errors()])
def test_bad_input_raises_naming_the_argument(label: str) -> None:
    _, fn, error, message = next(e for e in _errors() if e[0] == label)
    with pytest.raises(error, match=message):
        fn()


# ---------------------------------------------------------------------- the fixtures are reproducible
def _assert_same_fixture(fresh: Any, committed: Any, rtol: float) -> None:
    """Equal structure, None pattern, inputs and errors; numbers equal up to TF's kernel rounding."""
    if isinstance(committed, dict):
        assert isinstance(fresh, dict) and fresh.keys() == committed.keys()
        for key in committed:
            _assert_same_fixture(fresh[key], committed[key], rtol)
    elif isinstance(committed, list) and committed and isinstance(committed[0], float):
        torch.testing.assert_close(torch.tensor(fresh), torch.tensor(committed), rtol=rtol, atol=rtol)
    elif isinstance(committed, list):
        assert len(fresh) == len(committed)
        for a, b in zip(fresh, committed, strict=True):
            _assert_same_fixture(a, b, rtol)
    else:
        assert fresh == committed


@pytest.mark.tf_live
def test_generator_reproduces_the_fixtures(run_tf_generator) -> None:
    """Rerun real TensorFlow: the committed fixtures are what the generator writes today."""
    tmp_path = run_tf_generator(GENERATOR)
    for name in ("tf_gradients.json", "tf_hessians.json"):
        fresh = json.loads((tmp_path / name).read_text())
        committed = json.loads((FIXTURES / name).read_text())
        assert fresh["function"] == committed["function"]
        for case_id, case in committed["cases"].items():
            _assert_same_fixture(
                fresh["cases"][case_id], case, rtol=1e-6 if case["dtype"] == "float32" else 1e-12
            )
        assert fresh["cases"].keys() == committed["cases"].keys()


def test_compute_gradients_defaults_to_the_parameters_that_require_grad() -> None:
    """TF's default var_list is the trainable variables: a frozen parameter is left out, as
    backward(); step() leaves it, also through a wrapper."""
    from torchgrad_compat.amp import LossScaleOptimizer

    w, frozen = (
        torch.nn.Parameter(torch.tensor([1.0, 2.0])),
        torch.nn.Parameter(torch.ones(1), requires_grad=False),
    )
    for opt in (
        tgo.GradientDescentOptimizer([w, frozen], 0.1),
        LossScaleOptimizer(tgo.GradientDescentOptimizer([w, frozen], 0.1)),
    ):
        pairs = opt.compute_gradients(lambda: (3 * w * w).sum() * frozen.sum())
        assert [v for _, v in pairs] == [w] and torch.equal(pairs[0][0], torch.tensor([6.0, 12.0]))
    tgo.GradientDescentOptimizer([w, frozen], 0.1).minimize(lambda: (w * w).sum())
    assert torch.equal(w.detach(), torch.tensor([0.8, 1.6])) and torch.equal(frozen.detach(), torch.ones(1))


def test_compute_gradients_refuses_what_tf_refuses() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, -3.0]))
    opt = tgo.GradientDescentOptimizer([w], 0.1)
    for grad_loss in (torch.tensor([2, 3]), torch.tensor([2.0, 3.0], dtype=torch.float64)):
        with pytest.raises(
            TypeError,
            match=f"grad_loss has dtype {grad_loss.dtype}; it must have the loss's dtype torch.float32",
        ):
            opt.compute_gradients(w * w, grad_loss=grad_loss)
    c = torch.tensor([1.0 + 2.0j], requires_grad=True)
    with pytest.raises(ValueError, match=r"var_list\[0\] has dtype torch.complex64"):
        opt.compute_gradients((c.abs() ** 2).sum(), var_list=[c])
    z = torch.tensor([1.0 + 1.0j, 2.0 - 1.0j], dtype=torch.complex128, requires_grad=True)
    with pytest.raises(
        TypeError, match=r"grad_ys\[0\] holds real numbers; ys\[0\] has dtype torch.complex128"
    ):
        gradients(z * z, z, grad_ys=[[1.0, 2.0]])
    (g,) = gradients(z * z, z, grad_ys=[[1.0 + 0j, 2.0]])
    assert g is not None


@pytest.mark.parametrize("what", ["hessians", "hessian_vector_product"])
def test_second_derivatives_of_a_complex_x_are_refused_as_by_tf(what: str) -> None:
    """TF differentiates the first derivative without grad_ys: for a complex x it is complex, and
    TF raises ("Gradients of complex tensors must set grad_ys")."""
    z = torch.tensor([1.0 + 2.0j, 0.5 - 1.0j], requires_grad=True)
    y = (z * z.conj()).real.sum()
    with pytest.raises(TypeError, match=r"xs\[0\] is complex"):
        if what == "hessians":
            hessians(y, z)
        else:
            hessian_vector_product(y, z, torch.ones(2, dtype=torch.complex64))


@pytest.mark.parametrize("grad_ys", [[True], [[True, False]]])
def test_boolean_grad_ys_are_refused_as_a_bool_tensor_is(grad_ys):
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match=r"grad_ys\[0\] has dtype torch.bool"):
        gradients([x * 2], [x], grad_ys=grad_ys)


def test_grad_ys_ints_beyond_int64_are_taken_as_numbers():
    x = torch.ones(2, requires_grad=True)
    (g,) = gradients([x * 2], [x], grad_ys=[[2**70, 1]])
    assert torch.equal(g, torch.tensor([2.0**71, 2.0]))
