"""Parts that wait in host memory and visit the device: whole (:class:`Parked`) or a block at a time
(:class:`BlockSwap`).

:class:`Parked` is the low-memory levels' way to move a part: its tensors are copied to the device from pinned
host memory, and sent back by pointing them at their host copies again (inference never changes a weight),
so leaving the device costs no copy.

:class:`BlockSwap` is put on a built model (forward hooks only: the modules, parameters and state-dict keys
stay as they were). The parts outside the blocks move as a :class:`Parked` part; each block is brought to the
device just before its forward and dropped right after, so the device holds the resident parts, one block
computing and (on CUDA) the next block arriving: its copy runs on a side stream from pinned memory while the
current block computes. On the CPU the hooks change nothing: the same ops run on the same tensors.
:class:`Streamed` applies it to the text encoders: the T5 encoder's layers stream, the rest visits whole.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["BlockSwap", "Parked", "Streamed", "streamed_blocks", "text_modules"]


class Parked:
    """The tensors of ``module`` (less those of the modules in ``skip``) wait in host memory.

    :meth:`to` a device copies them there (on CUDA from pinned host memory, pinned on the first visit);
    :meth:`to` the CPU points them back at their host tensors, with no copy. Only for modules whose tensors
    nothing changes while they are on the device (inference)."""

    def __init__(self, module: nn.Module, skip: Iterable[nn.Module] = ()) -> None:
        inside = {id(m) for s in skip for m in s.modules()}
        self._owners = [m for m in module.modules() if id(m) not in inside]
        self._host: dict[tuple[int, str, str], torch.Tensor] = {}

    def _slots(self) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
        seen = set()
        for owner in self._owners:
            for kind, table in (("param", owner._parameters), ("buffer", owner._buffers)):
                for name, tensor in table.items():
                    if tensor is not None and id(tensor) not in seen:  # a tied weight moves once
                        seen.add(id(tensor))
                        yield owner, kind, name, tensor

    def to(self, device: torch.device | str) -> Parked:
        device = torch.device(device)
        for owner, kind, name, tensor in list(self._slots()):
            key = (id(owner), kind, name)
            if tensor.device == device or (device.index is None and tensor.device.type == device.type):
                continue
            if device.type == "cpu":
                value = self._host.get(key)
                if value is None:
                    value = tensor.detach().cpu()
            else:
                host = tensor.detach() if tensor.device.type == "cpu" else self._host.get(key)
                if host is None:
                    host = tensor.detach().cpu()
                if device.type == "cuda" and not host.is_pinned():
                    host = host.pin_memory()  # the copies below can then run beside the compute
                self._host[key] = host
                value = host.to(device, non_blocking=True)
            if kind == "param":
                tensor.data = value
            else:
                owner._buffers[name] = value
        return self


class BlockSwap:
    """Streams ``blocks`` of ``model`` (default: ``model.blocks_in_order()``, a DiT's) to the device during
    each forward; the rest of ``model`` visits the device as a :class:`Parked` part."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module] | None = None) -> None:
        self.blocks = list(blocks) if blocks is not None else [block for _, block in model.blocks_in_order()]
        self.resident = Parked(model, skip=self.blocks)
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
        self.resident.to(device)
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


def streamed_blocks(module: nn.Module) -> list[nn.Module]:
    """The layers of every T5 stack in ``module`` (the T5 encoder's 24 layers hold ~97% of its weights)."""
    from transformers.models.t5.modeling_t5 import T5Stack

    return [block for stack in module.modules() if isinstance(stack, T5Stack) for block in stack.block]


class Streamed:
    """The text encoders' models (:func:`text_modules`) moved as one part: a model with T5 layers as a
    :class:`BlockSwap` over them, any other as a :class:`Parked` part."""

    def __init__(self, text_encoder: Any) -> None:
        self.parts: list[Parked | BlockSwap] = []
        for module in text_modules(text_encoder):
            blocks = streamed_blocks(module)
            self.parts.append(BlockSwap(module, blocks) if blocks else Parked(module))

    def to(self, device: torch.device | str) -> Streamed:
        for part in self.parts:
            part.to(device)
        return self


def text_modules(text_encoder: Any) -> list[nn.Module]:
    """The models of the text encoders: pfctl's encoders list them (``modules()``); an ``nn.Module`` is one."""
    if isinstance(text_encoder, nn.Module):
        return [text_encoder]
    return list(getattr(text_encoder, "modules", list)())
