"""The root ``pfctl`` command: an index of subcommands (each in its own module)."""

from __future__ import annotations

from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from pfctl import __version__
from pfctl.cli import demo, encode_latents, export, generate, merge_lora, train, verify_groupnorm
from pfctl.cli._common import STATE


def _flags_take_no_value(params: list) -> list:
    """Blank the value placeholder of the flags among ``params``: ``--dry-run``, not ``--dry-run <bool>``."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: typer.Context) -> list:
        return _flags_take_no_value(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: typer.Context) -> list:
        return _flags_take_no_value(super().get_params(ctx))


def examples_epilog(examples: tuple[str, ...], note: str | None = None) -> str:
    """A command's help epilog: one example command per line (paragraphs, so every renderer keeps the breaks)."""
    return "\n\n".join(["Examples:", *examples, *([note] if note else [])])


app = typer.Typer(
    name="pfctl",
    cls=_Group,
    help=(
        "Train and run pyramidal-flow-matching video diffusion models (Pyramid Flow).\n\n"
        "Data flows one way: videos → encode-latents → train → generate → mp4."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pfctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
) -> None:
    """Train and run pyramidal-flow-matching video diffusion models."""
    if debug:
        STATE["debug"] = True


for module, name in (
    (encode_latents, "encode-latents"),
    (train, "train"),
    (generate, "generate"),
    (verify_groupnorm, "verify-groupnorm"),
    (merge_lora, "merge-lora"),
    (export, "export"),
    (demo, "demo"),
):
    app.command(
        name,
        cls=_Command,
        help=module.HELP,
        epilog=examples_epilog(module.EXAMPLES, getattr(module, "NOTE", None)),
    )(getattr(module, name.replace("-", "_")))


def main() -> None:
    """Console-script entry point."""
    app(prog_name="pfctl")
