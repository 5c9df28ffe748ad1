"""docs/amp.md's recipes for trainers that call ``loss.backward()`` themselves: its own code, run for real.

PyTorch Lightning (a precision plugin for automatic optimization; manual
optimization) and Hugging Face's ``Trainer`` (a subclass), each against the same
steps written as a plain loop: bitwise the same parameters and loss scales, with
gradient accumulation, gradient clipping and a step skipped for an inf. Without
the recipe, the trainer's unscaled ``loss.backward()`` makes ``step()`` raise.
Skipped when the trainer's package is not installed.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _readme import run_block
from torch import Tensor, nn

import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer

BATCHES = 8
POISONED = 4  # the loss of this micro-batch is times inf: its optimizer step is skipped
CLIP = 0.05
MANUAL_CLIP = 1.0  # docs/amp.md's manual optimization recipe clips to this norm


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(i: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)


def _loss(model: nn.Module, x: Tensor, y: Tensor, i: int) -> Tensor:
    return F.mse_loss(model(x), y) * (math.inf if i == POISONED else 1.0)


def _optimizer(model: nn.Module) -> LossScaleOptimizer:
    return LossScaleOptimizer(tgo.AdamOptimizer(model.parameters(), 0.01), DynamicLossScale(128.0, 2))


def _autocast(enabled: bool) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def _reference(
    accumulate: int, clip: float | None, autocast: bool = False
) -> tuple[list[Tensor], list[float]]:
    """The same training as a plain loop: parameters at the end, the scale after each step."""
    model = _model()
    opt = _optimizer(model)
    scales = []
    for first in range(0, BATCHES, accumulate):
        opt.zero_grad()
        for i in range(first, first + accumulate):
            x, y = _batch(i)
            with _autocast(autocast):
                loss = _loss(model, x, y, i)
            opt.get_scaled_loss(loss / accumulate).backward()
        opt.unscale_()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        scales.append(float(opt.loss_scale()))
    return [p.detach().clone() for p in model.parameters()], scales


def _assert_same_run(
    params: list[Tensor], scales: list[float], accumulate: int, clip: float | None, autocast: bool = False
) -> None:
    expected_params, expected_scales = _reference(accumulate, clip, autocast)
    assert scales == expected_scales
    assert any(b < a for a, b in itertools.pairwise(expected_scales)), "a step was skipped"
    for p, q in zip(params, expected_params, strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------- PyTorch Lightning
def _lightning() -> Any:
    return pytest.importorskip("lightning.pytorch", reason="lightning is not installed")


def _loss_scale_precision(autocast: bool) -> Any:
    """docs/amp.md's precision plugin (Lightning's own AMP plugin does the same around GradScaler),
    autocasting to bfloat16 on the CPU here (the page's autocasts to float16 on CUDA)."""
    readme = run_block("class LossScalePrecision", torch=torch)

    class OnTheCPU(readme["LossScalePrecision"]):
        def forward_context(self):
            return _autocast(autocast)

    return OnTheCPU()


def _lightning_module(L: Any, manual: bool, scales: list[float]) -> Any:
    # docs/amp.md's manual optimization recipe is this module's training_step.
    readme_training_step = run_block("self.manual_backward")["training_step"]

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual
            self.net = _model()

        def configure_optimizers(self) -> LossScaleOptimizer:
            return _optimizer(self.net)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            self.batch_idx = batch_idx
            if manual:
                return readme_training_step(self, batch, batch_idx)
            return self.loss(batch)

        def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
            return _loss(self.net, *batch, self.batch_idx)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if manual or (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
                scales.append(float(self.optimizers().optimizer.loss_scale()))

    return Regressor()


def _fit(L: Any, module: Any, **trainer_kwargs: Any) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    data = torch.utils.data.DataLoader([_batch(i) for i in range(BATCHES)], batch_size=None)
    trainer.fit(module, data)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers and logging
@pytest.mark.parametrize(("accumulate", "autocast"), [(1, False), (2, False), (2, True)])
def test_lightning_automatic_optimization_with_the_precision_plugin(accumulate: int, autocast: bool) -> None:
    L = _lightning()
    scales: list[float] = []
    module = _lightning_module(L, manual=False, scales=scales)
    _fit(
        L,
        module,
        plugins=[_loss_scale_precision(autocast)],
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP,
    )
    _assert_same_run(list(module.net.parameters()), scales, accumulate, CLIP, autocast)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_manual_optimization() -> None:
    L = _lightning()
    scales: list[float] = []
    module = _lightning_module(L, manual=True, scales=scales)
    _fit(L, module)
    _assert_same_run(list(module.net.parameters()), scales, 1, MANUAL_CLIP)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_without_the_plugin_raises() -> None:
    """Lightning's own backward is loss.backward(): the update would be divided by the scale."""
    L = _lightning()
    with pytest.raises(RuntimeError, match=r"no backward pass went through opt.get_scaled_loss"):
        _fit(L, _lightning_module(L, manual=False, scales=[]))


# ---------------------------------------------------------------------- Hugging Face Trainer
def _loss_scale_trainer(transformers: Any, tmp_path: Any) -> type:
    """docs/amp.md's Trainer subclass; its block runs as written, building a Trainer."""
    namespace = {"torch": torch, "AdamOptimizer": tgo.AdamOptimizer, "model": _HFRegressor(), "data": []}
    namespace["args"] = _hf_args(transformers, tmp_path, 1)
    return run_block("class LossScaleTrainer", **namespace)["LossScaleTrainer"]


class _HFRegressor(nn.Module):
    """A model as Trainer expects one: keyword inputs, a dict with "loss". Records the batch order."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.order: list[int] = []

    def forward(self, x: Tensor, y: Tensor, index: Tensor) -> dict[str, Tensor]:
        if self.training:
            self.order.append(int(index))
        return {"loss": _loss(self.net, x, y, int(index))}


def _hf_args(transformers: Any, tmp_path: Any, accumulate: int) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,  # one item of the data set is one whole batch
        gradient_accumulation_steps=accumulate,
        max_grad_norm=CLIP,
        num_train_epochs=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
    )


def _hf_train(
    transformers: Any, trainer_cls: type, tmp_path: Any, accumulate: int
) -> tuple[_HFRegressor, LossScaleOptimizer]:
    model = _HFRegressor()
    opt = _optimizer(model.net)
    args = _hf_args(transformers, tmp_path, accumulate)
    data = [
        {"x": x, "y": y, "index": torch.tensor(i)} for i, (x, y) in enumerate(map(_batch, range(BATCHES)))
    ]
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=lambda items: items[0],
        optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)),
    )
    trainer.train()
    return model, opt


@pytest.mark.parametrize("accumulate", [1, 2])
def test_hugging_face_trainer_subclass(tmp_path: Any, accumulate: int) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    model, trained = _hf_train(
        transformers, _loss_scale_trainer(transformers, tmp_path), tmp_path, accumulate
    )
    # Trainer shuffles the batches: the reference takes them in the order the model saw them.
    order = model.order
    assert sorted(order) == list(range(BATCHES))
    reference = _model()
    opt = _optimizer(reference)
    for first in range(0, BATCHES, accumulate):
        opt.zero_grad()
        for i in order[first : first + accumulate]:
            x, y = _batch(i)
            opt.get_scaled_loss(_loss(reference, x, y, i) / accumulate).backward()
        opt.unscale_()
        nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        opt.step()
    assert float(trained.loss_scale()) == float(opt.loss_scale())
    assert float(opt.loss_scale()) < 128.0 * 2 ** (BATCHES // accumulate // 2), "a step was skipped"
    for p, q in zip(model.net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_hugging_face_trainer_without_the_subclass_raises(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    with pytest.raises(RuntimeError, match=r"no backward pass went through opt.get_scaled_loss"):
        _hf_train(transformers, transformers.Trainer, tmp_path, 1)
