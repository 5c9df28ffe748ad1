"""Checkpoints through torch's own tools, in one process: every optimizer and wrapper resumes bitwise.

A run of ``STEPS`` steps is checkpointed after ``SPLIT`` and resumed in a fresh
model and optimizer through each tool; the resumed parameters, slots and every
optimizer-wide value (beta powers, AdagradDA's step, the loss scale and its
counter) must equal the uninterrupted run's bit for bit. The tools:

- ``torch.save``/``torch.load(weights_only=True)`` of ``state`` and
  ``param_groups`` only, as frameworks that rebuild the dict from torch's two keys do;
- ``torch.distributed.checkpoint``: ``get_state_dict``/``set_state_dict`` with
  ``dcp.save``/``dcp.load`` (nested and flattened optimizer state);
- ``ZeroRedundancyOptimizer``: ``consolidate_state_dict`` then ``load_state_dict``,
  in a one-rank gloo group (two ranks: tests/optim/test_fsdp2.py).

Checkpoints of this package's earlier layout (a top-level ``non_slot_state``;
a wrapper's ``{"optimizer": ..., "loss_scale": ...}``; a whole pickled optimizer)
still load. Also here: DCP's state-initialising zero-gradient step changes no
number; non-slot state written into the groups around ``load_state_dict`` (as
ZeRO does) is checked before the next step; DTensor gradients of the wrong
layout are refused before anything changes (FSDP2 itself: tests/optim/test_fsdp2.py).
AGNOptimizer, which needs a parameter server, is resumed in tests/agn/test_agn.py.
"""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _host_reads import HostReads
from _procs import free_port
from optim_specs import SPECS, spec_configs
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer
from torchgrad_compat.xla import CrossShardOptimizer

STEPS, SPLIT = 5, 3


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return ((model(x) - y) ** 2).mean()


