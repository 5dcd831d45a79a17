"""Inputs for verify-groupnorm: a built-in synthetic clip, or a real video read with decord.

The synthetic clip is built to stress per-chunk statistics: GroupNorm statistics that change over time
are what make chunked statistics differ from whole-clip ones, and a fade plus a hard cut change them most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

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


def load_clip(
    path: str | Path, num_frames: int, height: int, width: int, *, fps: float | None = None
) -> Clip:
    """The first ``num_frames`` frames of a video at ``fps`` (None: its own rate), as encode-latents
    reads them: the same reader (decord, PyAV where decord mis-sizes a stream), the same fps
    resampling (:func:`pfctl.data.video.resample_indices`) and the same cover-resize and centre crop."""
    from pfctl.data.buckets import Bucket
    from pfctl.data.video import (
        ClipPlan,
        MediaError,
        open_video,
        probe_video,
        read_clip,
        require_decord,
        resample_indices,
        to_model_input,
    )

    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"video file {path} does not exist", hint="pass --video PATH to a readable video")
    require_decord()
    try:
        reader = open_video(path)
        info = probe_video(path, reader=reader)
        rate = fps or info.fps or 24.0
        timeline = resample_indices(info.num_frames, info.fps, rate)
        if len(timeline) < num_frames:
            raise InputError(
                f"video {path} has {info.num_frames} frames at {info.fps:.2f} fps: only {len(timeline)} of "
                f"{num_frames} frames can be taken at {rate:.2f} fps",
                hint="use fewer --frames or a lower --fps",
            )
        plan = ClipPlan(
            clip_id=path.name,
            item_id=path.name,
            clip_index=0,
            frame_indices=tuple(timeline[:num_frames]),
            bucket=Bucket(width, height),
            fps=rate,
            source_fps=info.fps,
            source_width=info.width,
            source_height=info.height,
        )
        frames = read_clip(reader, plan)
    except MediaError as exc:
        raise InputError(f"cannot read video {path}: {exc.detail}", hint="is it a video file?") from None
    video = to_model_input(frames).unsqueeze(0).contiguous()  # (1, 3, T, H, W) in [-1, 1]
    return Clip(
        video=video,
        source=str(path),
        fps=rate,
        description=f"{path.name}: {num_frames} frames at {rate:.2f} fps, {width}x{height}",
    )
