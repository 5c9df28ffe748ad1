"""What torch.optim's generic optimizer tests ask of any optimizer, over the table in optim_specs.py.

The checks follow pytorch's test/test_optim.py and
torch/testing/_internal/common_optimizers.py: param groups, zero_grad, hooks on
every update path, state_dict round trips (deepcopy, torch.save with
weights_only, older dicts without flags, dtype casting), GradScaler. Documented
exceptions, where TF's math or dtypes differ, are tested as such: complex
parameters are rejected (TF's optimizers have no complex kernels), and the
optimizers without slots keep no per-parameter state.
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import re
from typing import Any

import pytest
import torch
from optim_specs import SPECS, OptimSpec
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import LossScaleOptimizer
from torchgrad_compat.optim._hyper import Flag
from torchgrad_compat.xla import CrossShardOptimizer

DEFAULT_CONFIGS = [(spec, next(iter(spec.configs))) for spec in SPECS]
DEFAULT_IDS = [spec.name.removesuffix("Optimizer") for spec, _ in DEFAULT_CONFIGS]
by_spec = pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
by_path = pytest.mark.parametrize(
    "path", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=["loop", "foreach", "fused"]
)


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in ((4, 3), (5,))
    ]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    for p, g in zip(params, _grads(params, step), strict=True):
        p.grad = g


def _lockstep(a: Any, a_params: list[torch.Tensor], b: Any, b_params: list[torch.Tensor], steps: int) -> None:
    for step in range(steps):
        _set_grads(a_params, step)
        _set_grads(b_params, step)
        a.step()
        b.step()
    for x, y in zip(a_params, b_params, strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- hooks
@by_spec
def test_step_hooks_fire_once_on_every_update_path(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    global_handles = [
        register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append("global post")),
    ]
    try:
        _set_grads(params, 0)
        opt.step()
        opt.apply_gradients(list(zip(_grads(params, 1), params, strict=True)))
        opt.minimize(lambda: sum((p * p).sum() for p in params))
    finally:
        for handle in global_handles:
            handle.remove()
    assert calls == ["global pre", "pre", "post", "global post"] * 3


def by_wrapper(test: Any) -> Any:
    """Run ``test(wrap)`` around each of this package's wrappers that a torch tool may hold."""
    test = pytest.mark.filterwarnings("ignore:CrossShardOptimizer. no torch.distributed process group")(test)
    return pytest.mark.parametrize(
        "wrap",
        [lambda opt: LossScaleOptimizer(opt, loss_scale=1.0), CrossShardOptimizer],
        ids=["LossScaleOptimizer", "CrossShardOptimizer"],
    )(test)


@by_wrapper
def test_step_hooks_fire_on_a_wrapper_and_on_what_it_wraps(wrap):
    params = _params()
    inner = SPECS[0].make(params)
    wrapper = wrap(inner)
    calls: list[str] = []
    inner.register_step_post_hook(lambda o, args, kwargs: calls.append("inner"))
    wrapper.register_step_post_hook(lambda o, args, kwargs: calls.append("wrapper"))
    wrapper.apply_gradients(list(zip(_grads(params, 0), params, strict=True)))
    wrapper.minimize(lambda: sum((p * p).sum() for p in params))
    assert calls == ["inner", "wrapper"] * 2


@by_spec
def test_a_pre_hook_may_replace_apply_gradients_arguments(spec: OptimSpec, cid: str):
    # torch's contract for step pre hooks: returning (args, kwargs) replaces them.
    params, expected_params = _params(), _params()
    opt, expected = spec.make(params, cid), spec.make(expected_params, cid)
    replacement = list(zip(_grads(params, 5), params, strict=True))
    opt.register_step_pre_hook(lambda o, args, kwargs: ((args[0], replacement), kwargs))
    opt.apply_gradients(list(zip(_grads(params, 0), params, strict=True)))
    expected.apply_gradients(list(zip(_grads(expected_params, 5), expected_params, strict=True)))
    for p, e in zip(params, expected_params, strict=True):
        assert torch.equal(p, e)


