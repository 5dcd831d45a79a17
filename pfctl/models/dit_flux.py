"""miniFLUX pyramid DiT (``PyramidFluxTransformer``): double-stream blocks, then single-stream blocks.

Checkpoint-compatible with the reference class of the same name (config fields and state-dict keys are the
same, ``diffusion_pytorch_model.safetensors`` of the released ``diffusion_transformer_*`` folders loads with
``strict=True``). The layers are in :mod:`pfctl.models.dit_layers`, the attention layout in
:mod:`pfctl.models.attention_layout`; :mod:`pfctl.models.fast` applies the speed paths to a built model.

Where pfctl deliberately differs from the reference (all documented, none affects the default numerics):

* ``use_flash_attn`` is accepted and stored but has no effect: every attention call is SDPA with the explicit
  boolean mask. The reference's flash-attn path ran without the temporal-causal mask; pfctl never drops it.
* ``use_temporal_causal=False`` really removes the causal part of the mask (text padding stays masked).
* ``interp_condition_pos=False`` really uses integer (y, x) positions ``0..n-1`` for every clip; the
  reference ignored the flag and always interpolated lower-resolution history clips onto the current grid.
* Gradient checkpointing (applied by :mod:`pfctl.models.fast`) covers blocks with execution index
  ``< floor(L * ratio)``, ``L`` = double + single blocks counted from the input side (the reference used
  ``index <= int(len * ratio)`` per block list).
* Patchify is a fixed 2x2 reshape as in the reference: ``in_channels`` = 4 x latent channels and the config
  ``patch_size`` must stay 1 (it only sizes ``proj_out``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from pfctl.errors import ConfigError, InputError
from pfctl.models.attention_layout import (
    PyramidAttention,
    PyramidLayout,
    attention_dtype,
    by_column,
    clip_frame_ids,
    column_tails,
    tail_table,
)
from pfctl.models.dit_layers import (
    AdaLNContinuous,
    AdaLNZero,
    AttentionOps,
    ColumnModulation,
    DualStreamBlock,
    RMSNorm,
    TimestepTextEmbedding,
    check_forward_inputs,
    check_ratio,
    final_layer,
    init_reference_weights,
    layer_norm,
    note_flash_flag,
)
from pfctl.models.rope import rope_tables, rotary_table, with_text_identity

PATCH = 2  # the Flux DiT patchifies by a fixed 2x2 reshape (config patch_size only sizes proj_out)
QK_EPS = 1e-6

#: Constructor overrides the reference pipeline applies when it loads a released checkpoint folder.
REFERENCE_LOAD_OVERRIDES: dict[str, object] = {"axes_dims_rope": [16, 24, 24]}


class FluxTransformerBlock(DualStreamBlock):
    """Double-stream block (image and text streams with their own weights, joint attention)."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int) -> None:
        super().__init__(
            dim,
            num_attention_heads,
            attention_head_dim,
            qk_norm="rms_norm",
            eps=QK_EPS,
            context_pre_only=False,
            context_norm_prefix="norm_added",
        )


