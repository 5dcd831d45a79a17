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

``selective`` works through PyTorch's selective-checkpoint dispatch mode, which sees every operator the block
runs. A compiled block whose attention runs outside its graphs (row groups: :mod:`.row_groups`) enters that
mode around its attention kernel calls only, so neither the compiled graphs' operators nor the row groups'
slicing and copying pay the mode's per-operator cost (thousands of operators a 768p step).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch.utils.checkpoint
from torch import nn

from pfctl.models.attention_layout import PyramidLayout, kernel_call_context
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


@contextlib.contextmanager
def _around_attention(context: Callable[[], Any]) -> Iterator[None]:
    """Each fused attention call of the block's eager attention runs under ``context()``
    (:data:`pfctl.models.attention_layout.kernel_call_context`), the rest of the block under nothing."""
    token = kernel_call_context.set(context)
    try:
        yield
    finally:
        kernel_call_context.reset(token)


def _island_contexts() -> tuple[Any, Any]:
    """:func:`_selective_contexts` for a block whose attention runs eagerly between its compiled graphs: a pair of
    them per attention kernel call (a replaying context is entered once), the keeping one entered around the
    call in the forward, its replaying twin around the same call in the recomputation (the calls come in the
    same order)."""
    replays: collections.deque = collections.deque()

    def keep() -> Any:
        keeping, replaying = _selective_contexts()
        replays.append(replaying)
        return keeping

    return _around_attention(keep), _around_attention(replays.popleft)


class Checkpointed:
    """Mixin of a block: its call runs under ``torch.utils.checkpoint`` (non-reentrant) when training, if
    ``activation_checkpointing`` is set on it, with ``checkpointing_policy`` (the module docstring's two).
    Every block of a model gets the mixin (so blocks of one kind keep one class, which FSDP's wrap policy
    matches by class) and the flag says which ones recompute."""

    activation_checkpointing: bool = False
    checkpointing_policy: Policy = "full"
    #: the block's attention modules run row groups outside its compiled graphs (:class:`.row_groups.CompiledRowGroups`)
    attention_outside_graph: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            if self.checkpointing_policy == "selective":
                kwargs["context_fn"] = (
                    _island_contexts if self._attention_in_island(args) else _selective_contexts
                )
            return torch.utils.checkpoint.checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)
        return super().__call__(*args, **kwargs)

    def _attention_in_island(self, args: tuple) -> bool:
        """Whether this call's attention runs in the row groups' eager island (:mod:`.row_groups`): the block's
        attention modules are compiled ones and the model attends in row groups (the layout says)."""
        if not self.attention_outside_graph:
            return False
        layout = next((a for a in args if isinstance(a, PyramidLayout)), None)
        return layout is not None and layout.grouping


def checkpointed_blocks(blocks: list[tuple[str, nn.Module]], ratio: float) -> list[tuple[str, nn.Module]]:
    """The ``(name, block)`` pairs checkpointed at ``ratio``: the first ``floor(len(blocks) * ratio)``."""
    check_ratio(ratio)
    return blocks[: num_checkpointed(len(blocks), ratio)]
