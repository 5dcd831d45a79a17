"""Pieces shared by the two pyramid DiTs (miniFLUX in ``dit_flux``, SD3-style MMDiT in ``dit_mmdit``).

Both models take the same input: a list of *columns* (one per pyramid stage present in the batch), each a
list of clips ``[Bc, C, t, h, w]`` ordered oldest history first, the clip being denoised last. Text rows are
interleaved: row ``r = b*K + k`` belongs to column ``k``, item ``b``. Inside the network

* image tokens of all columns are concatenated along the token axis (``[Bc, N, D]``, ``N = sum n_k``);
* AdaLN modulation is per column (the timestep/pooled text of rows ``k::K``);
* attention is per column, over ``[text_k ; image_k]``, with one boolean mask per column that encodes
  text padding (padding only sees padding) and, optionally, temporal causality (a query at frame ``f``
  sees keys at frames ``<= f``; text counts as frame 0).

Everything that depends only on shapes (token counts, RoPE tables, attention masks) is computed once per
forward in a :class:`PyramidLayout` and handed to every block, so no block rebuilds them.

Attention is SDPA with an additive mask; :data:`ATTENTION_BACKENDS` say which fused kernel runs it
(:func:`attention_kernels`): PyTorch's choice, the memory-efficient kernel, or cuDNN's.

Numerics follow the reference implementation exactly in float32 (same op order), so the parity vectors match
to ~1e-7; nothing here reads the environment or touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from pfctl.errors import ConfigError, InputError
from pfctl.models import fused_linear, fused_qk

logger = logging.getLogger(__name__)

#: attention kernels of the DiTs (:meth:`BlockCheckpointing.set_attention_backend`, :func:`attention_kernels`)
ATTENTION_BACKENDS = ("auto", "efficient", "cudnn")

ROPE_THETA = 10000
TIMESTEP_FREQ_DIM = 256
#: Additive attention mask value of a masked key: the finite value SDPA's cuDNN path itself substitutes for a
#: boolean False (cuDNN mishandles -inf). With it every backend matches a boolean mask bit for bit: next to
#: any allowed key (every row has one, the diagonal) exp(score - 65504 - max) underflows to exactly 0.
MASKED = -65504.0


# ----------------------------------------------------------------------------------------------------------
# Timestep / pooled-text conditioning
# ----------------------------------------------------------------------------------------------------------


def timestep_embedding(
    timesteps: torch.Tensor, dim: int = TIMESTEP_FREQ_DIM, max_period: int = 10000
) -> torch.Tensor:
    """Sinusoidal features of (possibly fractional) timesteps on the 0..1000 scale, ``[R] -> [R, dim]``.

    Layout is ``[cos, sin]`` with frequencies ``exp(-ln(max_period) * i / (dim/2))`` (DDPM-style with
    ``flip_sin_to_cos=True`` and no frequency shift), computed in float32 whatever the input dtype.
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    args = timesteps[:, None].float() * torch.exp(exponent)[None, :]  # [R, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    """``linear_1 -> SiLU -> linear_2``; the key names match the reference checkpoints."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class TimestepTextEmbedding(nn.Module):
    """The conditioning vector ``temb = MLP(timestep features) + MLP(pooled text)``, one row per batch row."""

    def __init__(self, dim: int, pooled_projection_dim: int) -> None:
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIMESTEP_FREQ_DIM, dim)
        self.text_embedder = MLPEmbedder(pooled_projection_dim, dim)

    def forward(self, timestep: torch.Tensor, pooled_projection: torch.Tensor) -> torch.Tensor:
        freqs = timestep_embedding(timestep).to(dtype=pooled_projection.dtype)  # [R, 256]
        return self.timestep_embedder(freqs) + self.text_embedder(pooled_projection)  # [R, D]


# ----------------------------------------------------------------------------------------------------------
# Norms, modulation, feed-forward
# ----------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMS norm over the last axis with a learned scale; statistics in float32, output in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def _normalized(x: torch.Tensor, rstd: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """``x * rstd`` in float32, rounded to a half-precision weight's dtype (the reference multiplies in it)."""
    if weight_dtype in (torch.float16, torch.bfloat16):
        return torch.mul(x, rstd, out=torch.empty_like(x, dtype=weight_dtype))
    return x * rstd