class FluxSingleAttention(AttentionOps, nn.Module):
    """Self-attention of the single-stream blocks (no output projection: ``proj_out`` of the block does it)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = RMSNorm(head_dim, eps=QK_EPS)
        self.norm_k = RMSNorm(head_dim, eps=QK_EPS)

    def forward(
        self, x: torch.Tensor, layout: PyramidLayout, queries: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [Bc, sum(L+n_k), D]`` in the single-stream layout -> ``[Bc, sum(L+n_k), H*hd]``; with ``queries``
        (the last block: the rows of ``x`` that :func:`column_tails` keeps) only those rows are attended,
        ``[Bc, sum(m_k), H*hd]``."""
        lengths, q_lengths, q_rope = layout.joint_lengths, layout.joint_lengths, layout.joint_rope
        tails = queries is not None
        if tails:  # q from the tails' rows, k and v from all
            q_lengths, q_rope = layout.tail_lengths, tail_table(q_rope, lengths, layout.tail_lengths)
            q, k, v = [*self.project(queries, (self.to_q,)), *self.project(x, (self.to_k, self.to_v))]
        else:
            q, k, v = self.project(x, (self.to_q, self.to_k, self.to_v))
        q, k, v = (t.unflatten(-1, (self.heads, self.head_dim)) for t in (q, k, v))  # [Bc, T, H, hd]
        q, k = self.norm_rope(q, self.norm_q, q_rope), self.norm_rope(k, self.norm_k, layout.joint_rope)
        if layout.packed is not None:  # every column in one call
            return layout.packed.attend(q, k, v, "tails" if tails else "joint")
        outs = [
            self.attend(layout, column, qc, kc, vc)
            for column, (qc, kc, vc) in enumerate(
                zip(q.split(q_lengths, 1), k.split(lengths, 1), v.split(lengths, 1), strict=True)
            )
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class FluxSingleTransformerBlock(ColumnModulation, nn.Module):
    """Single-stream block on ``[text_k; image_k]`` per column: parallel attention + MLP, one AdaLN-Zero."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.norm = AdaLNZero(dim, 3)
        self.proj_mlp = nn.Linear(dim, self.mlp_hidden_dim)
        self.proj_out = nn.Linear(dim + self.mlp_hidden_dim, dim)
        self.attn = FluxSingleAttention(dim, num_attention_heads, attention_head_dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(proj_mlp(x))`` (tanh approximation)."""
        return F.gelu(self.proj_mlp(x), approximate="tanh")

    def project_out(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """``proj_out([attn; mlp])``."""
        return self.proj_out(torch.cat([attn, mlp], dim=-1))

    def forward(
        self, hidden_states: torch.Tensor, temb: torch.Tensor, layout: PyramidLayout, last: bool = False
    ) -> torch.Tensor:
        """``hidden_states [Bc, sum(L+n_k), D]``, ``temb [K*Bc, D]``. ``last`` (the model's last block): only the
        rows of each column's last clip are computed and returned, ``[Bc, sum(m_k), D]`` (:func:`column_tails`)."""
        lengths = layout.joint_lengths
        shift, scale, gate = (by_column(m, layout.num_columns) for m in self.norm(temb))  # each [Bc, K, D]
        norm_x = self.modulate_columns(layer_norm(hidden_states), lengths, shift, scale)
        residual, rows, queries = hidden_states, norm_x, None
        if last:
            residual, queries = (
                column_tails(t, lengths, layout.tail_lengths) for t in (hidden_states, norm_x)
            )
            rows, lengths = queries, layout.tail_lengths
        mlp = self.mlp(rows)  # [Bc, T, 4D]
        attn = self.attn(norm_x, layout, queries)  # [Bc, T, D]
        out = self.gated_residual(residual, self.project_out(attn, mlp), lengths, gate)
        if out.dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out


class PyramidFluxTransformer(PyramidAttention, ModelMixin, ConfigMixin):
    """miniFLUX DiT of Pyramid Flow (reference config fields; see the module docstring for the differences).

    ``forward(sample, encoder_hidden_states, encoder_attention_mask, pooled_projections, timestep_ratio)``:

    * ``sample``: list of K columns, each a list of clips ``[Bc, in_channels/4, t, h, w]`` (h, w even), oldest
      history clip first, the clip being denoised last; history clips may have a smaller (h, w).
    * ``encoder_hidden_states [K*Bc, L, joint_attention_dim]``, ``encoder_attention_mask [K*Bc, L]`` (1 = real
      token), ``pooled_projections [K*Bc, pooled_projection_dim]``, ``timestep_ratio [K*Bc]`` -- the flow
      timestep on the 0..1000 scale despite its name. Row ``b*K + k`` is column ``k``, item ``b``.

    Returns a list of K tensors ``[Bc, in_channels/4, t, h, w]``: the prediction for the last clip of each column.
    """

    _no_split_modules: ClassVar[list[str]] = ["FluxTransformerBlock", "FluxSingleTransformerBlock"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 64,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        axes_dims_rope: tuple[int, ...] = (16, 24, 24),
        use_flash_attn: bool = False,
        use_temporal_causal: bool = True,
        interp_condition_pos: bool = True,
        use_gradient_checkpointing: bool = False,
        gradient_checkpointing_ratio: float = 0.6,
    ) -> None:
        super().__init__()
        if patch_size != 1:
            raise ConfigError(
                f"PyramidFluxTransformer: patch_size={patch_size} is not supported",
                hint="keep patch_size=1: the 2x2 patchify is built into in_channels (= 4 x latent channels)",
            )
        if in_channels % (PATCH * PATCH):
            raise ConfigError(f"in_channels={in_channels} must be 4 x the latent channels (2x2 patches)")
        if sum(axes_dims_rope) != attention_head_dim or len(axes_dims_rope) != 3:
            raise ConfigError(
                f"axes_dims_rope={list(axes_dims_rope)} must be 3 (t, y, x) even sizes summing to "
                f"attention_head_dim={attention_head_dim}",
                hint="the released model uses [16, 24, 24] with attention_head_dim=64",
            )
        check_ratio(gradient_checkpointing_ratio)

        self.out_channels = in_channels
        self.inner_dim = num_attention_heads * attention_head_dim
        dim = self.inner_dim

        self.time_text_embed = TimestepTextEmbedding(dim, pooled_projection_dim)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.x_embedder = nn.Linear(in_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            [FluxTransformerBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [
                FluxSingleTransformerBlock(dim, num_attention_heads, attention_head_dim)
                for _ in range(num_single_layers)
            ]
        )
        self.norm_out = AdaLNContinuous(dim)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * in_channels)

        note_flash_flag(type(self).__name__, use_flash_attn)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Reference init (:func:`init_reference_weights`); the single-stream AdaLNs start at zero too."""
        init_reference_weights(self, extra_zero=[b.norm.linear for b in self.single_transformer_blocks])

    def packed_orders(self) -> tuple[str, ...]:
        """The double-stream blocks attend in the streams' order, the single-stream ones in the joint order,
        the last of them only the columns' tails."""
        double = ("streams",) if len(self.transformer_blocks) else ()
        return double + (("joint", "tails") if len(self.single_transformer_blocks) else ())

    def blocks_in_order(self) -> list[tuple[str, nn.Module]]:
        """All transformer blocks in execution order (the order gradient checkpointing counts in,
        :func:`pfctl.models.fast.apply_fast_paths`)."""
        double = [(f"transformer_blocks.{i}", b) for i, b in enumerate(self.transformer_blocks)]
        single = [(f"single_transformer_blocks.{i}", b) for i, b in enumerate(self.single_transformer_blocks)]
        return double + single

    # ------------------------------------------------------------------------------------------------------

    def _patchify(self, clip: torch.Tensor, where: str) -> torch.Tensor:
        """``[Bc, C, t, H, W]`` -> ``[Bc, t*(H/2)*(W/2), 4C]`` (token order t, y, x; features p1, p2, c)."""
        b, c, t, hh, ww = clip.shape
        if hh % PATCH or ww % PATCH or c * PATCH * PATCH != self.config.in_channels:
            raise InputError(
                f"{where} has shape {tuple(clip.shape)}: need {self.config.in_channels // 4} channels "
                "and even h, w",
                hint="latents are [B, C, t, h, w] with h and w divisible by 2",
            )
        x = clip.reshape(b, c, t, hh // PATCH, PATCH, ww // PATCH, PATCH)  # [b, c, t, h, p1, w, p2]
        x = x.permute(0, 2, 3, 5, 4, 6, 1)  # [b, t, h, w, p1, p2, c]
        return x.reshape(b, t * (hh // PATCH) * (ww // PATCH), PATCH * PATCH * c)

    def _axis_positions(self, n: int, n_last: int, device: torch.device) -> torch.Tensor:
        """(y or x) positions of a clip with ``n`` tokens along an axis where the current clip has ``n_last``."""
        if n == n_last or not self.config.interp_condition_pos:
            return torch.arange(n, device=device, dtype=torch.float32)
        full = torch.arange(n_last, device=device, dtype=torch.float32)[None, None]  # [1, 1, n_last]
        return F.interpolate(full, size=n, mode="linear", align_corners=False).view(n)

    def _positions(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """(t, y, x) RoPE positions ``[n, 3]`` of a column's image tokens."""
        last_h, last_w = grids[-1][1], grids[-1][2]
        out, start = [], 0
        for t, h, w in grids:
            tt = torch.arange(start, start + t, device=device, dtype=torch.float32)
            ys, xs = self._axis_positions(h, last_h, device), self._axis_positions(w, last_w, device)
            grid = torch.stack(torch.meshgrid(tt, ys, xs, indexing="ij"), dim=-1)  # [t, h, w, 3]
            out.append(grid.reshape(-1, 3))
            start += t
        return torch.cat(out, dim=0)

    def build_layout(
        self,
        grids: list[list[tuple[int, int, int]]],
        encoder_attention_mask: torch.Tensor,
        batch: int,
        attn_dtype: torch.dtype,
        text_lengths: Sequence[int] | None = None,
    ) -> PyramidLayout:
        """Token counts, RoPE tables and attention masks (in ``attn_dtype``, the dtype of q) of one call
        (shapes only; built once per forward)."""
        device = encoder_attention_mask.device
        image_lengths = [sum(t * h * w for t, h, w in col) for col in grids]
        positions = torch.cat([self._positions(col, device) for col in grids], dim=0)  # [N, 3]
        cos, sin = rope_tables(positions, self.config.axes_dims_rope)  # 2 x [N, hd/2]
        text_len = encoder_attention_mask.shape[1]
        frame_ids = [clip_frame_ids(col, device) for col in grids]
        return self.pyramid_layout(
            grids,
            encoder_attention_mask != 0,
            frame_ids,
            batch,
            attn_dtype,
            text_lengths,
            rope=rotary_table(cos, sin),
            joint_rope=rotary_table(*with_text_identity(cos, sin, image_lengths, text_len)),
        )

    def forward(
        self,
        sample: list[list[torch.Tensor]],
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep_ratio: torch.Tensor,
        text_lengths: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        columns = check_forward_inputs(
            sample, encoder_hidden_states, encoder_attention_mask, pooled_projections, timestep_ratio
        )
        encoder_hidden_states, encoder_attention_mask, text_lengths = self.align_text(
            encoder_hidden_states, encoder_attention_mask, text_lengths
        )
        num_cols, batch = len(columns), columns[0][0].shape[0]

        temb = self.time_text_embed(timestep_ratio, pooled_projections)  # [K*Bc, D]
        text = self.context_embedder(encoder_hidden_states)  # [K*Bc, L, D]
        # embedded per column (as the reference does: GEMM shapes, hence rounding, match it bit for bit)
        image = torch.cat(
            [
                self.x_embedder(
                    torch.cat([self._patchify(c, f"sample[{k}][{j}]") for j, c in enumerate(col)], 1)
                )
                for k, col in enumerate(columns)
            ],
            dim=1,
        )  # [Bc, N, D], columns then clips in order

        grids = [[(c.shape[2], c.shape[3] // PATCH, c.shape[4] // PATCH) for c in col] for col in columns]
        layout = self.build_layout(grids, encoder_attention_mask, batch, attention_dtype(image), text_lengths)

        for block in self.transformer_blocks:
            image, text = block(image, text, temb, layout)

        # single-stream layout: [text_0; image_0; text_1; image_1; ...] -> [Bc, sum(L + n_k), D]
        # (unbind/split rather than indexing/slicing: backward reassembles with one stack/cat, no zero-fills)
        parts = []
        for text_col, img in zip(
            by_column(text, num_cols).unbind(1), image.split(layout.image_lengths, dim=1), strict=True
        ):
            parts += [text_col, img]
        hidden = torch.cat(parts, dim=1)

        last = len(self.single_transformer_blocks) - 1
        for i, block in enumerate(self.single_transformer_blocks):
            hidden = block(hidden, temb, layout, i == last)
        if last < 0:  # no single-stream block: the last clips' rows of the joint layout
            hidden = column_tails(hidden, layout.joint_lengths, layout.tail_lengths)

        # K x [Bc, C, t, 2h, 2w]: the last clip of each column (all the last block returned)
        return final_layer(hidden, temb, layout, grids, PATCH, self.norm_out, self.proj_out)
