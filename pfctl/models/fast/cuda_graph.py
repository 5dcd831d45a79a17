"""Replay the DiT forward of one sampler stage as a CUDA graph.

Inside a stage the sampler calls the DiT 10-20 times with inputs of one shape. At the low-resolution
stages each call is a few hundred tokens, so the GPU finishes every kernel before Python has launched the
next one: a miniFLUX forward is ~5,000 kernel launches, and launching them costs more than running them.
A CUDA graph records the launches once and replays them with one call.

:class:`StageGraph` wraps the DiT for one stage. Its first call runs eagerly on a side stream (the warm-up
CUDA graphs need, and a real result); the second call captures the forward into a graph over static input
buffers; from then on every call copies its inputs into those buffers and replays. The kernels and their
order are the same as eager execution, so the result is the same. A signature change (shapes, dtypes)
starts over (or, with ``keep``, finds the graph it captured before). Once one graph has been captured, the
libraries' lazy set-up is done, so the first call of a new signature captures at once and replays (no eager
call: a video's ~50 stage shapes each paid one); a capture that fails falls back to eager calls from then on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["StageGraph", "flatten_tensors", "record_graph", "signature", "unflatten_tensors"]


def flatten_tensors(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensors of a nest of dicts, lists, tuples and dataclass instances in a fixed order, plus the structure
    to rebuild it."""
    leaves: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return ("tensor", len(leaves) - 1)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            fields = [(f.name, walk(getattr(node, f.name))) for f in dataclasses.fields(node) if f.init]
            return ("dataclass", (type(node), fields))
        if isinstance(node, dict):
            return ("dict", [(key, walk(value)) for key, value in node.items()])
        if isinstance(node, (list, tuple)):
            return ("list" if isinstance(node, list) else "tuple", [walk(v) for v in node])
        return ("const", node)

    return leaves, walk(obj)


