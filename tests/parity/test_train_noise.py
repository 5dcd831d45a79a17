"""Training-noise construction vs the reference vectors (temporal pyramid and non-AR paths).

The saved random draws (``rng_draw.*``) are replayed in the reference's order, so the rebuilt DiT
inputs, targets, ratios and timesteps must equal the saved ones. When pfctl's Flux DiT is
importable, the saved DiT outputs and loss are checked as well.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from helpers.parity import reference_flux_dit
from pfctl.flow.loss import flow_matching_loss
from pfctl.flow.pyramid import (
    build_full_sequence_batch,
    build_temporal_pyramid_batch,
    pyramid_latents,
    sample_stage_length,
)
from pfctl.flow.scheduler import PyramidFlowScheduler
from pfctl.models.vae import FLUX_LATENT_NORM, normalize_latents

pytestmark = pytest.mark.parity

ATOL = 1e-6


def _draws(tensors: dict, first: int = 0) -> list[torch.Tensor]:
    n = sum(1 for k in tensors if k.startswith("rng_draw."))
    return [tensors[f"rng_draw.{i}"] for i in range(first, n)]


def _ratios_from_columns(column_to_stage: list[int]) -> list[int]:
    counts = Counter(column_to_stage)
    return [counts[s] for s in range(max(column_to_stage) + 1)]


def _assert_batch(batch, ref: dict):
    for k, clips in enumerate(batch.sample):
        n_ref = sum(1 for key in ref if key.startswith(f"sample.{k}."))
        assert len(clips) == n_ref, f"column {k}: {len(clips)} clips, reference {n_ref}"
        for j, clip in enumerate(clips):
            torch.testing.assert_close(clip, ref[f"sample.{k}.{j}"], rtol=0, atol=ATOL)
        torch.testing.assert_close(batch.targets[k], ref[f"target.{k}"], rtol=0, atol=ATOL)
        torch.testing.assert_close(batch.ratios[k], ref[f"ratio.{k}"], rtol=0, atol=ATOL)
    torch.testing.assert_close(batch.timesteps, ref["timestep_ratio"], rtol=0, atol=1e-4)


def _check_dit(refdir, batch, ref: dict):
    dit = reference_flux_dit(refdir)
    with torch.no_grad():
        outputs = dit(
            sample=batch.sample,
            encoder_hidden_states=ref["encoder_hidden_states"],
            encoder_attention_mask=ref["encoder_attention_mask"],
            pooled_projections=ref["pooled_projections"],
            timestep_ratio=batch.timesteps,
        )
    for k, out in enumerate(outputs):
        # DiT numerics are the model's own parity test; here a looser bound checks the wiring
        torch.testing.assert_close(out, ref[f"output.{k}"], rtol=1e-5, atol=5e-5)
    loss = flow_matching_loss(outputs, batch.targets, batch.column_to_stage)
    torch.testing.assert_close(loss.loss.reshape(1), ref["loss"], rtol=1e-5, atol=1e-5)


TEMPORAL_CASES = [
    ("forward_train_temporal_pyramid.safetensors", "train_temporal_pyramid"),
    ("forward_first_unit.safetensors", "first_unit_no_history"),
]


def _temporal_case(refdir, filename, meta_key):
    path = refdir / "flux_dit" / filename
    if not path.exists():
        pytest.skip(f"{path} not in the reference set")
    meta = json.loads((refdir / "flux_dit" / "forward_meta.json").read_text())[meta_key]
    ref = load_file(path)
    scheduler = PyramidFlowScheduler()
    pyramid = pyramid_latents(ref["clean_latent"], scheduler.num_stages)
    for i, level in enumerate(pyramid):
        torch.testing.assert_close(level, ref[f"pyramid_latent.{i}"], rtol=0, atol=0)
    clip_units = ref["clean_latent"].shape[2]  # frame_per_unit = 1
    units = sample_stage_length(
        0, meta["rank"], meta["video_sync_group"], meta["max_temporal_length"], clip_units
    )
    draws = _draws(ref)
    clean_before = ref["clean_latent"].clone()
    batch = build_temporal_pyramid_batch(
        pyramid,
        scheduler,
        units,
        sample_ratios=_ratios_from_columns(meta["column_to_stage"]),
        corrupt_ratio=1 / 3,
        rng=draws,
    )
    assert torch.equal(ref["clean_latent"], clean_before), "input modified in place"
    assert batch.column_to_stage == meta["column_to_stage"]
    return batch, ref


@pytest.mark.parametrize(("filename", "meta_key"), TEMPORAL_CASES)
def test_temporal_pyramid_noise(refdir, filename, meta_key):
    batch, ref = _temporal_case(refdir, filename, meta_key)
    _assert_batch(batch, ref)


@pytest.mark.parametrize(("filename", "meta_key"), TEMPORAL_CASES)
def test_temporal_pyramid_dit_output_and_loss(refdir, filename, meta_key):
    batch, ref = _temporal_case(refdir, filename, meta_key)
    # the saved outputs (DiT-independent): pfctl's loss on them equals the saved loss
    outs = [ref[f"output.{k}"] for k in range(len(batch.sample))]
    loss = flow_matching_loss(outs, batch.targets, batch.column_to_stage)
    torch.testing.assert_close(loss.loss.reshape(1), ref["loss"], rtol=0, atol=1e-6)
    assert set(loss.per_stage) == set(batch.column_to_stage)
    _check_dit(refdir, batch, ref)


def _no_ar_case(refdir):
    folder = refdir / "train_noise_no_ar"
    if not (folder / "forward.safetensors").exists():
        pytest.skip("train_noise_no_ar/ not in the reference set")
    meta = json.loads((folder / "meta.json").read_text())
    ref = load_file(folder / "forward.safetensors")
    raw_before = ref["vae_latent_raw"].clone()
    # the VAE adapter's rule (what the trainer applies to cached latents)
    clean = normalize_latents(ref["vae_latent_raw"], FLUX_LATENT_NORM)
    assert torch.equal(ref["vae_latent_raw"], raw_before), "input modified in place"
    torch.testing.assert_close(clean, ref["clean_latent"], rtol=0, atol=0)
    scheduler = PyramidFlowScheduler()
    pyramid = pyramid_latents(clean, scheduler.num_stages)
    for i, level in enumerate(pyramid):
        torch.testing.assert_close(level, ref[f"pyramid_latent.{i}"], rtol=0, atol=0)
    # draw 0 is the trainer's text-dropout mask; the noise builder consumes the rest
    roles = meta["rng_draw_roles"]
    first = next(i for i, role in enumerate(roles) if role.startswith("noise"))
    draws = _draws(ref, first=first)
    batch = build_full_sequence_batch(
        pyramid, scheduler, sample_ratios=_ratios_from_columns(meta["column_to_stage"]), rng=draws
    )
    return batch, ref


def test_no_ar_noise(refdir):
    batch, ref = _no_ar_case(refdir)
    _assert_batch(batch, ref)


def test_no_ar_dit_output_and_loss(refdir):
    batch, ref = _no_ar_case(refdir)
    outs = [ref[f"output.{k}"] for k in range(len(batch.sample))]
    loss = flow_matching_loss(outs, batch.targets, batch.column_to_stage)
    torch.testing.assert_close(loss.loss.reshape(1), ref["loss"], rtol=0, atol=1e-6)
    _check_dit(refdir, batch, ref)
