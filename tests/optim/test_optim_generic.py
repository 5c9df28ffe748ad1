"""Generic checks over the optimizer table (tests/optim_specs.py).

Numbers against TensorFlow live in test_tf_parity.py; this file checks the
contract: the two implementations agree, the driving modes agree, slots, state
dicts, errors, sparse rules, dtypes and learning-rate handling.
"""

from __future__ import annotations

import copy
import io
import math
import re

import pytest
import torch
from optim_specs import SPECS, OptimSpec, spec_configs

import torchgrad_compat.optim as tgo
import torchgrad_compat.optim._hyper as optim_hyper
from torchgrad_compat.optim._hyper import Hyper
from torchgrad_compat.optim._memory import _CPU_CHUNK_BYTES

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _ids(pairs):
    return [f"{spec.name.removesuffix('Optimizer')}-{cid}" for spec, cid in pairs]


SPEC_CONFIGS = spec_configs()
SPEC_IDS = _ids(SPEC_CONFIGS)
DEFAULT_CONFIGS = [(spec, next(iter(spec.configs))) for spec in SPECS]
DEFAULT_IDS = _ids(DEFAULT_CONFIGS)


def _params(dtype=torch.float32, seed=0, *, empty=False, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (5,)] + ([(0,)] if empty else [])
    return [
        torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_() for s in shapes
    ]


def _grads(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, p.dtype) for p in params]


