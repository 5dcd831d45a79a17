"""The layers of the two pyramid DiTs (miniFLUX in ``dit_flux``, SD3-style MMDiT in ``dit_mmdit``).

Inside the network image tokens of all columns are concatenated along the token axis (``[Bc, N, D]``,
``N = sum n_k``); AdaLN modulation is per column (the timestep/pooled text of rows ``k::K``); attention is
per column under the masks of :mod:`pfctl.models.attention_layout`.

Plain PyTorch, the reference's computation op for op: in float32 the parity vectors match to ~1e-7. Nothing
here reads the environment, compiles or fuses; :mod:`pfctl.models.fast` applies those to a built model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pfctl.errors import ConfigError, InputError
from pfctl.models.attention_layout import PyramidLayout, by_column
from pfctl.models.rope import RotaryTable, apply_rope

logger = logging.getLogger(__name__)

TIMESTEP_FREQ_DIM = 256


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
        """The reference's steps: ``x * rsqrt(mean(float(x)^2) + eps)`` in float32, rounded to a half-precision
        weight's dtype (the reference multiplies in it), times the weight, in ``x``'s dtype."""
        rstd = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()  # [..., 1] float32
        normed = x * rstd
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            normed = normed.to(self.weight.dtype)
        return (normed * self.weight).to(x.dtype)


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


class ColumnModulation:
    """Mixin of the blocks (and the output norm): AdaLN modulation and gated residuals per column.

    ``x`` is ``[Bc, sum(lengths), D]``, one token segment per column; the modulation tensors are ``[Bc, K, D]``
    (one row per column, broadcast over its tokens, so autograd keeps only ``[Bc, K, D]``)."""

    def modulate_columns(
        self, x: torch.Tensor, lengths: Sequence[int], shift: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """``x * (1 + scale_k) + shift_k`` on the token segment of each column."""
        return self.affine_columns(x, list(lengths), 1 + scale, shift, None)

    def gated_residual(
        self, residual: torch.Tensor, x: torch.Tensor, lengths: Sequence[int], gate: torch.Tensor
    ) -> torch.Tensor:
        """``residual + gate_k * x`` on the token segment of each column."""
        return self.affine_columns(x, list(lengths), gate, None, residual)

    def affine_columns(
        self,
        x: torch.Tensor,
        lengths: list[int],
        scale: torch.Tensor,
        shift: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """``(x_k * scale_k [+ shift_k]) [+ residual]`` per column segment ``x_k``."""
        scales = scale[:, :, None].unbind(1)  # K x [Bc, 1, D]
        shifts = [None] * len(lengths) if shift is None else shift[:, :, None].unbind(1)
        parts = [
            x_k * s_k if b_k is None else x_k * s_k + b_k
            for x_k, s_k, b_k in zip(x.split(lengths, 1), scales, shifts, strict=True)
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out if residual is None else residual + out


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


class AdaLNContinuous(ColumnModulation, nn.Module):
    """Final-layer style AdaLN: ``SiLU -> linear`` giving (scale, shift) -- note: scale first."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, temb: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        scale, shift = self.linear(F.silu(temb).to(dtype)).chunk(2, dim=-1)  # 2 x [R, D]
        return scale, shift


class GELUProj(nn.Module):
    """Linear followed by tanh-approximated GELU (key ``proj``)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """Transformer MLP ``dim -> 4*dim -> dim``; keys ``net.0.proj`` and ``net.2`` as in the checkpoints."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, dim * mult), nn.Dropout(0.0), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


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
    image = proj_out(
        norm_out.modulate_columns(layer_norm(image), tails, shift, scale)
    )  # [Bc, sum(m_k), p*p*C]
    return [
        unpatchify(tokens, col_grids[-1], patch)  # [Bc, C, t, h*p, w*p]
        for tokens, col_grids in zip(image.split(tails, dim=1), grids, strict=True)
    ]


# ----------------------------------------------------------------------------------------------------------
# Attention and the dual-stream (MMDiT) block
# ----------------------------------------------------------------------------------------------------------


