"""Parity of ``PyramidDiffusionMMDiT`` (SD3-style pyramid DiT) with the reference vectors.

Cases are discovered from the files present: every sub-folder of the reference dir whose ``config.json`` names
this class, and every ``forward_*.safetensors`` in it. Inputs ``sample.{k}.{j}`` (column k, clip j), text and
timesteps are replayed; every ``output.{k}`` must match with rel error (max abs diff / max abs ref) within the
float32 rounding of the model's and the case's sizes (``helpers.parity.dit_sums``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.parity import assert_reference_layout, assert_replay_within, model_dirs_or_skip, reference_kwargs
from pfctl.models.dit_mmdit import PyramidDiffusionMMDiT

CLASS = PyramidDiffusionMMDiT


@pytest.mark.parity
def test_mmdit_matches_reference_vectors(refdir: Path) -> None:
    assert_replay_within(refdir, CLASS)


@pytest.mark.parity
def test_mmdit_state_dict_keys_are_the_reference_keys(refdir: Path) -> None:
    for d in model_dirs_or_skip(refdir, CLASS):
        model = CLASS(**reference_kwargs(d))
        reference = assert_reference_layout(model, d)
        # the sin-cos buffer is computed at construction: it must equal the stored one, up to the rounding of
        # the angles (positions up to pos_embed_max_size times frequencies <= 1; |d sin| <= |d angle|)
        angle = max(int(reference_kwargs(d).get("pos_embed_max_size") or 1), 1)
        torch.testing.assert_close(
            model.state_dict()["pos_embed.pos_embed"],
            reference["pos_embed.pos_embed"],
            rtol=0,
            atol=8 * torch.finfo(torch.float32).eps * angle,
        )
