"""Synthetic "shapes" videos: one coloured shape moving in one direction on a plain background.

Every clip is a real H.264 mp4 (yuv420p, written with PyAV) so the whole pipeline — decord
decoding, fps resampling, VAE encoding — runs on it exactly as on real footage.

Determinism: clip ``i`` depends only on ``(seed, i)`` (its own ``numpy`` generator), so the
first clips of a 100-clip and a 1000-clip dataset are the same. The (colour, shape, direction)
classes are drawn as a seeded permutation of their product, cycled, so every class is equally
frequent in any dataset of a multiple of that product's size.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfctl.errors import ConfigError, InputError

# Saturated colours with well separated hues, so the colour can be read back from decoded frames.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (40, 90, 230),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 210),
    "orange": (240, 130, 30),
}
DEFAULT_COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
"""The default palette: the four colours with the widest hue gaps (easiest for a tiny model)."""
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Unit motion per direction in image coordinates (x to the right, y downwards)."""
BACKGROUND: tuple[int, int, int] = (24, 24, 24)
"""A neutral background (zero saturation), so every saturated pixel belongs to the shape."""

_SUPERSAMPLE = 4  # sub-pixels per pixel and axis, for anti-aliased edges


@dataclass(frozen=True)
class ShapeClip:
    """One clip's ground truth: what is drawn, where it starts and how it moves (pixels)."""

    id: str
    color: str
    shape: str
    direction: str
    caption: str
    size: float
    """Half-extent of the shape (circle radius, half side of the square)."""
    start: tuple[float, float]
    """Centre (x, y) at frame 0."""
    velocity: tuple[float, float]
    """Displacement (dx, dy) per frame."""


@dataclass(frozen=True)
class ShapesDataset:
    """What :func:`make_shapes` wrote."""

    root: Path
    annotation_file: Path
    clips: list[ShapeClip] = field(repr=False)
    video_paths: list[Path] = field(repr=False)
    width: int = 64
    height: int = 64
    num_frames: int = 17
    fps: float = 24.0
    seed: int = 0


def caption_for(color: str, shape: str, direction: str) -> str:
    """The caption of a clip: ``"a red circle moving left"``."""
    return f"a {color} {shape} moving {direction}"


def parse_caption(caption: str) -> tuple[str | None, str | None, str | None]:
    """(colour, shape, direction) named in a caption; None where a word is missing."""
    words = caption.lower().replace(",", " ").split()
    color = next((w for w in words if w in COLORS), None)
    shape = next((w for w in words if w in SHAPES), None)
    direction = next((w for w in words if w in DIRECTIONS), None)
    return color, shape, direction


def _check_choice(kind: str, values: Sequence[str], allowed: Sequence[str]) -> tuple[str, ...]:
    values = tuple(values)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ConfigError(
            f"unknown {kind} {bad or '(none given)'} for the shapes dataset",
            hint=f"choose from: {', '.join(allowed)}",
        )
    return values


def plan_clips(
    num_clips: int,
    size: tuple[int, int],
    num_frames: int,
    seed: int,
    *,
    colors: Sequence[str] = DEFAULT_COLORS,
    shapes: Sequence[str] = SHAPES,
    directions: Sequence[str] = tuple(DIRECTIONS),
) -> list[ShapeClip]:
    """Ground truth for ``num_clips`` clips (no pixels): classes, sizes, start points, velocities."""
    width, height = size
    colors = _check_choice("colour", colors, tuple(COLORS))
    shapes = _check_choice("shape", shapes, SHAPES)
    directions = _check_choice("direction", directions, tuple(DIRECTIONS))
    combos = list(itertools.product(colors, shapes, directions))
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(combos))
    clips = []
    for index in range(num_clips):
        color, shape, direction = combos[int(order[index % len(combos)])]
        rng = np.random.default_rng([seed, index])
        short = min(width, height)
        half = float(rng.uniform(0.12, 0.18) * short)
        margin = half + 1.0
        ux, uy = DIRECTIONS[direction]
        span_along = (width if ux else height) - 2 * margin
        # Travel 55-85 % of the free span, starting so that the shape stays fully inside the frame.
        travel = float(rng.uniform(0.55, 0.85) * span_along)
        offset = float(rng.uniform(0.0, span_along - travel))
        across_lo, across_hi = margin, (height if ux else width) - margin
        across = float(rng.uniform(across_lo, across_hi))
        along_start = margin + offset if (ux + uy) > 0 else margin + offset + travel
        start = (along_start, across) if ux else (across, along_start)
        step = travel / max(num_frames - 1, 1)
        velocity = (ux * step, uy * step)
        clips.append(
            ShapeClip(
                id=f"shapes_{index:05d}",
                color=color,
                shape=shape,
                direction=direction,
                caption=caption_for(color, shape, direction),
                size=half,
                start=(float(start[0]), float(start[1])),
                velocity=(float(velocity[0]), float(velocity[1])),
            )
        )
    return clips


