"""``pfctl generate``: prompts (and an optional first frame) → mp4 files with JSON sidecars.

The pipeline, in the order it runs:

1. check every input that can be checked cheaply (prompts, images, output folder) *before*
   loading a model, so bad input fails in a second and leaves nothing behind;
2. load DiT + VAE + text encoders (:func:`pfctl.models.checkpoint.load_components`) and pick
   the output size the model was trained for;
3. encode all prompts once (with the reference's aesthetic suffix; the negative prompt for CFG);
4. per video: draw the noise from a seeded CPU generator (the same video on any device), encode
   the i2v image as unit 0, run :func:`pfctl.sampling.sampler.generate_latents`;
5. de-normalise (a new tensor; the reference modifies its input) and decode with temporal
   chunking / spatial tiling (:func:`decode_latents`), convert to uint8 like the reference;
6. write the mp4 (PyAV, H.264 yuv420p) under a name that is never taken twice, then its JSON
   sidecar, both atomically.

With ``generate.offload`` the text encoders and the VAE live on the CPU and visit the GPU only
for their phase (and the DiT leaves the GPU while the VAE decodes), as the reference's
``cpu_offloading`` does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfctl.config.generate import RESOLUTIONS, GenerateConfig, PromptSpec, frames_for_temp
from pfctl.errors import ConfigError, InputError, ModelLoadError
from pfctl.runtime import logging as pflog

__all__ = [
    "GenerateReport",
    "PromptSpec",
    "VideoResult",
    "declared_sizes",
    "decode_latents",
    "encode_image_latent",
    "load_sidecar",
    "prepare_image",
    "resolve_size",
    "run_generate",
    "sidecar_to_run",
]

SIDECAR_FORMAT = "pfctl-generate-sidecar"
SIDECAR_VERSION = 1
SIZE_MULTIPLE = 64
"""Pixel sizes must be multiples of 8 (VAE) x 4 (two pyramid halvings) x 2 (DiT patch)."""


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoResult:
    """One written video."""

    path: Path
    sidecar: Path
    prompt: str
    seed: int
    num_frames: int
    width: int
    height: int
    fps: float
    temp: int
    image: str | None = None
    latents_path: Path | None = None
    seconds: float = 0.0
    latents: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Final normalised latents (B, C, temp, h, w), only with ``keep_latents=True``."""
    image_latent: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """The normalised i2v image latent (unit 0), only with ``keep_latents=True``."""


@dataclass(frozen=True)
class GenerateReport:
    """What :func:`run_generate` did."""

    videos: list[VideoResult]
    output_dir: Path
    model: dict[str, Any]
    width: int
    height: int
    seconds: float
    peak_memory_bytes: int | None = None


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _as_specs(prompts: Sequence[str | PromptSpec] | str | PromptSpec | None) -> list[PromptSpec]:
    if prompts is None:
        raise InputError("nothing to generate: no prompt given", hint='pass a prompt ("" = unconditional)')
    if isinstance(prompts, (str, PromptSpec)):
        prompts = [prompts]
    specs = []
    for item in prompts:
        if isinstance(item, PromptSpec):
            specs.append(item)
        elif isinstance(item, str):
            specs.append(PromptSpec(prompt=item))
        else:
            raise InputError(f"a prompt must be a string or PromptSpec, got {type(item).__name__}")
    if not specs:
        raise InputError("nothing to generate: the prompt list is empty")
    for spec in specs:
        where = f" ({spec.source})" if spec.source else ""
        if spec.temp is not None and (isinstance(spec.temp, bool) or spec.temp < 1):
            raise ConfigError(
                f"temp {spec.temp}{where} is not valid: temp counts latent frames and must be >= 1",
                hint="temp 16 gives 121 frames (≈5 s at 24 fps)",
            )
        if spec.num_videos is not None and spec.num_videos < 1:
            raise ConfigError(f"num_videos {spec.num_videos}{where} must be >= 1")
    return specs


