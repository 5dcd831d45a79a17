"""Sampling loop vs the reference ``generate`` / ``generate_i2v`` runs (latents only).

Two levels, discovered from the reference folders present:

* replay: a stand-in DiT returns the saved raw output of each call after checking that pfctl feeds
  it the saved inputs (history layout, CFG batch, timestep) — validates the loop without a model;
* model: pfctl's ``PyramidFluxTransformer`` with the reference weights, final latents within
  rel 1e-4 (skipped while the model is not importable).

The reference's quirks are requested explicitly (``reference_compat=True``; i2v steps passed as
``video_num_inference_steps``). The VAE decode part belongs to the generate command's tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.parity import reference_flux_dit, rel_error
from pfctl.models.text_embeddings import TextEmbeddings
from pfctl.sampling.sampler import TextConditioning, generate_latents

pytestmark = pytest.mark.parity

CASES = ["generate", "generate_i2v", "generate_linear_guidance"]
REFERENCE_DEFAULTS = {"alpha": 0.5, "min_guidance_scale": 2.0, "use_linear_guidance": False}


def _case(refdir, name):
    folder = refdir / name
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files or not (folder / "meta.json").exists():
        pytest.skip(f"{name}/ not in the reference set")
    return load_file(files[0]), json.loads((folder / "meta.json").read_text())


def _kwargs(tensors: dict, meta: dict) -> dict:
    call = {**REFERENCE_DEFAULTS, **meta["call"]}
    noise = tensors["initial_noise"]
    i2v = "image_latent" in tensors
    steps = call["num_inference_steps"]
    n_block = sum(1 for k in tensors if k.startswith("block_noise."))
    return {
        "temp": call["temp"],
        "height": noise.shape[-2],
        "width": noise.shape[-1],
        "num_inference_steps": steps,
        # the reference i2v has no video steps argument: every unit uses num_inference_steps
        "video_num_inference_steps": steps if i2v else call["video_num_inference_steps"],
        "guidance_scale": call["guidance_scale"],
        "video_guidance_scale": call["video_guidance_scale"],
        "use_linear_guidance": call["use_linear_guidance"],
        "alpha": call["alpha"],
        "min_guidance_scale": call["min_guidance_scale"],
        "initial_noise": noise,
        "block_noises": [tensors[f"block_noise.{i}"] for i in range(n_block)],
        "image_latent": tensors.get("image_latent"),
        "reference_compat": True,
        "latent_channels": noise.shape[1],
    }


def _text(tensors: dict) -> TextConditioning:
    negative = {k: tensors[f"negative_{k}"] for k in TextEmbeddings.KEYS}
    return TextConditioning(TextEmbeddings.from_dict(tensors), TextEmbeddings.from_dict(negative))


class ReplayDiT:
    """Checks each call's inputs against ``dit_call.{c}.*`` and returns the saved output."""

    def __init__(self, tensors: dict, meta: dict):
        self.t = tensors
        self.meta = meta
        self.calls = 0
        self.max_input_err = 0.0

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
            self.max_input_err = max(self.max_input_err, (clip - ref).abs().max().item())
        torch.testing.assert_close(timestep_ratio, self.t[f"dit_call.{c}.timestep_ratio"], rtol=0, atol=0)
        assert encoder_hidden_states.shape[0] == clips[-1].shape[0]
        self.calls += 1
        return [self.t[f"dit_call.{c}.output"].clone()]


@pytest.mark.parametrize("name", CASES)
def test_generate_loop_replay(refdir, name):
    tensors, meta = _case(refdir, name)
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
            torch.testing.assert_close(info["guided"], guided, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(info["latents"], tensors[f"step.{c}.sample"], rtol=1e-6, atol=1e-6)

    final = generate_latents(dit, _text(tensors), on_dit_call=record, **_kwargs(tensors, meta))
    assert dit.calls == meta["num_dit_calls"]
    assert dit.max_input_err <= 1e-5
    assert final.shape == tensors["final_latents"].shape
    assert rel_error(final, tensors["final_latents"], floor=1e-12) <= 1e-6


@pytest.mark.parametrize("name", CASES)
def test_generate_with_flux_dit(refdir, name):
    tensors, meta = _case(refdir, name)
    dit = reference_flux_dit(refdir)
    final = generate_latents(dit, _text(tensors), **_kwargs(tensors, meta))
    assert final.shape == tensors["final_latents"].shape
    rel = rel_error(final, tensors["final_latents"], floor=1e-12)
    assert rel <= 1e-4, f"{name}: rel error {rel:.3g}"
    if "image_latent" in tensors:
        assert torch.equal(final[:, :, :1], tensors["image_latent"])
