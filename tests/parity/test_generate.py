"""Sampling loop vs the reference ``generate`` / ``generate_i2v`` runs (latents only).

Two levels, for every reference folder whose ``meta.json`` records ``dit_calls`` (discovered, not named):

* replay: a stand-in DiT returns the saved raw output of each call after checking that pfctl feeds
  it the saved inputs (history layout, CFG batch, timestep) — validates the loop without a model;
* model: pfctl's ``PyramidFluxTransformer`` with the reference weights, final latents within the float32
  rounding of the run's sizes (skipped while the model is not importable).

The reference's quirks are requested explicitly (``reference_compat=True``; i2v steps passed as
``video_num_inference_steps``). The VAE decode part belongs to the generate command's tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.parity import dit_sums, reference_flux_dit, reference_kwargs, rel_error
from helpers.tolerance import assert_rounding_close, rounding_rtol
from pfctl.models.text_embeddings import TextEmbeddings
from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents

pytestmark = pytest.mark.parity

REFERENCE_DEFAULTS = {"alpha": 0.5, "min_guidance_scale": 2.0, "use_linear_guidance": False}


def _cases(refdir) -> list[tuple[str, dict, dict]]:
    """``(folder name, tensors, meta)`` of every generate run in the set; skips when there is none."""
    cases = []
    for folder in sorted(p for p in refdir.iterdir() if (p / "meta.json").is_file()):
        meta = json.loads((folder / "meta.json").read_text())
        files = sorted(folder.glob("*.safetensors"))
        if "dit_calls" in meta and "call" in meta and files:
            cases.append((folder.name, load_file(files[0]), meta))
    if not cases:
        pytest.skip("no generate run (a folder whose meta.json records dit_calls) in the reference set")
    return cases


def _loop_rtol(calls: int) -> float:
    """The sampler's own arithmetic: a few elementwise operations per DiT call (guidance mix, Euler step) and,
    between stages, a 2x2 resample and the renoise (helpers.tolerance)."""
    return rounding_rtol(reduction=4, depth=4 * calls)


def _kwargs(tensors: dict, meta: dict) -> dict:
    call = {**REFERENCE_DEFAULTS, **meta["call"]}
    noise = tensors["initial_noise"]
    i2v = "image_latent" in tensors
    steps = call["num_inference_steps"]
    n_block = sum(1 for k in tensors if k.startswith("block_noise."))
    settings = SamplingSettings(
        num_inference_steps=_as_steps(steps),
        # the reference i2v has no video steps argument: every unit uses num_inference_steps
        video_num_inference_steps=_as_steps(steps if i2v else call["video_num_inference_steps"]),
        guidance_scale=call["guidance_scale"],
        video_guidance_scale=call["video_guidance_scale"],
        use_linear_guidance=call["use_linear_guidance"],
        alpha=call["alpha"],
        min_guidance_scale=call["min_guidance_scale"],
        reference_compat=True,
    )
    return {
        "settings": settings,
        "temp": call["temp"],
        "height": noise.shape[-2],
        "width": noise.shape[-1],
        "initial_noise": noise,
        "block_noises": [tensors[f"block_noise.{i}"] for i in range(n_block)],
        "image_latent": tensors.get("image_latent"),
        "latent_channels": noise.shape[1],
    }


def _as_steps(steps: int | list[int]) -> int | tuple[int, ...]:
    return steps if isinstance(steps, int) else tuple(steps)


def _text(tensors: dict) -> TextConditioning:
    negative = {k: tensors[f"negative_{k}"] for k in TextEmbeddings.KEYS}
    return TextConditioning(TextEmbeddings.from_dict(tensors), TextEmbeddings.from_dict(negative))


class ReplayDiT:
    """Checks each call's inputs against ``dit_call.{c}.*`` and returns the saved output."""

    def __init__(self, tensors: dict, meta: dict):
        self.t = tensors
        self.meta = meta
        self.calls = 0
        self.max_input_err = 0.0  # relative: max |ours - ref| / max |ref| over the clips

    def __call__(
        self, *, sample, timestep_ratio, encoder_hidden_states, encoder_attention_mask, pooled_projections
    ):
        c = self.calls
        assert len(sample) == 1, "generation uses a single column"
        clips = sample[0]
        n_ref = sum(1 for k in self.t if k.startswith(f"dit_call.{c}.sample."))
        assert len(clips) == n_ref, f"call {c}: {len(clips)} clips, reference {n_ref}"
        for j, clip in enumerate(clips):
            ref = self.t[f"dit_call.{c}.sample.{j}"]
            assert clip.shape == ref.shape, (c, j)
            self.max_input_err = max(self.max_input_err, rel_error(clip, ref, floor=1e-12))
        torch.testing.assert_close(timestep_ratio, self.t[f"dit_call.{c}.timestep_ratio"], rtol=0, atol=0)
        assert encoder_hidden_states.shape[0] == clips[-1].shape[0]
        self.calls += 1
        return [self.t[f"dit_call.{c}.output"].clone()]


