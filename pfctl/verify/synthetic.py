"""Inputs for verify-groupnorm: a built-in synthetic clip, or a real video read with decord.

The synthetic clip is built to stress per-chunk statistics: GroupNorm statistics that change over time
are what make chunked statistics differ from whole-clip ones, and a fade plus a hard cut change them most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pfctl.errors import InputError


@dataclass
class Clip:
    """A (1, 3, T, H, W) clip in [-1, 1] and what it contains."""

    video: torch.Tensor
    source: str
    fps: float
    description: str
    events: dict[str, object] = field(default_factory=dict)


def synthetic_clip(num_frames: int, height: int, width: int, *, fps: float = 8.0, seed: int = 0) -> Clip:
    """Moving coloured gratings that fade in from black over the first third, then a hard cut
    (a different scene: other colours, other texture, brighter) at 60 % of the clip.

    The cut is placed off the usual 8-frame chunk grid on purpose, so it falls inside a chunk.
    """
    T, H, W = num_frames, height, width
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=torch.float32).view(T, 1, 1)
    yy = torch.linspace(-1, 1, H).view(1, H, 1)
    xx = torch.linspace(-1, 1, W).view(1, 1, W)
    fade_end = max(1, T // 3)
    cut = min(T - 1, max(1, round(0.6 * T) | 1))
    phase = torch.rand(6, generator=g) * 2 * math.pi

    def scene(freq: float, speed: float, colors: torch.Tensor, offset: float) -> torch.Tensor:
        chans = []
        for c in range(3):
            wave = torch.sin(freq * (xx * math.cos(c) + yy * math.sin(c)) * math.pi + speed * t + phase[c])
            chans.append(offset + colors[c] * wave)
        return torch.stack(chans, dim=0)  # (3, T, H, W)

    a = scene(2.0, 0.35, torch.tensor([0.6, 0.4, 0.5]), -0.1)
    b = scene(5.0, -0.6, torch.tensor([0.3, 0.7, 0.2]), 0.35)
    fade = (t.view(1, T, 1, 1) / fade_end).clamp(max=1.0)
    a = -1.0 + fade * (a + 1.0)  # fade in from black (-1)
    video = torch.where((t.view(1, T, 1, 1) >= cut), b, a)
    video = video + 0.02 * torch.randn(video.shape, generator=g)
    return Clip(
        video=video.clamp(-1, 1).unsqueeze(0),
        source="synthetic",
        fps=fps,
        description=f"synthetic: fade-in frames 0-{fade_end}, hard cut at frame {cut}",
        events={"fade": [0, fade_end], "cut": cut},
    )


def _resize(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(T, 3, h, w) float → center-cropped to the target aspect, then area/bilinear resized."""
    _, _, h, w = frames.shape
    target = width / height
    if w / h > target:
        new_w = round(h * target)
        x0 = (w - new_w) // 2
        frames = frames[..., x0 : x0 + new_w]
    else:
        new_h = round(w / target)
        y0 = (h - new_h) // 2
        frames = frames[..., y0 : y0 + new_h, :]
    return F.interpolate(frames, size=(height, width), mode="bilinear", antialias=True, align_corners=False)


def load_clip(
    path: str | Path, num_frames: int, height: int, width: int, *, fps: float | None = None
) -> Clip:
    """Read ``num_frames`` frames (at ``fps`` if given, else the native rate) from a video with decord."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"video file {path} does not exist", hint="pass --video PATH to a readable video")
    try:
        import decord

        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        native = float(reader.get_avg_fps()) or 24.0
        total = len(reader)
    except Exception as exc:  # decord raises its own DECORDError and RuntimeError
        raise InputError(
            f"cannot read video {path}: {exc}", hint="is it a video file decord can open?"
        ) from None
    rate = fps or native
    step = native / rate
    indices = [round(i * step) for i in range(num_frames)]
    indices = [i for i in indices if i < total]
    if len(indices) < num_frames:
        raise InputError(
            f"video {path} has {total} frames at {native:.2f} fps: only {len(indices)} of {num_frames} "
            f"frames can be taken at {rate:.2f} fps",
            hint="use fewer --frames or a lower --fps",
        )
    frames = torch.from_numpy(reader.get_batch(indices).asnumpy()).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    frames = _resize(frames, height, width).clamp(-1, 1)
    return Clip(
        video=frames.permute(1, 0, 2, 3).unsqueeze(0).contiguous(),
        source=str(path),
        fps=rate,
        description=f"{path.name}: {num_frames} frames at {rate:.2f} fps, {width}x{height}",
    )
