"""`pfctl demo`."""

from __future__ import annotations

from typing import Annotated

import typer

from pfctl.cli._common import command_errors

HELP = (
    "The whole pipeline on synthetic shapes in a few CPU minutes: make clips, encode-latents, fine-tune "
    "the embedded model on 2 processes (sync group 2), generate and score videos, verify-groupnorm."
)
EXAMPLES = ("pfctl demo",)


def demo(
    output_dir: Annotated[
        str, typer.Option("--output-dir", "-o", help="Folder for everything the demo writes.")
    ] = "pfctl-demo",
    quick: Annotated[
        bool, typer.Option("--quick", help="A much shorter run (16 clips, 4 steps, 2 videos): a smoke test.")
    ] = False,
    steps: Annotated[
        int | None,
        typer.Option("--steps", help="Fine-tuning steps (default 60; 4 with --quick).", show_default=False),
    ] = None,
    clips: Annotated[
        int | None,
        typer.Option(
            "--clips", help="Shapes clips to make (default 64; 16 with --quick).", show_default=False
        ),
    ] = None,
    nproc: Annotated[int, typer.Option("--nproc", help="Training processes (torchrun, CPU).")] = 2,
    sync_group: Annotated[
        int, typer.Option("--sync-group", help="Video sync group size (train.video_sync_group).")
    ] = 2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the dataset and the run.")] = 0,
) -> None:
    with command_errors():
        from pfctl.demo.run import run_demo

        run_demo(
            output_dir,
            quick=quick,
            num_clips=clips,
            steps=steps,
            nproc=nproc,
            sync_group=sync_group,
            seed=seed,
        )
