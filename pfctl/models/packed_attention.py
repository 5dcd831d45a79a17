"""Every column of a DiT call attended in one FlexAttention call (the ``flex`` attention backend).

The columns' text and image tokens lie in one sequence, in the order the blocks hold them: the single-stream
blocks' ``[text_0; image_0; text_1; ...]``, or the double-stream blocks' text rows of all columns followed by
their image tokens (:data:`ORDERS`). Nothing is reordered; a block-sparse mask per order says who sees whom:
a query sees a key of its own column whose text-padding state is its own and, under temporal causality,
whose frame is not after its own (text counts as frame 0): the rule of
:func:`pfctl.models.attention_layout.visibility_rules`, plus the column. Tiles of ``BLOCK`` x ``BLOCK`` query
and key tokens with no visible pair are skipped and tiles visible throughout run without the rule, so a call
costs about what its columns' own attentions cost, less the keys temporal causality hides. A block makes one
attention call however many columns the forward has (the merged micro-batches double them), where the SDPA
backends make one per column.

The masks are built once per forward from the token layout alone (:func:`packed_columns`), a few query rows
at a time, so no ``[T, T]`` mask is ever held. PyTorch generates the attention kernel, forward and backward:
compiled blocks trace it into their graphs; elsewhere on CUDA the call is compiled on its own. PyTorch's
FlexAttention has no CPU backward, so CPU training keeps the SDPA backends (``train.attention``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BLOCK", "ORDERS", "PackedColumns", "column_tokens", "packed_columns"]

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


#: the token orders a forward's blocks attend in (:func:`packed_columns` builds a mask for each one asked for)
ORDERS = ("joint", "streams", "tails")


@dataclass
class PackedColumns:
    """The block-sparse masks of one forward's packed columns, per token order (None where not built):

    * ``joint``: ``[text_0; image_0; text_1; image_1; ...]``, the single-stream blocks' sequence;
    * ``streams``: ``[text_0; ...; text_{K-1}; image_0; ...; image_{K-1}]``, the double-stream blocks' text rows
      and image tokens side by side, as they come (no reordering);
    * ``tails``: the joint order's keys, and as queries only the rows of each column's last clip
      (:func:`pfctl.models.attention_layout.column_tails`), what the last single-stream block attends."""

    joint: Any | None  # torch.nn.attention.flex_attention.BlockMask
    streams: Any | None
    tails: Any | None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: str = "joint") -> torch.Tensor:
        """``q [Bc, Sq, H, hd]``, ``k, v [Bc, T, H, hd]``, packed in ``order`` -> ``[Bc, Sq, H*hd]``."""
        out = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), getattr(self, order))
        return out.transpose(1, 2).flatten(2)  # from [Bc, H, Sq, hd]

    def attend_streams(
        self, text: Sequence[torch.Tensor], image: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The double-stream blocks' joint attention: ``text`` is q, k, v ``[K*Bc, L, H, hd]`` (rows ``b*K + k``),
        ``image`` q, k, v ``[Bc, N, H, hd]`` (all columns). Returns the text output ``[K*Bc, L, H*hd]`` (same
        rows) and the image output ``[Bc, N, H*hd]``."""
        (rows, text_len), (batch, tokens) = text[0].shape[:2], image[0].shape[:2]
        packed = [  # [Bc, K*L + N, H, hd]: item b's text rows b*K..b*K+K-1 in turn, then its image tokens
            torch.cat([t.unflatten(0, (batch, -1)).flatten(1, 2), i], dim=1)
            for t, i in zip(text, image, strict=True)
        ]
        text_out, image_out = self.attend(*packed, order="streams").split([rows // batch * text_len, tokens], 1)
        return text_out.reshape(rows, text_len, -1), image_out


def packed_columns(
    text_valid: torch.Tensor,
    frame_ids: Sequence[torch.Tensor],
    num_columns: int,
    temporal_causal: bool,
    orders: Sequence[str] = ORDERS,
    tail_lengths: Sequence[int] | None = None,
) -> PackedColumns:
    """The :class:`PackedColumns` of one forward, with the masks of ``orders`` (:data:`ORDERS`):
    ``text_valid [K*Bc, L]`` and ``frame_ids`` as for :func:`column_tokens`; ``tail_lengths`` (per column,
    the tokens of its last clip) for ``tails``."""
    tokens = column_tokens(text_valid, frame_ids, num_columns)
    text_len, batch, device = text_valid.shape[1], text_valid.shape[0] // num_columns, text_valid.device
    texts = [(k, slice(0, text_len)) for k in range(num_columns)]
    images = [(k, slice(text_len, None)) for k in range(num_columns)]
    pieces = {"streams": texts + images, "joint": [piece for pair in zip(texts, images, strict=True) for piece in pair]}
    rules: dict[str, tuple[Callable[..., torch.Tensor], int]] = {}  # the tails' keys are the joint order's
    masks = dict.fromkeys(ORDERS)
    for order in orders:
        keys = "streams" if order == "streams" else "joint"
        if keys not in rules:
            rules[keys] = _packed_rule(tokens, pieces[keys], temporal_causal)
        rule, total = rules[keys]
        if order != "tails":
            masks[order] = _block_mask(rule, batch, total, total, device)
            continue
        ends = torch.tensor([o.shape[0] for _, o in tokens]).cumsum(0).tolist()
        rows = torch.cat([torch.arange(end - m, end) for end, m in zip(ends, tail_lengths, strict=True)])
        masks[order] = _block_mask(_of_rows(rule, rows.to(device)), batch, rows.shape[0], total, device)
    return PackedColumns(**masks)


def _packed_rule(
    tokens: Sequence[tuple[torch.Tensor, torch.Tensor]], pieces: Sequence[tuple[int, slice]], temporal_causal: bool
) -> tuple[Callable[..., torch.Tensor], int]:
    """The rule of the columns' tokens (:func:`column_tokens`) packed as ``pieces`` (column, token slice) in
    order, and the packed length."""
    valid = torch.cat([tokens[k][0][:, part] for k, part in pieces], dim=1)  # [Bc, T]
    order = torch.cat([tokens[k][1][part] for k, part in pieces])  # [T]
    column = torch.cat([torch.full_like(tokens[k][1][part], k) for k, part in pieces])
    return _visible(valid, order, column, temporal_causal), order.shape[0]


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
