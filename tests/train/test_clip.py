"""torchgrad_compat.train's clipping against TensorFlow's: fixture bits, NaN rule, sparse, None, in place."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchgrad_compat import amp, optim, train
from torchgrad_compat.train import _eigen_sum

FIXTURES = Path(__file__).parents[1] / "fixtures" / "train"
GENERATOR = Path(__file__).parents[2] / "scripts" / "make_tf_clip_fixtures.py"
FIXTURE = json.loads((FIXTURES / "clip.json").read_text())
CASES = FIXTURE["cases"]
with np.load(FIXTURES / "clip.npz") as _npz:
    ARRAYS = {key: _npz[key] for key in _npz.files}

# Sums over some axes (not all) run in torch's order, not Eigen's: their last bits may differ.
PARTIAL_REDUCTION = {"by_norm_axes1", "by_norm_axes02"}
ULPS = 2


def hashed(size: int, seed: int, dtype: str) -> np.ndarray:
    """The generator's long inputs, made from integers (scripts/make_tf_clip_fixtures.py)."""
    i = np.arange(size, dtype=np.uint64) + np.uint64(seed) * np.uint64(1_000_003)
    h = (i * np.uint64(2654435761)) % np.uint64(2**32)
    return (h.astype(np.float64) / 2**32 * 6 - 3).astype(dtype)


def _entry(case: dict[str, Any], name: str | None) -> torch.Tensor | None:
    if name is None:
        return None
    if name.startswith("hashed:"):
        _, size, seed = name.split(":")
        return torch.from_numpy(hashed(int(size), int(seed), case["dtype"]))
    key = f"{case['id']}/{name}"
    if name in case["sparse"]:
        indices = torch.from_numpy(ARRAYS[f"{key}/indices"])[None]
        shape = tuple(int(s) for s in ARRAYS[f"{key}/dense_shape"])
        return torch.sparse_coo_tensor(indices, torch.from_numpy(ARRAYS[f"{key}/values"]), shape)
    return torch.from_numpy(ARRAYS[key])


def _run(case: dict[str, Any]) -> list[torch.Tensor | None]:
    inputs = [_entry(case, name) for name in case["inputs"]]
    kwargs = case["kwargs"]
    function = case["function"]
    if function == "clip_by_global_norm":
        clipped, norm = train.clip_by_global_norm(inputs, **kwargs)
        return [*clipped, norm]
    if function == "global_norm":
        return [train.global_norm(inputs)]
    if function == "l2_loss":
        return [train.sum_of_squares(t) * 0.5 for t in inputs]
    return [getattr(train, function)(inputs[0], **kwargs)]


