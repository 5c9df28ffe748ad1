"""Train a small classifier with any of torchgrad_compat's ten TensorFlow v1 optimizers.

    python scripts/train.py                               # Adam, 300 steps, CPU
    python scripts/train.py --optimizer ftrl --style tf   # TF style: opt.minimize(loss)
    python scripts/train.py --optimizer momentum --lr 0.05 --steps 1000 --device cuda
    python scripts/train.py --loss-scale dynamic          # autocast + LossScaleOptimizer
    python scripts/train.py --decay cosine --warmup-steps 30 --clip-norm 1.0 --ema 0.99
    PJRT_DEVICE=CPU python scripts/train.py --device xla  # torch_xla, one replica
    torchrun --nproc-per-node 2 scripts/train.py --cross-shard   # CrossShardOptimizer, gloo
    python scripts/train.py --steps 100 --save run.pt       # then continue it:
    python scripts/train.py --resume run.pt --steps 100     # steps 101..200, the same batches
    python scripts/convert_tf_checkpoint.py tf_run/ run.pt  # a TF1 run of this model, then --resume it

The data are synthetic, generated from ``--seed`` (nothing is downloaded): every
example has 16 dense features and one token out of 100, and its label (one of 4
classes) is decided by a fixed random linear "teacher". The model is a two-layer
MLP over the features concatenated with an embedding of the token. The embedding
is ``nn.Embedding(sparse=True)``, so each step hands the optimizer a sparse COO
gradient too and TensorFlow's sparse update rule of the chosen optimizer runs
(on XLA, which has no sparse tensors, the embedding's gradient is dense).

The two ``--style`` values drive the optimizer the two ways the library supports
and print the same numbers:

- ``torch``: ``opt.zero_grad(); loss.backward(); opt.step()``;
- ``tf``:    ``opt.minimize(loss, global_step=global_step)``.

The rest of a TF1 training loop, from ``torchgrad_compat.train``, with TF's numbers:
``--decay`` computes the learning rate from ``global_step`` at every step (with
``--warmup-steps``, BERT's linear warm-up first; with ``--decay-graph``, with the
float32 numbers of a TF1 graph, whose Grappler rewrites round some steps
differently from eager TF); ``--clip-norm`` clips the
gradients by their global norm before each update (after the loss scale's
unscaling, after the cross-replica sum); ``--ema`` keeps an exponential moving
average of the weights, updated after each step, and reports the held-out accuracy
of the averaged weights too (as a TF1 run evaluates them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from torchgrad_compat import train as tf_train
from torchgrad_compat.amp import LossScaleOptimizer
from torchgrad_compat.optim import (
    AdadeltaOptimizer,
    AdagradDAOptimizer,
    AdagradOptimizer,
    AdamOptimizer,
    FtrlOptimizer,
    GradientDescentOptimizer,
    MomentumOptimizer,
    Optimizer,
    ProximalAdagradOptimizer,
    ProximalGradientDescentOptimizer,
    RMSPropOptimizer,
)
from torchgrad_compat.xla import CrossShardOptimizer

# Hyperparameters that visibly train this model in the default 300 steps; the
# others keep TensorFlow's defaults. Adadelta's TF defaults (learning_rate=0.001,
# epsilon=1e-8) barely move in 300 steps, so it gets the paper's learning rate and
# torch's epsilon. RMSProp's `rms` slot starts at 1 (TF), so its first steps are
# small. Ftrl and AdagradDA compute the weights from their accumulators: their
# first step replaces the random initialisation, and the learning rate sets the
# weights' scale. The proximal optimizers get a small l1 penalty, their reason to be.
OPTIMIZERS: dict[str, tuple[type[Optimizer], dict[str, Any]]] = {
    "gradient_descent": (GradientDescentOptimizer, {"learning_rate": 0.5}),
    "momentum": (MomentumOptimizer, {"learning_rate": 0.1, "momentum": 0.9}),
    "adagrad": (AdagradOptimizer, {"learning_rate": 0.5}),
    "adagrad_da": (AdagradDAOptimizer, {"learning_rate": 0.5}),
    "adam": (AdamOptimizer, {"learning_rate": 0.01}),
    "adadelta": (AdadeltaOptimizer, {"learning_rate": 1.0, "epsilon": 1e-6}),
    "rmsprop": (RMSPropOptimizer, {"learning_rate": 0.03}),
    "ftrl": (FtrlOptimizer, {"learning_rate": 0.5, "l1_regularization_strength": 0.001}),
    "proximal_adagrad": (
        ProximalAdagradOptimizer,
        {"learning_rate": 0.5, "l1_regularization_strength": 0.001},
    ),
    "proximal_gradient_descent": (
        ProximalGradientDescentOptimizer,
        {"learning_rate": 0.5, "l1_regularization_strength": 0.001},
    ),
}

NUM_FEATURES = 16
NUM_TOKENS = 100
NUM_CLASSES = 4
EMBEDDING_DIM = 8
HIDDEN = 32
TRAIN_SIZE = 4096
HELD_OUT_SIZE = 1024
BATCH_SIZE = 64


@dataclass
class Dataset:
    features: Tensor  # (n, NUM_FEATURES) float32
    tokens: Tensor  # (n,) int64
    labels: Tensor  # (n,) int64

    def to(self, device: torch.device) -> Dataset:
        return Dataset(self.features.to(device), self.tokens.to(device), self.labels.to(device))

    def batch(self, index: Tensor) -> Dataset:
        return Dataset(self.features[index], self.tokens[index], self.labels[index])


def make_datasets(seed: int) -> tuple[Dataset, Dataset]:
    """A training set and a held-out set labelled by the same random linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    feature_weights = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=gen)
    token_weights = torch.randn(NUM_TOKENS, NUM_CLASSES, generator=gen)

    def sample(n: int) -> Dataset:
        features = torch.randn(n, NUM_FEATURES, generator=gen)
        tokens = torch.randint(NUM_TOKENS, (n,), generator=gen)
        logits = features @ feature_weights + token_weights[tokens]
        return Dataset(features, tokens, logits.argmax(dim=1))

    return sample(TRAIN_SIZE), sample(HELD_OUT_SIZE)


