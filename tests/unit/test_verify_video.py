"""verify-groupnorm reads videos exactly as encode-latents does (one reader, one fps resampler)."""

from __future__ import annotations

import pytest

from pfctl.data.synthetic import frame_index, index_frames, moving_frames, write_video
from pfctl.data.video import resample_indices
from pfctl.errors import InputError
from pfctl.verify.synthetic import load_clip

pytest.importorskip("decord")
pytest.importorskip("av")
pytestmark = pytest.mark.slow  # real videos, written and decoded


def test_odd_width_video_loads(tmp_path):
    """decord mis-sizes 72x48 frames (a copy error); encode-latents' reader falls back to PyAV."""
    path = write_video(tmp_path / "small.mp4", moving_frames(20, 48, 72), fps=25)
    clip = load_clip(path, 17, 16, 16)
    assert tuple(clip.video.shape) == (1, 3, 17, 16, 16)
    assert float(clip.video.min()) >= -1 and float(clip.video.max()) <= 1


def test_fps_resampling_takes_the_frames_encode_latents_takes(tmp_path):
    """120 frames at 29.97 fps give 97 frames at 24 fps on encode-latents' timeline (floor, not round)."""
    path = write_video(tmp_path / "ntsc.mp4", index_frames(120, 16, 16), fps=29.97)
    clip = load_clip(path, 97, 16, 16, fps=24)
    expected = resample_indices(120, 30000 / 1001, 24)[:97]
    assert len(expected) == 97 and clip.fps == 24
    frames = ((clip.video[0].permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy()
    got = [frame_index(f) for f in frames]
    assert got == [i % 64 for i in expected]  # the gray level encodes the index mod 64


def test_too_few_frames_is_a_clear_input_error(tmp_path):
    path = write_video(tmp_path / "short.mp4", moving_frames(10, 16, 16), fps=25)
    with pytest.raises(InputError, match="only 10 of 17"):
        load_clip(path, 17, 16, 16)
