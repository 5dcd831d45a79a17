"""Where the host's time goes: a sampling profiler of the Python threads, by phase of a run.

A thread takes every thread's Python stack every ``interval`` seconds (``sys._current_frames``; the others
never stop) and files it under the phase the run last named (:meth:`HostSampler.phase`). A sample stands for
the time since the one before it. :meth:`HostSampler.report` lists per phase and thread the functions that
took the most time, counted where they were on the stack (inclusive) and where they were running (leaf).
Threads are named as ``threading`` knows them (``MainThread``, a loader's); threads started outside Python,
such as the autograd engine's that runs the compiled backwards on CUDA, together. A Python thread that waits
shows its wait (a lock, a queue) as time: read those rows as idle.

Used by ``bench_train.py --host-profile N``; cheap enough for a whole run (a few thousand stacks a minute).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from types import FrameType

__all__ = ["HostSampler"]

Function = tuple[str, str]  # (file, function)


class HostSampler:
    """Start with ``with HostSampler() as sampler:``; name phases with :meth:`phase`; :meth:`report` after."""

    def __init__(self, interval: float = 0.02, depth: int = 120) -> None:
        self.interval, self.depth = interval, depth
        self.samples: list[tuple[str, str, float, tuple[Function, ...]]] = []  # phase, thread, seconds, stack
        self.current = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)

    def __enter__(self) -> HostSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def phase(self, name: str) -> None:
        """File the samples from now on under ``name``."""
        self.current = name

    def _run(self) -> None:
        own = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, stack in self._stacks(own).items():
                # a thread Python did not start (the autograd engine's): no name
                thread = names.get(ident, "threads started outside Python")
                self.samples.append((self.current, thread, now - last, stack))
            last = now

    def _stacks(self, own: int) -> dict[int, tuple[Function, ...]]:
        """Every other thread's stack as names, no frame object kept: a frame held past its function's return
        keeps that function's locals alive (a CUDA graph tree then finds a tensor of its pool that no output
        accounts for). The walk keeps the interpreter on this thread, so no frame returns while it is held."""
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        try:
            return {i: self._stack(f) for i, f in sys._current_frames().items() if i != own}
        finally:
            sys.setswitchinterval(switch)

    def _stack(self, frame: FrameType | None) -> tuple[Function, ...]:
        stack = []
        while frame is not None and len(stack) < self.depth:
            stack.append((frame.f_code.co_filename, frame.f_code.co_name))
            frame = frame.f_back
        return tuple(stack)

    def totals(self) -> dict[tuple[str, str], tuple[float, collections.Counter, collections.Counter]]:
        """Per (phase, thread): sampled seconds, inclusive seconds per function, leaf seconds per function."""
        out: dict[tuple[str, str], tuple[float, collections.Counter, collections.Counter]] = {}
        for phase, thread, seconds, stack in self.samples:
            total, inclusive, leaf = out.get((phase, thread), (0.0, collections.Counter(), collections.Counter()))
            for function in set(stack):
                inclusive[function] += seconds
            if stack:
                leaf[stack[0]] += seconds
            out[(phase, thread)] = (total + seconds, inclusive, leaf)
        return out

    def report(self, top: int = 12) -> str:
        """The ``top`` functions per phase (in run order) and thread (the main one first), inclusive and
        leaf, in seconds."""
        totals = self.totals()
        phases = list(dict.fromkeys(phase for phase, *_ in self.samples))
        lines = []
        for (phase, thread), (total, inclusive, leaf) in sorted(
            totals.items(), key=lambda item: (phases.index(item[0][0]), item[0][1] != "MainThread", item[0][1])
        ):
            lines.append(f"host samples: {phase}, {thread}: {total:.2f} s")
            for title, counter in (("inclusive", inclusive), ("leaf", leaf)):
                for (path, name), seconds in counter.most_common(top):
                    lines.append(f"  {title:9s} {seconds:8.2f} s  {_short(path)}:{name}")
        return "\n".join(lines)


def _short(path: str) -> str:
    """A file's path from its package on (the file's name for the standard library)."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    for package in ("pfctl/", "benchmarks/"):
        if f"/{package}" in path:
            return package + path.split(f"/{package}", 1)[1]
    return path.rsplit("/", 1)[-1]
