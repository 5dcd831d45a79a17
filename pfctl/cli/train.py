"""`pfctl train`."""

from __future__ import annotations

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import PrintConfigOpt, RecipeOpt, SetOpt

HELP = "Train or fine-tune the pyramid DiT with pyramidal flow matching and video sync groups."
EPILOG = "Example: accelerate launch -m pfctl train --recipe shapes-tiny --set train.video_sync_group=2"


def train(recipe: RecipeOpt = None, overrides: SetOpt = None, show_config: PrintConfigOpt = False) -> None:
    with command_errors():
        config = resolve_config(recipe, overrides)
        if show_config:
            print_config(config)
            return
        from pfctl import api

        api.train(config)
