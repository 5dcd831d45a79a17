"""The pyramid attention layout of both DiTs: who attends whom, in which query-row groups, for which rows.

Both models take a list of *columns* (one per pyramid stage present in the batch), each a list of clips
``[Bc, C, t, h, w]`` ordered oldest history first, the clip being denoised last. Text rows are interleaved:
row ``r = b*K + k`` belongs to column ``k``, item ``b``. Attention is per column, over ``[text_k ; image_k]``,
with one mask per column that encodes text padding (padding only sees padding) and, optionally, temporal
causality (a query at frame ``f`` sees keys at frames ``<= f``; text counts as frame 0).

Everything that depends only on shapes (token counts, RoPE tables, masks, row groups) is computed once per
forward in a :class:`PyramidLayout` and handed to every block, so no block rebuilds them. Attention is SDPA
with an additive mask; :data:`ATTENTION_BACKENDS` say which fused SDPA kernel runs it
(:func:`attention_kernels`), one call per column; the ``flex`` backend attends all columns in one
FlexAttention call instead (:mod:`pfctl.models.packed_attention`). Under temporal causality the queries may be
attended in row groups (:func:`causal_row_groups`) that skip the keys causality hides from the whole group:
the same result, less work. The last block computes only the rows of each column's last clip
(:func:`column_tails`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pfctl.errors import ConfigError, InputError
from pfctl.models.packed_attention import PackedColumns, column_tokens, packed_columns
from pfctl.models.rope import RotaryTable

#: attention kernels of the DiTs (:meth:`PyramidAttention.set_attention_backend`, :func:`attention_kernels`)
ATTENTION_BACKENDS = ("auto", "efficient", "cudnn", "flex")
#: Additive attention mask value of a masked key: the finite value SDPA's cuDNN path itself substitutes for a
#: boolean False (cuDNN mishandles -inf). With it every backend matches a boolean mask bit for bit: next to
#: any allowed key (every row has one, the diagonal) exp(score - 65504 - max) underflows to exactly 0.
MASKED = -65504.0
#: under the ``cudnn`` backend the text is cut to a multiple of this many tokens
#: (:meth:`PyramidAttention.align_text`): cuDNN builds a plan for every new shape, and the masked calls'
#: shapes then follow the text's few lengths, not each caption's
CUDNN_TEXT_MULTIPLE = 32


def by_column(rows: torch.Tensor, num_columns: int) -> torch.Tensor:
    """``[K*Bc, ...]`` interleaved rows (r = b*K + k) -> ``[Bc, K, ...]``."""
    return rows.view(rows.shape[0] // num_columns, num_columns, *rows.shape[1:])


def clip_frame_ids(clip_grids: Sequence[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """Frame index of every image token of a column (clips in order, tokens t-major): ``[n]`` int64.

    Clip ``j`` starts where clip ``j-1`` ended, so history frames precede the current clip's frames.
    """
    ids, start = [], 0
    for t, h, w in clip_grids:
        ids.append(torch.arange(start, start + t, device=device).repeat_interleave(h * w))
        start += t
    return torch.cat(ids)


def build_attention_bias(
    text_valid: torch.Tensor,
    frame_ids: Sequence[torch.Tensor],
    num_columns: int,
    temporal_causal: bool,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One additive attention mask ``[Bc, 1, L+n_k, L+n_k]`` per column: 0 where a query may attend, else
    :data:`MASKED`.

    ``text_valid`` is ``[K*Bc, L]`` (interleaved rows); ``frame_ids[k]`` is ``[n_k]``. A query sees a key iff
    both are real tokens or both are text padding (padding tokens only see each other, so they never leak
    into real tokens), and -- when ``temporal_causal`` -- the key's frame is not later than the query's
    (text is frame 0). The diagonal is always allowed, so no row is empty.

    SDPA would otherwise convert a boolean mask to such a tensor (in the query dtype ``dtype``) on every call
    of every block; building them once here saves those kernels and the copy each block's backward would
    keep. Each mask is a view of :func:`padded_attention_bias`'s storage, whose rows are padded to a multiple
    of 8 elements: the alignment the memory-efficient CUDA kernel needs, which it would otherwise restore by
    padding a copy per call.
    """
    return [bias[..., : bias.shape[2]] for bias in padded_attention_bias(text_valid, frame_ids, num_columns,
                                                                         temporal_causal, dtype)]  # fmt: skip


