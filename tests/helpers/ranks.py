"""Real processes on the CPU for multi-process tests: ``world`` forked ranks meeting over gloo.

Each rank runs ``target(rank, world, port, out)``; a rank that fails writes its traceback to
``out/error<rank>.txt`` (see :func:`record_errors`), so the test shows the rank's own error.
"""

from __future__ import annotations

import multiprocessing
import socket
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def record_errors(rank: int, out: Path) -> Iterator[None]:
    """Inside a rank: its traceback goes to ``out/error<rank>.txt`` before the error ends the process."""
    try:
        yield
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(target: Callable[[int, int, int, Path], None], world: int, out: Path, timeout: float) -> None:
    """Fork ``world`` ranks of ``target``, wait up to ``timeout`` s for each, and assert all ended well."""
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(out.glob("error*.txt"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * world
