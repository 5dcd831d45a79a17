"""Parity of ``PyramidDiffusionMMDiT`` (SD3-style pyramid DiT) with the reference vectors.

Cases are discovered from the files present: every sub-folder of the reference dir whose ``config.json`` names
this class, and every ``forward_*.safetensors`` in it. Inputs ``sample.{k}.{j}`` (column k, clip j), text and
timesteps are replayed; every ``output.{k}`` must match with rel error (max abs diff / max abs ref) <= 1e-5.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pfctl.models.dit_mmdit import PyramidDiffusionMMDiT

REL_TOL = 1e-5
CLASS = PyramidDiffusionMMDiT

# The discovery/replay helpers below mirror tests/parity/test_flux_dit.py on purpose: test modules do not
# import each other (that would depend on pytest's import mode).


def model_dirs(refdir: Path, class_name: str) -> list[Path]:
    found = []
    for sub in sorted(p for p in refdir.iterdir() if p.is_dir()):
        cfg = sub / "config.json"
        has_files = (sub / "constructor_kwargs.json").is_file() and cfg.is_file()
        if has_files and json.loads(cfg.read_text()).get("_class_name") == class_name:
            found.append(sub)
    return found


def columns_from(vectors: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Rebuild the column/clip list from ``sample.{k}.{j}`` keys."""
    index: dict[int, dict[int, torch.Tensor]] = {}
    for key, value in vectors.items():
        m = re.fullmatch(r"sample\.(\d+)\.(\d+)", key)
        if m:
            index.setdefault(int(m[1]), {})[int(m[2])] = value
    assert index, "no sample.{k}.{j} inputs in the vector file"
    assert sorted(index) == list(range(len(index))), f"columns are not contiguous: {sorted(index)}"
    return [[clips[j] for j in sorted(clips)] for _, clips in sorted(index.items())]


def replay(model_dir: Path, model_cls: type) -> list[tuple[str, int, float]]:
    """Build, load strictly and replay every forward file; returns (file, column, rel error) rows."""
    kwargs = json.loads((model_dir / "constructor_kwargs.json").read_text())
    model = model_cls(**kwargs).eval()
    model.load_state_dict(load_file(str(model_dir / "state_dict.safetensors")), strict=True)
    rows = []
    files = sorted(model_dir.glob("forward_*.safetensors"))
    assert files, f"no forward_*.safetensors in {model_dir}"
    for path in files:
        vectors = load_file(str(path))
        with torch.no_grad():
            outputs = model(
                sample=columns_from(vectors),
                encoder_hidden_states=vectors["encoder_hidden_states"],
                encoder_attention_mask=vectors["encoder_attention_mask"],
                pooled_projections=vectors["pooled_projections"],
                timestep_ratio=vectors["timestep_ratio"],
            )
        expected = sorted(int(k.split(".")[1]) for k in vectors if re.fullmatch(r"output\.\d+", k))
        assert expected == list(range(len(outputs))), (
            f"{path.name}: {len(outputs)} outputs vs keys {expected}"
        )
        for k, out in enumerate(outputs):
            ref = vectors[f"output.{k}"]
            assert out.shape == ref.shape, f"{path.name} output.{k}: {tuple(out.shape)} vs {tuple(ref.shape)}"
            rel = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            rows.append((path.name, k, rel))
    return rows


@pytest.mark.parity
def test_mmdit_matches_reference_vectors(refdir: Path) -> None:
    dirs = model_dirs(refdir, CLASS.__name__)
    if not dirs:
        pytest.skip(f"no reference folder for {CLASS.__name__} in {refdir}")
    rows = [row for d in dirs for row in replay(d, CLASS)]
    bad = [r for r in rows if not r[2] <= REL_TOL]
    assert not bad, f"rel error above {REL_TOL}: {bad}"


@pytest.mark.parity
def test_mmdit_state_dict_keys_are_the_reference_keys(refdir: Path) -> None:
    dirs = model_dirs(refdir, CLASS.__name__)
    if not dirs:
        pytest.skip(f"no reference folder for {CLASS.__name__} in {refdir}")
    for d in dirs:
        reference = load_file(str(d / "state_dict.safetensors"))
        model = CLASS(**json.loads((d / "constructor_kwargs.json").read_text()))
        ours = model.state_dict()
        assert sorted(ours) == sorted(reference)
        assert all(ours[k].shape == reference[k].shape for k in ours)
        # the sin-cos buffer is computed at construction: it must equal the stored one
        torch.testing.assert_close(
            ours["pos_embed.pos_embed"], reference["pos_embed.pos_embed"], rtol=0, atol=1e-6
        )
        # the config we write carries exactly the reference's fields
        ref_cfg = json.loads((d / "config.json").read_text())
        ours_cfg = dict(model.config)
        assert sorted(k for k in ref_cfg if not k.startswith("_")) == sorted(
            k for k in ours_cfg if not k.startswith("_")
        )
