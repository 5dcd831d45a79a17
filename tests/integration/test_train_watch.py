"""Watching a run: trackers through accelerate (TensorBoard events read back, W&B offline), resume into
the same tracker run, validation contact sheets decoded with the cache's VAE, the run summary."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from helpers.tiny_models import tiny_train_config
from pfctl import api
from pfctl.cli.app import app
from pfctl.config import load_config
from pfctl.config.train import check_trackers
from pfctl.data.dataset import write_synthetic_cache
from pfctl.errors import ConfigError
from pfctl.training.summary import wall_seconds

runner = CliRunner()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic 8x8 latents of 16 channels, whose header names the tiny causal VAE (16 latent channels,
    8x spatial): validation samples decode to 64x64 videos."""
    root = tmp_path_factory.mktemp("watch") / "cache"
    write_synthetic_cache(str(root), [4] * 8 + [3] * 8, seed=0)
    header = json.loads((root / "cache.json").read_text())
    header["vae"]["spec"] = "causal-vae-tiny"
    (root / "cache.json").write_text(json.dumps(header))
    return root


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tensorboard_events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


@pytest.mark.slow
def test_trackers_sheets_summary_and_resume_into_the_same_run(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    trackers = ["tensorboard"] + (["wandb"] if has("wandb") else [])
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / "home"))  # W&B writes nothing outside tmp
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    opts = dict(
        trackers=trackers, heldout_clips=2, eval_every=2, validation_every=2, validation_units=2,
        checkpoint_every=2, export=False,
    )  # fmt: skip
    api.train(tiny_train_config(cache, out, max_steps=2, **opts))
    first = json.loads((out / "trackers.json").read_text())
    assert first["run_name"] == "run" and first["project"] == "pfctl"

    # resume from step 2 to step 3: the same tracker run continues
    report = api.train(tiny_train_config(cache, out, max_steps=3, resume="latest", **opts))
    assert report.resumed_from and report.resumed_from.endswith("step-000002")
    assert json.loads((out / "trackers.json").read_text()) == first

    events = tensorboard_events(out / "trackers" / "pfctl")
    scalars = set(events.Tags()["scalars"])
    for key in ("loss", "loss_stage0", "loss_stage2", "heldout_loss", "heldout_loss_stage1", "lr", "grad_norm",
                "tokens_per_s", "data_time_s"):  # fmt: skip
        assert key in scalars, key
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]  # steps of both processes, once each
    assert [e.step for e in events.Scalars("heldout_loss_stage0")] == [0, 2]
    assert [e.step for e in events.Images("validation")] == [0, 2, 3]  # step 0, every 2, the last
    assert "mfu" not in scalars and "peak_memory_gib" not in scalars  # CPU: neither is measured

    if "wandb" in trackers:  # offline: both processes wrote into the run with the stored id
        runs = sorted((out / "trackers" / "wandb").glob("offline-run-*"))
        assert len(runs) == 2 and all(r.name.endswith(first["wandb_id"]) for r in runs)

    # the contact sheets: 2 clips x 3 frames of 64x64 videos, enlarged to 160 px cells, not blank
    sheets = sorted((out / "validation").glob("step-*.png"))
    assert [s.stem for s in sheets] == ["step-000000", "step-000002", "step-000003"]
    img = np.asarray(Image.open(sheets[-1]).convert("RGB"))
    gap, label, caption, head = 8, 22, 18, 40
    assert img.shape == (head + 2 * (label + 160 + caption + gap) + gap, max(gap + 3 * (160 + gap), 480), 3)
    cell = img[head + label : head + label + 160, gap : gap + 160]
    assert cell.std() > 5  # a decoded frame, not a flat colour
    assert len(list((out / "validation").glob("step-000003-*.mp4"))) == 2

    # the summary, written at the end, shows the whole run (both processes)
    text = (out / "summary.md").read_text()
    assert "| steps | 3 of 3 |" in text and "held-out loss" in text and "validation/step-000003.png" in text
    assert Image.open(out / "loss.png").size == (960, 540)


def test_a_missing_tracker_package_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Before any work: the dry-run (and the trainer) stop with exit 2, naming the extra to install."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'pfctl\[wandb\]'"):
        check_trackers(["wandb"])
    result = runner.invoke(
        app,
        [
            "train",
            "--dry-run",
            "--set",
            "train.trackers=[wandb]",
            "--set",
            f"train.cache={tmp_path / 'none'}",
        ],
        prog_name="pfctl",
    )
    assert result.exit_code == 2, result.output
    assert "wandb" in result.output and "pfctl[wandb]" in result.output
    assert "Traceback" not in result.output


