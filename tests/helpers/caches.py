"""encode-latents tests: a quick tiny-VAE config, and comparing two latent caches."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.tolerance import rounding_rtol
from pfctl.config import load_config
from pfctl.data import latent_cache as lc

BUCKETS = [[32, 24], [24, 32]]
"""Small buckets keep the tiny VAE at ~0.1 s per clip on 2 cores."""


def encode_config(annotations: Path, out: Path, **encode):
    """The tiny causal VAE on ``annotations`` into ``out``: 9 frames, :data:`BUCKETS`, no text, fp32 (bf16
    convolutions are slow on CPUs), decoding in this process; ``encode`` overrides any ``encode.`` key."""
    flags = {
        "encode.annotations": str(annotations),
        "encode.output_dir": str(out),
        "model.vae": "causal-vae-tiny",
        "encode.buckets": BUCKETS,
        "encode.num_frames": 9,
        "encode.num_workers": 0,
        "encode.text": False,
        "encode.dtype": "fp32",
    }
    flags.update({f"encode.{k}": v for k, v in encode.items()})
    return load_config(None, [], flags)


def assert_same_cache(got: Path, want: Path) -> None:
    """Same fingerprint, clips, manifest rows, metadata and text features; latents of the tiny causal VAE
    equal up to the rounding of another batch composition or process (helpers.tolerance: its 3x3x3
    convolutions over 16 channels, ~20 chained), each then rounded to bf16, so up to one bf16 step
    (2^-7 relative) apart."""
    a, b = lc.LatentCache.open(got), lc.LatentCache.open(want)
    assert a.fingerprint == b.fingerprint and a.items() == b.items()
    for clip_id in b.ids():
        assert a.metadata(clip_id) == b.metadata(clip_id)
        x, y = a.load(clip_id), b.load(clip_id)
        assert set(x) == set(y)
        for key in y:
            if key.startswith("latent"):
                fp32 = rounding_rtol(16 * 27, 20) * float(y[key].float().abs().max())
                torch.testing.assert_close(x[key].float(), y[key].float(), rtol=2**-7, atol=fp32)
            else:
                assert torch.equal(x[key], y[key]), (clip_id, key)