def _state_tensors(opt):
    """Every slot and non-slot tensor, in a fixed order, for bitwise comparisons."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            out.extend((k, state[k]) for k in sorted(state))
    for i, group in enumerate(opt.state_dict()["param_groups"]):
        out.extend((f"{i}/{k}", group[k]) for k in sorted(opt._non_slot_keys))
    return out


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple):
            assert x[0] == y[0]
            x, y = x[1], y[1]
        assert torch.equal(x, y), (x, y)


def _run_apply(spec, cid, params, steps, *, foreach=None, skip=None, **overrides):
    """Drive the optimizer TF-style for `steps` steps; `skip(step)` names params left without a grad."""
    opt = spec.make(params, cid, foreach=foreach, **overrides)
    for step in range(steps):
        grads = _grads(params, step)
        pairs = [
            (g if not (skip and i in skip(step)) else None, p) for i, (g, p) in enumerate(zip(grads, params))
        ]
        opt.apply_gradients(pairs)
    return opt


# ---------------------------------------------------------------- implementations agree
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_foreach_matches_reference(spec: OptimSpec, cid: str, dtype, device):
    # Bitwise: the foreach path issues the same ops in the same order. Step 2 has no
    # gradient for var1, so the per-call bookkeeping of partial updates is exercised.
    runs = []
    for foreach in (False, True):
        params = _params(dtype, empty=True, device=device)
        opt = _run_apply(spec, cid, params, 5, foreach=foreach, skip=lambda s: {1} if s == 2 else set())
        runs.append((params, opt))
    (p_ref, o_ref), (p_fe, o_fe) = runs
    _assert_bitwise(p_ref, p_fe)
    _assert_bitwise(_state_tensors(o_ref), _state_tensors(o_fe))


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_foreach_matches_reference_across_cpu_chunks(spec: OptimSpec, cid: str):
    # On CPU a foreach bucket is updated in chunks of at most _CPU_CHUNK_BYTES with reused
    # scratch buffers: two big tensors never share a chunk, small ones join a big one, and
    # parameters without a gradient change the chunk layout from step to step.
    big = int(0.6 * _CPU_CHUNK_BYTES) // 4
    shapes = [(big,), (3, 4), (big + 1000,), (5,)]
    runs = []
    for foreach in (False, True):
        gen = torch.Generator().manual_seed(3)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
        opt = _run_apply(spec, cid, params, 4, foreach=foreach, skip=lambda s: {s % 4})
        runs.append((params, opt))
    (p_ref, o_ref), (p_fe, o_fe) = runs
    _assert_bitwise(p_ref, p_fe)
    _assert_bitwise(_state_tensors(o_ref), _state_tensors(o_fe))


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_an_element_is_updated_alike_wherever_it_lies(spec: OptimSpec, cid: str, dtype, foreach):
    # One tensor against the same values split in two at an offset no vector width divides, as
    # FSDP2 shards a parameter or threads split a loop: an element's update must not depend on
    # whether a vectorised loop or the scalar loop that finishes each range reaches it.
    gen = torch.Generator().manual_seed(5)
    values = torch.rand(2000, generator=gen, dtype=torch.float64).add_(0.1).to(dtype)
    grads = [torch.randn(2000, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]
    whole, halves = (
        [values.clone().requires_grad_()],
        [t.clone().requires_grad_() for t in values.split([777, 1223])],
    )
    for params in (whole, halves):
        opt = spec.make(params, cid, foreach=foreach)
        for g in grads:
            for p, part in zip(params, g.split([p.numel() for p in params]), strict=True):
                p.grad = part.clone()
            opt.step()
    assert torch.equal(whole[0].detach(), torch.cat([p.detach() for p in halves]))


def _quadratic(params, target_seed=7):
    gen = torch.Generator().manual_seed(target_seed)
    targets = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    return sum(((p - t) ** 2).sum() * 0.5 for p, t in zip(params, targets, strict=True))


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_driving_modes_agree(spec: OptimSpec, cid: str):
    """minimize ≡ compute_gradients + apply_gradients ≡ backward + step, bitwise."""
    finals = []
    for mode in ("minimize", "compute_apply", "backward_step"):
        params = _params(torch.float64)
        opt = spec.make(params, cid)
        for _ in range(4):
            if mode == "minimize":
                opt.minimize(lambda params=params: _quadratic(params))
            elif mode == "compute_apply":
                opt.apply_gradients(opt.compute_gradients(_quadratic(params)))
            else:
                opt.zero_grad()
                _quadratic(params).backward()
                opt.step()
        finals.append((params, _state_tensors(opt)))
    for params, state in finals[1:]:
        _assert_bitwise(finals[0][0], params)
        _assert_bitwise(finals[0][1], state)


# ---------------------------------------------------------------- slots
@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_slots(spec: OptimSpec, cid: str):
    params = _params(torch.float64)
    opt = spec.make(params, cid)
    expected = spec.slots_for(cid)
    assert opt.get_slot_names() == sorted(expected)
    for name in expected:
        assert opt.get_slot(params[0], name) is None  # TF creates slots at the first apply
    opt.apply_gradients([(_grads(params, 0)[0], params[0])])
    for name in expected:
        slot = opt.get_slot(params[0], name)
        assert slot.shape == params[0].shape
        assert slot.dtype == params[0].dtype and slot.device == params[0].device
        assert not slot.requires_grad
        assert all(slot is not p for p in params)
        assert any(slot is v for v in opt.variables())
    # A parameter that never had a gradient has no slots.
    assert all(opt.get_slot(params[1], name) is None for name in expected)
    assert opt.get_slot(params[0], "no-such-slot") is None
    assert opt.get_slot(torch.zeros(3), expected[0] if expected else "m") is None
    assert sorted(opt._non_slot_keys) == sorted(spec.non_slot)
    group = opt.state_dict()["param_groups"][0]
    assert all(isinstance(group[k], torch.Tensor) and group[k].dim() == 0 for k in spec.non_slot)
    assert set(opt.state_dict()) == {"state", "param_groups"}
    # The slot order a name-based TF checkpoint numbers slots by names every slot TF makes.
    assert set(expected) <= set(spec.cls.tf_slot_order)
    assert set(spec.cls.tf_non_slot_names) <= set(spec.non_slot)


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_state_dict_resume_is_bitwise(spec: OptimSpec, cid: str):
    steps_before, steps_after = 3, 4
    params = _params(torch.float32)
    opt = spec.make(params, cid)
    for step in range(steps_before):
        opt.apply_gradients(zip(_grads(params, step), params))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = spec.make(resumed_params, cid)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(steps_before, steps_before + steps_after):
        opt.apply_gradients(zip(_grads(params, step), params))
        resumed.apply_gradients(zip(_grads(resumed_params, step), resumed_params))
    _assert_bitwise(params, resumed_params)
    _assert_bitwise(_state_tensors(opt), _state_tensors(resumed))


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_deepcopy_continues_in_lockstep(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    opt.apply_gradients(zip(_grads(params, 0), params))
    twin_params, twin = copy.deepcopy((params, opt))  # one memo: the twin's state keys are its params
    for step in range(1, 4):
        opt.apply_gradients(zip(_grads(params, step), params))
        twin.apply_gradients(zip(_grads(twin_params, step), twin_params))
    _assert_bitwise(params, twin_params)


@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_load_state_dict_rejects_what_does_not_fit(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    opt.apply_gradients(zip(_grads(params, 0), params))
    good = opt.state_dict()

    fresh = spec.make(_params(), cid)
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(ValueError, match="different number of parameter groups"):
        fresh.load_state_dict({**good, "param_groups": good["param_groups"] * 2})
    if spec.slots:
        slot = spec.slots[0]
        bad_state = {0: {**good["state"][0], slot: torch.zeros(7)}}
        with pytest.raises(ValueError, match=rf"slot '{slot}'.*shape \(7,\).*\(4, 3\)"):
            fresh.load_state_dict({**good, "state": {**good["state"], **bad_state}})
        # A missing slot is named, and so is one this optimizer does not have (another
        # optimizer's, which would be read as one of these: RMSProp's "momentum" as Momentum's).
        with pytest.raises(ValueError, match=f"lacks slot '{slot}'"):
            fresh.load_state_dict({**good, "state": {0: {}}})
        unrelated = {0: {**good["state"][0], "unrelated": torch.zeros(4, 3)}}
        with pytest.raises(ValueError, match=r"holds \['unrelated'\], which are not slots"):
            fresh.load_state_dict({**good, "state": unrelated})
        # A checkpoint of another optimizer is refused, whatever it lacks or holds.
        other = tgo.GradientDescentOptimizer if spec.name != "GradientDescentOptimizer" else tgo.AdamOptimizer
        other_params = _params()
        other_opt = other(other_params, learning_rate=0.1)
        other_opt.apply_gradients(zip(_grads(other_params, 0), other_params))
        with pytest.raises(ValueError, match="was it saved from another optimizer"):
            fresh.load_state_dict(other_opt.state_dict())
    if spec.non_slot:
        lacking = [{k: v for k, v in good["param_groups"][0].items() if k != spec.non_slot[0]}]
        with pytest.raises(ValueError, match=f"lacks the non-slot state.*{spec.non_slot[0]}"):
            fresh.load_state_dict({**good, "param_groups": lacking})
    _assert_bitwise(_state_tensors(fresh), [(k, v) for k, v in _state_tensors(fresh)])
    assert fresh.state_dict()["state"] == before["state"]  # nothing was loaded half-way


@pytest.mark.parametrize(
    ("tamper", "exception", "words"),
    [
        ("missing hyperparameter", ValueError, r"lacks the hyperparameters \['beta1'\]"),
        ("sparse slot", TypeError, r"slot 'm' of parameter 1 must be a dense \(strided\) tensor"),
        ("expanded slot", ValueError, r"slot 'm' of parameter 1 is an expanded view"),
        (
            "one tensor as two slots",
            ValueError,
            r"slot 'm' of parameter 1 and loaded slot 'v' of parameter 1 share memory",
        ),
    ],
)
def test_load_state_dict_refuses_state_a_step_could_not_use(tamper: str, exception: type, words: str):
    """Each of these loaded, and the next step raised halfway through (a parameter already moved)
    or found no beta1; now the load refuses it, changes nothing, and the optimizer steps on."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    opt = tgo.AdamOptimizer(params, 0.1, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    if tamper == "missing hyperparameter":
        del saved["param_groups"][0]["beta1"]
    elif tamper == "sparse slot":
        saved["state"][1]["m"] = saved["state"][1]["m"].to_sparse()
    elif tamper == "expanded slot":
        saved["state"][1]["m"] = torch.zeros(1).expand(4)
    else:
        saved["state"][1]["v"] = saved["state"][1]["m"]
    before = [(k, v.clone()) for k, v in _state_tensors(opt)]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(exception, match=words):
        opt.load_state_dict(saved)
    _assert_bitwise(_state_tensors(opt), before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    opt.step()


def _hyper_keys(spec: OptimSpec) -> dict[str, str]:
    """TF argument name -> param-group key, for the numeric hyperparameters."""
    return {h.arg: h.key for h in spec.cls._hypers if isinstance(h, Hyper)}


def _loaded_cases():
    cases = []
    for spec in SPECS:
        keys = _hyper_keys(spec)
        for arg, value, exc in spec.bad_args:
            if arg in keys and isinstance(value, float):
                cases.append(
                    pytest.param(
                        spec, arg, value, exc, id=f"{spec.name.removesuffix('Optimizer')}-{arg}={value!r}"
                    )
                )
    return cases


@pytest.mark.parametrize(("spec", "arg", "value", "exc"), _loaded_cases())
def test_load_state_dict_checks_hyperparameters_as_the_constructor(spec: OptimSpec, arg, value, exc):
    params = _params()
    opt = spec.make(params)
    opt.apply_gradients(zip(_grads(params, 0), params))
    good = opt.state_dict()
    fresh = spec.make(_params())
    before = copy.deepcopy(fresh.state_dict())
    groups = [{**good["param_groups"][0], _hyper_keys(spec)[arg]: value}]
    with pytest.raises(exc, match=arg):
        fresh.load_state_dict({**good, "param_groups": groups})
    assert not fresh.state  # neither slots nor hyperparameters were loaded half-way
    assert fresh.state_dict()["param_groups"] == before["param_groups"]


@pytest.mark.parametrize(
    ("spec", "cid"), [c for c in DEFAULT_CONFIGS if c[0].non_slot], ids=lambda x: getattr(x, "name", x)
)
def test_load_state_dict_checks_non_slot_state_first(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    opt.apply_gradients(zip(_grads(params, 0), params))
    good = opt.state_dict()
    key = spec.non_slot[0]
    current = good["param_groups"][0][key]
    bad_values = [
        ([0.5], TypeError, "must be a"),
        (current.reshape(1), TypeError, r"shape \(\)"),
        (torch.full_like(current, math.nan) if current.is_floating_point() else current.double(), None, None),
    ]
    for bad, exc, match in bad_values:
        exc = exc or (ValueError if current.is_floating_point() else TypeError)
        fresh = spec.make(_params(), cid, learning_rate=0.5)
        sd = {**good, "param_groups": [{**good["param_groups"][0], key: bad}]}
        with pytest.raises(exc, match=match or key):
            fresh.load_state_dict(sd)
        assert not fresh.state and fresh.param_groups[0]["lr"] == 0.5
        _assert_bitwise(
            [(k, fresh.param_groups[0][k]) for k in spec.non_slot],
            [(k, spec.make(_params(), cid).param_groups[0][k]) for k in spec.non_slot],
        )


def test_load_state_dict_does_not_mutate_its_argument():
    params = _params()
    opt = tgo.AdamOptimizer(params, learning_rate=0.1)
    opt.apply_gradients(zip(_grads(params, 0), params))
    sd = opt.state_dict()
    keys = set(sd)
    tgo.AdamOptimizer(_params(), learning_rate=0.1).load_state_dict(sd)
    assert set(sd) == keys == {"state", "param_groups"}


# ---------------------------------------------------------------- errors
def _bad_arg_cases():
    cases = []
    for spec in SPECS:
        for arg, value, exc in spec.bad_args:
            cases.append(
                pytest.param(
                    spec, arg, value, exc, id=f"{spec.name.removesuffix('Optimizer')}-{arg}={value!r}"
                )
            )
    return cases


@pytest.mark.parametrize(("spec", "arg", "value", "exc"), _bad_arg_cases())
def test_bad_hyperparameters_are_rejected(spec: OptimSpec, arg, value, exc):
    with pytest.raises(exc) as info:
        spec.make(_params(), **{arg: value})
    message = str(info.value)
    assert arg in message
    if isinstance(value, float):
        assert repr(value) in message


@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_bad_hyperparameter_in_a_param_group_is_rejected(spec: OptimSpec, cid: str):
    params = _params()
    with pytest.raises(ValueError, match="learning_rate.*nan"):
        spec.make([{"params": params[:1]}, {"params": params[1:], "lr": math.nan}], cid)


@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_bad_inputs_get_clear_errors(spec: OptimSpec, cid: str):
    params = _params()
    with pytest.raises(ValueError, match="empty parameter list"):
        spec.make([], cid)
    with pytest.raises(TypeError, match="iterable of Tensors"):
        spec.make(params[0], cid)
    with pytest.raises(ValueError, match="complex"):
        spec.make([torch.zeros(2, dtype=torch.complex64, requires_grad=True)], cid)
    with pytest.raises(TypeError, match="torch.int64"):
        spec.make([torch.zeros(2, dtype=torch.int64)], cid)
    opt = spec.make(params, cid)
    with pytest.raises(ValueError, match=r"gradient shape \(3, 4\) does not match variable shape \(4, 3\)"):
        opt.apply_gradients([(torch.zeros(3, 4), params[0])])
    with pytest.raises(TypeError, match="dtype torch.float64 does not match"):
        opt.apply_gradients([(torch.zeros(4, 3, dtype=torch.float64), params[0])])
    with pytest.raises(ValueError, match="does not manage variable"):
        opt.apply_gradients([(torch.zeros(2), torch.zeros(2, requires_grad=True))])
    with pytest.raises(ValueError, match=r"No gradients provided for any variable.*\(4, 3\).*\(5,\)"):
        opt.apply_gradients([(None, params[0]), (None, params[1])])
    with pytest.raises(TypeError, match="global_step must be a 0-d integer tensor"):
        opt.apply_gradients([(torch.zeros(4, 3), params[0])], global_step=torch.tensor(0.0))
    for narrow in (torch.uint8, torch.int8, torch.int16):  # these wrap within a run (uint8 at 256 steps)
        with pytest.raises(TypeError, match=rf"global_step must be a 0-d int32 or int64 tensor.*{narrow}"):
            opt.apply_gradients([(torch.zeros(4, 3), params[0])], global_step=torch.tensor(0, dtype=narrow))
    with pytest.raises(ValueError, match="gate_gradients"):
        opt.compute_gradients(_quadratic(params), gate_gradients=5)
    with pytest.raises(ValueError, match="aggregation_method"):
        opt.compute_gradients(_quadratic(params), aggregation_method=7)
    elementwise = torch.sparse_coo_tensor(
        torch.tensor([[0], [1]]), torch.tensor([1.0]), (4, 3), check_invariants=True
    )
    with pytest.raises(ValueError, match="row-sparse"):
        opt.apply_gradients([(elementwise, params[0])])
    wrong_rows = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 3), (6, 3), check_invariants=True)
    with pytest.raises(ValueError, match="gradient shape"):
        opt.apply_gradients([(wrong_rows, params[0])])
    assert not opt.state  # none of the rejected calls created state