# ---------------------------------------------------------------- param groups
@by_spec
def test_tf_argument_names_in_a_group_dict_map_to_their_keys(spec: OptimSpec, cid: str):
    params = _params()
    config = spec.configs[cid]
    opt = spec.make([{"params": params[:1], "learning_rate": 0.5}, {"params": params[1:]}], cid)
    assert opt.param_groups[0]["lr"] == 0.5
    assert "learning_rate" not in opt.param_groups[0]
    assert opt.param_groups[1]["lr"] == config.get("learning_rate", opt.defaults["lr"])
    with pytest.raises(ValueError, match="both 'learning_rate'"):
        spec.make([{"params": params, "learning_rate": 0.5, "lr": 0.5}], cid)
    with pytest.raises(ValueError, match="Invalid learning_rate value: -1"):
        spec.make([{"params": params, "learning_rate": -1.0}], cid)


def test_tf_names_of_regularization_strengths_map_to_their_keys():
    spec = next(s for s in SPECS if s.name == "ProximalGradientDescentOptimizer")
    params = _params()
    named, keyed = _params(), _params()
    a = spec.make([{"params": named, "l1_regularization_strength": 0.01}], "lr0.1")
    b = spec.make(keyed, "lr0.1", l1_regularization_strength=0.01)
    assert a.param_groups[0]["l1"] == 0.01
    _lockstep(a, named, b, keyed, 3)
    assert params  # the group dict did not consume the caller's list


# Each hyperparameter of the ten optimizers as a group key and as TF's argument name, with a
# value that asks for something (written from the constructors' signatures, not read from the check).
_EVERY_HYPER_KEY = {
    "lr": 0.5,
    "learning_rate": 0.5,
    "rho": 0.5,
    "epsilon": 0.5,
    "beta1": 0.5,
    "beta2": 0.5,
    "momentum": 0.5,
    "use_nesterov": True,
    "decay": 0.5,
    "centered": True,
    "initial_accumulator_value": 0.5,
    "initial_gradient_squared_accumulator_value": 0.5,
    "l1": 0.5,
    "l2": 0.5,
    "l1_regularization_strength": 0.5,
    "l2_regularization_strength": 0.5,
    "l2_shrinkage_regularization_strength": 0.5,
    "learning_rate_power": -0.25,
    "beta": 0.5,
}


@by_spec
def test_a_group_key_the_optimizer_would_not_read_is_refused(spec: OptimSpec, cid: str):
    # torch keeps and ignores a key its optimizer does not read: a group copied from torch or
    # Keras code, or with a typo, would train silently with the default in its place.
    params = _params()
    # Its constructor's argument names and its group keys.
    own = set(inspect.signature(spec.cls.__init__).parameters) | set(spec.make(_params(), cid).defaults)
    asks = {
        "weight_decay": 0.01,
        "maximize": True,
        "amsgrad": True,
        "dampening": 0.1,
        "eps": 1e-3,
        "nesterov": True,
        "alpha": 0.9,
        "beta_1": 0.8,
        "clipnorm": 1.0,
        "learnig_rate": 0.5,
        "Lr": 0.5,
        **{key: value for key, value in _EVERY_HYPER_KEY.items() if key not in own},
    }
    if spec.name != "AdamOptimizer":
        asks["betas"] = (0.8, 0.9)
    if "momentum" in own:
        asks["momentun"] = 0.5
    for key, value in asks.items():
        with pytest.raises(ValueError, match=re.escape(f"param group key '{key}' (got {value!r})")):
            spec.make([{"params": params, key: value}], cid)


@by_spec
def test_group_keys_that_ask_for_nothing_are_kept_and_change_nothing(spec: OptimSpec, cid: str):
    params, plain = _params(), _params()
    extra = {
        "weight_decay": 0.0,
        "maximize": False,
        "amsgrad": False,
        "clipnorm": None,
        "initial_lr": 0.1,
        "name": "encoder",
        "max_momentum": 0.95,
        "capturable": False,
    }
    opt = spec.make([{"params": params, **extra}], cid)
    assert {key: opt.param_groups[0][key] for key in extra} == extra
    _lockstep(opt, params, spec.make(plain, cid), plain, 3)


