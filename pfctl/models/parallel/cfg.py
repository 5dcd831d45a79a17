"""Classifier-free guidance on two ranks: each runs one half of the ``[negative, positive]`` batch."""

from __future__ import annotations

from typing import Any

import torch

from pfctl.models.parallel.groups import Group

__all__ = ["CfgParallel"]


def _half(tensor: torch.Tensor, half: int) -> torch.Tensor:
    return tensor.chunk(2)[half]


class CfgParallel:
    """Calls the DiT like the sampler's batched CFG forward, but on this rank's half only.

    The sampler's CFG batch is ``[negative; positive]`` (rows ``b*K + k`` of the text inputs: the first half of
    the rows belongs to the negative items for any column count K), so rank 0 of the pair takes the first
    half of every batched input and rank 1 the second; an all-gather of the velocities rebuilds the full
    batch on both. Any other attribute is the DiT's.
    """

    def __init__(self, dit: Any, group: Group) -> None:
        self.dit, self.group = dit, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dit, name)

    def __call__(
        self, *, sample: list[list[torch.Tensor]], text_lengths: Any = None, **rows: torch.Tensor
    ) -> list:
        half = self.group.rank
        sample = [[_half(clip, half) for clip in column] for column in sample]
        kwargs = {name: _half(t, half) for name, t in rows.items()}
        if text_lengths is not None:
            lengths = list(text_lengths)
            n = len(lengths) // 2
            kwargs["text_lengths"] = lengths[n * half : n * (half + 1)]
        outs = self.dit(sample=sample, **kwargs)
        return [torch.cat(self.group.all_gather(out), dim=0) for out in outs]
