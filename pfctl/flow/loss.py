"""Flow-matching loss: unweighted per-sample MSE on the current clip, averaged over all samples.

Each column's prediction covers only the clip being denoised (history clips are context), so the
loss never touches history tokens. Every (column, sample) pair counts once, whatever the stage's
resolution — the reference's choice, kept for parity; per-stage means are returned for logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlowLoss", "flow_matching_loss"]


@dataclass
class FlowLoss:
    """``loss``: scalar to backpropagate; ``per_sample[k]``: ``[Bc]`` MSE of column k (float32);
    ``per_stage``: mean per-sample MSE of the columns of each stage (detached, for logging)."""

    loss: torch.Tensor
    per_sample: list[torch.Tensor]
    per_stage: dict[int, torch.Tensor]


def flow_matching_loss(
    predictions: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    column_to_stage: Sequence[int] | None = None,
) -> FlowLoss:
    """Mean over all (column, sample) pairs of ``mean((v_pred - v_target)^2)`` over one sample's
    elements, computed in float32. ``column_to_stage`` (default: column index) groups columns for
    ``per_stage``."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    per_sample = []
    for pred, target in zip(predictions, targets, strict=True):
        if pred.shape != target.shape:
            raise ValueError(f"prediction shape {list(pred.shape)} != target shape {list(target.shape)}")
        diff = pred.float() - target.float()
        per_sample.append((diff**2).reshape(target.shape[0], -1).mean(dim=1))
    loss = torch.cat(per_sample, dim=0).mean()

    stages = list(column_to_stage) if column_to_stage is not None else list(range(len(per_sample)))
    per_stage: dict[int, torch.Tensor] = {}
    for stage in sorted(set(stages)):
        values = [v for v, s in zip(per_sample, stages, strict=True) if s == stage]
        per_stage[stage] = torch.cat(values).mean().detach()
    return FlowLoss(loss=loss, per_sample=per_sample, per_stage=per_stage)
