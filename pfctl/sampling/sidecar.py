"""Where ``pfctl generate`` writes: video names that are never taken twice, and the JSON sidecar next to each
mp4 that records what ran (prompt, seed, settings, model) and regenerates the video."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pfctl.config.generate import GenerateConfig, PromptSpec, frames_for_temp
from pfctl.errors import InputError

__all__ = [
    "SIDECAR_FORMAT",
    "SIDECAR_VERSION",
    "build_sidecar",
    "load_sidecar",
    "sidecar_path",
    "sidecar_to_run",
    "taken",
    "video_stem",
]

SIDECAR_FORMAT = "pfctl-generate-sidecar"
SIDECAR_VERSION = 1


def _slug(text: str, limit: int = 60) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:limit].rstrip("-") or "unconditional"


def video_stem(spec: PromptSpec, seed: int) -> str:
    base = _slug(spec.name) if spec.name else _slug(spec.prompt)
    return f"{base}_seed{seed}"


def sidecar_path(video: Path) -> Path:
    return video.with_suffix(".json")


def taken(candidate: Path) -> bool:
    return candidate.exists() or sidecar_path(candidate).exists()


def load_sidecar(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a video's JSON sidecar (``video.json`` or the ``video.mp4`` next to it)."""
    path = Path(path)
    if path.suffix == ".mp4":
        path = sidecar_path(path)
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
    recorded = {k: sidecar["model"].get(k) for k in ("path", "variant", "vae") if k in sidecar["model"]}
    if recorded.get("variant") is None:  # an export or a bare DiT folder: no variant folder was loaded
        recorded.pop("variant", None)
    model = base.model.model_copy(update=recorded)
    generate = GenerateConfig.model_validate({**base.generate.model_dump(), **gen})
    config = base.model_copy(update={"model": model, "generate": generate})
    spec = PromptSpec(prompt=sidecar["prompt"], image=(sidecar.get("image") or {}).get("path"))
    return config, spec


def build_sidecar(
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
