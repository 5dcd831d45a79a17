"""Activation checkpointing of the DiT blocks, applied per block.

The blocks with execution index ``< floor(L * ratio)`` (``L`` blocks in the order of the model's
``blocks_in_order()``: Flux double-stream then single-stream) recompute their forward in the backward
instead of keeping its activations, in training mode with gradients on. The swap keeps each block where it
is (same module tree, same state-dict keys); a compiled block is checkpointed around its compiled call.

Two policies (torchtitan's ``full`` and op-level ``selective``):

* ``full``: everything a checkpointed block computed is computed again (the reference's checkpointing);
* ``selective``: the results of the fused attention kernels (output and log-sum-exp, a few bytes per token
  and head next to the block's activations) are kept from the forward, so the recomputation runs the block's
  products and elementwise work but not its attention, the block's costliest part at long token counts.
  The kept results are the ones the recomputation would produce (the same kernel on the same inputs).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch.utils.checkpoint
from torch import nn

from pfctl.models.dit_layers import check_ratio, num_checkpointed

__all__ = ["Checkpointed", "checkpointed_blocks", "kept_operators"]

#: what a checkpointed block keeps from its forward (see the module docstring)
Policy = Literal["full", "selective"]

#: the fused SDPA kernels whose results ``selective`` keeps (those this PyTorch has); the math fallback is a
#: composition of ordinary operators and is recomputed
_ATTENTION_KERNELS = (
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


@functools.cache
def kept_operators() -> frozenset:
    """The operators whose results a ``selective`` checkpointed block keeps."""
    ops = (getattr(torch.ops.aten, name, None) for name in _ATTENTION_KERNELS)
    return frozenset(op.default for op in ops if op is not None)


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch.utils.checkpoint.CheckpointPolicy:
    policy = torch.utils.checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op in kept_operators() else policy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_keep_attention)


class Checkpointed:
    """Mixin of a block: its call runs under ``torch.utils.checkpoint`` (non-reentrant) when training, if
    ``activation_checkpointing`` is set on it, with ``checkpointing_policy`` (the module docstring's two).
    Every block of a model gets the mixin (so blocks of one kind keep one class, which FSDP's wrap policy
    matches by class) and the flag says which ones recompute."""

    activation_checkpointing: bool = False
    checkpointing_policy: Policy = "full"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            if self.checkpointing_policy == "selective":
                kwargs["context_fn"] = _selective_contexts
            return torch.utils.checkpoint.checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)
        return super().__call__(*args, **kwargs)


def checkpointed_blocks(blocks: list[tuple[str, nn.Module]], ratio: float) -> list[tuple[str, nn.Module]]:
    """The ``(name, block)`` pairs checkpointed at ``ratio``: the first ``floor(len(blocks) * ratio)``."""
    check_ratio(ratio)
    return blocks[: num_checkpointed(len(blocks), ratio)]
