"""Parity of ``PyramidFluxTransformer`` with the reference vectors.

Cases are discovered from the files present: every sub-folder of the reference dir whose ``config.json`` names
this class, and every ``forward_*.safetensors`` in it. Inputs ``sample.{k}.{j}`` (column k, clip j), text and
timesteps are replayed; every ``output.{k}`` must match with rel error (max abs diff / max abs ref) within the
float32 rounding of the model's and the case's sizes (``helpers.parity.dit_sums``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.parity import assert_reference_layout, assert_replay_within, model_dirs_or_skip, reference_kwargs
from pfctl.models.dit_flux import PyramidFluxTransformer

CLASS = PyramidFluxTransformer


@pytest.mark.parity
def test_flux_dit_matches_reference_vectors(refdir: Path) -> None:
    assert_replay_within(refdir, CLASS)


@pytest.mark.parity
def test_flux_dit_state_dict_keys_are_the_reference_keys(refdir: Path) -> None:
    for d in model_dirs_or_skip(refdir, CLASS):
        assert_reference_layout(CLASS(**reference_kwargs(d)), d)
