"""Safe formats only; nothing written outside the output folders; NaN detected and reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability import harness


def test_no_pickle_no_unsafe_yaml() -> None:
    outcome = harness.static_safety_scan()
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_encode_rejects_nan_latents(tmp_path: Path) -> None:
    outcome = harness.encode_nan_scenario(tmp_path)
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_train_nan_policy_stop_and_skip(tmp_path: Path) -> None:
    outcome = harness.train_nan_scenario(tmp_path)
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_nothing_written_outside_the_output_folders(tmp_path: Path) -> None:
    outcome = harness.outside_writes_scenario(tmp_path)
    assert outcome.ok, outcome.failures