def test_an_unknown_tracker_is_refused() -> None:
    with pytest.raises(ConfigError, match="trackers"):
        load_config(None, ["train.trackers=[tensorbored]"])


def _write_run(out: Path) -> None:
    """A run folder as the trainer leaves it, resumed once (elapsed_s restarts at the resume)."""
    rows = [
        {"step": 0, "heldout_loss": 0.9, "heldout_loss_stage0": 0.5, "heldout_loss_stage1": 1.3},
        *(
            {"step": s, "loss": 1.0 / s, "loss_stage0": 0.5 / s, "loss_stage1": 1.5 / s, "lr": 1e-4,
             "grad_norm": 1.0, "tokens_per_s": 100.0 * s, "samples_per_s": 1.0, "step_time_s": 1.0,
             "data_time_s": 0.25, "elapsed_s": e}
            for s, e in ((1, 10.0), (2, 11.0), (3, 5.0), (4, 6.0))
        ),
        {"step": 4, "heldout_loss": 0.4, "heldout_loss_stage0": 0.2, "heldout_loss_stage1": 0.6},
    ]  # fmt: skip
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    (out / "config.yaml").write_text("train:\n  max_steps: 4\n  export_format: pfctl\n")
    (out / "export").mkdir()


def test_summary_re_renders_from_the_run_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _write_run(out)
    result = runner.invoke(app, ["train", "--summary", str(out)], prog_name="pfctl")
    assert result.exit_code == 0, result.output
    text = result.output
    assert "| steps | 4 of 4 |" in text
    assert "| wall time | 17 s |" in text  # 11 s before the resume + 6 s after
    assert "250 image tokens/s" in text and "25.0% of the step time" in text
    assert "0.4000 (stage 0 0.2000, stage 1 0.6000) at step 4 (step 0: 0.9000)" in text
    assert f'pfctl generate --model {(out / "export").resolve()} "' in text
    assert (out / "summary.md").read_text().strip() == text.strip()
    chart = np.asarray(Image.open(out / "loss.png").convert("RGB"))
    assert chart.shape == (540, 960, 3) and chart.std() > 0


def test_summary_of_a_folder_without_metrics_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--summary", str(tmp_path)], prog_name="pfctl")
    assert result.exit_code == 2 and "metrics.jsonl" in result.output


def test_wall_time_adds_up_the_resumed_segments() -> None:
    rows = [{"elapsed_s": 3.0}, {"elapsed_s": 8.0}, {"elapsed_s": 2.0}, {"loss": 1.0}, {"elapsed_s": 4.0}]
    assert wall_seconds(rows) == 12.0
    assert wall_seconds([{"step_time_s": 1.5}, {"step_time_s": 2.0}]) == 3.5  # older logs: step times


def test_a_resume_keeps_the_tracker_run_and_a_fresh_run_starts_a_new_one(tmp_path: Path) -> None:
    from pfctl.training.trackers import init_kwargs, tracker_run

    cfg = load_config(None, ["train.trackers=[tensorboard, wandb]", "train.run_name=exp-1"]).train
    first = tracker_run(tmp_path, cfg, resuming=False)
    assert first["run_name"] == "exp-1" and len(first["wandb_id"]) == 8
    assert tracker_run(tmp_path, cfg, resuming=True) == first
    assert tracker_run(tmp_path, cfg, resuming=False)["wandb_id"] != first["wandb_id"]
    kwargs = init_kwargs(cfg, first, tmp_path, resume_step=6)
    assert kwargs["wandb"]["id"] == first["wandb_id"] and kwargs["wandb"]["resume"] == "allow"
    assert kwargs["wandb"]["mode"] == "offline"  # the default: no network, no account
    assert kwargs["tensorboard"] == {"purge_step": 7}  # what a dead run logged after step 6 is dropped
    assert init_kwargs(cfg, first, tmp_path, resume_step=None)["tensorboard"] == {"purge_step": 0}


def test_mfu_counts_six_flops_per_parameter_and_image_token(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pfctl.training.logs import mfu, peak_flops

    assert peak_flops(torch.device("cpu")) is None  # no MFU on the CPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_flops(torch.device("cuda", 0)) == 989.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert peak_flops(torch.device("cuda", 0)) is None  # unknown peak: no MFU rather than a wrong one
    # 1e9 parameters, 1e4 image tokens over 2 processes in 0.5 s against 1e15 FLOP/s each: 6e13 / 1e15
    assert mfu(10**9, 1e4, 0.5, 2, 1e15) == pytest.approx(0.06)
