"""Named DiT architectures for training from scratch (``model.dit_preset`` + ``model.dit_config``).

A preset is a DiT class plus its full constructor arguments; overrides replace single keys.
Presets that pair with the tiny offline text encoder (``tiny``, ``shapes-tiny``) take their text
widths from :mod:`pfctl.models.text_encoder` so the two can never drift apart.

* ``miniflux``    — the published miniFLUX (about 2B parameters; 24 blocks, 30 heads x 64).
* ``tiny``        — 1 double + 1 single block, 2 heads x 16: fast CPU unit tests.
* ``shapes-tiny`` — 2 double + 2 single blocks, 4 heads x 16: the embedded shapes demo (its
  recipe, ``recipes/shapes-tiny.yaml``, widens it to 8 heads).
* ``sd3-mmdit``   — the published SD3-style MMDiT (24 layers, 24 heads x 64).
* ``mmdit-tiny``  — a small SD3-style MMDiT; pairs with the tiny SD3 text encoder.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pfctl.errors import ConfigError
from pfctl.models.text_encoder import TINY_CLIP_DIM, TINY_T5_DIM


@dataclass(frozen=True)
class DiTPreset:
    name: str
    class_name: str
    config: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def model_name(self) -> str:
        from pfctl.models.checkpoint import model_name_of

        return model_name_of(self.class_name)


_COMMON_FLUX = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels x 2x2 patch (the reshape is inside the DiT)
    "use_flash_attn": False,
    "use_temporal_causal": True,
    "interp_condition_pos": True,
    "use_gradient_checkpointing": False,
    "gradient_checkpointing_ratio": 0.6,
}

# what every MMDiT preset shares with the released one: positions, text masking, causality, checkpointing
_COMMON_MMDIT = {
    "max_num_frames": 200,
    "qk_norm": "rms_norm",
    "pos_embed_type": "sincos",
    "temp_pos_embed_type": "rope",
    "add_temp_pos_embed": True,
    "use_t5_mask": True,
    "use_flash_attn": False,
    "use_temporal_causal": True,
    "interp_condition_pos": True,
    "use_gradient_checkpointing": False,
    "gradient_checkpointing_ratio": 0.6,
}

PRESETS: dict[str, DiTPreset] = {
    p.name: p
    for p in (
        DiTPreset(
            "miniflux",
            "PyramidFluxTransformer",
            {
                **_COMMON_FLUX,
                "num_layers": 8,
                "num_single_layers": 16,
                "attention_head_dim": 64,
                "num_attention_heads": 30,
                "joint_attention_dim": 4096,
                "pooled_projection_dim": 768,
                "axes_dims_rope": [16, 24, 24],
            },
            "published miniFLUX (about 2B parameters; T5-XXL 4096 / CLIP-L 768 text widths)",
        ),
        DiTPreset(
            "tiny",
            "PyramidFluxTransformer",
            {
                **_COMMON_FLUX,
                "num_layers": 1,
                "num_single_layers": 1,
                "attention_head_dim": 16,
                "num_attention_heads": 2,
                "joint_attention_dim": TINY_T5_DIM,
                "pooled_projection_dim": TINY_CLIP_DIM,
                "axes_dims_rope": [4, 6, 6],
            },
            "1+1 blocks, 2 heads x 16; pairs with the tiny text encoder (fast CPU tests)",
        ),
        DiTPreset(
            "shapes-tiny",
            "PyramidFluxTransformer",
            {
                **_COMMON_FLUX,
                "num_layers": 2,
                "num_single_layers": 2,
                "attention_head_dim": 16,
                "num_attention_heads": 4,
                "joint_attention_dim": TINY_T5_DIM,
                "pooled_projection_dim": TINY_CLIP_DIM,
                "axes_dims_rope": [4, 6, 6],
            },
            "2+2 blocks, 4 heads x 16; the embedded shapes demo model",
        ),
        DiTPreset(
            "sd3-mmdit",
            "PyramidDiffusionMMDiT",
            {
                "sample_size": 128,
                "patch_size": 2,
                "in_channels": 16,
                "num_layers": 24,
                "attention_head_dim": 64,
                "num_attention_heads": 24,
                "caption_projection_dim": 1536,
                "joint_attention_dim": 4096,
                "pooled_projection_dim": 2048,
                "pos_embed_max_size": 192,
                **_COMMON_MMDIT,
            },
            "published SD3-style MMDiT (about 2B parameters; needs CLIP-L + CLIP-G + T5 text)",
        ),
        DiTPreset(
            "mmdit-tiny",
            "PyramidDiffusionMMDiT",
            {
                "sample_size": 16,
                "patch_size": 2,
                "in_channels": 16,
                "num_layers": 2,
                "attention_head_dim": 16,
                "num_attention_heads": 2,
                "caption_projection_dim": 32,
                "joint_attention_dim": TINY_T5_DIM,
                "pooled_projection_dim": 2 * TINY_CLIP_DIM,  # CLIP-L + CLIP-G pooled, concatenated
                "pos_embed_max_size": 12,
                **_COMMON_MMDIT,
            },
            "small SD3-style MMDiT; pairs with the tiny SD3 text encoder",
        ),
    )
}


def list_presets() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> DiTPreset:
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(
            f"unknown DiT preset {name!r}",
            hint=f"model.dit_preset must be one of: {', '.join(list_presets())}",
        )
    return preset


def preset_config(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The preset's constructor arguments with ``overrides`` applied (validated, not built).

    Unknown keys are errors: a typo in ``model.dit_config`` would otherwise train a different
    model than the one asked for, silently.
    """
    preset = get_preset(name)
    config = copy.deepcopy(preset.config)
    allowed = set(config) | _class_arguments(preset.class_name)
    for key, value in (overrides or {}).items():
        if key not in allowed:
            raise ConfigError(
                f"unknown DiT config key {key!r} for preset {name!r} ({preset.class_name})",
                hint=f"model.dit_config keys: {', '.join(sorted(allowed))}",
            )
        config[key] = copy.deepcopy(value)
    return config


def _class_arguments(class_name: str) -> set[str]:
    """Constructor argument names of the DiT class (empty if the class is not importable)."""
    try:
        from pfctl.models.checkpoint import dit_class

        cls = dit_class(class_name)
    except Exception:
        return set()
    params = inspect.signature(cls.__init__).parameters
    return {k for k, p in params.items() if k != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def build_dit(
    preset: str,
    overrides: Mapping[str, Any] | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> torch.nn.Module:
    """A freshly initialised DiT of a registered architecture.

    ``seed`` makes the initialisation reproducible without touching the caller's global RNG.
    """
    from pfctl.models.checkpoint import build_dit_from_config

    config = preset_config(preset, overrides)
    class_name = get_preset(preset).class_name
    full = {"_class_name": class_name, **config}
    if seed is None:
        model = build_dit_from_config(full, source=f"preset {preset!r}")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_dit_from_config(full, source=f"preset {preset!r}")
    if dtype is not None or device is not None:
        model = torch.nn.Module.to(model, device=device, dtype=dtype)  # diffusers' .to warns
    return model
