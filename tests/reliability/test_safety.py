"""Safe formats only; nothing written outside the output folders; NaN detected and reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability import scenarios


def test_no_pickle_no_unsafe_yaml() -> None:
    outcome = scenarios.static_safety_scan()
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_encode_rejects_nan_latents(tmp_path: Path) -> None:
    outcome = scenarios.encode_nan_scenario(tmp_path)
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_train_nan_policy_stop_and_skip(tmp_path: Path) -> None:
    outcome = scenarios.train_nan_scenario(tmp_path)
    assert outcome.ok, outcome.failures


@pytest.mark.slow
def test_nothing_written_outside_the_output_folders(tmp_path: Path) -> None:
    outcome = scenarios.outside_writes_scenario(tmp_path)
    assert outcome.ok, outcome.failures