# ---------------------------------------------------------------- a step is all or nothing
def _snapshot(opt, params):
    return [p.detach().clone() for p in params] + [v.clone() for _, v in _state_tensors(opt)]


@pytest.mark.parametrize("mode", ["apply_gradients", "step"])
@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_sparse_row_out_of_range_changes_nothing(spec: OptimSpec, cid: str, mode: str):
    params, twin = _params(), _params()
    opt, ref = spec.make(params, cid), spec.make(twin, cid)
    for o, ps in ((opt, params), (ref, twin)):
        o.apply_gradients(zip(_grads(ps, 0), ps))  # slots and non-slot state exist and have moved
    gs = torch.tensor(3, dtype=torch.int64)
    dense = _grads(params, 1)[1]
    # Built without checking invariants, as torch builds them by default: row 9 of a 4-row variable.
    bad = torch.sparse_coo_tensor(torch.tensor([[1, 9]]), torch.ones(2, 3), (4, 3), check_invariants=False)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=r"row index 9 is out of range.*\(4, 3\).*0 to 3"):
        if mode == "step":
            params[1].grad, params[0].grad = dense, bad
            opt.step()
        else:
            opt.apply_gradients([(dense, params[1]), (bad, params[0])], global_step=gs)
    _assert_bitwise(_snapshot(opt, params), before)
    assert gs.item() == 3
    good = _sparse([1], torch.ones(1, 3), (4, 3))
    opt.apply_gradients([(dense, params[1]), (good, params[0])])  # the retry applies once
    ref.apply_gradients([(dense.clone(), twin[1]), (good, twin[0])])
    _assert_bitwise(_snapshot(opt, params), _snapshot(ref, twin))


