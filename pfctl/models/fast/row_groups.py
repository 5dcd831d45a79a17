"""Row-group attention for compiled blocks: one opaque operator, or an eager island.

A compiled block must trace neither the row groups nor their calls: it would guard on the group layout,
which changes every sampler stage and training step. :class:`CompiledRowGroups` (swapped into the attention
modules with ``compile``) sends a grouped column without gradients to the :func:`row_group_attention`
operator, opaque to the compiler, so a block stays one graph; with gradients every column of a model with
row groups on, grouped in this call or not, to :func:`_attend_in_row_groups`, run eagerly (a graph break).
The results are those of :meth:`pfctl.models.attention_layout.PyramidLayout.attend`.
"""

from __future__ import annotations

import torch

from pfctl.models.attention_layout import PyramidLayout, RowGroup, masked_attention

__all__ = ["CompiledRowGroups", "row_group_attention", "table_groups"]


def table_groups(table: torch.Tensor) -> list[RowGroup]:
    """The row groups of a :func:`group_table`."""
    return [RowGroup(a, b, None if ks[0] < 0 else tuple(ks)) for a, b, *ks in table.tolist()]


@torch.library.custom_op("pfctl::row_group_attention", mutates_args=())
def row_group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> torch.Tensor:
    """:func:`masked_attention` in the row groups of ``groups`` (a :func:`group_table`), as one operator:
    ``q, k, v [B, S, H, hd]`` -> ``[B, S, H*hd]``. No gradient (the sampler's path)."""
    return masked_attention(q, k, v, mask, backend, table_groups(groups))


@row_group_attention.register_fake
def _row_group_attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])


@torch.compiler.disable
def _attend_in_row_groups(
    layout: PyramidLayout, column: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """:meth:`PyramidLayout.attend` with gradients (training) in a model with row groups on, run eagerly
    inside compiled blocks (their graph breaks here), whether or not this call's columns are long enough to
    be grouped. The layout goes in whole: compiled code never reads the groups, the masks or the column
    index, so it holds no guard on them and a new group layout or column (every training step) recompiles
    nothing."""
    return layout.attend(column, q, k, v)


class CompiledRowGroups:
    """Mixin of the attention modules of compiled blocks: row groups outside the compiled graph."""

    def attend(
        self, layout: PyramidLayout, column: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if layout.grouping and torch.is_grad_enabled():
            return _attend_in_row_groups(layout, column, q, k, v)
        if not layout.grouped:
            return super().attend(layout, column, q, k, v)
        mask, table = layout.attn_masks[column], layout.group_tables[column]
        return torch.ops.pfctl.row_group_attention(q, k, v, mask, table, layout.attention_backend)
