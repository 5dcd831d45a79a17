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

from helpers.parity import columns_from, dit_sums, reference_flux_dit, reference_kwargs, rel_error
from helpers.tolerance import assert_rounding_close, rounding_rtol
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

NOISE = {"reduction": 4, "depth": 8}
"""The noise construction's arithmetic: 2x2 resamples between the stages and a few elementwise blends per
clip (helpers.tolerance)."""


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
            assert_rounding_close(clip, ref[f"sample.{k}.{j}"], **NOISE)
        assert_rounding_close(batch.targets[k], ref[f"target.{k}"], **NOISE)
        assert_rounding_close(batch.ratios[k], ref[f"ratio.{k}"], reduction=1)
    assert_rounding_close(batch.timesteps, ref["timestep_ratio"], reduction=1)


def _assert_loss(loss: torch.Tensor, batch, ref: dict) -> None:
    """A mean over every target element, in another order than the reference's (helpers.tolerance)."""
    elements = sum(t.numel() for t in batch.targets)
    assert_rounding_close(loss.reshape(1), ref["loss"], reduction=elements, depth=2)


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
    sums = dit_sums(reference_kwargs(refdir / "flux_dit"), batch.sample, ref["encoder_hidden_states"].shape[1])
    tol = rounding_rtol(**sums)
    for k, out in enumerate(outputs):
        rel = rel_error(out, ref[f"output.{k}"])
        assert rel <= tol, f"output.{k}: rel error {rel:.3g} (tolerance {tol:.3g})"
    loss = flow_matching_loss(outputs, batch.targets, batch.column_to_stage)
    _assert_loss(loss.loss, batch, ref)


def _temporal_cases(refdir) -> list[tuple[str, dict, dict]]:
    """``(file name, meta, tensors)`` of every ``flux_dit/forward_*`` file with training-noise vectors, its
    ``forward_meta.json`` entry found by the clip shapes it lists; skips when there is none."""
    folder = refdir / "flux_dit"
    meta_path = folder / "forward_meta.json"
    entries = json.loads(meta_path.read_text()).values() if meta_path.is_file() else []
    metas = [m for m in entries if isinstance(m, dict) and "column_to_stage" in m and "clip_shapes" in m]
    cases = []
    for path in sorted(folder.glob("forward_*.safetensors")):
        ref = load_file(path)
        if "clean_latent" not in ref:
            continue
        shapes = [[list(clip.shape) for clip in column] for column in columns_from(ref)]
        meta = next((m for m in metas if m["clip_shapes"] == shapes), None)
        assert meta is not None, f"{path.name}: no forward_meta.json entry lists its clip shapes"
        cases.append((path.name, meta, ref))
    if not cases:
        pytest.skip("no training-noise vectors (flux_dit/forward_* with clean_latent) in the reference set")
    return cases


def _temporal_batch(meta: dict, ref: dict):
    scheduler = PyramidFlowScheduler()
    pyramid = pyramid_latents(ref["clean_latent"], scheduler.num_stages)
    for i, level in enumerate(pyramid):
        assert_rounding_close(level, ref[f"pyramid_latent.{i}"], reduction=4, depth=len(pyramid))
    frame_per_unit = int(meta.get("frame_per_unit", 1))
    clip_units = 1 + (ref["clean_latent"].shape[2] - 1) // frame_per_unit
    counter = int(meta.get("accumulate_steps_after", 1)) - 1  # the reference counts the call before use
    units = sample_stage_length(
        counter, meta["rank"], meta["video_sync_group"], meta["max_temporal_length"], clip_units
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
    return batch


def test_temporal_pyramid_noise(refdir):
    for _, meta, ref in _temporal_cases(refdir):
        _assert_batch(_temporal_batch(meta, ref), ref)


def test_temporal_pyramid_dit_output_and_loss(refdir):
    for _, meta, ref in _temporal_cases(refdir):
        batch = _temporal_batch(meta, ref)
        # the saved outputs (DiT-independent): pfctl's loss on them equals the saved loss
        outs = [ref[f"output.{k}"] for k in range(len(batch.sample))]
        loss = flow_matching_loss(outs, batch.targets, batch.column_to_stage)
        _assert_loss(loss.loss, batch, ref)
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
        assert_rounding_close(level, ref[f"pyramid_latent.{i}"], reduction=4, depth=len(pyramid))
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
    _assert_loss(loss.loss, batch, ref)
    _check_dit(refdir, batch, ref)
