"""Options shared by every command, as ``Annotated`` aliases (one spelling, one help text)."""

from __future__ import annotations

from typing import Annotated

import typer

RecipeOpt = Annotated[
    str | None,
    typer.Option(
        "--recipe", "-r", help="Recipe name (see recipes/) or path to a YAML file.", show_default=False
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override any config field, e.g. --set train.lr=1e-4 (repeatable; values are YAML).",
        show_default=False,
    ),
]
PrintConfigOpt = Annotated[
    bool, typer.Option("--print-config", help="Print the resolved config as YAML and exit.")
]
SeedOpt = Annotated[
    int | None, typer.Option("--seed", help="Random seed (runtime.seed).", show_default=False)
]
OutputDirOpt = Annotated[
    str | None, typer.Option("--output-dir", "-o", help="Where results are written.", show_default=False)
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Checkpoint folder (official Pyramid Flow layout or a pfctl export); default: the embedded demo model.",
        show_default=False,
    ),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Validate and print the plan; do no work.")]

LORA_SCALE_HELP = "Scale of each --lora, in order (one value = every adapter; default 1)."
"""Help of the per-adapter scale option of ``generate`` (``--lora-scale``) and ``merge-lora`` (``--scale``):
both are read by :func:`pfctl.cli.generate.lora_refs`, so they describe one rule."""
