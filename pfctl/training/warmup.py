"""The warm-up of compiled blocks: what it will build, when it is over, and the compiler's work kept for the
next run on the same output directory (``train.compile_cache``, :mod:`pfctl.models.fast.compile_cache`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pfctl.runtime import logging as pflog


@dataclass(frozen=True)
class CompileCacheSite:
    """Where the run's compile cache lives, and whether this process writes it (the main process does)."""

    directory: Path
    device: torch.device
    writes: bool

    def load(self) -> None:
        from pfctl.models.fast.compile_cache import load_compile_cache

        loaded, line = load_compile_cache(self.directory, self.device)
        if line is not None:
            (pflog.log if loaded else pflog.warn)(line)

    def save(self, step: int) -> None:
        if not self.writes:
            return
        from pfctl.models.fast.compile_cache import save_compile_cache

        try:
            line = save_compile_cache(self.directory, self.device, step)
        except Exception as exc:  # an optional cache never stops a run (a full disk, PyTorch's own error)
            pflog.warn(f"compile cache not saved: {type(exc).__name__}: {exc}")
            return
        if line is not None:
            pflog.log(line)


class WarmupWatch:
    """The warm-up of compiled blocks in the log: at the start, the distinct inputs this rank will build
    (:func:`pfctl.training.plan.token_count_sets`); when each has been met ``need`` times (1: compiled at its
    first forward; 2: with CUDA graphs, recorded at its second), how long that took from the first step.
    With a ``cache``: its artifacts loaded at the start, and this run's saved when the warm-up is over.

    ``recordings`` (CUDA graphs): how many recordings the graph trees have begun so far
    (:func:`pfctl.models.fast.graph_trees.recordings_begun`, None where unknown). Once the warm-up is over every
    input has been recorded, so a step that begins recordings again is one whose recordings failed the trees'
    checks: slower than the compiled blocks without graphs. The first such step is named in a warning, with the
    switch that turns the graphs off."""

    def __init__(
        self,
        expected: dict[tuple[Any, ...], tuple[int, ...]],
        need: int,
        cache: CompileCacheSite | None = None,
        recordings: Callable[[], int | None] | None = None,
    ) -> None:
        self.expected, self.need, self.cache = expected, need, cache
        self.seen: dict[tuple[Any, ...], int] = {}
        self.started: float | None = None
        self.done = not expected
        self.recordings = recordings
        self._recorded: int | None = None  # the trees' recordings when the warm-up ended (then None: warned)

    def start(self) -> None:
        """Before the first step: the inputs to come in the log, the cache's artifacts loaded."""
        counts = sorted({sum(tokens) for tokens in self.expected.values()})
        what = "compiled and recorded as CUDA graphs" if self.need > 1 else "compiled"
        pflog.log(
            f"warm-up: {len(self.expected)} distinct inputs per rank, each {what} once "
            f"(image tokens per micro-batch: {', '.join(map(str, counts))})"
        )
        if self.cache is not None:
            self.cache.load()

    def saw(self, bucket: Any, units: Any, now: float) -> None:
        """One forward on ``bucket`` with ``units`` (the keys of ``expected``), at time ``now``."""
        if self.started is None:
            self.started = now
        key = (tuple(bucket), None if units is None else tuple(units))
        self.seen[key] = self.seen.get(key, 0) + 1

    def after_step(self, step: int, now: float) -> None:
        """Once, after the step in which the last expected input was met ``need`` times: the end logged, the
        compile cache saved."""
        if self.done:
            self._check_recordings(step)
            return
        if self.started is None:
            return
        if all(self.seen.get(key, 0) >= self.need for key in self.expected):
            self.done = True
            pflog.log(f"warm-up over at step {step}: {now - self.started:.1f} s from the first step")
            if self.cache is not None:
                self.cache.save(step)
            self._recorded = self.recordings() if self.recordings is not None else None

    def _check_recordings(self, step: int) -> None:
        """After the warm-up: warn (once) at the first step that began recordings of the CUDA graphs again."""
        if self._recorded is None or self.recordings is None:
            return
        now = self.recordings()
        if now is not None and now > self._recorded:
            pflog.warn(
                f"CUDA graphs: step {step} recorded graphs again after the warm-up ({now - self._recorded} "
                "recordings; the graph trees' checks failed): such steps run slower than the compiled blocks "
                "without graphs; --set train.cuda_graphs=false turns the graphs off"
            )
            self._recorded = None