MISFIT_DATA = {
    # p.grad.data = ...: torch checks p.grad = ... but not this.
    "fewer-elements": (
        lambda g: g.reshape(-1)[:6].clone(),
        ValueError,
        r"gradient shape \(6,\) does not match",
    ),
    "transposed-shape": (lambda g: g.t().contiguous(), ValueError, r"gradient shape \(3, 4\) does not match"),
    "float64": (lambda g: g.double(), TypeError, "gradient dtype torch.float64 does not match"),
}


@pytest.mark.parametrize("path", ["loop", "foreach", "fused"])
@pytest.mark.parametrize("misfit", list(MISFIT_DATA))
@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_step_refuses_a_gradient_replaced_through_data(spec: OptimSpec, cid: str, misfit: str, path: str):
    """A p.grad whose .data no longer fits its parameter is refused by name before anything
    changes, on every path: the fused kernels would otherwise read it past its end."""
    params = _params()
    opt = spec.make(
        params,
        cid,
        **{"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[path],
    )
    for p, g in zip(params, _grads(params, 0), strict=True):
        p.grad = g
    opt.step()  # slots and non-slot state exist
    replace, exception, words = MISFIT_DATA[misfit]
    grads = _grads(params, 1)
    params[1].grad, params[0].grad = grads[1], grads[0]
    params[0].grad.data = replace(grads[0])
    before = _snapshot(opt, params)
    with pytest.raises(exception, match=words):
        opt.step()
    _assert_bitwise(_snapshot(opt, params), before)


@pytest.mark.parametrize("bad", [math.nan, 1e39, -1.0], ids=repr)
@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_learning_rate_changed_after_construction_is_checked_before_use(spec: OptimSpec, cid: str, bad):
    params = _params()
    opt = spec.make([{"params": params[:1]}, {"params": params[1:]}], cid)
    opt.apply_gradients(zip(_grads(params, 0), params))
    before = _snapshot(opt, params)
    good = opt.param_groups[1]["lr"]
    opt.param_groups[1]["lr"] = bad  # as a user or a scheduler may write it
    with pytest.raises(ValueError, match=re.escape(f"learning_rate value: {bad!r}")):
        opt.apply_gradients(zip(_grads(params, 1), params))
    _assert_bitwise(_snapshot(opt, params), before)  # the first group was not updated either
    opt.param_groups[1]["lr"] = torch.tensor(bad)
    with pytest.raises(ValueError, match="learning_rate value"):
        opt.apply_gradients(zip(_grads(params, 1), params))
    _assert_bitwise(_snapshot(opt, params), before)
    opt.param_groups[1]["lr"] = good
    opt.apply_gradients(zip(_grads(params, 1), params))


# ---------------------------------------------------------------- sparse rules
def _sparse(indices, values, shape):
    return torch.sparse_coo_tensor(torch.tensor([indices]), values, shape, check_invariants=True)


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_sparse_rows_follow_tf_rule(spec: OptimSpec, cid: str):
    """Lazy optimizers leave rows without a gradient and their slots untouched; Adam moves every row."""
    p = _params()[0]
    opt = spec.make([p], cid)
    opt.apply_gradients([(_sparse([0, 1, 2, 3], torch.ones(4, 3), (4, 3)), p)])
    rows_before = p.detach()[[1, 3]].clone()
    slots_before = {k: v[[1, 3]].clone() for k, v in opt.state[p].items()}
    for step in range(3):
        opt.apply_gradients([(_sparse([2, 0, 2], _grads([torch.zeros(3, 3)], step)[0], (4, 3)), p)])
    moved = not torch.equal(p.detach()[[1, 3]], rows_before)
    assert moved == (not spec.sparse_lazy)
    for k, v in opt.state[p].items():
        assert torch.equal(v[[1, 3]], slots_before[k]) == spec.sparse_lazy, k


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_sparse_duplicates_are_summed_first(spec: OptimSpec, cid: str):
    """values [1, 2] at rows [1, 1] ≡ [3] at row [1] (TF sums duplicates before the update)."""
    results = []
    for indices, values in (([1, 1], [[1.0] * 3, [2.0] * 3]), ([1], [[3.0] * 3])):
        p = _params(torch.float64)[0]
        opt = spec.make([p], cid)
        for _ in range(3):
            opt.apply_gradients([(_sparse(indices, torch.tensor(values, dtype=torch.float64), (4, 3)), p)])
        results.append((p.detach(), opt))
    (summed, o1), (single, o2) = results
    if spec.sums_duplicates:
        _assert_bitwise([summed], [single])
        _assert_bitwise(_state_tensors(o1), _state_tensors(o2))
    else:
        # GradientDescent scatter-adds duplicates one after another, like TF.
        lr = torch.tensor(spec.configs[cid]["learning_rate"], dtype=torch.float32).double()
        expected = _params(torch.float64)[0].detach().clone()
        for _ in range(3):
            expected[1] = (expected[1] + (-1.0 * lr)) + (-2.0 * lr)
        _assert_bitwise([summed], [expected])


def test_sparse_gradient_from_embedding_backward():
    """nn.Embedding(sparse=True) gives an uncoalesced gradient; step() takes it as TF takes IndexedSlices."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    twin = torch.nn.Parameter(emb.weight.detach().clone())
    opt = tgo.AdagradOptimizer(emb.parameters(), learning_rate=0.1)
    twin_opt = tgo.AdagradOptimizer([twin], learning_rate=0.1)
    ids = torch.tensor([4, 1, 4, 4])
    emb(ids).pow(2).sum().backward()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    twin_opt.apply_gradients([(emb.weight.grad.coalesce(), twin)])
    opt.step()
    _assert_bitwise([emb.weight.detach()], [twin.detach()])


# ---------------------------------------------------------------- learning rates and groups
@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_tensor_and_callable_learning_rates_match_float(spec: OptimSpec, cid: str):
    lr = spec.configs[cid].get("learning_rate", 0.001)
    finals = []
    for value in (lr, torch.tensor(lr), lambda: lr):
        params = _params()
        _run_apply(spec, cid, params, 3, learning_rate=value)
        finals.append(params)
    _assert_bitwise(finals[0], finals[1])
    _assert_bitwise(finals[0], finals[2])


def test_callable_learning_rate_is_evaluated_at_every_apply_and_checked():
    p = torch.zeros(2, requires_grad=True)
    rates = iter([0.5, 0.25, math.nan])
    opt = tgo.GradientDescentOptimizer([p], learning_rate=lambda: next(rates))
    opt.apply_gradients([(torch.ones(2), p)])
    opt.apply_gradients([(torch.ones(2), p)])
    assert p.detach().tolist() == [-0.75, -0.75]
    with pytest.raises(ValueError, match="learning_rate.*nan"):
        opt.apply_gradients([(torch.ones(2), p)])


def test_lr_scheduler_drives_group_lr():
    p = torch.zeros(1, requires_grad=True)
    opt = tgo.GradientDescentOptimizer([p], learning_rate=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = torch.ones(1)
        opt.step()
        sched.step()
    assert p.item() == -(1.0 + 0.5 + 0.25)


@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_per_group_learning_rate_is_honoured(spec: OptimSpec, cid: str):
    if spec.zero_grad_moves:
        pytest.skip("the variable is a closed form of the accumulators: a tiny lr does not freeze it")
    params = _params()
    frozen_before = params[1].detach().clone()
    moving_before = params[0].detach().clone()
    opt = spec.make([{"params": params[:1]}, {"params": params[1:], "lr": 1e-28}], cid)
    for step in range(5):
        opt.apply_gradients(zip(_grads(params, step), params))
    assert torch.equal(params[1].detach(), frozen_before)
    assert not torch.equal(params[0].detach(), moving_before)


def test_add_param_group_keeps_slots_and_initialises_new_ones():
    params = _params()
    opt = tgo.AdagradOptimizer(params[:1], learning_rate=0.1, initial_accumulator_value=0.3)
    opt.apply_gradients([(_grads(params, 0)[0], params[0])])
    accum = opt.get_slot(params[0], "accumulator").clone()
    opt.add_param_group({"params": params[1:]})
    opt.apply_gradients([(_grads(params, 1)[1], params[1])])
    assert torch.equal(opt.get_slot(params[0], "accumulator"), accum)
    g = _grads(params, 1)[1]
    assert torch.allclose(opt.get_slot(params[1], "accumulator"), 0.3 + g * g)


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_hyperparameters_kept_between_steps_are_never_written(spec: OptimSpec, cid: str):
    """A hyperparameter given as a number is made into a tensor once and read at later steps (by
    every optimizer that uses that number): no update rule, on any path, may write it."""
    optim_hyper._NUMBER_TENSORS.clear()
    for dtype in (torch.float32, torch.float64):
        for path in ({"foreach": False}, {"foreach": True}, {"fused": True}):
            params = _params(dtype)
            opt = spec.make(params, cid, **path)
            for step in range(3):
                for p, g in zip(params, _grads(params, step), strict=True):
                    p.grad = g
                opt.step()
        p = _params(dtype)[0]
        opt = spec.make([p], cid)
        for step in range(3):
            values = _grads([torch.zeros(3, 3, dtype=dtype)], step)[0]
            opt.apply_gradients([(_sparse([2, 0, 2], values, (4, 3)), p)])
    kept = dict(optim_hyper._NUMBER_TENSORS)
    assert kept
    for (_, value, _, dtype), (tensor, version) in kept.items():
        made = torch.tensor(value, dtype=torch.float32).to(dtype)
        assert tensor.shape == () and tensor.dtype == dtype and tensor.device.type == "cpu"
        assert torch.equal(tensor, made) and tensor.signbit() == made.signbit(), (value, dtype, tensor)
        assert tensor._version == version, (value, dtype)


def test_a_subclass_that_writes_a_hyperparameter_tensor_changes_only_its_own_steps():
    """A subclass's update may write the hyperparameter tensors it is handed (each step used to
    get its own): another optimizer with the same learning rate must still read that rate."""

    class Halving(tgo.GradientDescentOptimizer):
        def _apply_dense(self, group, params, grads, slots, non_slot, hyper, path):
            super()._apply_dense(group, params, grads, slots, non_slot, hyper, path)
            hyper.lr.mul_(0.5)

    for path in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        p, q = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
        halving = Halving([p], learning_rate=0.1, **path)
        for _ in range(3):
            p.grad = torch.ones(4)
            halving.step()
        q.grad = torch.ones(4)
        tgo.GradientDescentOptimizer([q], learning_rate=0.1, **path).step()
        expected = torch.zeros(4) - torch.ones(4) * torch.tensor(0.1)
        assert torch.equal(q.detach(), expected), path
        assert torch.equal(p.detach(), 3 * expected), path


def test_a_step_inside_functionalize_leaves_later_eager_steps_working():
    """Tensors made inside a functorch transform are wrappers of that transform: none may be kept
    for the eager steps that follow."""

    def train_step(p, g):
        p = p.detach()
        p.grad = g
        tgo.GradientDescentOptimizer([p], learning_rate=0.125, foreach=False).step()
        return p.detach()

    expected = torch.full((3,), 0.875)
    assert torch.equal(torch.func.functionalize(train_step)(torch.ones(3), torch.ones(3)), expected)
    assert torch.equal(train_step(torch.ones(3), torch.ones(3)), expected)


@pytest.mark.parametrize("fused", [False, True])
def test_a_learning_rate_of_negative_zero_is_not_taken_for_zero(fused: bool):
    """0.0 == -0.0, but ``p - g * lr`` differs in sign between them for p = -0.0: TF's float32
    arithmetic, which the kept hyperparameter tensors must not conflate."""
    results = []
    for lr in (0.0, -0.0):
        p = torch.full((4,), -0.0, requires_grad=True)
        p.grad = torch.ones(4)
        tgo.GradientDescentOptimizer([p], learning_rate=lr, fused=fused).step()
        results.append(p.detach())
    g, p0 = torch.ones(4), torch.full((4,), -0.0)
    for lr, got in zip((0.0, -0.0), results, strict=True):
        expected = p0 - g * torch.tensor(lr)
        assert torch.equal(got.signbit(), expected.signbit()), (lr, got, expected)
    assert not torch.equal(results[0].signbit(), results[1].signbit())


def test_a_kept_hyperparameter_is_not_handed_to_a_fake_tensor_trace():
    """Under a dispatch mode (FakeTensorMode, as tracing uses) a hyperparameter is made in that
    mode, not taken from the real tensors kept for eager steps."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    real = optim_hyper.float32_tensor(0.375, torch.device("cpu"))
    assert type(real) is torch.Tensor
    with FakeTensorMode():
        traced = optim_hyper.float32_tensor(0.375, torch.device("cpu"))
    assert isinstance(traced, FakeTensor)
    assert optim_hyper.float32_tensor(0.375, torch.device("cpu")) is real


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_with_one_learning_rate_in_a_graph_capture_and_on_two_streams():
    """Where a CUDA hyperparameter tensor could be shared between steps, it would be read before
    it is written: by an eager step, when made during a capture (whose kernels run at replay),
    or by a step on another stream; or after it is let go, by a captured graph."""
    lr = 0.0123
    expected = torch.ones(8) - torch.ones(8) * torch.tensor(lr)

    def fresh():
        p = torch.ones(8, device="cuda", requires_grad=True)
        p.grad = torch.ones(8, device="cuda")
        return p, tgo.GradientDescentOptimizer([p], learning_rate=lr, foreach=True)

    captured, eager, on_default, on_side = fresh(), fresh(), fresh(), fresh()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured[1].step()
    eager[1].step()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # the default stream is busy: its kernels wait
    on_default[1].step()
    with torch.cuda.stream(side):
        on_side[1].step()
    torch.cuda.synchronize()
    junk = [torch.full((), 7.0, device="cuda") for _ in range(256)]  # reuses memory let go
    graph.replay()
    for p, _ in (captured, eager, on_default, on_side):
        assert torch.equal(p.detach().cpu(), expected)
    del junk


