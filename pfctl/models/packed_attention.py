"""Every column of a DiT call attended in one FlexAttention call (the ``flex`` attention backend).

The columns' ``[text_k; image_k]`` tokens lie side by side in one sequence, the single-stream blocks' own
order. One block-sparse mask holds what the per-column masks say, plus the column: a query sees a key of its
own column whose text-padding state is its own and, under temporal causality, whose frame is not after its
own (text counts as frame 0) — the rule of :func:`pfctl.models.attention_layout.visibility_rules`. Tiles of
``BLOCK`` x ``BLOCK`` query and key tokens with no visible pair are skipped and tiles visible throughout run
without the rule, so a call costs about what its columns' own attentions cost, less the keys temporal
causality hides; a block makes one attention call however many columns the forward has (the merged
micro-batches double them), where the SDPA backends make one per column.

The mask is built once per forward from the token layout alone (:func:`packed_columns`), a few query rows at
a time, so no ``[T, T]`` mask is ever held. PyTorch generates the attention kernel, forward and backward:
compiled blocks trace it into their graphs; elsewhere on CUDA the call is compiled on its own. PyTorch's
FlexAttention has no CPU backward, so CPU training keeps the SDPA backends (``train.attention``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BLOCK", "PackedColumns", "column_tokens", "packed_columns"]

#: tile size of the block-sparse mask, query and key tokens (FlexAttention's default)
BLOCK = 128
#: query tiles whose visibility one pass of :func:`_block_mask` evaluates (a ``[Bc, 16*BLOCK, T]`` boolean)
TILES_PER_PASS = 16


def column_tokens(
    text_valid: torch.Tensor, frame_ids: Sequence[torch.Tensor], num_columns: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per column its tokens ``[text_k; image_k]``: ``valid [Bc, L+n_k]`` (a real token, not text padding) and
    ``order [L+n_k]`` (the token's frame; text is frame 0), from ``text_valid [K*Bc, L]`` (rows ``b*K + k``)
    and the columns' image-token frames ``frame_ids[k] [n_k]``."""
    rows, text_len = text_valid.shape
    valid_cols = text_valid.view(rows // num_columns, num_columns, text_len)  # [Bc, K, L]
    tokens = []
    for k, frames in enumerate(frame_ids):
        valid = torch.cat([valid_cols[:, k], valid_cols.new_ones(valid_cols.shape[0], frames.shape[0])], dim=1)
        tokens.append((valid, torch.cat([frames.new_zeros(text_len), frames])))
    return tokens


@dataclass
class PackedColumns:
    """The block-sparse masks of one forward's packed columns: ``joint`` (every token a query) and ``tails``
    (the queries are the rows of each column's last clip, :func:`pfctl.models.attention_layout.column_tails`;
    None where no block attends them)."""

    joint: Any  # torch.nn.attention.flex_attention.BlockMask
    tails: Any | None
    text_len: int
    image_lengths: list[int]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tails: bool = False) -> torch.Tensor:
        """``q [Bc, Sq, H, hd]`` (all packed tokens, or with ``tails`` the columns' tails), ``k, v [Bc, T, H, hd]``
        packed -> ``[Bc, Sq, H*hd]``."""
        mask = self.tails if tails else self.joint
        out = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)  # [Bc, H, Sq, hd]
        return out.transpose(1, 2).flatten(2)

    def attend_streams(
        self,
        text: Sequence[Sequence[torch.Tensor]],
        image: Sequence[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The double-stream blocks' joint attention: ``text`` is q, k, v each a list of the columns' text
        tokens ``[Bc, L, H, hd]``, ``image`` q, k, v ``[Bc, N, H, hd]`` (all columns). Returns the columns'
        text outputs ``[Bc, L, H*hd]`` and image outputs ``[Bc, n_k, H*hd]``, in column order."""
        packed = []
        for text_part, image_part in zip(text, image, strict=True):
            pieces = zip(text_part, image_part.split(self.image_lengths, 1), strict=True)
            packed.append(torch.cat([t for pair in pieces for t in pair], dim=1))  # [Bc, T, H, hd]
        sizes = [n for image_len in self.image_lengths for n in (self.text_len, image_len)]
        parts = self.attend(*packed).split(sizes, dim=1)
        return list(parts[0::2]), list(parts[1::2])


def packed_columns(
    text_valid: torch.Tensor,
    frame_ids: Sequence[torch.Tensor],
    num_columns: int,
    temporal_causal: bool,
    tail_lengths: Sequence[int] | None = None,
) -> PackedColumns:
    """The :class:`PackedColumns` of one forward: ``text_valid [K*Bc, L]`` and ``frame_ids`` as for
    :func:`column_tokens`; ``tail_lengths`` (per column, the tokens of its last clip) also builds the mask of
    the tails' queries."""
    tokens = column_tokens(text_valid, frame_ids, num_columns)
    valid = torch.cat([v for v, _ in tokens], dim=1)  # [Bc, T]
    order = torch.cat([o for _, o in tokens])  # [T]
    sizes = [o.shape[0] for _, o in tokens]
    column = torch.repeat_interleave(
        torch.arange(len(sizes), device=order.device), torch.tensor(sizes, device=order.device)
    )
    rule = _visible(valid, order, column, temporal_causal)
    total = sum(sizes)
    joint = _block_mask(rule, valid.shape[0], total, total, order.device)
    tails = None
    if tail_lengths is not None:
        ends = torch.tensor(sizes).cumsum(0).tolist()
        rows = torch.cat([torch.arange(end - m, end) for end, m in zip(ends, tail_lengths, strict=True)])
        rows = rows.to(order.device)
        tails = _block_mask(_of_rows(rule, rows), valid.shape[0], rows.shape[0], total, order.device)
    return PackedColumns(joint, tails, text_valid.shape[1], [n - text_valid.shape[1] for n in sizes])


def _visible(
    valid: torch.Tensor, order: torch.Tensor, column: torch.Tensor, temporal_causal: bool
) -> Callable[..., torch.Tensor]:
    """The packed tokens' rule ``(b, h, q, kv) -> bool`` (FlexAttention's ``mask_mod``)."""

    def rule(b: torch.Tensor, h: torch.Tensor | None, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seen = (column[q] == column[kv]) & (valid[b, q] == valid[b, kv])
        return seen & (order[q] >= order[kv]) if temporal_causal else seen

    return rule


def _of_rows(rule: Callable[..., torch.Tensor], rows: torch.Tensor) -> Callable[..., torch.Tensor]:
    """``rule`` for queries that are the packed tokens ``rows``."""

    def tail_rule(b: torch.Tensor, h: torch.Tensor | None, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return rule(b, h, rows[q], kv)

    return tail_rule


def _block_mask(
    rule: Callable[..., torch.Tensor], batch: int, q_len: int, kv_len: int, device: torch.device
) -> Any:
    """The ``BlockMask`` of ``rule`` over ``[batch, q_len, kv_len]``: per tile of ``BLOCK`` x ``BLOCK`` tokens
    whether it has visible pairs (partial: the kernel applies ``rule``) or is visible throughout (full),
    evaluated ``TILES_PER_PASS`` query tiles at a time."""
    from torch.nn.attention.flex_attention import BlockMask

    q_tiles, kv_tiles = -(-q_len // BLOCK), -(-kv_len // BLOCK)
    b = torch.arange(batch, device=device)[:, None, None]
    kv = torch.arange(kv_len, device=device)[None, None, :]
    counts = []
    for first in range(0, q_tiles, TILES_PER_PASS):
        tiles = min(TILES_PER_PASS, q_tiles - first)
        q = torch.arange(first * BLOCK, min((first + tiles) * BLOCK, q_len), device=device)
        seen = torch.zeros(batch, tiles * BLOCK, kv_tiles * BLOCK, dtype=torch.bool, device=device)
        seen[:, : q.shape[0], :kv_len] = rule(b, None, q[None, :, None], kv)
        counts.append(seen.view(batch, tiles, BLOCK, kv_tiles, BLOCK).sum((2, 4), dtype=torch.int32))
    count = torch.cat(counts, dim=1)[:, None]  # [B, 1, q_tiles, kv_tiles]
    full = count == BLOCK * BLOCK
    partial = (count > 0) & ~full
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK, mask_mod=rule, seq_lengths=(q_len, kv_len)
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile the number of key tiles set in ``tiles [B, H, Qt, KVt]`` and their indices, first."""
    num = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, indices


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """FlexAttention of ``[B, H, S, hd]`` tensors: traced as it is inside a compiled block, compiled on its own
    on CUDA outside one (the uncompiled call computes every score), as it is elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_flex()(q, k, v, block_mask=block_mask)
    return flex_attention(q, k, v, block_mask=block_mask)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)
