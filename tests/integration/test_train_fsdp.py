"""``train.fsdp`` (FSDP2 applied by pfctl) with real processes: sharded training computes what the
unsharded run computes, checkpoints hold the whole (gathered) weights, a resume re-shards them and
continues exactly, the export is the gathered model.

CPU: 2 processes (gloo) under ``torchrun``, the tiny DiT with activation checkpointing on half of its
blocks, 2 micro-batches per step (the first backward without gradient sync), every step's gradients
clipped, EMA every step, held-out losses and validation samples.
CUDA (2 GPUs): the same in bf16, and compiled + checkpointed + sharded against the eager unsharded run; on one
GPU, compiled + checkpointed + sharded with the shards in host memory against the eager unsharded run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.tolerance import assert_rounding_close
from pfctl.data.dataset import write_synthetic_cache
from pfctl.models.registry import preset_config

STEPS = 4
CLIP = 0.05  # below the tiny DiT's gradient norms: every step is clipped (by the whole model's norm)
TINY = preset_config("tiny")
WIDTH = TINY["num_attention_heads"] * TINY["attention_head_dim"]
BLOCKS = TINY["num_layers"] + TINY["num_single_layers"]
# Sharded and unsharded runs sum the same gradients in other orders (reduce-scatter vs all-reduce, the
# clipping norm from per-shard norms): the weights may differ by the rounding of a step's sums, and every
# later step goes through them again. Longest sum: a block's MLP (4 x width) or the text projection; chained
# sums per step: forward, backward and update through every block and the embedders.
LOSS_SUMS = {
    "reduction": max(4 * WIDTH, TINY["joint_attention_dim"]),
    "depth": STEPS * 3 * 4 * (BLOCKS + 2),
}


def _run(tmp: Path, out: str, device: str, nproc: int = 2, precision: str = "auto", **train) -> Path:
    recipe = {
        "runtime": {"device": device, "seed": 2, "collective_timeout_s": 120, "mixed_precision": precision},
        "model": {"dit_preset": "tiny"},
        "train": {"cache": str(tmp / "cache"), "output_dir": str(tmp / out), "batch_size": 4, "max_units": 4,
                  "video_sync_group": 2, "grad_accum": 2, "lr": 2e-3, "grad_clip": CLIP, "warmup_steps": 1,
                  "max_steps": STEPS, "checkpoint_every": 2, "keep_last": None, "ema_decay": 0.9, "ema_every": 1, "log_every": 1,
                  "gradient_checkpointing": True, "gradient_checkpointing_ratio": 0.5, "heldout_clips": 2,
                  "eval_every": 2, "validation_every": STEPS, "validation_units": 1, **train},
    }  # fmt: skip
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "pfctl", "train", "--recipe", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PFCTL_TEST_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / out


def _losses(run: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def _check_sharded_run(tmp: Path, sharded: Path, plain: Path, fsdp: str, device: str, **train) -> None:
    """``sharded`` trained like ``plain`` (losses, weights); a resume from its step-2 checkpoint (with the
    ``train`` settings ``sharded`` ran with) continues like it (on the CPU exactly: the same computation on the
    same shards); its export is its last checkpoint's weights."""
    cpu = device == "cpu"
    last = sharded / "checkpoints" / f"step-{STEPS:06d}"
    validation = load_file(str(sharded / "validation" / f"step-{STEPS:06d}.safetensors"))["latents"]
    assert bool(validation.isfinite().all())  # every rank took part in sampling with the sharded DiT
    if cpu:
        assert min(_losses(plain, "grad_norm")) > CLIP
        assert_rounding_close(_losses(sharded, "grad_norm"), _losses(plain, "grad_norm"), **LOSS_SUMS)
        assert_rounding_close(_losses(sharded), _losses(plain), **LOSS_SUMS)
        assert_rounding_close(_losses(sharded, "heldout_loss"), _losses(plain, "heldout_loss"), **LOSS_SUMS)
        for sub in ("model", "ema"):
            ours, theirs = _weights(last / sub), _weights(plain / "checkpoints" / f"step-{STEPS:06d}" / sub)
            assert ours.keys() == theirs.keys(), sub
            for key, value in theirs.items():
                assert_rounding_close(ours[key], value, **LOSS_SUMS, msg=f"{sub}/{key}")
    else:  # bf16 blocks (gathered in bf16 vs cast by autocast: the same rounding), other kernels when compiled
        assert _losses(sharded) == pytest.approx(_losses(plain), rel=2e-2)

    (tmp / "part" / "checkpoints").mkdir(parents=True)
    os.symlink(sharded / "checkpoints" / "step-000002", tmp / "part" / "checkpoints" / "step-000002")
    part = _run(tmp, "part", device, fsdp=fsdp, resume="latest", **train)
    resumed = part / "checkpoints" / f"step-{STEPS:06d}"
    if cpu:
        assert _losses(part) == _losses(sharded)[2:]
        for name in ("model", "ema"):
            a, b = _weights(last / name), _weights(resumed / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        opt_a, opt_b = (load_file(str(p / "optimizer.safetensors")) for p in (last, resumed))
        assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)
    else:  # CUDA kernels need not be deterministic
        assert _losses(part) == pytest.approx(_losses(sharded)[2:], rel=1e-3)

    for name, exported in (("model", "transformer"), ("ema", "transformer_ema")):
        a, b = _weights(last / name), _weights(sharded / "export" / exported)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_cpu_offload_without_sharding_is_refused() -> None:
    from pfctl.config import load_config
    from pfctl.config.train import check_train_constraints
    from pfctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.fsdp_cpu_offload=true needs train\.fsdp"):
        check_train_constraints(load_config(None, ["train.fsdp_cpu_offload=true"]).train, 1)
    check_train_constraints(
        load_config(None, ["train.fsdp_cpu_offload=true", "train.fsdp=full_shard"]).train, 1
    )


