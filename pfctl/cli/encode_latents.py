"""`pfctl encode-latents`."""

from __future__ import annotations

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import PrintConfigOpt, RecipeOpt, SetOpt

HELP = "Decode videos (decord), encode them with the video VAE and the text encoders, and write a resumable, provenance-stamped latent cache."
EPILOG = (
    "Example: pfctl encode-latents --recipe shapes-tiny --set encode.annotations=data/train.jsonl -o cache/"
)


def encode_latents(
    recipe: RecipeOpt = None, overrides: SetOpt = None, show_config: PrintConfigOpt = False
) -> None:
    with command_errors():
        config = resolve_config(recipe, overrides)
        if show_config:
            print_config(config)
            return
        from pfctl import api

        api.encode_latents(config)
