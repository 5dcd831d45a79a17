"""`pfctl verify-groupnorm`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import PrintConfigOpt, RecipeOpt, SetOpt

HELP = 'Check whether chunked ("framewise") VAE encoding equals a one-call encode: audit the norms, measure the error, offer an exact chunked encode.'
EXAMPLES = (
    "pfctl verify-groupnorm --vae causal-vae-tiny --size 32x32 --json report.json --plot error.png",
    "pfctl verify-groupnorm --vae cogvideox-tiny --size 32x32",
)
NOTE = "Exit code 0 pass (or warn), 1 a path fails its tolerance (cogvideox-tiny: by design), 2 usage error."


def _parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    from pfctl.errors import ConfigError

    text = size.lower().replace("×", "x")
    try:
        if "x" in text:
            w, h = (int(v) for v in text.split("x", 1))
        else:
            w = h = int(text)
    except ValueError:
        raise ConfigError(
            f"--size '{size}' is not WIDTHxHEIGHT", hint="e.g. --size 64x64 or --size 64"
        ) from None
    return h, w


def _parse_chunks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    from pfctl.errors import ConfigError

    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(
            f"--chunk-sizes '{text}' is not a comma list of integers", hint="e.g. 4,8,16"
        ) from None


def _parse_tols(items: list[str] | None) -> dict[str, str]:
    from pfctl.errors import ConfigError

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--tol '{item}' is not KEY=VALUE", hint="e.g. --tol approx_rel_l2_pass=0.05")
        out[f"verify.tolerances.{key.strip()}"] = value.strip()
    return out


def verify_groupnorm(
    vae: Annotated[
        str | None,
        typer.Option(
            "--vae",
            help="VAE folder (config.json _class_name: pfctl causal VAE or a diffusers video VAE) or built-in "
            "name (causal-vae-tiny, cogvideox-tiny, wan-tiny, ltx-tiny, hunyuan-tiny, mochi-tiny).",
            show_default=False,
        ),
    ] = None,
    video: Annotated[
        str | None,
        typer.Option(
            "--video",
            help="Video file to test on; default: a synthetic clip with a fade and a cut.",
            show_default=False,
        ),
    ] = None,
    frames: Annotated[
        int | None, typer.Option("--frames", help="Frames to encode (verify.num_frames).", show_default=False)
    ] = None,
    size: Annotated[
        str | None,
        typer.Option("--size", help="WIDTHxHEIGHT of the clip (verify.width/height).", show_default=False),
    ] = None,
    fps: Annotated[
        float | None,
        typer.Option("--fps", help="Sampling rate for --video (verify.fps).", show_default=False),
    ] = None,
    chunk_sizes: Annotated[
        str | None,
        typer.Option(
            "--chunk-sizes",
            help="Chunk sizes to sweep, e.g. 4,8,16 (verify.chunk_sizes).",
            show_default=False,
        ),
    ] = None,
    json_path: Annotated[
        str | None, typer.Option("--json", help="Write the full report as JSON here.", show_default=False)
    ] = None,
    plot_path: Annotated[
        str | None,
        typer.Option(
            "--plot",
            help="Write a PNG of per-latent-frame error per path here (titled, labelled axes, legend).",
            show_default=False,
        ),
    ] = None,
    tol: Annotated[
        list[str] | None,
        typer.Option(
            "--tol",
            help="Override a tolerance, e.g. --tol exact_rel_l2=1e-4 (repeatable).",
            show_default=False,
        ),
    ] = None,
    recipe: RecipeOpt = None,
    overrides: SetOpt = None,
    show_config: PrintConfigOpt = False,
) -> None:
    with command_errors():
        height, width = _parse_size(size)
        flags = {
            "verify.vae": vae,
            "verify.video": video,
            "verify.num_frames": frames,
            "verify.height": height,
            "verify.width": width,
            "verify.fps": fps,
            "verify.chunk_sizes": _parse_chunks(chunk_sizes),
            "verify.json_path": json_path,
            "verify.plot_path": plot_path,
            **_parse_tols(tol),
        }
        config = resolve_config(recipe, overrides, flags=flags)
        if show_config:
            print_config(config)
            return
        _run(config)


def _run(config) -> None:
    """Run the check with progress on stderr, print the report, exit 1 when a path fails."""
    from pfctl import api
    from pfctl.runtime.logging import log
    from pfctl.verify.report import render

    with _stderr_progress() as progress:
        report = api.verify_groupnorm(config, progress=progress)
    render(report)
    for line in _written(config):
        log(line)
    if report.exit_code:
        raise typer.Exit(report.exit_code)


@contextmanager
def _stderr_progress() -> Iterator[Callable[[str, int, int | None], None]]:
    """Progress of the steps on stderr (stdout keeps the report): a rich bar on a terminal, else one
    line per step."""
    import sys

    if not sys.stderr.isatty():

        def line(step: str, done: int, total: int | None) -> None:
            if step != "done":
                print(f"verify-groupnorm [{done + 1}/{total or '?'}] {step}", file=sys.stderr, flush=True)

        yield line
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("verify-groupnorm", total=None)

        def update(step: str, done: int, total: int | None) -> None:
            bar.update(task, description=step, completed=done, total=total)

        yield update


def _written(config) -> list[str]:
    lines = []
    if config.verify.json_path:
        lines.append(f"report written to {config.verify.json_path}")
    if config.verify.plot_path:
        lines.append(f"per-latent-frame error plot written to {config.verify.plot_path}")
    return lines
