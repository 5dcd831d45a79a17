"""The warm-up of compiled blocks: what it will build, when it is over, and the compiler's work kept for the
next run on the same output directory and for the user's later runs (``train.compile_cache``,
``train.compile_cache_shared``, :mod:`pfctl.models.fast.compile_cache`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pfctl.runtime import logging as pflog

if TYPE_CHECKING:
    from pfctl.config.train import TrainConfig
    from pfctl.training.step_graphs import StepGraphs


@dataclass(frozen=True)
class CompileCacheSite:
    """Where the run's compile cache lives, whether this process writes it (the main process does), and the
    root of the cache the user's runs share (``train.compile_cache_shared``; None: none)."""

    directory: Path
    device: torch.device
    writes: bool
    shared: Path | None = None

    def load(self) -> None:
        """The run's own artifacts (a resumed run); where none of its own load, those earlier runs shared. Where
        there are none at all, the log says that the first steps compile (the first run of a setup)."""
        from pfctl.models.fast.compile_cache import load_compile_cache, load_shared_compile_cache

        loaded, line = load_compile_cache(self.directory, self.device)
        outcomes = [(loaded, line)] if line is not None else []
        if not loaded and self.shared is not None:
            outcomes += load_shared_compile_cache(self.shared, self.device)
        for ok, text in outcomes:
            (pflog.log if ok else pflog.warn)(text)
        if not outcomes:
            where = f"beside the run or in {self.shared}" if self.shared is not None else "beside the run"
            pflog.log(
                f"compile cache: nothing saved for this setup yet ({where}): the first steps compile the "
                "blocks, and the end of the warm-up saves them for later runs"
            )

    def save(self, step: int) -> None:
        """This process's artifacts beside the run, then into the shared cache (each failure a warning)."""
        if not self.writes:
            return
        from pfctl.models.fast.compile_cache import save_compile_cache

        for directory, shared in ((self.directory, False), (self.shared, True)):
            if directory is None:
                continue
            try:
                line = save_compile_cache(directory, self.device, step, shared=shared)
            except Exception as exc:  # an optional cache never stops a run (a full disk, PyTorch's own error)
                pflog.warn(f"compile cache not saved: {type(exc).__name__}: {exc}")
                continue
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
    switch that turns the graphs off.

    ``what``: how each input is met, for the log (default: compiled, or with ``need`` 2 compiled and recorded);
    ``summary``: a clause added to the line that ends the warm-up (the step's CUDA graphs recorded)."""

    def __init__(
        self,
        expected: dict[tuple[Any, ...], tuple[int, ...]],
        need: int,
        cache: CompileCacheSite | None = None,
        recordings: Callable[[], int | None] | None = None,
        what: str | None = None,
        summary: Callable[[], str] | None = None,
    ) -> None:
        self.expected, self.need, self.cache = expected, need, cache
        self.what, self.summary = what, summary
        self.seen: dict[tuple[Any, ...], int] = {}
        self.started: float | None = None
        self.done = not expected
        self.recordings = recordings
        self._recorded: int | None = None  # the trees' recordings when the warm-up ended (then None: warned)

    def start(self) -> None:
        """Before the first step: the inputs to come in the log, the cache's artifacts loaded."""
        counts = sorted({sum(tokens) for tokens in self.expected.values()})
        what = self.what or ("compiled and recorded as CUDA graphs" if self.need > 1 else "compiled")
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
            extra = f"; {self.summary()}" if self.summary is not None else ""
            pflog.log(f"warm-up over at step {step}: {now - self.started:.1f} s from the first step{extra}")
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


def watch_warmup(
    cfg: TrainConfig,
    expected: Callable[[], dict[tuple[Any, ...], tuple[int, ...]]],
    out: Path,
    device: torch.device,
    is_main: bool,
    step_graphs: StepGraphs | None,
) -> WarmupWatch | None:
    """The run's :class:`WarmupWatch`, started, where there is a warm-up to watch (``cfg`` settled): compiled
    blocks (the compile cache of ``out`` loaded, written by the main process), their CUDA graphs, or the
    step's (``step_graphs``). ``expected``: the distinct inputs of this rank
    (:func:`pfctl.training.plan.token_count_sets`), asked for only then."""
    compiled, graphed = cfg.compile is True, cfg.compile is True and cfg.cuda_graphs is True
    if not compiled and step_graphs is None:
        return None
    cache = None
    if compiled and cfg.compile_cache:
        shared = Path(cfg.compile_cache_shared).expanduser() if cfg.compile_cache_shared is not None else None
        cache = CompileCacheSite(out, device, writes=is_main, shared=shared)
    recordings, what, summary = None, None, None
    if graphed:
        from pfctl.models.fast.graph_trees import recordings_begun

        recordings = functools.partial(recordings_begun, device.index or 0)
    if step_graphs is not None:
        what = ("compiled, then " if compiled else "") + "recorded in the step's CUDA graphs"
        summary = step_graphs.summary
    watch = WarmupWatch(
        expected(), need=2 if graphed else 1, cache=cache, recordings=recordings, what=what, summary=summary
    )
    watch.start()
    return watch
