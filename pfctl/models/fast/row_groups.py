"""Row-group attention for compiled blocks: one operator, opaque to the compiler, with its own backward.

A compiled block must trace neither the row groups nor their calls: it would guard on the group layout,
which changes every sampler stage and training step. :class:`CompiledRowGroups` (swapped into the attention
modules with ``compile``) sends a grouped column to the :func:`row_group_attention` operator, which takes
the groups as a host table, so a block stays one graph. With gradients (training) every column of a model
with row groups on goes through it, grouped in this call or not (one group: the one masked call), so the
block's graph does not change with the step's layout. Its backward (:func:`row_group_attention_backward`)
attends the groups again with autograd and returns their gradients: one more attention forward per call,
for a block graph without a break. The results are those of
:meth:`pfctl.models.attention_layout.PyramidLayout.attend`.
"""

from __future__ import annotations

import torch

from pfctl.models.attention_layout import PyramidLayout, RowGroup, masked_attention

__all__ = ["CompiledRowGroups", "row_group_attention", "row_group_attention_backward", "table_groups"]


def table_groups(table: torch.Tensor) -> list[RowGroup]:
    """The row groups of a :func:`group_table` (its empty ones left out)."""
    return [RowGroup(a, b, None if ks[0] < 0 else tuple(ks)) for a, b, *ks in table.tolist() if a < b]


@torch.library.custom_op("pfctl::row_group_attention", mutates_args=())
def row_group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> torch.Tensor:
    """:func:`masked_attention` in the row groups of ``groups`` (a :func:`group_table`), as one operator:
    ``q, k, v [B, S, H, hd]`` -> ``[B, S, H*hd]`` (differentiable in ``q, k, v``)."""
    return masked_attention(q, k, v, mask, backend, table_groups(groups))


@row_group_attention.register_fake
def _row_group_attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])


@torch.library.custom_op("pfctl::row_group_attention_backward", mutates_args=())
def row_group_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    groups: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`row_group_attention` for ``q, k, v`` (contiguous, their shapes): the groups
    attended again under ``torch.func.vjp`` (the dispatcher runs an operator's kernel below autograd; the
    transform differentiates there), the same kernels and calls as the forward."""
    row_groups = table_groups(groups)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return masked_attention(q, k, v, mask, backend, row_groups)

    _, pullback = torch.func.vjp(attend, q, k, v)
    return tuple(g.contiguous() for g in pullback(grad))


@row_group_attention_backward.register_fake
def _row_group_attention_backward_shape(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *layout: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _keep_inputs(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    q, k, v, mask, groups, backend = inputs
    ctx.save_for_backward(q, k, v, mask, groups)
    ctx.backend = backend


def _row_group_attention_grad(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, mask, groups = ctx.saved_tensors
    dq, dk, dv = torch.ops.pfctl.row_group_attention_backward(grad, q, k, v, mask, groups, ctx.backend)
    return dq, dk, dv, None, None, None


row_group_attention.register_autograd(_row_group_attention_grad, setup_context=_keep_inputs)


class CompiledRowGroups:
    """Mixin of the attention modules of compiled blocks: row groups as one operator in the compiled graph."""

    def attend(
        self, layout: PyramidLayout, column: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if (layout.grouping and torch.is_grad_enabled()) or layout.grouped:  # training reads no `grouped`
            mask, table = layout.attn_masks[column], layout.group_tables[column]
            return torch.ops.pfctl.row_group_attention(q, k, v, mask, table, layout.attention_backend)
        return super().attend(layout, column, q, k, v)