class Classifier(nn.Module):
    """Two-layer MLP over [features, embedding(token)]; the embedding's gradient is sparse if asked."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(NUM_TOKENS, EMBEDDING_DIM, sparse=sparse)
        self.hidden = nn.Linear(NUM_FEATURES + EMBEDDING_DIM, HIDDEN)
        self.output = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, features: Tensor, tokens: Tensor) -> Tensor:
        x = torch.cat([features, self.embedding(tokens)], dim=1)
        return self.output(F.relu(self.hidden(x)))


def batch_indices(seed: int) -> Iterator[Tensor]:
    """The examples of step 1, 2, ...: the same sequence for every run of a seed, resumed or not."""
    generator = torch.Generator().manual_seed(seed + 1)
    while True:
        yield torch.randint(TRAIN_SIZE, (BATCH_SIZE,), generator=generator)


def export_batches(path: Path, seed: int, steps: int) -> None:
    """Steps 1..steps' batches as NumPy arrays [steps, BATCH_SIZE, ...]: what a TF run of this model eats."""
    import numpy as np

    train_set, _ = make_datasets(seed)
    indices = batch_indices(seed)
    batches = [train_set.batch(next(indices)) for _ in range(steps)]
    np.savez(
        path,
        features=torch.stack([b.features for b in batches]).numpy(),
        tokens=torch.stack([b.tokens for b in batches]).numpy(),
        labels=torch.stack([b.labels for b in batches]).numpy(),
    )
    print(f"wrote {steps} batches of {BATCH_SIZE} (seed {seed}) to {path}")


def loss_on(model: Classifier, data: Dataset) -> Tensor:
    return F.cross_entropy(model(data.features, data.tokens), data.labels)


