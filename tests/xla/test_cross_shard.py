"""CrossShardOptimizer: real gloo processes on 127.0.0.1 against single-process references.

Process start-up dominates, so each world size starts once (a module fixture)
and runs every check of tests/xla/_cross_shard_workers.py meant for it; each test
below reads one check's verdict from every rank. One process without a process
group covers the local path, argument checks and forwarding; the torch_xla
test runs when torch_xla is importable.
"""

from __future__ import annotations

import importlib.util
import pickle
import warnings

import _cross_shard_workers as workers
import pytest
import torch
from _deadlines import scaled
from _procs import run_ranks
from torch import nn

import torchgrad_compat.optim as tgo
from torchgrad_compat.xla import CrossShardOptimizer
from torchgrad_compat.xla._agreement import check_group_assignment
from torchgrad_compat.xla._reducer import DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES, _plan

TWO_RANK_CHECKS = [
    "full_batch_equivalence",
    "dcp_state_dict_leaves_the_first_step_check",
    "missing_gradients",
    "sparse_and_dense_mixed",
    "few_collectives",
    "add_param_group",
    "accumulation",
    "state_dict_resume",
    "mismatched_parameters",
    "invalid_argument_on_one_rank",
    "different_steps_across_ranks",
    "a_group_added_later_is_compared_at_the_next_step",
    "fused_as_the_reference_loop",
    "a_sparse_gradient_that_is_not_row_sparse_is_refused",
    "complex_parameters_are_refused_on_every_rank",
    "a_parameter_unfrozen_after_construction_is_summed",
    # Last: the failed pass leaves a bucket's all-reduce unwaited (complete on both ranks).
    "a_backward_pass_that_raised_midway_stops_the_next_step",
]
FOUR_RANK_CHECKS = [
    "subgroup_divisor",
    "subgroups_full_batch_equivalence",
    "subgroups_that_trained_apart_take_a_group_added_later",
    "invalid_arguments_before_any_collective",
    "mismatched_group_assignment",
    "mismatched_parameters",
    "invalid_argument_on_one_rank",
]
# A group silent this long (scaled) is hung: a hung collective fails the run instead of stalling it.
DEADLINE_S = 120


def _run_ranks(world: int, checks: list[str]) -> dict[str, dict[int, str | None]]:
    """Start ``world`` processes, run ``checks`` in each; ``{check: {rank: traceback or None}}``."""
    messages = run_ranks(
        workers.run_checks,
        world,
        lambda rank, port, results: (rank, world, port, checks, results),
        expected=world * len(checks),
        deadline_s=DEADLINE_S,
    )
    verdicts: dict[str, dict[int, str | None]] = {name: {} for name in checks}
    for name, rank, error in messages:
        verdicts[name][rank] = error
    return verdicts


def _assert_every_rank_passed(verdicts: dict[str, dict[int, str | None]], check: str, world: int) -> None:
    by_rank = verdicts[check]
    missing = [r for r in range(world) if r not in by_rank]
    assert not missing, f"{check}: no verdict from ranks {missing} (crashed or hung)"
    failures = {r: e for r, e in by_rank.items() if e is not None}
    assert not failures, "\n".join(f"--- rank {r}:\n{e}" for r, e in failures.items())


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, dict[int, str | None]]:
    return _run_ranks(2, TWO_RANK_CHECKS)


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, dict[int, str | None]]:
    return _run_ranks(4, FOUR_RANK_CHECKS)


@pytest.mark.parametrize("check", TWO_RANK_CHECKS)
def test_two_ranks(two_ranks, check):
    _assert_every_rank_passed(two_ranks, check, 2)


@pytest.mark.parametrize("check", FOUR_RANK_CHECKS)
def test_four_ranks(four_ranks, check):
    _assert_every_rank_passed(four_ranks, check, 4)


def test_a_frozen_peer_surfaces_as_an_error_after_the_group_timeout():
    """A rank that stops answering: the others' step raises RuntimeError once the group's timeout passes."""
    timeout_s = scaled(3.0)  # the timeout under test; scaled too, or a slow rendezvous would time out
    messages = run_ranks(
        workers.frozen_peer,
        2,
        lambda rank, port, results: (rank, 2, port, timeout_s, results),
        expected=1,
        deadline_s=60,
    )
    assert len(messages) == 1, "rank 0 did not report (hung past its process group's timeout)"
    rank, error, seconds = messages[0]
    assert rank == 0 and error is not None and error.startswith("RuntimeError"), error
    assert timeout_s - 0.5 <= seconds <= timeout_s + scaled(5), (seconds, error)


# ---------------------------------------------------------------- one process, no process group
def _local(opt: torch.optim.Optimizer, **kwargs) -> CrossShardOptimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CrossShardOptimizer(opt, **kwargs)


def test_without_process_group_warns_once_and_steps_locally():
    w = nn.Parameter(torch.ones(3))
    with pytest.warns(UserWarning, match="assuming 1 shard") as record:
        opt = CrossShardOptimizer(tgo.AdamOptimizer([w], learning_rate=0.1))
        opt.minimize((w * w).sum())
        (w * w).sum().backward()
        opt.step()
    assert len(record) == 1
    assert opt.num_shards == 1 and opt.group_assignment is None and opt.reduction == "mean"


