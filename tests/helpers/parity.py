"""Shared pieces of the DiT parity tests, so every test reads the reference folders the same way.

A reference model folder holds ``config.json`` (``_class_name`` names the pfctl class),
``constructor_kwargs.json``, ``state_dict.safetensors`` and ``forward_*.safetensors`` cases whose inputs are
``sample.{k}.{j}`` (column k, clip j), the text tensors and ``timestep_ratio``, and whose outputs are
``output.{k}``. Cases are discovered from the files present; no number from the vectors is copied here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from helpers.tolerance import rounding_rtol


def model_dirs(refdir: Path, class_name: str) -> list[Path]:
    """Sub-folders of ``refdir`` whose ``config.json`` names ``class_name`` (and that have constructor kwargs)."""
    found = []
    for sub in sorted(p for p in refdir.iterdir() if p.is_dir()):
        cfg = sub / "config.json"
        has_files = (sub / "constructor_kwargs.json").is_file() and cfg.is_file()
        if has_files and json.loads(cfg.read_text()).get("_class_name") == class_name:
            found.append(sub)
    return found


def model_dirs_or_skip(refdir: Path, model_cls: type) -> list[Path]:
    """:func:`model_dirs` for ``model_cls``; skips the test when the reference set has none."""
    dirs = model_dirs(refdir, model_cls.__name__)
    if not dirs:
        pytest.skip(f"no reference folder for {model_cls.__name__} in {refdir}")
    return dirs


def reference_kwargs(model_dir: Path) -> dict[str, Any]:
    """The constructor arguments the reference model was built with."""
    return json.loads((model_dir / "constructor_kwargs.json").read_text())


def load_reference_model(model_dir: Path, model_cls: type) -> torch.nn.Module:
    """Build ``model_cls`` from the folder's constructor kwargs and load its state dict strictly (eval mode)."""
    model = model_cls(**reference_kwargs(model_dir)).eval()
    model.load_state_dict(load_file(str(model_dir / "state_dict.safetensors")), strict=True)
    return model


def reference_flux_dit(refdir: Path) -> torch.nn.Module:
    """pfctl's Flux DiT with the reference ``flux_dit/`` weights (skips when the model is not importable)."""
    try:
        from pfctl.models.dit_flux import PyramidFluxTransformer
    except ImportError as exc:  # tests that use it check other parts first; they need not fail on this
        pytest.skip(f"pfctl.models.dit_flux not importable yet: {exc}")
    return load_reference_model(refdir / "flux_dit", PyramidFluxTransformer)


def dit_sums(kwargs: dict[str, Any], columns: list[list[torch.Tensor]], text_len: int) -> dict[str, int]:
    """The sums of one pyramid-DiT forward, from the folder's constructor arguments and the case's inputs (for
    :func:`helpers.tolerance.rounding_rtol`): the longest is the MLP's hidden width (4x the attention width)
    or the attention's key count (a column's 2x2 patches plus the text), whichever is larger; about 8 are
    chained per block (projections, scores, weighted values, output, two MLP layers, norms)."""
    inner = int(kwargs["num_attention_heads"]) * int(kwargs["attention_head_dim"])
    blocks = int(kwargs.get("num_layers", 0)) + int(kwargs.get("num_single_layers", 0))
    keys = max(sum(c.shape[-3] * c.shape[-2] * c.shape[-1] for c in column) // 4 for column in columns)
    return {"reduction": max(4 * inner, keys + text_len), "depth": 8 * max(blocks, 1)}


def vae_rtol(vae: torch.nn.Module) -> float:
    """A causal VAE's float32 rounding (:func:`helpers.tolerance.rounding_rtol`): its widest convolution's
    ``channels * kernel volume`` terms, one sum per convolution chained (encoder and decoder together)."""
    convs = [m for m in vae.modules() if isinstance(m, torch.nn.Conv3d)]
    longest = max(m.in_channels // m.groups * math.prod(m.kernel_size) for m in convs)
    return rounding_rtol(reduction=longest, depth=len(convs))


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


def rel_error(ours: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """max |ours - ref| / max |ref|; ``floor`` only guards an all-zero reference."""
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def replay(model_dir: Path, model_cls: type) -> list[tuple[str, int, float, float]]:
    """Build, load strictly and replay every forward file; returns (file, column, rel error, tolerance) rows,
    the tolerance derived from the model's and the case's sizes (:func:`dit_sums`)."""
    model = load_reference_model(model_dir, model_cls)
    kwargs = reference_kwargs(model_dir)
    rows = []
    files = sorted(model_dir.glob("forward_*.safetensors"))
    assert files, f"no forward_*.safetensors in {model_dir}"
    for path in files:
        vectors = load_file(str(path))
        columns = columns_from(vectors)
        tol = rounding_rtol(**dit_sums(kwargs, columns, vectors["encoder_hidden_states"].shape[1]))
        with torch.no_grad():
            outputs = model(
                sample=columns,
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
            rows.append((path.name, k, rel_error(out, ref), tol))
    return rows


def assert_replay_within(refdir: Path, model_cls: type) -> None:
    """Every forward case of every reference folder for ``model_cls`` matches to float32 rounding: its rel
    error (max abs diff / max abs ref) within the tolerance its sizes give (:func:`dit_sums`)."""
    rows = [row for d in model_dirs_or_skip(refdir, model_cls) for row in replay(d, model_cls)]
    bad = [r for r in rows if not r[2] <= r[3]]
    assert not bad, f"rel error above the rounding tolerance (file, column, error, tolerance): {bad}"


def assert_reference_layout(model: torch.nn.Module, model_dir: Path) -> dict[str, torch.Tensor]:
    """``model`` has exactly the reference state-dict keys and shapes and writes exactly the reference's
    config fields; returns the reference state dict for class-specific checks."""
    reference = load_file(str(model_dir / "state_dict.safetensors"))
    ours = model.state_dict()
    assert sorted(ours) == sorted(reference)
    assert all(ours[k].shape == reference[k].shape for k in ours)
    # the config we write carries exactly the reference's fields
    ref_cfg = json.loads((model_dir / "config.json").read_text())
    ours_cfg = dict(model.config)
    assert sorted(k for k in ref_cfg if not k.startswith("_")) == sorted(
        k for k in ours_cfg if not k.startswith("_")
    )
    return reference
