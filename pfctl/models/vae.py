"""The VAE adapter interface every pfctl command uses, our causal-VAE adapter, and ``load_vae``.

Commands never call a VAE class directly: they get a :class:`VideoVAE` from :func:`load_vae` and use
``encode`` / ``decode`` / ``normalize`` / ``denormalize`` / ``fingerprint``. This keeps the
frame contract (``1 + temporal_factor * k`` frames), chunking/tiling options and the latent
normalisation the DiT trains on in one place per VAE family.

Latent normalisation (Pyramid Flow pipeline): ``z_norm = (z - shift) * scale`` where frame 0 (the
image frame) uses the image factors and frames 1.. the video factors. A single-frame latent is an
image and gets the image factors only. The inverse is ``z = z_norm / scale + shift``. These are the
reference's exact expressions (same float rounding). Both functions return new tensors; the
reference modifies its input in place, pfctl never does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from pfctl.config.fast import FastPathsConfig
from pfctl.errors import ConfigError, InputError, ModelLoadError, PfctlError
from pfctl.models.causal_vae import CausalVideoVAE
from pfctl.models.posterior import Posterior
from pfctl.utils.io import fingerprint as _fingerprint
from pfctl.utils.io import tensor_fingerprint

__all__ = [
    "FLUX_LATENT_NORM",
    "SD3_LATENT_NORM",
    "TINY_CAUSAL_VAE_CONFIG",
    "LatentNorm",
    "Posterior",
    "PyramidCausalVAE",
    "VideoVAE",
    "build_tiny_causal_vae",
    "denormalize_latents",
    "load_causal_vae_folder",
    "load_vae",
    "normalize_latents",
    "with_fast_paths",
]

Chunking = Literal["none", "framewise", "exact"]
_CHUNKINGS = ("none", "framewise", "exact")


# ---------------------------------------------------------------------------------------------
# latent normalisation
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LatentNorm:
    """Per-frame affine normalisation: frame 0 with the image factors, later frames with the video ones."""

    image_shift: float
    image_scale: float
    video_shift: float
    video_scale: float

    def to_dict(self) -> dict[str, Any]:
        """JSON form, recorded in latent-cache headers so a trainer applies the same rule."""
        return {
            "rule": "frame0_image_rest_video",
            "image_shift": self.image_shift,
            "image_scale": self.image_scale,
            "video_shift": self.video_shift,
            "video_scale": self.video_scale,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatentNorm:
        return cls(
            float(data["image_shift"]),
            float(data["image_scale"]),
            float(data["video_shift"]),
            float(data["video_scale"]),
        )


#: Pyramid Flow with the miniFLUX DiT (shift -0.04, scale 1/1.8726 for the image frame)
FLUX_LATENT_NORM = LatentNorm(
    image_shift=-0.04, image_scale=1 / 1.8726, video_shift=-0.2343, video_scale=1 / 3.0986
)
#: Pyramid Flow with the SD3 MMDiT (same video factors)
SD3_LATENT_NORM = LatentNorm(
    image_shift=0.1490, image_scale=1 / 1.8415, video_shift=-0.2343, video_scale=1 / 3.0986
)


def normalize_latents(z: Tensor, norm: LatentNorm) -> Tensor:
    """Raw VAE latents (B, C, T, h, w) -> the DiT's latent space: ``(z - shift) * scale`` with the image
    factors on frame 0 and the video factors after. Returns a new tensor (both parts written into it;
    concatenated when autograd must see it: ``out=`` ops have no gradient, and the VAE's training
    backpropagates through this)."""
    if torch.is_grad_enabled() and z.requires_grad:
        first = (z[:, :, :1] - norm.image_shift) * norm.image_scale
        return torch.cat([first, (z[:, :, 1:] - norm.video_shift) * norm.video_scale], dim=2)
    out = torch.empty_like(z, memory_format=torch.contiguous_format)
    torch.sub(z[:, :, :1], norm.image_shift, out=out[:, :, :1]).mul_(norm.image_scale)
    torch.sub(z[:, :, 1:], norm.video_shift, out=out[:, :, 1:]).mul_(norm.video_scale)
    return out


def denormalize_latents(z: Tensor, norm: LatentNorm) -> Tensor:
    """Inverse of :func:`normalize_latents` (``z / scale + shift`` per frame). Returns a new tensor."""
    if torch.is_grad_enabled() and z.requires_grad:
        first = z[:, :, :1] / norm.image_scale + norm.image_shift
        return torch.cat([first, z[:, :, 1:] / norm.video_scale + norm.video_shift], dim=2)
    out = torch.empty_like(z, memory_format=torch.contiguous_format)
    torch.div(z[:, :, :1], norm.image_scale, out=out[:, :, :1]).add_(norm.image_shift)
    torch.div(z[:, :, 1:], norm.video_scale, out=out[:, :, 1:]).add_(norm.video_shift)
    return out


# ---------------------------------------------------------------------------------------------
# interface
# ---------------------------------------------------------------------------------------------
@runtime_checkable
class VideoVAE(Protocol):
    """What every command may rely on, whatever the VAE family."""

    name: str
    latent_channels: int
    spatial_factor: int
    temporal_factor: int
    module: torch.nn.Module

    def valid_num_frames(self, n: int) -> int: ...

    def encode(
        self,
        video: Tensor,
        *,
        chunking: Chunking = "none",
        chunk_frames: int | None = None,
        tile: int | None = None,
    ) -> Posterior: ...

    def decode(
        self,
        latents: Tensor,
        *,
        chunking: Chunking = "none",
        chunk_frames: int | None = None,
        tile: int | None = None,
    ) -> Tensor: ...

    def normalize(self, z: Tensor) -> Tensor: ...

    def denormalize(self, z: Tensor) -> Tensor: ...

    def fingerprint(self) -> str: ...


# ---------------------------------------------------------------------------------------------
# our causal VAE
# ---------------------------------------------------------------------------------------------
def _refuse_fp16(dtype: torch.dtype, where: str) -> None:
    if dtype == torch.float16:
        raise ConfigError(
            f"{where}: float16 is not supported for the Pyramid Flow causal VAE (its latents overflow to NaN)",
            hint="use bf16 or fp32 for the VAE",
        )


class PyramidCausalVAE:
    """Adapter of :class:`CausalVideoVAE` to :class:`VideoVAE`.

    Chunking modes: ``"none"`` = one call over the whole clip; ``"framewise"`` = temporal chunks
    of ``chunk_frames`` frames (encode: pixel frames, default 16, multiple of 8; the first chunk
    has one frame more) or latent frames (decode, default 2); ``"exact"`` = the same as
    ``"framewise"``: this VAE's norms are per frame and its convolutions causal with carried
    context, so chunked results equal the unchunked ones up to float rounding (no separate exact
    path is needed, unlike VAEs whose norms span time).

    ``tile`` is the spatial tile size in pixels (multiple of 32; ``None`` = no tiling); tiled
    results differ from untiled ones near tile borders (as in the reference).

    Inputs are moved/cast to the module's device and dtype (never modified); outputs are float32.
    """

    name = "pyramid-causal-vae"

    def __init__(self, module: CausalVideoVAE, latent_norm: LatentNorm = FLUX_LATENT_NORM) -> None:
        param = next(module.parameters())
        _refuse_fp16(param.dtype, "PyramidCausalVAE")
        self.module = module
        self.latent_norm = latent_norm
        self.latent_channels = int(module.config.encoder_out_channels)
        self.spatial_factor = int(module.spatial_factor)
        self.temporal_factor = int(module.temporal_factor)
        #: on CUDA, encode and decode channels-last (cuDNN's layout for 3-D convs, see
        #: ``use_channels_last``): faster for both (benchmarks/RESULTS.md)
        self.channels_last = True

    # -- sizes ---------------------------------------------------------------------------------
    def valid_num_frames(self, n: int) -> int:
        """Largest ``1 + temporal_factor * k <= n`` (0 when ``n < 1``)."""
        if n < 1:
            return 0
        return 1 + ((n - 1) // self.temporal_factor) * self.temporal_factor

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """The module's device and dtype; on CUDA its weights are first put in the layout
        ``channels_last`` asks for (a conversion of about a millisecond, done once)."""
        param = next(self.module.parameters())
        if param.device.type == "cuda":
            weight = self.module.encoder.conv_in.conv.weight
            if weight.is_contiguous(memory_format=torch.channels_last_3d) != self.channels_last:
                self.module.use_channels_last(self.channels_last)
        return param.device, param.dtype

    def _run(self, fn: Any, x: Tensor, chunking: str, window: int, tile: int | None, **extra: Any) -> Any:
        """``fn`` (the module's encode or decode) on ``x`` moved to the module, without gradients."""
        device, dtype = self._placement()
        with torch.no_grad():
            return fn(
                x.to(device=device, dtype=dtype),
                temporal_chunk=chunking != "none",
                window_size=window,
                tile_sample_min_size=tile,
                **extra,
            )

    def _check_chunking(self, chunking: str, allowed: tuple[str, ...]) -> None:
        if chunking not in allowed:
            raise ConfigError(f"unknown VAE chunking {chunking!r}", hint=f"use one of {', '.join(allowed)}")

    # -- encode / decode -----------------------------------------------------------------------
    def encode(
        self,
        video: Tensor,
        *,
        chunking: Chunking = "none",
        chunk_frames: int | None = None,
        tile: int | None = None,
    ) -> Posterior:
        """Pixels (B, 3, 1 + 8k, H, W) in [-1, 1] (H, W multiples of 8) -> posterior over (B, 16, 1 + k, H/8, W/8)."""
        self._check_chunking(chunking, _CHUNKINGS)
        if video.ndim != 5 or video.shape[1] != 3:
            raise InputError(f"VAE encode expects (B, 3, T, H, W) pixels, got shape {tuple(video.shape)}")
        t, h, w = video.shape[2:]
        if t < 1 or (t - 1) % self.temporal_factor:
            raise InputError(
                f"the VAE encodes 1 + {self.temporal_factor}k frames, got {t}",
                hint=f"trim the clip to {self.valid_num_frames(t)} frames (valid_num_frames)",
            )
        if h % self.spatial_factor or w % self.spatial_factor:
            raise InputError(
                f"frame size {h}x{w} is not a multiple of {self.spatial_factor}",
                hint=f"resize or crop frames to multiples of {self.spatial_factor} pixels",
            )
        window = 16 if chunk_frames is None else chunk_frames
        if chunking != "none" and (
            isinstance(window, bool)
            or not isinstance(window, int)
            or window <= 0
            or window % self.temporal_factor
        ):
            raise ConfigError(
                f"chunk_frames={chunk_frames!r} is not a positive multiple of {self.temporal_factor}",
                hint="use e.g. 8, 16 or 32 pixel frames per chunk (default 16)",
            )
        posterior = self._run(self.module.encode, video, chunking, window, tile)
        return Posterior(mean=posterior.mean.float(), std=posterior.std.float())

    def decode(
        self,
        latents: Tensor,
        *,
        chunking: Chunking = "none",
        chunk_frames: int | None = None,
        tile: int | None = None,
    ) -> Tensor:
        """Raw (denormalised) latents (B, 16, t, h, w) -> pixels (B, 3, 1 + 8(t-1), 8h, 8w), about [-1, 1].

        ``chunk_frames`` counts latent frames (default 2; the reference's low-memory decode uses 1).
        """
        self._check_chunking(chunking, _CHUNKINGS)
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise InputError(
                f"VAE decode expects (B, {self.latent_channels}, t, h, w) latents, got shape {tuple(latents.shape)}"
            )
        window = 2 if chunk_frames is None else chunk_frames
        if chunking != "none" and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ConfigError(
                f"chunk_frames={chunk_frames!r} is not a positive number of latent frames",
                hint="use 1 or 2 latent frames per chunk",
            )
        video = self._run(self.module.decode, latents, chunking, window, tile, output_dtype=torch.float32)
        return video.contiguous()

    # -- normalisation / identity --------------------------------------------------------------
    def normalize(self, z: Tensor) -> Tensor:
        return normalize_latents(z, self.latent_norm)

    def denormalize(self, z: Tensor) -> Tensor:
        return denormalize_latents(z, self.latent_norm)

    def fingerprint(self) -> str:
        """Hash of class + config + weights (names, shapes, dtypes, bytes): one pass over the weights."""
        config = {k: v for k, v in self.module.config.items() if not k.startswith("_")}
        return _fingerprint(
            {
                "class": f"{type(self.module).__module__}.{type(self.module).__qualname__}",
                "config": config,
                "weights": tensor_fingerprint(self.module.state_dict()),
            }
        )


# ---------------------------------------------------------------------------------------------
# built-in tiny model
# ---------------------------------------------------------------------------------------------
#: Demonstration config of "causal-vae-tiny": the real block structure (8x/8x, 16 latent channels)
#: with 8/16 channels and one resnet per block. Random weights: it reconstructs nothing, it exists
#: so that commands, tests and the demo run end to end in seconds without a download.
TINY_CAUSAL_VAE_CONFIG: dict[str, Any] = {
    "encoder_in_channels": 3,
    "encoder_out_channels": 16,
    "encoder_layers_per_block": [1, 1, 1, 1],
    "encoder_block_out_channels": [8, 8, 16, 16],
    "encoder_norm_num_groups": 4,
    "decoder_in_channels": 16,
    "decoder_out_channels": 3,
    "decoder_layers_per_block": [1, 1, 1, 1],
    "decoder_block_out_channels": [8, 8, 16, 16],
    "decoder_norm_num_groups": 4,
    "scaling_factor": 0.13025,
    "interpolate": False,
}
TINY_CAUSAL_VAE_SEED = 0


def build_tiny_causal_vae(seed: int = TINY_CAUSAL_VAE_SEED) -> CausalVideoVAE:
    """The "causal-vae-tiny" demonstration model: random but deterministic weights (own generator,
    global RNG untouched): matrices ~ N(0, 1/fan_in), biases 0, norm scales 1."""
    with torch.device("meta"):
        model = CausalVideoVAE(**TINY_CAUSAL_VAE_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, ref in sorted(model.state_dict().items()):
        if ref.ndim >= 2:
            fan_in = ref[0].numel()
            tensors[name] = torch.randn(tuple(ref.shape), generator=gen) / fan_in**0.5
        elif name.endswith("weight") and "norm" in name:
            tensors[name] = torch.ones(tuple(ref.shape))
        else:
            tensors[name] = torch.zeros(tuple(ref.shape))
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_TINY_DIFFUSERS = ("cogvideox-tiny", "wan-tiny", "ltx-tiny", "hunyuan-tiny", "mochi-tiny")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}", hint="use fp32 or bf16") from None


def _place(model: CausalVideoVAE, device: str | torch.device, dtype: torch.dtype) -> CausalVideoVAE:
    # nn.Module.to directly: diffusers' ModelMixin.to logs a spurious "keep in float32" warning
    # whenever a dtype keyword is given, even when no module must stay in float32
    return torch.nn.Module.to(model, device=device, dtype=dtype).eval()


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"no config.json in {path.parent}", hint="point at a VAE folder") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", hint="config.json must be valid JSON") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object", hint="config.json must be a JSON object")
    return data


