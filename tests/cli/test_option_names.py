"""The option set of every command is frozen here: adding, renaming or removing an option must be a
deliberate change to this table (and to the README), never an accident."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from pfctl.cli.app import app

COMMON = {"--recipe", "--set", "--print-config", "--help"}
OPTIONS = {
    "encode-latents": COMMON
    | {
        "--annotations",
        "--batch-size",
        "--chunking",
        "--dry-run",
        "--max-failures",
        "--model",
        "--num-workers",
        "--output-dir",
        "--overwrite",
        "--vae",
    },
    "train": COMMON
    | {"--dry-run", "--max-steps", "--output-dir", "--plan-steps", "--resume", "--seed", "--summary", "--world-size"},
    "generate": COMMON
    | {
        "--duration",
        "--frames",
        "--image",
        "--lora",
        "--lora-scale",
        "--low-memory",
        "--model",
        "--num-videos",
        "--output-dir",
    }
    | {"--prompts", "--seed", "--temp"},
    "verify-groupnorm": COMMON
    | {"--chunk-sizes", "--fps", "--frames", "--json", "--plot", "--size", "--tol", "--vae", "--video"},
    "demo": {"--clips", "--help", "--nproc", "--output-dir", "--quick", "--seed", "--steps", "--sync-group"},
    "merge-lora": {"--help", "--lora", "--model", "--output-dir", "--scale", "--variant"},
}


def _options(command: str) -> set[str]:
    out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "220"}, prog_name="pfctl").output
    return set(re.findall(r"│\s+(?:\*\s+)?(--[a-z][a-z-]*)", out))


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_option_names_are_frozen(command: str) -> None:
    assert _options(command) == OPTIONS[command]


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_every_command_shows_an_example(command: str) -> None:
    out = CliRunner().invoke(app, [command, "--help"], prog_name="pfctl").output
    assert "Example" in out
