"""Pyramidal flow matching: the one place the conventions are written down.

Conventions used by every module in :mod:`pfctl.flow` and :mod:`pfctl.sampling`:

* **sigma** is the noise level: ``sigma = 1`` is pure noise, ``sigma = 0`` is data.
* A training/sampling trajectory is cut into ``stages`` (3 by default: 1/4, 1/2 and full
  latent resolution). Inside stage ``k`` a point is the interpolation

      x = r * start + (1 - r) * end,        r in [1, 0] (the *local* ratio, 1 at the stage start)

  between the stage's ``start`` point (noisier, at stage k's resolution: pure noise for stage 0,
  otherwise the upsampled previous stage re-noised to ``start_sigma[k]``) and its ``end`` point
  (``end_sigma[k]`` noise, ``0`` for the last stage).
* The DiT predicts the velocity ``v = start - end`` (so an Euler step is
  ``x <- x + (r_next - r) * v``; ``r`` decreases, the sample moves from start to end).
* The DiT's time input is the flow **timestep on the 0..1000 scale**, shared between stages in
  proportion to their sigma length (stage 0 owns 1000 -> ~744, stage 1 ~744 -> ~386, stage 2
  ~386 -> ~1). The reference calls this argument ``timestep_ratio``; it is not a 0..1 ratio.
* Video tensors are ``(B, C, T, H, W)``; a *unit* is the group of latent frames generated at once
  (``frame_per_unit = 1``: one latent frame).

Modules:

* :mod:`pfctl.flow.scheduler` — sigma/timestep tables, inference grids, Euler step, stage-transition
  renoising and the block noise.
* :mod:`pfctl.flow.pyramid` — spatial pyramids, stage endpoints, temporal-pyramid history layout, the
  unit allocation of AR training (``sample_stage_length``) and the training-noise builders.
* :mod:`pfctl.flow.loss` — the flow-matching loss.
"""

from __future__ import annotations

from pfctl.flow.loss import FlowLoss, flow_matching_loss
from pfctl.flow.pyramid import (
    PyramidBatch,
    RandomSource,
    StageLengthPlan,
    build_full_sequence_batch,
    build_temporal_pyramid_batch,
    history_clips,
    plan_stage_lengths,
    pyramid_latents,
    pyramid_noise,
    sample_stage_length,
)
from pfctl.flow.scheduler import PyramidFlowScheduler, StageSchedule, block_noise

__all__ = [
    "FlowLoss",
    "PyramidBatch",
    "PyramidFlowScheduler",
    "RandomSource",
    "StageLengthPlan",
    "StageSchedule",
    "block_noise",
    "build_full_sequence_batch",
    "build_temporal_pyramid_batch",
    "flow_matching_loss",
    "history_clips",
    "plan_stage_lengths",
    "pyramid_latents",
    "pyramid_noise",
    "sample_stage_length",
]
