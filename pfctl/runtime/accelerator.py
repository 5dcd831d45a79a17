"""``build_runtime``: the only place that creates an ``accelerate.Accelerator``.

Works as plain ``pfctl ...`` (one process), under ``accelerate launch -m pfctl ...`` and
``torchrun -m pfctl ...``; on CPU (gloo) and CUDA (nccl); single- and multi-node (global
rank = ``rank``, rank on this host = ``local_rank``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pfctl.runtime import logging as pflog
from pfctl.runtime.sync_groups import SyncGroups, create_sync_groups, plan_sync_groups

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from pfctl.config.schema import RuntimeConfig


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_mixed_precision(mixed_precision: str, device: str) -> str:
    """``auto`` → bf16 on CUDA, ``no`` (fp32) on the CPU."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if device == "cuda" else "no"


def world_size_from_env() -> int:
    """The world size a launcher announced (1 for a plain process), without touching torch."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Runtime:
    """What every command gets from the runtime: processes, device, precision, sync group."""

    accelerator: Accelerator
    device_type: str
    mixed_precision: str
    sync: SyncGroups
    seed: int
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def local_rank(self) -> int:
        return self.accelerator.local_process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision, torch.float32)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def seed_everything(self, offset: int = 0, device_specific: bool = False) -> None:
        """Seed python, numpy and torch; ``device_specific`` adds the rank (per-rank noise)."""
        from accelerate.utils import set_seed

        set_seed(self.seed + offset, device_specific=device_specific)

    def close(self) -> None:
        self.accelerator.end_training()


def build_runtime(
    config: RuntimeConfig,
    *,
    sync_group_size: int = 1,
    gradient_accumulation_steps: int = 1,
    project_dir: str | None = None,
    log_with: str | list[str] | None = None,
) -> Runtime:
    """Create the accelerator, seed, configure logging and create the sync groups.

    The sync-group layout is validated *before* any collective, identically on every rank,
    so a bad ``sync_group_size`` fails everywhere at once instead of hanging.
    """
    plan = plan_sync_groups(world_size_from_env(), sync_group_size)

    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    device = resolve_device(config.device)
    precision = resolve_mixed_precision(config.mixed_precision, device)
    if device == "cuda":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = config.allow_tf32
        torch.backends.cudnn.allow_tf32 = config.allow_tf32
    kwargs: dict[str, Any] = {
        "cpu": device == "cpu",
        "mixed_precision": precision,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(seconds=config.collective_timeout_s))],
    }
    if project_dir is not None:
        kwargs["project_config"] = ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=False
        )
    if log_with:
        kwargs["log_with"] = log_with
    accelerator = Accelerator(**kwargs)
    pflog.configure(accelerator.is_main_process, accelerator.process_index, config.log_format)
    # The plan used the launcher's WORLD_SIZE; accelerate must agree with it.
    plan = plan_sync_groups(accelerator.num_processes, sync_group_size)
    sync = create_sync_groups(plan, accelerator.process_index)
    runtime = Runtime(
        accelerator=accelerator, device_type=device, mixed_precision=precision, sync=sync, seed=config.seed
    )
    runtime.seed_everything()
    return runtime
