"""A ``torch.optim.lr_scheduler`` that sets ``group["lr"]`` from a TF decay at the scheduler's step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from .learning_rate_decay import LearningRateDecay


class DecayLR(LRScheduler):
    """Set each group's ``lr`` to a TF decay's float32 value at the step ``last_epoch``.

    ``last_epoch`` plays TF's ``global_step``: after construction the learning
    rate is the decay's value at step 0, and each ``step()`` after
    ``optimizer.step()`` moves it one step on, as TF's ``global_step`` moves after
    each ``apply_gradients``. Each value is computed afresh from the step (the
    decay's own ``global_step`` is not read), so the scheduler is closed form:
    ``step(epoch)``, ``SequentialLR`` (which restarts it at 0 at its milestone)
    and ``ChainedScheduler`` (later schedulers scale the value it sets) work as
    with torch's own. ``group["lr"]`` is a Python float holding the float32 value,
    as torch's schedulers write, so a fused or ``torch.compile``d step does not
    recompile as it changes.

    ``state_dict()`` holds the step (``last_epoch``) and torch's bookkeeping, not
    the decays, as ``LambdaLR`` leaves out its functions: make the scheduler with
    the same decays, then ``load_state_dict``.

    Args:
        optimizer: the optimizer whose groups it drives.
        decay: a :class:`LearningRateDecay` for every group, or one per group.
        last_epoch: torch's: -1 to start.

    Raises:
        TypeError: ``decay`` is not a decay (or a list of them), or a group's
            ``lr`` is a callable (which this would replace).
        ValueError: a list of decays of another length than ``param_groups``.

    Example:
        >>> import torch
        >>> from torchgrad_compat import optim, train
        >>> w = torch.zeros(3, requires_grad=True)
        >>> opt = optim.MomentumOptimizer([w], learning_rate=0.1, momentum=0.9)
        >>> sched = train.DecayLR(opt, train.cosine_decay(0.1, None, 1000))
        >>> for _ in range(3):
        ...     (w - 1).square().sum().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        ...     sched.step()
        >>> opt.param_groups[0]["lr"] == train.cosine_decay(0.1, None, 1000).at(3)
        True
    """

    def __init__(
        self,
        optimizer: Optimizer,
        decay: LearningRateDecay | Sequence[LearningRateDecay],
        last_epoch: int = -1,
    ) -> None:
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        decays = [decay] * len(groups) if isinstance(decay, LearningRateDecay) else list(decay)
        for i, d in enumerate(decays):
            if not isinstance(d, LearningRateDecay):
                raise TypeError(
                    f"decay[{i}] must be a LearningRateDecay (from a decay function), got {type(d).__name__}"
                )
        if len(decays) != len(groups):
            raise ValueError(
                f"Invalid decay value: {len(decays)} decays; expected one per param group ({len(groups)})"
            )
        for i, group in enumerate(groups):
            if callable(group["lr"]) and not isinstance(group["lr"], Tensor):
                raise TypeError(
                    f"param_groups[{i}]['lr'] is a callable ({group['lr']!r}); DecayLR sets the learning "
                    "rate itself: give the optimizer a number, or use the decay as learning_rate alone"
                )
        self.decays = decays
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [decay.at(self.last_epoch) for decay in self.decays]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "decays")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; a state without a valid ``last_epoch`` changes nothing."""
        last_epoch = state_dict.get("last_epoch")
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"Invalid last_epoch value: {last_epoch!r}; expected an int >= -1")
        unknown = {"optimizer", "decays"} & state_dict.keys()
        if unknown:
            raise ValueError(f"Invalid state_dict value: it holds {sorted(unknown)}, which are not state")
        self.__dict__.update(state_dict)
