"""Tiny model folders for tests of every part, built with the real pfctl classes.

* :func:`make_text_encoder_folder` - tiny CLIP + T5 (or SD3 triple) with offline tokenizers.
* :func:`make_official_folder` - a whole checkpoint folder in the official Pyramid Flow layout:
  ``causal_video_vae/`` (config.json + pickled fp32 ``diffusion_pytorch_model.bin``, as the
  official one), ``<variant>/`` (config.json + safetensors), ``tokenizer{,_2}/``,
  ``text_encoder{,_2}/``.
* :func:`tiny_vae`, :func:`tiny_dit`, :func:`write_vae_folder`.

Text-encoder folders are built once per process per (kind, seed) and copied, because training
the tiny BPE and writing the shards costs a few hundred milliseconds each time.
"""

from __future__ import annotations

import atexit
import copy
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_TEMPLATES: dict[tuple[str, int], Path] = {}
_TEMPLATE_ROOT: Path | None = None


def _template_root() -> Path:
    global _TEMPLATE_ROOT
    if _TEMPLATE_ROOT is None:
        _TEMPLATE_ROOT = Path(tempfile.mkdtemp(prefix="pfctl-tiny-models-"))
        atexit.register(shutil.rmtree, _TEMPLATE_ROOT, True)
    return _TEMPLATE_ROOT


def make_text_encoder_folder(path: str | Path, *, kind: str = "pyramid_flux", seed: int = 0) -> Path:
    """Tiny text encoder subfolders (official names) under ``path``; returns ``path``."""
    from pfctl.models.text_encoder import FLUX_SUBFOLDERS, SD3_SUBFOLDERS, build_tiny_text_encoder_folder

    key = (kind, seed)
    if key not in _TEMPLATES:
        template = _template_root() / f"text-{kind}-{seed}"
        build_tiny_text_encoder_folder(template, seed=seed, kind=kind)
        _TEMPLATES[key] = template
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for name in SD3_SUBFOLDERS if kind == "pyramid_mmdit" else FLUX_SUBFOLDERS:
        shutil.copytree(_TEMPLATES[key] / name, root / name, dirs_exist_ok=True)
    return root


def tiny_vae(seed: int = 0, config: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """A random-weight CausalVideoVAE: the built-in "causal-vae-tiny" architecture unless ``config``."""
    from pfctl.models.causal_vae import CausalVideoVAE
    from pfctl.models.vae import build_tiny_causal_vae

    if config is None:
        return build_tiny_causal_vae(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CausalVideoVAE(**copy.deepcopy(dict(config))).eval()


def tiny_dit(
    preset: str = "tiny", seed: int = 0, overrides: Mapping[str, Any] | None = None
) -> torch.nn.Module:
    """A registered DiT preset with seeded random weights (every output projection non-zero).

    The DiTs zero-initialise their modulation/output layers like the reference, so a freshly
    built model outputs exactly 0; tests that compare outputs need non-trivial weights.
    """
    from pfctl.models.registry import build_dit

    model = build_dit(preset, overrides, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def write_vae_folder(folder: str | Path, vae: torch.nn.Module) -> Path:
    """config.json + a pickled fp32 ``diffusion_pytorch_model.bin``, like the official VAE folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vae.save_config(str(folder))
    state = {k: v.detach().float().cpu().clone() for k, v in vae.state_dict().items()}
    torch.save(state, folder / "diffusion_pytorch_model.bin")
    return folder


def make_official_folder(
    tmp_path: str | Path,
    *,
    name: str = "pyramid-flow-tiny",
    variant: str = "diffusion_transformer_384p",
    dit_preset: str = "tiny",
    dit_overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    with_dit: bool = True,
    with_vae: bool = True,
    with_text: bool = True,
    text_kind: str | None = None,
    vae_config: Mapping[str, Any] | None = None,
) -> Path:
    """A tiny checkpoint folder in the official layout under ``tmp_path / name``; returns it.

    ``text_kind`` defaults to the DiT's family (SD3 triple for ``mmdit-*`` presets). The DiT
    preset's text widths match the tiny text encoder, so the folder loads end to end.
    """
    from pfctl.models.checkpoint import save_dit_folder
    from pfctl.models.registry import get_preset

    root = Path(tmp_path) / name
    root.mkdir(parents=True, exist_ok=True)
    preset = get_preset(dit_preset)
    if text_kind is None:
        text_kind = "pyramid_mmdit" if preset.class_name == "PyramidDiffusionMMDiT" else "pyramid_flux"
    if with_dit:
        save_dit_folder(tiny_dit(dit_preset, seed=seed, overrides=dit_overrides), root / variant)
    if with_vae:
        write_vae_folder(root / "causal_video_vae", tiny_vae(seed, vae_config))
    if with_text:
        make_text_encoder_folder(root, kind=text_kind, seed=seed)
    return root


FAST_GENERATE = [
    "generate.width=64",
    "generate.height=64",
    "generate.strict_resolution=false",
    "generate.num_inference_steps=[1,1,1]",
    "generate.video_num_inference_steps=[1,1,1]",
    "runtime.device=cpu",
]
"""``generate`` overrides that make a tiny model's video quick on the CPU: 64x64, one step per stage."""


def tiny_train_config(cache: str | Path, out: str | Path, **train: Any):
    """A quick CPU ``pfctl train`` config: the ``tiny`` preset on ``cache`` into ``out``, batch 4, 4 units,
    seed 3, one warm-up step, every step logged; ``train`` overrides any ``train.`` key."""
    import json

    from pfctl.config import load_config

    overrides = {
        "runtime.device": "cpu",
        "runtime.seed": 3,
        "model.dit_preset": "tiny",
        "train.cache": str(cache),
        "train.output_dir": str(out),
        "train.batch_size": 4,
        "train.max_units": 4,
        "train.warmup_steps": 1,
        "train.log_every": 1,
        **{f"train.{k}": v for k, v in train.items()},
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
