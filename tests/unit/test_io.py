"""pfctl.utils.io.replace_dir: the one way exports, LoRA adapters and the embedded model are swapped in."""

from __future__ import annotations

from pathlib import Path

from pfctl.utils.io import replace_dir


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