def _dense(t: torch.Tensor) -> np.ndarray:
    return (t._values() if t.layout == torch.sparse_coo else t).numpy()


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in units in the last place (0 for equal bits or two NaNs)."""
    itype = np.int32 if got.dtype == np.float32 else np.int64
    g, w = got.view(itype).astype(np.int64), want.view(itype).astype(np.int64)
    distance = np.abs(g - w)
    return np.where(np.isnan(got) & np.isnan(want), 0, distance)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_tensorflows_numbers(case):
    outputs = _run(case)
    assert len(outputs) == len(case["outputs"])
    bound = ULPS if case["id"].rsplit("_", 1)[0] in PARTIAL_REDUCTION else 0
    for got, name in zip(outputs, case["outputs"], strict=True):
        if name is None:
            assert got is None
            continue
        want = _entry(case, name)
        assert got.layout == want.layout and got.dtype == want.dtype
        if got.layout == torch.sparse_coo:
            assert torch.equal(got._indices(), want._indices())
        distance = _ulps(_dense(got), _dense(want))
        assert distance.max(initial=0) <= bound, (
            f"{name}: {int((distance > 0).sum())} differ, up to {distance.max()} ulps"
        )
        if not bound:  # the sign of a zero too; a NaN's sign bit is the CPU's, not part of the rule
            numbers = ~np.isnan(_dense(want))
            assert np.array_equal(np.signbit(_dense(got))[numbers], np.signbit(_dense(want))[numbers])


def test_the_fixtures_cover_the_rules():
    ids = {c["id"].rsplit("_", 1)[0] for c in CASES}
    assert {
        "global_zeros",
        "global_inf",
        "global_nan",
        "global_none_sparse",
        "by_norm_zeros",
        "by_norm_nan",
    } <= ids
    assert {c["dtype"] for c in CASES} == {"float32", "float64"}


def test_a_non_finite_norm_turns_every_gradient_into_nan_and_a_loss_scale_skips():
    w = torch.ones(3, requires_grad=True)
    v = torch.ones(2, requires_grad=True)
    opt = amp.LossScaleOptimizer(
        optim.GradientDescentOptimizer([w, v], learning_rate=0.1), loss_scale="dynamic"
    )
    scale = opt.loss_scale().item()
    w.grad = torch.tensor([1.0, math.inf, 2.0])
    v.grad = torch.tensor([3.0, 4.0])
    norm = train.clip_by_global_norm_([w, v], clip_norm=1.0)
    assert norm.item() == math.inf
    assert torch.isnan(w.grad).all() and torch.isnan(v.grad).all()
    opt.apply_gradients([(w.grad, w), (v.grad, v)])  # unscaled gradients: skipped, the scale lowered
    assert torch.equal(w.detach(), torch.ones(3)) and torch.equal(v.detach(), torch.ones(2))
    assert opt.loss_scale().item() == scale / 2


def test_in_place_is_the_pure_function_on_p_grad():
    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(s, requires_grad=True) for s in ((4, 3), (5,), (2,))]
    grads = [torch.randn(p.shape, generator=gen) * 3 for p in params]
    params[2].grad = None
    for p, g in zip(params[:2], grads, strict=False):
        p.grad = g.clone()
    pure, pure_norm = train.clip_by_global_norm([*grads[:2], None], 1.5)
    norm = train.clip_by_global_norm_(params, 1.5)
    assert torch.equal(norm, pure_norm)
    assert torch.equal(params[0].grad, pure[0]) and torch.equal(params[1].grad, pure[1])
    assert params[2].grad is None and pure[2] is None


def test_in_place_scales_a_sparse_gradient_from_an_embedding():
    emb = torch.nn.Embedding(6, 3, sparse=True)
    emb(torch.tensor([2, 0, 2, 5])).square().sum().backward()
    grad = emb.weight.grad
    assert not grad.is_coalesced()
    rows = grad._values().clone()
    summed_rows = grad.coalesce().values()
    (expected,), expected_norm = train.clip_by_global_norm([grad], 0.5)
    norm = train.clip_by_global_norm_(emb.parameters(), 0.5)
    assert torch.equal(norm, expected_norm)
    assert torch.equal(emb.weight.grad._values(), expected._values())
    assert torch.equal(emb.weight.grad._indices(), expected._indices())
    # The rows as given: index 2's two rows count apart, not summed first (as TF's IndexedSlices).
    assert norm.item() == pytest.approx(torch.linalg.vector_norm(rows).item(), rel=1e-6)
    assert norm.item() != pytest.approx(torch.linalg.vector_norm(summed_rows).item(), rel=1e-3)


def test_the_global_norm_is_differentiable():
    x = torch.randn(9000, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    train.global_norm([x, None]).backward()
    torch.testing.assert_close(x.grad, x.detach() / torch.linalg.vector_norm(x.detach()))


def test_all_zero_gradients_stay_zero():
    grads = [torch.zeros(3), torch.zeros(2, 2)]
    clipped, norm = train.clip_by_global_norm(grads, 1.0)
    assert norm.item() == 0.0 and all(torch.equal(c, g) for c, g in zip(clipped, grads, strict=True))


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (
            lambda: train.clip_by_global_norm([torch.ones(2)], -1.0),
            ValueError,
            "Invalid clip_norm value: -1.0",
        ),
        (
            lambda: train.clip_by_global_norm([torch.ones(2)], math.nan),
            ValueError,
            "Invalid clip_norm value: nan",
        ),
        (
            lambda: train.clip_by_global_norm([torch.ones(2)], math.inf),
            ValueError,
            "Invalid clip_norm value: inf",
        ),
        (lambda: train.clip_by_norm(torch.ones(2), -0.5), ValueError, "Invalid clip_norm value: -0.5"),
        (
            lambda: train.clip_by_norm(torch.ones(2), torch.tensor(-2.0)),
            ValueError,
            r"Invalid clip_norm value: -2.0",
        ),
        (lambda: train.clip_by_global_norm(torch.ones(2), 1.0), TypeError, "t_list must be a sequence"),
        (lambda: train.clip_by_global_norm([None, None], 1.0), ValueError, "holds no tensor"),
        (
            lambda: train.global_norm([torch.ones(2), "x"]),
            TypeError,
            r"t_list\[1\] must be a floating tensor",
        ),
        (
            lambda: train.global_norm([torch.ones(2), torch.ones(2, dtype=torch.float64)]),
            TypeError,
            "one dtype",
        ),
        (
            lambda: train.clip_by_value(torch.ones(2), 1.0, -1.0),
            ValueError,
            "Invalid clip_value_min value: 1.0",
        ),
        (
            lambda: train.clip_by_value(torch.ones(2), math.nan, 1.0),
            ValueError,
            "Invalid clip_value_min value: nan",
        ),
        (
            lambda: train.clip_by_global_norm_([torch.ones(2, requires_grad=True)], 1.0),
            ValueError,
            "no parameter",
        ),
        (
            lambda: train.clip_by_global_norm_([torch.ones(2, requires_grad=True)], -1.0),
            ValueError,
            "clip_norm",
        ),
    ],
)
def test_bad_input_is_refused_by_name(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_a_refused_in_place_clip_changes_no_gradient():
    w = torch.ones(2, requires_grad=True)
    w.grad = torch.tensor([3.0, 4.0])
    with pytest.raises(ValueError):
        train.clip_by_global_norm_([w], math.nan)
    assert torch.equal(w.grad, torch.tensor([3.0, 4.0]))


@pytest.mark.tf_live
def test_generator_reproduces_the_fixtures(run_tf_generator) -> None:
    """Rerun real TensorFlow: the committed fixtures are what the generator writes today."""
    out = run_tf_generator(GENERATOR)
    assert json.loads((out / "clip.json").read_text())["cases"] == CASES
    with np.load(out / "clip.npz") as fresh:
        assert sorted(fresh.files) == sorted(ARRAYS)
        for key, value in ARRAYS.items():
            np.testing.assert_array_equal(fresh[key], value, err_msg=key)


def eigen_order_sum(x: np.ndarray, lanes: int) -> np.floating:
    """Eigen's full sum of the 1-d ``x``, written out (numpy adds in ``x``'s dtype; ``accumulate``
    adds the rows one after another): the specification the batched sums are checked against."""

    def summed(first: int, count: int) -> np.floating:
        if count > lanes * 1024:  # halves split at a packet boundary, summed apart, then added
            split = lanes * -(-(first + -(-count // 2)) // lanes)
            left = min(split - first, count)
            total = x.dtype.type(0) + summed(first, left)
            return total + summed(split, count - left) if left < count else total
        leaf, block = x[first : first + count], 4 * lanes
        blocks = count // block
        packet = np.zeros(lanes, x.dtype)
        if blocks:  # four packet accumulators, each lane adding the blocks in turn, then folded
            a = np.add.accumulate(leaf[: blocks * block].reshape(blocks, block), axis=0)[-1]
            packet = ((a[:lanes] + a[lanes : 2 * lanes]) + a[2 * lanes : 3 * lanes]) + a[3 * lanes :]
        vectorized = count // lanes * lanes
        for j in range(blocks * block, vectorized, lanes):
            packet = packet + leaf[j : j + lanes]
        tail = x.dtype.type(0)
        for j in range(vectorized, count):
            tail = tail + leaf[j]
        while len(packet) > 1:
            packet = packet[: len(packet) // 2] + packet[len(packet) // 2 :]
        return tail + packet[0]

    return summed(0, len(x))


SIZES = [
    [7, 31, 32, 100, 1000, 4095, 4097, 8191, 8192, 8193, 10000, 100003, 0, 1],
    [10000] * 30,
    [33] * 40 + [70000] * 3 + [5],
    [3_000_000],  # more than one piece of work
    # Tensors longer than a CPU piece, cut into parts between leaves, among short ones and empty ones.
    [1, 7, 8, 31, 32, 33, 8191, 8192, 8193, 65537, 0, 1_000_003, 0, 300_001, 5],
]


@pytest.mark.parametrize("path", ["cpu", "block_major", "block_major_row_by_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{len(s)}_tensors")
def test_batched_sums_add_in_eigens_order(sizes, dtype, path, monkeypatch):
    """Every path gives Eigen's bits: the CPU's (numpy over the tensors as they lie), and the
    block-major one (a GPU's) with numpy's reduction or one addition per row, as on a GPU."""
    if path != "cpu":
        monkeypatch.setattr(_eigen_sum, "_cpu_sums", _eigen_sum._block_major_sums)
    if path == "block_major_row_by_row":
        monkeypatch.setattr(_eigen_sum, "_sum_rows", _eigen_sum._sum_rows_one_by_one)
    gen = torch.Generator().manual_seed(len(sizes))
    tensors = [torch.randn(n, generator=gen, dtype=dtype) * 3 for n in sizes]
    lanes = _eigen_sum.PACKET[dtype]
    got = _eigen_sum.eigen_sums(tensors, square=True).numpy()
    want = [eigen_order_sum((t * t).numpy(), lanes) for t in tensors]
    np.testing.assert_array_equal(got, np.array(want, dtype=got.dtype))
    halves = torch.rand(len(sizes) * 37, generator=gen, dtype=dtype)
    assert _eigen_sum.eigen_sums([halves], square=False).item() == eigen_order_sum(halves.numpy(), lanes)


def test_a_strided_tensor_longer_than_a_piece_is_summed_by_its_values():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(700, 1001, generator=gen)
    tensors = [torch.randn(9, generator=gen), x.t(), x[:, ::3]]
    got = _eigen_sum.eigen_sums(tensors, square=True).numpy()
    want = [eigen_order_sum((t * t).contiguous().view(-1).numpy(), 8) for t in tensors]
    np.testing.assert_array_equal(got, np.array(want, dtype=got.dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_short_sum_adds_in_eigens_order(dtype):
    """The halves of a global norm are summed by a shorter numpy path: every length of one leaf."""
    lanes = 8 if dtype == np.float32 else 4
    rng = np.random.default_rng(lanes)
    for n in [*range(0, 300), 1021, 4095, 4096, 4097, 8191, 8192, 8193]:
        x = (rng.random(n) * 10).astype(dtype)
        got = _eigen_sum.eigen_sum_short(x)
        if n > lanes * 1024:
            assert got is None
        else:
            assert got.dtype == dtype and got == eigen_order_sum(x, lanes), n


def _lso_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    params = list(model.parameters())
    opt = amp.LossScaleOptimizer(optim.GradientDescentOptimizer(params, learning_rate=0.1), "dynamic")
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    return params, opt, (model(x) - y).square().sum() * 10


@pytest.mark.parametrize("bad", [None, math.inf])
def test_loss_scale_tf_style_clips_the_unscaled_gradients(bad):
    """compute_gradients (unscaled) -> clip_by_global_norm -> apply_gradients, as TF; a non-finite
    gradient makes the norm inf and every clipped gradient NaN, and the step is skipped."""
    params, opt, loss = _lso_setup()
    if bad is not None:
        loss = loss * bad
    grads_and_vars = opt.compute_gradients(loss)
    clipped, norm = train.clip_by_global_norm([g for g, _ in grads_and_vars], 1.0)
    before, scale = [p.detach().clone() for p in params], opt.loss_scale().item()
    opt.apply_gradients(zip(clipped, params, strict=True))
    if bad is None:
        assert norm > 1.0
        for p, b, g in zip(params, before, clipped, strict=True):
            assert torch.equal(p.detach(), b - 0.1 * g)
    else:
        assert not torch.isfinite(norm) and all(torch.isnan(c).all() for c in clipped)
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
        assert opt.loss_scale().item() == scale / 2


@pytest.mark.parametrize("bad", [None, math.inf])
def test_loss_scale_torch_style_unscale_clip_step(bad):
    """get_scaled_loss(loss).backward(); unscale_(); clip_by_global_norm_; step(): the same update
    as the TF style, and a step with a non-finite gradient stays skipped."""
    params, opt, loss = _lso_setup()
    if bad is not None:
        loss = loss * bad
    _, tf_opt, tf_loss = _lso_setup()
    tf_params = [p for group in tf_opt.param_groups for p in group["params"]]
    grads_and_vars = tf_opt.compute_gradients(tf_loss * (1 if bad is None else bad))
    tf_opt.apply_gradients(zip(train.clip_by_global_norm([g for g, _ in grads_and_vars], 1.0)[0], tf_params))
    before, scale = [p.detach().clone() for p in params], opt.loss_scale().item()
    opt.get_scaled_loss(loss).backward()
    opt.unscale_()
    norm = train.clip_by_global_norm_(params, 1.0)
    opt.step()
    assert opt.loss_scale().item() == tf_opt.loss_scale().item()
    for p, q in zip(params, tf_params, strict=True):
        assert torch.equal(p.detach(), q.detach())
    if bad is None:
        assert norm > 1.0 and not torch.equal(params[0].detach(), before[0])
    else:
        assert not torch.isfinite(norm)
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
        assert opt.loss_scale().item() == scale / 2


@pytest.mark.parametrize("style", ["tf", "torch"])
def test_finite_gradients_whose_norm_overflows_skip_the_step_in_both_styles(style):
    """Every gradient finite, their float32 sum of squares not: the global norm is inf, TF's rule
    makes every clipped gradient NaN, and the loss scale skips the step (TF decides on the
    gradients apply_gradients gets), also where unscale_() had found the gradients finite."""
    params, opt, loss = _lso_setup()
    before, scale = [p.detach().clone() for p in params], opt.loss_scale().item()
    huge = torch.full_like(params[0], 1e19)
    if style == "tf":
        grads_and_vars = opt.compute_gradients(loss)
        grads = [huge, *(g for g, _ in grads_and_vars[1:])]
        clipped, norm = train.clip_by_global_norm(grads, 1.0)
        opt.apply_gradients(zip(clipped, params, strict=True))
    else:
        opt.get_scaled_loss(loss).backward()
        opt.unscale_()
        params[0].grad.copy_(huge)
        norm = train.clip_by_global_norm_(params, 1.0)
        opt.step()
    assert torch.isinf(norm)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    assert opt.loss_scale().item() == scale / 2


def test_strided_and_expanded_tensors_are_summed_by_their_values():
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(300, 70, generator=gen), torch.randn(20001, generator=gen)
    z = torch.randn(3, 1, generator=gen).expand(3, 5000)
    strided = [x.t(), y[::2], z]
    dense = [t.contiguous() for t in strided]
    assert torch.equal(train.global_norm(strided), train.global_norm(dense))
    clipped, _ = train.clip_by_global_norm(strided, 1.0)
    clipped_dense, _ = train.clip_by_global_norm(dense, 1.0)
    assert all(torch.equal(got, want) for got, want in zip(clipped, clipped_dense, strict=True))
