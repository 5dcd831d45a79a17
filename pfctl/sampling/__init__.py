"""Sampling loops (text-to-video, image-to-video) over the pyramidal flow; see :mod:`pfctl.sampling.sampler`."""

from __future__ import annotations

from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents, guidance_schedule

__all__ = ["SamplingSettings", "TextConditioning", "generate_latents", "guidance_schedule"]
