"""Validation samples during training: a few clips' cached captions sampled with fixed noise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pfctl.data.dataset import unbatch
from pfctl.runtime import logging as pflog
from pfctl.training.data import TEXT_KEYS, TrainData


@torch.no_grad()
def sample_validation(
    config: Any, runtime: Any, data: TrainData, dit: torch.nn.Module, out: Path, step: int
) -> Path | None:
    """Sample a few clips' captions (cached embeddings, null text as negative) with fixed noise into
    ``out/validation/step-NNNNNN.safetensors``.

    Latents are saved normalised (``pfctl generate`` decodes with the VAE); the same seed every
    time, so samples of successive steps are comparable. Under FSDP every rank takes part (``dit`` is
    then the sharded module); otherwise only the main process samples (the others return None).
    """
    from pfctl.models.text_embeddings import TextEmbeddings
    from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents
    from pfctl.utils.io import atomic_save_safetensors

    cfg, rt, cache = config.train, runtime, data.cache
    ids = cfg.validation_clips or [c.id for c in data.heldout] or cache.ids()[:2]
    if not (rt.is_main or cfg.fsdp != "none"):
        return None
    entries = [cache.load(cid) for cid in ids]
    text = {key: torch.stack([unbatch(e[key], nd) for e in entries]) for key, nd in TEXT_KEYS}
    null = {key: unbatch(cache.null_text()[key], nd)[None] for key, nd in TEXT_KEYS}
    first = cache.row(ids[0])
    with rt.accelerator.autocast():
        latents = generate_latents(
            dit,
            TextConditioning(
                TextEmbeddings.from_dict(text).to(dtype=torch.float32),
                TextEmbeddings.from_dict(null).to(dtype=torch.float32),
            ),
            SamplingSettings(num_inference_steps=10, video_num_inference_steps=10),
            temp=cfg.validation_units, height=int(first["height"]), width=int(first["width"]),
            generator=torch.Generator(device=rt.device).manual_seed(rt.seed), device=rt.device,
            latent_channels=int(first.get("latent_channels", 16)),
        )  # fmt: skip
    path = out / "validation" / f"step-{step:06d}.safetensors"
    if rt.is_main:
        atomic_save_safetensors({"latents": latents.float()}, path, metadata={"clip_ids": ",".join(ids)})
        pflog.log(f"validation latents of {ids} → {path}")
    return path
