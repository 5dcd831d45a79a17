"""`pfctl encode-latents`: option names, flag → config mapping, rendering, exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pfctl.cli.app import app
from pfctl.data.encode import EncodeReport, PlanRow
from pfctl.errors import CheckFailed

runner = CliRunner()
OPTIONS = [
    "--recipe", "--set", "--print-config", "--annotations", "--output-dir", "--model", "--vae",
    "--chunking", "--max-failures", "--batch-size", "--num-workers", "--dry-run", "--overwrite",
]  # fmt: skip


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the library call; record what the CLI passed."""
    seen: dict[str, Any] = {}

    def encode_latents(config, **kwargs):
        seen["config"], seen["kwargs"] = config, kwargs
        if seen.get("raise"):
            raise seen["raise"]
        return seen.get("report") or EncodeReport(
            output_dir=config.encode.output_dir, fingerprint="abc", encoded=3
        )

    monkeypatch.setattr("pfctl.api.encode_latents", encode_latents)
    return seen


def test_help_lists_the_options() -> None:
    result = runner.invoke(app, ["encode-latents", "--help"], prog_name="pfctl", terminal_width=200)
    assert result.exit_code == 0
    for option in OPTIONS:
        assert option in result.output
    assert "-a" in result.output and "-o" in result.output


def test_flags_map_to_config_fields(fake_api: dict[str, Any]) -> None:
    args = [
        "encode-latents", "-a", "data/train.jsonl", "-o", "out/cache", "-m", "ckpt", "--vae", "causal-vae-tiny",
        "--chunking", "framewise", "--max-failures", "5", "--set", "encode.fps=30", "--dry-run", "--overwrite",
        "--batch-size", "3", "--num-workers", "5",
    ]  # fmt: skip
    result = runner.invoke(app, args, prog_name="pfctl")
    assert result.exit_code == 0, result.output
    config = fake_api["config"]
    assert config.encode.annotations == "data/train.jsonl" and config.encode.output_dir == "out/cache"
    assert config.model.path == "ckpt" and config.model.vae == "causal-vae-tiny"
    assert (
        config.encode.chunking == "framewise" and config.encode.max_failures == 5 and config.encode.fps == 30
    )
    assert config.encode.batch_size == 3 and config.encode.num_workers == 5
    assert fake_api["kwargs"] == {"dry_run": True, "overwrite": True}
    auto = runner.invoke(
        app, ["encode-latents", "--num-workers", "auto", "--batch-size", "1"], prog_name="pfctl"
    )
    assert auto.exit_code == 0 and fake_api["config"].encode.num_workers == "auto"
    for bad in (["--num-workers", "many"], ["--batch-size", "0"]):
        result = runner.invoke(app, ["encode-latents", *bad], prog_name="pfctl")
        assert result.exit_code == 2 and ("num_workers" in result.output or "batch_size" in result.output)


def test_defaults_and_print_config(fake_api: dict[str, Any]) -> None:
    result = runner.invoke(app, ["encode-latents", "--print-config"], prog_name="pfctl")
    assert result.exit_code == 0 and "config" not in fake_api
    assert "clip_mode: head" in result.output and "num_frames: 121" in result.output
    assert "- 640\n    - 384" in result.output and "chunking: none" in result.output
    result = runner.invoke(app, ["encode-latents", "--chunking", "sideways"], prog_name="pfctl")
    assert result.exit_code == 2


def test_summary_and_plan_rendering(fake_api: dict[str, Any]) -> None:
    result = runner.invoke(app, ["encode-latents", "-a", "x.jsonl"], prog_name="pfctl", terminal_width=200)
    assert result.exit_code == 0 and "encoded" in result.output and "3" in result.output
    fake_api["report"] = EncodeReport(
        output_dir="c",
        fingerprint="abc",
        encoded=3,
        batch_size=2,
        stage_seconds={"decode_wait": 0.25, "vae": 4.0},
    )
    result = runner.invoke(app, ["encode-latents", "-a", "x.jsonl"], prog_name="pfctl", terminal_width=200)
    assert "seconds per stage (batches of 2): decode wait 0.2, vae 4.0" in result.output, result.output
    fake_api["report"] = EncodeReport(
        output_dir="c", fingerprint="abc", dry_run=True, estimated_bytes=3 * 2**20,
        plan=[PlanRow("640x384", 121, (16, 16, 48, 80), clips=2, cached=1, bytes_per_clip=2**20)],
        failures=[{"source": "bad.mp4", "line": 4, "reason": "too_short", "detail": "5 frames"}], failed=1,
        failures_by_reason={"too_short": 1},
    )  # fmt: skip
    result = runner.invoke(
        app, ["encode-latents", "-a", "x.jsonl", "--dry-run"], prog_name="pfctl", terminal_width=200
    )
    assert result.exit_code == 0, result.output
    for text in ("640x384", "16x16x48x80", "1 clip(s) to encode", "3.0 MiB", "too_short", "bad.mp4 (line 4)"):
        assert text in result.output


def test_too_many_failures_exit_1_after_the_summary(fake_api: dict[str, Any]) -> None:
    error = CheckFailed("7 input(s) failed, more than max_failures=2", hint="see failures.jsonl")
    error.report = EncodeReport(
        output_dir="c", fingerprint="abc", failed=7, failures_by_reason={"truncated": 7}
    )
    fake_api["raise"] = error
    result = runner.invoke(app, ["encode-latents", "-a", "x.jsonl"], prog_name="pfctl", terminal_width=200)
    assert result.exit_code == 1
    assert "truncated" in result.output and "max_failures=2" in result.output


def test_bad_inputs_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["encode-latents", "-a", str(tmp_path / "none.jsonl")], prog_name="pfctl")
    assert result.exit_code == 2 and "does not exist" in result.output
    (tmp_path / "a.csv").write_text("file,caption\nx.mp4,hello\n")
    result = runner.invoke(app, ["encode-latents", "-a", str(tmp_path / "a.csv")], prog_name="pfctl")
    assert result.exit_code == 2 and "missing column" in result.output and "'video'" in result.output
    (tmp_path / "a.jsonl").write_text(json.dumps({"video": "x.mp4", "text": "hi"}) + "\n")
    # no model option: the embedded model, whose DiT cannot train a 96x64 bucket (refused before any work)
    args = ["encode-latents", "-a", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "c")]
    result = runner.invoke(app, [*args, "--set", "encode.buckets=[[96,64]]"], prog_name="pfctl")
    assert result.exit_code == 2 and "96x64" in result.output and "64x64, 128x64" in result.output, (
        result.output
    )
    assert not (tmp_path / "c").exists()


def test_unknown_vae_class_exits_2(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps({"video": "x.mp4", "text": "hi"}) + "\n")
    vae = tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLFancy"}))
    args = [
        "encode-latents",
        "-a",
        str(tmp_path / "a.jsonl"),
        "--vae",
        str(vae),
        "--set",
        "encode.text=false",
    ]
    result = runner.invoke(
        app, [*args, "--set", "runtime.device=cpu", "-o", str(tmp_path / "c")], prog_name="pfctl"
    )
    assert result.exit_code == 2, result.output
    assert "AutoencoderKLFancy" in result.output and not (tmp_path / "c").exists()
