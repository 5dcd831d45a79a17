"""``CausalVideoVAE``: the Pyramid Flow causal video VAE (8x spatial, 8x temporal, 16 channels).

Same constructor arguments (hence ``config.json``) and state-dict keys as the reference class, so
the official ``causal_video_vae`` folder loads unchanged. Differences from the reference, on
purpose:

* Temporal chunking and spatial tiling are *arguments* of :meth:`CausalVideoVAE.encode` /
  :meth:`CausalVideoVAE.decode`; there is no ``enable_tiling()`` switch and no frame cache stored
  on the modules (each call builds its own :class:`~pfctl.models.causal_vae.conv.FrameCache`).
* ``tile_sample_min_size`` must be a positive multiple of ``4 * spatial factor`` (32): the
  reference silently returns wrongly sized outputs for other values; we raise ``ConfigError``.
  For valid sizes the tiling (tile grid, 25 % overlap, blend order) is the reference's.
* Chunked encode requires ``window_size`` to be a multiple of the temporal factor (8); other
  windows give a different number of latent frames than the unchunked encode.
* The caller's tensors are never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn

from pfctl.errors import ConfigError, InputError
from pfctl.models.causal_vae.blocks import Decoder, Encoder
from pfctl.models.causal_vae.conv import CausalConv3d, FrameCache

__all__ = ["TILE_OVERLAP", "CausalVideoVAE", "DiagonalGaussian"]

#: fraction of a tile shared with its neighbour (reference: 1/4 for encode and decode)
TILE_OVERLAP = 0.25

_DOWN_BLOCK = "DownEncoderBlockCausal3D"
_UP_BLOCK = "UpDecoderBlockCausal3D"


@dataclass
class DiagonalGaussian:
    """Posterior N(mean, std^2) per latent element, from the encoder's raw ``moments``.

    ``moments`` = [mean ; logvar] along channels; logvar is clamped to [-30, 20] before
    ``std = exp(logvar / 2)`` (as the reference).
    """

    moments: Tensor
    mean: Tensor
    logvar: Tensor
    std: Tensor

    @classmethod
    def from_moments(cls, moments: Tensor) -> DiagonalGaussian:
        mean, logvar = torch.chunk(moments, 2, dim=1)
        logvar = torch.clamp(logvar, -30.0, 20.0)
        return cls(moments=moments, mean=mean, logvar=logvar, std=torch.exp(0.5 * logvar))

    @property
    def var(self) -> Tensor:
        return torch.exp(self.logvar)

    def mode(self) -> Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        """mean + std * eps; eps drawn on the generator's device, then moved (diffusers' rule)."""
        device = generator.device if generator is not None else self.mean.device
        eps = torch.randn(self.mean.shape, generator=generator, device=device, dtype=self.mean.dtype)
        return self.mean + self.std * eps.to(self.mean.device)


def _as_list(value: Sequence, n: int, name: str) -> list:
    values = list(value)
    if len(values) != n:
        raise ConfigError(
            f"VAE config {name} has {len(values)} entries, expected {n} (one per block)",
            hint="give one value per entry of block_out_channels",
        )
    return values


def _check_supported(down_types: Sequence[str], up_types: Sequence[str], interpolate: bool) -> None:
    """The config options this implementation does not build fail here, naming the key."""
    bad = [t for t in down_types if t != _DOWN_BLOCK] + [t for t in up_types if t != _UP_BLOCK]
    if bad:
        raise ConfigError(
            f"unsupported VAE block type(s) {sorted(set(bad))}",
            hint=f"CausalVideoVAE builds only {_DOWN_BLOCK} / {_UP_BLOCK}",
        )
    if interpolate:
        raise ConfigError(
            "CausalVideoVAE config has interpolate=true, which the model does not implement",
            hint="set interpolate to false (the released checkpoint is loaded with interpolate=False)",
        )


class CausalVideoVAE(ModelMixin, ConfigMixin):
    """Causal 3-D VAE of Pyramid Flow (MAGVIT-v2-like), config- and key-compatible with the reference.

    Video (B, 3, 1 + 8k, H, W) in [-1, 1] <-> latents (B, 16, 1 + k, H/8, W/8). Frame 0 is
    encoded on its own (an image is a 1-frame video), every later group of 8 frames becomes one
    latent frame. Norms are per frame and convolutions causal, so temporal chunking is exact.
    Only the ``*Causal3D`` block types and ``interpolate=False`` exist (the reference raises on
    anything else too); ``encoder_double_z``, ``*_type``, ``sample_size`` and ``scaling_factor``
    are stored for config compatibility and not used (the encoder always outputs mean and
    log-variance; tiling takes its size as an argument).
    """

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        encoder_in_channels: int = 3,
        encoder_out_channels: int = 4,
        encoder_layers_per_block: tuple[int, ...] = (2, 2, 2, 2),
        encoder_down_block_types: tuple[str, ...] = (_DOWN_BLOCK,) * 4,
        encoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512),
        encoder_spatial_down_sample: tuple[bool, ...] = (True, True, True, False),
        encoder_temporal_down_sample: tuple[bool, ...] = (True, True, True, False),
        encoder_block_dropout: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0),
        encoder_act_fn: str = "silu",
        encoder_norm_num_groups: int = 32,
        encoder_double_z: bool = True,
        encoder_type: str = "causal_vae_conv",
        decoder_in_channels: int = 4,
        decoder_out_channels: int = 3,
        decoder_layers_per_block: tuple[int, ...] = (3, 3, 3, 3),
        decoder_up_block_types: tuple[str, ...] = (_UP_BLOCK,) * 4,
        decoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512),
        decoder_spatial_up_sample: tuple[bool, ...] = (True, True, True, False),
        decoder_temporal_up_sample: tuple[bool, ...] = (True, True, True, False),
        decoder_block_dropout: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0),
        decoder_act_fn: str = "silu",
        decoder_norm_num_groups: int = 32,
        decoder_type: str = "causal_vae_conv",
        sample_size: int = 256,
        scaling_factor: float = 0.18215,
        add_post_quant_conv: bool = True,
        interpolate: bool = False,
        downsample_scale: int = 8,
    ) -> None:
        super().__init__()
        n_enc = len(encoder_block_out_channels)
        n_dec = len(decoder_block_out_channels)
        _check_supported(encoder_down_block_types, decoder_up_block_types, interpolate)
        spatial_down = _as_list(encoder_spatial_down_sample, n_enc, "encoder_spatial_down_sample")
        temporal_down = _as_list(encoder_temporal_down_sample, n_enc, "encoder_temporal_down_sample")
        spatial_up = _as_list(decoder_spatial_up_sample, n_dec, "decoder_spatial_up_sample")
        temporal_up = _as_list(decoder_temporal_up_sample, n_dec, "decoder_temporal_up_sample")
        if sum(spatial_down) != sum(spatial_up) or sum(temporal_down) != sum(temporal_up):
            raise ConfigError(
                "VAE encoder and decoder resample a different number of times",
                hint="encoder_*_down_sample and decoder_*_up_sample must have the same count of true",
            )
        self.encoder = Encoder(
            in_channels=encoder_in_channels,
            latent_channels=encoder_out_channels,
            block_out_channels=list(encoder_block_out_channels),
            layers_per_block=_as_list(encoder_layers_per_block, n_enc, "encoder_layers_per_block"),
            spatial_down=spatial_down,
            temporal_down=temporal_down,
            dropout=_as_list(encoder_block_dropout, n_enc, "encoder_block_dropout"),
            groups=encoder_norm_num_groups,
            act_fn=encoder_act_fn,
        )
        self.decoder = Decoder(
            latent_channels=decoder_in_channels,
            out_channels=decoder_out_channels,
            block_out_channels=list(decoder_block_out_channels),
            layers_per_block=_as_list(decoder_layers_per_block, n_dec, "decoder_layers_per_block"),
            spatial_up=spatial_up,
            temporal_up=temporal_up,
            dropout=_as_list(decoder_block_dropout, n_dec, "decoder_block_dropout"),
            groups=decoder_norm_num_groups,
            act_fn=decoder_act_fn,
        )
        self.quant_conv = CausalConv3d(2 * encoder_out_channels, 2 * encoder_out_channels, 1)
        self.post_quant_conv = CausalConv3d(encoder_out_channels, encoder_out_channels, 1)
        self.spatial_factor = 2 ** sum(spatial_down)
        self.temporal_factor = 2 ** sum(temporal_down)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # Training-from-scratch init of the reference (truncated normal, std 0.02); loaded weights
        # overwrite it. On the meta device these calls cost nothing.
        if isinstance(m, nn.Linear | nn.Conv3d):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.GroupNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def use_channels_last(self, enabled: bool = True) -> CausalVideoVAE:
        """Store conv weights (and hence every activation) as (..., T, H, W, C), or back to the default.

        cuDNN computes 3-D convolutions channels-last; with default-layout activations it transposes
        every conv's input and output. In channels-last mode the norms and upsamplers keep that layout
        too (``FrameGroupNorm`` has its own channels-last path), so nothing is transposed. Results
        agree with the default layout up to float rounding. Returns ``self``.
        """
        return self.to(memory_format=torch.channels_last_3d if enabled else torch.contiguous_format)

    # ------------------------------------------------------------------ validation helpers
    def check_tile_size(self, tile_sample_min_size: int | None) -> int | None:
        """Return the tile size (pixels) if valid, else raise ``ConfigError``.

        Tiles start every ``3S/4`` pixels and each keeps ``S/8 - S/32`` latents; these agree only
        when ``S`` is a multiple of ``4 * spatial_factor`` (32 here).
        """
        if tile_sample_min_size is None:
            return None
        step = 4 * self.spatial_factor
        s = tile_sample_min_size
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0 or s % step:
            raise ConfigError(
                f"VAE tile size {s!r} is not supported: it must be a positive multiple of {step} "
                f"(e.g. {step}, {2 * step}, 128, 256, 512)",
                hint=f"other sizes would return wrongly sized outputs; pick a multiple of {step} "
                "or disable tiling",
            )
        return s

    def _check_video(self, x: Tensor, what: str, channels: int) -> None:
        if x.ndim != 5 or x.shape[1] != channels:
            raise InputError(
                f"VAE {what} expects a (B, {channels}, T, H, W) tensor, got shape {tuple(x.shape)}",
                hint="videos are (batch, channels, frames, height, width); an image is T=1",
            )

    def _chunks(self, n: int, window: int) -> list[tuple[int, int]]:
        """First chunk ``window + 1`` frames, then ``window`` frames, then the remainder."""
        bounds = [(0, min(window + 1, n))]
        start = bounds[0][1]
        while start < n:
            bounds.append((start, min(start + window, n)))
            start = bounds[-1][1]
        return bounds

    # ------------------------------------------------------------------ encode
    def _run_chunks(
        self,
        x: Tensor,
        window: int,
        frames_out: int,
        step: Callable[[Tensor, FrameCache], Tensor],
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Run ``step`` on the temporal chunks of ``x`` (see :meth:`_chunks`) with one carried
        :class:`FrameCache`, copying each result into a tensor of ``frames_out`` frames allocated
        once (in ``dtype``, default the results' own) instead of concatenating a list of parts at
        the end, which would hold the whole output twice."""
        cache = FrameCache()
        out = None
        pos = 0
        with torch.no_grad():
            for i, (a, b) in enumerate(self._chunks(x.shape[2], window)):
                if i:
                    cache.next_chunk()
                part = step(x[:, :, a:b], cache)
                if out is None:
                    n, c, _, h, w = part.shape
                    out = part.new_empty((n, c, frames_out, h, w), dtype=dtype or part.dtype)
                out[:, :, pos : pos + part.shape[2]].copy_(part)
                pos += part.shape[2]
        return out

    def _encode_moments(self, x: Tensor, temporal_chunk: bool, window_size: int) -> Tensor:
        if not temporal_chunk:
            return self.quant_conv(self.encoder(x))
        return self._run_chunks(
            x,
            window_size,
            self.latent_num_frames(x.shape[2]),
            lambda chunk, cache: self.quant_conv(self.encoder(chunk, cache), cache),
        )

    def encode(
        self,
        x: Tensor,
        temporal_chunk: bool = False,
        window_size: int = 16,
        tile_sample_min_size: int | None = None,
    ) -> DiagonalGaussian:
        """Encode pixels (B, 3, T, H, W) in [-1, 1] into the latent posterior.

        ``temporal_chunk``: encode ``window_size + 1`` frames first, then ``window_size`` frames
        at a time, carrying causal context (inference only, runs without autograd; exact up to
        float rounding). ``tile_sample_min_size``: tile size in pixels; tiling happens only when
        H or W exceeds it (``None`` = never tile).
        """
        self._check_video(x, "encode", self.config.encoder_in_channels)
        tile = self.check_tile_size(tile_sample_min_size)
        if temporal_chunk:
            f = self.temporal_factor
            if (
                isinstance(window_size, bool)
                or not isinstance(window_size, int)
                or window_size <= 0
                or window_size % f
            ):
                raise ConfigError(
                    f"temporal chunk window {window_size!r} frames is not supported for encode",
                    hint=f"use a positive multiple of {f} (default 16)",
                )
            if (x.shape[2] - 1) % f:
                raise InputError(
                    f"chunked encode needs 1 + {f}k frames, got {x.shape[2]}",
                    hint=f"trim the clip to 1 + {f}k frames or encode without temporal chunking",
                )
        if tile is not None and (x.shape[-1] > tile or x.shape[-2] > tile):
            moments = self._tiled(
                x,
                tile_in=tile,
                tile_out=tile // self.spatial_factor,
                run=lambda t: self._encode_moments(t, temporal_chunk, window_size),
            )
        else:
            moments = self._encode_moments(x, temporal_chunk, window_size)
        return DiagonalGaussian.from_moments(moments.contiguous())  # latents are small; callers may save them

    # ------------------------------------------------------------------ decode
    def _decode_pixels(
        self, z: Tensor, temporal_chunk: bool, window_size: int, dtype: torch.dtype | None = None
    ) -> Tensor:
        if not temporal_chunk:
            video = self.decoder(self.post_quant_conv(z))
            return video if dtype is None else video.to(dtype)
        return self._run_chunks(
            z,
            window_size,
            self.pixel_num_frames(z.shape[2]),
            lambda chunk, cache: self.decoder(self.post_quant_conv(chunk, cache), cache),
            dtype,
        )

    def decode(
        self,
        z: Tensor,
        temporal_chunk: bool = False,
        window_size: int = 2,
        tile_sample_min_size: int | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Decode latents (B, 16, t, h, w) into pixels (B, 3, 1 + 8(t-1), 8h, 8w), about [-1, 1].

        ``window_size`` is in latent frames (first chunk ``window_size + 1``). Tiling happens only
        when h or w exceeds ``tile_sample_min_size / 8``. ``output_dtype`` (default: the model's):
        chunked and tiled decodes write their pieces straight into a video of that dtype, so a
        float32 result never coexists with a full bf16 copy.
        """
        self._check_video(z, "decode", self.config.decoder_in_channels)
        tile = self.check_tile_size(tile_sample_min_size)
        if temporal_chunk and (
            isinstance(window_size, bool) or not isinstance(window_size, int) or window_size <= 0
        ):
            raise ConfigError(
                f"temporal chunk window {window_size!r} latent frames is not supported for decode",
                hint="use a positive integer (the reference uses 1 or 2)",
            )
        if tile is not None:
            tile_latent = tile // self.spatial_factor
            if z.shape[-1] > tile_latent or z.shape[-2] > tile_latent:
                return self._tiled(
                    z,
                    tile_in=tile_latent,
                    tile_out=tile,
                    run=lambda t: self._decode_pixels(t, temporal_chunk, window_size),
                    dtype=output_dtype,
                )
        return self._decode_pixels(z, temporal_chunk, window_size, output_dtype)

    def forward(
        self, sample: Tensor, sample_posterior: bool = False, generator: torch.Generator | None = None
    ) -> tuple[DiagonalGaussian, Tensor]:
        """Reconstruction for training: encode, take the mean (or a sample), decode."""
        posterior = self.encode(sample)
        z = posterior.sample(generator) if sample_posterior else posterior.mean
        return posterior, self.decode(z)

    # ------------------------------------------------------------------ tiling
    @staticmethod
    def _blend(prev: Tensor, cur: Tensor, extent: int, dim: int) -> Tensor:
        """Cross-fade the first ``extent`` rows of ``cur`` with the last ones of ``prev`` along ``dim``.

        Row y of the result is ``prev[-e + y] * (1 - y/e) + cur[y] * (y/e)``; rows >= e are ``cur``.
        Returns a new tensor. The two products are rounded to the tensors' dtype before the sum,
        as the reference's row-by-row loop with Python-float weights does, so the result is the
        reference's to the bit, in a handful of kernels instead of four per row.
        """
        e = min(prev.shape[dim], cur.shape[dim], extent)
        out = cur.clone()
        if e == 0:
            return out
        opmath = torch.float64 if cur.dtype == torch.float64 else torch.float32
        shape = [1] * cur.ndim
        shape[dim] = e
        ramp = torch.arange(e, dtype=torch.float64, device=cur.device) / e
        w_cur = ramp.to(opmath).view(shape)
        w_prev = (1 - ramp).to(opmath).view(shape)
        a = prev.narrow(dim, prev.shape[dim] - e, e)
        b = cur.narrow(dim, 0, e)
        mixed = (a.to(opmath) * w_prev).to(cur.dtype) + (b.to(opmath) * w_cur).to(cur.dtype)
        out.narrow(dim, 0, e).copy_(mixed)
        return out

    def _tiled(
        self,
        x: Tensor,
        tile_in: int,
        tile_out: int,
        run: Callable[[Tensor], Tensor],
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Run ``run`` on overlapping spatial tiles of ``x`` and stitch the outputs.

        Input tiles of ``tile_in`` start every ``int(tile_in * 3/4)``; output tiles (size
        ``tile_out``) are blended over ``int(tile_out / 4)`` with the tile above, then with the
        tile on the left (both already blended), and their top-left ``tile_out - blend`` part is
        kept. Same visiting order and arithmetic as the reference.

        Unlike the reference, finished tiles are not collected: each one's kept part goes straight
        into the output (allocated once, in ``dtype``, default the tiles' own), and only the edges
        the next tiles blend with are kept: the bottom strip of each tile of the previous row and
        the right strip of the tile on the left. Peak memory is the output plus one tile's work.
        """
        step = int(tile_in * (1 - TILE_OVERLAP))
        extent = int(tile_out * TILE_OVERLAP)
        keep = tile_out - extent
        h, w = x.shape[-2], x.shape[-1]
        rows, cols = range(0, h, step), range(0, w, step)

        def kept(starts: range, n: int) -> int:  # output size along one axis
            return sum(min(keep, (min(s + tile_in, n) - s) * tile_out // tile_in) for s in starts)

        out = None
        above: list[Tensor | None] = [None] * len(cols)  # bottom strip of each tile of the previous row
        for r, i in enumerate(rows):
            left = None
            for c, j in enumerate(cols):
                tile = run(x[:, :, :, i : i + tile_in, j : j + tile_in])
                if r:
                    tile = self._blend(above[c], tile, extent, dim=3)
                if left is not None:
                    tile = self._blend(left, tile, extent, dim=4)
                if out is None:
                    n, ch, t = tile.shape[:3]
                    out = tile.new_empty((n, ch, t, kept(rows, h), kept(cols, w)), dtype=dtype or tile.dtype)
                piece = tile[:, :, :, :keep, :keep]
                top, lft = r * keep, c * keep
                out[:, :, :, top : top + piece.shape[3], lft : lft + piece.shape[4]].copy_(piece)
                above[c] = tile[:, :, :, -extent:].clone()
                left = tile[:, :, :, :, -extent:].clone()
        return out

    # ------------------------------------------------------------------ sizes
    def latent_num_frames(self, num_frames: int) -> int:
        return 1 + (num_frames - 1) // self.temporal_factor

    def pixel_num_frames(self, latent_frames: int) -> int:
        return 1 + (latent_frames - 1) * self.temporal_factor