def load_causal_vae_folder(
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalVideoVAE:
    """Build :class:`CausalVideoVAE` from ``folder/config.json`` and load its weights strictly.

    Weights: ``diffusion_pytorch_model.safetensors`` (or shards), else the official pickled
    ``diffusion_pytorch_model.bin``, read with ``torch.load(weights_only=True)``
    (see :mod:`pfctl.models.weights`). The model is built on the meta device, so no memory or time
    is spent on an initialisation that the weights overwrite.
    """
    from pfctl.models.weights import load_folder_weights, load_into_module

    dtype = _as_dtype(dtype)
    _refuse_fp16(dtype, str(folder))
    folder = Path(folder)
    config_path = folder / "config.json"
    config = _read_config(config_path)
    try:
        with torch.device("meta"):
            model = CausalVideoVAE.from_config(config)
    except PfctlError as exc:
        raise ModelLoadError(f"{config_path}: {exc.message}", hint=exc.hint) from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{config_path}: invalid CausalVideoVAE config: {exc}", hint="compare with a released config.json"
        ) from exc
    load_into_module(model, load_folder_weights(folder), strict=True, assign=True)
    return _place(model, device, dtype)


def _diffusers_vae(
    spec: str, class_name: str | None, dtype: torch.dtype, device: str | torch.device
) -> VideoVAE:
    try:
        from pfctl.models.diffusers_vae import load_diffusers_vae
    except ImportError as exc:
        raise ModelLoadError(
            f"cannot load {spec!r}: diffusers VAE support (pfctl.models.diffusers_vae) is unavailable: {exc}",
            hint="use the Pyramid causal VAE (a CausalVideoVAE folder or 'causal-vae-tiny')",
        ) from exc
    return load_diffusers_vae(spec, class_name, dtype=dtype, device=device)


