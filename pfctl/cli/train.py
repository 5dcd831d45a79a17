"""`pfctl train`."""

from __future__ import annotations

from typing import Annotated

import typer

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import DryRunOpt, OutputDirOpt, PrintConfigOpt, RecipeOpt, SeedOpt, SetOpt

HELP = "Train or fine-tune the pyramid DiT with pyramidal flow matching and video sync groups."
EXAMPLES = (
    "pfctl train --recipe debug-tiny --set train.cache=cache/ --dry-run --world-size 8 --set train.video_sync_group=4",
    "pfctl train --recipe debug-tiny --set train.cache=cache/ --max-steps 2",
    "torchrun --standalone --nproc_per_node 2 -m pfctl train --recipe debug-tiny --set train.cache=cache/ "
    "--set train.video_sync_group=2 --max-steps 2 -o outputs/debug-tiny-2proc",
)

MaxStepsOpt = Annotated[
    int | None,
    typer.Option("--max-steps", help="Optimizer steps to train (train.max_steps).", show_default=False),
]
ResumeOpt = Annotated[
    str | None,
    typer.Option(
        "--resume",
        help="'latest' (newest complete checkpoint in the output dir, if any) or a checkpoint folder (train.resume).",
        show_default=False,
    ),
]
WorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        help="With --dry-run: simulate this many processes (default: the launcher's).",
        show_default=False,
    ),
]
PlanStepsOpt = Annotated[
    int | None,
    typer.Option(
        "--plan-steps", help="With --dry-run: steps to show (train.plan_steps).", show_default=False
    ),
]

SummaryOpt = Annotated[
    str | None,
    typer.Option(
        "--summary",
        help="Write OUTPUT_DIR/summary.md and loss.png of a run from its metrics.jsonl and print the summary; no training.",
        metavar="OUTPUT_DIR",
        show_default=False,
    ),
]


def train(
    recipe: RecipeOpt = None,
    overrides: SetOpt = None,
    show_config: PrintConfigOpt = False,
    output_dir: OutputDirOpt = None,
    max_steps: MaxStepsOpt = None,
    resume: ResumeOpt = None,
    seed: SeedOpt = None,
    dry_run: DryRunOpt = False,
    world_size: WorldSizeOpt = None,
    plan_steps: PlanStepsOpt = None,
    summary: SummaryOpt = None,
) -> None:
    with command_errors():
        if summary is not None:
            from pfctl import api

            typer.echo(api.train_summary(summary).markdown)
            return
        flags = {
            "train.output_dir": output_dir,
            "train.max_steps": max_steps,
            "train.resume": resume,
            "runtime.seed": seed,
            "train.plan_steps": plan_steps,
        }
        config = resolve_config(recipe, overrides, flags)
        if show_config:
            print_config(config)
            return
        from pfctl import api

        if dry_run:
            typer.echo(api.train(config, dry_run=True, world_size=world_size).render())
            return
        report = api.train(config)
        if report.is_main:
            typer.echo(
                f"trained {report.steps} steps in {report.seconds:.1f} s; final loss "
                f"{report.final_loss if report.final_loss is None else f'{report.final_loss:.4f}'}"
                + (f"; export: {report.export_dir}" if report.export_dir else "")
            )
