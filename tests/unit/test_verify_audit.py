"""Audit: norms and attention classified from what a real forward pass feeds them."""

from __future__ import annotations

import pytest
import torch

from pfctl.models.diffusers_vae import load_diffusers_vae
from pfctl.verify.audit import ATTN, EXACT, STATS, audit_module, check_framewise_flags


def _audit(spec: str, frames: int = 9):
    vae = load_diffusers_vae(spec)
    x = torch.rand(1, 3, frames, 16, 16) * 2 - 1
    return vae, x, audit_module(vae.module, lambda: vae.encode(x))


@pytest.mark.parametrize(
    ("spec", "verdict", "coupled_by"),
    [
        ("cogvideox-tiny", STATS, ["stats"]),
        ("wan-tiny", EXACT, []),
        ("ltx-tiny", EXACT, []),
        ("hunyuan-tiny", ATTN, ["stats", "attention"]),
        ("mochi-tiny", ATTN, ["attention"]),
    ],
)
def test_verdicts_of_diffusers_vaes(spec, verdict, coupled_by):
    _, _, audit = _audit(spec)
    assert audit.verdict == verdict
    assert audit.coupled_by == coupled_by
    if verdict == EXACT:
        assert audit.first_offending == []
    else:
        assert audit.first_offending


def test_cogvideox_counts_and_first_offender():
    _, _, audit = _audit("cogvideox-tiny")
    counts = audit.counts()
    # tiny config: 4 down resnets + 2 mid resnets, two norms each, plus norm_out
    assert counts["time_coupled"] == 13
    assert counts["per_frame"] == counts["channel_only"] == 0
    assert audit.first_offending[0] == "encoder.down_blocks.0.resnets.0.norm1"


def test_wan_norms_are_channel_only_and_attention_per_frame():
    _, _, audit = _audit("wan-tiny")
    counts = audit.counts()
    assert counts["channel_only"] > 0 and counts["time_coupled"] == 0
    assert counts["attention_per_frame"] >= 1 and counts["attention_cross_frame"] == 0


def test_mochi_groupnorm_is_per_frame_but_attention_spans_frames():
    _, _, audit = _audit("mochi-tiny", frames=13)
    assert audit.counts()["per_frame"] > 0
    cross = [a for a in audit.attention if a.cross_frame]
    assert cross and all(a.causal for a in cross)


def test_ltx_encode_flag_bug_detected():
    vae, x, _ = _audit("ltx-tiny")
    flags = check_framewise_flags(vae.module, x)
    bug = [f for f in flags if f.severity == "bug"]
    assert bug and "use_framewise_decoding" in bug[0].message
    assert vae.module.use_framewise_encoding is False  # restored


def test_cogvideox_flag_note():
    vae, x, _ = _audit("cogvideox-tiny")
    flags = check_framewise_flags(vae.module, x)
    assert [f.flag for f in flags] == ["num_sample_frames_batch_size"]


def test_pfctl_causal_vae_is_exact_chunkable():
    vae_mod = pytest.importorskip("pfctl.models.vae")
    vae = vae_mod.load_vae("causal-vae-tiny")
    x = torch.rand(1, 3, 9, 16, 16) * 2 - 1
    audit = audit_module(vae.module, lambda: vae.encode(x))
    assert audit.verdict == EXACT
    assert audit.counts()["time_coupled"] == 0
