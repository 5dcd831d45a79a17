"""The recipe schema: one root object with a section per concern.

``runtime`` and ``model`` are shared by every command; ``encode``, ``train``, ``generate``
and ``verify`` belong to one command each (their classes live in the sibling modules, so
defaults live in exactly one place).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pfctl.config.base import Section
from pfctl.config.encode import EncodeConfig
from pfctl.config.fast import FastPathsConfig
from pfctl.config.generate import GenerateConfig
from pfctl.config.train import TrainConfig
from pfctl.config.verify import VerifyConfig


class RuntimeConfig(Section):
    """The accelerator runtime (see ``pfctl.runtime``)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` picks CUDA when a GPU is visible, else the CPU."""
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = "auto"
    """``auto`` = bf16 on CUDA, fp32 (``no``) on the CPU."""
    seed: int = 42
    log_format: Literal["auto", "rich", "plain"] = "auto"
    """``auto`` uses rich progress bars on a terminal and plain lines otherwise."""
    allow_tf32: bool = True
    collective_timeout_s: int = Field(default=600, ge=10)
    """A rank waiting longer than this in a collective aborts instead of hanging."""


class ModelConfig(Section):
    """Which model to use. ``path`` = None means the embedded default (the shapes demo model)."""

    path: str | None = None
    """A Pyramid Flow checkpoint folder (official layout), a pfctl export, or None."""
    name: Literal["pyramid_flux", "pyramid_mmdit"] = "pyramid_flux"
    variant: str = "diffusion_transformer_384p"
    """The DiT subfolder of an official checkpoint folder."""
    vae: str | None = None
    """A VAE folder or built-in name; default: ``<path>/causal_video_vae``."""
    dit_preset: str | None = None
    """Train from scratch with a registered architecture (e.g. ``miniflux``, ``tiny``)."""
    dit_config: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments of the DiT that override the preset (from scratch only)."""
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16"
    """Compute dtype of frozen parts (VAE, text encoders) and of inference."""


class RecipeConfig(Section):
    """A whole recipe. Every section has defaults, so an empty file is a valid recipe."""

    description: str = ""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    encode: EncodeConfig = Field(default_factory=EncodeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    fast: FastPathsConfig = Field(default_factory=FastPathsConfig)
