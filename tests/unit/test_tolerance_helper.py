"""helpers.tolerance: the rounding tolerance accepts another summation order and still catches a real change."""

from __future__ import annotations

import pytest
import torch

from helpers.tolerance import assert_rounding_close, rounding_rtol


def test_another_summation_order_passes_and_a_real_change_does_not() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=gen), torch.randn(512, 64, generator=gen)
    one_call = a @ b
    chunked = sum(a[:, i : i + 7] @ b[i : i + 7] for i in range(0, 512, 7))  # the same sums, another order
    assert not torch.equal(chunked, one_call)  # what bit-equality would have refused
    assert_rounding_close(chunked, one_call, reduction=512)
    assert_rounding_close(one_call, (a.double() @ b.double()).float(), reduction=512)  # vs the exact product
    with pytest.raises(AssertionError):
        assert_rounding_close(one_call * (1 + 1e-3), one_call, reduction=512)  # e.g. a lost term or scale


def test_tolerance_grows_with_the_sums_and_the_dtype() -> None:
    assert rounding_rtol(4) < rounding_rtol(400) < rounding_rtol(400, depth=10)
    assert rounding_rtol(4, dtype=torch.float32) < rounding_rtol(4, dtype=torch.bfloat16)
    assert_rounding_close([1.0, 2.0], [1.0, 2.0], reduction=1)  # plain lists (a run's losses) work too
