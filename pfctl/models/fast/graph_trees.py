"""Faster recording for compiled blocks run as CUDA graphs (``torch.compile`` mode ``reduce-overhead``).

Inductor's CUDA-graph trees record each compiled block's forward and backward as one node of a path that
starts at every ``cudagraph_mark_step_begin``. A training step's path holds every graph of its forward and
backward, and each node's outputs (for a forward: every activation its backward keeps). On recording a
node, and on building it, the trees ask for every input and every output whether it is a live output of an
earlier node of the path (``CUDAGraphNode._is_alias_of_live_recorded_tensor``), and for every input, the
weights included, whether any node of the path ever output its storage (``_is_cuda_graph_recorded_tensor``),
each time by scanning all of them. That is quadratic in the path's length, and on the 384p recipe it took
most of the host time of the steps that record (measured in ``benchmarks/RESULTS.md``).

:func:`index_recorded_outputs` makes both questions dictionary lookups. Within one call of the two methods
that ask them (a node's ``__init__`` and ``_add_first_outputs``) the path's outputs are indexed once by
storage pointer; the answers (the first live output of the path on the same storage; whether there is any)
are the scans'. A nested call may add outputs to the path (``__init__`` records, and recording adds the
node's first outputs): the outer call's index is built again at its next question. Elsewhere, and on a
PyTorch whose trees lack what this relies on, the scans run as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["index_outputs", "index_recorded_outputs", "live_output_on_storage", "recordings_begun"]

_INDEX = "_pfctl_outputs_by_storage"  # the index of a node, while one of the wrapped methods runs
_ABSENT = object()
# the methods it replaces or wraps
_NEEDS = ("_is_alias_of_live_recorded_tensor", "_is_cuda_graph_recorded_tensor", "_add_first_outputs")


def live_output_on_storage(
    path_weakrefs: list[list[Any]], index: dict[int, list[tuple[int, int]]], storage_ptr: int, deref: Callable
) -> tuple[int, int] | None:
    """The first ``(depth, output)`` of ``path_weakrefs`` that is live (``deref(ref)`` not None) and on the
    storage at ``storage_ptr``, found through ``index`` (:func:`index_outputs` of the same path)."""
    for depth, output in index.get(storage_ptr, ()):
        if deref(path_weakrefs[depth][output]) is not None:
            return depth, output
    return None


def index_outputs(path_weakrefs: list[list[Any]]) -> dict[int, list[tuple[int, int]]]:
    """Storage pointer -> the positions ``(depth, output)`` of the path's weak references to it, in the
    order the trees scan them."""
    index: dict[int, list[tuple[int, int]]] = {}
    for depth, refs in enumerate(path_weakrefs):
        for output, ref in enumerate(refs):
            if ref is not None:
                index.setdefault(ref.data_ptr(), []).append((depth, output))
    return index


def index_recorded_outputs() -> bool:
    """Answer the trees' alias question from an index (module docstring); once per process. Returns
    whether the trees have what this relies on (if not, nothing is changed)."""
    from torch._inductor import cudagraph_trees as trees

    node = getattr(trees, "CUDAGraphNode", None)
    if node is None or not hasattr(trees, "maybe_deref") or not all(hasattr(node, m) for m in _NEEDS):
        return False
    if getattr(node, "_pfctl_indexed", False):
        return True
    scan_live, scan_any = node._is_alias_of_live_recorded_tensor, node._is_cuda_graph_recorded_tensor

    def alias_of_live_output(self: Any, t: Any) -> tuple[int, int] | None:
        index = _index(self)
        if index is None:  # not inside a wrapped method: the trees' own scan
            return scan_live(self, t)
        return live_output_on_storage(
            self.path_weakrefs, index, t.untyped_storage().data_ptr(), trees.maybe_deref
        )

    def recorded_output(self: Any, t: Any) -> bool:
        index = _index(self)
        return scan_any(self, t) if index is None else t.untyped_storage().data_ptr() in index

    node._is_alias_of_live_recorded_tensor = alias_of_live_output
    node._is_cuda_graph_recorded_tensor = recorded_output
    node.__init__ = _indexed_while(node.__init__)
    node._add_first_outputs = _indexed_while(node._add_first_outputs)
    node._pfctl_indexed = True
    return True


def _index(node: Any) -> dict[int, list[tuple[int, int]]] | None:
    """The index of ``node``'s path while a wrapped method runs (built on the first question), else None."""
    index = node.__dict__.get(_INDEX, _ABSENT)
    if index is _ABSENT:
        return None
    if index is None:
        index = node.__dict__[_INDEX] = index_outputs(node.path_weakrefs)
    return index


def _indexed_while(method: Callable) -> Callable:
    """``method`` with a fresh index of the node's path for its duration (built on the first question); an
    enclosing call's index is built again afterwards, as the path may have grown."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        nested = _INDEX in self.__dict__
        self.__dict__[_INDEX] = None
        try:
            return method(self, *args, **kwargs)
        finally:
            if nested:
                self.__dict__[_INDEX] = None
            else:
                self.__dict__.pop(_INDEX, None)

    return wrapper


def recordings_begun(device_index: int) -> int | None:
    """How many recordings the graph trees of ``device_index`` have begun in this process: each is a new path's
    first, or one made again because a recording failed the trees' checks. 0 before the trees exist; None on a
    PyTorch whose trees keep no such count."""
    from torch._inductor import cudagraph_trees as trees

    get_manager = getattr(trees, "get_manager", None)
    if get_manager is None:
        return None
    manager = get_manager(device_index, create_if_none_exists=False)
    return 0 if manager is None else getattr(manager, "debug_fail_counter", None)
