"""TensorFlow's float32 scalar arithmetic on the host, op by op.

A learning-rate decay is a handful of 0-d float32 ops. TensorFlow runs each on
the CPU through Eigen's scalar path: ``+ - * /`` and ``sqrt`` correctly
rounded, ``exp``, ``log``, ``cos`` and ``pow`` by the C library's float
functions (``expf``, ``logf``, ``cosf``, ``powf``), and every result flushed to
zero when it is subnormal (TF runs its kernels with flush-to-zero and
denormals-are-zero set). This module reproduces exactly that with Python
floats:

- ``+ - * /`` and ``sqrt`` of two float32 numbers computed in double and
  rounded to float32 once give the correctly rounded float32 result (a double
  holds more than twice float32's 24 bits, so the double rounding is
  innocuous);
- the transcendental functions are the C library's own, through ``ctypes``;
- :func:`f32` rounds to float32 and flushes a subnormal to a zero of its sign.

torch's 0-d CPU ops are not TF's here: they take SLEEF's vectorised
approximations and keep subnormals. Over 6000 random float32 arguments each,
against TF 2.21: ``exp`` differs in 48, ``cos`` in 303, ``log`` in 43, ``sqrt``
in 927, ``pow`` only where TF flushes a subnormal result (32); computing in
double and rounding once differs too (``cos`` in 86, ``exp`` in 5), as the C
library's float functions are not always correctly rounded. The C library's
float functions through this module: 0 differences.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import struct

_FLT_MIN = 1.1754943508222875e-38  # the smallest normal float32

# struct's native "f" packs a double by the C cast to float (round to nearest, inf beyond the
# range), as ctypes.c_float does, in less time: a decay rounds a handful of numbers at every step.
_FLOAT = struct.Struct("f")
_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or ctypes.util.find_library("c"))


def _float_function(name: str, arity: int):
    function = getattr(_LIBM, name)
    function.restype = ctypes.c_float
    function.argtypes = [ctypes.c_float] * arity
    return function


_expf = _float_function("expf", 1)
_logf = _float_function("logf", 1)
_cosf = _float_function("cosf", 1)
_powf = _float_function("powf", 2)


def f32(x: float) -> float:
    """``x`` rounded to float32 (inf beyond its range), a subnormal result flushed to a signed zero."""
    try:
        (y,) = _FLOAT.unpack(_FLOAT.pack(x))
    except struct.error:  # (not a float: ctypes raises its own error, OverflowError for a huge int)
        y = ctypes.c_float(x).value
    if -_FLT_MIN < y < _FLT_MIN:
        return math.copysign(0.0, y)
    return y


def add(a: float, b: float) -> float:
    return f32(a + b)


def sub(a: float, b: float) -> float:
    return f32(a - b)


def mul(a: float, b: float) -> float:
    return f32(a * b)


def div(a: float, b: float) -> float:
    """IEEE division: a zero divisor gives a signed inf, or NaN for 0/0 (Python would raise)."""
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return f32(a / b)


def minimum(a: float, b: float) -> float:
    """TF's ``minimum``: NaN if either operand is NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return min(a, b)


def floor(x: float) -> float:
    return x if not math.isfinite(x) else float(math.floor(x))


def ceil(x: float) -> float:
    return x if not math.isfinite(x) else float(math.ceil(x))


def sqrt(x: float) -> float:
    return math.nan if x < 0 or math.isnan(x) else f32(math.sqrt(x))


def exp(x: float) -> float:
    return f32(_expf(x))


def log(x: float) -> float:
    return f32(_logf(x))


def cos(x: float) -> float:
    return f32(_cosf(x))


def pow(x: float, y: float) -> float:
    return f32(_powf(x, y))
