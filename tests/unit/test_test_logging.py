"""The suite's own output: a failing test's report is not buried under torch's trace records."""

from __future__ import annotations

import pytest
import torch


def test_compiling_leaves_no_trace_records_in_the_captured_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    torch._dynamo.reset()
    try:
        double = torch.compile(lambda x: x * 2 + 1, backend="eager")
        assert torch.equal(double(torch.ones(3)), torch.full((3,), 3.0))
    finally:
        torch._dynamo.reset()
    assert [r for r in caplog.records if r.name == "torch.__trace"] == []
