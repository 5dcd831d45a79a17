"""Comparing two latent caches (encode-latents tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.tolerance import rounding_rtol
from pfctl.data import latent_cache as lc


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
