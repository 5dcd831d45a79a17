"""A full disk, read-only folders, and a failing rank under torchrun (4 CPU processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability import scenarios


@pytest.mark.slow
def test_encode_disk_full_then_resume(tmp_path: Path) -> None:
    outcome = scenarios.encode_disk_full_scenario(tmp_path)
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_read_only_output_exits_2(tmp_path: Path) -> None:
    outcome = scenarios.read_only_scenario(tmp_path)
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_a_raising_rank_stops_every_rank(tmp_path: Path) -> None:
    outcome = scenarios.dist_raise_scenario(tmp_path)
    assert outcome.ok, (outcome.failures, outcome.notes)
