"""Everything encode-latents settles before it decodes a frame: which model, which settings, which
VAE and text encoders, and the cache header (provenance + fingerprint) that results.

Where the settings come from, lowest priority first: the defaults of :class:`EncodeConfig` < the
model's own encode settings (the embedded model's trained size, frame rate and clip length) < the
recipe < ``--set`` < flags. No model option at all (no ``--model``, no ``--vae``) means the embedded
model, its VAE and its text encoders, as for ``pfctl generate``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pfctl.data import latent_cache as lc
from pfctl.data.buckets import as_buckets, check_buckets, grid_multiple
from pfctl.data.video import FrameContract, FrameSettings
from pfctl.errors import ConfigError
from pfctl.utils.io import fingerprint as stable_hash

if TYPE_CHECKING:
    from pfctl.config.encode import EncodeConfig
    from pfctl.config.schema import RecipeConfig

PREPROCESSING_VERSION = 1
"""Bumped when decoding/resizing changes in a way that changes pixels (part of the fingerprint)."""
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_DIT_CLASSES = ("PyramidFluxTransformer", "PyramidDiffusionMMDiT")


# ----------------------------------------------------------------------------------- the model


def with_model(config: RecipeConfig) -> tuple[RecipeConfig, dict[str, Any] | None]:
    """``config`` with the model filled in, and the embedded model's manifest when that is the model.

    No ``model.path`` and no ``model.vae``: the embedded model (its files' sha256 checked).
    """
    from pfctl.models import embedded

    m = config.model
    if m.path is None and m.vae is None:
        need = ("vae", "text") if config.encode.text and not config.encode.text_encoder else ("vae",)
        root, variant, _ = embedded.resolve_embedded(need)
        config = config.model_copy(
            update={"model": m.model_copy(update={"path": str(root), "variant": variant})}
        )
        return config, embedded.read_manifest(root)
    if embedded.is_embedded_root(m.path):
        return config, embedded.read_manifest(m.path)
    return config, None


def model_encode_settings(manifest: Mapping[str, Any], temporal_factor: int) -> dict[str, Any]:
    """The encode settings the embedded model was trained with: its size (one bucket), its frame
    rate and its clip length (``generate.temp`` latent frames)."""
    settings: dict[str, Any] = {}
    if manifest.get("resolution"):
        width, height = manifest["resolution"]
        settings["buckets"] = [[int(width), int(height)]]
    if manifest.get("fps"):
        settings["fps"] = float(manifest["fps"])
    temp = (manifest.get("generate") or {}).get("temp")
    if temp:
        settings["num_frames"] = 1 + temporal_factor * (int(temp) - 1)
    return settings


def apply_model_settings(cfg: EncodeConfig, settings: Mapping[str, Any]) -> EncodeConfig:
    """``cfg`` with the model's settings where the user set none (recipe, ``--set`` and flags all
    count as set: pydantic's ``model_fields_set``)."""
    update = {k: v for k, v in settings.items() if k not in cfg.model_fields_set}
    if not update:
        return cfg
    merged = type(cfg).model_validate({**cfg.model_dump(), **update})
    object.__setattr__(merged, "__pydantic_fields_set__", set(cfg.model_fields_set))
    return merged


def dit_patch(folder: Path) -> int:
    """Latent pixels per token side of the DiT whose ``config.json`` is in ``folder``: the Flux DiT
    patchifies 2x2 by a fixed reshape (its ``patch_size`` only sizes ``proj_out``), the MMDiT by
    ``patch_size``."""
    from pfctl.models.dit_flux import PATCH

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("_class_name") == "PyramidFluxTransformer":
        return PATCH
    return int(config.get("patch_size", 2))  # the MMDiT class default


def model_dit_folder(config: RecipeConfig) -> Path | None:
    """The DiT folder of ``model.path`` (``model.variant`` first, else the first DiT found), if any."""
    if not config.model.path:
        return None
    root = Path(config.model.path).expanduser()
    if not root.is_dir():
        return None
    candidates = [root / config.model.variant, *sorted(p for p in root.iterdir() if p.is_dir())]
    for folder in candidates:
        try:
            name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_class_name")
        except (OSError, ValueError):
            continue
        if name in _DIT_CLASSES:
            return folder
    return None


def check_trainable_buckets(config: RecipeConfig, settings: FrameSettings, vae: Any) -> None:
    """Buckets the model's DiT cannot train are refused before any clip is decoded.

    With a model folder holding a DiT: sides must be multiples of VAE factor × DiT patch ×
    2^(stages − 1) (``train.sample_ratios`` gives the stages); with only a VAE, of the VAE factor
    (``pfctl train`` checks the rest against its DiT)."""
    buckets = [(b.width, b.height) for b in settings.buckets]
    folder = model_dit_folder(config)
    if folder is None:
        multiple, why = vae.spatial_factor, f"the spatial factor of VAE {vae.name}"
    else:
        patch, stages = dit_patch(folder), len(config.train.sample_ratios)
        multiple = grid_multiple(patch=patch, stages=stages, vae_factor=vae.spatial_factor)
        why = (
            f"VAE factor {vae.spatial_factor} x DiT patch {patch} x 2^{stages - 1} for "
            f"{stages} pyramid stages; DiT {folder.name}"
        )
    check_buckets(buckets, multiple, what="encode.buckets", unit="px", why=why)


# ----------------------------------------------------------------------------- the other inputs


def resolve_dtype(config: RecipeConfig) -> torch.dtype:
    name = config.encode.dtype or config.model.dtype
    if name == "fp16":
        raise ConfigError(
            "model.dtype = 'fp16' cannot be used to encode latents: the causal VAE gives NaN latents in fp16",
            hint="set encode.dtype=bf16 (default) or fp32",
        )
    return _DTYPES[name]


def resolve_vae_spec(config: RecipeConfig) -> str:
    """``model.vae`` (folder or built-in name), else the model folder (its ``causal_video_vae/``);
    call it on the config :func:`with_model` returns (which always names one of them)."""
    return config.model.vae or str(config.model.path)


def resolve_text_folder(config: RecipeConfig) -> tuple[Path, str] | None:
    """(folder, text-encoder kind) or None when text is not encoded. Raises :class:`ConfigError`."""
    if not config.encode.text:
        return None
    from pfctl.models.text_encoder import FLUX_SUBFOLDERS, detect_text_encoder_kind

    raw = config.encode.text_encoder or config.model.path
    if raw is None:
        raise ConfigError(
            "no text encoder folder: captions cannot be encoded",
            hint="set encode.text_encoder=FOLDER (or --model CHECKPOINT_FOLDER), or encode.text=false for latents only",
        )
    folder = Path(raw).expanduser()
    kind = detect_text_encoder_kind(folder) if folder.is_dir() else None
    if kind is None:
        raise ConfigError(
            f"{folder} has no text encoders (expected subfolders {', '.join(s + '/' for s in FLUX_SUBFOLDERS)})",
            hint="point encode.text_encoder at a Pyramid Flow checkpoint folder, or set encode.text=false",
        )
    return folder, kind


def text_identity(folder: Path, kind: str, max_sequence_length: int) -> dict[str, Any]:
    """The text encoder's identity without loading it: kind, length and a digest of its folders."""
    from pfctl.models.checkpoint import folder_digest
    from pfctl.models.text_encoder import TEXT_ENCODERS

    subfolders = TEXT_ENCODERS[kind].subfolders
    return {
        "kind": kind,
        "max_sequence_length": max_sequence_length,
        "folders": {s: folder_digest(folder / s) for s in subfolders},
    }


def text_dims_from_folder(folder: Path, kind: str) -> tuple[int, int] | None:
    """(token dim, pooled dim) read from config.json files (dry-run size estimates, no loading)."""
    try:
        if kind == "pyramid_flux":
            t5 = json.loads((folder / "text_encoder_2" / "config.json").read_text())
            clip = json.loads((folder / "text_encoder" / "config.json").read_text())
            return int(t5["d_model"]), int(clip["hidden_size"])
        t5 = json.loads((folder / "text_encoder_3" / "config.json").read_text())
        c1 = json.loads((folder / "text_encoder" / "config.json").read_text())
        c2 = json.loads((folder / "text_encoder_2" / "config.json").read_text())
        return int(t5["d_model"]), int(c1["projection_dim"]) + int(c2["projection_dim"])
    except (OSError, KeyError, ValueError):
        return None


def normalization_record(vae: Any) -> dict[str, Any]:
    """The latent normalisation the trainer must apply, as JSON (adapter name + rule + factors)."""
    record: dict[str, Any] = {"adapter": vae.name}
    norm = getattr(vae, "latent_norm", None)
    if norm is not None and hasattr(norm, "to_dict"):
        record.update(norm.to_dict())
        return record
    config = dict(getattr(vae.module, "config", {}) or {})
    record["rule"] = (
        "(z - latents_mean) * scaling_factor / latents_std, else (z - shift_factor) * scaling_factor"
    )
    for key in ("scaling_factor", "shift_factor", "latents_mean", "latents_std", "invert_scale_latents"):
        if config.get(key) is not None:
            value = config[key]
            record[key] = list(value) if isinstance(value, tuple) else value
    return record


def frame_settings(cfg: EncodeConfig, contract: FrameContract, decode_threads: int) -> FrameSettings:
    return FrameSettings(
        contract=contract,
        buckets=tuple(as_buckets(cfg.buckets)),
        fps=cfg.fps,
        clip_mode=cfg.clip_mode,
        clips_per_video=cfg.clips_per_video,
        num_frames=cfg.num_frames,
        max_frames=cfg.max_frames,
        min_frames=cfg.min_frames,
        max_source_pixels=cfg.max_source_pixels,
        decode_threads=decode_threads,
    )


def preprocessing_record(cfg: EncodeConfig, settings: FrameSettings, seed: int) -> dict[str, Any]:
    """The parameters that change the cached tensors (only those relevant to the clip mode)."""
    record: dict[str, Any] = {
        "version": PREPROCESSING_VERSION,
        "fps": cfg.fps,
        "clip_mode": cfg.clip_mode,
        "buckets": [b.name for b in settings.buckets],
        "resize": "cover-bicubic-antialias+center-crop",
        "value_range": "[-1,1]",
        "chunking": cfg.chunking,
        "chunk_frames": cfg.chunk_frames,
        "tile": cfg.tile,
        "store": cfg.store,
        "storage_dtype": "bfloat16",
    }
    if cfg.clip_mode == "full":
        record["max_frames"] = settings.contract.snap(cfg.max_frames)
    else:
        record["num_frames"] = settings.clip_frames
    if cfg.clip_mode == "uniform":
        record["clips_per_video"] = cfg.clips_per_video
    if cfg.store == "sample":
        record["sample_seed"] = seed
    return record


def build_header(
    *,
    vae: Any,
    vae_spec: str,
    compute_dtype: torch.dtype,
    text: dict[str, Any] | None,
    text_dims: tuple[int, int] | None,
    preprocessing: dict[str, Any],
    store: str,
) -> dict[str, Any]:
    """cache.json: format, version, fingerprint and the provenance it hashes, plus what readers need."""
    from pfctl import __version__

    provenance = {
        "format_version": lc.FORMAT_VERSION,
        "vae": {
            "name": vae.name,
            "class": type(vae.module).__name__,
            "fingerprint": vae.fingerprint(),
            "compute_dtype": str(compute_dtype).removeprefix("torch."),
        },
        "text_encoder": text,
        "preprocessing": preprocessing,
    }
    latent_keys = lc.LATENT_KEYS_MEAN_STD if store == "mean_std" else lc.LATENT_KEYS_SAMPLE
    return {
        "format": lc.FORMAT_NAME,
        "format_version": lc.FORMAT_VERSION,
        "fingerprint": stable_hash(provenance),
        "provenance": provenance,
        "vae": {
            "name": vae.name,
            "class": type(vae.module).__name__,
            "spec": vae_spec,
            "latent_channels": vae.latent_channels,
            "spatial_factor": vae.spatial_factor,
            "temporal_factor": vae.temporal_factor,
            "normalization": normalization_record(vae),
        },
        "text_encoder": None
        if text is None
        else {
            "kind": text["kind"],
            "max_sequence_length": text["max_sequence_length"],
            "dim": text_dims[0] if text_dims else None,
            "pooled_dim": text_dims[1] if text_dims else None,
        },
        "store": store,
        "storage_dtype": "bfloat16",
        "latent_keys": list(latent_keys),
        "text_keys": list(lc.TEXT_KEYS) if text is not None else [],
        "null_text": lc.NULL_TEXT_FILE if text is not None else None,
        "tensor_layout": "latents [C, T, h, w] raw (not normalised); prompt_embeds [L, D]; mask [L]; pooled [Dp]",
        "created_by": f"pfctl {__version__}",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def check_frames(cfg: EncodeConfig, settings: FrameSettings, vae: Any) -> None:
    """A clip length the VAE's frame contract has no valid count for is refused."""
    if cfg.clip_mode != "full" and settings.clip_frames < 1:
        raise ConfigError(
            f"encode.num_frames = {cfg.num_frames}: no valid frame count for VAE {vae.name} at or below it",
            hint=f"use e.g. {vae.valid_num_frames(max(cfg.num_frames, 1 + vae.temporal_factor) + vae.temporal_factor)}",
        )
