"""Synthetic H.264 videos (PyAV) for tests, benchmarks and demos — no downloads, no system ffmpeg.

:func:`index_frames` makes frames whose brightness encodes their index, so a test can tell
exactly which source frame a decoder (and the fps resampler) returned.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def index_frames(num_frames: int, height: int, width: int, step: int = 4) -> np.ndarray:
    """uint8 (N, H, W, 3): frame i is flat gray ``(step·i) mod 256`` — readable after lossy coding."""
    levels = (np.arange(num_frames) * step) % 256
    return np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).astype(np.uint8)


def frame_index(frame: np.ndarray, step: int = 4) -> int:
    """Inverse of :func:`index_frames` for a decoded (H, W, 3) frame (mod 256/step)."""
    return round(float(frame.astype(np.float64).mean()) / step)


def moving_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 (N, H, W, 3): a textured background with a moving square (realistic-ish codec load)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    background = np.kron(base, np.ones((8, 8, 1), dtype=np.uint8))[:height, :width]
    frames = np.repeat(background[None], num_frames, axis=0)
    side = max(4, min(height, width) // 4)
    for i in range(num_frames):
        x = (i * 4) % max(1, width - side)
        y = (i * 2) % max(1, height - side)
        frames[i, y : y + side, x : x + side] = (255, 32, 32)
    return frames


def write_video(
    path: str | os.PathLike[str],
    frames: np.ndarray,
    fps: float = 24.0,
    *,
    crf: int = 12,
    faststart: bool = False,
) -> Path:
    """Write uint8 (N, H, W, 3) RGB frames as H.264 / yuv420p MP4 (H and W must be even)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n, height, width, _ = frames.shape
    options = {"movflags": "+faststart"} if faststart else {}
    from fractions import Fraction

    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "ultrafast", "tune": "zerolatency"}
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_audio_only(path: str | os.PathLike[str], seconds: float = 0.5, rate: int = 16000) -> Path:
    """An MP4 with one AAC audio stream and no video (a valid media file that is not a video)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "mono"
        samples, frame_len = int(seconds * rate), 1024
        for i, start in enumerate(range(0, samples, frame_len)):
            t = np.arange(start, start + frame_len) / rate
            wave = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]
            frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, i * frame_len
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_bad_media(folder: str | os.PathLike[str], good: str | os.PathLike[str]) -> dict[str, str]:
    """A corpus of broken inputs next to a good video ``good``; returns {file name: expected reason}.

    zero-byte, plain text named .mp4, the first 40% of ``good`` (moov atom cut off), audio only,
    and a folder named like a video (unreadable as a file).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = Path(good).read_bytes()
    (folder / "zero.mp4").write_bytes(b"")
    (folder / "notes.mp4").write_text("this is not a video\n")
    (folder / "cut.mp4").write_bytes(data[: int(len(data) * 0.4)])
    write_audio_only(folder / "sound.mp4")
    (folder / "dir.mp4").mkdir(exist_ok=True)
    return {
        "zero.mp4": "empty_file",
        "notes.mp4": "not_a_video",
        "cut.mp4": "truncated",
        "sound.mp4": "audio_only",
        "dir.mp4": "unreadable",
    }
