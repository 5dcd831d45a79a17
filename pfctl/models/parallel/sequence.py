"""Ulysses sequence parallel: the ranks of a sequence group split each attention's tokens and heads.

Put on a built DiT by :func:`apply_sequence_parallel` (class swaps in place, as :mod:`pfctl.models.fast`
does: the same modules, parameters and state-dict keys). Every rank of the group holds the residual stream;
in each attention:

* the q/k/v projections (image and text side) run on this rank's share of the tokens (``ceil(S/P)``
  rows, the last share padded), then an all-to-all over heads gives every rank *all* tokens of ``H/P`` heads;
* the per-head q/k norm, RoPE and the masked attention run unchanged on those heads: every query sees every
  key it saw before, under the same temporal-causal mask and row groups, so the result is exact;
* an all-to-all back gives each rank its tokens with all heads, the output projection runs on them and an
  all-gather rebuilds the full stream (the miniFLUX single-stream attention has no output projection of its
  own: its heads are all-gathered).

The heads must divide by the group size (:func:`pfctl.models.parallel.plan.check_heads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pfctl.models.parallel.groups import Group
from pfctl.models.parallel.plan import check_heads

__all__ = ["apply_sequence_parallel"]


def _padded(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, int]:
    """``x [B, S, F]`` padded with zero rows to a multiple of ``parts``; and ``m`` = rows per part."""
    m = -(-x.shape[1] // parts)
    pad = m * parts - x.shape[1]
    return (F.pad(x, (0, 0, 0, pad)) if pad else x), m


class UlyssesIn:
    """A q/k/v projection on this rank's tokens, all-to-all to all tokens of this rank's heads."""

    ulysses: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, seq = self.ulysses, x.shape[1]
        p = group.size
        x, m = _padded(x, p)
        y = F.linear(x[:, group.rank * m : (group.rank + 1) * m], self.weight, self.bias)  # [B, m, F]
        y = y.unflatten(-1, (p, -1)).permute(2, 0, 1, 3)  # [P, B, m, F/P]: part j = head group j
        y = group.all_to_all(y)  # part i = rank i's tokens of this rank's heads
        return y.permute(1, 0, 2, 3).flatten(1, 2)[:, :seq]  # [B, S, F/P]


class UlyssesOut:
    """An output projection on all tokens of this rank's heads: all-to-all to this rank's tokens of all
    heads, the projection, an all-gather of the tokens."""

    ulysses: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, seq = self.ulysses, x.shape[1]
        x, m = _padded(x, group.size)
        parts = x.unflatten(1, (group.size, m)).permute(
            1, 0, 2, 3
        )  # [P, B, m, F/P]: part j = rank j's tokens
        mine = group.all_to_all(parts).permute(1, 2, 0, 3).flatten(2)  # [B, m, F], heads in order
        y = F.linear(mine, self.weight, self.bias)
        return torch.cat(group.all_gather(y), dim=1)[:, :seq]


class GatherHeads:
    """An attention without its own output projection: its heads all-gathered (``[B, S, H*hd]``)."""

    ulysses: Group

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        return torch.cat(self.ulysses.all_gather(out), dim=-1)


def _swap(module: nn.Module, mixin: type, group: Group) -> None:
    from pfctl.models.fast import swap_class

    swap_class(module, mixin)
    module.ulysses = group


def apply_sequence_parallel(dit: nn.Module, group: Group) -> int:
    """Split every attention of ``dit`` (either DiT) over ``group``; returns the attentions changed. Refuses
    (:class:`~pfctl.errors.ConfigError`) when the heads do not divide by the group size."""
    from pfctl.models.dit_flux import FluxSingleAttention
    from pfctl.models.dit_layers import DualStreamAttention

    if group.size == 1:
        return 0
    attentions = [m for m in dit.modules() if isinstance(m, (DualStreamAttention, FluxSingleAttention))]
    for attn in attentions:
        check_heads(attn.heads, group.size)
    for attn in attentions:
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            if hasattr(attn, name):
                _swap(getattr(attn, name), UlyssesIn, group)
        if isinstance(attn, DualStreamAttention):
            _swap(attn.to_out[0], UlyssesOut, group)
            if not attn.context_pre_only:
                _swap(attn.to_add_out, UlyssesOut, group)
        else:
            _swap(attn, GatherHeads, group)
        attn.heads //= group.size
    return len(attentions)
