"""Replay the DiT forward of one sampler stage as a CUDA graph.

Inside a stage the sampler calls the DiT 10-20 times with inputs of one shape. At the low-resolution
stages each call is a few hundred tokens, so the GPU finishes every kernel before Python has launched the
next one: a miniFLUX forward is ~5,000 kernel launches, and launching them costs more than running them.
A CUDA graph records the launches once and replays them with one call.

:class:`StageGraph` wraps the DiT for one stage. Its first call runs eagerly on a side stream (the warm-up
CUDA graphs need, and a real result); the second call captures the forward into a graph over static input
buffers; from then on every call copies its inputs into those buffers and replays. The kernels and their
order are the same as eager execution, so the result is the same. A signature change (shapes, dtypes)
starts over; a capture that fails falls back to eager calls for the rest of the stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["StageGraph", "flatten_tensors", "signature", "unflatten_tensors"]


def flatten_tensors(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensors of a nest of dicts, lists and tuples in a fixed order, plus the structure to rebuild it."""
    leaves: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return ("tensor", len(leaves) - 1)
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
    if kind == "dict":
        return {key: unflatten_tensors(value, leaves) for key, value in payload}
    if kind in ("list", "tuple"):
        items = [unflatten_tensors(v, leaves) for v in payload]
        return items if kind == "list" else tuple(items)
    return payload


def signature(leaves: list[torch.Tensor], spec: Any) -> tuple:
    """What a captured graph depends on: structure, and each tensor's shape, dtype and device."""
    return repr(spec), tuple((tuple(t.shape), t.dtype, t.device) for t in leaves)


class StageGraph:
    """Calls ``fn(**kwargs)`` eagerly once, then as a replayed CUDA graph while the input signature holds.

    Only for CUDA inputs and a ``fn`` whose work depends on nothing but its tensor inputs (no host
    synchronisation, no randomness, parameters left in place): the sampler's DiT in inference mode.
    Outputs are returned as fresh tensors, never the graph's static buffers.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.replays = 0
        self._key: tuple | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: list[torch.Tensor] = []
        self._outputs: tuple[list[torch.Tensor], Any] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._device: torch.device | None = None  # the inputs' GPU: streams and graphs live there
        self._disabled = False

    def __call__(self, **kwargs: Any) -> Any:
        leaves, spec = flatten_tensors(kwargs)
        if self._disabled:
            return self.fn(**kwargs)
        key = signature(leaves, spec)
        if key != self._key:  # first call of this signature: eager warm-up on a side stream
            self.release()
            self._key = key
            self._device = next((t.device for t in leaves if t.is_cuda), None)
            if self._device is None:  # nothing on a GPU: nothing to capture
                self._disabled = True
                return self.fn(**kwargs)
            with torch.cuda.device(self._device):
                return self._on_side_stream(lambda: self.fn(**kwargs))
        if self._graph is None:
            with torch.cuda.device(self._device):
                captured = self._capture(leaves, spec)
            if not captured:
                return self.fn(**kwargs)
        for static, value in zip(self._inputs, leaves, strict=True):
            static.copy_(value)
        self._graph.replay()
        self.replays += 1
        out_leaves, out_spec = self._outputs
        return unflatten_tensors(out_spec, [t.clone() for t in out_leaves])

    def release(self) -> None:
        """Drop the graph and its buffers (their memory goes back to the caching allocator)."""
        self._key, self._graph, self._inputs, self._outputs = None, None, [], None

    def _on_side_stream(self, work: Callable[[], Any]) -> Any:
        if self._stream is None or self._stream.device != self._device:
            self._stream = torch.cuda.Stream(self._device)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            result = work()
        torch.cuda.current_stream().wait_stream(self._stream)
        return result

    def _capture(self, leaves: list[torch.Tensor], spec: Any) -> bool:
        self._inputs = [t.detach().clone() for t in leaves]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._stream):
                out = self.fn(**unflatten_tensors(spec, self._inputs))
        except RuntimeError as err:  # an op that cannot be captured: run this stage eagerly
            logger.warning("CUDA graph capture failed (%s); running the DiT eagerly", err)
            self.release()
            self._disabled = True
            return False
        self._graph = graph
        self._outputs = flatten_tensors(out)
        return True
