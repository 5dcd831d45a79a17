"""What a run measures on the side: the held-out loss (:func:`heldout_loss`), and validation samples (a few
clips' cached captions sampled with fixed noise, decoded with the cache's VAE into mp4s and one contact sheet
per step: a picture of what the model makes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfctl.data.dataset import group_rng, stored_latent, unbatch
from pfctl.flow.pyramid import plan_stage_lengths, pyramid_latents
from pfctl.runtime import logging as pflog
from pfctl.training.data import TEXT_KEYS, TextRows, TrainData

LABEL_CHARS = 90
"""Captions longer than this are cut (with "...") in the sheet's row labels."""


@dataclass
class ValidationSamples:
    """What one validation wrote (main process): the latents, and when the cache names its VAE, one mp4
    per sample and the contact sheet (its path and pixels, H x W x 3 uint8, for the trackers)."""

    latents: Path
    sheet: Path | None = None
    videos: list[Path] = field(default_factory=list)
    image: np.ndarray | None = None


@torch.no_grad()
def sample_validation(
    config: Any, runtime: Any, data: TrainData, dit: torch.nn.Module, out: Path, step: int
) -> ValidationSamples | None:
    """Sample a few clips' captions (cached embeddings, null text as negative) with fixed noise into
    ``out/validation/step-NNNNNN.safetensors``; decoded, ``step-NNNNNN-<i>.mp4`` and the contact sheet
    ``step-NNNNNN.png`` (:func:`write_contact_sheet`).

    Latents are saved normalised (``pfctl generate`` decodes with the VAE); the same seed every
    time, so samples of successive steps are comparable. Under FSDP every rank takes part (``dit`` is
    then the sharded module); only the main process writes (the others return None).
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
    if not rt.is_main:
        return None
    path = out / "validation" / f"step-{step:06d}.safetensors"
    atomic_save_safetensors({"latents": latents.float()}, path, metadata={"clip_ids": ",".join(ids)})
    samples = ValidationSamples(latents=path)
    frames = decode_validation(cache.vae, latents, rt.device)
    if frames is None:
        pflog.log(f"validation latents of {ids} → {path} (the cache names no VAE to decode them)")
        return samples
    labels = [f'step {step} | seed {rt.seed} | "{caption(cache, cid)}"' for cid in ids]
    write_contact_sheet(samples, frames, labels, fps=clip_fps(cache, ids[0]), step=step)
    pflog.log(f"validation samples of {ids} → {samples.sheet} (+ {len(samples.videos)} mp4)")
    return samples


def decode_validation(
    vae_info: dict[str, Any], latents: torch.Tensor, device: torch.device
) -> np.ndarray | None:
    """Normalised latents → uint8 frames (B, T, H, W, 3) with the cache's VAE (``vae_info["spec"]``),
    loaded for this call and freed after; None when the cache does not name its VAE."""
    from pfctl.models.vae import load_vae
    from pfctl.sampling.decode import decode_latents, host_frames

    spec = vae_info.get("spec")
    if not spec:
        return None
    vae = load_vae(spec, dtype=torch.float32, device=device)
    try:
        _, frames = decode_latents(vae, latents.float())
        return host_frames(frames)
    finally:
        del vae
        if device.type == "cuda":
            torch.cuda.empty_cache()


def write_contact_sheet(
    samples: ValidationSamples, frames: np.ndarray, labels: list[str], *, fps: float, step: int
) -> None:
    """One mp4 per sample and the contact sheet of them all (first, middle, last frame) next to the
    latents; fills ``samples``."""
    from pfctl.sampling.video_io import write_video
    from pfctl.utils.plot import contact_sheet, save_png

    stem = samples.latents.with_suffix("")
    samples.videos = [write_video(f"{stem}-{i}.mp4", video, fps) for i, video in enumerate(frames)]
    image = contact_sheet(list(zip(labels, frames, strict=True)), title=f"validation samples at step {step}")
    samples.sheet = save_png(image, stem.with_suffix(".png"))
    samples.image = np.asarray(image)


def caption(cache: Any, clip_id: str) -> str:
    """The clip's caption as encoded (clip metadata ``text``), else its id; long ones cut."""
    text = cache.metadata(clip_id).get("text") or clip_id
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 3] + "..."


def clip_fps(cache: Any, clip_id: str) -> float:
    """The frame rate the clip was encoded at (24 when the cache does not say)."""
    try:
        return float(cache.metadata(clip_id).get("fps", 24))
    except ValueError:
        return 24.0


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


@torch.no_grad()
def heldout_loss(trainer: Any) -> dict[str, float]:
    """Mean loss over the held-out clips with fixed noise (comparable across steps): ``heldout_loss`` and per
    stage ``heldout_loss_stage<k>``, of ``trainer`` (:class:`pfctl.training.trainer.Trainer`: its model,
    data, and the noising and loss it trains with).

    Each clip fills all K columns of a batch (so every stage is measured on it) and is noised by a generator
    seeded from the clip's index — the training RNGs are not touched.
    """
    cfg, device, data = trainer.cfg, trainer.runtime.device, trainer.data
    k = sum(cfg.sample_ratios)
    trainer.model.eval()
    losses, per_stage = [], {stage: [] for stage in trainer.stages}
    for i, clip in enumerate(data.heldout):
        entry = data.cache.load(clip.id)
        frames = min(clip.num_latent_frames, cfg.max_units)
        latent = data.loader.normalize(stored_latent(entry)[None, :, :frames].float())
        gen = torch.Generator(device=device).manual_seed(
            int(group_rng(trainer.runtime.seed, 301, i).integers(2**62))
        )
        pyramid = pyramid_latents(latent.repeat(k, 1, 1, 1, 1).to(device), num_stages=3)
        units = None
        if cfg.use_temporal_pyramid:
            units = plan_stage_lengths(cfg.max_units, 1).lengths(i, 0, clip_units=frames)
        inputs = trainer.noise_inputs(pyramid, units, gen, draw_unused_corruption=True)
        text = {
            key: unbatch(entry[key], nd).unsqueeze(0).repeat_interleave(k, 0).to(device)
            for key, nd in TEXT_KEYS
        }
        rows = TextRows(
            text["prompt_embeds"].float(),
            text["prompt_attention_mask"].long(),
            text["pooled_prompt_embeds"].float(),
            text_lengths=None,
        )
        loss, stage_losses = trainer.loss(inputs, rows)
        losses.append(float(loss))
        for stage, value in stage_losses.items():
            per_stage[stage].append(float(value))
    trainer.model.train()
    return {"heldout_loss": _mean(losses)} | {
        f"heldout_loss_stage{s}": _mean(v) for s, v in per_stage.items()
    }
