"""Every command the README and the ``--help`` examples show runs as written (issue 26 items 3 and 20).

The commands are read from where a user reads them: the README's fenced ``bash`` blocks, and the
epilog of each command as the Typer app renders it. They run in a temporary folder holding what the
README names: ``data/train.jsonl`` (short real H.264 clips from :mod:`pfctl.demo.shapes`),
``prompts.jsonl``, ``first_frame.png``, ``my-data.yaml`` (a recipe of 64x64 clips) and
``./pyramid-flow-miniflux`` (a tiny random-weight folder in the official layout, both DiT variants).
``cache/`` is what the README's own encode-latents command writes there.

How each command is treated (every extracted command must fall in one of these, or the test fails):

* ``pfctl ...``: run in-process (CliRunner); ``accelerate launch ... -m pfctl ...`` and
  ``torchrun ... -m pfctl ...``: run as real processes (two CPU processes on gloo where they say 2).
  Each must exit 0; the one exception is ``verify-groupnorm --vae cogvideox-tiny``, whose documented
  verdict on that random-weight VAE is FAIL (exit 1).
* README blocks that begin with ``# GPU`` (the official weights on GPUs, e.g. ``accelerate launch
  --multi_gpu --num_processes 8 ... --recipe pyramid-flux-384p-8gpu``) cannot run to completion on a
  CPU. They run as written with ``--print-config`` appended: that proves the launcher syntax, the
  recipe, every ``--set`` key and value and the flags, and the test checks that the model folder (with
  its DiT variant) and the files the command names exist; no encoding, training or sampling happens.
* Installation and download lines (``python3 -m venv``, ``pip``, ``hf download``, ``ruff``/``pytest``
  of the README's test command, which CI runs as ``.ci/run``), copying completions into your home,
  and shells that are not installed are not run; the reason is part of the test's table.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from pfctl.cli.app import app

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = ("accelerate", "torchrun")
SETUP = {
    "python3": "creates the virtual environment",
    ".": "activates the virtual environment",
    "pip": "installs packages",
    "hf": "downloads the official weights",
    "ruff": "part of the README's test command (CI runs it: .ci/run)",
    "pytest": "part of the README's test command (CI runs it: .ci/run)",
    "cp": "copies a completion file into your home folder",
}
EXPECTED_EXIT = {"pfctl verify-groupnorm --vae cogvideox-tiny --size 32x32": 1}
"""Commands whose documented outcome is a failed check: the README's verify-groupnorm sample says FAIL."""

runner = CliRunner()


def readme_commands() -> list[tuple[str, bool]]:
    """(command, gpu) for every command of the README's ``bash`` blocks, chains split at ``&&``."""
    commands: list[tuple[str, bool]] = []
    block: list[str] | None = None
    for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines():
        if block is None:
            if line.strip() == "```bash":
                block = []
            continue
        if line.strip() != "```":
            block.append(line)
            continue
        gpu = bool(block) and block[0].startswith("# GPU")
        for text in block:
            tokens = shlex.split(text, comments=True)
            while tokens:
                cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                commands.append((shlex.join(tokens[:cut]), gpu))
                tokens = tokens[cut + 1 :]
        block = None
    return commands


def help_examples() -> dict[str, list[str]]:
    """Command name → the example lines of its epilog (the paragraphs after ``Examples:``)."""
    group = get_command(app)
    out = {}
    for name, command in group.commands.items():
        paragraphs = (command.epilog or "").split("\n\n")
        assert paragraphs[0] == "Examples:", f"pfctl {name} --help has no examples"
        out[name] = [p for p in paragraphs[1:] if p.split(" ", 1)[0] in ("pfctl", *LAUNCHERS)]
    return out


def test_help_shows_one_example_per_line() -> None:
    for name, examples in help_examples().items():
        assert examples, name
        shown = runner.invoke(app, [name, "--help"], prog_name="pfctl", env={"COLUMNS": "400"}).output
        lines = [line.strip() for line in shown.splitlines()]
        for example in examples:
            assert example in lines, f"{example!r} is not a line of its own in pfctl {name} --help"
            assert " | " not in example and "  ·  " not in example


def test_flags_render_as_flags() -> None:
    """A flag takes no value, so help shows no value placeholder after it (Typer shows ``<bool>``)."""
    for args in ([], *([name] for name in help_examples())):
        shown = runner.invoke(app, [*args, "--help"], prog_name="pfctl", env={"COLUMNS": "200"}).output
        assert "--help" in shown and "<bool>" not in shown, args


def test_recipe_completion_offers_the_shipped_names() -> None:
    env = {"_PFCTL_COMPLETE": "complete_bash", "COMP_WORDS": "pfctl train --recipe py", "COMP_CWORD": "3"}
    result = runner.invoke(app, [], env=env, prog_name="pfctl")
    offered = set(result.output.split())
    assert {"pyramid-flux-384p-8gpu", "pyramid-flux-768p-8gpu", "pyramid-flux-without-ar"} <= offered
    assert "debug-tiny" not in offered


