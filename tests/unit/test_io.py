"""pfctl.utils.io.replace_dir: the one way exports, LoRA adapters and the embedded model are swapped in."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from pfctl.utils.io import (
    atomic_save_safetensors,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    current_umask,
    replace_dir,
)


def _folder(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "weights.txt").write_text(text)
    return path


def test_replace_dir_creates_and_replaces_without_leftovers(tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert replace_dir(_folder(tmp_path / ".staging-1", "first"), out) == out
    assert (out / "weights.txt").read_text() == "first"

    (out / "stale.txt").write_text("from the old run")
    replace_dir(_folder(tmp_path / ".staging-2", "second"), out)
    assert sorted(p.name for p in out.iterdir()) == ["weights.txt"]  # nothing of the old folder survives
    assert (out / "weights.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # staging moved, old copy deleted


# -- permissions: what we write honours the umask, as a plain open() / mkdir would -------------


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request: pytest.FixtureRequest):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    """``relative path → permission bits`` of ``root`` and everything under it."""
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def _expect(root: Path, umask: int) -> dict[str, int]:
    return {rel: (0o777 if (root / rel).is_dir() else 0o666) & ~umask for rel in _modes(root)}


def test_current_umask_reads_without_changing_it(umask: int) -> None:
    assert current_umask() == umask
    assert os.umask(umask) == umask  # unchanged by the read


def test_atomic_files_get_the_plain_open_mode(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "out"  # pytest's tmp_path is 0700
    root.mkdir()
    with open(root / "plain.txt", "w") as fh:
        fh.write("x")
    atomic_write_bytes(root / "a.bin", b"x")
    atomic_write_json(root / "sub" / "b.json", {"a": 1})
    atomic_save_safetensors({"w": torch.zeros(2)}, root / "c.safetensors")
    modes = _modes(root)
    assert modes["plain.txt"] == 0o666 & ~umask
    assert modes == _expect(root, umask)


def test_replaced_folders_get_the_plain_mkdir_mode(tmp_path: Path, umask: int) -> None:
    staging = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700 whatever the umask
    atomic_write_text(staging / "weights.txt", "w")
    out = replace_dir(staging, tmp_path / "export")
    assert _modes(out) == _expect(out, umask)


def test_export_and_checkpoint_honour_the_umask(tmp_path: Path, umask: int) -> None:
    from helpers.tiny_models import tiny_dit
    from pfctl.models.checkpoint import save_export
    from pfctl.training import checkpoint as ckpt

    export = save_export(tmp_path / "export", tiny_dit("tiny", seed=0), base_model_path=None, config_yaml="a: 1\n")
    assert _modes(export) == _expect(export, umask)

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    tensors, meta = ckpt.rng_state(torch.Generator().manual_seed(0))
    payload = ckpt.CheckpointPayload(
        step=1,
        train_state={"world_size": 1},
        rank_state={"micro_step": 1, "rng": meta},
        rank_tensors=tensors,
        model=net,
        model_state=net.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state={"last_epoch": 1},
    )
    root = tmp_path / "checkpoints"
    step = ckpt.save_checkpoint(root, payload, rank=0, is_main=True, barrier=lambda: None)
    assert _modes(root) == _expect(root, umask)
    assert step.is_dir() and len(_modes(step)) > 4  # model, optimizer, rank state, marker


def test_log_and_warn_print_brackets_as_written(capsys) -> None:
    """Error texts carry brackets (gloo: ``[/path/pair.cc:553]``, rich-markup look-alikes): printed verbatim."""
    from pfctl.runtime import logging as pflog

    pflog.log("gloo said [/__w/gloo/pair.cc:553] and [/closing] [bold]x[/bold]")
    pflog.warn("a [red]tag[/red] and [/oops]")
    out = capsys.readouterr().out
    assert "[/__w/gloo/pair.cc:553] and [/closing] [bold]x[/bold]" in out
    assert "warning: a [red]tag[/red] and [/oops]" in out
