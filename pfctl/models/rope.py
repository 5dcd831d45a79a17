"""Rotary position embedding (RoPE) of the pyramid DiTs: tables per token and the rotation of channel pairs.

Axis ``a`` of a position uses frequencies ``theta ** (-2i / d_a)``; the angles are evaluated in float64 and
rounded to float32 as the reference does, and each channel pair ``(x[2i], x[2i+1])`` of a query or key head
is rotated by its token's angle: ``(c*x0 - s*x1, s*x0 + c*x1)``, computed in float32 and rounded once to the
input's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pfctl.errors import ConfigError

ROPE_THETA = 10000


def rope_tables(
    positions: torch.Tensor, axes_dims: Sequence[int], theta: int = ROPE_THETA
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions ``[S, A]`` (one column per axis) -> ``(cos, sin)``, each ``[S, sum(d)/2]``.

    Axis ``a`` uses frequencies ``theta ** (-2i / d_a)``; angles are evaluated in float64 and rounded to float32
    (as the reference does), axes are concatenated in order.
    """
    cos, sin = [], []
    for a, d in enumerate(axes_dims):
        if d % 2:
            raise ConfigError(f"RoPE axis dims must be even, got {list(axes_dims)}", hint="e.g. [16, 24, 24]")
        omega = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d))
        angles = positions[:, a].double()[:, None] * omega[None, :]  # [S, d/2]
        cos.append(torch.cos(angles).float())
        sin.append(torch.sin(angles).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


@dataclass(frozen=True)
class RotaryTable:
    """A rotation of channel pairs written as two broadcast products, each ``[S, 1, hd/2, 2]`` float32:
    ``out[..., i, :] = x[..., i, 0] * a[i] + x[..., i, 1] * b[i]``.

    Forward ``a = (cos, sin)``, ``b = (-sin, cos)``: ``(c*x0 - s*x1, s*x0 + c*x1)``, the reference's products and
    sums (``x1 * -s`` is exactly ``-(s * x1)``), so results are bit-identical to it. ``a_t``/``b_t`` are the
    transpose (rotation by minus the angle), which is the backward: ``(c*g0 + s*g1, -s*g0 + c*g1)``.
    """

    a: torch.Tensor
    b: torch.Tensor
    a_t: torch.Tensor
    b_t: torch.Tensor


def rotary_table(cos: torch.Tensor, sin: torch.Tensor) -> RotaryTable:
    """:class:`RotaryTable` of ``(cos, sin)`` tables ``[S, hd/2]`` (built once per forward, shared by blocks)."""
    c, s = cos[:, None], sin[:, None]  # [S, 1, hd/2]: broadcast over heads
    neg_s = -s
    return RotaryTable(
        a=torch.stack([c, s], dim=-1),
        b=torch.stack([neg_s, c], dim=-1),
        a_t=torch.stack([c, neg_s], dim=-1),
        b_t=torch.stack([s, c], dim=-1),
    )


def apply_rope(x: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Rotate adjacent channel pairs ``(x[2i], x[2i+1])`` of ``x [B, S, H, hd]`` by the table (``S`` rows):
    ``x0 * a + x1 * b`` per pair, in float32 (the products read ``x`` in its own dtype), rounded once to
    ``x``'s dtype."""
    pairs = x.unflatten(-1, (-1, 2))  # [B, S, H, hd/2, 2]
    return (pairs[..., :1] * table.a + pairs[..., 1:] * table.b).to(x.dtype).flatten(-2)


def with_text_identity(
    cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int], text_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for the single-stream layout ``[text_0; image_0; text_1; image_1; ...]``.

    Text tokens sit at position 0 on every axis, i.e. the identity rotation (cos 1, sin 0).
    """
    ones = cos.new_ones(text_len, cos.shape[-1])
    zeros = sin.new_zeros(text_len, sin.shape[-1])
    cos_parts, sin_parts = [], []
    for c, s in zip(cos.split(list(lengths), 0), sin.split(list(lengths), 0), strict=True):
        cos_parts += [ones, c]
        sin_parts += [zeros, s]
    return torch.cat(cos_parts, 0), torch.cat(sin_parts, 0)
