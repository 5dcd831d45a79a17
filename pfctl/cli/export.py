"""`pfctl export`: a trained model as an official Pyramid Flow folder (the reference, ComfyUI)."""

from __future__ import annotations

from typing import Annotated

import typer

from pfctl.cli._common import command_errors

HELP = (
    "Write a pfctl export, checkpoint or LoRA export as an official Pyramid Flow folder "
    "(DiT variant folder + VAE + text encoders) that the reference's code and ComfyUI load."
)
EXAMPLES = ("pfctl export outputs/train/export -o my-pyramid-flow/",)

SourceArg = Annotated[
    str,
    typer.Argument(
        help="A pfctl export (OUTPUT/export), a checkpoint (OUTPUT/checkpoints/step-NNNNNN) or a LoRA export.",
        show_default=False,
    ),
]
OutOpt = Annotated[
    str, typer.Option("--output-dir", "-o", help="The folder to create (must not exist).", show_default=False)
]
VariantOpt = Annotated[
    str | None,
    typer.Option(
        "--variant",
        help="DiT folder name, e.g. diffusion_transformer_768p (default: the base model's variant).",
        show_default=False,
    ),
]
EmaOpt = Annotated[
    bool, typer.Option("--ema/--no-ema", help="Export the EMA weights when the source has them.")
]
BaseOpt = Annotated[
    str | None,
    typer.Option(
        "--base",
        help="Model folder whose VAE and text encoders go beside the DiT (default: the one the run started from).",
        show_default=False,
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Storage dtype of the DiT weights: fp32, bf16 or fp16 (default: as trained).",
        show_default=False,
    ),
]


def export(
    source: SourceArg,
    output_dir: OutOpt,
    variant: VariantOpt = None,
    ema: EmaOpt = True,
    base: BaseOpt = None,
    dtype: DtypeOpt = None,
) -> None:
    with command_errors():
        from pfctl import api
        from pfctl.runtime.logging import log

        report = api.export(source, output_dir, variant=variant, ema=ema, base=base, dtype=dtype)
        log(
            f"exported {report.source} ({report.kind}, {report.weights} weights) → {report.output_dir} "
            f"({report.variant}/ + VAE and text encoders of {report.base})"
        )
