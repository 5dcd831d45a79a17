"""The background side of encode-latents: a writer thread behind a bounded queue, and the stage clock.

:class:`AsyncWriter` runs one handler per job on its own thread, in the order the jobs were put, so
the thread that feeds the VAE never waits on the disk (only on a full queue: then the disk is the
bottleneck). Files stay whole whatever happens: each clip file is written atomically (a temp file
renamed into place, :func:`pfctl.utils.io.atomic_save_safetensors`), so a ``kill -9`` leaves at most a
``.*.tmp`` file that the rerun deletes, and clips the queue still held are simply encoded again.

:class:`StageClock` times the stages of a batch: on CUDA with events recorded on the stream (the
host only queues work, so its own clock would time the queueing), read once the batch is finished.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

_STOP = object()


class AsyncWriter:
    """Runs ``handle(job)`` for each :meth:`put` job on one background thread; at most ``depth`` jobs wait.

    The first error of a handler stops the handling (later jobs are dropped, their clips were never
    written, so a rerun encodes them) and is raised in the caller: at its next :meth:`put`, or at
    :meth:`close`. :meth:`close` waits until every job put before it is handled (the queue drains)
    and joins the thread; call it whatever happens, before the run's manifest part is written.
    """

    def __init__(self, handle: Callable[[Any], None], depth: int, name: str = "pfctl-write") -> None:
        self._handle = handle
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._raised = False
        self.busy_seconds = 0.0  # time the thread spent in handlers
        self.wait_seconds = 0.0  # time put() waited for room in the queue
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if self._error is not None:
                continue  # drop: nothing more is written after an error
            start = time.perf_counter()
            try:
                self._handle(job)
            except BaseException as exc:  # raised in the caller (put / close)
                self._error = exc
            self.busy_seconds += time.perf_counter() - start

    def _check(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def put(self, job: Any) -> None:
        """Queue ``job`` (waits while the queue is full); raises a handler's earlier error instead."""
        self._check()
        start = time.perf_counter()
        self._queue.put(job)
        self.wait_seconds += time.perf_counter() - start

    def close(self) -> None:
        """Handle every queued job, stop the thread and raise a handler's error not raised yet."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._check()


class StageClock:
    """Marks between the stages of one batch's work; seconds per stage summed into :attr:`seconds`.

    :meth:`start` opens a batch's list of marks, :meth:`mark` closes a stage (named) at this point of
    the work; :meth:`add` sums a finished batch's stages (on CUDA: call it after the batch's work is
    done, e.g. after synchronising on its event).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> list[tuple[str, Any]]:
        return [("", self._now())]

    def mark(self, marks: list[tuple[str, Any]], stage: str) -> None:
        marks.append((stage, self._now()))

    def add(self, marks: list[tuple[str, Any]]) -> None:
        for (_, before), (stage, after) in itertools.pairwise(marks):
            self.seconds[stage] += before.elapsed_time(after) / 1000 if self.cuda else after - before


__all__ = ["AsyncWriter", "StageClock"]
