"""Helpers every command uses: config resolution and the error → exit-code mapping."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import typer

from pfctl.errors import EXIT_CHECK_FAILED, PfctlError

STATE = {"debug": os.environ.get("PFCTL_DEBUG", "") not in ("", "0")}


def _stderr(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(message, markup=False)


@contextmanager
def command_errors() -> Iterator[None]:
    """Turn expected failures into one clear line and the documented exit code.

    0 ok, 1 a check failed, 2 usage error / bad input. A traceback is shown only with
    ``--debug`` (or ``PFCTL_DEBUG=1``); unexpected errors exit 1 with a pointer to it.
    """
    try:
        yield
    except PfctlError as exc:
        if STATE["debug"]:
            raise
        _stderr(f"error: {exc.message}")
        if exc.hint:
            _stderr(f"  hint: {exc.hint}")
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        _stderr("interrupted")
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except Exception as exc:
        if STATE["debug"]:
            raise
        rank = os.environ.get("RANK")
        where = f" on rank {rank}" if rank is not None else ""
        _stderr(f"internal error{where}: {type(exc).__name__}: {exc}")
        _stderr("  hint: rerun with --debug (or PFCTL_DEBUG=1) for the traceback, and report it")
        raise typer.Exit(EXIT_CHECK_FAILED) from None


def resolve_config(recipe: str | None, overrides: list[str] | None, flags: Mapping[str, Any] | None = None):
    """Recipe + ``--set`` + flags → validated :class:`pfctl.config.schema.RecipeConfig`."""
    from pfctl.config import load_config

    return load_config(recipe, overrides or (), flags)


def print_config(config: Any) -> None:
    from pfctl.config import dump_config

    sys.stdout.write(dump_config(config))
