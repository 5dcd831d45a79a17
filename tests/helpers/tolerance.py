"""Tolerances for two computations of the same mathematics that are not the same call on the same memory.

Two such computations agree bit for bit only when they run the same kernels on the same memory. Anything else
(another x86-64 CPU with other SIMD widths, weights loaded from disk at another alignment, a channels-last
layout, a compiled graph, a chunked or tiled call, another batch composition or thread count) may sum in
another order, and a floating-point sum depends on its order.

Derivation. A sum of ``n`` products computed in two orders differs by accumulated rounding errors of at most
``eps/2`` relative to each partial sum; modelled as independent, they add as a random walk, so the two
results differ by about ``eps * sqrt(n) * m`` where ``m`` is the magnitude of the terms (the worst case,
``eps * n * m``, needs every rounding to go the same way). A network chains ``depth`` such reductions; their
independent errors add in quadrature: ``eps * sqrt(n * depth) * m``. ``ulps`` is the margin: the largest
difference over thousands of elements lies several standard deviations out, and the terms of a sum can be
larger than its result. ``m`` is taken as the largest magnitude of the expected tensor, which the tiny test
models keep near 1 (normalised activations). ``eps`` is that of the dtype the computation runs in.

Real bugs (a dropped bias, a wrong mask, a swapped axis) change results by far more than this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def rounding_rtol(
    reduction: int, depth: int = 1, ulps: float = 8.0, dtype: torch.dtype = torch.float32
) -> float:
    """Relative tolerance for ``depth`` chained sums of ``reduction`` terms each, in ``dtype``."""
    return ulps * torch.finfo(dtype).eps * math.sqrt(max(reduction, 1) * max(depth, 1))


def assert_rounding_close(
    actual: torch.Tensor | Sequence[float],
    expected: torch.Tensor | Sequence[float],
    *,
    reduction: int,
    depth: int = 1,
    ulps: float = 8.0,
    msg: str | None = None,
) -> None:
    """``actual`` equals ``expected`` up to the rounding of another summation order (module docstring).

    ``reduction``: the longest sum an output element goes through (a matmul's inner size, a convolution's
    ``channels * kernel volume``, an attention's key count); ``depth``: how many such sums are chained.
    Sequences of Python floats (e.g. a run's losses) are compared as float32 tensors.
    """
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    rtol = rounding_rtol(reduction, depth, ulps, expected.dtype)
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30), msg=msg)
