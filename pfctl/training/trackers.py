"""The run's experiment trackers (``train.trackers``), through accelerate's tracker API.

accelerate creates and feeds the trackers (main process only); this module chooses their settings:
the local files of every tracker go under ``output_dir/trackers`` (TensorBoard events in
``trackers/<tracker_project>``, the W&B run in ``trackers/wandb``), W&B runs offline unless
``train.wandb_mode=online``, and a resumed run continues the same tracker run: its identity (run
name, W&B run id) is kept in ``output_dir/trackers.json``.

A resume goes back to the checkpoint's step, so what a run logged after its last checkpoint is
dropped: TensorBoard purges those events (``purge_step``); W&B ignores steps it has already seen.
"""

from __future__ import annotations

import json
import secrets
import string
from pathlib import Path
from typing import Any

import numpy as np

from pfctl.config.train import TrainConfig
from pfctl.utils.io import atomic_write_text

TRACKERS_FILE = "trackers.json"
"""The trackers' run identity in ``output_dir`` (read back by a resume)."""
TRACKERS_DIR = "trackers"
"""accelerate's logging directory: local tracker files under ``output_dir``."""


def tracker_run(out: Path, cfg: TrainConfig, *, resuming: bool) -> dict[str, Any]:
    """The run's identity in the trackers, written to ``out/trackers.json``: the one stored there when
    resuming (same W&B run), else a new one (run name: ``train.run_name`` or the folder's name)."""
    path = out / TRACKERS_FILE
    previous = json.loads(path.read_text(encoding="utf-8")) if resuming and path.is_file() else {}
    alphabet = string.ascii_lowercase + string.digits  # W&B run ids: [a-z0-9]
    run = {
        "project": cfg.tracker_project,
        "run_name": previous.get("run_name") or cfg.run_name or out.resolve().name,
        "wandb_id": previous.get("wandb_id") or "".join(secrets.choice(alphabet) for _ in range(8)),
    }
    atomic_write_text(path, json.dumps(run, indent=2, sort_keys=True) + "\n")
    return run


def init_kwargs(cfg: TrainConfig, run: dict[str, Any], out: Path, resume_step: int | None) -> dict[str, Any]:
    """accelerate's ``init_trackers(init_kwargs=...)`` for this run."""
    kwargs: dict[str, dict[str, Any]] = {
        # events of steps after the checkpoint (a run that died later) are dropped from the view
        "tensorboard": {"purge_step": 0 if resume_step is None else resume_step + 1},
        "wandb": {
            "name": run["run_name"],
            "id": run["wandb_id"],
            "resume": "allow",
            "mode": cfg.wandb_mode,
            "dir": str(out / TRACKERS_DIR),
        },
        "mlflow": {"run_name": run["run_name"]},
    }
    return {name: kwargs[name] for name in cfg.trackers if name in kwargs}


def start_trackers(
    accelerator: Any, cfg: TrainConfig, out: Path, hparams: dict[str, Any], resume_step: int | None
) -> dict[str, Any] | None:
    """Start ``train.trackers`` (main process; accelerate was built with ``log_with=train.trackers``).
    Returns the run identity, None without trackers."""
    if not cfg.trackers:
        return None
    run = tracker_run(out, cfg, resuming=resume_step is not None)
    (out / TRACKERS_DIR).mkdir(parents=True, exist_ok=True)
    accelerator.project_configuration.logging_dir = str(out / TRACKERS_DIR)
    accelerator.init_trackers(
        run["project"], config=hparams, init_kwargs=init_kwargs(cfg, run, out, resume_step)
    )
    return run


def log_validation(accelerator: Any, sheet: np.ndarray, videos: list[Path], step: int) -> None:
    """The validation contact sheet (H, W, 3 uint8) to every tracker that shows images, and the mp4s
    to W&B (the only one of accelerate's trackers that plays videos)."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({"validation": sheet[None]}, step=step, dataformats="NHWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log_images({"validation": [sheet]}, step=step)
            tracker.log({"validation_videos": [wandb.Video(str(p), format="mp4") for p in videos]}, step=step)
        elif hasattr(tracker, "log_images"):
            tracker.log_images({"validation": [sheet]}, step=step)


def flat_config(cfg: TrainConfig) -> dict[str, Any]:
    """Tracker hyper-parameters must be scalars."""
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.model_dump().items()}
