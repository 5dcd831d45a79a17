"""Pyramid Flow's causal video VAE (config- and state-dict-compatible with the reference)."""

from pfctl.models.causal_vae.conv import CausalConv3d, FrameCache, FrameGroupNorm
from pfctl.models.causal_vae.model import TILE_OVERLAP, CausalVideoVAE, DiagonalGaussian

__all__ = [
    "TILE_OVERLAP",
    "CausalConv3d",
    "CausalVideoVAE",
    "DiagonalGaussian",
    "FrameCache",
    "FrameGroupNorm",
]