def _check_output_dir(path: Path) -> None:
    """Create ``path`` and prove it is writable (before any model is loaded)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InputError(
            f"output folder {path} is not writable: {reason}",
            hint="choose another folder with --output-dir / generate.output_dir",
        ) from None


def prepare_image(path: str | os.PathLike[str], width: int, height: int) -> tuple[np.ndarray, torch.Tensor]:
    """Read an image, resize it to cover ``width`` x ``height`` and cut the centre (as the
    reference's demo app does). Returns the uint8 pixels (H, W, 3) and the VAE input
    (1, 3, 1, H, W) in [-1, 1]."""
    from pfctl.sampling.video_io import image_to_tensor, load_image, resize_cover_center_crop

    pixels = resize_cover_center_crop(load_image(path), width, height)
    return pixels, image_to_tensor(pixels)


def _file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------


def _size_from(value: Any) -> tuple[int, int] | None:
    if isinstance(value, str) and value in RESOLUTIONS:
        return RESOLUTIONS[value]
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _embedded_resolution(info: dict[str, Any]) -> Any:
    """The trained size of the embedded model, when ``info`` is it or an export fine-tuned from it."""
    embedded = info.get("embedded")
    if isinstance(embedded, dict):
        return embedded.get("resolution")
    bases = [info.get("base_model_path"), (info.get("export") or {}).get("base_model_path")]
    if not any(bases):
        return None
    from pfctl.models.embedded import has_embedded_model, is_embedded_root, read_manifest

    if has_embedded_model() and any(is_embedded_root(b) for b in bases if b):
        return read_manifest().get("resolution")
    return None


def declared_sizes(info: dict[str, Any], variant: str | None) -> list[tuple[int, int]]:
    """(width, height) sizes a loaded model declares, from (first match wins):

    * a pfctl export's marker ``extra``: ``resolution`` ([W, H] or "384p"), ``resolutions`` (a
      list) or ``variant``;
    * the embedded model's manifest (also for exports fine-tuned from it);
    * an official folder's DiT variant (``..._384p`` → 640x384, ``..._768p`` → 1280x768).

    Empty when unknown (e.g. ``diffusion_transformer_image``).
    """
    extra = (info.get("export") or {}).get("extra") or {}
    sizes: list[tuple[int, int]] = []
    if isinstance(extra, dict):
        for item in [extra.get("resolution"), *(extra.get("resolutions") or [])]:
            size = _size_from(item)
            if size and size not in sizes:
                sizes.append(size)
        if sizes:
            return sizes
        if isinstance(extra.get("variant"), str):
            variant = extra["variant"]
    embedded = _size_from(_embedded_resolution(info))
    if embedded:
        return [embedded]
    if variant:
        for name, size in RESOLUTIONS.items():
            if variant == name or variant.endswith("_" + name):
                return [size]
    return []


def resolve_size(
    gen: GenerateConfig, declared: Sequence[tuple[int, int]], model_desc: str
) -> tuple[int, int]:
    """The (width, height) to generate, checked against what the model supports."""
    if gen.width is not None and gen.height is not None:
        size, source = (gen.width, gen.height), "generate.width/height"
    elif gen.resolution != "auto":
        size, source = RESOLUTIONS[gen.resolution], f"generate.resolution={gen.resolution}"
    elif declared:
        size, source = tuple(declared[0]), "the model"
    else:
        raise ConfigError(
            f"{model_desc} does not declare its resolution",
            hint="set generate.resolution (384p or 768p) or generate.width and generate.height",
        )
    width, height = int(size[0]), int(size[1])
    if width % SIZE_MULTIPLE or height % SIZE_MULTIPLE:
        raise ConfigError(
            f"{width}x{height} (from {source}) is not a multiple of {SIZE_MULTIPLE} pixels",
            hint="sizes go through the VAE (/8), two pyramid halvings (/4) and 2x2 patches: use "
            "multiples of 64, e.g. 640x384 or 1280x768",
        )
    if declared and (width, height) not in [tuple(s) for s in declared]:
        listed = ", ".join(f"{w}x{h}" for w, h in declared)
        if gen.strict_resolution:
            raise ConfigError(
                f"{model_desc} generates {listed}, not {width}x{height} (from {source}); "
                "Pyramid Flow models have no dynamic resolution",
                hint=f"use {listed}, or --set generate.strict_resolution=false to try anyway",
            )
        pflog.warn(
            f"{width}x{height} is not a size {model_desc} was trained for ({listed}); quality may suffer"
        )
    return width, height


# --------------------------------------------------------------------------------------------
# Decode and image encode: the pieces parity tests call directly
# --------------------------------------------------------------------------------------------


def decode_latents(
    vae: Any,
    latents: torch.Tensor,
    *,
    chunking: str = "framewise",
    window: int = 1,
    tile: int | None = 256,
    normalized: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents → (decoder output (B, 3, T, H, W) float32, frames (B, T, H, W, 3) uint8).

    ``normalized=True`` first applies the VAE adapter's ``denormalize`` (frame 0 image factors,
    later frames video factors) — into a new tensor, the caller's latents are left alone.
    ``chunking="framewise"`` decodes ``window`` latent frames at a time (the reference: 1 with
    ``save_memory``, else 2); ``tile`` is the spatial tile in pixels (None = never tile).
    uint8 conversion is the reference's: ``x * 127.5 + 127.5``, clamp, truncate.
    """
    from pfctl.sampling.video_io import frames_to_uint8

    # fp32 for the affine map: bf16 sampler output would lose bits to the 1/scale multiply
    z = vae.denormalize(latents.float()) if normalized else latents
    video = vae.decode(z, chunking=chunking, chunk_frames=window if chunking != "none" else None, tile=tile)
    return video, frames_to_uint8(video)


