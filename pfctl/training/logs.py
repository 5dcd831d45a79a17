"""The run's logs: ``metrics.jsonl`` (+ console, the trackers) and the per-rank assignment files.

A resume trims both to the checkpoint's step, so lines written by a run that died after its last
checkpoint do not appear twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pfctl.config.train import TrainConfig
from pfctl.runtime import logging as pflog
from pfctl.utils.io import atomic_write_text


class RunLogs:
    """Writes this rank's logs under ``out`` (metrics: the main process only)."""

    def __init__(self, out: Path, cfg: TrainConfig, runtime: Any) -> None:
        self.out, self.cfg, self.runtime = out, cfg, runtime
        self.assignments = out / "assignments" / f"rank-{runtime.rank:05d}.jsonl"

    def trim(self, step: int) -> None:
        """Drop log lines past ``step`` (left by a run that died after its last checkpoint)."""
        files = [self.assignments]
        if self.runtime.is_main:
            files.append(self.out / "metrics.jsonl")
        for path in files:
            if path.is_file():
                keep = [ln for ln in path.read_text().splitlines() if log_step(ln) <= step]
                atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    def assignment(self, record: dict[str, Any]) -> None:
        """What this rank trained in one forward (:func:`pfctl.training.plan.assignment`)."""
        if self.cfg.log_assignments:
            self.assignments.parent.mkdir(parents=True, exist_ok=True)
            with self.assignments.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(record, sort_keys=True) + "\n")

    def metrics(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        metrics = {"step": step, **metrics}
        if self.runtime.is_main:
            with (self.out / "metrics.jsonl").open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(metrics, sort_keys=True) + "\n")
            if console:
                pflog.log(format_metrics(metrics, self.cfg.max_steps))
        if self.cfg.trackers:
            self.runtime.accelerator.log(
                {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}, step=step
            )


def log_step(line: str) -> float:
    """The step of a metrics/assignment log line; a line torn by a kill (or empty) sorts last (dropped)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


PEAK_BF16_FLOPS = {"H200": 989.5e12, "H100": 989.5e12, "A100": 312e12}
"""Dense bf16 matrix-product rates of the datasheets (FLOP/s), by GPU name: the MFU's denominator."""


def peak_flops(device: Any) -> float | None:
    """The bf16 peak of ``device`` when it is a GPU of :data:`PEAK_BF16_FLOPS`, else None (no MFU)."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((value for key, value in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(parameters: int, image_tokens: float, seconds: float, processes: int, peak: float) -> float:
    """Model FLOPs utilisation of a step: 6·N FLOPs per image token (forward 2·N, backward 4·N; text
    tokens and attention scores not counted) over the step time, against ``processes`` x ``peak``."""
    return 6.0 * parameters * image_tokens / (seconds * processes * peak)


def format_metrics(m: dict[str, Any], max_steps: int) -> str:
    if "loss" not in m:
        return "  ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())
    stages = " ".join(
        f"s{k[len('loss_stage') :]}={v:.4f}" for k, v in m.items() if k.startswith("loss_stage")
    )
    return (
        f"step {m['step']}/{max_steps}  loss {m['loss']:.4f} ({stages})  lr {m['lr']:.3g}  "
        f"grad_norm {m['grad_norm']:.3g}  {m['tokens_per_s']:.0f} tok/s  {m['samples_per_s']:.2f} samples/s"
        + (f"  MFU {m['mfu']:.1%}" if "mfu" in m else "")
        + (f"  peak mem {m['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in m else "")
        + ("  [skipped]" if m.get("skipped") else "")
    )