def _coverage(shape: str, cx: float, cy: float, half: float, width: int, height: int) -> np.ndarray:
    """Fraction (H, W) of each pixel covered by the shape, from a supersampled inside-test.

    Only the pixels of the shape's bounding box are tested (the rest are 0).
    """
    s = _SUPERSAMPLE
    out = np.zeros((height, width), dtype=np.float64)
    x0, x1 = max(int(np.floor(cx - half)) - 1, 0), min(int(np.ceil(cx + half)) + 2, width)
    y0, y1 = max(int(np.floor(cy - half)) - 1, 0), min(int(np.ceil(cy + half)) + 2, height)
    if x0 >= x1 or y0 >= y1:
        return out
    ys = y0 + (np.arange((y1 - y0) * s, dtype=np.float64) + 0.5) / s
    xs = x0 + (np.arange((x1 - x0) * s, dtype=np.float64) + 0.5) / s
    dx = xs[None, :] - cx
    dy = ys[:, None] - cy
    if shape == "circle":
        inside = dx * dx + dy * dy <= half * half
    elif shape == "square":
        inside = (np.abs(dx) <= half) & (np.abs(dy) <= half)
    elif shape == "triangle":
        # Upward-pointing isosceles triangle inscribed in the same 2*half box.
        rel = (dy + half) / (2 * half)  # 0 at the apex, 1 at the base
        inside = (dy >= -half) & (dy <= half) & (np.abs(dx) <= half * rel)
    else:  # pragma: no cover - guarded by plan_clips
        raise ValueError(shape)
    out[y0:y1, x0:x1] = inside.reshape(y1 - y0, s, x1 - x0, s).mean(axis=(1, 3))
    return out


def render_clip(
    clip: ShapeClip,
    size: tuple[int, int],
    num_frames: int,
    background: tuple[int, int, int] = BACKGROUND,
) -> np.ndarray:
    """The clip's frames as (T, H, W, 3) uint8 RGB (anti-aliased edges)."""
    width, height = size
    color = np.asarray(COLORS[clip.color], dtype=np.float64)
    bg = np.asarray(background, dtype=np.float64)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        cx = clip.start[0] + clip.velocity[0] * t
        cy = clip.start[1] + clip.velocity[1] * t
        alpha = _coverage(clip.shape, cx, cy, clip.size, width, height)[..., None]
        frames[t] = np.rint(bg * (1.0 - alpha) + color * alpha).astype(np.uint8)
    return frames


def _validate(num_clips: int, size: tuple[int, int], num_frames: int, fps: float) -> tuple[int, int]:
    if num_clips < 1:
        raise ConfigError(f"num_clips must be >= 1, got {num_clips}")
    try:
        width, height = (int(v) for v in size)
    except (TypeError, ValueError):
        raise ConfigError(f"size must be (width, height), got {size!r}") from None
    if width < 16 or height < 16 or width % 2 or height % 2:
        raise ConfigError(
            f"size {width}x{height} is not usable: width and height must be even and >= 16",
            hint="multiples of 64 (e.g. 64x64, 128x128) also suit the pyramid DiT",
        )
    if num_frames < 2:
        raise ConfigError(f"num_frames must be >= 2 for motion to be visible, got {num_frames}")
    if not fps > 0:
        raise ConfigError(f"fps must be positive, got {fps}")
    return width, height