@pytest.mark.parametrize("style", ["minimize", "step"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_without_process_group_is_the_bare_optimizer_bitwise(style, reduction):
    torch.manual_seed(0)
    a = nn.Linear(4, 2)
    b = nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    wrapped = _local(tgo.RMSPropOptimizer(a.parameters(), learning_rate=0.01), reduction=reduction)
    bare = tgo.RMSPropOptimizer(b.parameters(), learning_rate=0.01)
    for _ in range(3):
        x = torch.randn(5, 4)
        for opt, model in ((wrapped, a), (bare, b)):
            if style == "minimize":
                opt.minimize(model(x).pow(2).mean())
            else:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_compute_gradients_is_unscaled_with_one_shard():
    """TF scales the loss only when there is more than one shard: loss 3v gives 3, as TF's probe."""
    v = nn.Parameter(torch.tensor(1.0))
    opt = _local(tgo.GradientDescentOptimizer([v], 1.0))
    ((grad, var),) = opt.compute_gradients(3.0 * v)
    assert var is v and grad.item() == 3.0


def test_forwards_to_the_wrapped_optimizer():
    w = nn.Parameter(torch.ones(2))
    inner = tgo.AdamOptimizer([w], learning_rate=0.1)
    opt = _local(inner)
    opt.minimize((w * w).sum())
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.get_slot(w, "m") is inner.get_slot(w, "m") and opt.get_slot_names() == ["m", "v"]
    assert opt.variables() == inner.variables()
    assert opt.state_dict()["state"].keys() == inner.state_dict()["state"].keys()
    opt.learning_rate = 0.5
    assert inner.param_groups[0]["lr"] == 0.5
    (w * w).sum().backward()
    opt.zero_grad()
    assert w.grad is None


def test_cannot_be_pickled():
    opt = _local(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"reduction": "max"}, ValueError, "'max'"),
        ({"reduction": "none"}, ValueError, "'none'"),
        ({"reduction": None}, TypeError, "reduction"),
        ({"name": 3}, TypeError, "name"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb"),
        ({"bucket_cap_mb": float("nan")}, ValueError, "bucket_cap_mb"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb"),
        ({"group_assignment": [[0, 1]]}, ValueError, "range(1)"),
        ({"group_assignment": [0]}, TypeError, "list of lists"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else None,
)
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        _local(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), **kwargs)


def test_wraps_only_optimizers():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        CrossShardOptimizer([nn.Parameter(torch.ones(1))])


@pytest.mark.parametrize("spelling", ["weighted_mean", "weighted_sum"])
def test_accepts_tf_reduction_spellings(spelling):
    opt = _local(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), reduction=spelling)
    assert opt.reduction == spelling.removeprefix("weighted_")


# TF's own error cases ([V] in tf_semantics.md §4) plus duplicates, which TF's set comparison lets through.
@pytest.mark.parametrize(
    ("groups", "world", "error"),
    [
        ([0, 1], 2, TypeError),
        ([[0, 1], [2, 3]], 8, ValueError),
        ([[0, 1, 2], [3, 4, 5, 6, 7]], 8, ValueError),
        ([[0, 1], [2, 3], [3, 3]], 4, ValueError),
        ([[0, 1], [1, 2]], 4, ValueError),
        ([[0, True]], 2, TypeError),
        ((0, 1), 2, TypeError),
    ],
    ids=repr,
)
def test_group_assignment_must_be_an_equal_split_of_a_permutation(groups, world, error):
    with pytest.raises(error, match="group_assignment"):
        check_group_assignment(groups, world)


def test_group_assignment_accepted():
    assert check_group_assignment(None, 4) is None and check_group_assignment([], 4) is None
    assert check_group_assignment([[3, 0], [2, 1]], 4) == [[3, 0], [2, 1]]


def test_buckets_follow_reverse_order_by_dtype_with_a_small_first_bucket_by_default():
    big = FIRST_BUCKET_BYTES // 4  # float32 elements in the first bucket's cap
    params = [
        torch.zeros(big // 2),  # 0
        torch.zeros(10, dtype=torch.float64),  # 1
        torch.zeros(big),  # 2
        torch.zeros(big // 2),  # 3
        torch.zeros(3),  # 4
    ]
    # Reverse order: 4, 3 (float32, still under 1 MiB), 2 closes the first float32 bucket; then 1 and 0.
    assert _plan(params, DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES) == [[4, 3, 2], [1], [0]]
    assert _plan([torch.zeros(4) for _ in range(200)], DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES) == [
        list(range(199, -1, -1))
    ]
    # An explicit bucket_cap_mb sizes the first bucket too, as in DDP: 4, 3, 2 and 0 share one.
    assert _plan(params, DEFAULT_BUCKET_BYTES, DEFAULT_BUCKET_BYTES) == [[4, 3, 2, 0], [1]]


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_torch_xla_single_replica(monkeypatch):
    """PJRT_DEVICE=CPU, one replica: the local path on XLA tensors, and the bucketed reduce through xm."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    import torch_xla.core.xla_model as xm

    from torchgrad_compat.xla._collective import XlaCollective
    from torchgrad_compat.xla._reducer import GradientReducer

    device = xm.xla_device()
    w = nn.Parameter(torch.tensor([1.0, -2.0], device=device))
    with pytest.warns(UserWarning, match="torch_xla world size is 1"):
        opt = CrossShardOptimizer(tgo.GradientDescentOptimizer([w], 0.5))
    opt.minimize((w * w).sum())
    assert torch.equal(w.detach().cpu(), torch.tensor([0.0, 0.0]))

    params = [torch.zeros(3, device=device), torch.zeros(2, 2, device=device)]
    reducer = GradientReducer(params, XlaCollective(), bucket_cap_bytes=1024, first_bucket_cap_bytes=1024)
    grads = [torch.arange(3.0, device=device), None]
    sums = reducer.reduce(grads, average=True)
    assert torch.equal(sums[0].cpu(), torch.arange(3.0)) and sums[1] is None