def _train(model: nn.Module, opt: Any, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss = _loss(model, step)
        if isinstance(opt, LossScaleOptimizer):
            loss = opt.get_scaled_loss(loss)
        loss.backward()
        opt.step()


# ---------------------------------------------------------------- what is trained
def _core(spec, cid, foreach=False):
    return lambda params: spec.make(params, cid, foreach=foreach)


def _lso_adam(params):
    # increment_period=2: the scale grows during the run, so a lost counter shows.
    return LossScaleOptimizer(
        tgo.AdamOptimizer(params, learning_rate=0.01),
        DynamicLossScale(initial_loss_scale=8, increment_period=2),
    )


def _lso_torch_adam(params):
    return LossScaleOptimizer(torch.optim.Adam(params, lr=0.01), DynamicLossScale(increment_period=2))


def _cross_shard_adam(params):
    return CrossShardOptimizer(tgo.AdamOptimizer(params, learning_rate=0.01))


def _lso_cross_shard_adagrad_da(params):
    return LossScaleOptimizer(
        CrossShardOptimizer(tgo.AdagradDAOptimizer(params, learning_rate=0.1)),
        DynamicLossScale(increment_period=3),
    )


CORE = [
    pytest.param(_core(spec, cid), id=f"{spec.name.removesuffix('Optimizer')}-{cid}")
    for spec, cid in spec_configs()
]
CORE_FOREACH = [
    pytest.param(
        _core(spec, next(iter(spec.configs)), True), id=f"{spec.name.removesuffix('Optimizer')}-foreach"
    )
    for spec in SPECS
]
WRAPPERS = [
    pytest.param(_lso_adam, id="LossScale-Adam"),
    pytest.param(_lso_torch_adam, id="LossScale-torchAdam"),
    pytest.param(_cross_shard_adam, id="CrossShard-Adam"),
    pytest.param(_lso_cross_shard_adagrad_da, id="LossScale-CrossShard-AdagradDA"),
]
ALL = CORE + CORE_FOREACH + WRAPPERS


def _snapshot(model: nn.Module, opt: Any) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then every optimizer state tensor, by name: what must match bitwise."""
    out = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    variables = opt.variables() if hasattr(opt, "variables") else []
    out.extend((f"variable{i}", v.detach().clone()) for i, v in enumerate(variables))
    if isinstance(opt, LossScaleOptimizer):
        out.append(("loss_scale", opt.loss_scale()))
    return out


def _assert_bitwise(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [name for name, _ in a] == [name for name, _ in b]
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), f"{name} differs after resuming: {x} vs {y}"


def _reference(make: Callable) -> list[tuple[str, torch.Tensor]]:
    model = _model()
    opt = make(list(model.parameters()))
    _train(model, opt, range(STEPS))
    return _snapshot(model, opt)


def _resume(make: Callable, checkpoint: Callable, restore: Callable) -> list[tuple[str, torch.Tensor]]:
    """Train SPLIT steps, ``checkpoint(model, opt)``; a fresh pair, ``restore(model, opt, saved)``; finish."""
    model = _model()
    opt = make(list(model.parameters()))
    _train(model, opt, range(SPLIT))
    saved = checkpoint(model, opt)
    # Training on after the checkpoint must not reach into it.
    _train(model, opt, range(SPLIT, STEPS))
    fresh_model = _model(seed=1)
    fresh = make(list(fresh_model.parameters()))
    restore(fresh_model, fresh, saved)
    _train(fresh_model, fresh, range(SPLIT, STEPS))
    return _snapshot(fresh_model, fresh)


# ---------------------------------------------------------------- torch.save, two keys
def _save_two_keys(model, opt):
    sd = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optim": {"state": sd["state"], "param_groups": sd["param_groups"]}},
        buffer,
    )
    return buffer.getvalue()


def _load_weights_only(model, opt, saved):
    loaded = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])


@pytest.mark.parametrize("make", ALL)
def test_state_dict_has_torch_keys_and_resumes_through_torch_save(make):
    model = _model()
    opt = make(list(model.parameters()))
    _train(model, opt, range(1))
    assert set(opt.state_dict()) == {"state", "param_groups"}
    _assert_bitwise(_resume(make, _save_two_keys, _load_weights_only), _reference(make))


# ---------------------------------------------------------------- DCP, one process
def _dcp_checkpoint(options: StateDictOptions | None, tmp_path):
    def checkpoint(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        path = tmp_path / "ckpt"
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        return path

    def restore(model, opt, path):
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )

    return checkpoint, restore


@pytest.mark.parametrize("make", ALL)
def test_dcp_resume_is_bitwise(make, tmp_path):
    checkpoint, restore = _dcp_checkpoint(None, tmp_path)
    _assert_bitwise(_resume(make, checkpoint, restore), _reference(make))


@pytest.mark.parametrize("make", CORE_FOREACH + WRAPPERS)
def test_dcp_flattened_optimizer_state_resume_is_bitwise(make, tmp_path):
    checkpoint, restore = _dcp_checkpoint(StateDictOptions(flatten_optimizer_state_dict=True), tmp_path)
    _assert_bitwise(_resume(make, checkpoint, restore), _reference(make))


# ---------------------------------------------------------------- ZeroRedundancyOptimizer, one rank
@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _zero(spec, cid):
    def make(params):
        return ZeroRedundancyOptimizer(params, optimizer_class=spec.cls, **spec.configs[cid])

    return make


def _lso_zero_adam(params):
    zero = ZeroRedundancyOptimizer(params, optimizer_class=tgo.AdamOptimizer, learning_rate=0.01)
    return LossScaleOptimizer(zero, DynamicLossScale(initial_loss_scale=8, increment_period=2))


ZERO = [
    pytest.param(_zero(spec, cid), id=f"{spec.name.removesuffix('Optimizer')}-{cid}")
    for spec, cid in spec_configs()
]
ZERO.append(pytest.param(_lso_zero_adam, id="LossScale-ZeRO-Adam"))


def _zero_inner(opt):
    return opt.inner_optimizer if isinstance(opt, LossScaleOptimizer) else opt


def _zero_snapshot(model, opt):
    local = _zero_inner(opt).optim
    out = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    out.extend((f"variable{i}", v.detach().clone()) for i, v in enumerate(local.variables()))
    if isinstance(opt, LossScaleOptimizer):
        out.extend(("loss_scale", v.clone()) for v in opt.loss_scale.variables())
    return out


def _zero_checkpoint(model, opt):
    _zero_inner(opt).consolidate_state_dict(to=0)
    return copy.deepcopy((model.state_dict(), opt.state_dict()))


def _zero_restore(model, opt, saved):
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])


@pytest.mark.parametrize("make", ZERO)
def test_zero_redundancy_optimizer_resume_is_bitwise(make, one_rank_group):
    model = _model()
    opt = make(list(model.parameters()))
    _train(model, opt, range(STEPS))
    expected = _zero_snapshot(model, opt)

    model = _model()
    opt = make(list(model.parameters()))
    _train(model, opt, range(SPLIT))
    saved = _zero_checkpoint(model, opt)
    fresh_model = _model(seed=1)
    fresh = make(list(fresh_model.parameters()))
    _zero_restore(fresh_model, fresh, saved)
    _train(fresh_model, fresh, range(SPLIT, STEPS))
    _assert_bitwise(_zero_snapshot(fresh_model, fresh), expected)


def test_zero_redundancy_optimizer_follows_lr_and_refuses_learning_rate_written_later(one_rank_group):
    # ZeRO keeps its constructor's learning_rate= in its groups and copies them into the local
    # optimizer before each step, beside "lr", which a scheduler writes and the update reads.
    model, plain_model = _model(), _model()
    zero = ZeroRedundancyOptimizer(
        list(model.parameters()), optimizer_class=tgo.MomentumOptimizer, learning_rate=0.1, momentum=0.5
    )
    plain = tgo.MomentumOptimizer(plain_model.parameters(), learning_rate=0.1, momentum=0.5)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (zero, plain)]
    for step in range(3):
        for m, o, sched in zip((model, plain_model), (zero, plain), schedulers, strict=True):
            _train(m, o, range(step, step + 1))
            sched.step()
    assert zero.optim.param_groups[0]["learning_rate"] == 0.1
    _assert_bitwise(list(model.named_parameters()), list(plain_model.named_parameters()))
    # Written by the user on ZeRO's group, it is copied into the local one and would be ignored.
    zero.param_groups[0]["learning_rate"] = 0.01
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=re.escape("key 'learning_rate' (got 0.01) was written after")):
        _train(model, zero, range(3, 4))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


# ---------------------------------------------------------------- the earlier layout
def _old_adam_state_dict(model: nn.Module, opt: tgo.AdamOptimizer) -> dict[str, Any]:
    """Adam's state dict as this package wrote it before: beta powers under a top-level "non_slot_state"."""
    params = list(model.parameters())
    group = opt.param_groups[0]
    return {
        "state": {
            i: {"m": opt.get_slot(p, "m").clone(), "v": opt.get_slot(p, "v").clone()}
            for i, p in enumerate(params)
        },
        "param_groups": [
            {
                "lr": 0.01,
                "beta1": 0.9,
                "beta2": 0.999,
                "betas": (0.9, 0.999),
                "epsilon": 1e-08,
                "foreach": None,
                "params": list(range(len(params))),
            }
        ],
        "non_slot_state": [
            {"beta1_power": group["beta1_power"].clone(), "beta2_power": group["beta2_power"].clone()}
        ],
    }


def _adam(params):
    return tgo.AdamOptimizer(params, learning_rate=0.01)


def _old_lso_state_dict(model: nn.Module, opt: LossScaleOptimizer) -> dict[str, Any]:
    return {
        "optimizer": _old_adam_state_dict(model, opt.inner_optimizer),
        "loss_scale": {
            "class": "DynamicLossScale",
            "initial_loss_scale": 8,
            "increment_period": 2,
            "multiplier": 2.0,
            "current_loss_scale": opt.loss_scale(),
            "good_steps": opt.loss_scale.good_steps,
        },
    }


def _old_adagrad_da_state_dict(model: nn.Module, opt: tgo.AdagradDAOptimizer) -> dict[str, Any]:
    params = list(model.parameters())
    slots = ("gradient_accumulator", "gradient_squared_accumulator")
    return {
        "state": {i: {s: opt.get_slot(p, s).clone() for s in slots} for i, p in enumerate(params)},
        "param_groups": [
            {
                "lr": 0.1,
                "initial_gradient_squared_accumulator_value": 0.1,
                "l1": 0.0,
                "l2": 0.0,
                "foreach": None,
                "params": list(range(len(params))),
            }
        ],
        "non_slot_state": [{"global_step": opt.param_groups[0]["global_step"].clone()}],
    }


OLD_LAYOUTS = [
    pytest.param(_adam, _old_adam_state_dict, id="Adam"),
    pytest.param(
        lambda ps: tgo.AdagradDAOptimizer(ps, learning_rate=0.1), _old_adagrad_da_state_dict, id="AdagradDA"
    ),
    pytest.param(_lso_adam, _old_lso_state_dict, id="LossScale-Adam"),
    pytest.param(
        _cross_shard_adam,
        lambda model, opt: {"optimizer": _old_adam_state_dict(model, opt.inner_optimizer)},
        id="CrossShard-Adam",
    ),
]


@pytest.mark.parametrize(("make", "old_layout"), OLD_LAYOUTS)
def test_earlier_layout_loads_and_resumes_bitwise(make, old_layout):
    def checkpoint(model, opt):
        return copy.deepcopy((model.state_dict(), old_layout(model, opt)))

    def restore(model, opt, saved):
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        assert set(opt.state_dict()) == {"state", "param_groups"}

    _assert_bitwise(_resume(make, checkpoint, restore), _reference(make))


def test_earlier_layout_is_checked_as_the_current_one():
    model = _model()
    opt = _adam(list(model.parameters()))
    _train(model, opt, range(2))
    old = _old_adam_state_dict(model, opt)
    old["non_slot_state"][0]["beta1_power"] = torch.tensor(1.0)  # 1 - beta1_power = 0: a division by zero
    fresh = tgo.AdamOptimizer(list(_model().parameters()), learning_rate=0.5)
    with pytest.raises(ValueError, match="Invalid beta1_power value"):
        fresh.load_state_dict(old)
    old["non_slot_state"] = [{}]
    with pytest.raises(ValueError, match="lacks the non-slot state"):
        fresh.load_state_dict(old)
    assert not fresh.state and fresh.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("make", WRAPPERS)
def test_dcp_flattened_load_into_a_wrapper_that_never_saved(make, tmp_path):
    """set_optimizer_state_dict alone (no get_state_dict first) finds the wrapper's keys in live groups."""
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _model()
    opt = make(list(model.parameters()))
    _train(model, opt, range(SPLIT))
    optim_sd = get_optimizer_state_dict(model, opt, options=options)
    fresh_model = _model()
    fresh = make(list(fresh_model.parameters()))
    set_optimizer_state_dict(fresh_model, fresh, optim_sd, options=options)
    expected, got = opt.state_dict(), fresh.state_dict()
    assert expected["param_groups"][0].keys() == got["param_groups"][0].keys()
    for key, value in expected["param_groups"][0].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, got["param_groups"][0][key]), key


