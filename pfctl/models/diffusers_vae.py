"""Adapters that give diffusers' video VAEs the :class:`pfctl.models.vae.VideoVAE` interface.

Each diffusers video VAE chunks time in its own way (CogVideoX always runs the encoder on 8-frame
batches, Wan on 1+4+4+… frames with a feature cache, LTX and HunyuanVideo on overlapping temporal tiles,
Mochi not at all). The adapter makes the three encode modes explicit arguments instead of hidden
module state:

- ``chunking="none"``: one encoder call over the whole clip (for CogVideoX that means calling
  ``encoder`` + ``quant_conv`` directly, because the library has no switch to turn frame batching off);
- ``chunking="framewise"``: the library's own chunked path (``chunk_frames`` picks another chunk size);
- ``chunking="exact"``: chunked with bounded memory *and* equal to ``"none"`` — for time-coupled
  GroupNorms this is :func:`pfctl.models.exact_chunked.exact_chunked_encode` (layer-synchronous
  statistics).

Module state the library keeps (``num_sample_frames_batch_size``, tile sizes, framewise flags) is set
for the duration of one call and restored, so calls never leak settings into each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pfctl.errors import ConfigError, InputError, ModelLoadError
from pfctl.models.posterior import Posterior

DIFFUSERS_CLASSES = (
    "AutoencoderKLCogVideoX",
    "AutoencoderKLWan",
    "AutoencoderKLLTXVideo",
    "AutoencoderKLHunyuanVideo",
    "AutoencoderKLMochi",
)
"""The diffusers video VAE classes pfctl adapts (``_class_name`` in ``config.json``)."""

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "cogvideox-tiny": (
        "AutoencoderKLCogVideoX",
        dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2),
    ),
    "wan-tiny": ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)),
    "ltx-tiny": (
        "AutoencoderKLLTXVideo",
        dict(
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False, False, False, False, False),
            upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1),
            patch_size=1,
            patch_size_t=1,
        ),
    ),
    "hunyuan-tiny": (
        "AutoencoderKLHunyuanVideo",
        dict(
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=2,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        ),
    ),
    "mochi-tiny": (
        "AutoencoderKLMochi",
        dict(
            encoder_block_out_channels=(32, 32, 32, 32),
            decoder_block_out_channels=(32, 32, 32, 32),
            latent_channels=4,
            layers_per_block=(1, 1, 1, 1, 1),
        ),
    ),
}
"""Built-in random-weight configs: they run in well under a second and check the algebra of chunking,
never the size of the error of a trained model."""

CHUNKINGS = ("none", "framewise", "exact")
EXACT_SCHEDULES = ("recompute", "parked")
"""Schedules of the exact chunked encode: ``recompute`` (:mod:`pfctl.models.exact_recompute`, the
default: the framewise path's memory or less with its default smallest chunks, the first conv of
every resnet computed twice) and ``parked``
(:mod:`pfctl.models.exact_chunked`: every chunk's activation kept at each norm; less compute, about
twice the memory; CogVideoX only)."""


def _diffusers_class(class_name: str) -> type:
    if class_name not in DIFFUSERS_CLASSES:
        raise ModelLoadError(
            f"VAE class '{class_name}' is not supported by pfctl's diffusers adapters",
            hint=f"supported: {', '.join(DIFFUSERS_CLASSES)}",
        )
    import diffusers

    return getattr(diffusers, class_name)


def _resolve_folder(path: Path) -> Path:
    """A VAE folder, or a pipeline folder with a ``vae/`` subfolder."""
    if (path / "config.json").is_file():
        return path
    if (path / "vae" / "config.json").is_file():
        return path / "vae"
    raise ModelLoadError(
        f"no config.json in {path} (nor in {path / 'vae'})",
        hint="pass a diffusers VAE folder (save_pretrained layout) or a built-in name such as cogvideox-tiny",
    )


def read_class_name(path: str | Path) -> str | None:
    """``_class_name`` of a folder's config.json (None when the folder has none)."""
    folder = Path(path).expanduser()
    try:
        folder = _resolve_folder(folder)
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (ModelLoadError, OSError, json.JSONDecodeError):
        return None
    name = data.get("_class_name")
    return name if isinstance(name, str) else None


def is_diffusers_spec(spec: str) -> bool:
    """True when ``spec`` names a built-in tiny diffusers VAE or a folder holding a supported class."""
    if spec in TINY_CONFIGS:
        return True
    return read_class_name(spec) in DIFFUSERS_CLASSES