@pytest.fixture(scope="module")
def cpu_unsharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-process eager run without sharding (DDP) every sharded run is compared with."""
    tmp = tmp_path_factory.mktemp("plain")
    write_synthetic_cache(str(tmp / "cache"), [4] * 16 + [2] * 16, seed=0)
    return _run(tmp, "plain", "cpu", fsdp="none")


@pytest.fixture(scope="module")
def cpu_unsharded_merged(cpu_unsharded: Path) -> Path:
    """The same unsharded run with each step's micro-batches as one forward (``train.merge_micro_batches``)."""
    return _run(cpu_unsharded.parent, "plain-merged", "cpu", fsdp="none", merge_micro_batches=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fsdp", "background", "merged"), [("shard_grad_op", False, False), ("full_shard", True, True)]
)
def test_fsdp_on_cpu_processes_matches_unsharded_and_resumes(
    tmp_path: Path, request: pytest.FixtureRequest, fsdp: str, background: bool, merged: bool
) -> None:
    """``background``: the sharded run writes its checkpoints from a thread per rank (``train.checkpoint_async``),
    committed by the main process once both ranks have written; the resume from them is still exact.
    ``merged``: each step's micro-batches go through the DiT as one (``train.merge_micro_batches``), so no
    backward runs without gradient sync; compared with the unsharded run that merges them too."""
    plain = request.getfixturevalue("cpu_unsharded_merged" if merged else "cpu_unsharded")
    os.symlink(plain.parent / "cache", tmp_path / "cache")
    switches = {"checkpoint_async": background, "merge_micro_batches": merged}
    sharded = _run(tmp_path, "sharded", "cpu", fsdp=fsdp, **switches)
    _check_sharded_run(tmp_path, sharded, plain, fsdp, "cpu", merge_micro_batches=merged)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize(("fsdp", "compile"), [("shard_grad_op", False), ("full_shard", True)])
