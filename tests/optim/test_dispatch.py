"""The functional forms of the update rules: signature, scratch lists and their source, argument errors."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from optim_specs import SPECS

# Every optimizer's functional form is its module's last name (torchgrad_compat.optim.adam.adam).
RULES = tuple(spec.cls.__module__.rsplit(".", 1)[-1] for spec in SPECS)


def _rule(name: str):
    module = importlib.import_module(f"torchgrad_compat.optim.{name}")
    return getattr(module, name), getattr(module, f"_single_tensor_{name}")


@pytest.mark.parametrize("name", RULES)
def test_signature_is_the_reference_loops_and_the_paths(name):
    rule, single = _rule(name)
    loop = list(inspect.signature(single).parameters)
    assert list(inspect.signature(rule).parameters) == [*loop, "foreach", "fused", "scratch"]
    for arg in ("foreach:", "fused:", "scratch:"):
        assert arg in rule.__doc__


def _lists(n: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [[torch.rand(5, generator=gen) + 0.5 for _ in range(3)] for _ in range(n)]


# (rule, number of lists, scalars, the scratch lists its foreach path needs)
SCRATCH_CASES = {
    "adam": ("adam", 4, {"alpha": 0.1, "one_minus_beta1": 0.1, "one_minus_beta2": 0.001, "epsilon": 1e-7}, 2),
    "momentum": ("momentum", 3, {"lr": 0.1, "momentum": 0.9, "use_nesterov": False}, 1),
    "momentum-nesterov": ("momentum", 3, {"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, 2),
    "proximal_adagrad": ("proximal_adagrad", 3, {"lr": 0.1, "l1": None, "l2": None}, 2),
    "proximal_adagrad-l1": ("proximal_adagrad", 3, {"lr": 0.1, "l1": 0.01, "l2": 0.01}, 3),
}


def _scalars(scalars: dict) -> dict:
    return {k: v if isinstance(v, bool) or v is None else torch.tensor(v) for k, v in scalars.items()}


@pytest.mark.parametrize("case", SCRATCH_CASES)
def test_a_scratch_source_is_asked_for_the_count_the_foreach_path_needs(case):
    name, n, scalars, count = SCRATCH_CASES[case]
    rule, _ = _rule(name)
    expected, given = _lists(n), _lists(n)
    rule(*expected, **_scalars(scalars), foreach=True)
    asked = []

    def source(like, k):
        asked.append((len(like), k))
        return [[torch.empty_like(t) for t in like] for _ in range(k)]

    rule(*given, **_scalars(scalars), foreach=True, scratch=source)
    assert asked == [(3, count)]
    for want, got in zip(expected, given, strict=True):
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g)


def test_scratch_lists_of_the_wrong_count_are_refused_before_any_update():
    rule, _ = _rule("adam")
    lists = _lists(4)
    before = [[t.clone() for t in lst] for lst in lists]
    scalars = _scalars(SCRATCH_CASES["adam"][2])
    with pytest.raises(ValueError, match=r"adam: the foreach path needs 2 scratch lists, got 1"):
        rule(*lists, **scalars, foreach=True, scratch=[[torch.empty(5) for _ in range(3)]])
    for lst, old in zip(lists, before, strict=True):
        for t, o in zip(lst, old, strict=True):
            assert torch.equal(t, o)


def test_lists_by_keyword_and_argument_errors_name_the_functional_form():
    rule, _ = _rule("adam")
    scalars = _scalars(SCRATCH_CASES["adam"][2])
    positional, by_name = _lists(4), _lists(4)
    rule(*positional, **scalars, foreach=True)
    rule(**dict(zip(("params", "grads", "ms", "vs"), by_name, strict=True)), **scalars, foreach=True)
    for want, got in zip(positional, by_name, strict=True):
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g)
    with pytest.raises(TypeError, match=r"^adam\(\).*'epsilon'"):
        rule(*_lists(4), **{k: v for k, v in scalars.items() if k != "epsilon"}, foreach=False)
    with pytest.raises(TypeError, match=r"^adam\(\).*'eps'"):
        rule(*_lists(4), **scalars, eps=torch.tensor(1.0), foreach=False)
    with pytest.raises(TypeError, match=r"^adam\(\).*'foreach'"):
        rule(*_lists(4), **scalars)