@by_spec
def test_a_key_a_training_loop_writes_into_a_group_is_refused_at_the_next_step(spec: OptimSpec, cid: str):
    # As a weight-decay schedule does (group["weight_decay"] = wd_schedule[it]); the step that
    # refuses it changes nothing, and once the key asks for nothing the steps go on as without it.
    params, plain = _params(), _params()
    opt, reference = spec.make(params, cid), spec.make(plain, cid)
    _lockstep(opt, params, reference, plain, 2)
    for key, value, idle in (("weight_decay", 0.05, 0.0), ("maximize", True, False)):
        opt.param_groups[0][key] = value
        _assert_refused_leaving_all_as_it_was(opt, params, f"param group key '{key}' (got {value!r})")
        opt.param_groups[0][key] = idle
    _lockstep(opt, params, reference, plain, 2)


@by_spec
def test_a_tf_name_written_into_a_group_after_it_was_added_is_refused_at_the_next_step(
    spec: OptimSpec, cid: str
):
    # TF's names are taken when a group is added (test above); one written later would sit
    # beside the key the update reads. Refused until it is gone; the refused step changes nothing.
    renames = [(s.arg, s.key) for s in spec.cls._hypers if s.arg != s.key]
    params, plain = _params(), _params()
    opt, reference = spec.make(params, cid), spec.make(plain, cid)
    _lockstep(opt, params, reference, plain, 2)
    for arg, key in renames:
        for value in (opt.param_groups[0][key], 0.125):  # the key's own value is refused too
            opt.param_groups[0][arg] = value
            message = f"key {arg!r} (got {value!r}) was written after"
            _assert_refused_leaving_all_as_it_was(opt, params, message)
        del opt.param_groups[0][arg]
    _lockstep(opt, params, reference, plain, 2)


@by_spec
def test_a_tf_name_given_when_the_group_was_added_may_stay_with_that_value(spec: OptimSpec, cid: str):
    # As ZeroRedundancyOptimizer copies its own group (learning_rate=...) into this optimizer's
    # before each step: the copy holds the value the group was added with, the key is what is read.
    renames = [(s.arg, s.key) for s in spec.cls._hypers if s.arg != s.key]
    params, plain = _params(), _params()
    given = {arg: 0.25 for arg, _ in renames}
    opt = spec.make([{"params": params, **given}], cid)
    reference = spec.make([{"params": plain, **given}], cid)
    opt.param_groups[0]["lr"] = reference.param_groups[0]["lr"] = 0.5  # as a scheduler writes it
    for arg, _ in renames:
        opt.param_groups[0][arg] = 0.25
    _lockstep(opt, params, reference, plain, 2)
    opt.param_groups[0]["learning_rate"] = 0.5  # another value: now it asks for something
    _assert_refused_leaving_all_as_it_was(opt, params, "key 'learning_rate' (got 0.5) was written after")


def test_a_tf_name_in_a_loaded_group_is_kept_as_a_copy_until_written():
    # A state_dict saved from ZeroRedundancyOptimizer's local optimizer holds "learning_rate"
    # beside "lr": the loaded "lr" is read; a later write of the name is refused.
    spec = next(s for s in SPECS if s.name == "MomentumOptimizer")
    params, plain = _params(), _params()
    saved = spec.make(_params(seed=5)).state_dict()
    saved["param_groups"][0]["learning_rate"] = saved["param_groups"][0]["lr"]
    opt, reference = spec.make(params), spec.make(plain)
    opt.load_state_dict(saved)
    _lockstep(opt, params, reference, plain, 2)
    opt.param_groups[0]["learning_rate"] = 0.01
    _assert_refused_leaving_all_as_it_was(opt, params, "key 'learning_rate' (got 0.01) was written after")


