"""Helpers every command uses: config resolution and the error → exit-code mapping."""

from __future__ import annotations

import errno
import os
import sys
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer

from pfctl.errors import EXIT_CHECK_FAILED, EXIT_USAGE, PfctlError

if TYPE_CHECKING:
    from pfctl.config.schema import RecipeConfig

STATE = {"debug": os.environ.get("PFCTL_DEBUG", "") not in ("", "0")}


def _stderr(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(message, markup=False)


@contextmanager
def command_errors() -> Iterator[None]:
    """Turn expected failures into one clear line and the documented exit code.

    0 ok, 1 a check failed, 2 usage error / bad input. ``--debug`` (or ``PFCTL_DEBUG=1``) adds the
    traceback above that line; the exit code stays the same. Unexpected errors exit 1 with a pointer
    to ``--debug``.
    """
    rank = os.environ.get("RANK")
    where = f" on rank {rank}" if rank is not None and world_size_env() > 1 else ""
    try:
        yield
    except KeyboardInterrupt:
        _stderr("interrupted")
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except Exception as exc:
        if STATE["debug"]:
            sys.stderr.write(traceback.format_exc())
            sys.stderr.flush()
        raise typer.Exit(_report(exc, where)) from None


def _report(exc: Exception, where: str) -> int:
    """Print ``exc`` as one line (+ a hint) and return its exit code."""
    if isinstance(exc, PfctlError):
        _stderr(f"error{where}: {exc.message}")
        if exc.hint:
            _stderr(f"  hint: {exc.hint}")
        return exc.exit_code
    if isinstance(exc, OSError) and exc.errno in _OS_ERRORS:
        code, hint = _OS_ERRORS[exc.errno]
        target = f": {exc.filename}" if exc.filename else ""
        _stderr(f"error{where}: {exc.strerror or exc}{target}")
        _stderr(f"  hint: {hint}")
        return code
    if _is_collective_failure(exc):
        _stderr(f"error{where}: a collective operation failed: {type(exc).__name__}: {str(exc)[:300]}")
        _stderr(
            "  hint: another process stopped or stalled (its own error above names the reason); "
            "see runtime.collective_timeout_s"
        )
        return EXIT_CHECK_FAILED
    _stderr(f"internal error{where}: {type(exc).__name__}: {exc}")
    if not STATE["debug"]:
        _stderr("  hint: rerun with --debug (or PFCTL_DEBUG=1) for the traceback, and report it")
    return EXIT_CHECK_FAILED


_RESUME = "finished work is kept: rerun the same command to resume"
_OS_ERRORS = {
    errno.ENOSPC: (
        EXIT_CHECK_FAILED,
        f"the disk is full: free space (or choose another output folder); {_RESUME}",
    ),
    errno.EDQUOT: (EXIT_CHECK_FAILED, f"the disk quota is exceeded: free space; {_RESUME}"),
    errno.EROFS: (EXIT_USAGE, "the file system is read-only: choose a writable output folder"),
    errno.EACCES: (EXIT_USAGE, "permission denied: choose a folder you can write to, or fix its permissions"),
    errno.EPERM: (EXIT_USAGE, "operation not permitted: choose a folder you can write to"),
}
"""Environment failures (not bugs): errno → (exit code, hint). Disk full is a failed run (1);
an unwritable output folder is a bad input (2)."""


def world_size_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _is_collective_failure(exc: BaseException) -> bool:
    """gloo / NCCL errors a surviving rank sees when a peer died or stalled."""
    name = type(exc).__name__
    text = str(exc)
    return name in ("DistBackendError", "DistNetworkError", "DistError") or any(
        key in text.lower()
        for key in (
            "gloo",
            "nccl",
            "connection closed by peer",
            "connection reset by peer",
            "timed out waiting",
        )
    )


def resolve_config(
    recipe: str | None, overrides: list[str] | None, flags: Mapping[str, Any] | None = None
) -> RecipeConfig:
    """Recipe + ``--set`` + flags → validated :class:`pfctl.config.schema.RecipeConfig`."""
    from pfctl.config import load_config

    return load_config(recipe, overrides or (), flags)


def print_config(config: Any) -> None:
    from pfctl.config import dump_config

    sys.stdout.write(dump_config(config))
