"""``pfctl export``: what pfctl trained, as an official Pyramid Flow folder other tools load.

The source is one of what training writes:

* a pfctl export (``OUTPUT/export``, marker ``pfctl_export.json``): its EMA DiT by default;
* a checkpoint step folder (``OUTPUT/checkpoints/step-NNNNNN``): ``ema/`` by default, else ``model/``;
  the run's ``config.yaml`` (two levels up) names the base model;
* a LoRA export (marker ``pfctl_lora.json``) or a LoRA run's checkpoint: the adapter merged into
  its base at scale 1 (the EMA adapter by default), exactly as ``pfctl merge-lora`` merges it.

The DiT lands under the base model's variant folder (``diffusion_transformer_384p`` when the run
started from the 384p miniFLUX) unless ``variant`` names another; the VAE and text encoders are the
base model's (:func:`pfctl.models.official.write_official_folder`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pfctl.errors import CheckpointError, ConfigError
from pfctl.models.checkpoint import (
    EXPORT_MARKER,
    VAE_SUBFOLDER,
    load_components,
    load_dit_folder,
    read_export_marker,
)
from pfctl.models.lora import ADAPTER_WEIGHTS, LORA_MARKER, merge_adapters, read_lora_marker
from pfctl.models.official import DTYPES, write_official_folder

TRAIN_STATE = "train_state.json"


@dataclass
class OfficialExportReport:
    output_dir: Path
    source: str
    kind: str  # "export" | "checkpoint" | "lora"
    variant: str
    weights: str  # "ema" | "raw"
    base: str
    provenance: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Source:
    """A DiT (weights ready) and what the official folder needs to know about it."""

    dit: torch.nn.Module
    kind: str
    weights: str
    base: str | None  # the folder with the base's VAE and text encoders
    variant: str | None  # the base model's DiT variant
    provenance: dict[str, Any]


def _run_config(folder: Path) -> dict[str, Any]:
    """The resolved recipe a training run saved (``config.yaml`` in the run folder), as plain data."""
    import yaml

    path = folder / "config.yaml"
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: cannot tell which base model {folder} was trained from",
            hint="pass --base with the model folder the run started from",
        )
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def _base_of(config: dict[str, Any]) -> tuple[str | None, str | None]:
    """(base model folder, its DiT variant) of a run config; the embedded model when model.path is unset."""
    model = config.get("model") or {}
    if model.get("path") is not None:
        return str(model["path"]), model.get("variant")
    from pfctl.models.embedded import embedded_model_path, read_manifest

    root = embedded_model_path()
    return str(root), read_manifest(root).get("variant")


def _from_lora(raw: Path, ema: Path, base: str | None, variant: str | None, want_ema: bool) -> _Source:
    """The adapter (``ema`` when wanted and there) merged into its base at scale 1, as merge-lora does."""
    adapter, weights = (ema, "ema") if want_ema and (ema / ADAPTER_WEIGHTS).is_file() else (raw, "raw")
    marker = read_lora_marker(raw) or {}
    base = base or marker.get("base_model_path")
    variant = variant or marker.get("variant")
    if base is None:
        raise CheckpointError(f"{raw} does not name the base model it adapts", hint="pass --base")
    merged = merge_adapters(base, [(adapter, 1.0)], variant=variant or "diffusion_transformer_384p")
    provenance = {"merged_loras": merged.extra["merged_loras"]}
    return _Source(merged.dit, "lora", weights, merged.aux, variant, provenance)


def _from_export(root: Path, base: str | None, want_ema: bool) -> _Source:
    marker = read_export_marker(root)
    use_ema = want_ema and bool(marker.get("transformer_ema"))
    parts = load_components(root, need=("dit",), dtype=torch.float32, use_ema=use_ema)
    run_base, run_variant = _base_of(_run_config(root)) if (root / "config.yaml").is_file() else (None, None)
    own = str(root) if (root / VAE_SUBFOLDER).is_dir() else None
    extra = dict(marker.get("extra") or {})
    provenance = {
        "steps": extra.get("steps"),
        "source_fingerprint": marker.get("ema_fingerprint" if use_ema else "dit_fingerprint"),
    }
    aux = base or own or marker.get("base_model_path") or run_base
    weights = "ema" if use_ema else "raw"
    return _Source(parts.dit, "export", weights, aux, extra.get("variant") or run_variant, provenance)


def _from_checkpoint(step: Path, base: str | None, variant: str | None, want_ema: bool) -> _Source:
    run_base, run_variant = _base_of(_run_config(step.parent.parent))
    base, variant = base or run_base, variant or run_variant
    state = json.loads((step / TRAIN_STATE).read_text(encoding="utf-8"))
    if (step / "model" / ADAPTER_WEIGHTS).is_file():
        source = _from_lora(step / "model", step / "ema", base, variant, want_ema)
        source.kind = "checkpoint"
    else:
        use_ema = want_ema and (step / "ema").is_dir()
        dit = load_dit_folder(step / ("ema" if use_ema else "model"), dtype=torch.float32)
        source = _Source(dit, "checkpoint", "ema" if use_ema else "raw", base, variant, {})
    source.provenance["steps"] = state.get("step")
    return source


def _only_variant(base: str | None) -> str | None:
    """The DiT variant of a base folder that holds exactly one (the embedded model: ``..._64p``)."""
    found = sorted(p.name for p in Path(base).glob("diffusion_transformer_*") if p.is_dir()) if base else []
    return found[0] if len(found) == 1 else None


def _read_source(path: Path, base: str | None, variant: str | None, want_ema: bool) -> _Source:
    if (path / EXPORT_MARKER).is_file():
        return _from_export(path, base, want_ema)
    if (path / LORA_MARKER).is_file():
        return _from_lora(path, path / "ema", base, variant, want_ema)
    if (path / TRAIN_STATE).is_file():
        return _from_checkpoint(path, base, variant, want_ema)
    raise ConfigError(
        f"{path} is not something pfctl trained: no {EXPORT_MARKER}, {LORA_MARKER} or {TRAIN_STATE}",
        hint="pass a pfctl export (OUTPUT/export), a checkpoint (OUTPUT/checkpoints/step-NNNNNN) or a LoRA export",
    )


def export_official(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    variant: str | None = None,
    ema: bool = True,
    base: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    replace: bool = False,
) -> OfficialExportReport:
    """Write ``source`` (a pfctl export, checkpoint or LoRA export) as an official folder at ``out``.

    ``ema``: the EMA weights when the source has them (else the trained ones); ``base``: the model
    folder whose VAE and text encoders go beside the DiT (default: the one the run started from);
    ``dtype``: ``fp32`` / ``bf16`` / ``fp16`` for the DiT's stored weights (default: as trained, fp32);
    ``replace``: an official folder pfctl wrote earlier at ``out`` is replaced (``pfctl train`` at its end).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported", hint=f"choose from {', '.join(DTYPES)}")
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder", hint="pass the export, checkpoint or LoRA folder")
    if Path(out).exists() and not replace:  # before loading anything
        raise CheckpointError(f"{out} exists; refusing to overwrite it", hint="choose a new output folder")
    src = _read_source(path, None if base is None else str(base), variant, ema)
    chosen = variant or src.variant or _only_variant(src.base)
    if chosen is None:
        raise ConfigError(
            f"cannot tell which DiT variant {path} is", hint="pass --variant, e.g. diffusion_transformer_384p"
        )
    if src.base is None:
        raise CheckpointError(f"{path} names no base model with a VAE and text encoders", hint="pass --base")
    provenance = {
        "source": str(path.resolve()),
        "source_kind": src.kind,
        "weights": src.weights,
        **src.provenance,
    }
    written = write_official_folder(
        out, src.dit, base=src.base, variant=chosen, provenance=provenance,
        dtype=None if dtype is None else DTYPES[dtype], replace=replace,
    )  # fmt: skip
    return OfficialExportReport(written, str(path), src.kind, chosen, src.weights, src.base, provenance)
