"""mp4 writing (PyAV) read back with decord, image loading and the i2v image preprocessing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from pfctl.errors import InputError
from pfctl.sampling import video_io
from pfctl.sampling.video_io import (
    frames_to_uint8,
    image_to_tensor,
    load_image,
    probe_video,
    resize_cover_center_crop,
    write_video,
    write_video_unique,
)


def smooth_frames(t: int = 17, h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    """Smooth moving gradients: compress well, so decoded pixels stay close to the input."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    frames = np.empty((t, h, w, 3), dtype=np.uint8)
    for i in range(t):
        for c in range(3):
            frames[i, :, :, c] = 127.5 + 100 * np.sin(xx / 20.0 + yy / 30.0 + 0.2 * i + phase[c])
    return frames


def read_back(path: Path) -> tuple[np.ndarray, float]:
    import decord

    reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
    return reader.get_batch(list(range(len(reader)))).asnumpy(), reader.get_avg_fps()


@pytest.mark.parametrize("fps", [24, 30, 8])
def test_write_video_frame_count_size_fps(tmp_path, fps):
    frames = smooth_frames()
    path = write_video(tmp_path / "v.mp4", frames, fps)
    decoded, got_fps = read_back(path)
    assert decoded.shape == frames.shape
    assert got_fps == pytest.approx(fps, rel=1e-3)
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 4.0  # crf 18 on smooth content
    info = probe_video(path)
    assert (info.num_frames, info.width, info.height) == (17, 64, 48)
    assert info.codec == "h264" and info.pix_fmt == "yuv420p"


def test_write_video_accepts_torch_and_fractional_fps(tmp_path):
    frames = torch.from_numpy(smooth_frames(t=9))
    path = write_video(tmp_path / "v.mp4", frames, 24000 / 1001)
    assert probe_video(path).fps == pytest.approx(23.976, abs=1e-3)


def test_write_video_is_byte_reproducible(tmp_path):
    frames = smooth_frames(seed=3)
    digests = {
        hashlib.sha256(write_video(tmp_path / f"{i}.mp4", frames, 24).read_bytes()).hexdigest()
        for i in range(3)
    }
    assert len(digests) == 1


@pytest.mark.parametrize(
    "frames, match",
    [
        (np.zeros((4, 16, 16, 3), dtype=np.float32), "uint8"),
        (np.zeros((4, 16, 16), dtype=np.uint8), r"\(T, H, W, 3\)"),
        (np.zeros((0, 16, 16, 3), dtype=np.uint8), "0 frames"),
        (np.zeros((4, 15, 16, 3), dtype=np.uint8), "even"),
    ],
)
def test_write_video_refuses_bad_frames_and_leaves_nothing(tmp_path, frames, match):
    with pytest.raises(ValueError, match=match):
        write_video(tmp_path / "v.mp4", frames, 24)
    assert list(tmp_path.iterdir()) == []


def test_write_video_no_overwrite_and_unique_names(tmp_path):
    frames = smooth_frames(t=9)
    first = write_video(tmp_path / "v.mp4", frames, 24)
    before = first.read_bytes()
    with pytest.raises(FileExistsError):
        write_video(tmp_path / "v.mp4", smooth_frames(t=9, seed=5), 24, overwrite=False)
    assert first.read_bytes() == before
    names = [write_video_unique(tmp_path / "v.mp4", frames, 24).name for _ in range(2)]
    assert names == ["v-1.mp4", "v-2.mp4"]
    (tmp_path / "v-3.json").write_text("{}")  # a companion file vetoes its name
    vetoed = write_video_unique(
        tmp_path / "v.mp4", frames, 24, taken=lambda p: p.with_suffix(".json").exists()
    )
    assert vetoed.name == "v-4.mp4"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp files left


