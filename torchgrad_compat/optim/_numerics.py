"""TensorFlow's arithmetic where torch's differs: correctly rounded square roots, half-precision
working copies, and duplicate sparse rows summed in TF's order."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from .._torch_internals import bump_versions, sparse_rows, sparse_values

_VALID_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_HALF_DTYPES = (torch.float16, torch.bfloat16)

# Where numpy's square root serves (see sqrt).
_NUMPY_SQRT_DTYPES = (torch.float32, torch.float64)


def _numpy_view(t: Tensor) -> np.ndarray | None:
    """``t``'s memory as a numpy array, where numpy's square root may stand in for torch's: a
    plain float32 or float64 CPU tensor that autograd is not to record an operation on, outside
    ``torch.compile`` (see :func:`sqrt`)."""
    if (
        torch.compiler.is_compiling()
        or (t.requires_grad and torch.is_grad_enabled())
        or t.dtype not in _NUMPY_SQRT_DTYPES
        or t.device.type != "cpu"
        or type(t) not in (Tensor, torch.nn.Parameter)
    ):
        return None
    return t.detach().numpy()


def sqrt(t: Tensor) -> Tensor:
    """``√t``, correctly rounded, as TensorFlow's square root and the code Inductor generates.

    torch's eager CPU ``sqrt`` is not correctly rounded in every release: torch 2.13 is an ulp off
    for about 17% of float32 inputs and 1.3% of float64 ones (on an AVX-512 CPU), and rules that
    subtract square roots (Ftrl's ``√n - √a``) carry that ulp far beyond TF's numbers. On the CPU
    numpy's, the processor's instruction, serves instead; elsewhere (CUDA), for a tensor that
    requires grad with grad mode on, and inside ``torch.compile`` (which generates a correctly
    rounded one) torch's own.
    """
    src = _numpy_view(t)
    if src is None:
        return t.sqrt()
    out = torch.empty_like(t)
    np.sqrt(src, out=out.numpy())
    return out


def sqrt_(t: Tensor) -> Tensor:
    """:func:`sqrt` in place; ``t``. Its version counter moves, as with ``t.sqrt_()``: autograd
    refuses a backward pass through an operation that saved it before."""
    src = _numpy_view(t)
    if src is None:
        return t.sqrt_()
    np.sqrt(src, out=src)
    bump_versions([t])
    return t


def foreach_sqrt_(tensors: list[Tensor]) -> None:
    """:func:`sqrt_` over a list (``torch._foreach_sqrt_`` where that one serves)."""
    if not tensors or _numpy_view(tensors[0]) is None:
        torch._foreach_sqrt_(tensors)
        return
    for t in tensors:
        sqrt_(t)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF_DTYPES else dtype


@contextmanager
def _working_precision(
    params: list[Tensor], grads: list[Tensor], slots: list[dict[str, Tensor]]
) -> Iterator[tuple[list[Tensor], list[Tensor], list[dict[str, Tensor]]]]:
    """The tensors an update works on: float32 working copies for half-precision parameters.

    float16/bfloat16 parameters are updated through float32 copies (of
    parameter, gradient and slots), with float32 hyperparameters, and rounded
    back once when stored, as torch's fused kernels do. TensorFlow instead casts
    the hyperparameters to the half dtype, where ``bfloat16(1 - 0.999) == 0`` and
    ``float16(1e-8) == 0``: its bfloat16 Adam never updates ``v``.
    """
    if params[0].dtype not in _HALF_DTYPES:
        yield params, grads, slots
        return
    wide_params = [p.float() for p in params]
    wide_slots = [{k: v.float() for k, v in s.items()} for s in slots]
    yield wide_params, [g.float() for g in grads], wide_slots
    for p, wide in zip(params, wide_params, strict=True):
        p.copy_(wide)
    for s, wide in zip(slots, wide_slots, strict=True):
        for k, v in s.items():
            v.copy_(wide[k])


def one_element_rows(p: Tensor) -> bool:
    """Whether each row of ``p`` holds one element (a 1-D parameter, or rows of shape (1,)): TF's
    sparse kernels take such a variable (``inner_dim == 1``) through scalar C++ code, whose
    roundings the sparse rules follow there."""
    return math.prod(p.shape[1:]) == 1


def summed_rows(g: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of the row-sparse gradient ``g``, sorted and unique, and their values, with the
    values of a row given more than once summed as TensorFlow sums them.

    TF's optimizers sum the duplicates of an ``IndexedSlices`` with ``unsorted_segment_sum``:
    from zero, adding each row's values in the order they are given. ``coalesce()`` adds them
    in that order only up to 16 entries; past that its sort moves them, and the sums differ in
    their last bits (more where the values cancel). On the CPU they are added here in the
    order given (``index_add_`` into zeros goes through the rows in order); half-precision
    values in float32, rounded once (TF rounds each addition to the half dtype). On other
    devices, where TF's sum runs in no set order either, ``coalesce()`` sums them. A gradient
    marked coalesced (rows sorted and unique, see :func:`_check_rows`) is taken as it is.
    """
    if g.is_coalesced() or g.device.type != "cpu":
        g = g.coalesce()
        return sparse_rows(g), sparse_values(g)
    values = sparse_values(g)
    rows, where = torch.unique(sparse_rows(g), return_inverse=True)
    wide = values.float() if values.dtype in _HALF_DTYPES else values
    summed = wide.new_zeros((rows.numel(), *values.shape[1:]))
    summed.index_add_(0, where, wide)
    return rows, summed.to(values.dtype)
