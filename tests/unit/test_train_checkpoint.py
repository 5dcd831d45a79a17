"""Checkpoint layout: atomic, never half-picked, pruned, lossless for optimizer and RNG state."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pfctl.errors import CheckpointError
from pfctl.training import checkpoint as ckpt


def _payload(step: int, net: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator):
    tensors, meta = ckpt.rng_state(gen)
    return ckpt.CheckpointPayload(
        step=step,
        train_state={"world_size": 1},
        rank_state={"micro_step": step, "rng": meta},
        rank_tensors=tensors,
        model=net,
        model_state=net.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state={"last_epoch": step},
    )


def _save(root: Path, step: int, keep_last=None):
    torch.manual_seed(step)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    gen = torch.Generator().manual_seed(5)
    payload = _payload(step, net, opt, gen)
    path = ckpt.save_checkpoint(
        root, payload, rank=0, is_main=True, barrier=lambda: None, keep_last=keep_last
    )
    return path, net, opt, gen


def test_roundtrip_is_lossless(tmp_path: Path) -> None:
    path, net, opt, gen = _save(tmp_path, 3)
    assert path.name == "step-000003" and (path / "train_state.json").is_file()
    loaded = ckpt.load_checkpoint(path, rank=0)
    for k, v in net.state_dict().items():
        assert torch.equal(loaded.model_state[k], v)
    # RNG: restoring gives the same next draws for python, numpy, torch and the noise generator
    expect = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=gen))
    gen2 = torch.Generator().manual_seed(99)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    ckpt.restore_rng_state(loaded.rank_tensors, loaded.rank_state["rng"], gen2)
    got = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=gen2))
    assert got[0] == expect[0] and got[1] == expect[1]
    assert torch.equal(got[2], expect[2]) and torch.equal(got[3], expect[3])
    new_opt = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    new_opt.load_state_dict(loaded.optimizer_state)
    for a, b in zip(opt.state_dict()["state"].values(), new_opt.state_dict()["state"].values(), strict=False):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_half_written_checkpoints_are_never_latest(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    # a run killed while saving step 4: its temp folder, and a step folder without the commit marker
    (tmp_path / ".tmp-step-000004" / "model").mkdir(parents=True)
    (tmp_path / "step-000005" / "model").mkdir(parents=True)
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-000002"
    assert ckpt.resolve_resume("latest", tmp_path) == tmp_path / "step-000002"
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.resolve_resume(str(tmp_path / "step-000005"), tmp_path)
    assert ckpt.resolve_resume(None, tmp_path) is None
    assert ckpt.resolve_resume("latest", tmp_path / "nothing") is None


def test_keep_last_prunes_old_and_stale(tmp_path: Path) -> None:
    (tmp_path / ".tmp-step-000001").mkdir(parents=True)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_missing_rank_state_names_the_layout(tmp_path: Path) -> None:
    path, *_ = _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="no state for rank 3"):
        ckpt.load_checkpoint(path, rank=3)
