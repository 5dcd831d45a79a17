"""The run summary: ``output_dir/summary.md`` and ``output_dir/loss.png``, from ``metrics.jsonl`` and
``config.yaml`` alone, so it is written at the end of training and re-rendered any time after
(``pfctl train --summary OUTPUT_DIR``), also for a run that is still going or died.

It answers what a person asks of a finished run: how long, how fast, how low did the loss go (training
and held-out, overall and per stage, as a curve), what do the samples look like (the first and last
validation contact sheets), and where is the model and how to generate from it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pfctl.errors import InputError
from pfctl.utils.io import atomic_write_text

SUMMARY_FILE = "summary.md"
PLOT_FILE = "loss.png"


@dataclass
class RunSummary:
    """What :func:`write_summary` wrote: the Markdown (also its text) and the loss curve."""

    path: Path
    plot: Path
    markdown: str


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The rows of ``out/metrics.jsonl`` (a line torn by a kill is skipped)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        raise InputError(
            f"{path} not found: {out} is not the output folder of a pfctl train run",
            hint="give the train.output_dir of a run (it holds metrics.jsonl and config.yaml)",
        )
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def read_config(out: Path) -> dict[str, Any]:
    """The run's resolved config (``out/config.yaml``), {} when absent."""
    import yaml

    path = out / "config.yaml"
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}


def wall_seconds(rows: list[dict[str, Any]]) -> float:
    """Wall time over every process that trained the run: ``elapsed_s`` restarts with each resume, so
    each segment contributes its last value (without it: the sum of the logged step times)."""
    total, last = 0.0, None
    for row in rows:
        value = row.get("elapsed_s")
        if value is None:
            continue
        if last is not None and value < last:
            total += last
        last = value
    if last is not None:
        return total + last
    return sum(row.get("step_time_s", 0.0) for row in rows)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _stage_keys(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for row in rows for k in row if k.startswith(prefix) and k[len(prefix) :].isdigit()})


def loss_chart(train_rows: list[dict[str, Any]], heldout_rows: list[dict[str, Any]]) -> Any:
    """The loss curves: training overall and per stage, held-out overall and per stage."""
    from pfctl.utils.plot import line_chart

    series = {}
    for rows, key, name in (
        (train_rows, "loss", "train (all stages)"),
        (heldout_rows, "heldout_loss", "held-out (all stages)"),
        *((train_rows, k, f"train stage {k.removeprefix('loss_stage')}") for k in _stage_keys(train_rows, "loss_stage")),
        *((heldout_rows, k, f"held-out stage {k.removeprefix('heldout_loss_stage')}")
          for k in _stage_keys(heldout_rows, "heldout_loss_stage")),
    ):  # fmt: skip
        points = [(row["step"], row[key]) for row in rows if key in row]
        if points:
            series[name] = ([p[0] for p in points], [p[1] for p in points])
    return line_chart(series, title="Loss", xlabel="optimizer step", ylabel="flow-matching loss")


def _losses(row: dict[str, Any], key: str, prefix: str) -> str:
    stages = ", ".join(f"stage {k.removeprefix(prefix)} {row[k]:.4f}" for k in _stage_keys([row], prefix))
    return f"{row[key]:.4f}" + (f" ({stages})" if stages else "")


def _use_the_model(out: Path, train: dict[str, Any]) -> list[str]:
    """Where the export is and the command that generates from it."""
    official = train.get("export_format") == "official"
    export = (out / ("export-official" if official else "export")).resolve()
    if not export.is_dir():
        return [
            "No export yet: the run has not reached `train.max_steps` (or `train.export` is false).",
            f"Continue it with `pfctl train --recipe ... --resume latest --output-dir {out}`.",
        ]
    flag = "--lora" if (train.get("lora") or {}).get("enabled") else "--model"
    return [
        f"The trained model is in `{export}`. Generate from it:",
        "",
        f'    pfctl generate {flag} {export} "a prompt like your training captions"',
    ]


def render_summary(out: Path) -> tuple[str, Any]:
    """The Markdown of the summary and the loss chart (a PIL image) of the run in ``out``."""
    rows, config = read_metrics(out), read_config(out)
    train = config.get("train") or {}
    train_rows = [r for r in rows if "loss" in r]
    heldout_rows = [r for r in rows if "heldout_loss" in r]
    steps = max((r["step"] for r in train_rows), default=0)
    lines = [f"# Training run `{out.resolve()}`", "", "| | |", "|---|---|"]
    lines.append(f"| steps | {steps} of {train.get('max_steps', '?')} |")
    lines.append(f"| wall time | {_duration(wall_seconds(rows))} |")
    if train_rows:
        tps = statistics.median(r["tokens_per_s"] for r in train_rows)
        lines.append(f"| throughput | {tps:,.0f} image tokens/s (median of the logged steps) |")
        mfus = [r["mfu"] for r in train_rows if "mfu" in r]
        if mfus:
            lines.append(f"| MFU | {statistics.median(mfus):.1%} (median; 6·N FLOPs per image token) |")
        memory = [r["peak_memory_gib"] for r in train_rows if "peak_memory_gib" in r]
        if memory:
            lines.append(f"| peak GPU memory | {max(memory):.1f} GiB |")
        step_time = sum(r.get("step_time_s", 0.0) for r in train_rows)
        if step_time and any("data_time_s" in r for r in train_rows):
            share = sum(r.get("data_time_s", 0.0) for r in train_rows) / step_time
            lines.append(f"| data loading | {share:.1%} of the step time |")
        lines.append(
            f"| final training loss | {_losses(train_rows[-1], 'loss', 'loss_stage')} at step {steps} |"
        )
    if heldout_rows:
        first, last = heldout_rows[0], heldout_rows[-1]
        lines.append(
            f"| held-out loss | {_losses(last, 'heldout_loss', 'heldout_loss_stage')} at step {last['step']} "
            f"(step {first['step']}: {first['heldout_loss']:.4f}) |"
        )
    lines += ["", f"![loss curve]({PLOT_FILE})", ""]
    sheets = sorted((out / "validation").glob("step-*.png"))
    if sheets:
        lines += ["## Validation samples", ""]
        for sheet in dict.fromkeys([sheets[0], sheets[-1]]):
            lines += [f"![{sheet.stem}]({sheet.relative_to(out).as_posix()})", ""]
    lines += ["## Use the model", "", *_use_the_model(out, train), ""]
    return "\n".join(lines), loss_chart(train_rows, heldout_rows)


def write_summary(out: str | Path) -> RunSummary:
    """Render the summary of the run in ``out`` into ``out/summary.md`` and ``out/loss.png``."""
    from pfctl.utils.plot import save_png

    out = Path(out)
    markdown, chart = render_summary(out)
    plot = save_png(chart, out / PLOT_FILE)
    return RunSummary(path=atomic_write_text(out / SUMMARY_FILE, markdown), plot=plot, markdown=markdown)