def test_generate_loop_replay(refdir):
    for name, tensors, meta in _cases(refdir):
        _replay_case(name, tensors, meta)


def _replay_case(name: str, tensors: dict, meta: dict) -> None:
    dit = ReplayDiT(tensors, meta)
    steps = []

    def record(info):
        steps.append(info)
        c = len(steps) - 1
        ref_meta = meta["dit_calls"][c]
        assert (info["unit"], info["stage"], info["step"]) == (
            ref_meta["unit"],
            ref_meta["stage"],
            ref_meta["step_in_stage"],
        )
        assert info["sigma"] == ref_meta["sigma"] and info["sigma_next"] == ref_meta["sigma_next"]
        if "guidance" in ref_meta:
            assert info["guidance"] == ref_meta["guidance"]
        guided = tensors.get(f"step.{c}.model_output_guided")
        if guided is not None:
            assert_rounding_close(info["guided"], guided, reduction=4, depth=4 * (c + 1), msg=name)
            latents = tensors[f"step.{c}.sample"]
            assert_rounding_close(info["latents"], latents, reduction=4, depth=4 * (c + 1), msg=name)

    final = generate_latents(dit, _text(tensors), on_dit_call=record, **_kwargs(tensors, meta))
    assert dit.calls == meta["num_dit_calls"], name
    tol = _loop_rtol(dit.calls)
    assert dit.max_input_err <= tol, (name, dit.max_input_err, tol)
    assert final.shape == tensors["final_latents"].shape, name
    assert rel_error(final, tensors["final_latents"], floor=1e-12) <= tol, name


def test_generate_with_flux_dit(refdir):
    cases = _cases(refdir)
    dit = reference_flux_dit(refdir)
    kwargs = reference_kwargs(refdir / "flux_dit")
    for name, tensors, meta in cases:
        final = generate_latents(dit, _text(tensors), **_kwargs(tensors, meta))
        ref = tensors["final_latents"]
        assert final.shape == ref.shape, name
        # every DiT call's sums (the whole video's tokens bound any column's), chained over the calls;
        # guidance g turns a difference d of the two predictions into up to (1 + 2 g) d
        sums = dit_sums(kwargs, [[ref[0]]], tensors["prompt_embeds"].shape[1])
        call = {**REFERENCE_DEFAULTS, **meta["call"]}
        gain = 1 + 2 * max(call["guidance_scale"], call["video_guidance_scale"])
        tol = rounding_rtol(sums["reduction"], sums["depth"] * meta["num_dit_calls"], ulps=8 * gain)
        rel = rel_error(final, ref, floor=1e-12)
        assert rel <= tol, f"{name}: rel error {rel:.3g} (tolerance {tol:.3g})"
        if "image_latent" in tensors:
            assert torch.equal(final[:, :, :1], tensors["image_latent"]), name
