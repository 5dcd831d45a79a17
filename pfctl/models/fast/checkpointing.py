"""Activation checkpointing of the DiT blocks, applied per block.

The blocks with execution index ``< floor(L * ratio)`` (``L`` blocks in the order of the model's
``blocks_in_order()``: Flux double-stream then single-stream) recompute their forward in the backward
instead of keeping its activations, in training mode with gradients on. The swap keeps each block where it
is (same module tree, same state-dict keys); a compiled block is checkpointed around its compiled call.
"""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint
from torch import nn

from pfctl.models.dit_layers import check_ratio, num_checkpointed

__all__ = ["Checkpointed", "checkpointed_blocks"]


class Checkpointed:
    """Mixin of a block: its call runs under ``torch.utils.checkpoint`` (non-reentrant) when training, if
    ``activation_checkpointing`` is set on it. Every block of a model gets the mixin (so blocks of one kind
    keep one class, which FSDP's wrap policy matches by class) and the flag says which ones recompute."""

    activation_checkpointing: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)
        return super().__call__(*args, **kwargs)


def checkpointed_blocks(blocks: list[tuple[str, nn.Module]], ratio: float) -> list[tuple[str, nn.Module]]:
    """The ``(name, block)`` pairs checkpointed at ``ratio``: the first ``floor(len(blocks) * ratio)``."""
    check_ratio(ratio)
    return blocks[: num_checkpointed(len(blocks), ratio)]