def _workspace(root: Path) -> None:
    from PIL import Image

    from helpers.tiny_models import make_official_folder
    from pfctl.demo.shapes import make_shapes, plan_clips, render_clip

    make_official_folder(root, name="pyramid-flow-miniflux")
    make_official_folder(
        root,
        name="pyramid-flow-miniflux",
        variant="diffusion_transformer_768p",
        with_vae=False,
        with_text=False,
    )
    # 8 clips: the README's dry run puts 2 sync groups of 4 over batches of 4 clips
    make_shapes(root / "data", 8, (64, 64), 121, 24, seed=3, annotation_name="train.jsonl")  # 5 s: 384p plans
    clip = plan_clips(1, (64, 64), 17, seed=5)[0]
    Image.fromarray(render_clip(clip, (64, 64), 17)[0]).save(root / "first_frame.png")
    (root / "prompts.jsonl").write_text('{"prompt": "a red circle moving right", "temp": 2, "seed": 1}\n')
    fast = {"num_inference_steps": [2, 2, 2], "video_num_inference_steps": [1, 1, 1], "temp": 2}
    recipe = {
        "runtime": {"device": "cpu", "mixed_precision": "bf16"},
        "model": {"path": "./pyramid-flow-miniflux"},
        "encode": {"annotations": "data/train.jsonl", "output_dir": "cache-mine/", "num_frames": 17,
                   "buckets": [[64, 64]], "num_workers": 0, "max_sequence_length": 16},
        "train": {"cache": "cache-mine/", "output_dir": "outputs/train", "max_steps": 2, "batch_size": 4,
                  "max_units": 2, "lora": {"rank": 4, "alpha": 4}},
        "generate": {"width": 64, "height": 64, "strict_resolution": False, **fast},
    }  # fmt: skip
    (root / "my-data.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    shutil.copytree(REPO / "completions", root / "completions")


def _in_process(argv: list[str]) -> tuple[int, str]:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # each command is a fresh process for a user
    result = runner.invoke(app, argv, prog_name="pfctl")
    return result.exit_code, result.output


def _subprocess(tokens: list[str], cwd: Path) -> tuple[int, str]:
    exe = Path(sys.executable).with_name(tokens[0])
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [str(exe) if exe.exists() else tokens[0], *tokens[1:]],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def _check_gpu_config(output: str, tokens: list[str], cwd: Path) -> None:
    """The resolved config of a GPU command names folders and files that exist."""
    lines = output.splitlines()
    start = lines.index("model:")  # several processes print the config each: read the first one
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
    model = yaml.safe_load("\n".join(lines[start:end]))["model"]
    if model.get("path"):
        assert (cwd / model["path"] / model["variant"] / "config.json").is_file(), model
    for token in tokens:
        if token.endswith((".jsonl", ".png", ".yaml")):
            assert (cwd / token).is_file(), token


def run_command(command: str, gpu: bool, cwd: Path, outputs: dict[str, str] | None = None) -> str | None:
    """Run one documented command; None when it ran, else why it is not run. ``outputs`` collects what each
    command that ran printed."""
    tokens = shlex.split(command)
    head = tokens[0]
    if head in SETUP or tokens[:2] == ["accelerate", "config"]:
        return SETUP.get(head, "interactive: asks questions about your machine")
    if head == "source":
        shell = {"bash": "bash", "zsh": "zsh"}[tokens[1].rsplit(".", 1)[-1]]
        if shutil.which(shell) is None:
            return f"{shell} is not installed"
        prelude = "autoload -Uz compinit && compinit -u && " if shell == "zsh" else ""
        proc = subprocess.run([shell, "-c", prelude + command], cwd=cwd, capture_output=True, text=True)
        assert proc.returncode == 0, f"{command}: {proc.stderr}"
        return None
    assert head == "pfctl" or (head in LAUNCHERS and "pfctl" in tokens), f"unclassified command: {command}"
    if gpu:
        tokens.append("--print-config")
    code, output = _in_process(tokens[1:]) if head == "pfctl" else _subprocess(tokens, cwd)
    expected = EXPECTED_EXIT.get(command, 0)
    assert code == expected, f"`{shlex.join(tokens)}` exited {code} (expected {expected}):\n{output[-3000:]}"
    if outputs is not None:
        outputs[command] = output
    if gpu:
        _check_gpu_config(output, tokens, cwd)
    return None


@pytest.mark.slow
def test_every_documented_command_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = readme_commands()
    assert any(gpu for _, gpu in readme) and len(readme) > 20
    examples = [(shlex.join(shlex.split(c)), False) for lines in help_examples().values() for c in lines]
    _workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    done: set[tuple[str, bool]] = set()
    outputs: dict[str, str] = {}
    not_run = {}
    for command, gpu in [*readme, *examples]:
        if (command, gpu) in done:
            continue
        done.add((command, gpu))
        reason = run_command(command, gpu, tmp_path, outputs)
        if reason:
            not_run[command] = reason
    assert {shlex.split(c)[0] for c in not_run} <= {*SETUP, "accelerate", "source"}, not_run
    assert (tmp_path / "merged").is_dir() and list((tmp_path / "outputs" / "prompts").glob("*.mp4"))
    check_demo((tmp_path / "pfctl-demo").resolve(), outputs["pfctl demo"])


def check_demo(out: Path, printed: str) -> None:
    """What the README's main command, ``pfctl demo``, leaves for a person: its six stages announced, the
    exported model, one video per prompt, the verify-groupnorm report, and the contact sheets at step 0 and at
    the end, the loss curve and the summary, each path printed."""
    from pfctl.demo.run import DemoSettings

    settings = DemoSettings.make(quick=False)
    for stage in range(1, 7):
        assert f"[{stage}/6]" in printed
    assert (out / "train" / "export" / "pfctl_export.json").is_file()
    assert len(list((out / "videos").glob("*.mp4"))) == len(settings.prompts) * settings.videos_per_prompt
    assert (out / "verify-groupnorm.json").is_file()
    sheets = [out / "train" / "validation" / f"step-{s:06d}.png" for s in (0, settings.steps)]
    for path in (*sheets, out / "train" / "loss.png", out / "train" / "summary.md"):
        assert path.is_file() and str(path) in printed, path