def unflatten_tensors(spec: Any, leaves: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_tensors` with other tensors in the leaves' places."""
    kind, payload = spec
    if kind == "tensor":
        return leaves[payload]
    if kind == "dataclass":
        cls, fields = payload
        return cls(**{name: unflatten_tensors(value, leaves) for name, value in fields})
    if kind == "dict":
        return {key: unflatten_tensors(value, leaves) for key, value in payload}
    if kind in ("list", "tuple"):
        items = [unflatten_tensors(v, leaves) for v in payload]
        return items if kind == "list" else tuple(items)
    return payload


def record_graph(
    graph: torch.cuda.CUDAGraph,
    stream: torch.cuda.Stream,
    pool: Any,
    work: Callable[[], Any],
    capture_error_mode: str = "global",
) -> Any:
    """Capture ``work()`` into ``graph`` on ``stream`` (made to wait for the work queued before it), in the
    memory ``pool`` (None: a pool of its own); returns what ``work`` returned, the tensors the graph writes.
    Unlike ``torch.cuda.graph``, without synchronizing the device and emptying the allocator's cache first:
    the cached memory stays for the eager work around the graphs (a video captures ~50 shapes, a training
    run one per distinct input). ``capture_error_mode="thread_local"`` lets other threads use the GPU
    meanwhile."""
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode=capture_error_mode)
        try:
            return work()
        finally:
            graph.capture_end()


def signature(leaves: list[torch.Tensor], spec: Any) -> tuple:
    """What a captured graph depends on: structure, and each tensor's shape, dtype and device."""
    return repr(spec), tuple((tuple(t.shape), t.dtype, t.device) for t in leaves)


@dataclass
class _Captured:
    """One signature's graph: the static input buffers it reads and the outputs it writes."""

    device: torch.device
    graph: torch.cuda.CUDAGraph | None = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: tuple[list[torch.Tensor], Any] | None = None


class StageGraph:
    """Calls ``fn(**kwargs)`` as a replayed CUDA graph while the input signature holds: eagerly once first,
    until one signature has been captured; a later new signature is captured at its first call.

    Only for CUDA inputs and a ``fn`` whose work depends on nothing but its tensor inputs (no host
    synchronisation, no randomness, parameters left in place): the sampler's DiT in inference mode.
    Outputs are returned as fresh tensors, never the graph's static buffers.

    ``keep=False`` (one stage): a new signature drops the graph of the last one. ``keep=True`` (a run of
    several videos): the graph of every signature stays, all in one memory pool (a graph's intermediates
    are free again once its outputs are copied out, and graphs never run at the same time), so a signature
    seen before replays from its first call: the next video of the same size pays no warm-up and no capture.
    """

    def __init__(self, fn: Callable[..., Any], *, keep: bool = False) -> None:
        self.fn = fn
        self.keep = keep
        self.replays = 0
        self.captures = 0
        self._graphs: dict[tuple, _Captured] = {}
        self._pool: Any = None  # the memory pool the kept graphs share
        self._stream: torch.cuda.Stream | None = None
        self._disabled = False

    def __call__(self, **kwargs: Any) -> Any:
        leaves, spec = flatten_tensors(kwargs)
        if self._disabled:
            return self.fn(**kwargs)
        key = signature(leaves, spec)
        entry = self._graphs.get(key)
        if entry is None:  # first call of this signature
            if not self.keep:
                self.release()
            device = next((t.device for t in leaves if t.is_cuda), None)
            if device is None:  # nothing on a GPU: nothing to capture
                self._disabled = True
                return self.fn(**kwargs)
            self._graphs[key] = entry = _Captured(device)
            if not self._warmed(device):  # eager warm-up on the side stream
                with torch.cuda.device(device):
                    return self._on_side_stream(device, lambda: self.fn(**kwargs))
            # the libraries were warmed up by an earlier signature on this stream: capture at once
            with torch.cuda.device(device):
                if not self._capture(entry, leaves, spec, fallback=True):
                    return self._on_side_stream(device, lambda: self.fn(**kwargs))
        elif entry.graph is None:
            with torch.cuda.device(entry.device):
                captured = self._capture(entry, leaves, spec)
            if not captured:
                return self.fn(**kwargs)
        for static, value in zip(entry.inputs, leaves, strict=True):
            static.copy_(value)
        entry.graph.replay()
        self.replays += 1
        out_leaves, out_spec = entry.outputs
        return unflatten_tensors(out_spec, [t.clone() for t in out_leaves])

    def release(self) -> None:
        """Drop every graph and its buffers (their memory goes back to the caching allocator)."""
        self._graphs, self._pool = {}, None

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This object's side stream on ``device``, made to wait for the work queued before now."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def _on_side_stream(self, device: torch.device, work: Callable[[], Any]) -> Any:
        with torch.cuda.stream(self._side_stream(device)):
            result = work()
        torch.cuda.current_stream().wait_stream(self._stream)
        return result

    def _warmed(self, device: torch.device) -> bool:
        """Whether a graph was captured on this object's side stream on ``device``: the lazy set-up a first
        call does (library handles, workspaces) is then done, and a new signature needs no eager warm-up."""
        return self.captures > 0 and self._stream is not None and self._stream.device == device

    def _capture(
        self, entry: _Captured, leaves: list[torch.Tensor], spec: Any, *, fallback: bool = False
    ) -> bool:
        """Capture ``entry``'s graph. A capture that fails disables the graphs, or, with ``fallback`` (a
        signature captured without its own warm-up), leaves this signature to an eager warm-up first."""
        entry.inputs = [t.detach().clone() for t in leaves]
        if self.keep and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            out = record_graph(
                graph, self._side_stream(entry.device), self._pool,
                lambda: self.fn(**unflatten_tensors(spec, entry.inputs)),
            )  # fmt: skip
        except RuntimeError as err:  # an op that cannot be captured: run eagerly from now on
            if fallback:
                logger.info("CUDA graph capture without a warm-up failed (%s); warming up first", err)
                entry.inputs = []
                return False
            logger.warning("CUDA graph capture failed (%s); running the DiT eagerly", err)
            self.release()
            self._disabled = True
            return False
        entry.graph = graph
        entry.outputs = flatten_tensors(out)
        self.captures += 1
        return True