# ---------------------------------------------------------------- no-ops and zero gradients
@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_step_without_gradients_does_nothing(spec: OptimSpec, cid: str):
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = spec.make(params, cid)
    non_slot = [copy.deepcopy(opt.non_slot_state(g)) for g in opt.param_groups]
    opt.step()
    _assert_bitwise([p.detach() for p in params], before)
    assert not opt.state
    for a, b in zip([opt.non_slot_state(g) for g in opt.param_groups], non_slot, strict=True):
        _assert_bitwise(sorted(a.items()), sorted(b.items()))


@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_zero_gradients(spec: OptimSpec, cid: str):
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = spec.make(params, cid)
    opt.apply_gradients([(torch.zeros_like(p), p) for p in params])
    if spec.zero_grad_moves:
        # TF recomputes the variable from its accumulators, which are still at rest: it becomes 0.
        assert all(torch.equal(p.detach(), torch.zeros_like(p)) for p in params)
    else:
        _assert_bitwise([p.detach() for p in params], before)


# ---------------------------------------------------------------- direction
def _rosenbrock(xy):
    x, y = xy[0], xy[1]
    return (1 - x) ** 2 + 100 * (y - x * x) ** 2


@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
@pytest.mark.parametrize("problem", ["quadratic", "rosenbrock"])
def test_loss_goes_down(spec: OptimSpec, cid: str, problem: str):
    if problem == "quadratic":
        params = _params(torch.float64)
        loss_fn = lambda: _quadratic(params)  # noqa: E731
        opt = spec.make(params, cid)
    else:
        xy = torch.tensor([-1.5, 2.0], dtype=torch.float64, requires_grad=True)
        loss_fn = lambda: _rosenbrock(xy)  # noqa: E731
        opt = spec.make([xy], cid, learning_rate=1e-3)
    first = loss_fn().item()
    for _ in range(100):
        opt.minimize(loss_fn)
    last = loss_fn().item()
    assert last < first, (first, last)