@torch.no_grad()
def evaluate(model: Classifier, data: Dataset) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over the whole of ``data``."""
    logits = model(data.features, data.tokens)
    loss = F.cross_entropy(logits, data.labels).item()
    accuracy = (logits.argmax(dim=1) == data.labels).float().mean().item()
    return loss, accuracy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda", "xla"],
        default="cpu",
        help="xla: one torch_xla replica (PJRT_DEVICE picks the hardware, e.g. PJRT_DEVICE=CPU)",
    )
    parser.add_argument(
        "--style",
        choices=["torch", "tf"],
        default="torch",
        help="torch: loss.backward(); opt.step().  tf: opt.minimize(loss, global_step=...)",
    )
    parser.add_argument(
        "--cross-shard",
        action="store_true",
        help="run under torchrun: each process trains on its share of every batch and "
        "CrossShardOptimizer averages the gradients (gloo on CPU, nccl on CUDA)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="with --cross-shard: seconds a rank waits for the others in a collective before it raises",
    )
    parser.add_argument(
        "--save",
        type=Path,
        help="write the model, the optimizer (state_dict) and the step count here at the end",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        help="continue a run --save (or scripts/convert_tf_checkpoint.py) wrote: its weights, optimizer "
        "state and step count; --steps more steps follow, on the batches the run would have drawn next",
    )
    parser.add_argument(
        "--export-batches",
        type=Path,
        help="write the first --steps batches (features, tokens, labels) as .npz and exit: the data a "
        "TensorFlow run of this model trains on (scripts/make_tf_train_checkpoint.py)",
    )
    parser.add_argument(
        "--loss-scale",
        default="none",
        help="none, dynamic, or a fixed number >= 1: wrap the optimizer in LossScaleOptimizer and "
        "compute the loss under torch.autocast (float16 on CUDA, bfloat16 on CPU and XLA)",
    )
    parser.add_argument(
        "--decay",
        choices=sorted(DECAYS),
        default=None,
        help="a TF learning-rate decay of the optimizer's learning rate, computed from global_step",
    )
    parser.add_argument("--decay-steps", type=int, default=100, help="the decay's decay_steps")
    parser.add_argument("--decay-rate", type=float, default=0.5, help="exponential decay's decay_rate")
    parser.add_argument(
        "--warmup-steps", type=int, default=0, help="a linear warm-up from 0 over these steps first"
    )
    parser.add_argument(
        "--decay-graph",
        action="store_true",
        help="compute --decay and --warmup-steps as a TF1 graph (Session, Estimator) does, with "
        "Grappler's rewrites, rather than as eager TF does",
    )
    parser.add_argument(
        "--clip-norm",
        type=float,
        default=None,
        help="clip the gradients by their global norm (TF's clip_by_global_norm) before each update",
    )
    parser.add_argument(
        "--ema",
        type=float,
        default=None,
        metavar="DECAY",
        help="keep an ExponentialMovingAverage of the weights with this decay (num_updates=global_step)",
    )
    args = parser.parse_args(argv)
    args.loss_scale = _loss_scale(parser, args.loss_scale)
    if args.decay_steps < 1:
        parser.error(f"--decay-steps must be at least 1, got {args.decay_steps}")
    if not 0 < args.decay_rate <= 1:
        parser.error(f"--decay-rate must be in (0, 1], got {args.decay_rate}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.clip_norm is not None and not 0 < args.clip_norm < math.inf:
        parser.error(f"--clip-norm must be a positive finite number, got {args.clip_norm}")
    if args.ema is not None and not 0 <= args.ema <= 1:
        parser.error(f"--ema must be a decay in [0, 1], got {args.ema}")
    if args.cross_shard and "RANK" not in os.environ:
        parser.error(
            "--cross-shard runs under torchrun: torchrun --nproc-per-node 2 scripts/train.py --cross-shard"
        )
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.resume is not None and not args.resume.is_file():
        parser.error(f"--resume {str(args.resume)!r}: no such file")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was requested but torch.cuda.is_available() is False")
    if args.device == "xla":
        if importlib.util.find_spec("torch_xla") is None:
            parser.error("--device xla needs the torch_xla package (pip install torch_xla with its torch)")
        if args.cross_shard:
            parser.error("--cross-shard runs under torchrun with gloo or nccl, not with --device xla")
    return args


def _loss_scale(parser: argparse.ArgumentParser, value: str) -> str | float | None:
    if value in ("none", "dynamic"):
        return None if value == "none" else value
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not number >= 1 or math.isinf(number):
        parser.error(f"--loss-scale must be none, dynamic or a finite number >= 1, got {value!r}")
    return number


def optimizer_settings(name: str, lr: float | None) -> tuple[type[Optimizer], dict[str, Any]]:
    """The class and constructor arguments for ``--optimizer name``, with ``--lr`` applied."""
    cls, hyperparameters = OPTIMIZERS[name]
    if lr is not None:
        hyperparameters = {**hyperparameters, "learning_rate": lr}
    return cls, hyperparameters


# --decay: each TF decay of the learning rate lr over --decay-steps steps.
DECAYS = {
    "exponential": lambda lr, step, args: tf_train.exponential_decay(
        lr, step, args.decay_steps, args.decay_rate, graph=args.decay_graph
    ),
    "polynomial": lambda lr, step, args: tf_train.polynomial_decay(
        lr, step, args.decay_steps, end_learning_rate=lr / 100, graph=args.decay_graph
    ),
    "cosine": lambda lr, step, args: tf_train.cosine_decay(
        lr, step, args.decay_steps, alpha=0.01, graph=args.decay_graph
    ),
}


def decay_of(args: argparse.Namespace, lr: float) -> tf_train.LearningRateDecay | None:
    """--decay (and --warmup-steps) of ``lr``, or None for a constant learning rate."""
    if args.decay is None and not args.warmup_steps:
        return None
    if args.decay is None:  # a warm-up alone: then the constant learning rate
        decayed = tf_train.piecewise_constant(None, [args.warmup_steps], [lr, lr], graph=args.decay_graph)
    else:
        decayed = DECAYS[args.decay](lr, None, args)
    return tf_train.linear_warmup(lr, decayed, args.warmup_steps) if args.warmup_steps else decayed


def decay_schedule(args: argparse.Namespace, opt: Optimizer, lr: float, start: int) -> Any:
    """A ``DecayLR`` scheduler at step ``start`` (TF's global_step: each learning rate is the
    decay's float32 value at the step), or None. A resumed run's learning rate is its decay's
    at the step it resumes from, as TF's is: nothing but the step needs saving."""
    decay = decay_of(args, lr)
    if decay is None:
        return None
    for group in opt.param_groups:
        group["initial_lr"] = lr  # (what a torch scheduler made at step 0 would have kept)
    return tf_train.DecayLR(opt, decay, last_epoch=start - 1)


def describe_run(
    args: argparse.Namespace, opt: torch.optim.Optimizer, hyperparameters: dict[str, Any]
) -> None:
    how = "loss.backward(); opt.step()" if args.style == "torch" else "opt.minimize(loss, global_step)"
    arguments = ", ".join(f"{k}={v}" for k, v in hyperparameters.items())
    num_params = sum(p.numel() for group in opt.param_groups for p in group["params"])
    sparse = args.device != "xla"
    print(f"optimizer: {type(opt).__name__}({arguments}), {args.style} style: {how}")
    print(
        f"data: {TRAIN_SIZE} training / {HELD_OUT_SIZE} held-out examples, {NUM_FEATURES} features + "
        f"1 of {NUM_TOKENS} tokens, {NUM_CLASSES} classes (seed {args.seed})"
    )
    print(
        f"model: {num_params:,} parameters: Embedding({NUM_TOKENS}, {EMBEDDING_DIM}, sparse={sparse}) -> "
        f"Linear({NUM_FEATURES + EMBEDDING_DIM}, {HIDDEN}) -> ReLU -> Linear({HIDDEN}, {NUM_CLASSES}); "
        f"batch {BATCH_SIZE}, {args.steps} steps on {args.device}"
    )


def mixed_precision(args: argparse.Namespace, device: torch.device) -> contextlib.AbstractContextManager:
    """torch.autocast when loss scaling is on: float16 on CUDA, bfloat16 on CPU and XLA."""
    if args.loss_scale is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16)


