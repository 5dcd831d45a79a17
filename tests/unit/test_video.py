"""Decoding: fps resampling, clip extraction, 8k+1 snapping, buckets, crop, [-1, 1], bad-file reasons."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pfctl.data.annotations import Item
from pfctl.data.buckets import Bucket, cover_size, nearest_bucket
from pfctl.data.synthetic import frame_index, index_frames, write_bad_media, write_video
from pfctl.data.video import (
    REASONS,
    FrameContract,
    FrameSettings,
    MediaError,
    VideoInfo,
    clip_starts,
    decode_item,
    open_video,
    plan_clips,
    resample_indices,
    resize_cover_crop,
    to_model_input,
)

BUCKETS = (Bucket(64, 48), Bucket(48, 64))


@pytest.fixture(scope="session")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small real H.264 files: 2 s at 30 fps whose frames encode their index, a portrait clip, bad files."""
    root = tmp_path_factory.mktemp("video-media")
    write_video(root / "idx30.mp4", index_frames(60, 64, 64), fps=30)
    write_video(root / "portrait.mp4", index_frames(20, 64, 48), fps=24)
    write_video(root / "wide.mp4", index_frames(12, 48, 128), fps=24)
    write_bad_media(root / "bad", root / "idx30.mp4")
    return root


@pytest.fixture(scope="session")
def contract() -> FrameContract:
    """The causal VAE's 1 + 8k contract (tests/integration checks it equals the adapter's table)."""
    return FrameContract.one_plus_multiple(8, 300)


def _item(path: Path, **kw) -> Item:
    return Item(id=kw.pop("id", path.stem), kind="video", path=path, text="t", line=1, source=path.name, **kw)


def _settings(contract: FrameContract, **kw) -> FrameSettings:
    return FrameSettings(contract=contract, buckets=BUCKETS, **{"num_frames": 17, "fps": 24.0, **kw})


# ------------------------------------------------------------------------------------ pure logic


def test_resample_indices_follow_the_target_timeline() -> None:
    # 30 → 24 fps: output frame j shows source frame floor(j * 30 / 24); 2 s stays 2 s
    idx = resample_indices(60, 30.0, 24.0)
    assert len(idx) == 48
    assert idx[:9] == [0, 1, 2, 3, 5, 6, 7, 8, 10]
    assert all(i == int(j * 1.25) for j, i in enumerate(idx))
    assert resample_indices(48, 24.0, 24.0) == list(range(48))
    assert resample_indices(10, 24.0, None) == list(range(10))
    assert resample_indices(5, 12.0, 24.0) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # upsampling repeats
    assert resample_indices(60, 60.0, 24.0)[:5] == [0, 2, 5, 7, 10]
    assert resample_indices(0, 30.0, 24.0) == []


def test_frame_contract_snaps_to_8k_plus_1(contract: FrameContract) -> None:
    assert [contract.snap(n) for n in (0, 1, 8, 9, 16, 17, 120, 121, 122)] == [
        0,
        1,
        1,
        9,
        9,
        17,
        113,
        121,
        121,
    ]
    assert contract.snap(10_000) == 297  # beyond the table: its last entry

    class Vae4:  # any adapter's valid_num_frames works, e.g. a 1 + 4k contract
        def valid_num_frames(self, n: int) -> int:
            return 0 if n < 1 else 1 + (n - 1) // 4 * 4

    assert FrameContract.from_vae(Vae4(), 12).table == (0, 1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9)


def test_clip_starts_modes() -> None:
    assert clip_starts(48, 17, "head", 3) == [0]
    assert clip_starts(48, 17, "uniform", 3) == [0, 16, 31]
    assert clip_starts(17, 17, "uniform", 3) == [0]  # no room: one clip, not three copies
    assert clip_starts(16, 17, "head", 1) == []


def test_plan_clips_head_uniform_full_and_too_short(contract: FrameContract, tmp_path: Path) -> None:
    info = VideoInfo(num_frames=60, fps=30.0, width=1920, height=1080)
    item = _item(tmp_path / "v.mp4")
    (head,) = plan_clips(item, info, _settings(contract, num_frames=20))
    assert head.num_frames == 17 and head.bucket == Bucket(64, 48) and head.fps == 24.0
    assert head.frame_indices == tuple(int(j * 1.25) for j in range(17)) and head.clip_id == "v"
    clips = plan_clips(item, info, _settings(contract, clip_mode="uniform", clips_per_video=3))
    assert [c.clip_id for c in clips] == ["v#0", "v#1", "v#2"]
    assert [c.frame_indices[0] for c in clips] == [0, 20, 38]  # starts 0, 16, 31 on the 24 fps timeline
    (full,) = plan_clips(item, info, _settings(contract, clip_mode="full", max_frames=300))
    assert full.num_frames == 41  # 48 frames at 24 fps, snapped to 8k+1
    (capped,) = plan_clips(item, info, _settings(contract, clip_mode="full", max_frames=30))
    assert capped.num_frames == 25
    with pytest.raises(MediaError) as info_err:
        plan_clips(item, info, _settings(contract, num_frames=49))
    assert info_err.value.reason == "too_short" and "48 frames at 24 fps" in info_err.value.detail
    listed = _item(tmp_path / "v.mp4", frames=tuple(range(0, 40, 2)))
    (explicit,) = plan_clips(listed, info, _settings(contract))
    assert explicit.frame_indices == tuple(range(0, 34, 2)) and explicit.fps == 30.0  # 20 listed → 17
    with pytest.raises(MediaError, match="lists frame 99"):
        plan_clips(_item(tmp_path / "v.mp4", frames=(1, 99)), info, _settings(contract))


