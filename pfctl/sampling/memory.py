"""``generate.low_memory``: the levels' expected peak device memory, and the DiT wrapper of level ``stream``.

:func:`expected_peak_bytes` is an estimate from the parts' parameter bytes and the activations of the
largest DiT forward and of the decode (measured peaks: benchmarks/RESULTS.md). Per level, the phases and what
the device holds in each:

* ``none``: text encoders + DiT + VAE throughout, plus the largest phase's activations;
* ``offload``: encoding (the text encoders, their T5 layers streamed: two at a time), sampling (DiT + its
  activations), decoding (VAE + the decode, tiled where the untiled one would not fit in free memory);
* ``stream``: as ``offload``, but sampling holds the DiT's resident parts and two blocks (one computing, one
  arriving) instead of the whole DiT.

Parts move as :class:`pfctl.models.block_swap.Parked` parts (copied in from pinned host memory, sent back
with no copy) or stream through :class:`pfctl.models.block_swap.BlockSwap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pfctl.config.generate import GenerateConfig
from pfctl.flow.pyramid import history_layout
from pfctl.runtime import logging as pflog
from pfctl.sampling.decode import UNTILED_DECODE_BYTES_PER_PIXEL

__all__ = ["MemoryLevel", "MemoryParts", "dit_tokens", "expected_peak_bytes", "measure_parts"]

DIT_BYTES_PER_TOKEN_WIDTH = 12
"""Live activations of one block forward, in units of (tokens x width x dtype bytes): the residual, its
norm, q/k/v, the attention output and the 4x MLP hidden, with a margin."""


@dataclass(frozen=True)
class MemoryParts:
    """Bytes of the parts' parameters (and buffers) on the device, and the DiT's shape."""

    text: int
    dit: int
    dit_blocks: int  # all transformer blocks
    dit_block: int  # the largest block
    vae: int
    dit_width: int
    dtype_bytes: int
    text_blocks: int = 0  # the T5 layers, which stream at levels offload and stream
    text_block: int = 0  # the largest of them


def _bytes(part: Any) -> int:
    """Bytes of a part's parameters and buffers (a module, or an object with ``parameters()``, such as the
    text encoders)."""
    if part is None:
        return 0
    tensors = [*getattr(part, "parameters", tuple)(), *getattr(part, "buffers", tuple)()]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_parts(text_encoder: Any, dit: nn.Module, vae: Any, dtype: torch.dtype) -> MemoryParts:
    """The :class:`MemoryParts` of loaded parts: sizes from their tensors, activations at ``dtype``'s width."""
    from pfctl.models.block_swap import streamed_blocks, text_modules

    blocks = [block for _, block in dit.blocks_in_order()]
    text_layers = [b for m in text_modules(text_encoder) for b in streamed_blocks(m)]
    return MemoryParts(
        text=_bytes(text_encoder),
        text_blocks=sum(_bytes(b) for b in text_layers),
        text_block=max((_bytes(b) for b in text_layers), default=0),
        dit=_bytes(dit),
        dit_blocks=sum(_bytes(b) for b in blocks),
        dit_block=max((_bytes(b) for b in blocks), default=0),
        vae=_bytes(getattr(vae, "module", vae)),
        dit_width=int(getattr(dit, "inner_dim", 0)),
        dtype_bytes=dtype.itemsize,
    )


