"""The fault hook itself, atomic writes under faults, and the error → exit-code mapping (fast)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import typer

from pfctl.cli._common import command_errors
from pfctl.runtime import faults
from pfctl.utils.io import atomic_write_bytes, atomic_write_text


@pytest.fixture
def armed(monkeypatch: pytest.MonkeyPatch):
    def arm(spec: str) -> None:
        monkeypatch.setenv(faults.ENV, spec)
        faults._CACHE.clear()

    yield arm
    faults._CACHE.clear()


def test_no_op_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.fault("train_step", rank=0, step=1)
    assert not faults.poisoned("encode_nan", clip="x") and not faults.active()


def test_matching_by_rank_context_and_after(armed, monkeypatch: pytest.MonkeyPatch) -> None:
    armed("train_step:rank=2:step=3;encode_nan:clip=a#0:after=1")
    monkeypatch.setenv("RANK", "1")
    faults.fault("train_step", step=3)  # other rank: nothing
    monkeypatch.setenv("RANK", "2")
    faults.fault("train_step", step=2)  # other step: nothing
    with pytest.raises(faults.InjectedFault, match=r"'train_step' on rank 2 \(step=3\)"):
        faults.fault("train_step", step=3)
    assert [faults.poisoned("encode_nan", clip="a#0") for _ in range(2)] == [False, True]
    assert not faults.poisoned("encode_nan", clip="b")


def test_malformed_spec_is_loud(armed) -> None:
    armed("train_step:rank")
    with pytest.raises(ValueError, match="bad entry"):
        faults.fault("train_step")


def test_disk_full_mid_write_keeps_the_old_file(armed, tmp_path: Path) -> None:
    target = tmp_path / "manifest.jsonl"
    atomic_write_text(target, "old\n")
    armed("write:path=manifest:error=enospc")
    with pytest.raises(OSError) as info:
        atomic_write_bytes(target, b"x" * 10_000)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["manifest.jsonl"]


@pytest.mark.parametrize(
    ("error", "code", "text"),
    [
        (OSError(errno.ENOSPC, "No space left on device", "/o/clip.safetensors"), 1, "No space left"),
        (OSError(errno.EROFS, "Read-only file system", "/o/cache.json"), 2, "Read-only"),
        (PermissionError(errno.EACCES, "Permission denied", "/o"), 2, "Permission denied"),
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), 1, "collective"),
        (faults.InjectedFault("boom"), 1, "internal error"),
    ],
)
def test_errors_become_one_line_and_an_exit_code(
    error: Exception, code: int, text: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PFCTL_DEBUG", raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(typer.Exit) as info, command_errors():
        raise error
    err = capsys.readouterr().err
    assert info.value.exit_code == code and text in err and "on rank 3" in err
    assert "Traceback" not in err


def test_torn_log_line_is_dropped_on_resume() -> None:
    from pfctl.training.logs import log_step as _log_step

    lines = [json.dumps({"step": 1}), json.dumps({"step": 2}), '{"step": 3, "lo']
    assert [ln for ln in lines if _log_step(ln) <= 2] == lines[:2]


def test_pruning_never_leaves_a_complete_looking_half(tmp_path: Path) -> None:
    from pfctl.training.checkpoint import list_checkpoints, prune_checkpoints

    for step in (1, 2, 3):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "train_state.json").write_text("{}")
    (tmp_path / ".tmp-deleting-step-000000").mkdir()  # left by a kill during an earlier prune
    prune_checkpoints(tmp_path, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3] and sorted(os.listdir(tmp_path)) == [
        "step-000003"
    ]