def _assert_refused_leaving_all_as_it_was(
    opt: Any,
    params: list[torch.Tensor],
    message: str,
    error: type[Exception] = ValueError,
    pattern: bool = False,
) -> None:
    """The next step (gradients of step 7) raises ``error`` with ``message`` (a regular expression
    if ``pattern``) and changes no parameter and no state."""
    before = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in params]
    _set_grads(params, 7)
    with pytest.raises(error, match=message if pattern else re.escape(message)):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))
    assert _same_state(opt.state_dict(), before)


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_other_names_of_an_optimizers_own_hyperparameter_name_its_key():
    by_name = {spec.name: spec for spec in SPECS}
    cases = [
        ("MomentumOptimizer", "nesterov", False, "'use_nesterov'"),
        ("RMSPropOptimizer", "alpha", 0.9, "'decay'"),
        ("RMSPropOptimizer", "eps", 1e-10, "'epsilon'"),
        ("AdamOptimizer", "beta_2", 0.99, "'beta2'"),
        ("AdadeltaOptimizer", "eps", 1e-6, "'epsilon'"),
    ]
    for name, key, value, own in cases:
        # Any value: the equivalent exists here, so the key can only mean to set it.
        with pytest.raises(ValueError, match=f"'{key}' .*its key is {own}"):
            by_name[name].make([{"params": _params(), key: value}])


def test_a_parameter_in_two_groups_is_rejected():
    params = _params()
    with pytest.raises(ValueError, match="more than one parameter group"):
        SPECS[0].make([{"params": params}, {"params": params[:1]}])


@by_spec
def test_complex_parameters_are_rejected(spec: OptimSpec, cid: str):
    # An exception to torch's generic tests (which step complex params as
    # view_as_real): TF's v1 optimizers have no complex kernels to reproduce.
    with pytest.raises(ValueError, match="complex"):
        spec.make([torch.zeros(2, dtype=torch.complex64, requires_grad=True)], cid)


