"""``generate`` on several processes: the layout (``generate.parallel``), the jobs of this rank, and the DiT
each job calls (:mod:`pfctl.models.parallel`).

Every rank of a video group loads the model, encodes the prompts and draws the same noise (seeded CPU
generators); the group's ranks share each forward (CFG halves, sequence split) so they hold the same latents
throughout. The group's first rank decodes and writes the video and its sidecar; the others write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pfctl.config.generate import GenerateConfig
from pfctl.models.parallel.plan import ParallelPlan, plan_parallel
from pfctl.runtime import logging as pflog

__all__ = ["ParallelRun", "check_layout", "setup_parallel"]


def _plan(gen: GenerateConfig, world_size: int, num_videos: int) -> ParallelPlan:
    guidance = gen.guidance_scale > 0 or gen.video_guidance_scale > 0
    return plan_parallel(world_size, num_videos, gen.parallel.cfg, gen.parallel.sequence, guidance)


def check_layout(gen: GenerateConfig, world_size: int, num_videos: int) -> None:
    """Refuse a layout that cannot work, before any model is loaded (the same answer on every rank)."""
    _plan(gen, world_size, num_videos)


@dataclass
class ParallelRun:
    """This rank's part: the plan, its groups, whether it writes."""

    plan: ParallelPlan
    groups: Any  # pfctl.models.parallel.groups.ParallelGroups, or None for one process

    @property
    def shares_videos(self) -> bool:
        """Whether several ranks work on each video (then no CUDA graphs or compiled blocks)."""
        return self.plan.group_size > 1

    @property
    def writes(self) -> bool:
        return self.groups is None or self.groups.writes

    def my_jobs(self, jobs: list[Any]) -> list[Any]:
        """This rank's group's share of the videos (every ``data``-th)."""
        if self.groups is None:
            return jobs
        return jobs[self.groups.video_group :: self.plan.data]

    def record(self) -> dict[str, int]:
        return self.plan.record()

    def dit_for(self, dit: Any, guidance: float) -> Any:
        """The DiT a job calls: CFG-parallel when the group halves the CFG batch and the job guides."""
        if self.groups is None or self.plan.cfg == 1 or guidance <= 0:
            return dit
        from pfctl.models.parallel.cfg import CfgParallel

        return CfgParallel(dit, self.groups.cfg)


def setup_parallel(gen: GenerateConfig, runtime: Any, dit: Any, num_videos: int) -> ParallelRun:
    """The layout for ``num_videos`` videos on the runtime's ranks; splits ``dit``'s attention when the
    sequence degree is above 1 (refusing heads that do not divide)."""
    plan = _plan(gen, runtime.world_size, num_videos)
    if runtime.world_size == 1:
        return ParallelRun(plan, None)
    from pfctl.models.parallel.groups import create_groups
    from pfctl.models.parallel.plan import check_heads
    from pfctl.models.parallel.sequence import apply_sequence_parallel

    check_heads(int(dit.config.num_attention_heads), plan.sequence)  # before any collective
    groups = create_groups(plan, runtime.rank)
    apply_sequence_parallel(dit, groups.sequence)
    layout = ", ".join(f"{k} {v}" for k, v in plan.record().items())
    pflog.log(f"parallel layout: {layout}")
    return ParallelRun(plan, groups)
