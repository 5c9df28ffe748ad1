"""One table that knows the ten optimizers; the generic tests in test_optim_generic.py know the checks.

Adding an optimizer means its file and an entry here. Everything in an entry is
written from TensorFlow's documentation and sources, not read back from the
implementation: the slot names, which sparse rule TF uses, the bad inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

import torchgrad_compat.optim as tgo

NAN, INF = math.nan, math.inf


@dataclass(frozen=True)
class OptimSpec:
    name: str
    # Named constructor configurations (after params); the first is the default one.
    configs: dict[str, dict[str, Any]]
    # TF's slot names for each configuration id (default: `slots`).
    slots: tuple[str, ...]
    slots_by_config: dict[str, tuple[str, ...]] = field(default_factory=dict)
    non_slot: tuple[str, ...] = ()
    # TF's sparse kernels touch only the given rows (all but Adam, whose sparse rule decays every row).
    sparse_lazy: bool = True
    # Sparse duplicates are summed before the update (all but GradientDescent, which applies them in turn).
    sums_duplicates: bool = True
    # The variable is a closed form of the accumulators (Ftrl, AdagradDA): a zero gradient moves it.
    zero_grad_moves: bool = False
    # (argument, bad value, exception type) for the constructor; NaN/inf/negative/wrong type.
    bad_args: tuple[tuple[str, Any, type[Exception]], ...] = ()

    @property
    def cls(self) -> type[tgo.Optimizer]:
        return getattr(tgo, self.name)

    def slots_for(self, config_id: str) -> tuple[str, ...]:
        return self.slots_by_config.get(config_id, self.slots)

    def make(self, params: Any, config_id: str | None = None, **overrides: Any) -> tgo.Optimizer:
        config = self.configs[config_id or next(iter(self.configs))]
        return self.cls(params, **{**config, **overrides})


def _lr_cases() -> tuple[tuple[str, Any, type[Exception]], ...]:
    return (
        ("learning_rate", NAN, ValueError),
        ("learning_rate", INF, ValueError),
        ("learning_rate", -INF, ValueError),
        ("learning_rate", -0.1, ValueError),
        ("learning_rate", torch.tensor(-1.0), ValueError),
        ("learning_rate", torch.tensor([0.1, 0.2]), ValueError),
        ("learning_rate", "0.1", TypeError),
        ("learning_rate", True, TypeError),
        # Finite as a Python float, inf once rounded to float32, the precision of the update.
        ("learning_rate", 1e39, ValueError),
        ("learning_rate", 1e300, ValueError),
        ("learning_rate", torch.tensor(1e39, dtype=torch.float64), ValueError),
        ("learning_rate", torch.tensor(0.1, device="meta"), ValueError),
    )


def _nonneg(arg: str) -> tuple[tuple[str, Any, type[Exception]], ...]:
    return (
        (arg, -0.5, ValueError),
        (arg, NAN, ValueError),
        (arg, INF, ValueError),
        (arg, 1e39, ValueError),
        (arg, "1", TypeError),
    )


def _positive(arg: str) -> tuple[tuple[str, Any, type[Exception]], ...]:
    return ((arg, 0.0, ValueError), *_nonneg(arg))


def _unit(arg: str, *, include_one: bool) -> tuple[tuple[str, Any, type[Exception]], ...]:
    cases = [(arg, -0.1, ValueError), (arg, 1.5, ValueError), (arg, NAN, ValueError), (arg, None, TypeError)]
    if not include_one:
        # Below 1 as a Python float, exactly 1 in float32: Adam's bias correction divides by zero.
        cases += [(arg, 1.0, ValueError), (arg, 1 - 1e-10, ValueError)]
    return tuple(cases)


SPECS: tuple[OptimSpec, ...] = (
    OptimSpec(
        name="GradientDescentOptimizer",
        configs={"lr0.1": {"learning_rate": 0.1}},
        slots=(),
        sums_duplicates=False,
        bad_args=_lr_cases(),
    ),
    OptimSpec(
        name="MomentumOptimizer",
        configs={
            "m0.9": {"learning_rate": 0.05, "momentum": 0.9},
            "nesterov": {"learning_rate": 0.05, "momentum": 0.9, "use_nesterov": True},
        },
        slots=("momentum",),
        bad_args=(
            *_lr_cases(),
            *_nonneg("momentum"),
            ("use_nesterov", 1, TypeError),
            ("use_nesterov", "yes", TypeError),
        ),
    ),
    OptimSpec(
        name="AdagradOptimizer",
        configs={
            "lr0.1": {"learning_rate": 0.1},
            "init0.5": {"learning_rate": 0.1, "initial_accumulator_value": 0.5},
        },
        slots=("accumulator",),
        bad_args=(*_lr_cases(), *_positive("initial_accumulator_value")),
    ),
    OptimSpec(
        name="AdagradDAOptimizer",
        configs={
            "lr0.1": {"learning_rate": 0.1},
            "l1l2": {
                "learning_rate": 0.1,
                "l1_regularization_strength": 0.01,
                "l2_regularization_strength": 0.02,
            },
        },
        slots=("gradient_accumulator", "gradient_squared_accumulator"),
        non_slot=("global_step",),
        zero_grad_moves=True,
        bad_args=(
            *_lr_cases(),
            *_positive("initial_gradient_squared_accumulator_value"),
            *_nonneg("l1_regularization_strength"),
            *_nonneg("l2_regularization_strength"),
            ("global_step", torch.tensor(1.0), TypeError),
            ("global_step", 3, TypeError),
            ("global_step", torch.tensor(0, dtype=torch.uint8), TypeError),
        ),
    ),
    OptimSpec(
        name="AdamOptimizer",
        configs={
            "default": {"learning_rate": 0.01},
            "b0.5eps0.1": {"beta1": 0.5, "beta2": 0.9, "epsilon": 0.1},
        },
        slots=("m", "v"),
        non_slot=("beta1_power", "beta2_power"),
        sparse_lazy=False,
        bad_args=(
            *_lr_cases(),
            *_unit("beta1", include_one=False),
            *_unit("beta2", include_one=False),
            *_nonneg("epsilon"),
        ),
    ),
    OptimSpec(
        name="AdadeltaOptimizer",
        configs={
            "lr1": {"learning_rate": 1.0},
            "rho0.9": {"learning_rate": 0.5, "rho": 0.9, "epsilon": 1e-6},
        },
        slots=("accum", "accum_update"),
        bad_args=(*_lr_cases(), *_unit("rho", include_one=True), *_nonneg("epsilon")),
    ),
    OptimSpec(
        name="RMSPropOptimizer",
        configs={
            "plain": {"learning_rate": 0.01},
            "momentum": {"learning_rate": 0.01, "momentum": 0.5},
            "centered": {"learning_rate": 0.01, "momentum": 0.5, "centered": True, "epsilon": 1e-6},
        },
        slots=("momentum", "rms"),
        slots_by_config={"centered": ("mg", "momentum", "rms")},
        bad_args=(
            *_lr_cases(),
            *_unit("decay", include_one=True),
            *_nonneg("momentum"),
            *_nonneg("epsilon"),
            ("centered", 1, TypeError),
        ),
    ),
    OptimSpec(
        name="FtrlOptimizer",
        configs={
            "lr0.1": {"learning_rate": 0.1},
            "all": {
                "learning_rate": 0.1,
                "learning_rate_power": -0.3,
                "initial_accumulator_value": 0.2,
                "l1_regularization_strength": 0.001,
                "l2_regularization_strength": 0.002,
                "l2_shrinkage_regularization_strength": 0.003,
                "beta": 0.1,
            },
        },
        slots=("accum", "linear"),
        zero_grad_moves=True,
        bad_args=(
            *_lr_cases(),
            ("learning_rate_power", 0.5, ValueError),
            ("learning_rate_power", NAN, ValueError),
            *_nonneg("initial_accumulator_value"),
            *_nonneg("l1_regularization_strength"),
            *_nonneg("l2_regularization_strength"),
            *_nonneg("l2_shrinkage_regularization_strength"),
            *_nonneg("beta"),
        ),
    ),
    OptimSpec(
        name="ProximalAdagradOptimizer",
        configs={
            "lr0.1": {"learning_rate": 0.1},
            "l1l2": {
                "learning_rate": 0.1,
                "l1_regularization_strength": 0.01,
                "l2_regularization_strength": 0.02,
            },
        },
        slots=("accumulator",),
        bad_args=(
            *_lr_cases(),
            *_positive("initial_accumulator_value"),
            *_nonneg("l1_regularization_strength"),
            *_nonneg("l2_regularization_strength"),
        ),
    ),
    OptimSpec(
        name="ProximalGradientDescentOptimizer",
        configs={
            "lr0.1": {"learning_rate": 0.1},
            "l1l2": {
                "learning_rate": 0.1,
                "l1_regularization_strength": 0.01,
                "l2_regularization_strength": 0.02,
            },
        },
        slots=(),
        bad_args=(
            *_lr_cases(),
            *_nonneg("l1_regularization_strength"),
            *_nonneg("l2_regularization_strength"),
        ),
    ),
)

SPEC_BY_NAME = {spec.name: spec for spec in SPECS}

# fused=True against the reference loop (foreach=False), rtol and atol, where the two may round
# otherwise: Ftrl's powers other than -0.5 (a float64 pow on the CPU, Triton's pow on CUDA). Every
# other rule is bitwise (the loop's square root is correctly rounded, as the compiled one is).
FUSED_TOL = {torch.float32: (2e-5, 5e-6), torch.float64: (1e-13, 1e-14), torch.bfloat16: (1.6e-2, 1e-5)}


def spec_configs() -> list[tuple[OptimSpec, str]]:
    """Every (spec, config id) pair, for parametrisation."""
    return [(spec, cid) for spec in SPECS for cid in spec.configs]
