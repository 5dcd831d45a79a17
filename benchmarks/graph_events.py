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

from pfctl.models.fast.graph_trees import index_outputs, live_output_on_storage

__all__ = ["GraphEvents", "describe", "why_check_failed"]

# the trees' manager methods a call ends in, and what each means
_OUTCOMES = {"execute_node": "replayed", "record_function": "recorded", "run_eager": "warm-up runs"}


class GraphEvents:
    """Counts the trees' calls by outcome while entered (``with``); :meth:`take` returns and resets the counts.

    Keys: ``calls``, ``replayed``, ``recorded``, ``warm-up runs``, ``new sizes`` (calls of sizes not met before:
    the trees keep one function per set of sizes), ``failed check: <status>`` (a recording of the call's
    function whose invariants did not hold; PyTorch's status names), ``why: <status>: <finding>`` (what such a
    check found, :func:`why_check_failed`, after the graph it was a check of: ``forward graph: ``,
    ``backward graph: ``, where the trees say). On a PyTorch whose trees lack a method
    counted here, that count stays absent. ``manager`` and ``node``: the classes counted (default: the trees'
    ``CUDAGraphTreeManager`` and ``CUDAGraphNode``)."""

    def __init__(self, manager: type | None = None, node: type | None = None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._classes = manager, node
        self._functions: set[Any] = set()
        self._depth = 0  # calls of _run in progress
        self._mode: str | None = None  # the call's graph: forward or backward (the trees' mode of its function)
        self._restore: list[tuple[type, str, Any]] = []

    def __enter__(self) -> GraphEvents:
        manager, node = self._classes
        if manager is None and node is None:
            from torch._inductor import cudagraph_trees as trees

            manager = getattr(trees, "CUDAGraphTreeManager", None)
            node = getattr(trees, "CUDAGraphNode", None)
        if manager is not None:
            self._wrap(manager, "_run", self._calls)
            for name, outcome in _OUTCOMES.items():
                self._wrap(manager, name, functools.partial(self._outcomes, outcome))
        if node is not None:
            self._wrap(node, "check_invariants", self._checks)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, method in reversed(self._restore):
            setattr(owner, name, method)
        self._restore.clear()

    def take(self) -> collections.Counter[str]:
        counts, self.counts = self.counts, collections.Counter()
        return counts

    def _wrap(self, owner: type, name: str, counting: Callable[[Callable], Callable]) -> None:
        method = getattr(owner, name, None)
        if method is not None:
            setattr(owner, name, functools.wraps(method)(counting(method)))
            self._restore.append((owner, name, method))

    def _calls(self, method: Callable) -> Callable:
        """``_run(manager, new_inputs, function_id)``: one call, counted once (the trees call it again from
        inside itself when a call starts a new path)."""

        def run(manager: Any, new_inputs: Any, function_id: Any, *args: Any, **kwargs: Any) -> Any:
            mode = getattr(manager, "id_to_mode", {}).get(function_id)
            self._mode = None if mode is None else getattr(mode, "name", str(mode)).lower()
            if self._depth == 0:
                self.counts["calls"] += 1
                if function_id not in self._functions:
                    self._functions.add(function_id)
                    self.counts["new sizes"] += 1
            self._depth += 1
            try:
                return method(manager, new_inputs, function_id, *args, **kwargs)
            finally:
                self._depth -= 1

        return run

    def _outcomes(self, outcome: str, method: Callable) -> Callable:
        def ends(*args: Any, **kwargs: Any) -> Any:
            self.counts[outcome] += 1
            return method(*args, **kwargs)

        return ends

    def _checks(self, method: Callable) -> Callable:
        def check(node: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(node, inputs, *args, **kwargs)
            status = result[0] if isinstance(result, tuple) else result
            name = getattr(status, "name", str(status))
            if name != "SUCCESS":
                self.counts[f"failed check: {name}"] += 1
                graph = "" if self._mode is None else f"{self._mode} graph: "
                for what in why_check_failed(node, inputs, name):
                    self.counts[f"{_WHY}{name}: {graph}{what}"] += 1
            return result

        return check


_WHY = "why: "  # the counts' keys of what a failed check found
# the trees' record of a recording's input positions each check compares with its data pointers
_COMPARED = {
    "CudagraphManagedIdxMismatch": "cudagraph_managed_idxs",
    "StaticInputIdxMismatch": "tensor_static_input_idxs",
}


def why_check_failed(node: Any, inputs: Any, status: str) -> list[str]:
    """What a failed invariant check of ``node`` (a recording) found on ``inputs`` (the call's), as PyTorch's
    trees keep it: for a data-pointer check, each compared input that is not where the recording had it, named
    by the recording's placeholder and its sizes (a graph's own outputs are managed inputs of the next graph;
    parameters are static inputs); for the liveness check, each output of the path the recording saw freed
    that is alive now, as ``output i of graph d`` of the path. A moved input also says where it was recorded and
    where it is now, where either is an output of the path: on an output of the path (another output of the graph
    it came from: several outputs alike in sizes that the next graph takes by position) or not on any (an eager
    tensor). Empty where the trees keep none of it."""
    if status == "ExpectedDeadIndicesBeforeGraphMismatch":
        refs = getattr(node, "path_weakrefs", None)
        expected_dead = getattr(node, "expected_dead_indices_before_graph", None) or ()
        if refs is None:
            return []
        return [f"output {i} of graph {d} alive" for d, i in expected_dead if _alive(refs[d][i])]
    recorded = getattr(node, "static_input_data_ptrs", None)
    compared = getattr(node, _COMPARED.get(status, ""), None)
    if recorded is None or compared is None:
        return []
    placeholders = getattr(getattr(node, "wrapped_function", None), "placeholders", None) or ()
    refs = getattr(node, "path_weakrefs", None)
    index = index_outputs(refs) if refs else {}  # the path's outputs by storage pointer
    moved = []
    for i in compared:
        tensor = inputs[i] if i < len(inputs) else None
        if hasattr(tensor, "data_ptr") and i < len(recorded) and tensor.data_ptr() != recorded[i]:
            name = placeholders[i].name if i < len(placeholders) else f"input {i}"
            was = next(iter(index.get(recorded[i], ())), None)
            now = live_output_on_storage(refs, index, tensor.untyped_storage().data_ptr(), _deref)
            where = f" (recorded {_output(was)}, now {_output(now)})" if was or now else ""
            moved.append(f"{name} {list(tensor.shape)} moved{where}")
    return moved


def _output(position: tuple[int, int] | None) -> str:
    """``output i of graph d`` of the path, for its ``(d, i)``."""
    return "off the path outputs" if position is None else f"output {position[1]} of graph {position[0]}"


def _deref(ref: Any) -> Any:
    """The storage a path's weak reference (the trees' ``StorageWeakRefWrapper``) refers to, or None."""
    return ref()


def _alive(ref: Any) -> bool:
    """A path's weak reference to an output (the trees' ``StorageWeakRefWrapper``, or None) still refers to it."""
    return ref is not None and _deref(ref) is not None


def describe(counts: collections.Counter[str]) -> str:
    """One line: the calls by outcome (those without a graph for good are the calls left over), then the
    failed checks; empty when no call went through the trees."""
    calls = counts.get("calls", 0)
    if not calls:
        return ""
    outcomes = [f"{counts.get(k, 0)} {k}" for k in _OUTCOMES.values()]
    no_graph = calls - sum(counts.get(k, 0) for k in _OUTCOMES.values())
    parts = [f"{calls} calls: " + ", ".join(outcomes) + f", {no_graph} without a graph"]
    if counts.get("new sizes"):
        parts.append(f"{counts['new sizes']} of new sizes")
    failed = sorted(
        (k.removeprefix("failed check: "), v) for k, v in counts.items() if k.startswith("failed check: ")
    )
    if failed:
        parts.append("failed checks: " + ", ".join(f"{name} {v}" for name, v in failed))
    why = sorted(((-v, k.removeprefix(_WHY)) for k, v in counts.items() if k.startswith(_WHY)))
    if why:
        shown = [f"{what} x{-v}" for v, what in why[:_WHY_SHOWN]]
        more = f" (+{len(why) - _WHY_SHOWN} more)" if len(why) > _WHY_SHOWN else ""
        parts.append("found: " + ", ".join(shown) + more)
    return "; ".join(parts)


_WHY_SHOWN = 6  # the most frequent findings a line names
