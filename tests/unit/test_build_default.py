"""build_default's fine-tune data: the cache view that lists some colours' clips more often."""

from __future__ import annotations

import json
from pathlib import Path

from pfctl.data.dataset import write_synthetic_cache
from pfctl.demo.build_default import weighted_cache_view
from pfctl.training.data import cache_clips, open_cache


def test_weighted_cache_view_repeats_the_weighted_colours_clips(tmp_path: Path) -> None:
    """Each green clip three times, each blue one twice, the rest once: every copy an entry of its own id over
    the same clip file, the files linked into the view (no link out of it, which the cache refuses), the
    source cache untouched, and the view opens as a cache whose clips load like the source's."""
    cache = tmp_path / "cache"
    write_synthetic_cache(str(cache), [2, 2, 2, 2], seed=0)
    ids = [json.loads(line)["id"] for line in (cache / "manifest.jsonl").read_text().splitlines()]
    colours = dict(zip(ids, ["green", "blue", "red", "yellow"], strict=True))
    annotations = tmp_path / "annotations.jsonl"
    annotations.write_text("".join(json.dumps({"id": i, "color": c}) + "\n" for i, c in colours.items()))
    before = (cache / "manifest.jsonl").read_text()

    rows = weighted_cache_view(cache, annotations, tmp_path / "view", {"green": 3, "blue": 2})

    assert rows == 3 + 2 + 1 + 1
    assert (cache / "manifest.jsonl").read_text() == before
    view = open_cache(str(tmp_path / "view"))
    got = [c.id for c in cache_clips(view)]
    green, blue = ids[0], ids[1]
    assert sorted(got) == sorted([green, f"{green}-x2", f"{green}-x3", blue, f"{blue}-x2", ids[2], ids[3]])
    entries = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "view" / "manifest.jsonl").read_text().splitlines()}
    assert entries[f"{green}-x3"]["path"] == entries[green]["path"]
    assert not any(p.is_symlink() for p in (tmp_path / "view").rglob("*"))
    source = open_cache(str(cache))
    for key, value in source.load(green).items():
        if hasattr(value, "shape"):
            assert (view.load(f"{green}-x2")[key] == value).all(), key