AUTO_TILE = 256
"""The tile ``decode_tile: auto`` falls back to when an untiled decode would not fit."""
UNTILED_DECODE_BYTES_PER_PIXEL = (19_000, 12_500)
"""Peak memory of an untiled causal-VAE decode in bf16 with a float32 result, per pixel of a frame:
(fixed, per latent frame of the window). Measured on an H200 at 640x384, 16 latent frames, channels-last
with the fused norms (window 1: 7.00 GiB, window 2: 9.82 GiB, bf16 result; the float32 result adds
726 bytes per pixel to the fixed part)."""


def host_frames(frames: torch.Tensor) -> np.ndarray:
    """Decoded uint8 frames as a host array, copied from a GPU through pinned memory: on an H200 a 768p
    video's frames (357 MB) took 224 ms to copy into pageable memory and 6.5 ms into pinned memory (PyTorch
    caches the pinned block, so later videos reuse it)."""
    if frames.device.type != "cuda":
        return frames.numpy()
    host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
    host.copy_(frames)
    return host.numpy()


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation could use: the device's free memory plus what PyTorch holds unused
    (CUDA), or the host's available memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_decode_tile(
    tile: int | str | None,
    *,
    height: int,
    width: int,
    window: int,
    dtype: torch.dtype,
    available: int,
) -> int | None:
    """The tile size a decode of ``height`` x ``width`` frames uses: ``tile`` itself unless it is
    ``"auto"``, then no tiling when the untiled decode's estimated peak (``window`` latent frames per
    decoder call) fits in 80% of ``available`` bytes, else :data:`AUTO_TILE`. Untiled decoding is
    both faster (a tile grid decodes ~2x the pixels: its tiles overlap) and free of blending seams."""
    if tile != "auto":
        return tile  # type: ignore[return-value]
    fixed, per_frame = UNTILED_DECODE_BYTES_PER_PIXEL
    need = (fixed + per_frame * window) * height * width * dtype.itemsize / 2
    return None if need <= 0.8 * available else AUTO_TILE


def encode_image_latent(
    vae: Any, image_tensor: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, Any]:
    """The i2v unit 0: VAE posterior of the image, a *sample* of it (as the reference draws),
    normalised with the image factors. Returns (normalised latent (1, C, 1, h, w), posterior)."""
    posterior = vae.encode(image_tensor, chunking="none", tile=None)
    sample = posterior.sample(generator)
    return vae.normalize(sample), posterior


# --------------------------------------------------------------------------------------------
# Model loading
# --------------------------------------------------------------------------------------------


def _export_has_ema(path: Path) -> bool:
    from pfctl.models.checkpoint import EXPORT_MARKER, read_export_marker

    if not (path / EXPORT_MARKER).is_file():
        return False
    return bool(read_export_marker(path).get("transformer_ema"))


def _load(config: Any, dtype: torch.dtype, device: torch.device | str) -> Any:
    from pfctl.models import checkpoint

    path = config.model.path
    kwargs: dict[str, Any] = {
        "variant": config.model.variant,
        "need": ("dit", "vae", "text"),
        "dtype": dtype,
        "device": device,
        "vae": config.model.vae,
    }
    if path is None:
        try:
            return checkpoint.load_components(None, **kwargs)
        except TypeError as exc:
            if "NoneType" not in str(exc):
                raise
            raise ModelLoadError(
                "no model given and this pfctl ships no default model",
                hint="pass a Pyramid Flow folder or pfctl export with --model / model.path",
            ) from None
    root = Path(path).expanduser()
    if root.is_dir() and _export_has_ema(root):
        kwargs["use_ema"] = True
    return checkpoint.load_components(root, **kwargs)


