"""The root command: help, version, fast start, completions, error → exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pfctl import __version__
from pfctl.cli.app import app

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["encode-latents", "train", "generate", "verify-groupnorm"]
runner = CliRunner()


def test_root_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"], prog_name="pfctl")
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_command_help_has_an_example(name: str) -> None:
    result = runner.invoke(app, [name, "--help"], prog_name="pfctl")
    assert result.exit_code == 0, result.output
    assert "Example" in result.output
    assert "--recipe" in result.output and "--set" in result.output and "--print-config" in result.output


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"pfctl {__version__}"


def test_help_is_fast_and_imports_no_heavy_module() -> None:
    code = (
        "import sys, time; t = time.perf_counter();"
        "from pfctl.cli.app import app;"
        "from typer.testing import CliRunner; r = CliRunner().invoke(app, ['--help']);"
        "heavy = [m for m in ('torch', 'diffusers', 'accelerate', 'transformers', 'decord', 'av', 'safetensors')"
        " if m in sys.modules];"
        "import json; print(json.dumps({'heavy': heavy, 'code': r.exit_code, 's': time.perf_counter() - t}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["heavy"] == [] and info["code"] == 0


def test_python_dash_m_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "pfctl", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_completions_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_completions.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "train.no_such_key=1"], "unknown key 'train.no_such_key'"),
        (["--set", "runtime.device=gpu"], "runtime.device = 'gpu'"),
        (["--set", "trian.lr=1"], "did you mean 'train'?"),
        (["--set", "justakey"], "bad override"),
        (["--recipe", "no-such-recipe"], "neither a file nor a known recipe"),
    ],
)
@pytest.mark.parametrize("name", COMMANDS)
def test_bad_config_exits_2_with_the_key_named(name: str, args: list[str], needle: str) -> None:
    result = runner.invoke(app, [name, *args, "--print-config"], prog_name="pfctl")
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_print_config_shows_the_override(name: str) -> None:
    result = runner.invoke(app, [name, "--set", "runtime.seed=7", "--print-config"], prog_name="pfctl")
    assert result.exit_code == 0, result.output
    assert "seed: 7" in result.output


def _failed_check(*args: object, **kwargs: object) -> None:
    from pfctl.errors import CheckFailed

    raise CheckFailed("the check failed", hint="a hint")


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("name", COMMANDS)
def test_debug_adds_a_traceback_and_keeps_the_exit_code(
    name: str, debug: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pfctl.cli._common import STATE

    monkeypatch.setitem(STATE, "debug", False)  # --debug sets it for the process; restored afterwards
    flag = ["--debug"] if debug else []
    usage = runner.invoke(app, [*flag, name, "--set", "train.no_such_key=1", "--print-config"])
    assert usage.exit_code == 2, usage.output
    assert "unknown key 'train.no_such_key'" in usage.output
    assert ("Traceback" in usage.output) == debug

    monkeypatch.setattr("pfctl.config.load_config", _failed_check)
    check = runner.invoke(app, [*flag, name, "--print-config"])
    assert check.exit_code == 1, check.output
    assert "error: the check failed" in check.output and "hint: a hint" in check.output
    assert ("Traceback" in check.output) == debug


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_keeps_exit_code_2_in_a_real_process(how: str, tmp_path: Path) -> None:
    """The issue's command: a missing annotation file is a usage error with or without --debug."""
    env = {k: v for k, v in os.environ.items() if k != "PFCTL_DEBUG"}
    args = ["encode-latents", "-a", str(tmp_path / "nonexistent.jsonl"), "-o", str(tmp_path / "out")]
    if how == "flag":
        args = ["--debug", *args]
    else:
        env["PFCTL_DEBUG"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pfctl", *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" in proc.stderr and "nonexistent.jsonl" in proc.stderr


_VARIANT_PROBE = """
import os

import torch


def test_this_variant():
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":  # the variable reached the child's torch
        assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    # fails in the one-thread variant only: it stands in for a tolerance that holds on one CPU and not another
    assert os.environ.get("PFCTL_TEST_THREADS") != "1"
"""


@pytest.mark.slow
def test_cpu_variants_run_the_tests_under_each_variant_and_name_the_failed(tmp_path: Path) -> None:
    """``scripts/cpu_variants.py`` runs pytest with each variant's environment, reports each, and fails when
    one fails; a wrong variant name is a usage error."""
    (tmp_path / "test_probe.py").write_text(_VARIANT_PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("PFCTL_TEST_THREADS", "ATEN_CPU_CAPABILITY")}
    script = str(REPO / "scripts" / "cpu_variants.py")
    run = subprocess.run(
        [sys.executable, script, "--variants", "no-simd,one-thread", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("no-simd: exit 0 ") and "1 passed" in line for line in lines), run.stdout
    assert any(line.startswith("one-thread: exit 1 ") and "1 failed" in line for line in lines), run.stdout
    assert lines[-1] == "1 of 2 variants passed; failed: one-thread"
    bad = subprocess.run([sys.executable, script, "--variants", "avx9"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown variant(s) avx9" in bad.stderr
