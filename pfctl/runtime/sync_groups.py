"""Video sync groups: G contiguous ranks that read the same videos.

With world size W and group size G (W % G == 0), ranks r and r' share a group iff
r // G == r' // G. The data sampler is sharded by group index, so every rank of a group
sees the same clips; each rank trains a different temporal length of them (see
``pfctl.flow.pyramid.sample_stage_length``). This is *not* sequence parallelism.

:func:`plan_sync_groups` is the one validator of the layout rule (W % G == 0 and, for
temporal-pyramid training over M latent units, G <= M and M % G == 0). It is pure and runs
before any process group exists, so a bad layout is rejected identically on every rank (no
collective can hang on it); the config check, the unit allocation and the dry-run all call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pfctl.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SyncGroupPlan:
    """The layout of sync groups for a world size (pure data).

    ``max_units`` (M, the latent units of the longest clip) is set for temporal-pyramid training:
    rank r then trains the high-resolution positions :meth:`positions` ``(r)``, one per turn.
    """

    world_size: int
    group_size: int
    max_units: int | None = None

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def groups(self) -> list[list[int]]:
        g = self.group_size
        return [list(range(i * g, (i + 1) * g)) for i in range(self.num_groups)]

    @property
    def turns(self) -> int | None:
        """Micro-steps in which a group covers the positions 1..M (None without ``max_units``)."""
        return None if self.max_units is None else self.max_units // self.group_size

    def group_index(self, rank: int) -> int:
        return rank // self.group_size

    def rank_in_group(self, rank: int) -> int:
        return rank % self.group_size

    def positions(self, rank: int) -> list[int]:
        """The 1-based unit positions ``rank`` trains at full resolution, turn by turn (``[]`` without
        ``max_units``): its group's ranks together cover 1..M exactly once."""
        g = self.group_size
        return [self.rank_in_group(rank) + 1 + turn * g for turn in range(self.turns or 0)]


def _divisors(n: int, at_most: int | None = None) -> list[int]:
    return [d for d in range(1, min(n, at_most or n) + 1) if n % d == 0]


def plan_sync_groups(world_size: int, group_size: int, max_units: int | None = None) -> SyncGroupPlan:
    """Validate the layout (W, G and, for temporal-pyramid training, M) and return the plan.

    Raises :class:`ConfigError` (exit code 2) naming the numbers and the values allowed: G must
    divide W, and G must divide M (the reference divides by zero when G > M and silently never
    trains the positions above ``G * (M // G)`` when G does not divide M).
    """
    if group_size < 1:
        raise ConfigError(
            f"train.video_sync_group must be >= 1, got {group_size}", hint="use 1 to disable sync groups"
        )
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}", hint="launch at least one process")
    if world_size % group_size != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by train.video_sync_group {group_size}",
            hint=f"choose train.video_sync_group from {_divisors(world_size)}, "
            f"or launch a multiple of {group_size} processes",
        )
    if max_units is not None:
        _check_max_units(max_units, group_size)
    return SyncGroupPlan(world_size=world_size, group_size=group_size, max_units=max_units)


def _check_max_units(m: int, g: int) -> None:
    if m < 1:
        raise ConfigError(
            f"train.max_units {m} (max latent units per clip M) must be >= 1",
            hint="set train.max_units to at least 1 latent frame",
        )
    if g > m:
        raise ConfigError(
            f"train.video_sync_group {g} is larger than train.max_units {m} (max latent units per clip M)",
            hint=f"choose G <= {m} with {m} % G == 0 (e.g. G={max(_divisors(m, g))})",
        )
    if m % g:
        raise ConfigError(
            f"train.max_units {m} is not divisible by train.video_sync_group {g} (M is not a multiple of G)",
            hint=f"a group covers the units 1..M in M/G micro-steps; positions above {g * (m // g)} would never "
            f"be trained: choose G from {_divisors(m)} (e.g. G={max(_divisors(m, g))}) or change max_units",
        )


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