class _RMSNormFunction(torch.autograd.Function):
    """The reference's RMS norm, ``(x * rsqrt(mean(float(x)^2) + eps) [-> weight dtype] * weight) -> x dtype``,
    with the same ops and rounding steps, in fewer kernels and with less kept for backward.

    Forward: the final cast is folded into the last product (``out=`` rounds once, as ``.to`` did). Backward
    forms the same products and sums autograd forms for that graph (``2 * g_mean * x`` as ``(2 * g_mean) * x``:
    scaling by 2 is exact), but keeps only ``x`` and ``rstd`` -- autograd also kept the float32 upcast of a
    half-precision ``x`` and, when the weight trains, the float32 normalised values -- and skips autograd's
    casts, its ``pow(x, 1)`` copy and its full-size division.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        rstd = x.float().pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1] float32
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(_normalized(x, rstd, weight.dtype), weight, out=torch.empty_like(x))

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        if weight.dtype in (torch.float16, torch.bfloat16):
            grad = grad.to(weight.dtype)  # the product with the weight ran in its dtype (a no-op for bf16 x)
        grad_weight = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * _normalized(x, rstd, weight.dtype)).sum_to_size(weight.shape)
        if ctx.needs_input_grad[0]:
            # gradient of the float32 normalised values (rounded in the weight dtype first when it is half)
            grad_y = torch.mul(grad, weight, out=torch.empty_like(x, dtype=torch.float32))
            grad_var = (grad_y * x).sum(-1, keepdim=True).mul(-0.5) * rstd.pow(3)  # through rsqrt
            grad_x = torch.mul(grad_y, rstd, out=torch.empty_like(x))
            grad_x += torch.mul(grad_var.div(x.shape[-1]).mul(2.0), x, out=torch.empty_like(x))  # mean(x^2)
        return grad_x, grad_weight, None


def make_qk_norm(kind: str | None, head_dim: int, eps: float) -> nn.Module | None:
    """Per-head query/key norm: ``"rms_norm"``, ``"layer_norm"`` or ``None``."""
    if kind is None:
        return None
    if kind == "rms_norm":
        return RMSNorm(head_dim, eps=eps)
    if kind == "layer_norm":
        return nn.LayerNorm(head_dim, eps=eps)
    raise ConfigError(
        f"qk_norm={kind!r} is not supported",
        hint="use 'rms_norm' (the released models), 'layer_norm' or null",
    )


def layer_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Parameter-free LayerNorm over the last axis (every AdaLN in these models uses this form)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


class AdaLNZero(nn.Module):
    """``SiLU -> linear`` producing ``n_chunks`` modulation vectors per batch row.

    Only the projection lives here; the norm itself is parameter-free (:func:`layer_norm`). Chunk order is the
    reference's: 6 chunks = (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp), 3 chunks =
    (shift, scale, gate).
    """

    def __init__(self, dim: int, n_chunks: int) -> None:
        super().__init__()
        self.n_chunks = n_chunks
        self.linear = nn.Linear(dim, n_chunks * dim)

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(temb)).chunk(self.n_chunks, dim=-1)  # n x [R, D]


class AdaLNContinuous(nn.Module):
    """Final-layer style AdaLN: ``SiLU -> linear`` giving (scale, shift) -- note: scale first."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, temb: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        scale, shift = self.linear(F.silu(temb).to(dtype)).chunk(2, dim=-1)  # 2 x [R, D]
        return scale, shift


class GELUProj(nn.Module):
    """Linear followed by tanh-approximated GELU (key ``proj``); one fused product on CUDA inference
    (:func:`pfctl.models.fused_linear.linear_gelu`)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_linear.linear_gelu(self.proj, x)


class FeedForward(nn.Module):
    """Transformer MLP ``dim -> 4*dim -> dim``; keys ``net.0.proj`` and ``net.2`` as in the checkpoints."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, dim * mult), nn.Dropout(0.0), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