def padded_attention_bias(
    text_valid: torch.Tensor,
    frame_ids: Sequence[torch.Tensor],
    num_columns: int,
    temporal_causal: bool,
    dtype: torch.dtype,
    extents: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """The masks of :func:`build_attention_bias` as contiguous ``[Bc, 1, S, R]`` tensors: keys ``[0, S)``
    then ``R - S`` padding columns (``MASKED``), ``R`` the next multiple of 8 above ``S``. With ``extents``
    (per column, :func:`mask_extents`) only the first ``extents[k]`` queries and keys: all the attention
    in row groups reads (a large 768p sampling call's mask is then ~1/15 of the full one; timings in
    benchmarks/RESULTS.md).

    The DiT layouts hold these and slice them inside the blocks (:func:`masked_attention`): a block compiled
    with dynamic shapes then sees one contiguous input of two free sizes for every token count, where the
    strided views would give it a new stride pattern to specialise on whenever ``S`` is or is not a
    multiple of 8 (graph counts in benchmarks/RESULTS.md)."""
    biases = []
    rules = visibility_rules(text_valid, frame_ids, num_columns, temporal_causal)
    for k, (bc, size, rule) in enumerate(rules):
        size = size if extents is None else min(size, extents[k])
        idx = torch.arange(size, device=text_valid.device)
        mask = rule(torch.arange(bc, device=idx.device)[:, None, None], None, idx[:, None], idx[None, :])
        storage = torch.full((bc, 1, size, (size + 8) // 8 * 8), MASKED, dtype=dtype, device=mask.device)
        storage[..., :size].masked_fill_(mask[:, None], 0.0)
        biases.append(storage)
    return biases


def visibility_rules(
    text_valid: torch.Tensor, frame_ids: Sequence[torch.Tensor], num_columns: int, temporal_causal: bool
) -> list[tuple[int, int, Callable[..., torch.Tensor]]]:
    """Per column ``(Bc, S, rule)``: ``rule(b, h, q, kv)`` (FlexAttention's ``mask_mod`` signature; any
    broadcastable index tensors) says whether query ``q`` of item ``b`` may attend key ``kv`` of the column's
    ``S = L + n_k`` tokens: the definition of visibility the attention masks are built from."""
    return [
        (valid.shape[0], valid.shape[1], _visibility_rule(valid, order, temporal_causal))
        for valid, order in column_tokens(text_valid, frame_ids, num_columns)
    ]


def _visibility_rule(
    valid: torch.Tensor, order: torch.Tensor, temporal_causal: bool
) -> Callable[..., torch.Tensor]:
    """The rule of one column: ``valid [Bc, S]`` real-token flags, ``order [S]`` frame of each token."""

    def rule(b: torch.Tensor, h: torch.Tensor | None, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        visible = valid[b, q] == valid[b, kv]
        return visible & (order[q] >= order[kv]) if temporal_causal else visible

    return rule


def attention_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype q/k/v will have in the blocks fed ``hidden_states``: autocast's when it is on, else its own."""
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden_states.dtype


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    backend: str = "auto",
    row_groups: Sequence[RowGroup] | None = None,
) -> torch.Tensor:
    """Attention under one column's additive mask from :func:`build_attention_bias` (or the padded storage of
    :func:`padded_attention_bias`: only its first ``S`` key columns are used); ``q [B, Sq, H, hd]``,
    ``k, v [B, S, H, hd]`` -> ``[B, Sq, H*hd]``. With ``Sq < S`` the queries are the column's last ``Sq``
    positions (the rows of its last clip, all the last block computes: :func:`column_tails`).

    Every attention call of both DiTs goes through here, with the kernels of ``backend``
    (:func:`attention_kernels`). SDPA picks a fused kernel that accepts the mask (memory-efficient or cuDNN on
    GPU, the flash-style CPU kernel), never one that would drop it. With ``row_groups``
    (:func:`causal_row_groups`) the query rows are attended group by group, each against the keys before its
    end only: the keys temporal causality hides from the whole group are not computed at all.
    """
    first = k.shape[1] - q.shape[1]  # the position of the first query
    mask = mask[..., : k.shape[1]]  # a padded_attention_bias storage: its first S columns
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, hd]
    if mask.dtype != q.dtype:  # a layout built for another dtype than the blocks run in
        mask = mask.to(q.dtype)
    if row_groups is not None:
        return _attention_by_row_groups(q, k, v, mask, backend, row_groups, first).flatten(2)
    with attention_kernels(backend):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., first:, :])  # [B, H, Sq, hd]
    return out.transpose(1, 2).flatten(2)  # [B, Sq, H*hd]