# ---------------------------------------------------------------- state
@by_spec
def test_state_holds_slots_only_when_the_optimizer_has_slots(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    _set_grads(params, 0)
    opt.step()
    if spec.slots_for(cid):
        assert set(opt.state) == set(params)
    else:
        assert len(opt.state) == 0  # as torch's SGD without momentum: no {p: {}} entries


@by_spec
def test_zero_grad(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    _set_grads(params, 0)
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@by_spec
def test_deepcopy_of_a_state_dict_loads_and_continues_in_lockstep(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    for step in range(3):
        _set_grads(params, step)
        opt.step()
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = spec.make(resumed_params, cid)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    _lockstep(opt, params, resumed, resumed_params, 3)


@by_spec
def test_state_dict_deterministic_as_torchs_own_test(spec: OptimSpec, cid: str):
    """torch's test_state_dict_deterministic: equal state dicts from equal runs, and a group listed
    twice (``param_groups.extend(param_groups)``) saved as the group it is."""
    params = _params()
    opt = spec.make(params, cid)
    for step in range(3):
        _set_grads(params, step)
        opt.step()
    copied_params = [p.detach().clone().requires_grad_() for p in params]
    copied = spec.make(copied_params, cid)
    copied.load_state_dict(copy.deepcopy(opt.state_dict()))
    _lockstep(opt, params, copied, copied_params, 3)
    torch.testing.assert_close(opt.state_dict(), copied.state_dict(), rtol=0, atol=0)
    copied.param_groups.extend(copied.param_groups)
    saved = copied.state_dict()
    assert saved["param_groups"][-1] == opt.state_dict()["param_groups"][-1]
    _set_grads(copied_params, 0)
    _set_grads(params, 0)
    copied.step()  # (a group listed twice is updated twice, as torch's optimizers do)


@by_spec
def test_state_dict_round_trips_through_weights_only_load(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    _set_grads(params, 0)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = spec.make(resumed_params, cid)
    resumed.load_state_dict(loaded)
    _lockstep(opt, params, resumed, resumed_params, 2)


@by_spec
def test_an_older_state_dict_without_flags_loads_and_steps(spec: OptimSpec, cid: str):
    # torch's test_can_load_older_state_dict: flags added in later versions are
    # filled with their defaults when missing.
    params = _params()
    opt = spec.make(params, cid)
    _set_grads(params, 0)
    opt.step()
    old = copy.deepcopy(opt.state_dict())
    # Adam's betas alias joined the group later than TF's beta1/beta2.
    flags = {"foreach", "betas", *(s.key for s in spec.cls._hypers if isinstance(s, Flag))}
    for group in old["param_groups"]:
        for flag in flags:
            group.pop(flag, None)
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = spec.make(resumed_params, cid)
    resumed.load_state_dict(old)
    assert all(flag in group for group in resumed.param_groups for flag in flags & set(opt.param_groups[0]))
    _lockstep(opt, params, resumed, resumed_params, 2)


@by_spec
def test_load_state_dict_casts_slots_to_the_parameters_dtype(spec: OptimSpec, cid: str):
    # torch's _process_value_according_to_param_policy: slots follow the
    # parameter's dtype; TF's float32 non-slot state (beta powers) stays float32.
    params = _params(torch.float32)
    opt = spec.make(params, cid)
    _set_grads(params, 0)
    opt.step()
    wide_params = [p.detach().double().requires_grad_() for p in params]
    wide = spec.make(wide_params, cid)
    wide.load_state_dict(opt.state_dict())
    for p, w in zip(params, wide_params, strict=True):
        for name, slot in wide.state.get(w, {}).items():
            assert slot.dtype == torch.float64, name
            assert torch.equal(slot, opt.state[p][name].double())
    _set_grads(wide_params, 1)
    wide.step()
    assert all(torch.isfinite(p).all() for p in wide_params)


@by_spec
@by_path
def test_a_variable_converted_after_its_slots_were_made_is_refused_until_they_are_reloaded(
    spec: OptimSpec, cid: str, path: dict[str, bool]
):
    # model.double() after a step replaces each p.data and leaves the float32 slots: the three
    # paths each mixed float64 variables with float32 slots their own way, with three results.
    params = _params(torch.float32)
    opt = spec.make(params, cid, **path)
    _set_grads(params, 0)
    opt.step()
    for p in params:
        p.data = p.data.double()
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref = spec.make(ref_params, cid, **path)
    ref.load_state_dict(opt.state_dict())  # (torch's load casts the slots to the variables' dtype)
    _set_grads(ref_params, 7)
    ref.step()
    if opt.state:
        message = r"slot '\w+' of variable .* is torch.float32 on cpu, but the variable is now torch.float64"
        _assert_refused_leaving_all_as_it_was(opt, params, message, TypeError, pattern=True)
        opt.load_state_dict(opt.state_dict())  # the remedy the error names
    _set_grads(params, 7)
    opt.step()
    for p, r in zip(params, ref_params, strict=True):
        assert p.dtype == torch.float64
        assert torch.equal(p, r)


@by_spec
@by_path
@pytest.mark.parametrize("shape", [(1, 5), (7,)], ids=["reshaped", "grown"])
def test_a_variable_given_memory_of_another_shape_after_its_slots_were_made_is_refused(
    spec: OptimSpec, cid: str, path: dict[str, bool], shape: tuple[int, ...]
):
    # p.data = ... of another shape (an embedding grown by rows, a view): the loop updated the
    # variables before it and then failed in torch's words; the fused path took a reshape of the
    # same size and updated it in memory order.
    params = _params(torch.float32)
    opt = spec.make(params, cid, **path)
    _set_grads(params, 0)
    opt.step()
    params[1].data = torch.linspace(-1, 1, math.prod(shape)).reshape(shape)
    if opt.state:
        message = rf"slot '\w+' of variable {re.escape(f'tensor(shape={shape}')}.* has shape \(5,\)"
        _assert_refused_leaving_all_as_it_was(opt, params, message, pattern=True)
        del opt.state[params[1]]  # the remedy the error names: its slots start again
    _set_grads(params, 7)
    opt.step()
    assert all(slot.shape == shape for slot in opt.state.get(params[1], {}).values())
    assert all(torch.isfinite(p).all() for p in params)


def _two_steps_with_slots(
    spec: OptimSpec, cid: str, path: dict[str, bool], group_each: bool = False
) -> tuple[list[torch.Tensor], Any]:
    """Two steps of ``spec`` over ``_params()`` (each in a param group of its own if
    ``group_each``); skips the test for an optimizer that keeps no slots."""
    params = _params(torch.float32)
    opt = spec.make([{"params": [p]} for p in params] if group_each else params, cid, **path)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    if not opt.state:
        pytest.skip(f"{spec.name} keeps no slots")
    return params, opt


@by_spec
@by_path
@pytest.mark.parametrize("change", ["replaced, reshaped", "reshaped in place", "replaced, float64"])
def test_a_slot_replaced_or_reshaped_after_a_step_is_refused(
    spec: OptimSpec, cid: str, path: dict[str, bool], change: str
):
    # A slot of another shape (of the same size) or dtype than its variable, put in the state
    # between two steps: the loop updated the variables before it and then failed in torch's
    # words, the fused path updated a reshaped slot in memory order without a word.
    params, opt = _two_steps_with_slots(spec, cid, path)
    state = opt.state[params[1]]
    name = next(iter(state))
    if change == "replaced, reshaped":
        state[name] = state[name].reshape(1, 5).clone()
    elif change == "reshaped in place":
        state[name].data = state[name].data.reshape(1, 5)
    else:
        state[name] = state[name].double()
    if change.endswith("float64"):
        message = (
            rf"slot '{name}' of variable .* is torch.float64 on cpu, but the variable is now torch.float32"
        )
        _assert_refused_leaving_all_as_it_was(opt, params, message, TypeError, pattern=True)
    else:
        message = rf"slot '{name}' of variable .* has shape \(1, 5\)"
        _assert_refused_leaving_all_as_it_was(opt, params, message, pattern=True)
    del opt.state[params[1]]  # the remedy the error names: its slots start again
    _set_grads(params, 7)
    opt.step()
    assert all(slot.shape == (5,) for slot in opt.state[params[1]].values())


@by_spec
@by_path
@pytest.mark.parametrize("change", ["deleted", "renamed"])
def test_a_slot_deleted_from_its_dict_is_refused_before_any_group_is_updated(
    spec: OptimSpec, cid: str, path: dict[str, bool], change: str
):
    # Each parameter in a group of its own: the update failed on the missing slot (a bare
    # KeyError) after the groups before it had been updated. A slot renamed kept as many slots,
    # of the same metadata, and went as far.
    params, opt = _two_steps_with_slots(spec, cid, path, group_each=True)
    state = opt.state[params[1]]
    if change == "deleted" and len(state) < 2:
        pytest.skip(f"{spec.name} keeps one slot: deleting it leaves no slot, made again at the next step")
    name = next(iter(state))
    if change == "deleted":
        del state[name]
    else:
        state[f"{name}_renamed"] = state.pop(name)
    message = rf"variable .* has slots .* but not \['{name}'\]: a slot was deleted"
    _assert_refused_leaving_all_as_it_was(opt, params, message, pattern=True)
    del opt.state[params[1]]  # the remedy the error names: its slots start again
    _set_grads(params, 7)
    opt.step()
    assert name in opt.state[params[1]]


def test_a_variable_converted_in_a_group_of_mixed_dtypes_is_refused():
    # A group of two dtypes has no one kind: each parameter's dtype is compared with the last step's.
    params = [_params(torch.float32)[0], _params(torch.bfloat16)[1]]
    opt = tgo.AdamOptimizer(params, 0.1)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    params[1].data = params[1].data.float()
    _set_grads(params, 2)
    with pytest.raises(
        TypeError, match=r"slot 'm' of variable .* is torch.bfloat16 on cpu, but the variable is now"
    ):
        opt.step()


@by_spec
def test_deepcopy_copies_all_public_attributes(spec: OptimSpec, cid: str):
    opt = spec.make(_params(), cid)
    clone = copy.deepcopy(opt)
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    assert public == {k for k in clone.__dict__ if not k.startswith("_")}
    assert repr(clone) == repr(opt)


@by_spec
def test_state_dict_and_load_state_dict_hooks_fire(spec: OptimSpec, cid: str):
    params = _params()
    opt = spec.make(params, cid)
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["sd pre", "sd post", "load pre", "load post"]


@by_wrapper
def test_state_dict_hooks_fire_on_a_wrapper_and_may_replace_what_it_loads(wrap):
    params = _params()
    wrapper = wrap(SPECS[0].make(params))
    calls: list[str] = []
    wrapper.register_state_dict_pre_hook(lambda o: calls.append("sd pre"))
    wrapper.register_state_dict_post_hook(lambda o, sd: calls.append("sd post"))

    def lower_lr(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("load pre")
        return {**sd, "param_groups": [{**g, "lr": 0.001} for g in sd["param_groups"]]}

    wrapper.register_load_state_dict_pre_hook(lower_lr)
    wrapper.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    saved = wrapper.state_dict()
    wrapper.load_state_dict(saved)
    assert calls == ["sd pre", "sd post", "load pre", "load post"]
    assert wrapper.param_groups[0]["lr"] == 0.001 and saved["param_groups"][0]["lr"] != 0.001


# ---------------------------------------------------------------- with torch's tools
@by_spec
def test_grad_scaler_steps_as_without_scaling(spec: OptimSpec, cid: str):
    # GradScaler unscales by a power of two (exact), so the update is bitwise
    # the unscaled one. torch's test_grad_scaling_autocast, on CPU.
    scaled_params, plain_params = _params(), _params()
    scaled, plain = spec.make(scaled_params, cid), spec.make(plain_params, cid)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        loss = sum((p * g).sum() for p, g in zip(scaled_params, _grads(scaled_params, step), strict=True))
        scaler.scale(loss).backward()
        scaler.step(scaled)
        scaled.zero_grad()
        scaler.update()
        _set_grads(plain_params, step)
        plain.step()
    for s, p in zip(scaled_params, plain_params, strict=True):
        assert torch.equal(s, p)


@by_spec
def test_state_dict_is_deterministic_for_equal_parameters(spec: OptimSpec, cid: str):
    # torch's test_state_dict_deterministic: equal but not identical parameters,
    # driven alike, give equal state dicts.
    a_params, b_params = _params(), _params()
    a, b = spec.make(a_params, cid), spec.make(b_params, cid)
    _lockstep(a, a_params, b, b_params, 3)
    torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [False, True], ids=["reference", "foreach"])
@by_spec
def test_non_contiguous_parameters_step_as_contiguous_ones(spec: OptimSpec, cid: str, foreach: bool):
    gen = torch.Generator().manual_seed(3)
    strided = [
        torch.randn(4, 3, 2, generator=gen)[..., 0].requires_grad_(),
        torch.randn(3, 5, generator=gen).t().requires_grad_(),
        # (The foreach path's temporaries are laid out as a channels-last parameter.)
        torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last).requires_grad_(),
    ]
    assert not any(p.is_contiguous() for p in strided)
    dense = [p.detach().contiguous().requires_grad_() for p in strided]
    a, b = spec.make(strided, cid, foreach=foreach), spec.make(dense, cid, foreach=foreach)
    _lockstep(a, strided, b, dense, 3)


@by_spec
def test_one_group_of_mixed_dtypes(spec: OptimSpec, cid: str):
    # torch's test_mixed_device_dtype, on one device: each dtype is updated in
    # its own precision whichever path runs.
    def make_params() -> list[torch.Tensor]:
        return [_params(torch.float32)[0], _params(torch.float64)[1], _params(torch.bfloat16)[0]]

    results = []
    for foreach in (False, True):
        params = make_params()
        opt = spec.make(params, cid, foreach=foreach)
        for step in range(3):
            _set_grads(params, step)
            opt.step()
        results.append(params)
    for ref, fe in zip(*results, strict=True):
        assert torch.equal(ref, fe)
    for p, fresh in zip(results[0], make_params(), strict=True):
        assert p.dtype == fresh.dtype
