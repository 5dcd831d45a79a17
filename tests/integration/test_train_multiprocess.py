"""`torchrun -m pfctl train` with real CPU processes (gloo): sync groups, agreed replacements, plan = run.

Each run: 36 video clips (8, 5 and 3 latent frames) + 4 images, the tiny DiT, 3 steps of 2
micro-batches. One clip file is corrupted so that group 0 must replace it in its first batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pfctl import api
from pfctl.config import load_config
from pfctl.data.dataset import write_synthetic_cache
from pfctl.data.latent_cache import LatentCache
from pfctl.flow.pyramid import sample_stage_length

LENGTHS = [8] * 12 + [5] * 12 + [3] * 12 + [1] * 4
REFERENCE = Path(__file__).resolve().parents[2].parent / "shared" / "reference" / "pyramid_flow"


def _recipe(tmp: Path, cache: Path, group: int, **train) -> Path:
    recipe = {
        "runtime": {"device": "cpu", "seed": 11, "collective_timeout_s": 120},
        "model": {"dit_preset": "tiny"},
        "train": {
            "cache": str(cache),
            "output_dir": str(tmp / "out"),
            "max_steps": 3,
            "grad_accum": 2,
            "batch_size": 4,
            "max_units": 8,
            "video_sync_group": group,
            "warmup_steps": 1,
            "checkpoint_every": 100,
            "export": False,
            **train,
        },
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _torchrun(nproc: int, recipe: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "pfctl", "train", "--recipe", str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PFCTL_TEST_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _reference_units() -> dict | None:
    path = REFERENCE / "sample_stage_length.json"
    if not path.is_file():
        return None
    table = json.loads(path.read_text())["table"]
    return {
        (e["max_temporal_length"], e["video_sync_group"]): e["results"]
        for e in table
        if e["valid_in_trainer"]
    }


@pytest.mark.slow
@pytest.mark.parametrize(("world", "group"), [(4, 2), (4, 4), (2, 1)])
def test_sync_groups_on_real_processes(tmp_path: Path, world: int, group: int) -> None:
    cache = tmp_path / "cache"
    write_synthetic_cache(str(cache), LENGTHS, seed=5)
    recipe = _recipe(tmp_path, cache, group)
    config = load_config(str(recipe))

    # corrupt the first clip group 0 would train, so the run has to replace it
    plan = api.train(config, dry_run=True, world_size=world).rows
    victim = plan[0]["ids"][0]
    (cache / LatentCache.open(cache).row(victim)["path"]).write_bytes(b"not a safetensors file")
    plan = api.train(config, dry_run=True, world_size=world).rows
    assert plan[0]["replaced"] == {"0": [victim]}

    proc = _torchrun(world, recipe)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out" / "assignments"
    done = [
        json.loads(x) for r in range(world) for x in (out / f"rank-{r:05d}.jsonl").read_text().splitlines()
    ]
    done.sort(key=lambda r: (r["micro_step"], r["rank"]))
    assert len(done) == world * 3 * 2

    # 1. the dry-run table is what the run did (ids, columns, replacements, units, tokens)
    assert done == plan

    # 2. same clips inside a group, different clips across groups, the victim replaced everywhere
    for micro in range(6):
        rows = [r for r in done if r["micro_step"] == micro]
        per_group = {}
        for r in rows:
            per_group.setdefault(r["group"], set()).add(tuple(r["ids"]))
        assert all(len(ids) == 1 for ids in per_group.values())
        batches = [set(next(iter(ids))) for ids in per_group.values()]
        assert all(a.isdisjoint(b) for i, a in enumerate(batches) for b in batches[i + 1 :])
    assert all(victim not in r["ids"] for r in done)
    assert all(r["replaced"] == {"0": [victim]} for r in done if r["micro_step"] == 0 and r["group"] == 0)

    # 3. per-rank lengths = the reference schedule (the table when present)
    table = _reference_units()
    for r in done:
        frames = r["bucket"][0]
        if table is not None and (8, group) in table:
            calls = table[(8, group)].get(f"max_units={frames}|rank={r['rank']}")
            if calls is not None and r["micro_step"] < len(calls):
                assert r["units"] == calls[r["micro_step"]], r
        assert tuple(r["units"]) == sample_stage_length(r["micro_step"], r["rank"], group, 8, frames)


@pytest.mark.slow
def test_bad_layout_exits_2_on_every_rank(tmp_path: Path) -> None:
    """The layout check runs before any collective, so each rank fails alone with exit code 2.

    The ranks are started as independent processes (as srun or mpirun would): torchrun's agent
    kills the siblings of the first rank that exits, which would hide whether they fail cleanly.
    """
    cache = tmp_path / "cache"
    write_synthetic_cache(str(cache), LENGTHS[:8], seed=5)
    recipe = _recipe(tmp_path, cache, 4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never contacted
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pfctl", "train", "--recipe", str(recipe)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 2, out
        assert f"error on rank {rank}: world size 2 is not divisible by train.video_sync_group 4" in out
        assert "hint: choose train.video_sync_group from [1, 2]" in out


@pytest.mark.slow
def test_bad_layout_under_torchrun_reports_exit_code_2(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    write_synthetic_cache(str(cache), LENGTHS[:8], seed=5)
    proc = _torchrun(2, _recipe(tmp_path, cache, 4), timeout=120)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "world size 2 is not divisible by train.video_sync_group 4" in text
    assert "exitcode  : 2" in text or "exit code 2" in text or "exitcode: 2" in text


@pytest.mark.slow
def test_step_graphs_with_two_processes_average_like_ddp(tmp_path: Path) -> None:
    """Data parallel under ``train.cuda_graphs=step``: each of two processes (one sync group, so each trains
    other units of the same clips) records its own inputs and replays them without DDP, and the step's
    gradients are averaged after its last micro-batch; the losses and the final weights are those of the
    same two-process run under DDP without graphs, within fp32 rounding. (On the CPU the recording is
    played by ``helpers.step_graphs.replaying_capture``; the speed is settled by hand in the worker.)"""
    from safetensors.torch import load_file

    from helpers.tolerance import assert_rounding_close

    write_synthetic_cache(str(tmp_path / "cache"), [4] * 8, seed=5)
    worker = Path(__file__).with_name("_step_graphs_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PFCTL_TEST_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    runs = {}
    for mode in ("plain", "step"):
        folder = tmp_path / mode
        folder.mkdir()
        recipe = _recipe(folder, tmp_path / "cache", 2, max_steps=4, max_units=4, lr=2e-3, checkpoint_every=4, log_every=1)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        proc = subprocess.run(
            [*cmd, str(worker), str(recipe), mode], capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = [json.loads(x) for x in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = [r["loss"] for r in rows if "loss" in r]
        if mode == "step":  # two unit positions a rank (one bucket), each recorded once
            assert "CUDA graphs of the step: 2 recorded" in proc.stdout + proc.stderr
    assert len(runs["step"]) == 4
    assert_rounding_close(runs["step"], runs["plain"], reduction=64, depth=4 * 8)
    weights = {
        mode: load_file(str(tmp_path / mode / "out/checkpoints/step-000004/model/diffusion_pytorch_model.safetensors"))
        for mode in runs
    }
    for key, value in weights["plain"].items():
        assert_rounding_close(weights["step"][key], value, reduction=64, depth=4 * 8)