def _is_diffusers_model_class(name: str) -> bool:
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin

    try:
        obj = getattr(diffusers, name, None)
    except Exception:  # diffusers' lazy module raises on some optional backends
        return False
    return isinstance(obj, type) and issubclass(obj, ModelMixin)


def load_vae(
    spec: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> VideoVAE:
    """Open a VAE by folder or built-in name.

    * ``"default"``: the trained VAE of the embedded shapes demo model (:mod:`pfctl.models.embedded`).
    * ``"causal-vae-tiny"``: the random demonstration VAE (:func:`build_tiny_causal_vae`).
    * other built-in ``*-tiny`` names (``cogvideox-tiny``, ``wan-tiny``, ...): diffusers VAEs.
    * a folder whose ``config.json`` has ``_class_name == "CausalVideoVAE"`` (e.g. the official
      ``causal_video_vae/``), or a checkpoint root holding such a ``causal_video_vae/`` folder.
    * a folder of a diffusers autoencoder class (``AutoencoderKLCogVideoX``, ...).

    ``dtype`` float16 is refused for the causal VAE (NaN latents); use bf16 or fp32.
    """
    dtype = _as_dtype(dtype)
    text = os.fspath(spec)
    if text == "default":  # the embedded shapes demo model's VAE (fingerprint-checked)
        from pfctl.models.embedded import embedded_vae_folder

        adapter = PyramidCausalVAE(load_causal_vae_folder(embedded_vae_folder(), dtype=dtype, device=device))
        adapter.is_demo = True  # type: ignore[attr-defined]
        adapter.demo_name = "the embedded shapes demo VAE (pfctl/assets/shapes-tiny)"  # type: ignore[attr-defined]
        return adapter
    path = Path(text).expanduser()
    if not path.is_dir():
        if text == "causal-vae-tiny":
            _refuse_fp16(dtype, text)
            return PyramidCausalVAE(_place(build_tiny_causal_vae(), device, dtype))
        if text.endswith("-tiny"):
            return _diffusers_vae(text, None, dtype, device)
        raise ModelLoadError(
            f"VAE {text!r} is neither a folder nor a built-in name",
            hint="give a model folder or one of: causal-vae-tiny, " + ", ".join(_TINY_DIFFUSERS),
        )
    if not (path / "config.json").is_file() and (path / "causal_video_vae" / "config.json").is_file():
        path = path / "causal_video_vae"
    config = _read_config(path / "config.json")
    class_name = config.get("_class_name")
    if class_name == "CausalVideoVAE":
        return PyramidCausalVAE(load_causal_vae_folder(path, dtype=dtype, device=device))
    if isinstance(class_name, str) and _is_diffusers_model_class(class_name):
        return _diffusers_vae(str(path), class_name, dtype, device)
    raise ModelLoadError(
        f"{path / 'config.json'}: _class_name {class_name!r} is not a supported VAE",
        hint="expected CausalVideoVAE or a diffusers autoencoder class (e.g. AutoencoderKLCogVideoX)",
    )


def with_fast_paths(vae: VideoVAE, fast: FastPathsConfig) -> VideoVAE:
    """``vae`` with the ``fast:`` paths that concern it applied (:func:`pfctl.models.fast.apply_fast_paths`:
    the causal VAE's fused norms); the fast package is imported only when one is on."""
    module = getattr(vae, "module", None)
    if fast.fused_vae_norm and isinstance(module, CausalVideoVAE):
        from pfctl.models.fast import FastPaths, apply_fast_paths

        apply_fast_paths(module, FastPaths(kernels=fast))
    return vae