# ---------------------------------------------------------------- DTensor parameters, refused gradients
def test_dtensor_gradients_must_be_laid_out_as_their_parameter(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    p = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    opt = tgo.AdamOptimizer([p], learning_rate=0.1, foreach=True)
    with pytest.raises(ValueError, match=r"same placements"):
        opt.apply_gradients([(distribute_tensor(torch.ones(4, 3), mesh, [Replicate()]), p)])
    with pytest.raises(ValueError, match=r"same placements.*a plain tensor"):
        opt.apply_gradients([(torch.ones(4, 3), p)])
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3))
    with pytest.raises(ValueError, match="sparse gradients of DTensor parameters are not supported"):
        opt.apply_gradients([(sparse, p)])
    assert not opt.state and float(opt.param_groups[0]["beta1_power"]) == pytest.approx(0.9)  # all or nothing
    opt.apply_gradients([(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]), p)])
    assert isinstance(opt.get_slot(p, "m"), type(p)) and float(opt.param_groups[0]["beta1_power"]) < 0.9


# ---------------------------------------------------------------- DCP's state-initialising step
# Not around torch.optim.Adam: DCP's zero-gradient step advances torch's own Adam "step" (torch's behaviour).
OWN_STATE = [*CORE, *(w for w in WRAPPERS if w.id != "LossScale-torchAdam")]


