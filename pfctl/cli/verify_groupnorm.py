"""`pfctl verify-groupnorm`."""

from __future__ import annotations

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import PrintConfigOpt, RecipeOpt, SetOpt

HELP = 'Check whether chunked ("framewise") VAE encoding equals a one-call encode: audit the norms, measure the error, offer an exact chunked encode.'
EPILOG = "Example: pfctl verify-groupnorm --vae cogvideox-tiny --json report.json"


def verify_groupnorm(
    recipe: RecipeOpt = None, overrides: SetOpt = None, show_config: PrintConfigOpt = False
) -> None:
    with command_errors():
        config = resolve_config(recipe, overrides)
        if show_config:
            print_config(config)
            return
        from pfctl import api

        api.verify_groupnorm(config)