# ---------------------------------------------------------------- low precision
# Half-precision runs are compared with the same run in float64 started from the same
# (rounded) values. Updates run through float32 working copies, so the error is the
# rounding of the stored values: measured worst case after 5 steps over the table,
# 1.73·u (Adam, bfloat16; u = 2^-11 for float16, 2^-8 for bfloat16), relative to
# 1 + |x|. The tolerance is 4·u.
HALF_TOL = {torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("spec", "cid"), SPEC_CONFIGS, ids=SPEC_IDS)
def test_half_precision_tracks_float64(spec: OptimSpec, cid: str, dtype):
    ref_params = _params(torch.float64)
    half_params = [p.detach().to(dtype).requires_grad_() for p in ref_params]
    ref_params = [p.detach().to(dtype).double().requires_grad_() for p in ref_params]  # same start
    ref = spec.make(ref_params, cid)
    half = spec.make(half_params, cid)
    for step in range(5):
        grads = [g.to(dtype) for g in _grads(ref_params, step)]
        ref.apply_gradients(zip([g.double() for g in grads], ref_params))
        half.apply_gradients(zip(grads, half_params))
    tol = HALF_TOL[dtype]
    for h, r in zip(half_params, ref_params, strict=True):
        assert h.dtype == dtype
        torch.testing.assert_close(h.detach().double(), r.detach(), rtol=tol, atol=tol)
    for name in spec.slots_for(cid):
        assert half.get_slot(half_params[0], name).dtype == dtype


