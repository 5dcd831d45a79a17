"""The process groups of a :class:`~pfctl.models.parallel.plan.ParallelPlan` and the collectives on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pfctl.models.parallel.plan import ParallelPlan

__all__ = ["Group", "ParallelGroups", "create_groups"]


@dataclass(frozen=True)
class Group:
    """``size`` ranks that share a collective; this rank is the ``rank``-th (``handle`` None: size 1)."""

    size: int
    rank: int
    handle: Any = None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (all of one shape), in rank order."""
        if self.size == 1:
            return [tensor]
        import torch.distributed as dist

        # dense first: empty_like would keep a permuted layout, and the collective writes a dense one
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.handle)
        return out

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor [size, ...]``: part i goes to rank i; returns ``[size, ...]``, part i from rank i."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        # dense first: empty_like would keep a permuted layout, and the collective writes a dense one
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=self.handle)
        return out


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the plan and its groups."""

    plan: ParallelPlan
    rank: int
    cfg: Group
    sequence: Group

    @property
    def video_group(self) -> int:
        """Which group of ranks (which share of the videos) this rank is in."""
        return self.plan.place(self.rank)[0]

    @property
    def writes(self) -> bool:
        """The first rank of each video group decodes and writes its videos."""
        return self.rank % self.plan.group_size == 0


def create_groups(plan: ParallelPlan, rank: int) -> ParallelGroups:
    """Create every CFG pair's and every sequence split's process group on every rank, in the same order
    (a torch rule), and keep this rank's."""
    group, half, seq = plan.place(rank)
    cfg, sequence = Group(1, 0), Group(1, 0)
    if plan.group_size == 1:
        return ParallelGroups(plan, rank, cfg, sequence)
    import torch.distributed as dist

    for g in range(plan.data):
        if plan.cfg > 1:
            for s in range(plan.sequence):
                handle = dist.new_group(plan.cfg_ranks(g, s))
                if (g, s) == (group, seq):
                    cfg = Group(plan.cfg, half, handle)
        if plan.sequence > 1:
            for h in range(plan.cfg):
                handle = dist.new_group(plan.sequence_ranks(g, h))
                if (g, h) == (group, half):
                    sequence = Group(plan.sequence, seq, handle)
    return ParallelGroups(plan, rank, cfg, sequence)
