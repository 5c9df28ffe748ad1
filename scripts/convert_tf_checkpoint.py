"""Convert a TensorFlow 1 checkpoint of scripts/train.py's model into a file train.py --resume continues.

    python scripts/convert_tf_checkpoint.py tests/fixtures/tf_train/adam converted.pt --optimizer adam
    python scripts/train.py --resume converted.pt --optimizer adam --steps 5 --save continued.pt

The checkpoint (a prefix, or a directory: its latest) is what
``tf.compat.v1.train.Saver`` wrote for train.py's model built in TF
(scripts/make_tf_train_checkpoint.py builds one): whatever its variable names,
``suggest_var_map`` matches them to the torch model by name, shape and order
and prints what it matched and how (a Dense kernel is transposed into torch's
Linear layout), and refuses a guess. ``load_tf_checkpoint`` then fills the
model and the optimizer's slots and optimizer-wide state (Adam's beta powers,
AdagradDA's step) and reads the global step, all or nothing. The output holds
the model's and the optimizer's ``state_dict`` and the step, as train.py's
``--save`` writes them; ``--resume`` continues from the next batch.

``--optimizer`` must be the optimizer the TF run used (and with it train.py's
hyperparameters, which a checkpoint does not hold); ``--optimizer-name`` is
its TF ``name=`` if not the default. ``--weights-only`` starts a new optimizer
from the TF weights (fine-tuning with another optimizer): its slots, absent
from the checkpoint, start at their initial values and the step at 0.

``--ema DECAY`` carries the moving averages of a run that kept an
``ExponentialMovingAverage`` of the weights (``<variable>/ExponentialMovingAverage``)
into the file, for ``train.py --resume --ema DECAY``. A run of TF1's whole
loop, a decay, clipping and averages (``make_tf_train_checkpoint.py --loop``),
continues with the same flags::

    python scripts/convert_tf_checkpoint.py tests/fixtures/tf_train_loop/adam converted.pt --ema 0.99
    python scripts/train.py --resume converted.pt --steps 5 --decay cosine --warmup-steps 7 \
        --decay-steps 8 --clip-norm 0.5 --ema 0.99
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train.py, beside this script

from train import OPTIMIZERS, Classifier, optimizer_settings, save

from torchgrad_compat.checkpoint import load_tf_checkpoint, suggest_var_map
from torchgrad_compat.train import ExponentialMovingAverage


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="TF checkpoint prefix (model.ckpt-5) or directory")
    parser.add_argument("output", type=Path, help="the file train.py --resume reads")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--optimizer-name", help="TF's name= of the optimizer, if not the default")
    parser.add_argument("--lr", type=float, default=None, help="as train.py's --lr")
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="load the weights only; the optimizer starts fresh and the step at 0",
    )
    parser.add_argument(
        "--ema",
        type=float,
        default=None,
        metavar="DECAY",
        help="as train.py's --ema: load the weights' moving averages too, for --resume --ema DECAY",
    )
    args = parser.parse_args(argv)
    if args.ema is not None and not 0 <= args.ema <= 1:
        parser.error(f"--ema must be a decay in [0, 1], got {args.ema}")

    model = Classifier()
    cls, hyperparameters = optimizer_settings(args.optimizer, args.lr)
    opt = cls(model.parameters(), **hyperparameters)
    var_map = suggest_var_map(args.checkpoint, model, verbose=True)
    if var_map.unmatched_checkpoint or var_map.unmatched_module:
        raise SystemExit("not every variable was matched (see above): this is not train.py's model")
    ema = None
    if args.ema is not None:
        ema = ExponentialMovingAverage(args.ema)  # train.py's (its num_updates is its global step)
        ema.apply(model.named_parameters())  # the shadows, which the load fills
    if args.weights_only:  # the optimizer stays fresh: its first step makes its slots, as TF's would
        info = load_tf_checkpoint(args.checkpoint, var_map, ema=ema)
    else:
        info = load_tf_checkpoint(args.checkpoint, var_map, opt, ema=ema, optimizer_name=args.optimizer_name)
    step = 0 if args.weights_only or info.global_step is None else info.global_step
    unused = ", ".join(info.unused) or "none"
    print(f"loaded {len(info.loaded)} tensors at global step {info.global_step}; unused: {unused}")
    save(args.output, model, opt, step, args.optimizer, ema)
    resume = f"--resume {args.output} --optimizer {args.optimizer}"
    if ema is not None:
        resume += f" --ema {args.ema}"
    print(f"wrote {args.output}: python scripts/train.py {resume}")


if __name__ == "__main__":
    main()
