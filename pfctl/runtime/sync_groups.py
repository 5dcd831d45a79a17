"""Video sync groups: G contiguous ranks that read the same videos.

With world size W and group size G (W % G == 0), ranks r and r' share a group iff
r // G == r' // G. The data sampler is sharded by group index, so every rank of a group
sees the same clips; each rank trains a different temporal length of them (see
``pfctl.flow.pyramid.sample_stage_length``). This is *not* sequence parallelism.

``plan_sync_groups`` is pure and runs before any process group exists, so a bad layout is
rejected identically on every rank (no collective can hang on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pfctl.errors import DistributedError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SyncGroupPlan:
    """The layout of sync groups for a world size (pure data)."""

    world_size: int
    group_size: int

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def groups(self) -> list[list[int]]:
        g = self.group_size
        return [list(range(i * g, (i + 1) * g)) for i in range(self.num_groups)]

    def group_index(self, rank: int) -> int:
        return rank // self.group_size

    def rank_in_group(self, rank: int) -> int:
        return rank % self.group_size


def plan_sync_groups(world_size: int, group_size: int) -> SyncGroupPlan:
    """Validate the layout and return the plan. Raises :class:`DistributedError`."""
    if world_size < 1:
        raise DistributedError(f"world size must be >= 1, got {world_size}")
    if group_size < 1:
        raise DistributedError(
            f"video_sync_group must be >= 1, got {group_size}", hint="set train.video_sync_group=1 to disable"
        )
    if world_size % group_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise DistributedError(
            f"world size {world_size} is not divisible by video_sync_group {group_size}",
            hint=f"choose video_sync_group from {divisors}, or launch a multiple of {group_size} processes",
        )
    return SyncGroupPlan(world_size=world_size, group_size=group_size)


@dataclass
class SyncGroups:
    """This rank's sync group, with collectives restricted to it."""

    plan: SyncGroupPlan
    rank: int
    process_group: Any = None  # torch.distributed ProcessGroup, None when world size is 1

    @property
    def index(self) -> int:
        return self.plan.group_index(self.rank)

    @property
    def rank_in_group(self) -> int:
        return self.plan.rank_in_group(self.rank)

    @property
    def size(self) -> int:
        return self.plan.group_size

    @property
    def ranks(self) -> list[int]:
        return self.plan.groups[self.index]

    def broadcast(self, tensor: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        """Broadcast ``tensor`` in place from the group's ``src_in_group``-th rank."""
        if self.process_group is not None:
            import torch.distributed as dist

            dist.broadcast(tensor, src=self.ranks[src_in_group], group=self.process_group)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce ``tensor`` in place over the group (``sum``, ``max``, ``min``)."""
        if self.process_group is not None:
            import torch.distributed as dist

            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op], group=self.process_group)
        return tensor

    def broadcast_object(self, obj: Any, src_in_group: int = 0) -> Any:
        if self.process_group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src_in_group], group=self.process_group)
        return box[0]


def create_sync_groups(plan: SyncGroupPlan, rank: int) -> SyncGroups:
    """Create every group's process group on every rank, in the same order (a torch rule)."""
    import torch.distributed as dist

    if plan.world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return SyncGroups(plan=plan, rank=rank)
    mine = None
    for ranks in plan.groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return SyncGroups(plan=plan, rank=rank, process_group=mine)
