"""The posterior every VAE adapter's ``encode`` returns (:mod:`pfctl.models.vae`, :mod:`pfctl.models.diffusers_vae`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Posterior:
    """Diagonal Gaussian over latents, (B, C, t, h, w) each."""

    mean: Tensor
    std: Tensor

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        """``mean + std * eps``; eps drawn on the generator's device then moved (diffusers' convention)."""
        device = generator.device if generator is not None else self.mean.device
        eps = torch.randn(self.mean.shape, generator=generator, device=device, dtype=self.mean.dtype)
        return self.mean + self.std * eps.to(self.mean.device)