def test_bucket_choice_and_cover_crop() -> None:
    buckets = [Bucket(640, 384), Bucket(384, 640), Bucket(512, 512)]
    assert nearest_bucket(1920, 1080, buckets) == Bucket(640, 384)
    assert nearest_bucket(1080, 1920, buckets) == Bucket(384, 640)
    assert nearest_bucket(500, 490, buckets) == Bucket(512, 512)
    assert nearest_bucket(100, 100, buckets[:2]) == Bucket(640, 384)  # tie → first listed
    assert cover_size(1920, 1080, Bucket(640, 384)) == (683, 384)
    assert cover_size(1000, 1000, Bucket(640, 384)) == (640, 640)
    # a frame whose columns encode x: after an exact-size crop the centre columns remain
    frame = torch.arange(100, dtype=torch.uint8).repeat(40, 1)[None, :, :, None].expand(1, 40, 100, 3)
    out = resize_cover_crop(frame.contiguous(), Bucket(40, 40))
    assert out.shape == (1, 40, 40, 3) and out[0, 0, 0, 0] == 30 and out[0, 0, -1, 0] == 69
    down = resize_cover_crop(torch.full((2, 96, 160, 3), 200, dtype=torch.uint8), Bucket(40, 32))
    assert down.shape == (2, 32, 40, 3) and bool((down == 200).all())


def test_to_model_input_range_and_layout() -> None:
    frames = torch.tensor([0, 255, 128], dtype=torch.uint8).view(3, 1, 1, 1).expand(3, 2, 2, 3)
    x = to_model_input(frames.contiguous())
    assert x.shape == (3, 3, 2, 2) and x.dtype == torch.float32
    assert x.min() == -1.0 and x.max() == 1.0 and abs(float(x[0, 2, 0, 0]) - 0.00392) < 1e-4


# ----------------------------------------------------------------------------------- real files


def test_decode_resamples_to_the_right_source_frames(media: Path, contract: FrameContract) -> None:
    decoded = decode_item(_item(media / "idx30.mp4"), _settings(contract, num_frames=33))
    assert decoded.failure is None
    (plan,), (frames,) = decoded.plans, decoded.frames
    assert frames.shape == (33, 48, 64, 3) and frames.dtype == torch.uint8
    got = [frame_index(f.numpy()) for f in frames]
    assert got == [int(j * 30 / 24) for j in range(33)] == list(plan.frame_indices)


def test_decode_uniform_clips_and_skip_cached(media: Path, contract: FrameContract) -> None:
    settings = _settings(contract, clip_mode="uniform", clips_per_video=2, fps=None)
    decoded = decode_item(_item(media / "idx30.mp4"), settings, skip=frozenset({"idx30#0"}))
    assert [p.clip_id for p in decoded.plans] == ["idx30#1"] and decoded.skipped == ["idx30#0"]
    assert [frame_index(f.numpy()) for f in decoded.frames[0]] == list(range(43, 60))


def test_portrait_goes_to_portrait_bucket(media: Path, contract: FrameContract) -> None:
    decoded = decode_item(_item(media / "portrait.mp4"), _settings(contract))
    assert decoded.plans[0].bucket == Bucket(48, 64) and decoded.frames[0].shape == (17, 64, 48, 3)
    assert [frame_index(f.numpy()) for f in decoded.frames[0]] == list(range(17))


def test_reader_falls_back_to_pyav_where_decord_missizes(media: Path) -> None:
    """decord 0.6 returns wrongly shaped frames for 48-pixel-wide H.264; PyAV takes over."""
    reader = open_video(media / "portrait.mp4")
    assert (reader.width, reader.height, len(reader), reader.fps) == (48, 64, 20, 24.0)
    frames = reader.get_frames([0, 5, 19])
    assert frames.shape == (3, 64, 48, 3) and [frame_index(f) for f in frames] == [0, 5, 19]
    assert reader.get_frames([2])[0].mean() == pytest.approx(8, abs=2)  # going back re-opens
    reader.close()


def test_bad_files_get_reasons(media: Path, contract: FrameContract) -> None:
    expected = {
        "zero.mp4": "empty_file",
        "notes.mp4": "not_a_video",
        "cut.mp4": "truncated",
        "sound.mp4": "audio_only",
        "dir.mp4": "unreadable",
        "missing.mp4": "missing",
    }
    for name, reason in expected.items():
        decoded = decode_item(_item(media / "bad" / name), _settings(contract))
        assert decoded.failure is not None and decoded.failure.reason == reason, (name, decoded.failure)
        assert reason in REASONS and not decoded.frames
    short = decode_item(_item(media / "wide.mp4"), _settings(contract))
    assert short.failure.reason == "too_short" and "needs 17" in short.failure.detail
    huge = decode_item(_item(media / "portrait.mp4"), _settings(contract, max_source_pixels=64 * 47))
    assert huge.failure.reason == "resolution_too_large" and "48x64" in huge.failure.detail


def test_images_are_single_frame_clips(tmp_path: Path, contract: FrameContract) -> None:
    from PIL import Image

    Image.fromarray(np.full((30, 80, 3), 77, dtype=np.uint8)).save(tmp_path / "pic.png")
    item = Item(id="pic", kind="image", path=tmp_path / "pic.png", text="t", line=1, source="pic.png")
    decoded = decode_item(item, _settings(contract))
    assert decoded.failure is None and decoded.plans[0].frame_indices == (0,)
    assert decoded.frames[0].shape == (1, 48, 64, 3) and int(decoded.frames[0].float().mean().round()) == 77
    (tmp_path / "bad.png").write_text("nope")
    bad = Item(id="bad", kind="image", path=tmp_path / "bad.png", text="t", line=1, source="bad.png")
    assert decode_item(bad, _settings(contract)).failure.reason == "not_a_video"