def by_column(rows: torch.Tensor, num_columns: int) -> torch.Tensor:
    """``[K*Bc, ...]`` interleaved rows (r = b*K + k) -> ``[Bc, K, ...]``."""
    return rows.view(rows.shape[0] // num_columns, num_columns, *rows.shape[1:])


def modulate_columns(
    x: torch.Tensor, lengths: Sequence[int], shift: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``x * (1 + scale_k) + shift_k`` on the token segment of each column.

    ``x`` is ``[Bc, sum(lengths), D]``; ``shift``/``scale`` are ``[Bc, K, D]``. Applied per segment with
    broadcasting (instead of expanding the modulation to every token) so autograd keeps only ``[Bc, K, D]``;
    ``1 + scale`` is one op on that small tensor for all columns.
    """
    return _affine_columns(x, list(lengths), 1 + scale, shift, None)


def gated_residual(
    residual: torch.Tensor, x: torch.Tensor, lengths: Sequence[int], gate: torch.Tensor
) -> torch.Tensor:
    """``residual + gate_k * x`` on the token segment of each column (``gate``: ``[Bc, K, D]``)."""
    return _affine_columns(x, list(lengths), gate, None, residual)


def _affine_columns(
    x: torch.Tensor,
    lengths: list[int],
    scale: torch.Tensor,
    shift: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """``(x_k * scale_k [+ shift_k]) [+ residual]``: :class:`_ColumnAffine` in eager mode. Under torch.compile
    the plain per-column form, which inductor fuses anyway (dynamo cannot trace ``out=`` into the strided
    column slices the eager version writes)."""
    if not torch.compiler.is_compiling():
        return _ColumnAffine.apply(x, lengths, scale, shift, residual)
    shifts = [None] * len(lengths) if shift is None else _column_rows(shift)
    parts = [
        x_k * s_k if b_k is None else x_k * s_k + b_k
        for x_k, s_k, b_k in zip(x.split(lengths, 1), _column_rows(scale), shifts, strict=True)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out if residual is None else residual + out


def _column_rows(m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[Bc, K, D]`` -> K views ``[Bc, 1, D]`` (one per column, broadcast over its tokens)."""
    return m[:, :, None].unbind(1)


def _column_sums(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per column the sum over its tokens, ``K x [Bc, n_k, D] -> [Bc, K, D]``, then cast to ``dtype`` (how
    autograd reduces the gradient of a broadcast ``[Bc, 1, D]`` operand and casts it to the operand's dtype)."""
    sums = [p.sum(1, keepdim=True) for p in parts]
    return (sums[0] if len(sums) == 1 else torch.cat(sums, dim=1)).to(dtype)


class _ColumnAffine(torch.autograd.Function):
    """``out_k = (x_k * scale_k [+ shift_k]) [+ residual_k]`` for the token segments ``x_k`` of the columns.

    The same products and sums, in the same order and dtypes, as ``cat([x_k * s_k + b_k]) + residual`` under
    autograd (each intermediate rounded to its own promoted dtype, each gradient cast back through that
    chain), but every column is written straight into one output and its gradient straight into one
    gradient tensor: no ``cat`` reassembling the segments in the forward, none for ``x``'s gradient in the
    backward, and one cast for all columns' modulation gradients instead of one per column.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        lengths: list[int],
        scale: torch.Tensor,
        shift: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        product_dtype = torch.promote_types(x.dtype, scale.dtype)
        sum_dtype = product_dtype if shift is None else torch.promote_types(product_dtype, shift.dtype)
        out_dtype = sum_dtype if residual is None else torch.promote_types(sum_dtype, residual.dtype)
        out = x.new_empty(x.shape, dtype=out_dtype)
        shifts = [None] * len(lengths) if shift is None else _column_rows(shift)
        for x_k, out_k, s_k, b_k in zip(
            x.split(lengths, 1), out.split(lengths, 1), _column_rows(scale), shifts, strict=True
        ):
            torch.mul(x_k, s_k, out=out_k)  # computed (and rounded) in the inputs' dtype, then stored
            if b_k is not None:
                out_k.add_(b_k)
        if residual is not None:
            out.add_(residual)
        ctx.lengths, ctx.x_dtype = lengths, x.dtype
        ctx.dtypes = (product_dtype, sum_dtype, None if shift is None else shift.dtype)
        # like autograd's product: keep each factor only for the other's gradient (a frozen modulation, e.g.
        # under LoRA, keeps no full-size x)
        ctx.save_for_backward(
            x if ctx.needs_input_grad[2] else None, scale if ctx.needs_input_grad[0] else None
        )
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, scale = ctx.saved_tensors
        product_dtype, sum_dtype, shift_dtype = ctx.dtypes
        grad_residual = grad if ctx.needs_input_grad[4] else None
        grad_sum = grad.to(sum_dtype)  # no-ops (no kernel) unless the residual stream is wider
        grads = grad_sum.to(product_dtype).split(ctx.lengths, 1)
        grad_x = grad_scale = grad_shift = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.new_empty(grad.shape, dtype=ctx.x_dtype)
            for g_k, s_k, out_k in zip(grads, _column_rows(scale), grad_x.split(ctx.lengths, 1), strict=True):
                torch.mul(g_k, s_k, out=out_k)
        if ctx.needs_input_grad[2]:
            products = [g_k * x_k for g_k, x_k in zip(grads, x.split(ctx.lengths, 1), strict=True)]
            grad_scale = _column_sums(products, scale.dtype)
        if ctx.needs_input_grad[3]:
            grad_shift = _column_sums(grad_sum.split(ctx.lengths, 1), shift_dtype)
        return grad_x, None, grad_scale, grad_shift, grad_residual


# ----------------------------------------------------------------------------------------------------------
# Positions, RoPE and masks
# ----------------------------------------------------------------------------------------------------------


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


def _rotate_pairs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, hd]`` -> ``x0 * a + x1 * b`` per channel pair, in float32, rounded once to ``x``'s dtype.

    Three kernels: the mixed-dtype products read ``x`` in its own dtype and compute in float32 (no upcast
    copy), and ``add(out=)`` rounds the float32 sum straight into the output (no separate cast).
    """
    pairs = x.unflatten(-1, (-1, 2))  # [B, S, H, hd/2, 2]
    out = torch.empty_like(pairs)
    return torch.add(pairs[..., :1] * a, pairs[..., 1:] * b, out=out).flatten(-2)


class _Rotary(torch.autograd.Function):
    """RoPE with a hand-written backward: the gradient of a rotation is the transposed rotation (3 kernels),
    where autograd would run the backward of every op of the forward (~14 kernels, with full-size zero-fills)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        a_t: torch.Tensor,
        b_t: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(a_t, b_t)
        return _rotate_pairs(x, a, b)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        a_t, b_t = ctx.saved_tensors
        return _rotate_pairs(grad, a_t, b_t), None, None, None, None


def apply_rope(x: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Rotate adjacent channel pairs ``(x[2i], x[2i+1])`` of ``x [B, S, H, hd]`` by the table (``S`` rows).

    Computed in float32 and returned in ``x``'s dtype (bf16 friendly); the gradient is exact too: the same
    products and sums autograd would form for ``(c*x0 - s*x1, s*x0 + c*x1)``.
    """
    return _Rotary.apply(x, table.a, table.b, table.a_t, table.b_t)


def norm_rope(x: torch.Tensor, norm: nn.Module | None, table: RotaryTable | None) -> torch.Tensor:
    """``apply_rope(norm(x), table)`` for q or k ``[B, S, H, hd]`` (no norm when ``norm`` is None, no rotation
    when ``table`` is None): one Triton kernel for an :class:`RMSNorm` and a rotation where
    :func:`pfctl.models.fused_qk.applies` (CUDA inference), the PyTorch ops otherwise."""
    if table is not None and isinstance(norm, RMSNorm) and fused_qk.applies(x, norm.weight):
        return torch.ops.pfctl.rms_norm_rope(x, norm.weight, table.a, table.b, norm.eps)
    if norm is not None:
        x = norm(x)
    return x if table is None else apply_rope(x, table)


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
    in row groups reads (a large 768p sampling call's mask is then ~1/15 of the full one, whose building
    took 2.3 ms of the call's 180.8 on an H200).

    The DiT layouts hold these and slice them inside the blocks (:func:`masked_attention`): a block compiled
    with dynamic shapes then sees one contiguous input of two free sizes for every token count, where the
    strided views would give it a new stride pattern to specialise on whenever ``S`` is or is not a
    multiple of 8. Measured on the CPU (tiny preset, 24 trainer steps, compiled blocks): 13 graphs for the
    2 block types with the views, 3 with these and ``compile_blocks(independent_sizes=True)``."""
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
    valid_cols = by_column(text_valid, num_columns)  # [Bc, K, L]
    bc, text_len = valid_cols.shape[0], valid_cols.shape[2]
    rules = []
    for k, frames in enumerate(frame_ids):
        valid = torch.cat([valid_cols[:, k], valid_cols.new_ones(bc, frames.shape[0])], dim=1)  # [Bc, S]
        order = torch.cat([frames.new_zeros(text_len), frames])  # [S]: text is frame 0
        rules.append((bc, valid.shape[1], _visibility_rule(valid, order, temporal_causal)))
    return rules


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
    hd]`` (positions ``first..S-1``), ``k, v [B, H, S, hd]`` -> ``[B, Sq, H, hd]``, each group's result written
    straight into its rows (a group's rows before ``first`` are not computed). Exact: every key at or after
    ``b`` is masked for every row of the group, so it adds exactly 0. A group with ``key_starts`` needs no mask
    at all: item ``i`` attends keys ``[key_starts[i], b)``, every one visible to every row (one call per run of
    items with the same start)."""
    out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    with attention_kernels(backend):
        for a, b, key_starts in row_groups:
            if b <= first:
                continue
            a = max(a, first)
            rows = slice(a - first, b - first)  # of q and out
            if key_starts is None:
                result = F.scaled_dot_product_attention(
                    q[:, :, rows], k[:, :, :b], v[:, :, :b], attn_mask=mask[..., a:b, :b]
                )
                out[:, rows] = result.transpose(1, 2)
                continue
            item = 0
            for start, run in itertools.groupby(key_starts):
                items = slice(item, item + len(list(run)))
                result = F.scaled_dot_product_attention(
                    q[items, :, rows], k[items, :, start:b], v[items, :, start:b]
                )
                out[items, rows] = result.transpose(1, 2)
                item = items.stop
    return out


#: the fewest query rows a group of :func:`causal_row_groups` closes with (whole frames are added until it has
#: them; a frame that large is a group of its own). Measured on an H200 over every call of a video
#: (benchmarks/bench_video_attention.py, CUDA graphs, every column grouped): 512 rows against 1,024 took the
#: attention from 13.7 to 13.0 s at 768p and from 1.68 to 1.48 s at 384p; 128 and 2,048 were slower
ROW_GROUP_MIN_ROWS = 512
#: the shortest column (text + image tokens) attended in row groups when the model is not told otherwise
#: (``set_attention_backend(min_tokens=)``; generate passes 0: every column). Training keeps this: its grouped
#: steps measured slower, host-bound (benchmarks/RESULTS.md, session 8)
ROW_GROUP_MIN_TOKENS = 6144


class RowGroup(NamedTuple):
    """Query rows ``[start, end)`` of one column, attended against keys ``[0, end)`` under the column's mask;
    or, with ``key_starts`` (one per item), against keys ``[key_starts[i], end)`` with no mask: the rows are one
    frame's image tokens and every one of those keys is visible to all of them."""

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
    :func:`left_align_text` leaves it) marks the groups of a single frame after the first as needing no mask:
    their rows see every key from the item's valid text to the frame's end, and nothing else."""
    frames = [h * w for t, h, w in clip_grids for _ in range(t)]
    groups: list[RowGroup] = []
    start, end, count = 0, text_len, 0  # the open group: rows [start, end), ``count`` frames

    def close() -> None:
        nonlocal start, count
        plain = key_starts is not None and count == 1 and start >= text_len
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
    return [
        size if groups is None else max((g.end for g in groups if g.key_starts is None), default=0)
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
    encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor, text_lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text rows ``[R, L, ...]`` whose first ``text_lengths[r]`` tokens are valid, cut to the longest valid
    length (the padding every row has) and rotated so each row's valid tokens end it.

    Exact for everything the DiT returns: padding tokens only ever attend each other and every text token
    sits at RoPE position 0, so moving text tokens and dropping the padding all rows share change no image
    token."""
    width = max(1, *text_lengths)

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
      every step (measured on an H200: 3.2x slower training steps with cuDNN allowed).
    * ``cudnn``: cuDNN's kernel first, the others where it cannot run a call (the CPU, unsupported shapes).

    Entered around each call, so gradient checkpointing's recomputation uses the kernel the forward used;
    torch.compile traces it without a graph break."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    others = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if backend == "efficient":
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
    grouped: bool = field(init=False)  # row_groups is set (a flag compiled blocks can branch on, see attend)

    # per column: the row groups as :func:`row_group_attention` takes them (a column without groups: one group)
    group_tables: list[torch.Tensor] | None = field(init=False)

    def __post_init__(self) -> None:
        self.grouped = self.row_groups is not None
        self.group_tables = None
        if self.row_groups is not None:
            self.group_tables = [
                group_table(groups or [RowGroup(0, self.text_len + n)], self.batch)
                for groups, n in zip(self.row_groups, self.image_lengths, strict=True)
            ]

    def attend(self, column: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:func:`masked_attention` of ``column`` ([text_k; image_k] tokens) with this call's mask and kernels.

        In row groups, compiled blocks trace neither the groups nor their calls (they would guard on the group
        layout, which changes every sampler stage and training step): without gradients the groups go to the
        :func:`row_group_attention` operator, opaque to the compiler, so a block stays one graph; with
        gradients to :func:`_attend_in_row_groups`, run eagerly (a graph break)."""
        if not self.grouped:
            return masked_attention(q, k, v, self.attn_masks[column], self.attention_backend)
        if torch.is_grad_enabled():
            return _attend_in_row_groups(self, column, q, k, v)
        mask, table = self.attn_masks[column], self.group_tables[column]
        return torch.ops.pfctl.row_group_attention(q, k, v, mask, table, self.attention_backend)

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


def group_table(groups: Sequence[RowGroup], batch: int) -> torch.Tensor:
    """Row groups as a host table ``[G, 2 + batch]`` int64: start, end, then each item's key start (``-1``
    throughout for a group attended under the mask)."""
    rows = [[g.start, g.end, *(g.key_starts or (-1,) * batch)] for g in groups]
    return torch.tensor(rows, dtype=torch.int64)


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
    """:meth:`PyramidLayout.attend` in row groups with gradients (training), run eagerly inside compiled
    blocks (their graph breaks here). The layout goes in whole: a compiled block never reads the groups, so
    it holds no guard on them and a new group layout (every training step) recompiles nothing."""
    groups = layout.row_groups[column]
    return masked_attention(q, k, v, layout.attn_masks[column], layout.attention_backend, groups)


# ----------------------------------------------------------------------------------------------------------
# Input checks and (un)patchify helpers
# ----------------------------------------------------------------------------------------------------------


def check_columns(sample: object) -> list[list[torch.Tensor]]:
    """Validate the ``sample`` argument: a list of columns, each a list of 5-D clips (a bare tensor counts as a
    one-clip column). Raises :class:`InputError` naming the offending column/clip."""
    if not isinstance(sample, (list, tuple)) or len(sample) == 0:
        raise InputError(
            f"sample must be a non-empty list of columns, got {type(sample).__name__}",
            hint="pass [[clip, ...], ...]: one list of clips [B, C, t, h, w] per column, current clip last",
        )
    columns = []
    batch = None
    for k, col in enumerate(sample):
        clips = [col] if isinstance(col, torch.Tensor) else list(col)
        if not clips:
            raise InputError(f"sample[{k}] holds no clip", hint="each column needs at least its current clip")
        for j, clip in enumerate(clips):
            if not isinstance(clip, torch.Tensor) or clip.dim() != 5:
                shape = tuple(clip.shape) if isinstance(clip, torch.Tensor) else type(clip).__name__
                raise InputError(f"sample[{k}][{j}] must be a 5-D tensor [B, C, t, h, w], got {shape}")
            if batch is None:
                batch = clip.shape[0]
            if clip.shape[0] != batch:
                raise InputError(
                    f"sample[{k}][{j}] has batch {clip.shape[0]}, expected {batch}",
                    hint="every clip of every column must have the same batch size Bc",
                )
        columns.append(clips)
    return columns


def check_text_rows(num_columns: int, batch: int, **rows: torch.Tensor) -> None:
    """Text/timestep inputs carry ``K*Bc`` interleaved rows; say which one does not."""
    for name, tensor in rows.items():
        if tensor is None:
            raise InputError(f"{name} is required")
        if tensor.dim() == 0 or tensor.shape[0] != num_columns * batch:
            raise InputError(
                f"{name} has shape {tuple(tensor.shape)}, expected {num_columns * batch} rows "
                f"(K*Bc = {num_columns}*{batch})",
                hint="rows are interleaved: row b*K + k belongs to column k, item b",
            )


def check_forward_inputs(
    sample: object,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    pooled_projections: torch.Tensor,
    timestep_ratio: torch.Tensor,
) -> list[list[torch.Tensor]]:
    """All checks of the shared forward contract, run before any weight is touched so a wrong call fails with
    a message naming the argument rather than a shape error deep inside a block. Returns the columns."""
    columns = check_columns(sample)
    check_text_rows(
        len(columns),
        columns[0][0].shape[0],
        encoder_hidden_states=encoder_hidden_states,
        encoder_attention_mask=encoder_attention_mask,
        pooled_projections=pooled_projections,
        timestep_ratio=timestep_ratio,
    )
    if encoder_attention_mask.shape[:2] != encoder_hidden_states.shape[:2]:
        raise InputError(
            f"encoder_attention_mask {tuple(encoder_attention_mask.shape)} does not match "
            f"encoder_hidden_states {tuple(encoder_hidden_states.shape)}"
        )
    return columns


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], patch: int) -> torch.Tensor:
    """``[B, t*h*w, p*p*C]`` tokens (feature order p1, p2, c) -> ``[B, C, t, h*p, w*p]``."""
    t, h, w = grid
    b = tokens.shape[0]
    x = tokens.reshape(b, t, h, w, patch, patch, -1)  # [B, t, h, w, p1, p2, C]
    x = x.permute(0, 6, 1, 2, 4, 3, 5)  # [B, C, t, h, p1, w, p2]
    return x.reshape(b, x.shape[1], t, h * patch, w * patch)


def final_layer(
    image: torch.Tensor,
    temb: torch.Tensor,
    layout: PyramidLayout,
    grids: Sequence[Sequence[tuple[int, int, int]]],
    patch: int,
    norm_out: AdaLNContinuous,
    proj_out: nn.Linear,
) -> list[torch.Tensor]:
    """Output head of both DiTs: per-column continuous AdaLN, projection, and unpatchify of the *last* clip of
    each column (history clips are conditioning only). ``image [Bc, sum(m_k), D]``, the last clips' tokens
    (:attr:`PyramidLayout.tail_lengths`, what the last block returns) -> K x ``[Bc, C, t, h*p, w*p]``."""
    tails = layout.tail_lengths
    scale, shift = (by_column(m, layout.num_columns) for m in norm_out(temb, image.dtype))  # [Bc, K, D]
    image = proj_out(modulate_columns(layer_norm(image), tails, shift, scale))  # [Bc, sum(m_k), p*p*C]
    return [
        unpatchify(tokens, col_grids[-1], patch)  # [Bc, C, t, h*p, w*p]
        for tokens, col_grids in zip(image.split(tails, dim=1), grids, strict=True)
    ]


# ----------------------------------------------------------------------------------------------------------
# Attention and the dual-stream (MMDiT) block
# ----------------------------------------------------------------------------------------------------------


class DualStreamAttention(nn.Module):
    """Joint attention of image tokens (all columns concatenated) with each column's text tokens.

    Image q/k/v come from ``to_q/k/v``, text q/k/v from ``add_*_proj``; q and k are normed per head, image
    q/k get RoPE (text sits at position 0: identity), then each column attends over ``[text_k; image_k]``
    under its mask. ``context_norm_prefix`` is the key name of the text-side qk norms, which differs between
    the two checkpoints (``norm_added`` for Flux, ``norm_add`` for MMDiT).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        qk_norm: str | None,
        eps: float,
        context_pre_only: bool,
        context_norm_prefix: str,
    ) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.context_pre_only = context_pre_only
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = make_qk_norm(qk_norm, head_dim, eps)
        self.norm_k = make_qk_norm(qk_norm, head_dim, eps)
        self.add_q_proj = nn.Linear(dim, inner)
        self.add_k_proj = nn.Linear(dim, inner)
        self.add_v_proj = nn.Linear(dim, inner)
        self._ctx_q, self._ctx_k = f"{context_norm_prefix}_q", f"{context_norm_prefix}_k"
        self.add_module(self._ctx_q, make_qk_norm(qk_norm, head_dim, eps))
        self.add_module(self._ctx_k, make_qk_norm(qk_norm, head_dim, eps))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])
        if not context_pre_only:
            self.to_add_out = nn.Linear(inner, dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))  # [B, S, H*hd] -> [B, S, H, hd]

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, layout: PyramidLayout
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # image side: [Bc, N, D] -> [Bc, N, H, hd]
        q = self._heads(self.to_q(hidden_states))
        k = self._heads(self.to_k(hidden_states))
        v = self._heads(self.to_v(hidden_states))
        q, k = norm_rope(q, self.norm_q, layout.rope), norm_rope(k, self.norm_k, layout.rope)
        # text side: [K*Bc, L, D] -> [K*Bc, L, H, hd]
        norm_cq, norm_ck = getattr(self, self._ctx_q), getattr(self, self._ctx_k)
        cq = self._heads(self.add_q_proj(encoder_hidden_states))
        ck = self._heads(self.add_k_proj(encoder_hidden_states))
        cv = self._heads(self.add_v_proj(encoder_hidden_states))
        if norm_cq is not None:
            cq, ck = norm_cq(cq), norm_ck(ck)
        # per column [Bc, L, H, hd]: unbind and split (not indexing/slicing) so that backward reassembles each
        # gradient with one stack/cat instead of zero-filling a full-size tensor per piece and adding them up
        cq, ck, cv = (by_column(t, layout.num_columns).unbind(1) for t in (cq, ck, cv))

        lengths, text_len = layout.image_lengths, layout.text_len
        image_out, text_out = [], []
        for column, (cq_col, ck_col, cv_col, qi, ki, vi) in enumerate(
            zip(cq, ck, cv, q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1), strict=True)
        ):
            out = layout.attend(
                column,
                torch.cat([cq_col, qi], dim=1),  # [Bc, L+n_k, H, hd]
                torch.cat([ck_col, ki], dim=1),
                torch.cat([cv_col, vi], dim=1),
            )  # [Bc, L+n_k, H*hd]
            text_part, image_part = out.split([text_len, qi.shape[1]], dim=1)
            text_out.append(text_part)
            image_out.append(image_part)
        image = self.to_out[1](self.to_out[0](torch.cat(image_out, dim=1)))  # [Bc, N, D]
        if self.context_pre_only:
            return image, None
        text = torch.stack(text_out, dim=1).flatten(0, 1)  # [Bc, K, L, .] -> [Bc*K, L, .] rows b*K + k
        return image, self.to_add_out(text)


