"""SD3-style pyramid MMDiT (``PyramidDiffusionMMDiT``): dual-stream blocks only, conv patch embedding.

Checkpoint-compatible with the reference class of the same name (config fields and state-dict keys, including
the persistent sin-cos buffer ``pos_embed.pos_embed``). Same forward contract as the Flux DiT
(:mod:`pfctl.models.dit_layers`). Positions:

* spatial: additive 2-D sin-cos table (``pos_embed_max_size`` squared, SD3 layout) cropped around its centre to
  the current clip's token grid; with ``interp_condition_pos`` smaller history clips get that crop bilinearly
  resized to their grid, otherwise their own centred crop;
* temporal: with ``add_temp_pos_embed`` either 1-axis RoPE over the full head dim on the frame index
  (``temp_pos_embed_type="rope"``, the released setting) or an additive 1-D sin-cos table (``"sincos"``).

Differences from the reference (documented; default numerics unchanged):

* ``use_flash_attn`` is accepted and stored but has no effect (masked SDPA everywhere; the reference refused
  flash + temporal-causal by assertion, pfctl simply never drops the mask).
* ``use_temporal_causal`` works whatever the temporal position type (the reference crashed unless RoPE was on).
* ``use_t5_mask=False`` really treats every text token as real (the reference always masked padding); the
  reference pipeline always passed ``True`` -- see :data:`REFERENCE_LOAD_OVERRIDES`.
* Gradient checkpointing (:mod:`pfctl.models.fast`) covers blocks with index ``< floor(L * ratio)`` from the input side (the reference
  checkpointed the *last* blocks, ``index >= int(L * ratio)``), the same rule as the Flux DiT.
* Defaults that could not run in the reference (``pos_embed_type="rope"``, ``caption_projection_dim=1152`` with
  24 x 64 heads) are replaced by working ones (``"sincos"``, 1536); released configs set both explicitly.
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
    clip_frame_ids,
    column_tails,
)
from pfctl.models.dit_layers import (
    AdaLNContinuous,
    DualStreamBlock,
    TimestepTextEmbedding,
    check_forward_inputs,
    check_ratio,
    final_layer,
    init_reference_weights,
    note_flash_flag,
)
from pfctl.models.rope import rope_tables, rotary_table

QK_EPS = 1e-5

#: Constructor overrides the reference pipeline applies when it loads a released checkpoint folder
#: (the published config.json does not carry them).
REFERENCE_LOAD_OVERRIDES: dict[str, object] = {
    "use_t5_mask": True,
    "add_temp_pos_embed": True,
    "temp_pos_embed_type": "rope",
    "interp_condition_pos": True,
}


def sincos_1d(embed_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """``[M]`` float32 positions -> ``[M, embed_dim]`` = ``[sin(p*w), cos(p*w)]``, ``w_i = 10000^(-i/(D/2))``.

    Evaluated in float64 (positions are float32 values) and rounded to float32 once, like the reference table.
    """
    if embed_dim % 2:
        raise ConfigError(f"sin-cos embedding dim must be even, got {embed_dim}")
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega  # [D/2]
    angles = positions.reshape(-1).double()[:, None] * omega[None, :]  # [M, D/2]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def sincos_2d_table(
    embed_dim: int, grid_size: int, base_size: int, interpolation_scale: float = 1.0
) -> torch.Tensor:
    """SD3's square 2-D table ``[grid_size**2, embed_dim]`` (row-major over (y, x)).

    First half of the channels encodes x (the column), second half y (the row); coordinates are
    ``i / (grid_size / base_size) / interpolation_scale`` in float32.
    """
    coords = torch.arange(grid_size, dtype=torch.float32) / (grid_size / base_size) / interpolation_scale
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")  # [G, G] each
    emb_x = sincos_1d(embed_dim // 2, xs)
    emb_y = sincos_1d(embed_dim // 2, ys)
    return torch.cat([emb_x, emb_y], dim=1).float()  # [G*G, D]


class PatchEmbed3D(nn.Module):
    """Per-frame 2-D conv patch embedding plus the additive sin-cos positions (key prefix ``pos_embed``)."""

    def __init__(
        self,
        sample_size: int,
        patch_size: int,
        in_channels: int,
        embed_dim: int,
        pos_embed_max_size: int,
        max_num_frames: int,
        temporal_sincos: bool,
        interp_condition_pos: bool,
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.max_size = pos_embed_max_size
        self.interp_condition_pos = interp_condition_pos
        self.temporal_sincos = temporal_sincos
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)
        table = sincos_2d_table(embed_dim, pos_embed_max_size, base_size=sample_size // patch_size)
        self.register_buffer("pos_embed", table[None], persistent=True)  # [1, G*G, D]
        if temporal_sincos:
            frames = sincos_1d(embed_dim, torch.arange(max_num_frames, dtype=torch.float32)).float()
            self.register_buffer("temp_pos_embed", frames[None], persistent=True)  # [1, F, D]

    def spatial_positions(self, h: int, w: int, last_h: int, last_w: int) -> torch.Tensor:
        """Additive positions ``[1, h*w, D]`` of a clip with token grid (h, w) in a column whose current clip
        has (last_h, last_w)."""
        g = self.max_size
        if max(h, w, last_h, last_w) > g:
            raise InputError(
                f"token grid {max(h, last_h)}x{max(w, last_w)} exceeds pos_embed_max_size={g}",
                hint="use a smaller resolution or a model with a larger pos_embed_max_size",
            )
        table = self.pos_embed.reshape(1, g, g, -1)  # [1, G, G, D]
        if self.interp_condition_pos:
            top, left = (g - last_h) // 2, (g - last_w) // 2
            crop = table[:, top : top + last_h, left : left + last_w]  # [1, last_h, last_w, D]
            if (h, w) != (last_h, last_w):
                crop = F.interpolate(crop.permute(0, 3, 1, 2), size=(h, w), mode="bilinear")  # [1, D, h, w]
                crop = crop.permute(0, 2, 3, 1)  # [1, h, w, D]
        else:
            top, left = (g - h) // 2, (g - w) // 2
            crop = table[:, top : top + h, left : left + w]
        return crop.reshape(1, h * w, -1)

    def embed_clip(self, clip: torch.Tensor, first_frame: int, last_hw: tuple[int, int]) -> torch.Tensor:
        """``[B, C, t, H, W]`` -> tokens ``[B, t*h*w, D]`` (t-major, then y, x)."""
        b, c, t, hh, ww = clip.shape
        p = self.patch_size
        x = self.proj(clip.permute(0, 2, 1, 3, 4).reshape(b * t, c, hh, ww))  # [(B t), D, h, w]
        h, w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)  # [(B t), h*w, D]
        x = x + self.spatial_positions(h, w, last_hw[0] // p, last_hw[1] // p)
        x = x.reshape(b, t, h * w, -1)  # [B, t, h*w, D]
        if self.temporal_sincos:
            x = x + self.temp_pos_embed[0, first_frame : first_frame + t, None, :]
        return x.reshape(b, t * h * w, -1).to(clip.dtype)


class JointTransformerBlock(DualStreamBlock):
    """SD3 joint block; the last block of the stack is ``context_pre_only`` (text is read, not updated)."""

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        qk_norm: str | None,
        context_pre_only: bool,
    ) -> None:
        super().__init__(
            dim,
            num_attention_heads,
            attention_head_dim,
            qk_norm=qk_norm,
            eps=QK_EPS,
            context_pre_only=context_pre_only,
            context_norm_prefix="norm_add",
        )


class PyramidDiffusionMMDiT(PyramidAttention, ModelMixin, ConfigMixin):
    """SD3-style DiT of Pyramid Flow. Forward contract as :class:`pfctl.models.dit_flux.PyramidFluxTransformer`:
    ``forward(sample, encoder_hidden_states, encoder_attention_mask, pooled_projections, timestep_ratio)`` with
    clips ``[Bc, in_channels, t, h, w]`` (h, w divisible by ``patch_size``); returns the last clip's prediction
    per column."""

    _no_split_modules: ClassVar[list[str]] = ["JointTransformerBlock"]

    @register_to_config
    def __init__(
        self,
        sample_size: int = 128,
        patch_size: int = 2,
        in_channels: int = 16,
        num_layers: int = 24,
        attention_head_dim: int = 64,
        num_attention_heads: int = 24,
        caption_projection_dim: int = 1536,
        pooled_projection_dim: int = 2048,
        pos_embed_max_size: int = 192,
        max_num_frames: int = 200,
        qk_norm: str | None = "rms_norm",
        pos_embed_type: str = "sincos",
        temp_pos_embed_type: str = "sincos",
        joint_attention_dim: int = 4096,
        use_gradient_checkpointing: bool = False,
        use_flash_attn: bool = True,
        use_temporal_causal: bool = False,
        use_t5_mask: bool = False,
        add_temp_pos_embed: bool = False,
        interp_condition_pos: bool = False,
        gradient_checkpointing_ratio: float = 0.6,
    ) -> None:
        super().__init__()
        self.out_channels = in_channels
        self.inner_dim = dim = num_attention_heads * attention_head_dim
        if pos_embed_type != "sincos":
            raise ConfigError(
                f"PyramidDiffusionMMDiT: pos_embed_type={pos_embed_type!r} is not supported for video",
                hint="use 'sincos' (the released model; the reference's 'rope' path was never implemented)",
            )
        if not pos_embed_max_size:
            raise ConfigError(
                "PyramidDiffusionMMDiT needs pos_embed_max_size (the SD3 cropped sin-cos table)"
            )
        if temp_pos_embed_type not in ("rope", "sincos"):
            raise ConfigError(f"temp_pos_embed_type={temp_pos_embed_type!r}: expected 'rope' or 'sincos'")
        if caption_projection_dim != dim:
            raise ConfigError(
                f"caption_projection_dim={caption_projection_dim} must equal num_attention_heads x "
                f"attention_head_dim = {dim}",
                hint="text and image streams share the attention width",
            )
        check_ratio(gradient_checkpointing_ratio)

        self.temporal_rope = add_temp_pos_embed and temp_pos_embed_type == "rope"
        self.pos_embed = PatchEmbed3D(
            sample_size,
            patch_size,
            in_channels,
            dim,
            pos_embed_max_size,
            max_num_frames,
            temporal_sincos=add_temp_pos_embed and temp_pos_embed_type == "sincos",
            interp_condition_pos=interp_condition_pos,
        )
        self.time_text_embed = TimestepTextEmbedding(dim, pooled_projection_dim)
        self.context_embedder = nn.Linear(joint_attention_dim, caption_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            [
                JointTransformerBlock(
                    dim,
                    num_attention_heads,
                    attention_head_dim,
                    qk_norm,
                    context_pre_only=i == num_layers - 1,
                )
                for i in range(num_layers)
            ]
        )
        self.norm_out = AdaLNContinuous(dim)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * in_channels)

        note_flash_flag(type(self).__name__, use_flash_attn)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Reference init (:func:`init_reference_weights`), including the patch conv."""
        init_reference_weights(self, patch_conv=self.pos_embed.proj)

    def blocks_in_order(self) -> list[tuple[str, nn.Module]]:
        """All transformer blocks in execution order (the order gradient checkpointing counts in)."""
        return [(f"transformer_blocks.{i}", b) for i, b in enumerate(self.transformer_blocks)]

    def _embed_column(self, clips: list[torch.Tensor], k: int) -> torch.Tensor:
        p, c_in = self.config.patch_size, self.config.in_channels
        last_hw = (clips[-1].shape[3], clips[-1].shape[4])
        tokens, frame = [], 0
        for j, clip in enumerate(clips):
            if clip.shape[1] != c_in or clip.shape[3] % p or clip.shape[4] % p:
                raise InputError(
                    f"sample[{k}][{j}] has shape {tuple(clip.shape)}: need {c_in} channels "
                    f"and h, w divisible by {p}"
                )
            tokens.append(self.pos_embed.embed_clip(clip, frame, last_hw))
            frame += clip.shape[2]
        return torch.cat(tokens, dim=1)  # [Bc, n_k, D]

    def build_layout(
        self,
        grids: list[list[tuple[int, int, int]]],
        encoder_attention_mask: torch.Tensor,
        batch: int,
        attn_dtype: torch.dtype,
        text_lengths: Sequence[int] | None = None,
    ) -> PyramidLayout:
        """Token counts, temporal RoPE table and attention masks (in ``attn_dtype``, the dtype of q) of one call
        (built once per forward)."""
        frame_ids = [clip_frame_ids(col, encoder_attention_mask.device) for col in grids]
        text_valid = encoder_attention_mask != 0
        if not self.config.use_t5_mask:
            text_valid = torch.ones_like(text_valid)
        rope = None
        if self.temporal_rope:
            frames = torch.cat(frame_ids).float()[:, None]  # [N, 1]
            rope = rotary_table(*rope_tables(frames, [self.config.attention_head_dim]))
        return self.pyramid_layout(grids, text_valid, frame_ids, batch, attn_dtype, text_lengths, rope=rope)

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
        if not self.config.use_t5_mask:  # every text token is attended: no padding to skip
            text_lengths = [encoder_attention_mask.shape[1]] * encoder_attention_mask.shape[0]
        encoder_hidden_states, encoder_attention_mask, text_lengths = self.align_text(
            encoder_hidden_states, encoder_attention_mask, text_lengths
        )
        batch = columns[0][0].shape[0]
        p = self.config.patch_size

        temb = self.time_text_embed(timestep_ratio, pooled_projections)  # [K*Bc, D]
        text = self.context_embedder(encoder_hidden_states)  # [K*Bc, L, D]
        image = torch.cat([self._embed_column(col, k) for k, col in enumerate(columns)], dim=1)  # [Bc, N, D]

        grids = [[(c.shape[2], c.shape[3] // p, c.shape[4] // p) for c in col] for col in columns]
        layout = self.build_layout(grids, encoder_attention_mask, batch, attention_dtype(image), text_lengths)
        for block in self.transformer_blocks:
            image, text = block(image, text, temb, layout)

        # K x [Bc, C, t, h*p, w*p]: the last clip of each column
        image = column_tails(image, layout.image_lengths, layout.tail_lengths)
        return final_layer(image, temb, layout, grids, p, self.norm_out, self.proj_out)
