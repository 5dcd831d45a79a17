"""`pfctl train` on the command line: flags → config, dry-run table, exit 2 with the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pfctl.cli.app import app
from pfctl.data.dataset import write_synthetic_cache

runner = CliRunner()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "cache"
    write_synthetic_cache(str(root), [4] * 8 + [2] * 8, seed=1)
    return root


def invoke(*args: str):
    return runner.invoke(app, ["train", *args], prog_name="pfctl")


def test_help_lists_the_run_controls() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for flag in ("--recipe", "--set", "--print-config", "--output-dir", "--max-steps", "--resume", "--seed",
                 "--dry-run", "--world-size", "--plan-steps"):  # fmt: skip
        assert flag in result.output, flag


def test_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_train(config, **kwargs):
        seen["config"], seen["kwargs"] = config, kwargs

        class Report:
            is_main, steps, seconds, final_loss, export_dir = True, 0, 0.0, None, None

        return Report()

    monkeypatch.setattr("pfctl.api.train", fake_train)
    result = invoke("-o", "runs/x", "--max-steps", "7", "--resume", "latest", "--seed", "5",
                    "--set", "train.video_sync_group=2", "--set", "train.use_temporal_causal=false")  # fmt: skip
    assert result.exit_code == 0, result.output
    cfg = seen["config"]
    assert (cfg.train.output_dir, cfg.train.max_steps, cfg.train.resume) == ("runs/x", 7, "latest")
    assert (
        cfg.runtime.seed == 5 and cfg.train.video_sync_group == 2 and cfg.train.use_temporal_causal is False
    )
    assert seen["kwargs"] == {}


def test_print_config_shows_defaults() -> None:
    result = invoke("--print-config")
    assert result.exit_code == 0
    for line in (
        "sample_ratios:",
        "corrupt_ratio: 0.333",
        "caption_dropout: 0.1",
        "use_temporal_pyramid: true",
    ):
        assert line in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "train.batch_size=6"], "train.batch_size 6 is not divisible by sum(train.sample_ratios) = 4"),
        (["--world-size", "4", "--set", "train.video_sync_group=3"],
         "world size 4 is not divisible by train.video_sync_group 3"),
        (["--world-size", "6", "--set", "train.video_sync_group=3", "--set", "train.max_units=16"],
         "train.max_units 16 is not divisible by train.video_sync_group 3"),
        (["--set", "train.sample_ratios=[1,1,1]", "--set", "train.batch_size=4"],
         "train.batch_size 4 is not divisible by sum(train.sample_ratios) = 3"),
    ],
)  # fmt: skip
def test_constraint_violations_exit_2_naming_the_numbers(args: list[str], message: str) -> None:
    result = invoke("--dry-run", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", " ")


def test_dry_run_prints_the_plan(cache: Path) -> None:
    result = invoke("--dry-run", "--world-size", "4", "--plan-steps", "2", "--set", f"train.cache={cache}",
                    "--set", "model.dit_preset=tiny", "--set", "train.video_sync_group=2",
                    "--set", "train.max_units=4")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "world size 4, video_sync_group 2, 2 groups" in result.output
    rows = [ln for ln in result.output.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(rows) == 2 * 4  # 2 steps x 4 ranks
    assert "tokens per sync group and step" in result.output
    # what CUDA would run (4 processes, no checkpointing, one micro-batch: compiled blocks, the memory-efficient
    # attention),
    # and the warm-up's inputs on rank 0: M / G = 2 unit positions of each of the 2 buckets
    flat = "".join(result.output.split())  # (the console wraps long lines, also after hyphens)
    assert "onCUDAwith4process(es):compiledblocks;checkpointingnone;attentionefficient" in flat
    assert "warm-up:4distinctinputsonrank0" in flat


def test_dry_run_says_whether_a_compile_cache_waits_in_the_output_directory(cache: Path, tmp_path: Path) -> None:
    args = ["--dry-run", "--plan-steps", "1", "--set", f"train.cache={cache}", "--set", "model.dit_preset=tiny",
            "--set", "train.max_units=4", "--set", f"train.output_dir={tmp_path}"]  # fmt: skip
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "nocompilecacheofthisrunyet" in "".join(result.output.split())
    assert "sharedcache~/.cache/pfctl/compile" in "".join(result.output.split())
    (tmp_path / "compile-cache.json").write_text('{"torch": "2.11.0", "triton": "3.6.0", "device": "H200", "step": 16}')
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "(torch2.11.0,triton3.6.0,deviceH200;writtenatstep16)" in "".join(result.output.split())


def test_dry_run_without_a_model_or_cache_says_what_to_set(cache: Path, tmp_path: Path) -> None:
    result = invoke("--dry-run", "--set", f"train.cache={cache}")
    assert result.exit_code == 2 and "model.dit_preset" in result.output
    result = invoke(
        "--dry-run", "--set", "model.dit_preset=tiny", "--set", f"train.cache={tmp_path / 'none'}"
    )
    assert result.exit_code == 2 and "does not exist" in result.output
