"""Write a DiT in the official Pyramid Flow folder layout, the one the reference and its tools load.

The reference's ``PyramidDiTForVideoGeneration(model_path, model_variant=...)`` (its scripts, its
Gradio app) and the ComfyUI wrapper read one folder::

    OUT/
      diffusion_transformer_384p/   config.json + diffusion_pytorch_model.safetensors   (the DiT; or _768p, ...)
      causal_video_vae/             config.json + weights
      text_encoder/  tokenizer/     CLIP-L
      text_encoder_2/ tokenizer_2/  T5-XXL
      text_encoder_3/ tokenizer_3/  (SD3 MMDiT only)
      pfctl_provenance.json         where the DiT came from (not read by the reference)

The DiT's ``config.json`` carries the reference's fields and ``_class_name``, its state dict the
reference's key names (pfctl's DiT classes use them). The VAE and text encoders are the base model's,
hard-linked where the file system allows it and copied otherwise. The folder is staged beside ``OUT``
and renamed into place at the end; an existing ``OUT`` is never overwritten.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pfctl.errors import CheckpointError, ConfigError
from pfctl.models.checkpoint import DIT_CLASSES, VAE_SUBFOLDER, folder_digest, save_dit_folder

PROVENANCE = "pfctl_provenance.json"
FLUX_AUX = (VAE_SUBFOLDER, "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
SD3_AUX = (*FLUX_AUX, "text_encoder_3", "tokenizer_3")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def aux_folders(dit: torch.nn.Module) -> tuple[str, ...]:
    """The base model's subfolders the official layout needs beside the DiT of this class."""
    name = DIT_CLASSES.get(type(dit).__name__, ("", ""))[1]
    return SD3_AUX if name == "pyramid_mmdit" else FLUX_AUX


def check_variant(variant: str) -> str:
    """The DiT subfolder name: the reference finds it by ``model_variant``, always ``diffusion_transformer_*``."""
    if not variant.startswith("diffusion_transformer_") or "/" in variant or variant.endswith("_"):
        raise ConfigError(
            f"variant {variant!r} is not an official DiT folder name",
            hint="use diffusion_transformer_384p, diffusion_transformer_768p or diffusion_transformer_<size>",
        )
    return variant


def _link_or_copy_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of ``src`` into ``dst`` (copy where linking fails: another file system)."""

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link)


def write_official_folder(
    out: str | os.PathLike[str],
    dit: torch.nn.Module,
    *,
    base: str | os.PathLike[str],
    variant: str,
    provenance: Mapping[str, Any],
    dtype: torch.dtype | None = None,
    replace: bool = False,
) -> Path:
    """Write ``dit`` (cast to ``dtype`` when given) under ``out/variant`` with the base model's VAE and
    text encoders beside it, and ``pfctl_provenance.json``; returns ``out``.

    Raises :class:`CheckpointError` when ``out`` exists (with ``replace``: unless it is a folder this
    function wrote, which is then replaced whole) or ``base`` lacks a folder the layout needs.
    """
    from pfctl import __version__
    from pfctl.utils.io import atomic_write_json, replace_dir

    out, base = Path(out), Path(base)
    check_variant(variant)
    if out.exists() and not (replace and (out / PROVENANCE).is_file()):
        raise CheckpointError(f"{out} exists; refusing to overwrite it", hint="choose a new output folder")
    missing = [name for name in aux_folders(dit) if not (base / name).is_dir()]
    if missing:
        raise CheckpointError(
            f"the base model {base} lacks {', '.join(m + '/' for m in missing)} for the official layout",
            hint="export from a model whose base is a complete Pyramid Flow folder, or pass --base",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.official-", dir=out.parent))
    try:
        model = dit if dtype is None else torch.nn.Module.to(dit, dtype=dtype)
        save_dit_folder(model, staging / variant)
        for name in aux_folders(dit):
            _link_or_copy_tree(base / name, staging / name)
        record = {
            "format": "pfctl-official-export",
            "pfctl_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "variant": variant,
            "dit_class": type(dit).__name__,
            "dit_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "dit_fingerprint": folder_digest(staging / variant),
            "base_model_path": str(base.resolve()),
            **dict(provenance),
        }
        atomic_write_json(staging / PROVENANCE, record)
        if out.exists() and not replace:  # appeared while we wrote
            raise CheckpointError(f"{out} exists; refusing to overwrite it", hint="choose a new output folder")
        replace_dir(staging, out)  # renamed into place, with the mode a plain mkdir gives (umask)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out