def _read_adapters(gen: GenerateConfig) -> list[Any]:
    """Read every ``generate.lora`` folder now (a bad path fails before a model is loaded)."""
    if not gen.lora:
        return []
    from pfctl.models.lora import read_lora

    return [read_lora(ref.path, ref.scale) for ref in gen.lora]


def _with_lora_base(config: Any, adapter: Any) -> Any:
    """No ``model.path``: load the base model the adapter was trained on (its marker names it)."""
    marker = adapter.marker or {}
    base = marker.get("base_model_path")
    if not base:
        raise ConfigError(
            f"LoRA {adapter.path} does not name its base model (trained from a preset, or a foreign adapter)",
            hint="pass the base model with --model",
        )
    if not Path(base).is_dir():
        raise ModelLoadError(
            f"the base model of LoRA {adapter.path} is gone: {base}", hint="pass the base model with --model"
        )
    update: dict[str, Any] = {"path": base}
    if marker.get("variant"):
        update["variant"] = marker["variant"]
    pflog.log(f"LoRA {adapter.path}: base model {base}")
    return config.model_copy(update={"model": config.model.model_copy(update=update)})


def _apply_adapters(dit: Any, adapters: list[Any], components: Any, *, owned: bool) -> Any:
    """Attach the adapters to the DiT (a copy when the caller owns the components)."""
    import copy

    from pfctl.models.lora import _check_base, apply_lora

    _check_base(adapters, dict(getattr(components, "info", {}) or {}))
    if not owned:
        dit = copy.deepcopy(dit)
    dtype = next(dit.parameters()).dtype
    apply_lora(dit, adapters, dtype=dtype)
    listed = ", ".join(f"{a.path} x{a.scale:g}" for a in adapters)
    pflog.log(f"LoRA applied: {listed}")
    return dit.eval()


def _adapter_fingerprint(adapter: Any) -> str:
    from pfctl.utils.io import tensor_fingerprint

    return tensor_fingerprint(adapter.state)


def _resolve_dtype(gen: GenerateConfig, model_dtype: str, device_type: str) -> torch.dtype:
    name = gen.dtype
    if name == "auto":
        name = model_dtype if device_type == "cuda" else "fp32"
    if name == "fp16":
        raise ConfigError(
            "fp16 is not supported for generation (the causal VAE gives NaN in fp16)",
            hint="use --set model.dtype=bf16 (or generate.dtype=fp32)",
        )
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _move(module: Any, device: torch.device | str) -> None:
    if module is not None:
        module.to(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _finished(device: torch.device) -> float:
    """The time once the GPU's queued work is done: the sidecar's timings are of the work, not of its launch
    (without it, the sampling's last kernels counted as decode and the decode's last as neither)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --------------------------------------------------------------------------------------------
# Naming and sidecars
# --------------------------------------------------------------------------------------------


def _slug(text: str, limit: int = 60) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:limit].rstrip("-") or "unconditional"


def _video_stem(spec: PromptSpec, seed: int) -> str:
    base = _slug(spec.name) if spec.name else _slug(spec.prompt)
    return f"{base}_seed{seed}"


def _sidecar_path(video: Path) -> Path:
    return video.with_suffix(".json")


def _taken(candidate: Path) -> bool:
    return candidate.exists() or _sidecar_path(candidate).exists()


def load_sidecar(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a video's JSON sidecar (``video.json`` or the ``video.mp4`` next to it)."""
    path = Path(path)
    if path.suffix == ".mp4":
        path = _sidecar_path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"sidecar {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read sidecar {path}: {exc}") from None
    if data.get("format") != SIDECAR_FORMAT:
        raise InputError(f"{path} is not a pfctl generate sidecar (format={data.get('format')!r})")
    return data