class DualStreamBlock(nn.Module):
    """MMDiT block: separate weights for image and text streams, joint attention, per-column AdaLN-Zero on
    the image stream and per-row AdaLN-Zero on the text stream. With ``context_pre_only`` (the last MMDiT
    block) the text stream is only read: its AdaLN is the continuous (scale, shift) kind and it has no
    output path."""

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        qk_norm: str | None,
        eps: float,
        context_pre_only: bool,
        context_norm_prefix: str,
    ) -> None:
        super().__init__()
        self.context_pre_only = context_pre_only
        self.norm1 = AdaLNZero(dim, 6)
        self.norm1_context = AdaLNContinuous(dim) if context_pre_only else AdaLNZero(dim, 6)
        self.attn = DualStreamAttention(
            dim, num_attention_heads, attention_head_dim, qk_norm, eps, context_pre_only, context_norm_prefix
        )
        self.ff = FeedForward(dim)
        if not context_pre_only:
            self.ff_context = FeedForward(dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        layout: PyramidLayout,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states [Bc, N, D]``, ``encoder_hidden_states [K*Bc, L, D]``, ``temb [K*Bc, D]``."""
        cols, lengths = layout.num_columns, layout.image_lengths
        x, c = hidden_states, encoder_hidden_states
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            by_column(m, cols) for m in self.norm1(temb)
        )  # each [Bc, K, D]
        norm_x = modulate_columns(layer_norm(x), lengths, shift_msa, scale_msa)

        if self.context_pre_only:
            c_scale, c_shift = self.norm1_context(temb, c.dtype)  # [K*Bc, D]
            norm_c = layer_norm(c) * (1 + c_scale[:, None]) + c_shift[:, None]
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
                temb
            )
            norm_c = layer_norm(c) * (1 + c_scale_msa[:, None]) + c_shift_msa[:, None]

        attn_x, attn_c = self.attn(norm_x, norm_c, layout)

        x = gated_residual(x, attn_x, lengths, gate_msa)
        norm_x = modulate_columns(layer_norm(x), lengths, shift_mlp, scale_mlp)
        x = gated_residual(x, self.ff(norm_x), lengths, gate_mlp)

        if self.context_pre_only:
            return x, None
        c = c + c_gate_msa[:, None] * attn_c
        norm_c = layer_norm(c) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        c = c + c_gate_mlp[:, None] * self.ff_context(norm_c)
        if c.dtype == torch.float16:
            c = c.clip(-65504, 65504)
        return x, c


# ----------------------------------------------------------------------------------------------------------
# Gradient checkpointing with one meaning for both DiTs
# ----------------------------------------------------------------------------------------------------------


def num_checkpointed(num_blocks: int, ratio: float) -> int:
    """How many blocks are checkpointed: ``floor(num_blocks * ratio)``, counted from the input side."""
    return math.floor(num_blocks * ratio + 1e-9)


def check_ratio(ratio: float) -> None:
    if not 0.0 <= float(ratio) <= 1.0:
        raise ConfigError(
            f"gradient_checkpointing_ratio={ratio} must be within [0, 1]",
            hint="the first floor(num_blocks * ratio) blocks (input side) are checkpointed; 1.0 = all",
        )


class BlockCheckpointing:
    """Mixin for the DiTs: checkpoints the blocks with execution index ``< floor(L * ratio)``, where ``L`` is
    the total number of transformer blocks in execution order (Flux: double-stream then single-stream).

    Active only when ``self.gradient_checkpointing`` is set (config ``use_gradient_checkpointing`` or
    diffusers' ``enable_gradient_checkpointing()``), in training mode, with grad enabled.
    """

    gradient_checkpointing: bool
    gradient_checkpointing_ratio: float
    #: the attention kernels (:data:`ATTENTION_BACKENDS`), handed to the blocks in each forward's layout
    attention_backend: str = "auto"
    #: attend query-row groups against their causal key prefix only (:func:`causal_row_groups`)
    skip_future_keys: bool = False
    #: the shortest column attended in row groups (None: :data:`ROW_GROUP_MIN_TOKENS`)
    row_group_min_tokens: int | None = None

    def blocks_in_order(self) -> list[tuple[str, nn.Module]]:  # pragma: no cover - overridden
        raise NotImplementedError

    def set_attention_backend(
        self, backend: str, skip_future_keys: bool = False, min_tokens: int | None = None
    ) -> None:
        """Run attention with ``backend``: ``auto`` (default), ``efficient`` or ``cudnn`` (:func:`attention_kernels`);
        with ``skip_future_keys`` (temporal-causal models only) in row groups that skip the keys causality hides
        (:func:`causal_row_groups`), for columns of ``min_tokens`` or more (None: :data:`ROW_GROUP_MIN_TOKENS`).
        Same results up to float rounding either way."""
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unknown attention backend {backend!r}", hint=f"use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if min_tokens is not None and (
            isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0
        ):
            raise ConfigError(
                f"row-group threshold {min_tokens!r} is not a token count", hint="use an integer >= 0"
            )
        self.attention_backend = backend
        self.skip_future_keys = bool(skip_future_keys)
        self.row_group_min_tokens = min_tokens

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
        groups: list[list[RowGroup] | None] = []
        for k, col in enumerate(grids):
            starts = None
            if text_lengths is not None:  # rows are interleaved: item b of column k is row b*K + k
                starts = [text_len - n for n in text_lengths[k :: len(grids)]]
            groups.append(column_row_groups(text_len, col, starts, threshold, ROW_GROUP_MIN_ROWS))
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

    @property
    def row_groups_active(self) -> bool:
        return self.skip_future_keys and self.config.use_temporal_causal

    def align_text(
        self,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        text_lengths: Sequence[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """With row groups on and the text rows' valid lengths known on the host (``text_lengths``, matching
        ``encoder_attention_mask``: :func:`right_padded_lengths`): the text cut and left-aligned by
        :func:`left_align_text`, and the lengths for :meth:`attention_row_groups`. Otherwise as given, and
        None."""
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
        return (*left_align_text(encoder_hidden_states, encoder_attention_mask, lengths), lengths)

    def compile_blocks(
        self,
        backend: str = "inductor",
        *,
        dynamic: bool | None = True,
        independent_sizes: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        """``torch.compile`` every transformer block in place, with dynamic shapes: one compiled graph per
        block type serves every token count (the pyramid changes it every call), and the state-dict keys
        stay as they are. Fuses the elementwise work around the matmuls (norms, RoPE, modulation).

        ``dynamic``: ``True`` makes every size of a block's inputs dynamic from the first trace; ``None``
        (automatic, what generate uses) traces static sizes first and makes dynamic only those that change,
        so head counts and widths stay constants. That matters wherever a block has a graph break (row
        groups with gradients): the frames around it take all their sizes from their inputs, and with every
        size dynamic Inductor generated generic kernels (RoPE 7x slower at 768p, benchmarks/RESULTS.md).

        ``independent_sizes`` (training): sizes that happen to be equal when a block is traced are not
        assumed to stay equal (PyTorch's "duck shaping" off, for the whole process), so columns whose token
        counts change independently every step do not recompile the blocks. Measured on the CPU over 24
        trainer steps: 5 graphs with duck shaping, 3 without; tracing takes ~1.5x as long.

        ``cuda_graphs`` (training): each compiled block forward and backward is also recorded as a CUDA graph
        per token count and replayed (``mode="reduce-overhead"``), so a step costs the host a few launches per
        block instead of hundreds. The caller marks each forward as a new step
        (``torch.compiler.cudagraph_mark_step_begin``): what the last one left may then be overwritten."""
        import torch._inductor.config as inductor_config

        # inductor's coalescing analysis (a tiling heuristic: speed, not results) asserted on dynamic-shape
        # kernels of these blocks with torch 2.11 on the H200; the measured generate runs have it off
        inductor_config.triton.coalesce_tiling_analysis = False
        if independent_sizes:
            import torch.fx.experimental._config as shape_config

            shape_config.use_duck_shape = False
        mode = "reduce-overhead" if cuda_graphs else None
        for _, block in self.blocks_in_order():
            block.compile(dynamic=dynamic, backend=backend, mode=mode)

    def checkpointed_block_names(self) -> list[str]:
        """Names (state-dict prefixes) of the blocks that are checkpointed when checkpointing is on."""
        blocks = self.blocks_in_order()
        n = num_checkpointed(len(blocks), self.gradient_checkpointing_ratio)
        return [name for name, _ in blocks[:n]]

    def _checkpoint_limit(self) -> int:
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return 0
        check_ratio(self.gradient_checkpointing_ratio)
        return num_checkpointed(len(self.blocks_in_order()), self.gradient_checkpointing_ratio)

    def _run_block(self, index: int, limit: int, block: nn.Module, *args: object) -> object:
        if index < limit:
            fn: Callable | None = getattr(self, "_gradient_checkpointing_func", None)
            if fn is not None:
                return fn(block, *args)
            return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
        return block(*args)


def init_reference_weights(
    model: nn.Module, extra_zero: Sequence[nn.Linear] = (), patch_conv: nn.Conv2d | None = None
) -> None:
    """Reference init of both DiTs: xavier-uniform linears (and the patch conv as a flattened matrix),
    N(0, 0.02) conditioning embedders, zero AdaLN and output layers so a fresh model predicts exactly 0.

    Draws happen in the reference's order (linears, conv, embedders), so a seeded build is reproducible.
    ``model`` has ``time_text_embed``, ``context_embedder``, ``norm_out``, ``proj_out`` and dual-stream
    ``transformer_blocks``; ``extra_zero`` are further layers to zero (Flux: the single-stream AdaLNs).
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    if patch_conv is not None:
        nn.init.xavier_uniform_(patch_conv.weight.data.view(patch_conv.weight.shape[0], -1))
        nn.init.zeros_(patch_conv.bias)
    for mlp in (model.time_text_embed.timestep_embedder, model.time_text_embed.text_embedder):
        nn.init.normal_(mlp.linear_1.weight, std=0.02)
        nn.init.normal_(mlp.linear_2.weight, std=0.02)
    nn.init.normal_(model.context_embedder.weight, std=0.02)
    zero = [model.norm_out.linear, model.proj_out]
    zero += [m for b in model.transformer_blocks for m in (b.norm1.linear, b.norm1_context.linear)]
    zero += list(extra_zero)
    for layer in zero:
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)


def note_flash_flag(model_name: str, use_flash_attn: bool) -> None:
    """``use_flash_attn`` is kept for checkpoint compatibility only (see the model docstrings)."""
    if use_flash_attn:
        logger.info(
            "%s: use_flash_attn=True is accepted but has no effect: attention always runs through SDPA with the "
            "explicit text-padding/temporal-causal mask (the reference flash path silently dropped the causal "
            "mask). PyTorch picks a fused kernel that supports the mask.",
            model_name,
        )