def load_diffusers_vae(
    spec: str,
    class_name: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> DiffusersVideoVAE:
    """Load a diffusers video VAE by built-in tiny name or from a local folder.

    Tiny models are built from a fixed seed without touching the global RNG, so two loads give the same
    weights (and the same fingerprint).
    """
    if spec in TINY_CONFIGS:
        cls_name, kwargs = TINY_CONFIGS[spec]
        cls = _diffusers_class(cls_name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = cls(**kwargs)
        if dtype != torch.float32:
            module = module.to(dtype=dtype)
        module = module.to(device=device).eval()
        return DiffusersVideoVAE(module, spec=spec, is_demo=True)
    folder = Path(spec).expanduser()
    if not folder.exists():
        raise InputError(
            f"VAE '{spec}' is neither a folder nor a built-in name",
            hint=f"built-in tiny VAEs: {', '.join(TINY_CONFIGS)}",
        )
    folder = _resolve_folder(folder)
    cls_name = class_name or read_class_name(folder)
    if cls_name is None:
        raise ModelLoadError(f"{folder / 'config.json'} has no _class_name", hint="pass class_name=")
    cls = _diffusers_class(cls_name)
    try:
        module = cls.from_pretrained(str(folder), torch_dtype=dtype)
    except Exception as exc:  # diffusers raises many types (OSError, ValueError, EnvironmentError)
        raise ModelLoadError(
            f"cannot load {cls_name} from {folder}: {type(exc).__name__}: {exc}",
            hint="check that the folder holds config.json and diffusion_pytorch_model.safetensors",
        ) from None
    module = module.to(device=device).eval()
    return DiffusersVideoVAE(module, spec=str(folder), is_demo=False)


@contextmanager
def _attrs(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration of a block and restore them (library knobs are module state)."""
    old = {k: getattr(obj, k) for k in values}
    try:
        for k, v in values.items():
            setattr(obj, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def _repeat_first(h: torch.Tensor, k: int) -> torch.Tensor:
    """Causal time padding of the clip's first chunk: k - 1 copies of frame 0 in front."""
    return torch.cat([h[:, :, :1]] * (k - 1) + [h], dim=2)


def _hunyuan_conv_patches(encoder: torch.nn.Module, engine: Any) -> list[tuple[torch.nn.Module, Callable]]:
    """HunyuanVideo's causal convs with their time padding from the engine: replicate padding is separable,
    so the spatial part is padded here and the time part (k - 1 copies of frame 0 on the first chunk,
    the previous chunk's frames after) comes from ``engine.causal_input``."""
    import torch.nn.functional as F
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoCausalConv3d

    patches: list[tuple[torch.nn.Module, Callable]] = []
    for name, mod in encoder.named_modules():
        if isinstance(mod, HunyuanVideoCausalConv3d):
            if mod.pad_mode != "replicate":
                raise ConfigError(
                    f"exact chunking needs replicate-padded causal convs ({name}: {mod.pad_mode})"
                )

            def fwd(h: torch.Tensor, _m: Any = mod, _n: str = name) -> torch.Tensor:
                k, stride = _m.conv.kernel_size[0], _m.conv.stride[0]
                h = F.pad(h, (*_m.time_causal_padding[:4], 0, 0), mode="replicate")
                if k > 1:
                    h = engine.causal_input(_n, h, k, stride, partial(_repeat_first, k=k))
                return _m.conv(h)

            patches.append((mod, fwd))
    return patches


def _causal_frame_attention(attn: Any, engine: Any, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """HunyuanVideo's mid-block attention on one chunk: its GroupNorm with the clip's statistics, and each
    of the chunk's frames attending to all frames up to itself, earlier chunks' keys and values from the
    engine (the library's frame-causal mask, without materialising it)."""
    import torch.nn.functional as F

    def run(h: torch.Tensor) -> torch.Tensor:
        B, _, T, H, W = h.shape
        residual = h.permute(0, 2, 3, 4, 1).flatten(1, 3)
        tokens = engine.group_norm(f"attn{index}.group_norm", attn.group_norm, h)
        tokens = tokens.permute(0, 2, 3, 4, 1).flatten(1, 3)
        heads = attn.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, -1, heads, t.shape[-1] // heads).transpose(1, 2)

        q = split(attn.to_q(tokens))
        k = engine.prefix(f"attn{index}.key", split(attn.to_k(tokens)), dim=2)
        v = engine.prefix(f"attn{index}.value", split(attn.to_v(tokens)), dim=2)
        earlier = k.shape[2] - q.shape[2]
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[:, :, t * H * W : (t + 1) * H * W],
                    k[:, :, : earlier + (t + 1) * H * W],
                    v[:, :, : earlier + (t + 1) * H * W],
                )
                for t in range(T)
            ],
            dim=2,
        )
        out = out.transpose(1, 2).reshape(B, -1, heads * q.shape[-1]).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        out = out / attn.rescale_output_factor
        return out.unflatten(1, (T, H, W)).permute(0, 4, 1, 2, 3)

    return run


class DiffusersVideoVAE:
    """The VideoVAE interface over one diffusers video VAE instance (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, *, spec: str, is_demo: bool) -> None:
        self.module = module
        self.spec = spec
        self.is_demo = is_demo
        self.class_name = type(module).__name__
        self.name = self.class_name
        cfg = module.config
        self.latent_channels = int(cfg.latent_channels if "latent_channels" in cfg else cfg.z_dim)
        self.family = {
            "AutoencoderKLCogVideoX": "cogvideox",
            "AutoencoderKLWan": "wan",
            "AutoencoderKLLTXVideo": "ltx",
            "AutoencoderKLHunyuanVideo": "hunyuan",
            "AutoencoderKLMochi": "mochi",
        }[self.class_name]
        self.temporal_factor, self.spatial_factor = self._factors()
        #: bytes of parked norm inputs the exact encode keeps on the GPU before it offloads the rest to
        #: host memory (``offload_above`` of ``exact_chunked_encode``); None = keep everything on the GPU
        self.exact_offload_above: int | None = None
        #: schedule of chunking="exact" (one of EXACT_SCHEDULES)
        self.exact_schedule = "recompute"
        #: bytes the recompute schedule may keep across passes (``checkpoint_bytes``); None = no limit
        self.exact_checkpoint_bytes: int | None = None

    # ------------------------------------------------------------------ shape facts
    def _factors(self) -> tuple[int, int]:
        m, cfg = self.module, self.module.config
        if self.family == "cogvideox":
            return int(cfg.temporal_compression_ratio), 2 ** (len(cfg.block_out_channels) - 1)
        if self.family == "wan":
            t = 2 ** sum(bool(v) for v in cfg.temperal_downsample)
            s = 2 ** len(cfg.temperal_downsample) * (cfg.patch_size or 1)
            return t, s
        return int(m.temporal_compression_ratio), int(m.spatial_compression_ratio)

    @property
    def frame_modulus(self) -> int:
        """Frame counts that round-trip are 1 + modulus·k. CogVideoX's decoder runs latents two at a
        time with the odd remainder first, so only an odd latent count (1 + 2·t·k frames) comes back
        whole; the others follow their temporal factor."""
        return 2 * self.temporal_factor if self.family == "cogvideox" else self.temporal_factor

    @property
    def frame_contract(self) -> str:
        return f"1+{self.frame_modulus}k"

    def valid_num_frames(self, n: int) -> int:
        """Largest contract-valid frame count <= n (0 if none)."""
        if n < 1:
            return 0
        return 1 + self.frame_modulus * ((n - 1) // self.frame_modulus)

    def num_latent_frames(self, n: int) -> int:
        return (n - 1) // self.temporal_factor + 1

    # ------------------------------------------------------------------ chunk plans
    def chunk_align(self) -> int:
        """Chunk sizes (after the first chunk) must be multiples of this to keep strided time ops aligned."""
        return self.temporal_factor

    def chunk_plan(self, num_frames: int, chunk_frames: int | None = None) -> list[int]:
        """Frame counts per encoder call of the framewise path (first chunk takes the remainder).

        For LTX/HunyuanVideo (overlapping temporal tiles) these are the tile *strides*: the boundaries
        where one tile's output hands over to the next.
        """
        T = num_frames
        if self.family == "cogvideox":
            c = chunk_frames or int(self.module.num_sample_frames_batch_size)
            n, r = max(T // c, 1), T % c
            plan = [c + r] + [c] * (n - 1) if n > 1 else [T]
            return plan if sum(plan) == T else [T]
        if self.family == "wan":
            c = chunk_frames or 4
            plan, left = [1], T - 1
            while left > 0:
                plan.append(min(c, left))
                left -= plan[-1]
            return plan
        if self.family in ("ltx", "hunyuan"):
            stride = chunk_frames or int(self.module.tile_sample_stride_num_frames)
            if self._tile_min(chunk_frames) >= T:
                return [T]
            plan, left = [1 + stride], T - 1 - stride
            while left > 0:
                plan.append(min(stride, left))
                left -= plan[-1]
            return plan
        return [T]

    def _tile_min(self, chunk_frames: int | None) -> int:
        m = self.module
        if chunk_frames is None:
            return int(m.tile_sample_min_num_frames)
        ratio = m.tile_sample_min_num_frames / m.tile_sample_stride_num_frames
        return _round_up(round(chunk_frames * ratio), self.temporal_factor)

    def chunking_note(self) -> str:
        """One line on what the library's own chunked path does (printed in reports)."""
        return {
            "cogvideox": "library always frame-batches the encoder (num_sample_frames_batch_size=8, remainder "
            "first) with a causal conv cache; GroupNorm sees one chunk",
            "wan": "library encodes 1, 4, 4, … frames with a feature cache (CACHE_T=2); norms are RMS over C",
            "ltx": "framewise encoding = overlapping temporal tiles (16+1 frames, stride 8, 1 latent blended), "
            "no cache; off by default",
            "hunyuan": "framewise encoding ON by default above 16 frames: overlapping temporal tiles "
            "(16+1 frames, stride 12, blended), no cache",
            "mochi": "no framewise encode (the library raises NotImplementedError: attention over time)",
        }[self.family]

    # ------------------------------------------------------------------ encode
    def _prep(self, video: torch.Tensor) -> torch.Tensor:
        if video.ndim != 5:
            raise InputError(f"video must be (B, C, T, H, W), got shape {tuple(video.shape)}")
        p = next(self.module.parameters())
        return video.to(device=p.device, dtype=p.dtype)

    def encode_moments(
        self, video: torch.Tensor, *, chunking: str = "none", chunk_frames: int | None = None, **exact_kw: Any
    ) -> torch.Tensor:
        """Raw encoder moments (B, 2·C, t, h, w): mean and log-variance stacked on channels."""
        if chunking not in CHUNKINGS:
            raise ConfigError(f"chunking '{chunking}' is not one of {', '.join(CHUNKINGS)}")
        if chunk_frames is not None:
            chunk_frames = _round_up(int(chunk_frames), self.chunk_align())
        x = self._prep(video)
        with torch.no_grad():
            if chunking == "none":
                return self._encode_one_call(x)
            if chunking == "framewise":
                return self._encode_framewise(x, chunk_frames)
            return self._encode_exact(x, chunk_frames, **exact_kw)

    def encode(
        self,
        video: torch.Tensor,
        *,
        chunking: str = "none",
        chunk_frames: int | None = None,
        tile: Any = None,
        **exact_kw: Any,
    ) -> Posterior:
        """Posterior over latents for a (B, 3, T, H, W) clip in [-1, 1]. ``tile`` is not supported here."""
        if tile is not None:
            raise ConfigError(
                "spatial tiling is not offered by pfctl's diffusers adapters", hint="drop tile="
            )
        moments = self.encode_moments(video, chunking=chunking, chunk_frames=chunk_frames, **exact_kw)
        mean, logvar = moments.chunk(2, dim=1)
        logvar = logvar.clamp(-30.0, 20.0)
        return Posterior(mean=mean, std=torch.exp(0.5 * logvar))

    def _encode_one_call(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if self.family == "cogvideox":
            h, _ = m.encoder(x)
            return m.quant_conv(h) if m.quant_conv is not None else h
        if self.family == "wan":
            return self._wan_encode(x, [1, x.shape[2] - 1] if x.shape[2] > 1 else [1])
        if self.family == "ltx":
            return m.encoder(x)
        if self.family == "hunyuan":
            return m.quant_conv(m.encoder(x))
        h, _ = m.encoder(x)
        return h

    def _wan_encode(self, x: torch.Tensor, plan: list[int]) -> torch.Tensor:
        """Wan's encoder over an explicit chunk plan with its feature cache (the first chunk must be 1 frame:
        the time downsamplers skip their strided conv on the first call)."""
        m = self.module
        if m.config.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

            x = patchify(x, patch_size=m.config.patch_size)
        m.clear_cache()
        outs, start = [], 0
        try:
            for n in plan:
                m._enc_conv_idx = [0]
                outs.append(
                    m.encoder(
                        x[:, :, start : start + n], feat_cache=m._enc_feat_map, feat_idx=m._enc_conv_idx
                    )
                )
                start += n
        finally:
            m.clear_cache()
        return m.quant_conv(torch.cat(outs, dim=2))

    def _encode_framewise(self, x: torch.Tensor, chunk_frames: int | None) -> torch.Tensor:
        m, T = self.module, x.shape[2]
        if self.family == "cogvideox":
            c = chunk_frames or int(m.num_sample_frames_batch_size)
            with _attrs(m, num_sample_frames_batch_size=c, use_tiling=False):
                return m._encode(x)
        if self.family == "wan":
            if chunk_frames is None:
                with _attrs(m, use_tiling=False):
                    return m._encode(x)
            return self._wan_encode(x, self.chunk_plan(T, chunk_frames))
        if self.family in ("ltx", "hunyuan"):
            knobs: dict[str, Any] = {"use_tiling": False}
            if chunk_frames is not None:
                knobs.update(
                    tile_sample_min_num_frames=self._tile_min(chunk_frames),
                    tile_sample_stride_num_frames=chunk_frames,
                )
            with _attrs(m, **knobs):
                if m.tile_sample_min_num_frames >= T:
                    return self._encode_one_call(x)
                return m._temporal_tiled_encode(x)
        raise ConfigError(
            "AutoencoderKLMochi has no framewise encode (its encoder attends over time)",
            hint="use chunking='none'",
        )

    def _encode_exact(self, x: torch.Tensor, chunk_frames: int | None, **kw: Any) -> torch.Tensor:
        if self.uses_exact_engine:
            schedule = kw.pop("schedule", self.exact_schedule)
            plan = self.exact_plan(x.shape[2], chunk_frames, schedule)
            if schedule == "recompute":
                from pfctl.models.exact_recompute import exact_recompute_encode

                kw.setdefault("checkpoint_bytes", self.exact_checkpoint_bytes)
                return exact_recompute_encode(self, x, plan, **kw).moments
            if schedule != "parked":
                raise ConfigError(f"exact schedule '{schedule}' is not one of {', '.join(EXACT_SCHEDULES)}")
            if self.family == "hunyuan":
                raise ConfigError(
                    "exact schedule 'parked' is not available for AutoencoderKLHunyuanVideo (its mid-block "
                    "attention spans all earlier frames)",
                    hint="use exact_schedule 'recompute'",
                )
            from pfctl.models.exact_chunked import exact_chunked_encode

            kw.setdefault("offload_above", self.exact_offload_above)
            return exact_chunked_encode(self, x, plan, **kw).moments
        if self.family == "wan":  # every norm is channel-only: the cached framewise path is already exact
            return self._encode_framewise(x, chunk_frames)
        raise ConfigError(
            f"chunking='exact' is not available for {self.class_name}",
            hint="its encoder attends over time or its framewise path carries no conv cache; use 'none'",
        )

    # ---- hooks for pfctl.models.exact_chunked / exact_recompute (exact chunked encode)
    @property
    def uses_exact_engine(self) -> bool:
        """True when chunking="exact" needs an exact schedule (time-coupled GroupNorms)."""
        return self.family in ("cogvideox", "hunyuan")

    def exact_plan(
        self, num_frames: int, chunk_frames: int | None = None, schedule: str | None = None
    ) -> list[int]:
        """Chunk plan of chunking="exact": ``chunk_frames`` when given, else the library's chunks for the
        parked schedule and the smallest aligned chunks for recompute (its peak is one chunk's working
        set plus the checkpoint, so small chunks are what keep it at or under the framewise path's)."""
        if chunk_frames is None and (schedule or self.exact_schedule) == "recompute":
            chunk_frames = self.chunk_align()
        return self.chunk_plan(num_frames, chunk_frames)

    def exact_chunk_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Runs the encoder on one chunk *without* the library's cache (the exact engine carries it)."""
        m = self.module

        def run(chunk: torch.Tensor) -> torch.Tensor:
            h, _ = m.encoder(chunk)
            return m.quant_conv(h) if m.quant_conv is not None else h

        return run

    def exact_stages(self, engine: Any) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
        """The encoder and quant_conv as a list of (name, fn on one chunk) whose composition is the
        one-call encode: conv_in, every resnet and downsampler, the mid block's parts, the tail."""
        m, enc = self.module, self.module.encoder
        cog = self.family == "cogvideox"

        def first(mod: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            return (lambda h: mod(h)[0]) if cog else mod

        stages = [("conv_in", first(enc.conv_in))]
        for i, block in enumerate(enc.down_blocks):
            stages += [(f"down_blocks.{i}.resnets.{j}", first(r)) for j, r in enumerate(block.resnets)]
            stages += [
                (f"down_blocks.{i}.downsamplers.{j}", d) for j, d in enumerate(block.downsamplers or [])
            ]
        mid = enc.mid_block
        attns = [None] * (len(mid.resnets) - 1) if cog else list(mid.attentions)
        stages.append(("mid_block.resnets.0", first(mid.resnets[0])))
        for j, (attn, resnet) in enumerate(zip(attns, mid.resnets[1:], strict=True)):
            if attn is not None:
                stages.append((f"mid_block.attentions.{j}", _causal_frame_attention(attn, engine, j)))
            stages.append((f"mid_block.resnets.{j + 1}", first(resnet)))
        norm_out = enc.norm_out if cog else enc.conv_norm_out

        def tail(h: torch.Tensor) -> torch.Tensor:
            h = first(enc.conv_out)(enc.conv_act(norm_out(h)))
            return m.quant_conv(h) if m.quant_conv is not None else h

        stages.append(("tail", tail))
        return stages

    def exact_patches(self, engine: Any) -> list[tuple[torch.nn.Module, Callable[..., Any]]]:
        """(module, replacement forward) pairs that route causal-conv padding through the engine."""
        if self.family == "hunyuan":
            return _hunyuan_conv_patches(self.module.encoder, engine)
        from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d

        patches: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
        for name, mod in self.module.encoder.named_modules():
            if isinstance(mod, CogVideoXCausalConv3d):
                if mod.pad_mode == "replicate":
                    raise ConfigError(f"exact chunking needs cache-mode causal convs ({name} replicates)")

                def fwd(inputs: torch.Tensor, conv_cache: Any = None, _m: Any = mod, _n: str = name) -> Any:
                    k = _m.time_kernel_size
                    if k > 1:
                        inputs = engine.causal_input(_n, inputs, k, 1, partial(_repeat_first, k=k))
                    return _m.conv(inputs), None

                patches.append((mod, fwd))
        return patches

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        latents: torch.Tensor,
        *,
        chunking: str = "none",
        chunk_frames: int | None = None,
        tile: Any = None,
    ) -> torch.Tensor:
        """Raw latents (not normalised) → (B, 3, T, H, W) in about [-1, 1]."""
        m = self.module
        p = next(m.parameters())
        z = latents.to(device=p.device, dtype=p.dtype)
        with torch.no_grad():
            if chunking == "none" and self.family == "cogvideox":
                if m.post_quant_conv is not None:
                    z = m.post_quant_conv(z)
                return m.decoder(z)[0]
            if chunking == "none" and self.family in ("ltx", "hunyuan"):
                with _attrs(m, use_framewise_decoding=False, use_tiling=False):
                    return m.decode(z).sample
            with _attrs(m, use_tiling=False):
                return m.decode(z).sample

    # ------------------------------------------------------------------ normalisation
    def _norm_factors(self, z: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | float, float]:
        cfg = self.module.config
        scale = float(cfg.get("scaling_factor", 1.0) or 1.0)
        mean = cfg.get("latents_mean")
        std = cfg.get("latents_std")
        if mean is None and isinstance(getattr(self.module, "latents_mean", None), torch.Tensor):
            mean, std = self.module.latents_mean.tolist(), self.module.latents_std.tolist()  # LTX: buffers
        if mean is not None and std is not None:
            shape = (1, -1) + (1,) * (z.ndim - 2)
            m = torch.tensor(mean, dtype=z.dtype, device=z.device).view(shape)
            s = torch.tensor(std, dtype=z.dtype, device=z.device).view(shape)
            return m, s, scale
        shift = float(cfg.get("shift_factor", 0.0) or 0.0)
        if cfg.get("invert_scale_latents", False):
            scale = 1.0 / scale
        return shift, 1.0, scale

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """The latent normalisation the diffusion model of this VAE trains on (never in place)."""
        mean, std, scale = self._norm_factors(z)
        return (z - mean) * scale / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std, scale = self._norm_factors(z)
        return z * std / scale + mean

    def fingerprint(self) -> str:
        from pfctl.utils.io import fingerprint, tensor_fingerprint

        cfg = {k: v for k, v in dict(self.module.config).items() if not k.startswith("_")}
        weights = tensor_fingerprint(self.module.state_dict())
        return fingerprint({"class": self.class_name, "config": cfg, "weights": weights})
