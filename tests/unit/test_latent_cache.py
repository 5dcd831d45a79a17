"""The latent cache format: write/read round trip, fingerprint and version checks, safe paths, merges."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from pfctl.data import latent_cache as lc
from pfctl.errors import CacheError


def _header(fingerprint: str = "f" * 16, **preprocessing) -> dict:
    return {
        "format": lc.FORMAT_NAME,
        "format_version": lc.FORMAT_VERSION,
        "fingerprint": fingerprint,
        "provenance": {"vae": {"name": "tiny"}, "preprocessing": {"fps": 24, **preprocessing}},
        "vae": {"name": "pyramid-causal-vae", "normalization": {"rule": "frame0_image_rest_video"}},
        "latent_keys": list(lc.LATENT_KEYS_MEAN_STD),
        "text_keys": list(lc.TEXT_KEYS),
    }


def _tensors(seed: int, t: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "latent_mean": torch.randn(16, t, 6, 8, generator=g).bfloat16(),
        "latent_std": torch.rand(16, t, 6, 8, generator=g).bfloat16(),
        "prompt_embeds": torch.randn(128, 32, generator=g).bfloat16(),
        "prompt_attention_mask": (torch.arange(128) < 5).long(),
        "pooled_prompt_embeds": torch.randn(24, generator=g).bfloat16(),
    }


def _write_cache(root: Path, ids: list[str], header: dict | None = None) -> dict[str, dict]:
    header = header or _header()
    assert lc.prepare_folder(root, header) == "new"
    root.mkdir(parents=True, exist_ok=True)
    writer = lc.LatentCacheWriter(root, header)
    writer.write_header()
    writer.write_null_text({k: v for k, v in _tensors(99).items() if k in lc.TEXT_KEYS})
    data, rows = {}, []
    for i, clip_id in enumerate(ids):
        data[clip_id] = _tensors(i)
        meta = {
            "source": f"{i}.mp4",
            "frame_indices": [0, 1, 2],
            "bucket": "64x48",
            "num_frames": "17",
            "fps": "24",
        }
        rows.append(writer.write(clip_id, data[clip_id], meta))
    writer.write_part(rows, [], {"rank": 0})
    lc.merge_parts(root, 1)
    return data


def test_round_trip(tmp_path: Path) -> None:
    ids = ["b", "a", "dir/clip#1"]
    data = _write_cache(tmp_path / "cache", ids)
    cache = lc.LatentCache.open(tmp_path / "cache")
    assert cache.ids() == sorted(ids) and len(cache) == 3 and "a" in cache
    row = cache.row("dir/clip#1")
    assert (row["num_latent_frames"], row["height"], row["width"], row["latent_channels"]) == (3, 6, 8, 16)
    assert row["bucket"] == "64x48" and row["num_frames"] == 17 and row["has_text"]
    assert row["shapes"]["prompt_embeds"] == [128, 32]
    for clip_id in ids:
        loaded = cache.load(clip_id)
        assert set(loaded) == set(data[clip_id])
        for key, value in data[clip_id].items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)
    meta = cache.metadata("a")
    assert json.loads(meta["frame_indices"]) == [0, 1, 2] and meta["fingerprint"] == cache.fingerprint
    assert meta["id"] == "a" and meta["format_version"] == str(lc.FORMAT_VERSION)
    null = cache.null_text()
    assert set(null) == set(lc.TEXT_KEYS) and null["prompt_embeds"].shape == (128, 32)
    assert cache.vae["normalization"]["rule"] == "frame0_image_rest_video"
    assert cache.latent_keys == lc.LATENT_KEYS_MEAN_STD


def test_clip_paths_stay_inside_and_never_collide(tmp_path: Path) -> None:
    ids = ["../../x", "/etc/passwd", "a/b", "a_b", "A_b", "..", "", "ü ñ", "x" * 500]
    paths = [lc.clip_relpath(i) for i in ids]
    assert len(set(paths)) == len(ids)
    for rel in paths:
        assert rel.startswith("clips/") and ".." not in Path(rel).parts and not Path(rel).is_absolute()
        assert len(Path(rel).name) < 120
    _write_cache(tmp_path / "c", ["../../x", "/abs"])
    assert not (tmp_path / "x.safetensors").exists()
    files = sorted(p.relative_to(tmp_path / "c").as_posix() for p in (tmp_path / "c").rglob("*.safetensors"))
    assert all(f.startswith("clips/") or f == lc.NULL_TEXT_FILE for f in files) and len(files) == 3


def test_tampered_manifest_path_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    _write_cache(root, ["a"])
    rows = [json.loads(line) for line in (root / lc.MANIFEST_FILE).read_text().splitlines()]
    rows[0]["path"] = "../../outside.safetensors"
    (root / lc.MANIFEST_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(CacheError, match="outside the cache folder"):
        lc.LatentCache.open(root)


def test_fingerprint_and_version_mismatch_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    _write_cache(root, ["a"])
    assert lc.prepare_folder(root, _header()) == "resume"
    other = _header("0" * 16, fps=30)
    with pytest.raises(CacheError) as info:
        lc.prepare_folder(root, other)
    assert "preprocessing.fps (24 → 30)" in info.value.message and "--overwrite" in info.value.hint
    assert "--output-dir" in info.value.hint
    assert lc.prepare_folder(root, other, overwrite=True) == "overwrite"
    newer = {**_header(), "format_version": lc.FORMAT_VERSION + 1}
    with pytest.raises(CacheError, match="format_version"):
        lc.prepare_folder(root, newer)
    with pytest.raises(CacheError, match="expected 0000"):
        lc.LatentCache.open(root, fingerprint="0" * 16)
    header = json.loads((root / lc.HEADER_FILE).read_text())
    header["format_version"] = 99
    (root / lc.HEADER_FILE).write_text(json.dumps(header))
    with pytest.raises(CacheError, match="format_version 99"):
        lc.LatentCache.open(root)


def test_foreign_folders_and_unfinished_caches(tmp_path: Path) -> None:
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "thesis.pdf").write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(CacheError, match="not a pfctl latent cache"):
            lc.prepare_folder(tmp_path / "foreign", _header(), overwrite=overwrite)
    with pytest.raises(CacheError, match="does not exist"):
        lc.LatentCache.open(tmp_path / "nope")
    root = tmp_path / "cache"
    _write_cache(root, ["a", "b"])
    (root / lc.MANIFEST_FILE).unlink()
    with pytest.raises(CacheError, match="did not finish") as info:
        lc.LatentCache.open(root)
    assert "resumes" in info.value.hint
    rows = lc.rebuild_manifest(root)
    assert [r["id"] for r in rows] == ["a", "b"] and len(lc.LatentCache.open(root)) == 2
    lc.clear_folder(root)
    assert sorted(p.name for p in root.iterdir()) == []


def test_merge_keeps_old_rows_and_lists_each_clip_once(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    _write_cache(root, ["a", "b"])
    header = lc.read_header(root)
    for rank, ids in enumerate([["b", "c"], ["d"]]):
        writer = lc.LatentCacheWriter(root, header, rank=rank)
        rows = [writer.write(i, _tensors(7), {"bucket": "64x48"}) for i in ids]
        fail = [{"id": f"bad{rank}", "line": rank, "reason": "too_short"}]
        writer.write_part(rows, fail, {"rank": rank, "encoded": len(rows)})
    assert [s["rank"] for s in lc.wait_for_parts(root, 2, timeout_s=1)] == [0, 1]
    rows, failures = lc.merge_parts(root, 2)
    assert [r["id"] for r in rows] == ["a", "b", "c", "d"]
    assert [f["id"] for f in failures] == ["bad0", "bad1"]
    assert not (root / lc.PARTS_DIR).exists()
    assert len((root / lc.FAILURES_FILE).read_text().splitlines()) == 2
    writer = lc.LatentCacheWriter(root, header)
    assert writer.finished_row("c")["num_latent_frames"] == 3 and writer.finished_row("zz") is None
    stale = lc.LatentCacheWriter(root, {**header, "fingerprint": "other"})
    assert stale.finished_row("c") is None  # a clip of another fingerprint is never trusted


def test_wait_for_parts_times_out_naming_ranks(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match=r"ranks \[0, 1\]"):
        lc.wait_for_parts(tmp_path, 2, poll_s=0.01, timeout_s=0.05)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_cache_files_honour_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        _write_cache(tmp_path / "cache", ["a", "b"])
    finally:
        os.umask(old)
    paths = [tmp_path / "cache", *(tmp_path / "cache").rglob("*")]
    assert any(p.suffix == ".safetensors" for p in paths)  # the clip files are among them
    for path in paths:
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == want, path
