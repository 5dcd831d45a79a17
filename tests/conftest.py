"""Shared fixtures. Tiny models are built in the tests; nothing is downloaded."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REFERENCE_DIR = REPO.parent / "shared" / "reference" / "pyramid_flow"


def reference_dir() -> Path | None:
    """The reference-vector folder: ``$PFCTL_REFERENCE_DIR`` or ``../shared/reference/pyramid_flow``."""
    path = Path(os.environ.get("PFCTL_REFERENCE_DIR", DEFAULT_REFERENCE_DIR))
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def refdir() -> Path:
    path = reference_dir()
    if path is None and os.environ.get("PFCTL_REQUIRE_REFERENCE"):
        pytest.fail(f"PFCTL_REQUIRE_REFERENCE is set but {os.environ.get('PFCTL_REFERENCE_DIR')} is missing")
    if path is None:
        pytest.skip(
            "reference vectors not found: set PFCTL_REFERENCE_DIR (default ../shared/reference/pyramid_flow)"
        )
    return path


def _no_trace_records(record: logging.LogRecord) -> bool:
    return False


def pytest_configure(config: pytest.Config) -> None:
    """Keep failure reports readable: torch's structured-trace logger ``torch.__trace`` is always at DEBUG
    and does not propagate, and pytest >= 8 attaches its capture handlers to every non-propagating logger,
    so each failure after a ``torch.compile`` listed hundreds of empty ``DEBUG torch.__trace`` lines (their
    payload is meant for TORCH_TRACE files). Those records are dropped unless TORCH_TRACE asks for them."""
    if not os.environ.get("TORCH_TRACE"):
        logging.getLogger("torch.__trace").addFilter(_no_trace_records)


def threads_per_test_process() -> int:
    """Torch's threads in a test process: ``$PFCTL_TEST_THREADS``, else at most 2, the machine's cores shared
    out among pytest-xdist's workers (the suite runs on every core, ``addopts`` in pyproject.toml)."""
    if "PFCTL_TEST_THREADS" in os.environ:
        return int(os.environ["PFCTL_TEST_THREADS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True, scope="session")
def _threads():
    import torch

    torch.set_num_threads(threads_per_test_process())
    yield
