"""The shapes VAE's training (pfctl.demo.train_vae): the decoder phase and its loss weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pfctl.demo.shapes import BACKGROUND
from pfctl.demo.train_vae import (
    DECODER_PREFIXES,
    SHAPES_VAE_CONFIG,
    VAETrainConfig,
    edge_weights,
    train_vae,
    train_vae_decoder,
)
from pfctl.errors import ConfigError

WEIGHTS = "causal_video_vae/diffusion_pytorch_model.safetensors"


def tiny_cfg(**overrides) -> VAETrainConfig:
    """16x16 clips of 9 frames (2x2 latents, 2 latent frames), 4-8 channels: seconds on a CPU."""
    vae_config = {
        **SHAPES_VAE_CONFIG,
        "encoder_block_out_channels": [4, 8, 8, 8],
        "decoder_block_out_channels": [4, 8, 8, 8],
    }
    base = {
        "steps": 2,
        "image_steps": 1,
        "decoder_steps": 3,
        "decoder_warmup_steps": 1,
        "batch_size": 2,
        "num_clips": 4,
        "size": 16,
        "num_frames": 9,
        "vae_config": vae_config,
    }
    return VAETrainConfig(**{**base, **overrides})


def test_edge_weights_mark_the_outline_band() -> None:
    cfg = VAETrainConfig(fg_weight=5.0, decoder_edge_weight=20.0)
    background = torch.tensor(BACKGROUND, dtype=torch.float32).view(1, 3, 1, 1, 1) / 127.5 - 1
    x = background.expand(1, 3, 1, 12, 12).clone()
    x[:, 0, :, 4:8, 4:8] = 0.8  # a 4x4 red square
    w = edge_weights(x, background, cfg)[0, 0, 0]
    assert w.shape == (12, 12)
    assert w[0, 0] == 1.0 and w[11, 11] == 1.0  # background far from the shape
    assert w[5, 5] == 5.0 and w[6, 6] == 5.0  # inside, off the outline: fg_weight
    assert w[4, 4] == 25.0 and w[7, 5] == 25.0  # the shape's own outline pixels
    assert w[3, 5] == 21.0 and w[8, 8] == 21.0  # background pixels touching the shape
    assert w[2, 5] == 1.0  # two pixels out: background again


@pytest.mark.slow
def test_decoder_phase_keeps_the_encoder_and_matches_a_single_run(tmp_path: Path) -> None:
    first = tmp_path / "first"
    train_vae(first, tiny_cfg(decoder_steps=0), log_every=1)
    before = load_file(first / WEIGHTS)
    record = json.loads((first / "vae_train_config.json").read_text())
    assert record["steps_done"] == 2 and record["decoder_steps_done"] == 0

    later = tmp_path / "later"
    shutil.copytree(first, later)
    train_vae_decoder(later, tiny_cfg(), log_every=1)
    after = load_file(later / WEIGHTS)
    decoder = [k for k in after if k.startswith(DECODER_PREFIXES)]
    assert decoder and len(decoder) < len(after)
    for key in after:
        if key in decoder:
            continue
        # the encoder is frozen: its weights (and so every latent it makes) are the saved ones
        assert torch.equal(after[key], before[key]), key
    assert any(not torch.equal(after[k], before[k]) for k in decoder)
    record = json.loads((later / "vae_train_config.json").read_text())
    assert record["steps_done"] == 2 and record["decoder_steps_done"] == 3
    assert record["decoder_edge_weight"] == tiny_cfg().decoder_edge_weight
    phases = [
        json.loads(line).get("phase") for line in (later / "vae_train_log.jsonl").read_text().splitlines()
    ]
    assert phases == [None, None, "decoder", "decoder", "decoder"]

    # the phase run later on the saved VAE draws the same batches as one call doing both phases
    # (own generators), so a VAE of an earlier build + the phase is the from-scratch VAE
    single = tmp_path / "single"
    train_vae(single, tiny_cfg(), log_every=1)
    for key, value in load_file(single / WEIGHTS).items():
        torch.testing.assert_close(value, after[key], rtol=0, atol=1e-6, msg=key)


def test_decoder_phase_refuses_no_steps(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="decoder_steps"):
        train_vae_decoder(tmp_path, tiny_cfg(decoder_steps=0))
    with pytest.raises(ConfigError, match="decoder_steps"):
        train_vae(tmp_path, tiny_cfg(decoder_steps=-1))


@pytest.mark.slow
def test_build_runs_the_decoder_phase_only_on_a_vae_without_it(tmp_path: Path, monkeypatch) -> None:
    from pfctl.demo import build_default
    from pfctl.demo import train_vae as module

    stage = tmp_path / "stage"
    train_vae(stage, tiny_cfg(decoder_steps=0), log_every=1)
    record = stage / "vae_train_config.json"
    old = json.loads(record.read_text())
    del old["decoder_steps_done"]  # a VAE trained before the phase existed
    record.write_text(json.dumps(old))
    calls = []

    def fake_phase(out_dir, cfg, **kwargs):
        calls.append(cfg.decoder_steps)
        path = Path(out_dir) / "vae_train_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "decoder_steps_done": cfg.decoder_steps}))

    monkeypatch.setattr(module, "train_vae_decoder", fake_phase)
    done = build_default._vae_stage(stage, None, None, "cpu")
    assert calls == [VAETrainConfig().decoder_steps]
    assert done["decoder_steps_done"] == VAETrainConfig().decoder_steps and done["steps_done"] == 2
    assert set(done["roundtrip"]) >= {"psnr", "color_accuracy", "direction_accuracy", "shape_accuracy"}
    build_default._vae_stage(stage, None, None, "cpu")  # the phase is recorded: not run again
    assert len(calls) == 1