class RowGroupCall(NamedTuple):
    """One attention call of row groups: the ``items`` (batch), query ``rows`` (of ``q``, which starts at
    position ``first``) and ``keys`` it attends, and ``mask_rows`` (positions: the rows of the column's
    mask it reads, with columns ``keys``), None for a call without a mask."""

    items: slice
    rows: slice
    keys: slice
    mask_rows: slice | None


def row_group_calls(row_groups: Sequence[RowGroup], first: int = 0) -> list[RowGroupCall]:
    """The calls that attend ``row_groups`` for the queries from position ``first`` on (a group's rows before
    ``first`` are not computed): a group under the mask is one call, rows ``[a, b)`` against keys ``[0, b)``;
    a group with ``key_starts`` one call per run of items with the same start (and one more for the first
    group's text padding before it). See :func:`_attention_by_row_groups`."""
    calls = []
    for a, b, key_starts in row_groups:
        if b <= first:
            continue
        a = max(a, first)
        if key_starts is None:
            calls.append(RowGroupCall(slice(None), slice(a - first, b - first), slice(0, b), slice(a, b)))
            continue
        for items, start in key_start_runs(key_starts):
            for lo, hi, keys in ((a, min(start, b), slice(0, start)), (max(a, start), b, slice(start, b))):
                if lo < hi:  # the text padding's rows (first group only), then the valid rows
                    calls.append(RowGroupCall(items, slice(lo - first, hi - first), keys, None))
    return calls


def key_start_runs(key_starts: Sequence[int]) -> list[tuple[slice, int]]:
    """The runs of items with the same key start, in order: each run's items (``slice(None)`` for one run of
    them all) and its start."""
    runs, item = [], 0
    for start, run in itertools.groupby(key_starts):
        count = len(list(run))
        runs.append((slice(None) if count == len(key_starts) else slice(item, item + count), start))
        item += count
    return runs


def whole_item_rows(calls: Sequence[RowGroupCall]) -> list[int] | None:
    """Each call's query row count where every call attends every item (the calls then tile the query rows in
    order), else None. Such calls take their queries by one split and give their results by one concatenation
    (:func:`by_call`, :func:`from_calls`): with gradients two autograd nodes, where slicing and copying into
    an output would add two per call, each with a backward that fills a whole query- or output-sized
    gradient."""
    if all(call.items == slice(None) for call in calls):
        return [call.rows.stop - call.rows.start for call in calls]
    return None


def by_call(
    x: torch.Tensor, calls: Sequence[RowGroupCall], rows: list[int] | None, dim: int
) -> list[torch.Tensor]:
    """Each call's items and query rows of ``x`` (items first, query rows along ``dim``) as views; ``rows``:
    :func:`whole_item_rows` of ``calls``."""
    if rows is not None:
        return list(x.split(rows, dim))
    between = (slice(None),) * (dim - 1)
    return [x[(call.items, *between, call.rows)] for call in calls]


def from_calls(
    parts: Iterable[torch.Tensor],
    calls: Sequence[RowGroupCall],
    rows: list[int] | None,
    dim: int,
    shape: Sequence[int],
) -> torch.Tensor:
    """The calls' ``parts`` (their items and query rows along ``dim``, in call order) as one tensor of
    ``shape``: concatenated where ``rows`` (:func:`whole_item_rows`) is set, else written into place."""
    if rows is not None:
        return torch.cat(list(parts), dim)
    out = None
    between = (slice(None),) * (dim - 1)
    for call, part in zip(calls, parts, strict=True):
        if out is None:
            out = part.new_empty(shape)
        out[(call.items, *between, call.rows)] = part
    return out