class AttentionOps:
    """Mixin of the attention modules: the q/k/v projections and the steps between them and the output
    projection."""

    def project(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        """Each of ``linears`` applied to ``x`` (q, k, v of one input)."""
        return [linear(x) for linear in linears]

    def norm_rope(self, x: torch.Tensor, norm: nn.Module | None, table: RotaryTable | None) -> torch.Tensor:
        """``rotate(norm(x), table)`` for q or k ``[B, S, H, hd]`` (no norm when ``norm`` is None, no rotation
        when ``table`` is None)."""
        if norm is not None:
            x = norm(x)
        return x if table is None else self.rotate(x, table)

    def rotate(self, x: torch.Tensor, table: RotaryTable) -> torch.Tensor:
        """RoPE of ``x [B, S, H, hd]`` (:func:`pfctl.models.rope.apply_rope`)."""
        return apply_rope(x, table)

    def attend(
        self, layout: PyramidLayout, column: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Masked attention of one column (:meth:`PyramidLayout.attend`)."""
        return layout.attend(column, q, k, v)


class DualStreamAttention(AttentionOps, nn.Module):
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

    def attend_by_column(
        self, layout: PyramidLayout, text: Sequence[torch.Tensor], image: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One attention call per column over ``[text_k; image_k]``: ``text`` is q, k, v ``[K*Bc, L, H, hd]``
        (rows ``b*K + k``), ``image`` q, k, v ``[Bc, N, H, hd]``; returns the text output ``[K*Bc, L, H*hd]``
        (same rows) and the image output ``[Bc, N, H*hd]``."""
        lengths, text_len = layout.image_lengths, layout.text_len
        # per column [Bc, L, H, hd]: unbind and split (not indexing/slicing) so that backward reassembles each
        # gradient with one stack/cat instead of zero-filling a full-size tensor per piece and adding them up
        text_cols = (by_column(x, layout.num_columns).unbind(1) for x in text)
        image_cols = (x.split(lengths, 1) for x in image)
        text_out, image_out = [], []
        for column, (cq_col, ck_col, cv_col, qi, ki, vi) in enumerate(zip(*text_cols, *image_cols, strict=True)):
            out = self.attend(
                layout,
                column,
                torch.cat([cq_col, qi], dim=1),  # [Bc, L+n_k, H, hd]
                torch.cat([ck_col, ki], dim=1),
                torch.cat([cv_col, vi], dim=1),
            )  # [Bc, L+n_k, H*hd]
            text_part, image_part = out.split([text_len, qi.shape[1]], dim=1)
            text_out.append(text_part)
            image_out.append(image_part)
        # [Bc, K, L, .] -> [Bc*K, L, .] rows b*K + k
        return torch.stack(text_out, dim=1).flatten(0, 1), torch.cat(image_out, dim=1)

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, layout: PyramidLayout
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # image side: [Bc, N, D] -> [Bc, N, H, hd]
        q, k, v = (self._heads(x) for x in self.project(hidden_states, (self.to_q, self.to_k, self.to_v)))
        q, k = self.norm_rope(q, self.norm_q, layout.rope), self.norm_rope(k, self.norm_k, layout.rope)
        # text side: [K*Bc, L, D] -> [K*Bc, L, H, hd]
        norm_cq, norm_ck = getattr(self, self._ctx_q), getattr(self, self._ctx_k)
        text_projections = (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        cq, ck, cv = (self._heads(x) for x in self.project(encoder_hidden_states, text_projections))
        if norm_cq is not None:
            cq, ck = norm_cq(cq), norm_ck(ck)
        if layout.packed is not None:  # every column in one call
            text, image = layout.packed.attend_streams((cq, ck, cv), (q, k, v))
        else:
            text, image = self.attend_by_column(layout, (cq, ck, cv), (q, k, v))
        image = self.to_out[1](self.to_out[0](image))  # [Bc, N, D]
        if self.context_pre_only:
            return image, None
        return image, self.to_add_out(text)


class DualStreamBlock(ColumnModulation, nn.Module):
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
        norm_x = self.modulate_columns(layer_norm(x), lengths, shift_msa, scale_msa)

        if self.context_pre_only:
            c_scale, c_shift = self.norm1_context(temb, c.dtype)  # [K*Bc, D]
            norm_c = layer_norm(c) * (1 + c_scale[:, None]) + c_shift[:, None]
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
                temb
            )
            norm_c = layer_norm(c) * (1 + c_scale_msa[:, None]) + c_shift_msa[:, None]

        attn_x, attn_c = self.attn(norm_x, norm_c, layout)

        x = self.gated_residual(x, attn_x, lengths, gate_msa)
        norm_x = self.modulate_columns(layer_norm(x), lengths, shift_mlp, scale_mlp)
        x = self.gated_residual(x, self.ff(norm_x), lengths, gate_mlp)

        if self.context_pre_only:
            return x, None
        c = c + c_gate_msa[:, None] * attn_c
        norm_c = layer_norm(c) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        c = c + c_gate_mlp[:, None] * self.ff_context(norm_c)
        if c.dtype == torch.float16:
            c = c.clip(-65504, 65504)
        return x, c


# ----------------------------------------------------------------------------------------------------------
# Gradient checkpointing (one meaning for both DiTs; applied by pfctl.models.fast) and initialisation
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
