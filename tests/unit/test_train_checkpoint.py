"""Checkpoint layout: atomic, never half-picked, pruned, lossless for optimizer and RNG state."""

from __future__ import annotations

import random
import time
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


def _trained(step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    torch.manual_seed(step)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    return net, opt, torch.Generator().manual_seed(5)


def test_background_saver_writes_the_state_of_the_call_while_the_run_goes_on(tmp_path: Path) -> None:
    """The files equal a blocking save's, byte for byte, although the model, optimizer and generator change
    right after ``save`` returns (the write works on its own host copy); the folder is committed once written,
    pruned like the blocking path, and carries no marker files."""
    net, opt, gen = _trained(3)
    blocking = ckpt.save_checkpoint(tmp_path / "a", _payload(3, net, opt, gen), rank=0, is_main=True,
                                    barrier=lambda: None)  # fmt: skip
    saved: list[Path] = []
    saver = ckpt.BackgroundSaver(tmp_path / "b", rank=0, world_size=1, is_main=True, barrier=lambda: None,
                                 keep_last=1, on_saved=saved.append)  # fmt: skip
    path = saver.save(_payload(3, net, opt, gen))
    with torch.no_grad():  # the run goes on: in-place updates of everything the payload referenced
        net.weight.add_(1.0)
    opt.step()
    torch.rand(3, generator=gen)
    saver.wait()
    assert saved == [path] and path == tmp_path / "b" / "step-000003"
    files = sorted(p.relative_to(blocking) for p in blocking.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    for name in files:
        assert (blocking / name).read_bytes() == (path / name).read_bytes(), name
    net2, opt2, gen2 = _trained(4)
    saver.save(_payload(4, net2, opt2, gen2))
    saver.wait()
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path / "b")] == ["step-000004"]  # keep_last=1


def test_background_saver_commits_after_every_rank_has_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks (threads, a shared barrier), rank 1's write held back: the main process commits only once
    rank 1's files are there, and the committed folder holds both ranks' files and no markers."""
    import threading

    barrier = threading.Barrier(2)
    release = threading.Event()
    committed: list[Path] = []
    write_files = ckpt._write_files

    def late_rank_one(tmp: Path, payload: ckpt.CheckpointPayload, rank: int, is_main: bool) -> None:
        if rank == 1:
            release.wait(timeout=30)
        write_files(tmp, payload, rank, is_main)

    monkeypatch.setattr(ckpt, "_write_files", late_rank_one)
    savers = [
        ckpt.BackgroundSaver(
            tmp_path, rank=r, world_size=2, is_main=r == 0, barrier=barrier.wait, on_saved=committed.append
        )
        for r in (0, 1)
    ]

    def save(r: int) -> None:
        savers[r].save(_payload(2, *_trained(2)))

    threads = [threading.Thread(target=save, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    time.sleep(0.3)
    assert not committed and ckpt.find_latest(tmp_path) is None  # the main process waits for rank 1
    release.set()
    savers[1].wait()
    savers[0].wait()
    assert committed == [tmp_path / "step-000002"] and ckpt.find_latest(tmp_path) == committed[0]
    assert sorted(p.name for p in (committed[0] / "ranks").iterdir()) == [
        "rank-00000.json", "rank-00000.safetensors", "rank-00001.json", "rank-00001.safetensors",
    ]  # fmt: skip


def test_background_saver_raises_a_failed_write_on_the_next_call(tmp_path: Path) -> None:
    """A write that fails (here: a state entry safetensors cannot store) is reported by ``wait`` as a CheckpointError,
    and nothing is committed."""
    net, opt, gen = _trained(1)
    saver = ckpt.BackgroundSaver(tmp_path, rank=0, world_size=1, is_main=True, barrier=lambda: None)
    payload = _payload(1, net, opt, gen)
    payload.model_state = {"weight": object()}  # not a tensor: the safetensors write fails in the thread
    saver.save(payload)
    with pytest.raises(CheckpointError, match="writing the checkpoint failed"):
        saver.wait()
    assert ckpt.find_latest(tmp_path) is None
    saver.wait()  # reported once


def test_background_saver_writes_at_once_when_the_host_copy_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Too little free host memory for the copy (twice the state's bytes): the rank's files are written before
    ``save`` returns (the run's later in-place changes cannot reach them), it says so, and the commit follows."""
    net, opt, gen = _trained(5)
    payload = _payload(5, net, opt, gen)
    need = ckpt.tensor_bytes(payload)
    assert need == sum(v.numel() * v.element_size() for v in net.state_dict().values()) + sum(
        t.numel() * t.element_size()
        for entry in opt.state_dict()["state"].values()
        for t in entry.values()
        if isinstance(t, torch.Tensor)
    ) + sum(t.numel() * t.element_size() for t in payload.rank_tensors.values())
    monkeypatch.setattr(ckpt, "available_host_bytes", lambda: 2 * need - 1)
    assert not ckpt.copy_fits(need)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    saver = ckpt.BackgroundSaver(tmp_path, rank=0, world_size=1, is_main=True, barrier=lambda: None)
    path = saver.save(payload)
    with torch.no_grad():
        net.weight.add_(1.0)
    saver.wait()
    assert "do not fit twice in the host's free memory" in capsys.readouterr().out
    loaded = ckpt.load_checkpoint(path, rank=0)
    assert all(torch.equal(loaded.model_state[k], v) for k, v in expected.items())