def _attention_by_row_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    backend: str,
    row_groups: Sequence[RowGroup],
    first: int = 0,
) -> torch.Tensor:
    """Rows ``[a, b)`` of the masked attention against keys ``[0, b)`` only, for each group; ``q [B, H, Sq,
    hd]`` (positions ``first..S-1``), ``k, v [B, H, S, hd]`` -> ``[B, Sq, H, hd]``, the calls' results
    (:func:`row_group_calls`) concatenated in row order, or written into their rows and items. Exact: every key
    at or after ``b`` is masked for every row of the group, so it adds exactly 0. A group with ``key_starts``
    needs no mask at all: item ``i``'s rows from ``key_starts[i]`` on attend keys ``[key_starts[i], b)``, every
    one visible to every one of them, and the first group's rows of text padding before it attend the padding
    ``[0, key_starts[i])``."""
    calls = row_group_calls(row_groups, first)
    rows = whole_item_rows(calls)
    with attention_kernels(backend):
        results = (  # each call's [b, rows, H, hd], computed as it is taken
            F.scaled_dot_product_attention(
                query, k[items, :, keys], v[items, :, keys], None if at is None else mask[items, :, at, keys]
            ).transpose(1, 2)
            for query, (items, _, keys, at) in zip(by_call(q, calls, rows, 2), calls, strict=True)
        )
        return from_calls(results, calls, rows, 1, (q.shape[0], q.shape[2], q.shape[1], q.shape[3]))


#: the fewest query rows a group of :func:`causal_row_groups` closes with (whole frames are added until it has
#: them; a frame that large is a group of its own) unless the model is told otherwise (``set_attention_backend(
#: min_rows=)``, ``train.row_group_min_rows``); chosen for sampling by benchmarks/bench_video_attention.py and
#: kept by training, where one frame per group was slower (RESULTS.md)
ROW_GROUP_MIN_ROWS = 512
#: the shortest column (text + image tokens) attended in row groups when the model is not told otherwise
#: (``set_attention_backend(min_tokens=)``; generate passes 0: every column). Training keeps it unless told
#: otherwise (``train.row_group_min_tokens``; the 768p recipe groups every column: benchmarks/RESULTS.md)
ROW_GROUP_MIN_TOKENS = 6144


class RowGroup(NamedTuple):
    """Query rows ``[start, end)`` of one column, attended against keys ``[0, end)`` under the column's mask;
    or, with ``key_starts`` (one per item), with no mask: the rows are one frame's image tokens (the first
    frame's with the text before it), every key in ``[key_starts[i], end)`` is visible to all of them but the
    text padding ``[0, key_starts[i])``, which sees only itself."""

    start: int
    end: int
    key_starts: tuple[int, ...] | None = None


def causal_row_groups(
    text_len: int,
    clip_grids: Sequence[tuple[int, int, int]],
    min_rows: int = ROW_GROUP_MIN_ROWS,
    key_starts: Sequence[int] | None = None,
) -> list[RowGroup]:
    """Query-row groups of one column's ``[text; image]`` sequence under temporal causality: whole frames are
    gathered until a group has ``min_rows`` rows, and a frame of ``min_rows`` or more is a group of its own, so
    no query in ``[start, end)`` may attend a key at or after ``end`` (frames are in order; the text shares
    frame 0 with the first image frame, so the first group holds both).

    ``key_starts`` (per item: where its valid text begins, the text being left-aligned as
    :func:`left_align_text` leaves it) marks the groups of a single frame as needing no mask: their rows see
    every key from the item's valid text to the frame's end, and nothing else (the first frame's group holds
    the text too, whose padding sees only the padding)."""
    frames = [h * w for t, h, w in clip_grids for _ in range(t)]
    groups: list[RowGroup] = []
    start, end, count = 0, text_len, 0  # the open group: rows [start, end), ``count`` frames

    def close() -> None:
        nonlocal start, count
        plain = key_starts is not None and count == 1
        groups.append(RowGroup(start, end, tuple(key_starts) if plain else None))
        start, count = end, 0

    for rows in frames:
        if rows >= min_rows and count:  # a large frame stands alone
            close()
        end, count = end + rows, count + 1
        if end - start >= min_rows:
            close()
    if end > start:
        close()
    return groups


