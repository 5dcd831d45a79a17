"""Block swap: a DiT whose transformer blocks wait on the CPU and visit the device one at a time.

:class:`BlockSwap` is put on a built DiT (forward hooks only: the modules, parameters and state-dict keys stay
as they were). The parts outside the blocks (embedders, output head) move with :meth:`BlockSwap.to`; each
block is brought to the device just before its forward and dropped right after, so the device holds the
resident parts, one block computing and (on CUDA) the next block arriving: its copy runs on a side stream
from pinned memory while the current block computes. On the CPU the hooks change nothing: the same ops run
on the same tensors.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = ["BlockSwap"]


class BlockSwap:
    """Streams the blocks of ``dit`` (``dit.blocks_in_order()``) to the device during each forward."""

    def __init__(self, dit: nn.Module) -> None:
        self.dit = dit
        self.blocks = [block for _, block in dit.blocks_in_order()]
        self.device = torch.device("cpu")
        self._stream: Any = None
        self._ready: dict[int, Any] = {}  # block index -> CUDA event of its copy (or None on the CPU)
        self._host: dict[int, list[torch.Tensor]] = {}
        self._handles = []
        for i, block in enumerate(self.blocks):
            self._host[i] = [t.data for t in self._tensors(block)]
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._before, i)))
            self._handles.append(block.register_forward_hook(functools.partial(self._after, i)))

    @property
    def on_device(self) -> list[int]:
        """The blocks (indices in execution order) brought to the device and not yet dropped."""
        return sorted(self._ready)

    @staticmethod
    def _tensors(block: nn.Module) -> list[torch.Tensor]:
        return [*block.parameters(), *block.buffers()]

    def to(self, device: torch.device | str) -> BlockSwap:
        """Move the resident parts (everything but the blocks) to ``device``; the blocks stream there."""
        device = torch.device(device)
        inside = {id(m) for block in self.blocks for m in block.modules()}
        for module in self.dit.modules():
            if id(module) in inside:
                continue
            for p in module.parameters(recurse=False):
                p.data = p.data.to(device)
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)
        for i in list(self._ready):
            self._drop(i)
        self.device = device
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            for i, host in self._host.items():  # pinned: the copies can run beside the compute
                if not host[0].is_pinned():
                    self._host[i] = [t.pin_memory() for t in host]
                    for t, h in zip(self._tensors(self.blocks[i]), self._host[i], strict=True):
                        t.data = h
        return self

    def _fetch(self, i: int) -> None:
        """Start copying block ``i`` to the device (on the side stream on CUDA)."""
        if i in self._ready or i >= len(self.blocks):
            return
        tensors = self._tensors(self.blocks[i])
        if self.device.type != "cuda":
            for t, h in zip(tensors, self._host[i], strict=True):
                t.data = h.to(self.device)
            self._ready[i] = None
            return
        with torch.cuda.stream(self._stream):
            for t, h in zip(tensors, self._host[i], strict=True):
                t.data = h.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._ready[i] = event

    def _drop(self, i: int) -> None:
        for t, h in zip(self._tensors(self.blocks[i]), self._host[i], strict=True):
            t.data = h
        self._ready.pop(i, None)

    def _before(self, i: int, module: nn.Module, args: Any) -> None:
        self._fetch(i)
        event = self._ready[i]
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in self._tensors(module):  # its memory is not reused before the compute is done with it
                t.data.record_stream(current)
        self._fetch(i + 1)

    def _after(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        self._drop(i)

    def remove(self) -> None:
        """Take the hooks off (the blocks stay where they are: on the CPU between forwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