def test_fsdp_on_gpus_matches_unsharded_and_resumes(tmp_path: Path, fsdp: str, compile: bool) -> None:
    write_synthetic_cache(str(tmp_path / "cache"), [4] * 16 + [2] * 16, seed=0)
    plain = _run(tmp_path, "plain", "cuda", fsdp="none")
    sharded = _run(tmp_path, "sharded", "cuda", fsdp=fsdp, compile=compile)
    _check_sharded_run(tmp_path, sharded, plain, fsdp, "cuda")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_step_graphs_on_two_gpus_train_like_ddp(tmp_path: Path) -> None:
    """Two GPUs, data parallel, each recording its steps as CUDA graphs (compiled, checkpointed blocks) and
    averaging the gradients after a step's last micro-batch: the losses follow the eager DDP run's within the
    rounding of bf16 autocast."""
    write_synthetic_cache(str(tmp_path / "cache"), [4] * 16 + [2] * 16, seed=0)
    plain = _run(tmp_path, "plain", "cuda", fsdp="none", compile=False, cuda_graphs=False)
    graphs = _run(tmp_path, "graphs", "cuda", fsdp="none", compile=True, cuda_graphs="step")
    settled = yaml.safe_load((graphs / "config.yaml").read_text())["train"]
    assert settled["cuda_graphs"] == "step" and settled["compile"] is True
    assert len(_losses(graphs)) == STEPS
    # bf16 rounds each product's inputs to 8 bits (2^-8 relative); the paths fuse differently
    assert _losses(graphs) == pytest.approx(_losses(plain), rel=2e-2)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_checkpointed_sharded_blocks_on_one_gpu_train_like_eager(tmp_path: Path) -> None:
    """Compile, activation checkpointing and FSDP2 in one run on one GPU: one process shards only with its
    shards in host memory (``train.fsdp_cpu_offload``), so the blocks gather their weights from the host every
    call. The losses follow the eager, unsharded run's within the rounding of bf16 autocast."""
    write_synthetic_cache(str(tmp_path / "cache"), [4] * 8 + [2] * 8, seed=0)
    lone = {"nproc": 1, "video_sync_group": 1, "eval_every": None, "heldout_clips": 0, "validation_every": None}
    plain = _run(tmp_path, "plain", "cuda", fsdp="none", compile=False, **lone)
    sharded = _run(tmp_path, "sharded", "cuda", fsdp="full_shard", fsdp_cpu_offload=True, **lone)
    settled = yaml.safe_load((sharded / "config.yaml").read_text())["train"]
    assert settled["compile"] is True and settled["fsdp"] == "full_shard" and settled["gradient_checkpointing"]
    assert len(_losses(sharded)) == STEPS
    # bf16 rounds each product's inputs to 8 bits (2^-8 relative); the paths fuse differently
    assert _losses(sharded) == pytest.approx(_losses(plain), rel=2e-2)


@pytest.mark.slow
def test_lone_process_resumes_across_fsdp_settings(tmp_path: Path) -> None:
    """One process shards too (a group of one), and a checkpoint resumes under the other ``train.fsdp``:
    the unsharded run's index-keyed optimizer state into the sharded optimizer, and back by name."""
    write_synthetic_cache(str(tmp_path / "cache"), [4] * 8 + [2] * 8, seed=0)
    lone = {"nproc": 1, "video_sync_group": 1, "checkpoint_every": 1}
    plain = _run(tmp_path, "plain", "cpu", fsdp="none", **lone)
    sharded = _run(
        tmp_path,
        "sharded",
        "cpu",
        fsdp="full_shard",
        resume=str(plain / "checkpoints" / "step-000001"),
        **lone,
    )
    back = _run(
        tmp_path, "back", "cpu", fsdp="none", resume=str(sharded / "checkpoints" / "step-000002"), **lone
    )
    assert_rounding_close(_losses(sharded), _losses(plain)[1:], **LOSS_SUMS)
    assert_rounding_close(_losses(back), _losses(plain)[2:], **LOSS_SUMS)
    meta = json.loads((sharded / "checkpoints" / "step-000002" / "optimizer.json").read_text())
    assert not meta["key_is_int"] and "transformer_blocks.0.attn.to_q.weight" in meta["param_keys"]


@pytest.mark.slow
def test_bf16_sharded_blocks_train_like_autocast(tmp_path: Path) -> None:
    """Under bf16 the blocks compute from bf16 gathers (what autocast's casts of the fp32 weights give) and
    reduce in fp32: the losses of the unsharded bf16-autocast run, while the weights stay fp32 masters."""
    write_synthetic_cache(str(tmp_path / "cache"), [4] * 8 + [2] * 8, seed=0)
    lone = {"nproc": 1, "precision": "bf16", "video_sync_group": 1, "lr": 2e-2}
    plain = _run(tmp_path, "plain", "cpu", fsdp="none", **lone)
    sharded = _run(tmp_path, "sharded", "cpu", fsdp="full_shard", **lone)
    # bf16 rounds each product input to 8 bits (2^-8 relative); the loss averages every element's error
    assert _losses(sharded) == pytest.approx(_losses(plain), rel=2**-8)
    weights = _weights(sharded / "checkpoints" / f"step-{STEPS:06d}" / "model")
    assert {t.dtype for t in weights.values()} == {torch.float32}
