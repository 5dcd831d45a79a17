"""Bad annotations, recipes and videos: a clear message and the documented exit code, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability import scenarios


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("bad-inputs")
    return work, {label: (args, code, needle) for label, args, code, needle in scenarios.cli_cases(work)}


def _labels() -> list[str]:
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="pfctl-labels-"))
    try:
        return [c[0] for c in scenarios.cli_cases(work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("label", _labels())
def test_cli_case(cases, label: str) -> None:
    work, table = cases
    args, code, needle = table[label]
    got, text, escaped = scenarios.run_cli_case(args)
    assert not escaped, text
    assert got == code, text
    assert needle in text
    assert not (work / "up").exists() and not (work.parent / "up").exists()  # ids stay inside the cache


@pytest.mark.slow
def test_bad_video_corpus(tmp_path: Path) -> None:
    outcome = scenarios.bad_video_scenario(tmp_path)
    assert outcome.ok, outcome.failures
