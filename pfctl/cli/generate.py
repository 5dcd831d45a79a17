"""`pfctl generate`."""

from __future__ import annotations

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import PrintConfigOpt, RecipeOpt, SetOpt

HELP = "Text-to-video and image-to-video with the pyramid sampler; writes mp4 + a JSON sidecar."
EPILOG = 'Example: pfctl generate "a red circle moving right" -o outputs/'


def generate(recipe: RecipeOpt = None, overrides: SetOpt = None, show_config: PrintConfigOpt = False) -> None:
    with command_errors():
        config = resolve_config(recipe, overrides)
        if show_config:
            print_config(config)
            return
        from pfctl import api

        api.generate(config)