@pytest.mark.parametrize("make", OWN_STATE)
def test_dcp_state_initialisation_changes_no_number(make):
    """get_state_dict on a fresh optimizer (a step-0 checkpoint) must not shift the run that follows."""
    model = _model()
    opt = make(list(model.parameters()))
    if isinstance(opt, LossScaleOptimizer):
        opt.loss_scale.load_state_dict({**opt.loss_scale.state_dict(), "increment_period": 1})
    get_state_dict(model, opt)
    assert all(p.grad is None for p in model.parameters())
    _train(model, opt, range(STEPS))
    reference_model = _model()
    reference = make(list(reference_model.parameters()))
    if isinstance(reference, LossScaleOptimizer):
        reference.loss_scale.load_state_dict({**reference.loss_scale.state_dict(), "increment_period": 1})
    _train(reference_model, reference, range(STEPS))
    _assert_bitwise(_snapshot(model, opt), _snapshot(reference_model, reference))


def test_an_optimizer_pickled_whole_in_the_earlier_layout_unpickles():
    """torch.save(opt) of the earlier layout kept the beta powers in an attribute, ``_non_slot``."""
    model = _model()
    opt = _adam(list(model.parameters()))
    _train(model, opt, range(SPLIT))
    pickled = opt.__getstate__()
    group = pickled["param_groups"][0]
    old = {
        "defaults": pickled["defaults"],
        "state": pickled["state"],
        "param_groups": [{k: v for k, v in group.items() if not k.endswith("_power")}],
        "_non_slot": [{"beta1_power": group["beta1_power"], "beta2_power": group["beta2_power"]}],
    }
    revived = tgo.AdamOptimizer.__new__(tgo.AdamOptimizer)
    revived.__setstate__(copy.deepcopy(old))
    assert revived._non_slot_keys == ("beta1_power", "beta2_power")
    assert len(revived.variables()) == len(opt.variables())
    assert all(torch.equal(a, b) for a, b in zip(revived.variables(), opt.variables(), strict=True))


