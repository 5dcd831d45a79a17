"""Options shared by every command, as ``Annotated`` aliases (one spelling, one help text)."""

from __future__ import annotations

from typing import Annotated

import typer


def complete_recipe(incomplete: str) -> list[str]:
    """Shell completion after ``--recipe``: the shipped recipe names that start with what was typed."""
    from pfctl.config.load import available_recipes

    return [name for name in available_recipes() if name.startswith(incomplete)]


RecipeOpt = Annotated[
    str | None,
    typer.Option(
        "--recipe",
        "-r",
        help="Recipe name (pfctl's recipes/ folder) or path to a YAML file.",
        show_default=False,
        autocompletion=complete_recipe,
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