def train(args: argparse.Namespace) -> None:
    if args.device == "cpu":
        torch.set_num_threads(1)  # the model is tiny: more threads only add synchronisation
    device = xla_device() if args.device == "xla" else torch.device(args.device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.cross_shard else (0, 1)
    if args.cross_shard and args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    train_set, held_out = (data.to(device) for data in make_datasets(args.seed))
    model = Classifier(sparse=device.type != "xla").to(device)
    cls, hyperparameters = optimizer_settings(args.optimizer, args.lr)
    # TF's global_step: minimize() moves it in the TF style, the loop in the torch style; the
    # moving averages read it at every step.
    global_step = torch.zeros((), dtype=torch.int64, device=device)
    opt = cls(model.parameters(), **hyperparameters)
    inner = opt
    # Shadows start at the initial weights (a resumed run loads its own below).
    ema = tf_train.ExponentialMovingAverage(args.ema, num_updates=global_step) if args.ema else None
    if ema is not None:
        ema.apply(model.named_parameters())
    if args.cross_shard:
        opt = CrossShardOptimizer(opt)  # reduction="mean": the gradient of the whole batch
    if args.loss_scale is not None:
        opt = LossScaleOptimizer(opt, args.loss_scale)  # around everything: every rank skips together
    # (Saved and loaded through the outermost optimizer: a loss scale's state is in the groups.)
    start = 0 if args.resume is None else resume(args, model, opt, device, ema)
    global_step.fill_(start)
    schedule = decay_schedule(args, inner, hyperparameters["learning_rate"], start)
    batches = batch_indices(args.seed)
    for _ in range(start):
        next(batches)  # the batches the resumed run already trained on
    describe_run(args, opt, hyperparameters)

    first_loss, accuracy = evaluate(model, train_set)
    print(f"step {start:>5}  training loss {first_loss:.4f}  training accuracy {accuracy:6.1%}")
    log_every = max(1, args.steps // 10)
    started = time.perf_counter()
    for step in range(start + 1, start + args.steps + 1):
        index = next(batches).to(device)
        batch = train_set.batch(index[rank::world])  # this rank's share of the batch
        with mixed_precision(args, device):
            loss = loss_on(model, batch)
        if args.style == "torch":
            opt.zero_grad()
            (opt.get_scaled_loss(loss) if args.loss_scale is not None else loss).backward()
            if args.clip_norm is not None:
                if args.loss_scale is not None:
                    opt.unscale_()  # clip the unscaled gradients
                tf_train.clip_by_global_norm_(model.parameters(), args.clip_norm)
            opt.step()
            global_step += 1
        elif args.clip_norm is None:
            opt.minimize(loss, global_step=global_step)  # LossScaleOptimizer scales it itself
        else:
            grads, params = zip(*opt.compute_gradients(loss), strict=True)  # unscaled, summed
            clipped, _ = tf_train.clip_by_global_norm(list(grads), args.clip_norm)
            opt.apply_gradients(zip(clipped, params, strict=True), global_step=global_step)
        if schedule is not None:
            schedule.step()  # the learning rate of the next step
        if ema is not None:
            ema.apply(model.named_parameters())
        if device.type == "xla":
            end_of_step()
        if (step - start) % log_every == 0 or step == start + args.steps:
            last_loss, accuracy = evaluate(model, train_set)
            print(f"step {step:>5}  training loss {last_loss:.4f}  training accuracy {accuracy:6.1%}")
    seconds = time.perf_counter() - started

    _, held_out_accuracy = evaluate(model, held_out)
    if ema is not None:
        with ema.swapped(model.named_parameters()):
            _, averaged_accuracy = evaluate(model, held_out)
        print(f"held-out accuracy of the moving averages (decay {args.ema}): {averaged_accuracy:.1%}")
    counted = f" (global_step {int(global_step)})" if args.style == "tf" else ""
    if args.loss_scale is not None:
        counted += f", final loss scale {float(opt.loss_scale()):g}"
    print(
        f"done: {cls.__name__}, {args.steps} steps{counted} in {seconds:.2f} s: training loss "
        f"{first_loss:.4f} -> {last_loss:.4f}, held-out accuracy {held_out_accuracy:.1%}"
    )
    if args.save is not None and rank == 0:
        save(args.save, model, opt, start + args.steps, args.optimizer, ema)
        print(f"saved step {start + args.steps} to {args.save}")


def save(
    path: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    optimizer: str,
    ema: tf_train.ExponentialMovingAverage | None = None,
) -> None:
    """What --resume reads: the model's and the optimizer's state_dicts, the step count, the
    optimizer, and the moving averages (with --ema)."""
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
    saved["optimizer_name"] = optimizer
    if ema is not None:
        saved["ema"] = ema.state_dict()
    torch.save(saved, path)


def resume(
    args: argparse.Namespace,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    device: torch.device,
    ema: tf_train.ExponentialMovingAverage | None = None,
) -> int:
    """Load a --save (or convert_tf_checkpoint.py) file into the model, optimizer and moving
    averages; the steps it ran."""
    saved = torch.load(args.resume, map_location=device, weights_only=True)
    if saved["optimizer_name"] != args.optimizer:
        raise SystemExit(
            f"--resume {str(args.resume)!r} holds a {saved['optimizer_name']} run; "
            f"pass --optimizer {saved['optimizer_name']} (its state does not fit {args.optimizer}'s)"
        )
    if ema is not None and "ema" not in saved:
        raise SystemExit(f"--resume {str(args.resume)!r} holds no moving averages: drop --ema, or start anew")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    if ema is not None:
        ema.load_state_dict(saved["ema"])
    print(f"resumed {args.resume} at step {saved['step']}")
    return int(saved["step"])


def xla_device() -> torch.device:
    import torch_xla

    return torch_xla.device()


def end_of_step() -> None:
    """Run the step's XLA graph now: one compiled program per step, reused from the second step on."""
    import torch_xla

    torch_xla.sync()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.export_batches is not None:
        export_batches(args.export_batches, args.seed, args.steps)
        return
    if not args.cross_shard:
        train(args)
        return
    # torchrun's env://. A rank that stops answering makes the others' next collective raise
    # RuntimeError after --timeout seconds, instead of after the default 30 minutes (gloo).
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        # Every rank holds the same parameters, so only rank 0 prints.
        with contextlib.redirect_stdout(io.StringIO()) if dist.get_rank() else contextlib.nullcontext():
            train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