def dit_tokens(temp: int, height: int, width: int, num_stages: int = 3, patch: int = 2) -> int:
    """Image tokens of the largest DiT forward of a video: its last unit at full resolution with its history
    (``height`` x ``width`` in latent pixels)."""

    def clip_tokens(stage: int, frames: int) -> int:
        down = 2 ** (num_stages - 1 - stage)
        return frames * (height // down // patch) * (width // down // patch)

    history = list(range(temp - 1))
    tokens = clip_tokens(num_stages - 1, 1)
    for stage, frames in history_layout(num_stages - 1, temp - 1):
        tokens += clip_tokens(stage, len(history[frames]))
    return tokens


def expected_peak_bytes(
    level: str, parts: MemoryParts, *, tokens: int, rows: int, height: int, width: int, tile: int | None
) -> int:
    """Expected peak device bytes of one video at ``level`` (``none``, ``offload``, ``stream``).

    ``tokens``: image tokens of the largest forward (:func:`dit_tokens`), ``rows``: its batch (2 with CFG);
    ``height`` x ``width``: the video's pixels; ``tile``: the decode tile (None: untiled), window 1.
    """
    act = rows * tokens * parts.dit_width * parts.dtype_bytes * DIT_BYTES_PER_TOKEN_WIDTH
    act += rows * tokens * tokens * parts.dtype_bytes  # the additive mask of one column, an upper bound
    fixed, per_frame = UNTILED_DECODE_BYTES_PER_PIXEL
    pixels = height * width if tile is None else min(height * width, tile * tile)
    decode = (fixed + per_frame) * pixels * parts.dtype_bytes // 2
    if level == "none":
        return parts.text + parts.dit + parts.vae + max(act, decode)
    text = parts.text - parts.text_blocks + 2 * parts.text_block
    dit = parts.dit if level == "offload" else parts.dit - parts.dit_blocks + 2 * parts.dit_block
    return max(text, dit + act, parts.vae + decode)


@dataclass(frozen=True)
class MemoryLevel:
    """What a ``generate.low_memory`` level does on a device."""

    level: str
    moves: bool
    """The parts move between the CPU and the device (never on the CPU, where they already are)."""

    @classmethod
    def of(cls, gen: GenerateConfig, device: torch.device) -> MemoryLevel:
        level = gen.memory_level
        if level != "none" and device.type == "cpu":
            pflog.log(
                f"generate.low_memory {level}: nothing moves on the CPU (blocks stream through the same hooks)"
            )
        return cls(level, level != "none" and device.type != "cpu")

    def adjust(self, gen: GenerateConfig) -> GenerateConfig:
        """The settings the level implies: for ``stream``, no CUDA graphs or compiled blocks (the blocks'
        tensors change place at every forward). The decode's tile stays ``decode_tile``'s: ``auto`` tiles
        only where the untiled decode would not fit in the memory free when it starts (the other parts are
        off the device then)."""
        if self.level == "stream":
            return gen.model_copy(update={"cuda_graphs": False, "compile": False})
        return gen

    def parts(self, dit: nn.Module, vae: nn.Module, text_encoder: Any) -> dict[str, Any]:
        """The parts as they move (:class:`pfctl.sampling.generate.Offload`'s): where nothing moves, the
        parts themselves; else the DiT as a parked part (``offload``) or a block swap (``stream``), the VAE
        parked, the text encoders with their T5 layers streamed."""
        if not self.moves:
            return {"dit": dit, "vae": vae, "text": text_encoder}
        from pfctl.models.block_swap import BlockSwap, Parked, Streamed

        return {
            "dit": BlockSwap(dit) if self.level == "stream" else Parked(dit),
            "vae": Parked(vae),
            "text": Streamed(text_encoder),
        }

    def record(self, parts: MemoryParts, gen: GenerateConfig, temps: list[int], width: int, height: int,
               spatial: int) -> dict[str, Any]:  # fmt: skip
        """The sidecar's ``memory``: the level and the expected peak of the longest video (an estimate, also
        logged)."""
        tokens = dit_tokens(max(temps), height // spatial, width // spatial)
        rows = 2 if gen.guidance_scale > 0 else 1
        tile = gen.decode_tile if isinstance(gen.decode_tile, int) else None
        peak = expected_peak_bytes(
            self.level, parts, tokens=tokens, rows=rows, height=height, width=width, tile=tile
        )
        pflog.log(f"low_memory {self.level}: expected peak device memory {peak / 2**30:.2f} GiB (an estimate)")
        return {
            "low_memory": self.level,
            "expected_peak_bytes": int(peak),
            "estimate": "pfctl.sampling.memory",
        }
