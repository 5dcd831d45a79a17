"""`pfctl merge-lora`: fold LoRA adapters into a base model and write a full pfctl export."""

from __future__ import annotations

from typing import Annotated

import typer

from pfctl.cli._common import command_errors
from pfctl.cli.options import LORA_SCALE_HELP

HELP = "Merge LoRA adapters (each at a scale) into a base model; writes a full model folder (pfctl export)."
EXAMPLES = (
    "pfctl merge-lora --model ./pyramid-flow-miniflux --lora outputs/train/export --scale 1.0 -o merged/",
)

BaseModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="The base model: an official Pyramid Flow folder or a pfctl export.",
        show_default=False,
    ),
]
LoraPathOpt = Annotated[
    list[str],
    typer.Option("--lora", help="A LoRA adapter folder (repeatable; merged in order).", show_default=False),
]
ScaleOpt = Annotated[
    list[float] | None,
    typer.Option(
        "--scale",
        help=LORA_SCALE_HELP,
        show_default=False,
    ),
]
OutOpt = Annotated[
    str, typer.Option("--output-dir", "-o", help="The merged model folder to write.", show_default=False)
]
VariantOpt = Annotated[
    str,
    typer.Option("--variant", help="DiT subfolder of an official base folder (model.variant)."),
]


def merge_lora(
    model: BaseModelOpt,
    lora: LoraPathOpt,
    output_dir: OutOpt,
    scale: ScaleOpt = None,
    variant: VariantOpt = "diffusion_transformer_384p",
) -> None:
    with command_errors():
        from pfctl.cli.generate import lora_refs
        from pfctl.runtime.logging import log

        refs = lora_refs(lora, scale, "--scale") or []
        from pfctl.models.lora import merge_lora_into_export

        report = merge_lora_into_export(
            model, [(r["path"], r["scale"]) for r in refs], output_dir, variant=variant
        )
        listed = ", ".join(f"{a['path']} x{a['scale']:g}" for a in report.adapters)
        log(f"merged {listed} into {report.base} → {report.output_dir}")
