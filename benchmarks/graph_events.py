"""What Inductor's CUDA-graph trees did in each training step (``bench_train.py``: its progress lines and report).

With ``train.cuda_graphs`` every compiled block's forward and backward runs through the trees
(``mode="reduce-overhead"``). A call is replayed from a recording, recorded, run without a graph while its sizes
are new (the trees' warm-up run), or run without a graph for good (the trees gave up on it). Once the warm-up is
over every call of a timed step should be a replay; a timed step that records or runs calls without a graph is
slow for a reason these counts name, down to the check that sent a call off its recording.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

__all__ = ["GraphEvents", "describe"]

# the trees' manager methods a call ends in, and what each means
_OUTCOMES = {"execute_node": "replayed", "record_function": "recorded", "run_eager": "warm-up runs"}


class GraphEvents:
    """Counts the trees' calls by outcome while entered (``with``); :meth:`take` returns and resets the counts.

    Keys: ``calls``, ``replayed``, ``recorded``, ``warm-up runs``, ``new sizes`` (calls of sizes not met before:
    the trees keep one function per set of sizes), ``failed check: <status>`` (a recording of the call's
    function whose invariants did not hold; PyTorch's status names). On a PyTorch whose trees lack a method
    counted here, that count stays absent. ``manager`` and ``node``: the classes counted (default: the trees'
    ``CUDAGraphTreeManager`` and ``CUDAGraphNode``)."""

    def __init__(self, manager: type | None = None, node: type | None = None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._classes = manager, node
        self._functions: set[Any] = set()
        self._restore: list[tuple[type, str, Any]] = []

    def __enter__(self) -> GraphEvents:
        manager, node = self._classes
        if manager is None and node is None:
            from torch._inductor import cudagraph_trees as trees

            manager = getattr(trees, "CUDAGraphTreeManager", None)
            node = getattr(trees, "CUDAGraphNode", None)
        if manager is not None:
            self._wrap(manager, "_run", self._on_call)
            for name, outcome in _OUTCOMES.items():
                self._wrap(manager, name, functools.partial(self._on_outcome, outcome))
        if node is not None:
            self._wrap(node, "check_invariants", None, self._on_check)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, method in reversed(self._restore):
            setattr(owner, name, method)
        self._restore.clear()

    def take(self) -> collections.Counter[str]:
        counts, self.counts = self.counts, collections.Counter()
        return counts

    def _wrap(
        self,
        owner: type,
        name: str,
        before: Callable[[tuple], None] | None,
        after: Callable[[Any], None] | None = None,
    ) -> None:
        method = getattr(owner, name, None)
        if method is None:
            return

        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(args + tuple(kwargs.values()))
            result = method(*args, **kwargs)
            if after is not None:
                after(result)
            return result

        setattr(owner, name, counted)
        self._restore.append((owner, name, method))

    def _on_call(self, args: tuple) -> None:
        self.counts["calls"] += 1
        function_id = args[2] if len(args) > 2 else None  # (manager, new_inputs, function_id)
        if function_id is not None and function_id not in self._functions:
            self._functions.add(function_id)
            self.counts["new sizes"] += 1

    def _on_outcome(self, outcome: str, args: tuple) -> None:
        self.counts[outcome] += 1

    def _on_check(self, result: Any) -> None:
        status = result[0] if isinstance(result, tuple) else result
        name = getattr(status, "name", str(status))
        if name != "SUCCESS":
            self.counts[f"failed check: {name}"] += 1


def describe(counts: collections.Counter[str]) -> str:
    """One line: the calls by outcome (those without a graph for good are the calls left over), then the
    failed checks; empty when no call went through the trees."""
    calls = counts.get("calls", 0)
    if not calls:
        return ""
    outcomes = [f"{counts.get(k, 0)} {k}" for k in ("replayed", "recorded", "warm-up runs")]
    no_graph = calls - sum(counts.get(k, 0) for k in _OUTCOMES.values())
    parts = [f"{calls} calls: " + ", ".join(outcomes) + f", {no_graph} without a graph"]
    if counts.get("new sizes"):
        parts.append(f"{counts['new sizes']} of new sizes")
    failed = sorted(
        (k.removeprefix("failed check: "), v) for k, v in counts.items() if k.startswith("failed check: ")
    )
    if failed:
        parts.append("failed checks: " + ", ".join(f"{name} {v}" for name, v in failed))
    return "; ".join(parts)
