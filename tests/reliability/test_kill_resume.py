"""SIGKILL at seeded random moments, then resume (the full command runs >= 12 kills each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability import harness


@pytest.mark.slow
def test_encode_survives_kills(tmp_path: Path) -> None:
    outcome = harness.encode_kill_scenario(tmp_path, kills=2, seed=7)
    assert outcome.ok, (outcome.failures, outcome.notes)


@pytest.mark.slow
def test_train_resumes_bit_identically_after_kills(tmp_path: Path) -> None:
    outcome = harness.train_kill_scenario(tmp_path, kills=2, seed=8, max_steps=4)
    assert outcome.ok, (outcome.failures, outcome.notes)
