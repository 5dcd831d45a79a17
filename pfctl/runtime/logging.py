"""Rank-aware output: rich on a terminal, plain lines elsewhere, silence on non-main ranks."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

_STATE: dict[str, Any] = {"is_main": True, "rank": 0, "format": "auto"}


def configure(is_main: bool, rank: int = 0, log_format: str = "auto") -> None:
    """Called once by the runtime (before it seeds): decides who prints and how.

    Imports rich now: ``rich.style`` draws from python's global RNG at import time, and a first
    import *after* a resume restored the RNG states would shift the stream (a resumed run's
    checkpoints then differ from an uninterrupted run's).
    """
    import rich.console
    import rich.progress
    import rich.style  # noqa: F401

    _STATE.update(is_main=is_main, rank=rank, format=log_format)


def use_rich() -> bool:
    fmt = _STATE["format"]
    if fmt == "rich":
        return True
    if fmt == "plain":
        return False
    return sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


def console() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, force_terminal=None if use_rich() else False)


def log(message: str, *, all_ranks: bool = False) -> None:
    """Print one line on the main process (or on every rank, prefixed, with ``all_ranks``)."""
    if all_ranks and not _STATE["is_main"]:
        print(f"[rank {_STATE['rank']}] {message}", flush=True)
    elif _STATE["is_main"]:
        console().print(message, markup=False)  # paths and error texts hold brackets: never markup


def warn(message: str) -> None:
    if _STATE["is_main"]:
        from rich.text import Text

        console().print(Text.assemble(("warning:", "yellow"), " ", message))


class _PlainProgress:
    """Progress as plain lines, at most one every ``interval`` seconds (logs, CI, pipes)."""

    def __init__(self, description: str, total: int | None, enabled: bool, interval: float = 10.0):
        self.description, self.total, self.enabled, self.interval = description, total, enabled, interval
        self.done = 0
        self.start = self.last = time.monotonic()

    def update(self, advance: int = 1, **fields: Any) -> None:
        self.done += advance
        now = time.monotonic()
        finished = self.total is not None and self.done >= self.total
        if self.enabled and (now - self.last >= self.interval or finished):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            extra = " ".join(f"{k}={v}" for k, v in fields.items())
            total = f"/{self.total}" if self.total is not None else ""
            print(f"{self.description}: {self.done}{total} ({rate:.2f}/s) {extra}".rstrip(), flush=True)


class _RichProgress:
    def __init__(self, progress: Any, task: Any):
        self.progress, self.task = progress, task

    def update(self, advance: int = 1, **fields: Any) -> None:
        info = " ".join(f"{k}={v}" for k, v in fields.items())
        self.progress.update(self.task, advance=advance, info=info)


@contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Any]:
    """A progress bar on the main process; plain lines when not on a terminal; silent elsewhere."""
    if not _STATE["is_main"] or not use_rich():
        yield _PlainProgress(description, total, enabled=_STATE["is_main"])
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    with Progress(*columns, console=console(), transient=False) as bar:
        yield _RichProgress(bar, bar.add_task(description, total=total, info=""))


def own_line(frames: Iterable[traceback.FrameSummary], skip: tuple[str, ...] = ()) -> str | None:
    """``pfctl/FILE:LINE`` of the last of ``frames`` in pfctl's own code (files named in ``skip`` left out), or
    None. Decided by path under the package, not by name: a checkout named ``pfctl`` holds torch in its
    ``.venv`` too."""
    package = Path(__file__).resolve().parents[1]
    ours = [(Path(f.filename).resolve(), f.lineno) for f in frames]
    ours = [(file, line) for file, line in ours if file.is_relative_to(package) and file.name not in skip]
    return f"{ours[-1][0].relative_to(package.parent)}:{ours[-1][1]}" if ours else None