def sidecar_to_run(sidecar: dict[str, Any], base: Any | None = None) -> tuple[Any, PromptSpec]:
    """(config, prompt) that regenerate the video a sidecar describes (same seed, settings, model).

    ``base`` supplies sections the sidecar does not record (runtime device, ...); the
    ``generate:`` section and ``model.path/variant/vae`` come from the sidecar.
    """
    from pfctl.config.schema import RecipeConfig

    base = base or RecipeConfig()
    gen = dict(sidecar["settings"]["generate"])
    gen.update({"seed": sidecar["seed"], "num_videos": 1, "temp": sidecar["temp"]})
    gen["guidance_scale"] = sidecar["guidance_scale"]
    gen["video_guidance_scale"] = sidecar["video_guidance_scale"]
    gen["negative_prompt"] = sidecar["negative_prompt"]
    model = base.model.model_copy(
        update={k: sidecar["model"].get(k) for k in ("path", "variant", "vae") if k in sidecar["model"]}
    )
    generate = GenerateConfig.model_validate({**base.generate.model_dump(), **gen})
    config = base.model_copy(update={"model": model, "generate": generate})
    spec = PromptSpec(prompt=sidecar["prompt"], image=(sidecar.get("image") or {}).get("path"))
    return config, spec


def _sidecar(
    *,
    config: Any,
    spec: PromptSpec,
    prompt_used: str,
    negative_prompt: str,
    seed: int,
    temp: int,
    guidance_scale: float,
    video_guidance_scale: float,
    width: int,
    height: int,
    video_path: Path,
    image_info: dict[str, Any] | None,
    model_info: dict[str, Any],
    runtime_info: dict[str, Any],
    timing: dict[str, float],
    latents_path: Path | None,
) -> dict[str, Any]:
    from pfctl import __version__
    from pfctl.utils.io import fingerprint

    gen = config.generate
    settings = gen.model_dump(mode="json")
    num_frames = frames_for_temp(temp)
    return {
        "format": SIDECAR_FORMAT,
        "format_version": SIDECAR_VERSION,
        "pfctl_version": __version__,
        "video": video_path.name,
        "prompt": spec.prompt,
        "prompt_used": prompt_used,
        "negative_prompt": negative_prompt,
        "seed": seed,
        "temp": temp,
        "num_frames": num_frames,
        "width": width,
        "height": height,
        "fps": gen.fps,
        "duration_s": num_frames / gen.fps,
        "guidance_scale": guidance_scale,
        "video_guidance_scale": video_guidance_scale,
        "mode": "i2v" if image_info else "t2v",
        "image": image_info,
        "latents": latents_path.name if latents_path else None,
        "model": model_info,
        "runtime": runtime_info,
        "settings": {"generate": settings, "config_fingerprint": fingerprint(config.model_dump(mode="json"))},
        "timing_s": timing,
    }


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


@dataclass
class _Job:
    spec: PromptSpec
    index: int  # video index within the prompt
    seed: int
    temp: int
    guidance_scale: float
    video_guidance_scale: float
    negative_prompt: str
    image_path: str | None


def _plan_jobs(
    specs: list[PromptSpec], gen: GenerateConfig, default_seed: int, image: str | None
) -> list[_Job]:
    jobs = []
    for spec in specs:
        base_seed = (
            spec.seed if spec.seed is not None else (gen.seed if gen.seed is not None else default_seed)
        )
        for k in range(spec.num_videos or gen.num_videos):
            jobs.append(
                _Job(
                    spec=spec,
                    index=k,
                    seed=int(base_seed) + k,
                    temp=int(spec.temp or gen.temp),
                    guidance_scale=float(
                        spec.guidance_scale if spec.guidance_scale is not None else gen.guidance_scale
                    ),
                    video_guidance_scale=float(
                        spec.video_guidance_scale
                        if spec.video_guidance_scale is not None
                        else gen.video_guidance_scale
                    ),
                    negative_prompt=spec.negative_prompt
                    if spec.negative_prompt is not None
                    else gen.negative_prompt,
                    image_path=spec.image or image,
                )
            )
    return jobs


def _prompt_used(prompt: str, suffix: str) -> str:
    """The reference appends its aesthetic suffix; an empty prompt stays empty (unconditional)."""
    return prompt + suffix if prompt.strip() else ""


def _dit_calls(job: _Job, gen: GenerateConfig) -> int:
    video = sum(gen.video_num_inference_steps) * (job.temp - 1)
    return video if job.image_path else sum(gen.num_inference_steps) + video