def _write_clips(
    root: Path,
    clips: Sequence[ShapeClip],
    size: tuple[int, int],
    num_frames: int,
    fps: float,
    background: tuple[int, int, int],
    absolute_paths: bool,
) -> tuple[list[dict[str, Any]], list[Path]]:
    """Render and encode every clip as ``root/videos/<id>.mp4``, in order; returns the annotation
    rows and the video paths."""
    from pfctl.sampling.video_io import write_video

    width, height = size
    rows, paths = [], []
    for clip in clips:
        path = root / "videos" / f"{clip.id}.mp4"
        frames = render_clip(clip, size, num_frames, background)
        # One encoder thread (write_video's default): byte-identical files on reruns.
        write_video(path, frames, fps, crf=18, threads=1)
        paths.append(path)
        video_ref = str(path.resolve()) if absolute_paths else path.relative_to(root).as_posix()
        rows.append(
            {
                "id": clip.id,
                "video": video_ref,
                "text": clip.caption,
                "color": clip.color,
                "shape": clip.shape,
                "direction": clip.direction,
                "num_frames": num_frames,
                "fps": fps,
                "width": width,
                "height": height,
            }
        )
    return rows, paths


def make_shapes(
    out_dir: str | os.PathLike[str],
    num_clips: int = 64,
    size: tuple[int, int] = (64, 64),
    num_frames: int = 17,
    fps: float = 24,
    seed: int = 0,
    *,
    colors: Sequence[str] = DEFAULT_COLORS,
    shapes: Sequence[str] = SHAPES,
    directions: Sequence[str] = tuple(DIRECTIONS),
    background: tuple[int, int, int] = BACKGROUND,
    annotation_name: str = "annotations.jsonl",
    absolute_paths: bool = False,
) -> ShapesDataset:
    """Write ``num_clips`` mp4 clips under ``out_dir/videos`` and ``out_dir/<annotation_name>``.

    Each JSONL row: ``{"id", "video", "text", "color", "shape", "direction", "num_frames",
    "fps", "width", "height"}``. ``video`` is relative to the annotation file's folder (so the
    dataset can be moved) unless ``absolute_paths``. ``size`` is (width, height); ``num_frames``
    of the form 8k+1 (17, 25, 121, ...) maps exactly onto latent frames of the causal VAE.
    Files are written atomically; rerunning with the same arguments rewrites identical files.
    """
    from pfctl.utils.io import atomic_write_text

    width, height = _validate(num_clips, size, num_frames, fps)
    root = Path(out_dir)
    try:
        (root / "videos").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the dataset folder {root}: {exc.strerror}") from None
    clips = plan_clips(
        num_clips, (width, height), num_frames, seed, colors=colors, shapes=shapes, directions=directions
    )
    annotation_file = root / annotation_name
    rows, paths = _write_clips(root, clips, (width, height), num_frames, fps, background, absolute_paths)
    atomic_write_text(annotation_file, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    meta = {
        "generator": "pfctl.demo.shapes",
        "seed": seed,
        "num_clips": num_clips,
        "width": width,
        "height": height,
        "num_frames": num_frames,
        "fps": fps,
        "colors": list(colors),
        "shapes": list(shapes),
        "directions": list(directions),
        "background": list(background),
        "clips": [asdict(c) for c in clips],
    }
    atomic_write_text(root / "shapes_meta.json", json.dumps(meta, indent=2) + "\n")
    return ShapesDataset(
        root=root,
        annotation_file=annotation_file,
        clips=clips,
        video_paths=paths,
        width=width,
        height=height,
        num_frames=num_frames,
        fps=float(fps),
        seed=seed,
    )
