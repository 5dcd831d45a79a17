"""`pfctl encode-latents`: options → config → :func:`pfctl.api.encode_latents` → summary tables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import DryRunOpt, ModelOpt, OutputDirOpt, PrintConfigOpt, RecipeOpt, SetOpt

if TYPE_CHECKING:
    from pfctl.data.encode import EncodeReport

HELP = (
    "Decode videos (decord, in worker processes), encode them with the video VAE (clips of one shape batched "
    "per call) and the text encoders (each caption once), and write a resumable, provenance-stamped latent cache "
    "(files written by a background thread). Without --model and --vae: the embedded model, its VAE and text encoders, "
    "and its encode settings (its trained size, fps and clip length). Settings, lowest priority first: "
    "defaults < the model's own < --recipe < --set < flags."
)
EXAMPLES = (
    "pfctl encode-latents -a data/train.jsonl -o cache/",
    "pfctl encode-latents -a data/train.jsonl -m ./pyramid-flow-miniflux -o cache-384p/ --dry-run",
)

AnnotationsOpt = Annotated[
    str | None,
    typer.Option(
        "--annotations",
        "-a",
        help="JSONL/CSV file (video|image, text; optional frames, fps, id) or a folder of videos with .txt captions (encode.annotations).",
        show_default=False,
    ),
]
VaeOpt = Annotated[
    str | None,
    typer.Option(
        "--vae", help="VAE folder or built-in name, e.g. causal-vae-tiny (model.vae; default: MODEL/causal_video_vae).",
        show_default=False,
    ),
]  # fmt: skip
ChunkingOpt = Annotated[
    Literal["none", "framewise", "exact"] | None,
    typer.Option("--chunking", help="VAE temporal chunking (encode.chunking).", show_default=False),
]
MaxFailuresOpt = Annotated[
    int | None,
    typer.Option(
        "--max-failures",
        help="Exit 1 if more inputs than this fail (encode.max_failures).",
        show_default=False,
    ),
]
BatchSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        help="Clips of one shape per VAE call (encode.batch_size, default 1; halved on out-of-memory).",
        show_default=False,
    ),
]
WorkersOpt = Annotated[
    str | None,
    typer.Option(
        "--num-workers",
        help="Decode worker processes, or auto: min(8, CPU cores / processes on this host) (encode.num_workers).",
        show_default=False,
    ),
]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite", help="Delete an existing cache in the output folder and re-encode everything."
    ),
]


def encode_latents(
    recipe: RecipeOpt = None,
    overrides: SetOpt = None,
    show_config: PrintConfigOpt = False,
    annotations: AnnotationsOpt = None,
    output_dir: OutputDirOpt = None,
    model: ModelOpt = None,
    vae: VaeOpt = None,
    chunking: ChunkingOpt = None,
    max_failures: MaxFailuresOpt = None,
    batch_size: BatchSizeOpt = None,
    num_workers: WorkersOpt = None,
    dry_run: DryRunOpt = False,
    overwrite: OverwriteOpt = False,
) -> None:
    with command_errors():
        flags = {
            "encode.annotations": annotations,
            "encode.output_dir": output_dir,
            "model.path": model,
            "model.vae": vae,
            "encode.chunking": chunking,
            "encode.max_failures": max_failures,
            "encode.batch_size": batch_size,
            "encode.num_workers": int(num_workers) if num_workers and num_workers.isdigit() else num_workers,
        }
        config = resolve_config(recipe, overrides, flags)
        if show_config:
            print_config(config)
            return
        from pfctl import api
        from pfctl.errors import CheckFailed

        try:
            report = api.encode_latents(config, dry_run=dry_run, overwrite=overwrite)
        except CheckFailed as exc:
            partial = getattr(exc, "report", None)
            if partial is not None:
                render_report(partial)
            raise
        render_report(report)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render_report(report: EncodeReport) -> None:
    """The plan (dry run) or the summary: encoded / skipped / failed by reason (main process only)."""
    if not report.is_main:
        return
    from rich.table import Table

    from pfctl.runtime.logging import console

    out = console()
    for note in report.notes:
        out.print(f"note: {note}")
    if report.dry_run:
        plan = Table(title=f"encode plan → {report.output_dir} (dry run: nothing written)")
        for col in ("bucket", "frames", "latent shape", "clips", "cached", "size/clip"):
            plan.add_column(col, justify="left" if col == "bucket" else "right")
        for row in report.plan:
            plan.add_row(
                row.bucket, str(row.num_frames), "x".join(map(str, row.latent_shape)), str(row.clips), str(row.cached),
                _size(row.bytes_per_clip),
            )  # fmt: skip
        out.print(plan)
        todo = sum(r.clips - r.cached for r in report.plan)
        out.print(
            f"{todo} clip(s) to encode, estimated {_size(report.estimated_bytes)} on disk; fingerprint {report.fingerprint}"
        )
    summary = Table(title=None if report.dry_run else f"encode-latents → {report.output_dir}")
    summary.add_column("")
    summary.add_column("count", justify="right")
    rows: list[tuple[str, Any]] = []
    if not report.dry_run:
        rows += [("encoded", report.encoded), ("skipped (already cached)", report.skipped)]
    rows.append(("failed inputs" if not report.dry_run else "invalid inputs", report.failed))
    rows += [(f"  {reason}", n) for reason, n in sorted(report.failures_by_reason.items())]
    if not report.dry_run:
        rows.append(("clips in manifest", report.manifest_clips))
    for name, value in rows:
        summary.add_row(name, str(value))
    out.print(summary)
    if not report.dry_run:
        if report.stage_seconds:
            stages = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in report.stage_seconds.items())
            out.print(f"seconds per stage (batches of {report.batch_size}): {stages}")
        out.print(
            f"{report.clips_per_s:.2f} clips/s ({report.encode_seconds:.1f} s encoding, {report.seconds:.1f} s total)"
            + (f"; failures: {report.failures_path}" if report.failed else "")
            + ("; stopped early (max_failures)" if report.stopped_early else "")
        )
    elif report.failures:
        for f in report.failures[:10]:
            out.print(f"  {f['source']} (line {f['line']}): {f['reason']} — {f['detail']}")