def test_frames_to_uint8_truncates_like_the_reference_and_copies():
    video = (
        torch.tensor([-1.5, -1.0, 0.0, 0.0039, 0.5, 1.0, 2.0]).reshape(1, 1, 7, 1, 1).expand(1, 3, 7, 1, 1)
    )
    before = video.clone()
    out = frames_to_uint8(video)
    assert out.shape == (1, 7, 1, 1, 3) and out.dtype == torch.uint8
    expected = (before * 127.5 + 127.5).clamp(0, 255).byte().permute(0, 2, 3, 4, 1)
    assert torch.equal(out, expected)
    assert out[0, :, 0, 0, 0].tolist() == [0, 0, 127, 127, 191, 255, 255]
    assert torch.equal(video, before)


# -- images --------------------------------------------------------------------------------------


def _png(path: Path, array: np.ndarray) -> Path:
    from PIL import Image

    Image.fromarray(array).save(path)
    return path


def test_load_image_pil_and_pyav_agree(tmp_path, monkeypatch):
    array = (np.random.default_rng(0).random((20, 30, 3)) * 255).astype(np.uint8)
    path = _png(tmp_path / "a.png", array)
    assert np.array_equal(load_image(path), array)
    monkeypatch.setattr(video_io, "_pil_available", lambda: False)
    assert np.array_equal(load_image(path), array)


def test_load_image_flattens_alpha(tmp_path):
    from PIL import Image

    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[..., 3] = 255
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "a.png")
    out = load_image(tmp_path / "a.png")
    assert out.shape == (8, 8, 3) and int(out[0, 0, 0]) == 200


@pytest.mark.parametrize("content", [None, b"not an image at all", b""])
def test_load_image_errors_are_input_errors(tmp_path, content):
    path = tmp_path / "bad.png"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=str(path.name)):
        load_image(path)


def test_resize_cover_center_crop_identity_and_cover():
    square = (np.random.default_rng(1).random((64, 64, 3)) * 255).astype(np.uint8)
    assert np.array_equal(resize_cover_center_crop(square, 64, 64), square)
    # 128x64 (W x H) with three vertical bands: covering 64x64 scales by 1 and keeps the middle band.
    wide = np.zeros((64, 128, 3), dtype=np.uint8)
    wide[:, :32] = (255, 0, 0)
    wide[:, 32:96] = (0, 255, 0)
    wide[:, 96:] = (0, 0, 255)
    out = resize_cover_center_crop(wide, 64, 64)
    assert out.shape == (64, 64, 3)
    assert (out[..., 1] == 255).all() and (out[..., 0] == 0).all()
    # upscaling a small portrait image to a landscape box: covers, no borders
    tall = np.full((40, 20, 3), 77, dtype=np.uint8)
    out = resize_cover_center_crop(tall, 64, 32)
    assert out.shape == (32, 64, 3) and (out == 77).all()


def test_resize_matches_the_reference_app_rule():
    """scale = max(Wt/W, Ht/H); size rounded; LANCZOS; centred box with edges rounded half-to-even."""
    from PIL import Image

    array = (np.random.default_rng(2).random((45, 101, 3)) * 255).astype(np.uint8)
    width, height = 64, 64
    img = Image.fromarray(array)
    scale = max(width / img.width, height / img.height)
    rw, rh = round(img.width * scale), round(img.height * scale)
    img = img.resize((rw, rh), resample=Image.LANCZOS)
    box = ((rw - width) / 2, (rh - height) / 2, (rw + width) / 2, (rh + height) / 2)
    expected = np.asarray(img.crop(box))
    assert np.array_equal(resize_cover_center_crop(array, width, height), expected)


def test_image_to_tensor_is_totensor_then_normalize():
    array = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3) * 3
    x = image_to_tensor(array)
    assert x.shape == (1, 3, 1, 4, 6) and x.dtype == torch.float32
    expected = (torch.from_numpy(array).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    assert torch.equal(x[0, :, 0], expected)
    assert x.min() >= -1 and x.max() <= 1
