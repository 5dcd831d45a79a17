"""The four library entry points. Each takes the validated recipe config and returns a report.

The CLI is a thin shell around these; tests and notebooks call them directly. Imports are
lazy so ``import pfctl.api`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pfctl.errors import NotBuiltError

if TYPE_CHECKING:
    from pfctl.config.schema import RecipeConfig


def encode_latents(config: RecipeConfig, **options: Any) -> Any:
    """Decode videos, encode them with the VAE and text encoders, write the latent cache."""
    raise NotBuiltError("encode-latents is not built yet in this version of pfctl")


def train(config: RecipeConfig, **options: Any) -> Any:
    """Train or fine-tune the pyramid DiT on a latent cache."""
    raise NotBuiltError("train is not built yet in this version of pfctl")


def generate(config: RecipeConfig, **options: Any) -> Any:
    """Text-to-video / image-to-video with the pyramid sampler, writing mp4 files."""
    raise NotBuiltError("generate is not built yet in this version of pfctl")


def verify_groupnorm(config: RecipeConfig, **options: Any) -> Any:
    """Audit a VAE's norms and measure chunked-vs-full encoding error."""
    raise NotBuiltError("verify-groupnorm is not built yet in this version of pfctl")
