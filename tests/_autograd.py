"""Autograd functions the tests share."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class FailingBackward(torch.autograd.Function):
    """The identity forward, a backward that raises: a backward pass failing midway."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError("backward failed on purpose")