# ---------------------------------------------------------------- state written around load_state_dict
def test_non_slot_state_written_by_a_tool_is_checked_before_the_step(one_rank_group):
    """ZeroRedundancyOptimizer.load_state_dict copies group entries past the local optimizer's checks."""
    model = _model()
    opt = ZeroRedundancyOptimizer(
        list(model.parameters()), optimizer_class=tgo.AdamOptimizer, learning_rate=0.01
    )
    _train(model, opt, range(2))
    opt.consolidate_state_dict(to=0)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["beta1_power"] = torch.tensor(1.0)  # 1 - beta1_power = 0: a division by zero
    opt.load_state_dict(saved)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Invalid beta1_power value: 1.0"):
        _train(model, opt, range(2, 3))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    local = opt.optim
    local.param_groups[0]["beta1_power"] = 0.5
    with pytest.raises(
        TypeError, match="'beta1_power' of param group 0 must be a 0-d real tensor, got float"
    ):
        _train(model, local, range(2, 3))


def test_non_slot_state_it_wrote_itself_is_not_read_again():
    model = _model()
    opt = _adam(list(model.parameters()))
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        with HostReads() as reads:
            opt.step()
        assert reads.count == 0
    opt.param_groups[0]["beta1_power"] = opt.param_groups[0]["beta1_power"].clone()  # written by hand
    with HostReads() as reads:
        opt.step()
    assert reads.count == 1  # the value written by hand is read and range-checked
    with HostReads() as reads:
        opt.step()
    assert reads.count == 0  # the step replaced it with its own