def run_generate(
    config: Any,
    prompts: Sequence[str | PromptSpec] | str | PromptSpec | None,
    *,
    image: str | os.PathLike[str] | None = None,
    components: Any = None,
    runtime: Any = None,
    keep_latents: bool = False,
) -> GenerateReport:
    """Generate one mp4 (+ JSON sidecar) per prompt and seed; see the module docstring.

    Args:
        config: the validated :class:`~pfctl.config.schema.RecipeConfig` (``generate``, ``model``
            and ``runtime`` sections are used).
        prompts: strings or :class:`PromptSpec` (per-prompt seed/temp/guidance/image/...).
        image: image-to-video for every prompt without its own ``image``.
        components: already loaded :class:`pfctl.models.checkpoint.Components` (skips loading).
        runtime: an existing :class:`pfctl.runtime.accelerator.Runtime` (else one is built).
        keep_latents: return the final latents (and the i2v image latent) in each result.
    """
    from pfctl.sampling.sampler import TextConditioning, generate_latents

    start = time.perf_counter()
    gen: GenerateConfig = config.generate

    # 1. inputs, before anything heavy ----------------------------------------------------------
    specs = _as_specs(prompts)
    image = os.fspath(image) if image is not None else None
    for path in {s.image or image for s in specs} - {None}:
        from pfctl.sampling.video_io import load_image

        load_image(path)  # unreadable / missing image → InputError now, not after loading a model
    if any(not s.prompt.strip() for s in specs):
        pflog.warn("empty prompt: generating without text conditioning (the null text); no suffix is added")
    output_dir = Path(gen.output_dir).expanduser()
    _check_output_dir(output_dir)

    # 2. runtime, model, size -------------------------------------------------------------------
    if runtime is None:
        from pfctl.runtime.accelerator import build_runtime

        runtime = build_runtime(config.runtime)
    device = torch.device(runtime.device)
    dtype = _resolve_dtype(gen, config.model.dtype, device.type)
    offload = gen.offload and device.type != "cpu"
    if gen.offload and not offload:
        pflog.log("generate.offload has no effect on the CPU")
    adapters = _read_adapters(gen)
    if adapters and config.model.path is None and components is None:
        config = _with_lora_base(config, adapters[0])
    loaded_here = components is None
    if components is None:
        components = _load(config, dtype, "cpu" if offload else device)
    dit, vae, text_encoder = components.dit, components.vae, components.text_encoder
    if adapters and dit is not None:
        dit = _apply_adapters(dit, adapters, components, owned=loaded_here)
    missing = [n for n, c in (("DiT", dit), ("VAE", vae), ("text encoder", text_encoder)) if c is None]
    if missing:
        raise ModelLoadError(f"generate needs a DiT, a VAE and text encoders; missing: {', '.join(missing)}")
    info = dict(getattr(components, "info", {}) or {})
    # the embedded demo model (and exports fine-tuned from it) brings its own size/steps/guidance
    from pfctl.models.embedded import apply_generate_defaults

    config = apply_generate_defaults(config, info)
    gen = config.generate
    model_desc = f"model {info.get('root') or config.model.path or '(given components)'}"
    # An export's size comes from its marker; model.variant names a subfolder of official folders only.
    variant = config.model.variant if info.get("layout") in ("official", "dit-folder", None) else None
    if isinstance(info.get("embedded"), dict):
        variant = info["embedded"].get("variant") or variant
    width, height = resolve_size(gen, declared_sizes(info, variant), model_desc)
    spatial = int(getattr(vae, "spatial_factor", 8))
    latent_h, latent_w = height // spatial, width // spatial
    latent_channels = int(getattr(vae, "latent_channels", 16))

    if offload:
        _move(dit, device)
    dit.set_attention_backend(gen.attention, gen.skip_future_keys, gen.row_group_min_tokens)
    compiled = gen.compile and device.type == "cuda"
    if gen.compile and not compiled:
        pflog.log("generate.compile is ignored on the CPU")
    if config.fast.any_on or compiled:
        from pfctl.models.fast import FastPaths, apply_fast_paths
        from pfctl.models.vae import with_fast_paths

        # automatic dynamic shapes: the token counts become dynamic once they change, the head sizes stay
        # static (with every size dynamic, the graphs around row-grouped attention ran generic kernels)
        applied = apply_fast_paths(dit, FastPaths(config.fast, compile=compiled, dynamic=None))
        pflog.log("fast paths: " + (", ".join(applied) or "none"))
        vae = with_fast_paths(vae, config.fast)

    jobs = _plan_jobs(specs, gen, runtime.seed, image)
    # several processes: each takes every world_size-th video (names never collide: exclusive publish)
    jobs = jobs[runtime.rank :: runtime.world_size] if runtime.world_size > 1 else jobs

    # 3. text phase -----------------------------------------------------------------------------
    if offload:
        text_encoder.to(device)
    cache: dict[str, Any] = {}

    def embed(text: str) -> Any:
        if text not in cache:
            cache[text] = text_encoder.empty_embedding() if text == "" else text_encoder.encode([text])
        return cache[text]

    conditioning = {}
    for job in jobs:
        used = _prompt_used(job.spec.prompt, gen.prompt_suffix)
        conditioning[id(job)] = (used, TextConditioning.from_pair(embed(used), embed(job.negative_prompt)))
    if offload:
        conditioning = {k: (used, _cond_to(c, device)) for k, (used, c) in conditioning.items()}
        text_encoder.to("cpu")
        _empty_cache(device)

    # 4-6. per video ----------------------------------------------------------------------------
    model_info = {
        "path": str(config.model.path) if config.model.path is not None else None,
        "root": info.get("root"),
        "layout": info.get("layout"),
        "variant": config.model.variant,
        "vae": config.model.vae,
        "model_name": info.get("model_name"),
        "dit_class": info.get("dit_class") or type(dit).__name__,
        "use_ema": bool(info.get("use_ema", _is_ema_load(config))),
        "fingerprints": info.get("fingerprints") or {},
        "lora": [
            {"path": str(a.path.resolve()), "scale": a.scale, "rank": a.config.get("r"),
             "fingerprint": _adapter_fingerprint(a)}
            for a in adapters
        ],
    }  # fmt: skip
    runtime_info = {
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "world_size": runtime.world_size,
    }
    image_cache: dict[str, tuple[np.ndarray, torch.Tensor, dict[str, Any]]] = {}
    results: list[VideoResult] = []
    graphs = None
    if gen.cuda_graphs and device.type == "cuda" and not offload and len(jobs) > 1:
        from pfctl.models.fast.cuda_graph import StageGraph

        # videos of one size repeat every stage's shapes: keep the graphs, later videos only replay them
        graphs = StageGraph(dit, keep=True)
    total_calls = sum(_dit_calls(j, gen) for j in jobs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    with pflog.progress("generate", total=total_calls) as bar:
        for number, job in enumerate(jobs, start=1):
            t0 = time.perf_counter()
            prompt_used, text = conditioning[id(job)]
            generator = torch.Generator(device="cpu").manual_seed(job.seed)
            # Draw order as the reference: full-resolution noise first, then the image posterior
            # sample, then the block noises (drawn inside the sampler).
            initial_noise = torch.randn(
                (1, latent_channels, job.temp, latent_h, latent_w), generator=generator, dtype=torch.float32
            )
            image_latent = None
            image_info = None
            if job.image_path:
                if job.image_path not in image_cache:
                    pixels, tensor = prepare_image(job.image_path, width, height)
                    image_cache[job.image_path] = (
                        pixels,
                        tensor,
                        {
                            "path": str(Path(job.image_path).resolve()),
                            "sha256": _file_sha256(job.image_path),
                            "preprocess": f"resize to cover {width}x{height} (LANCZOS), center crop",
                        },
                    )
                _, tensor, image_info = image_cache[job.image_path]
                if offload:
                    vae.module.to(device)
                image_latent, _ = encode_image_latent(vae, tensor, generator)
                if offload:
                    vae.module.to("cpu")
                    _empty_cache(device)
            pflog.log(
                f"[{number}/{len(jobs)}] {'i2v' if image_latent is not None else 't2v'} "
                f"{prompt_used or '(unconditional)'!r} seed {job.seed}: temp {job.temp} → "
                f"{frames_for_temp(job.temp)} frames {width}x{height}"
            )

            def on_call(event: dict[str, Any]) -> None:
                bar.update(1, unit=event["unit"], stage=event["stage"])

            latents = generate_latents(
                dit,
                text,
                temp=job.temp,
                height=latent_h,
                width=latent_w,
                num_inference_steps=gen.num_inference_steps,
                video_num_inference_steps=gen.video_num_inference_steps,
                guidance_scale=job.guidance_scale,
                video_guidance_scale=job.video_guidance_scale,
                use_linear_guidance=gen.use_linear_guidance,
                alpha=gen.alpha,
                min_guidance_scale=gen.min_guidance_scale,
                initial_noise=initial_noise,
                generator=generator,
                image_latent=image_latent,
                dtype=dtype,
                device=device,
                latent_channels=latent_channels,
                exact_stage_end=gen.exact_stage_end,
                reference_compat=gen.reference_compat,
                cuda_graphs=gen.cuda_graphs,
                graphs=graphs,
                on_dit_call=on_call,
            )
            t_sample = _finished(device) - t0

            if offload:
                _move(dit, "cpu")
                vae.module.to(device)
                _empty_cache(device)
            tile = resolve_decode_tile(
                gen.decode_tile,
                height=height,
                width=width,
                window=gen.decode_window if gen.decode_chunking == "framewise" else latents.shape[2],
                dtype=dtype,
                available=free_memory(device),
            )
            _, frames = decode_latents(
                vae, latents, chunking=gen.decode_chunking, window=gen.decode_window, tile=tile
            )
            if offload:
                vae.module.to("cpu")
                _move(dit, device)
                _empty_cache(device)
            t_decode = _finished(device) - t0 - t_sample

            result = _write_outputs(
                # the sidecar records the tile size used, so a re-run decodes the same way
                config=config.model_copy(update={"generate": gen.model_copy(update={"decode_tile": tile})}),
                job=job,
                frames=host_frames(frames[0]),
                latents=latents,
                prompt_used=prompt_used,
                width=width,
                height=height,
                output_dir=output_dir,
                image_info=image_info,
                model_info=model_info,
                runtime_info=runtime_info,
                timing={"sample": round(t_sample, 3), "decode": round(t_decode, 3)},
                keep_latents=keep_latents,
                image_latent=image_latent,
                seconds=time.perf_counter() - t0,
            )
            results.append(result)
            pflog.log(f"  → {result.path} ({result.seconds:.1f} s)")

    if graphs is not None:
        graphs.release()
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return GenerateReport(
        videos=results,
        output_dir=output_dir,
        model=model_info,
        width=width,
        height=height,
        seconds=time.perf_counter() - start,
        peak_memory_bytes=peak,
    )


def _is_ema_load(config: Any) -> bool:
    path = config.model.path
    try:
        return path is not None and Path(path).is_dir() and _export_has_ema(Path(path))
    except Exception:  # a broken marker was already reported by the loader
        return False


def _cond_to(text: Any, device: torch.device) -> Any:
    return text.to(device)


def _write_outputs(
    *,
    config: Any,
    job: _Job,
    frames: np.ndarray,
    latents: torch.Tensor,
    prompt_used: str,
    width: int,
    height: int,
    output_dir: Path,
    image_info: dict[str, Any] | None,
    model_info: dict[str, Any],
    runtime_info: dict[str, Any],
    timing: dict[str, float],
    keep_latents: bool,
    image_latent: torch.Tensor | None,
    seconds: float,
) -> VideoResult:
    from pfctl.sampling.video_io import write_video_unique
    from pfctl.utils.io import atomic_save_safetensors, atomic_write_json

    gen = config.generate
    stem = _video_stem(job.spec, job.seed)
    video_path = write_video_unique(
        output_dir / f"{stem}.mp4",
        frames,
        gen.fps,
        crf=gen.crf,
        threads=gen.encoder_threads,
        taken=_taken,
    )
    latents_path = None
    if gen.save_latents:
        latents_path = video_path.with_suffix(".latents.safetensors")
        atomic_save_safetensors(
            {"latents": latents.float().cpu()},
            latents_path,
            metadata={"normalized": "true", "seed": str(job.seed)},
        )
    sidecar = _sidecar(
        config=config,
        spec=job.spec,
        prompt_used=prompt_used,
        negative_prompt=job.negative_prompt,
        seed=job.seed,
        temp=job.temp,
        guidance_scale=job.guidance_scale,
        video_guidance_scale=job.video_guidance_scale,
        width=width,
        height=height,
        video_path=video_path,
        image_info=image_info,
        model_info=model_info,
        runtime_info=runtime_info,
        timing=timing,
        latents_path=latents_path,
    )
    sidecar_path = _sidecar_path(video_path)
    atomic_write_json(sidecar_path, sidecar)
    return VideoResult(
        path=video_path,
        sidecar=sidecar_path,
        prompt=job.spec.prompt,
        seed=job.seed,
        num_frames=int(frames.shape[0]),
        width=int(frames.shape[2]),
        height=int(frames.shape[1]),
        fps=float(gen.fps),
        temp=job.temp,
        image=image_info["path"] if image_info else None,
        latents_path=latents_path,
        seconds=seconds,
        latents=latents.detach().cpu() if keep_latents else None,
        image_latent=image_latent.detach().cpu() if (keep_latents and image_latent is not None) else None,
    )
