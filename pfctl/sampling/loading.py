"""The model ``pfctl generate`` runs: loading (official folder, export, embedded model, LoRA adapters), the
compute dtype, and the output size the model declares."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pfctl.config.generate import RESOLUTIONS, GenerateConfig
from pfctl.errors import ConfigError, ModelLoadError
from pfctl.runtime import logging as pflog

__all__ = [
    "SIZE_MULTIPLE",
    "adapter_fingerprint",
    "apply_adapters",
    "declared_sizes",
    "is_ema_load",
    "load_model",
    "loaded_variant",
    "read_adapters",
    "resolve_dtype",
    "resolve_size",
    "with_lora_base",
]

SIZE_MULTIPLE = 64
"""Pixel sizes must be multiples of 8 (VAE) x 4 (two pyramid halvings) x 2 (DiT patch)."""


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


def _export_has_ema(path: Path) -> bool:
    from pfctl.models.checkpoint import EXPORT_MARKER, read_export_marker

    if not (path / EXPORT_MARKER).is_file():
        return False
    return bool(read_export_marker(path).get("transformer_ema"))


def load_model(config: Any, dtype: torch.dtype, device: torch.device | str) -> Any:
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


def read_adapters(gen: GenerateConfig) -> list[Any]:
    """Read every ``generate.lora`` folder now (a bad path fails before a model is loaded)."""
    if not gen.lora:
        return []
    from pfctl.models.lora import read_lora

    return [read_lora(ref.path, ref.scale) for ref in gen.lora]


def with_lora_base(config: Any, adapter: Any) -> Any:
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


def apply_adapters(dit: Any, adapters: list[Any], components: Any, *, owned: bool) -> Any:
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


def adapter_fingerprint(adapter: Any) -> str:
    from pfctl.utils.io import tensor_fingerprint

    return tensor_fingerprint(adapter.state)


def resolve_dtype(gen: GenerateConfig, model_dtype: str, device_type: str) -> torch.dtype:
    name = gen.dtype
    if name == "auto":
        name = model_dtype if device_type == "cuda" else "fp32"
    if name == "fp16":
        raise ConfigError(
            "fp16 is not supported for generation (the causal VAE gives NaN in fp16)",
            hint="use --set model.dtype=bf16 (or generate.dtype=fp32)",
        )
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def loaded_variant(info: dict[str, Any]) -> str | None:
    """The variant folder the DiT was loaded from (official layout, the embedded model included); None
    for an export or a bare DiT folder, which have no variant."""
    if info.get("layout") != "official" or not info.get("dit_path"):
        return None
    return Path(info["dit_path"]).name


def is_ema_load(config: Any) -> bool:
    path = config.model.path
    try:
        return path is not None and Path(path).is_dir() and _export_has_ema(Path(path))
    except Exception:  # a broken marker was already reported by the loader
        return False