# ---------------------------------------------------------------- torch conventions
def test_step_closure_hooks_repr_and_deepcopy():
    params = _params()
    opt = tgo.AdamOptimizer(params, learning_rate=0.1)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    handle = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = _quadratic(params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]
    handle.remove()
    opt.step(closure)
    assert calls == ["pre", "post", "pre"]
    assert "AdamOptimizer" in repr(opt)
    clone = copy.deepcopy(opt)
    assert clone.state_dict()["param_groups"][0]["beta1_power"].item() == pytest.approx(0.9**3)


def test_global_step_is_incremented_in_place():
    params = _params()
    opt = tgo.GradientDescentOptimizer(params, learning_rate=0.1)
    gs = torch.tensor(5, dtype=torch.int64)
    opt.apply_gradients(zip(_grads(params, 0), params), global_step=gs)
    opt.minimize(lambda: _quadratic(params), global_step=gs)
    assert gs.item() == 7


def test_compute_gradients_defaults_and_unconnected_vars():
    params = _params()
    extra = torch.zeros(2, requires_grad=True)
    opt = tgo.GradientDescentOptimizer([*params, extra], learning_rate=0.1)
    pairs = opt.compute_gradients(lambda: _quadratic(params))
    assert [v for _, v in pairs] == [*params, extra]
    assert pairs[2][0] is None
    assert all(p.grad is None for p in params)  # nothing accumulated into .grad
    with pytest.raises(ValueError, match="No gradients provided"):
        opt.minimize(lambda: (extra * 0).sum().detach(), var_list=[extra])
    with pytest.raises(ValueError, match="var_list"):
        opt.compute_gradients(_quadratic(params), var_list=[torch.zeros(2)])


@pytest.mark.parametrize("path", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=str)
def test_centered_switched_on_after_the_first_step_is_named(path) -> None:
    """RMSProp's "mg" slot exists only when centered: switched on later, the step found no slot
    (a bare KeyError). It is refused by name before anything moves, in every param group."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = tgo.RMSPropOptimizer([{"params": [a]}, {"params": [b]}], 0.1, momentum=0.5, **path)
    for p in (a, b):
        p.grad = torch.ones(3)
    opt.step()
    before = [a.detach().clone(), b.detach().clone()]
    opt.param_groups[1]["centered"] = True
    with pytest.raises(ValueError, match=r"param group 1 has no slot \['mg'\]"):
        opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