def column_row_groups(
    text_len: int,
    clip_grids: Sequence[tuple[int, int, int]],
    key_starts: Sequence[int] | None,
    min_tokens: int,
    min_rows: int,
) -> list[RowGroup] | None:
    """The row groups of one column (:func:`causal_row_groups` closing at ``min_rows`` rows), or None when the
    column has fewer than ``min_tokens`` tokens (text + image): it then takes one masked call."""
    if text_len + sum(t * h * w for t, h, w in clip_grids) < min_tokens:
        return None
    return causal_row_groups(text_len, clip_grids, min_rows, key_starts)


def mask_extents(
    row_groups: Sequence[Sequence[RowGroup] | None] | None, sizes: Sequence[int]
) -> list[int] | None:
    """Per column of ``sizes[k]`` tokens, the leading ones whose mask its attention reads: all of them in one
    masked call (its groups None), else up to the end of its last row group attended under the mask
    (mask-free groups read none). None when no column is grouped."""
    if row_groups is None:
        return None
    # at least 2 (or the whole column): a compiled block taking the mask would specialise on a size of 0 or 1
    return [
        size if groups is None else min(size, max((g.end for g in groups if g.key_starts is None), default=2))
        for groups, size in zip(row_groups, sizes, strict=True)
    ]


def right_padded_lengths(mask: torch.Tensor) -> list[int] | None:
    """The valid tokens of each row of a text attention mask ``[R, L]`` (read on the host) when they are its
    first ones, as tokenizers pad; None when some row is laid out otherwise."""
    valid = mask.detach().cpu() != 0
    lengths = valid.sum(1)
    if not bool((valid == (torch.arange(valid.shape[1])[None] < lengths[:, None])).all()):
        return None
    return lengths.tolist()


def left_align_text(
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    text_lengths: Sequence[int],
    multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text rows ``[R, L, ...]`` whose first ``text_lengths[r]`` tokens are valid, cut to the longest valid
    length rounded up to a ``multiple`` (at most ``L``; the padding every row has) and rotated so each row's
    valid tokens end it.

    Exact for everything the DiT returns: padding tokens only ever attend each other and every text token
    sits at RoPE position 0, so moving text tokens and dropping the padding all rows share change no image
    token."""
    width = min(-(-max(1, *text_lengths) // multiple) * multiple, encoder_attention_mask.shape[1])

    def align(x: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [row[:width].roll(width - n, 0) for row, n in zip(x.unbind(0), text_lengths, strict=True)]
        )

    return align(encoder_hidden_states), align(encoder_attention_mask)


def attention_kernels(backend: str) -> contextlib.AbstractContextManager:
    """The SDPA kernels the attention may use under ``backend`` (:data:`ATTENTION_BACKENDS`):

    * ``auto``: PyTorch's order. Recent PyTorch puts cuDNN's kernel first on H100/H200 (with a new enough
      cuDNN) and flash / memory-efficient elsewhere; with a mask, flash never applies.
    * ``efficient``: cuDNN left out, so the memory-efficient kernel runs the masked calls (CPU: its fused
      kernel, as with ``auto``). cuDNN builds a plan for every new shape, and a training run's shapes change
      every step (benchmarks/RESULTS.md: training steps were much slower with cuDNN allowed).
    * ``cudnn``: cuDNN's kernel first, the others where it cannot run a call (the CPU, unsupported shapes).
    * ``flex``: the blocks attend every column in one FlexAttention call (:mod:`.packed_attention`), not
      through SDPA; an SDPA call under it takes ``efficient``'s kernels.

    Entered around each call, so gradient checkpointing's recomputation uses the kernel the forward used;
    torch.compile traces it without a graph break."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    others = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if backend in ("efficient", "flex"):
        return sdpa_kernel(others)
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, *others], set_priority=True)


