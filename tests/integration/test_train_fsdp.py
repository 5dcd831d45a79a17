"""FSDP through accelerate on 2 GPUs: train, checkpoint (gathered), resume (re-sharded). GPU only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pfctl.data.dataset import write_synthetic_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _run(tmp: Path, out: str, **train) -> subprocess.CompletedProcess:
    recipe = {
        "runtime": {"device": "cuda", "seed": 2},
        "model": {"dit_preset": "tiny"},
        "train": {"cache": str(tmp / "cache"), "output_dir": str(tmp / out), "batch_size": 4, "max_units": 4,
                  "video_sync_group": 2, "warmup_steps": 1, "checkpoint_every": 2, "keep_last": None,
                  "ema_decay": 0.9, "ema_every": 1, "log_every": 1, **train},
    }  # fmt: skip
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "pfctl", "train", "--recipe", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))


@pytest.mark.parametrize("fsdp", ["shard_grad_op", "full_shard"])
def test_fsdp_trains_checkpoints_and_resumes(tmp_path: Path, fsdp: str) -> None:
    write_synthetic_cache(str(tmp_path / "cache"), [4] * 16 + [2] * 16, seed=0)
    full = _run(tmp_path, "full", max_steps=4, fsdp=fsdp)
    assert full.returncode == 0, full.stderr[-4000:]
    (tmp_path / "part" / "checkpoints").mkdir(parents=True)
    os.symlink(
        tmp_path / "full" / "checkpoints" / "step-000002", tmp_path / "part" / "checkpoints" / "step-000002"
    )
    part = _run(tmp_path, "part", max_steps=4, fsdp=fsdp, resume="latest")
    assert part.returncode == 0, part.stderr[-4000:]

    def losses(run: str) -> list[float]:
        return [json.loads(x)["loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert losses("part") == pytest.approx(losses("full")[2:], rel=1e-3)
    from safetensors.torch import load_file

    for sub in ("model", "ema"):
        a = load_file(
            str(
                tmp_path
                / "full"
                / "checkpoints"
                / "step-000004"
                / sub
                / "diffusion_pytorch_model.safetensors"
            )
        )
        b = load_file(
            str(
                tmp_path
                / "part"
                / "checkpoints"
                / "step-000004"
                / sub
                / "diffusion_pytorch_model.safetensors"
            )
        )
        assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a), sub
    assert (tmp_path / "full" / "export" / "pfctl_export.json").is_file()
