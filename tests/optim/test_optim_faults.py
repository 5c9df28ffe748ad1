"""Hyperparameters that go bad after construction, for the optimizers where TF's range says so.

The generic table (test_optim_generic.py) covers what holds for every optimizer:
a learning rate written into a group, sparse rows out of range, loaded state.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from optim_specs import SPECS

import torchgrad_compat.optim as tgo


def _pair(value: float = 1.0):
    p = torch.ones(3, requires_grad=True)
    return p, torch.full((3,), value)


def test_lambda_lr_driving_ftrl_learning_rate_to_zero_is_refused_before_the_update():
    p, g = _pair()
    opt = tgo.FtrlOptimizer([p], learning_rate=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 - epoch)
    p.grad = g
    opt.step()
    sched.step()  # FTRL divides by the learning rate: TF requires it to be > 0
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    with pytest.raises(
        ValueError, match=r"Invalid learning_rate value: 0\.0; expected a value in \(0\.0, inf\)"
    ):
        opt.step()
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())


@pytest.mark.parametrize(
    ("key", "value"), [("beta1", 1.0), ("beta2", 1.0), ("epsilon", 1e39), ("beta1", math.nan)]
)
def test_adam_hyperparameters_written_after_construction_are_checked(key, value):
    p, g = _pair()
    opt = tgo.AdamOptimizer([p], learning_rate=0.1)
    opt.apply_gradients([(g, p)])
    powers = [opt.state_dict()["param_groups"][0][k].clone() for k in ("beta1_power", "beta2_power")]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=f"Invalid {key} value"):
        opt.apply_gradients([(g, p)])
    after = [opt.state_dict()["param_groups"][0][k] for k in ("beta1_power", "beta2_power")]
    assert all(torch.equal(a, b) for a, b in zip(after, powers, strict=True))  # beta powers did not advance


def test_hyperparameters_are_checked_in_float32_whatever_the_parameter_dtype():
    # TF converts every hyperparameter to a float32 tensor before casting it to the variable's dtype,
    # and so does HyperScalars: 1e39 is inf there even for a float64 variable.
    p = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"momentum value: 1e\+40.*rounds to inf"):
        tgo.MomentumOptimizer([p], learning_rate=0.1, momentum=1e40)
    with pytest.raises(ValueError, match="l2_shrinkage_regularization_strength value: 1e\\+39"):
        tgo.FtrlOptimizer([p], learning_rate=0.1, l2_shrinkage_regularization_strength=1e39)
    # The largest float32 is still a number: accepted.
    tgo.GradientDescentOptimizer([p], learning_rate=3.4028234663852886e38)


@pytest.mark.parametrize(
    ("cls", "arg"),
    [
        (tgo.AdagradOptimizer, "initial_accumulator_value"),
        (tgo.ProximalAdagradOptimizer, "initial_accumulator_value"),
        (tgo.FtrlOptimizer, "initial_accumulator_value"),
        (tgo.AdagradDAOptimizer, "initial_gradient_squared_accumulator_value"),
    ],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_slot_initial_values_are_checked_in_the_slot_dtype(cls, arg):
    # The slot is filled in the parameter's dtype: 1e5 is inf in float16 (every later update would be 0),
    # 1e39 is a number in float64, as in TF's constant initializer.
    half = torch.ones(3, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match=rf"Invalid {arg} value: 100000\.0.*rounded to float16"):
        cls([half], learning_rate=0.1, **{arg: 1e5})
    wide = torch.ones(3, dtype=torch.float64, requires_grad=True)
    opt = cls([wide], learning_rate=0.1, **{arg: 1e39})
    opt.add_param_group({"params": [torch.ones(2, requires_grad=True)], arg: 1.0})
    with pytest.raises(ValueError, match="rounded to float32"):
        opt.add_param_group({"params": [torch.ones(2, requires_grad=True)]})  # 1e39 reaches a float32 slot
    # Written after construction: checked when it is about to fill a new slot, before any update.
    other = torch.ones(3, dtype=torch.float16, requires_grad=True)
    opt = cls([half, other], learning_rate=0.1)
    opt.apply_gradients([(torch.ones(3, dtype=torch.float16), half)])
    opt.param_groups[0][next(h.key for h in opt._hypers if h.arg == arg)] = 1e5
    before = half.detach().clone()
    with pytest.raises(ValueError, match=rf"Invalid {arg} value: 100000\.0.*rounded to float16"):
        opt.apply_gradients([(torch.ones(3, dtype=torch.float16), p) for p in (half, other)])
    assert torch.equal(half.detach(), before) and not opt.state.get(other)


def test_compute_gradients_refuses_a_single_tensor_as_var_list():
    # Iterating a tensor gives its rows: every gradient came back None, with no error.
    p = torch.ones(4, 3, requires_grad=True)
    opt = tgo.GradientDescentOptimizer([p], learning_rate=0.1)
    with pytest.raises(
        TypeError, match=r"var_list must be a list of tensors.*shape=\(4, 3\).*pass \[tensor\]"
    ):
        opt.compute_gradients((p**2).sum(), var_list=p)
    assert opt.compute_gradients((p**2).sum(), var_list=[p])[0][0] is not None


def test_a_scheduler_over_a_callable_learning_rate_gets_a_named_error_at_the_first_step():
    p = torch.ones(3, requires_grad=True)
    opt = tgo.GradientDescentOptimizer([p], learning_rate=lambda: 0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # would fail later: "unsupported operand ... function"
    p.grad = torch.ones(3)
    with pytest.raises(
        RuntimeError, match="learning_rate is a callable.*lr_scheduler.*a number or a 0-d tensor"
    ):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize(
    ("cls", "key", "bad"),
    [
        (tgo.AdamOptimizer, "beta1_power", torch.tensor(1.0)),  # 1 - beta1_power = 0: a division by zero
        (tgo.AdamOptimizer, "beta2_power", torch.tensor(-0.5)),
        (tgo.AdagradDAOptimizer, "global_step", torch.tensor(-5)),
    ],
    ids=["adam-beta1_power=1", "adam-beta2_power<0", "adagradda-global_step<0"],
)
def test_loaded_non_slot_state_is_range_checked(cls, key, bad):
    p, g = _pair()
    opt = cls([p], learning_rate=0.1)
    opt.apply_gradients([(g, p)])
    sd = opt.state_dict()
    sd["param_groups"][0][key] = bad
    fresh = cls([torch.ones(3, requires_grad=True)], learning_rate=0.5)
    with pytest.raises(ValueError, match=f"Invalid {key} value"):
        fresh.load_state_dict(sd)
    assert not fresh.state and fresh.param_groups[0]["lr"] == 0.5


def _snapshot(opt) -> list[torch.Tensor]:
    """Every parameter, slot and non-slot tensor of ``opt``, cloned."""
    out = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    out += [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out += [v.clone() for g in opt.param_groups for v in g.values() if isinstance(v, torch.Tensor)]
    return out


def _unchanged(opt, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_snapshot(opt), before, strict=True))


@pytest.mark.parametrize("cls", [tgo.GradientDescentOptimizer, tgo.AdamOptimizer])
def test_a_parameter_listed_twice_is_refused(cls):
    # torch only warns, and the step would update it twice.
    p, q = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="parameter 2 of the group is parameter 0 again"):
        cls([p, q, p], learning_rate=0.1)
    opt = cls([q], learning_rate=0.1)
    with pytest.raises(ValueError, match="parameter 1 of the group is parameter 0 again"):
        opt.add_param_group({"params": [p, p]})
    assert len(opt.param_groups) == 1


def test_parameters_a_step_cannot_update_in_place_are_refused_at_construction():
    with torch.inference_mode():
        made_in_inference = torch.ones(3)
    with pytest.raises(ValueError, match="parameter 1 of the group is an inference tensor"):
        tgo.AdamOptimizer([torch.ones(3, requires_grad=True), made_in_inference], learning_rate=0.1)
    expanded = torch.ones(1, requires_grad=True).expand(3)
    with pytest.raises(ValueError, match=r"parameter 0 of the group is an expanded view \(strides \(0,\)\)"):
        tgo.GradientDescentOptimizer([expanded], learning_rate=0.1)


@pytest.mark.parametrize("kind", ["meta", "inference"])
def test_a_global_step_that_cannot_be_incremented_is_refused_before_the_update(kind):
    if kind == "meta":
        step = torch.zeros((), dtype=torch.int64, device="meta")
    else:
        with torch.inference_mode():
            step = torch.zeros((), dtype=torch.int64)
    p, g = _pair()
    opt = tgo.AdamOptimizer([p], learning_rate=0.1)
    opt.apply_gradients([(g, p)])
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="Invalid global_step value"):
        opt.apply_gradients([(g, p)], global_step=step)
    assert _unchanged(opt, before)


def test_adagrad_da_refuses_a_negative_global_step_before_any_update():
    p, g = _pair()
    with pytest.raises(ValueError, match=r"Invalid global_step value: -1; expected >= 0"):
        tgo.AdagradDAOptimizer([p], learning_rate=0.1, global_step=torch.tensor(-1))
    step = torch.tensor(3)
    opt = tgo.AdagradDAOptimizer([p], learning_rate=0.1, global_step=step)
    p.grad = g
    opt.step()
    before = _snapshot(opt)
    step.fill_(-2)
    with pytest.raises(ValueError, match=r"Invalid global_step value: -2; expected >= 0"):
        opt.step()
    assert _unchanged(opt, before)


@pytest.mark.parametrize("cls", [tgo.AdamOptimizer, tgo.AdagradOptimizer, tgo.FtrlOptimizer])
def test_a_sparse_gradient_marked_coalesced_with_duplicate_rows_is_refused(cls):
    # coalesce() trusts the mark: the duplicate rows would each be applied as if alone.
    p = torch.ones(4, 2, requires_grad=True)
    opt = cls([p], learning_rate=0.1)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.ones(2, 2), (4, 2), is_coalesced=True)
    with pytest.raises(ValueError, match="marked coalesced, but its row indices are not sorted and unique"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4, 2)) and not opt.state
    # The same rows unmarked are summed, as TF sums duplicate indices.
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.ones(2, 2), (4, 2))
    opt.step()
    q = torch.ones(4, 2, requires_grad=True)
    reference = cls([q], learning_rate=0.1)
    q.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.full((1, 2), 2.0), (4, 2))
    reference.step()
    assert torch.equal(p.detach(), q.detach())


def test_a_sparse_tensor_hyperparameter_is_refused():
    p, _ = _pair()
    lr = torch.tensor(0.1).to_sparse()
    with pytest.raises(TypeError, match="learning_rate given as a tensor must be dense"):
        tgo.AdamOptimizer([p], learning_rate=lr)
    opt = tgo.AdamOptimizer([p], learning_rate=0.1)
    opt.param_groups[0]["epsilon"] = torch.tensor(1e-8).to_sparse()
    p.grad = torch.ones(3)
    with pytest.raises(TypeError, match="epsilon given as a tensor must be dense"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


def test_an_int_too_large_for_a_float_is_named():
    p, _ = _pair()
    with pytest.raises(ValueError, match="Invalid learning_rate value: an int of 1329 bits"):
        tgo.GradientDescentOptimizer([p], learning_rate=10**400)


def test_adam_betas_that_require_grad_give_beta_powers_outside_autograd():
    p, g = _pair()
    beta1 = torch.tensor(0.9, requires_grad=True)
    opt = tgo.AdamOptimizer([p], learning_rate=0.1, beta1=beta1)
    opt.apply_gradients([(g, p)])
    assert opt.param_groups[0]["beta1_power"].grad_fn is None
    state = copy.deepcopy(opt.state_dict())
    assert float(state["param_groups"][0]["beta1_power"]) == pytest.approx(0.81)


def test_a_loaded_slot_that_overflows_the_parameters_dtype_is_refused():
    # torch casts loaded slots to the parameter's dtype: float64 1e39 would become inf in float32.
    p, g = _pair()
    opt = tgo.AdamOptimizer([p], learning_rate=0.1)
    p.grad = g
    opt.step()
    state = copy.deepcopy(opt.state_dict())  # (its slot dicts are the optimizer's own)
    before = _snapshot(opt)
    state["state"][0]["m"] = torch.full((3,), 1e39, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"slot 'm' of parameter 0 \(torch.float64\) holds finite values that overflow"
    ):
        opt.load_state_dict(state)
    assert _unchanged(opt, before)
    state["state"][0]["m"] = torch.full((3,), 0.5, dtype=torch.float64)
    opt.load_state_dict(state)  # a float64 slot that fits loads (cast, as torch does)
    assert opt.state[p]["m"].dtype == torch.float32


@pytest.mark.parametrize("spec", SPECS, ids=[spec.name for spec in SPECS])
def test_torch_argument_names_are_told_the_tf_argument_to_use(spec):
    """A user swapping torch.optim.X types torch's names; each gets TF's name, or why there is none."""
    params = [torch.nn.Parameter(torch.ones(2))]
    config = dict(next(iter(spec.configs.values())))
    config.pop("learning_rate", None)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'lr': .*learning_rate"):
        spec.cls(params, lr=0.1, **config)
    with pytest.raises(TypeError, match="'weight_decay': TensorFlow's v1 optimizers apply no weight decay"):
        spec.make(params, weight_decay=0.01)
    with pytest.raises(TypeError, match="did you mean 'learning_rate'"):
        spec.cls(params, learnig_rate=0.1, **config)


def test_adams_torch_names_are_told_their_tf_names():
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(TypeError, match="'betas': pass TensorFlow's beta1= and beta2="):
        tgo.AdamOptimizer(params, betas=(0.9, 0.99))
    with pytest.raises(TypeError, match="'eps': its name here is epsilon"):
        tgo.AdamOptimizer(params, eps=1e-7)
    with pytest.raises(TypeError, match="'nesterov': its name here is use_nesterov"):
        tgo.MomentumOptimizer(params, 0.1, 0.9, nesterov=True)


def _stepped(opt, params):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize(
    ("source", "target", "key"),
    [
        (
            lambda ps: tgo.ProximalAdagradOptimizer(ps, 0.1, l1_regularization_strength=0.1),
            tgo.AdagradOptimizer,
            "l1",
        ),
        (
            lambda ps: tgo.ProximalGradientDescentOptimizer(ps, 0.1, l2_regularization_strength=0.1),
            tgo.GradientDescentOptimizer,
            "l2",
        ),
        (
            lambda ps: torch.optim.SGD(ps, 0.1, weight_decay=0.01),
            tgo.GradientDescentOptimizer,
            "weight_decay",
        ),
    ],
    ids=["l1-into-adagrad", "l2-into-gradient-descent", "sgd-weight-decay"],
)
def test_another_optimizers_hyperparameter_is_refused_at_load_with_nothing_changed(source, target, key):
    params = [torch.nn.Parameter(torch.ones(3))]
    saved = _stepped(source(params), params).state_dict()
    opt = _stepped(target(params, 0.1), params)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"loaded param group 0: .*'{key}'"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    torch.testing.assert_close(after["state"], before["state"], rtol=0, atol=0)
    _stepped(opt, params)  # (and the next step runs)


def test_a_slot_on_the_meta_device_is_refused_by_name():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = _stepped(tgo.AdamOptimizer(params, 0.1), params)
    saved = opt.state_dict()
    saved["state"][0]["m"] = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="loaded slot 'm' of parameter 0 is a meta tensor"):
        opt.load_state_dict(saved)


def test_a_loss_scale_that_differs_between_groups_is_refused_at_load():
    from torchgrad_compat.amp import LossScaleOptimizer

    first, second = [torch.nn.Parameter(torch.ones(2))], [torch.nn.Parameter(torch.ones(2))]
    opt = LossScaleOptimizer(tgo.AdamOptimizer([{"params": first}, {"params": second}], 0.1))
    saved = opt.state_dict()
    saved["param_groups"][1]["loss_scale_current_loss_scale"] = torch.tensor(2.0)
    with pytest.raises(
        ValueError, match="param group 1 holds tensor\\(2.\\) for 'loss_scale_current_loss_scale'"
    ):
        opt.load_state_dict(saved)
    assert float(opt.loss_scale()) == 2.0**15


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cls", [tgo.GradientDescentOptimizer, tgo.AdagradDAOptimizer])
def test_a_global_step_at_its_largest_value_is_refused_before_anything_changes(cls, dtype):
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = cls(params, 0.1)
    largest = torch.iinfo(dtype).max
    global_step = torch.tensor(largest, dtype=dtype)
    with pytest.raises(ValueError, match=rf"Invalid global_step value: {largest} is the largest"):
        opt.apply_gradients([(torch.ones(3), params[0])], global_step=global_step)
    assert int(global_step) == largest
    assert torch.equal(params[0].detach(), torch.ones(3)) and not opt.state
    if cls is tgo.AdagradDAOptimizer:
        with pytest.raises(ValueError, match="is the largest"):
            tgo.AdagradDAOptimizer(params, 0.1, global_step=global_step)


def test_step_unscaling_refuses_gradients_its_kernels_would_not_unscale_once():
    """step(unscaling=...) on gradients the fused kernels would leave scaled (sparse, half) or unscale
    twice (one tensor for two parameters) is refused with nothing changed, not a silent wrong step."""
    from torchgrad_compat.optim.wrapper import Unscaling

    inv = torch.tensor(0.5)
    # A sparse gradient goes through the sparse rule, which does not unscale.
    table = torch.nn.Parameter(torch.ones(4, 2))
    opt = tgo.GradientDescentOptimizer([table], 1.0, fused=True)
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([[2.0, 2.0]]), (4, 2))
    with pytest.raises(ValueError, match=r"step\(unscaling=...\): the gradients of param group 0"):
        opt.step(unscaling=Unscaling(inv))
    # Half precision goes through float32 working copies: p.grad would keep its scale.
    half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = tgo.GradientDescentOptimizer([half], 1.0, fused=True)
    half.grad = torch.full((3,), 2.0, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 or float64, on the CPU"):
        opt.step(unscaling=Unscaling(inv))
    # One tensor as two parameters' gradient would be multiplied by inv twice.
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = tgo.GradientDescentOptimizer([a, b], 1.0, fused=True)
    a.grad = b.grad = torch.full((3,), 2.0)
    with pytest.raises(ValueError, match="would be unscaled twice"):
        opt.step(unscaling=Unscaling(inv))
    for p, value in ((table, 1.0), (half, 1.0), (a, 1.0), (b, 1.0)):
        assert torch.equal(p.detach(), torch.full_like(p, value))
    assert torch.equal(a.grad, torch.full((3,), 2.0))