@dataclass
class PyramidLayout:
    """Shape-derived state of one forward call, shared by all blocks (built once, never per block)."""

    num_columns: int  # K
    batch: int  # Bc, items per column
    text_len: int  # L
    image_lengths: list[int]  # n_k: image tokens of column k (all clips)
    tail_lengths: list[int]  # m_k: image tokens of column k's last clip, the only ones the output reads
    # per column: [Bc, 1, L+n_k, R] additive (0 / MASKED), from padded_attention_bias
    attn_masks: list[torch.Tensor]
    attention_backend: str = "auto"  # the kernels that run the attention (:func:`attention_kernels`)
    rope: RotaryTable | None = None  # for the image tokens [N]
    joint_rope: RotaryTable | None = None  # for the [text_k; image_k] layout (text: identity)
    row_groups: list[list[RowGroup] | None] | None = None  # per column (:func:`causal_row_groups`), or None
    # under the ``flex`` backend: every column's attention in one call (then ``attn_masks`` is empty)
    packed: PackedColumns | None = None
    # the model attends long columns in row groups: this call's columns may all be too short to be grouped
    grouping: bool = False
    # per column, where the model groups: the row groups as one host table (:func:`group_table`; a column
    # without groups: one group), what an operator taking them as a tensor reads (pfctl.models.fast)
    group_tables: list[torch.Tensor] | None = field(init=False)

    def __post_init__(self) -> None:
        self.group_tables = None
        if self.grouping:
            row_groups = self.row_groups or [None] * self.num_columns
            self.group_tables = [
                group_table(groups or [RowGroup(0, self.text_len + n)], self.batch, self.text_len)
                for groups, n in zip(row_groups, self.image_lengths, strict=True)
            ]

    def attend(self, column: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:func:`masked_attention` of ``column`` ([text_k; image_k] tokens) with this call's mask, kernels and
        row groups."""
        groups = None if self.row_groups is None else self.row_groups[column]
        return masked_attention(q, k, v, self.attn_masks[column], self.attention_backend, groups)

    @property
    def joint_lengths(self) -> list[int]:
        return [self.text_len + n for n in self.image_lengths]


def column_tails(x: torch.Tensor, lengths: Sequence[int], tails: Sequence[int], dim: int = 1) -> torch.Tensor:
    """The last ``tails[k]`` entries along ``dim`` of each column's segment (``lengths[k]`` entries), in column
    order, contiguous (the products then see rows laid out as in every other block). Each column ends with
    its last clip, so with :attr:`PyramidLayout.tail_lengths` these are the rows of the clips being denoised:
    all the model's output reads of the last block, which computes only them (queries, feed-forward and
    residual; the keys and values still come from every row)."""
    if len(lengths) == 1:
        return x.narrow(dim, lengths[0] - tails[0], tails[0]).contiguous()
    segments = x.split(list(lengths), dim)
    return torch.cat(
        [seg.narrow(dim, n - m, m) for seg, n, m in zip(segments, lengths, tails, strict=True)], dim
    )


def tail_table(table: RotaryTable, lengths: Sequence[int], tails: Sequence[int]) -> RotaryTable:
    """The rows of a :class:`RotaryTable` (one per token) that :func:`column_tails` keeps."""
    return RotaryTable(
        *(column_tails(t, lengths, tails, dim=0) for t in (table.a, table.b, table.a_t, table.b_t))
    )


def group_table(groups: Sequence[RowGroup], batch: int, text_len: int) -> torch.Tensor:
    """Row groups as a host table ``[1 + G, 2 + batch]`` int64: a first row ``[text_len, text_len, -1, ...]``
    (an empty group: the column's text length, :func:`table_text_len`), then per group its start, end and each
    item's key start (``-1`` throughout for a group attended under the mask). At least two rows: a compiled
    block taking the table would specialise on a size of 1."""
    rows = [[text_len, text_len, *(-1,) * batch]]
    rows += [[g.start, g.end, *(g.key_starts or (-1,) * batch)] for g in groups]
    return torch.tensor(rows, dtype=torch.int64)


def table_text_len(table: torch.Tensor) -> int:
    """The text length a :func:`group_table` was built with."""
    return int(table[0, 0])


class PyramidAttention:
    """Mixin of both DiTs: the attention settings (kernels, row groups) and the per-forward masks, row groups
    and text alignment they imply. The model's config supplies ``use_temporal_causal``."""

    #: the attention kernels (:data:`ATTENTION_BACKENDS`), handed to the blocks in each forward's layout
    attention_backend: str = "auto"
    #: attend query-row groups against their causal key prefix only (:func:`causal_row_groups`)
    skip_future_keys: bool = False
    #: the shortest column attended in row groups (None: :data:`ROW_GROUP_MIN_TOKENS`)
    row_group_min_tokens: int | None = None
    #: the fewest rows a row group closes with (None: :data:`ROW_GROUP_MIN_ROWS`)
    row_group_min_rows: int | None = None

    def set_attention_backend(
        self,
        backend: str,
        skip_future_keys: bool = False,
        min_tokens: int | None = None,
        min_rows: int | None = None,
    ) -> None:
        """Run attention with ``backend``: ``auto`` (default), ``efficient``, ``cudnn`` or ``flex``
        (:func:`attention_kernels`); with ``skip_future_keys`` (temporal-causal models only, not ``flex``, which
        skips those keys by itself) in row groups that skip the keys causality hides (:func:`causal_row_groups`),
        for columns of ``min_tokens`` or more (None: :data:`ROW_GROUP_MIN_TOKENS`), each closing at ``min_rows``
        rows (None: :data:`ROW_GROUP_MIN_ROWS`; 1: one frame per group, every group without a mask). Same
        results up to float rounding either way."""
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unknown attention backend {backend!r}", hint=f"use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        for name, value, least, counted in (
            ("threshold", min_tokens, 0, "token"),
            ("minimum", min_rows, 1, "row"),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ConfigError(
                    f"row-group {name} {value!r} is not a {counted} count", hint=f"use an integer >= {least}"
                )
        self.attention_backend = backend
        self.skip_future_keys = bool(skip_future_keys)
        self.row_group_min_tokens = min_tokens
        self.row_group_min_rows = min_rows

    @property
    def row_groups_active(self) -> bool:
        """Row groups apply: asked for, temporal causality to exploit, and not the ``flex`` backend (whose
        block-sparse mask skips the hidden keys by itself)."""
        return self.skip_future_keys and self.config.use_temporal_causal and self.attention_backend != "flex"

    def packed_orders(self) -> tuple[str, ...]:
        """The token orders the blocks attend in under the ``flex`` backend (:class:`PackedColumns`): the
        double-stream blocks' by default."""
        return ("streams",)

    def attention_row_groups(
        self,
        text_len: int,
        grids: Sequence[Sequence[tuple[int, int, int]]],
        text_lengths: Sequence[int] | None,
    ) -> list[list[RowGroup] | None] | None:
        """The per-column row groups of one forward (None for a column shorter than the threshold,
        ``row_group_min_tokens`` or :data:`ROW_GROUP_MIN_TOKENS`: one masked call), or None (off, no temporal
        causality to exploit, or no column long enough). ``text_lengths`` (per text row, the text left-aligned
        by :meth:`align_text`) lets single-frame groups run without a mask."""
        if not self.row_groups_active:
            return None
        threshold = ROW_GROUP_MIN_TOKENS if self.row_group_min_tokens is None else self.row_group_min_tokens
        min_rows = ROW_GROUP_MIN_ROWS if self.row_group_min_rows is None else self.row_group_min_rows
        groups: list[list[RowGroup] | None] = []
        for k, col in enumerate(grids):
            starts = None
            if text_lengths is not None:  # rows are interleaved: item b of column k is row b*K + k
                starts = [text_len - n for n in text_lengths[k :: len(grids)]]
            groups.append(column_row_groups(text_len, col, starts, threshold, min_rows))
        return None if all(g is None for g in groups) else groups

    def attention_masks(
        self,
        text_valid: torch.Tensor,
        grids: Sequence[Sequence[tuple[int, int, int]]],
        frame_ids: Sequence[torch.Tensor],
        text_lengths: Sequence[int] | None,
        dtype: torch.dtype,
    ) -> tuple[list[torch.Tensor], list[list[RowGroup] | None] | None]:
        """The per-column masks (:func:`padded_attention_bias` of ``text_valid [K*Bc, L]`` and the columns'
        ``frame_ids`` (:func:`clip_frame_ids` of ``grids``), in ``dtype``) and row groups
        (:meth:`attention_row_groups`) of one forward: a grouped column's mask covers only what its masked
        groups read (:func:`mask_extents`)."""
        text_len = text_valid.shape[1]
        row_groups = self.attention_row_groups(text_len, grids, text_lengths)
        extents = mask_extents(row_groups, [text_len + ids.shape[0] for ids in frame_ids])
        temporal_causal = self.config.use_temporal_causal
        return padded_attention_bias(
            text_valid, frame_ids, len(grids), temporal_causal, dtype, extents
        ), row_groups

    def pyramid_layout(
        self,
        grids: Sequence[Sequence[tuple[int, int, int]]],
        text_valid: torch.Tensor,
        frame_ids: Sequence[torch.Tensor],
        batch: int,
        dtype: torch.dtype,
        text_lengths: Sequence[int] | None,
        rope: RotaryTable | None = None,
        joint_rope: RotaryTable | None = None,
    ) -> PyramidLayout:
        """The :class:`PyramidLayout` of one forward over the columns' clip ``grids`` ``(t, h, w)`` (tokens):
        token counts, masks in ``dtype`` and row groups (:meth:`attention_masks`), or under the ``flex``
        backend the packed columns' block-sparse masks (:func:`packed_columns`), and the model's RoPE
        tables."""
        tail_lengths = [t * h * w for t, h, w in (col[-1] for col in grids)]
        packed, attn_masks, row_groups = None, [], None
        if self.attention_backend == "flex":
            causal, orders = self.config.use_temporal_causal, self.packed_orders()
            packed = packed_columns(text_valid, frame_ids, len(grids), causal, orders, tail_lengths)
        else:
            attn_masks, row_groups = self.attention_masks(text_valid, grids, frame_ids, text_lengths, dtype)
        return PyramidLayout(
            num_columns=len(grids),
            batch=batch,
            text_len=text_valid.shape[1],
            image_lengths=[sum(t * h * w for t, h, w in col) for col in grids],
            tail_lengths=tail_lengths,
            attn_masks=attn_masks,
            attention_backend=self.attention_backend,
            rope=rope,
            joint_rope=joint_rope,
            row_groups=row_groups,
            grouping=self.row_groups_active,
            packed=packed,
        )

    def align_text(
        self,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        text_lengths: Sequence[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """With row groups on and the text rows' valid lengths known on the host (``text_lengths``, matching
        ``encoder_attention_mask``: :func:`right_padded_lengths`): the text cut and left-aligned by
        :func:`left_align_text` (to a multiple of :data:`CUDNN_TEXT_MULTIPLE` tokens under the ``cudnn``
        backend), and the lengths for :meth:`attention_row_groups`. Otherwise as given, and None."""
        if text_lengths is None or not self.row_groups_active:
            return encoder_hidden_states, encoder_attention_mask, None
        lengths = [int(n) for n in text_lengths]
        rows, width = encoder_attention_mask.shape
        if len(lengths) != rows or not all(0 <= n <= width for n in lengths):
            raise InputError(
                f"text_lengths {lengths} does not fit encoder_attention_mask {tuple(encoder_attention_mask.shape)}",
                hint="one valid-token count per text row, at most its length (right_padded_lengths(mask))",
            )
        if all(n == width for n in lengths):  # no padding: nothing to move
            return encoder_hidden_states, encoder_attention_mask, lengths
        multiple = CUDNN_TEXT_MULTIPLE if self.attention_backend == "cudnn" else 1
        return (*left_align_text(encoder_hidden_states, encoder_attention_mask, lengths, multiple), lengths)
