"""Read a shapes clip back: which colour is the moving thing, and which way does it go?

Used to score the demo model (generate a caption, decode, check that the video shows it) and to
check the dataset itself (ground-truth clips must score 100 %). Works on decoded uint8 frames
(T, H, W, 3), whatever produced them.

Method, chosen to survive H.264 chroma subsampling and the blur of a small model:
1. the background colour is the median of the frame borders over all frames (the background
   is plain and the shape rarely sits on a border);
2. the object mask of each frame = pixels far from that colour (RGB distance);
3. colour = the palette hue nearest to the saturation-weighted circular mean hue of the
   mask pixels;
4. direction = sign of the larger component of the centroid's motion, fitted by least
   squares over the frames where the object is visible (y grows downwards: +y is "down");
5. shape = from the mask's silhouette in its bounding box, median over the visible frames:
   a triangle (apex up) is much narrower in its top half than in its bottom half, a square
   fills its box, a circle fills about pi/4 of it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pfctl.demo.shapes import COLORS, DIRECTIONS, parse_caption

TRIANGLE_TAPER = 0.6
"""Top-half / bottom-half mean width below which a silhouette reads as a triangle (ideal: 1/3)."""
SQUARE_FILL = 0.89
"""Share of its bounding box above which a silhouette reads as a square (ideal 1; circle pi/4)."""


@dataclass(frozen=True)
class ClipScore:
    """What was read from one clip. ``color`` / ``direction`` are None when undecidable."""

    color: str | None
    direction: str | None
    hue: float | None
    """Dominant hue of the object in degrees [0, 360)."""
    displacement: tuple[float, float]
    """Fitted centroid motion (dx, dy) over the whole clip, in pixels."""
    coverage: float
    """Mean fraction of the frame covered by the object mask."""
    visible_frames: int
    shape: str | None = None
    """``circle`` / ``square`` / ``triangle`` read from the silhouette; None when undecidable."""


@dataclass(frozen=True)
class ScoreReport:
    """Accuracy of a set of clips against their captions."""

    num_clips: int
    color_accuracy: float
    direction_accuracy: float
    both_accuracy: float
    rows: list[dict[str, Any]]
    shape_accuracy: float = 0.0
    """Share of the clips whose silhouette reads as the caption's shape."""


def rgb_to_hsv(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(..., 3) uint8/float RGB → hue in degrees [0, 360), saturation and value in [0, 1]."""
    x = np.asarray(rgb, dtype=np.float64) / (255.0 if np.asarray(rgb).dtype == np.uint8 else 1.0)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    cmax, cmin = x.max(axis=-1), x.min(axis=-1)
    delta = cmax - cmin
    safe = np.where(delta > 0, delta, 1.0)
    hue = np.where(
        cmax == r,
        ((g - b) / safe) % 6.0,
        np.where(cmax == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0),
    )
    hue = np.where(delta > 0, hue * 60.0, 0.0) % 360.0
    sat = np.where(cmax > 0, delta / np.where(cmax > 0, cmax, 1.0), 0.0)
    return hue, sat, cmax


def palette_hues(colors: Iterable[str] | None = None) -> dict[str, float]:
    """The hue (degrees) of each palette colour."""
    names = list(colors) if colors is not None else list(COLORS)
    rgb = np.asarray([COLORS[n] for n in names], dtype=np.uint8)
    hues, _, _ = rgb_to_hsv(rgb)
    return dict(zip(names, (float(h) for h in hues), strict=True))


def _hue_distance(a: float, b: float) -> float:
    d = abs(a - b) % 360.0
    return min(d, 360.0 - d)


def _as_frames(frames: Any) -> np.ndarray:
    if not isinstance(frames, np.ndarray):
        frames = frames.detach().cpu().numpy()
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3), got shape {tuple(frames.shape)}")
    return frames


def object_masks(frames: np.ndarray, threshold: float = 60.0) -> np.ndarray:
    """(T, H, W) bool: pixels whose colour is far from the plain background."""
    frames = _as_frames(frames).astype(np.float32)
    border = np.concatenate(
        [
            frames[:, 0, :, :].reshape(-1, 3),
            frames[:, -1, :, :].reshape(-1, 3),
            frames[:, :, 0, :].reshape(-1, 3),
            frames[:, :, -1, :].reshape(-1, 3),
        ]
    )
    background = np.median(border, axis=0)
    distance = np.linalg.norm(frames - background, axis=-1)
    return distance > threshold


def _silhouette(mask: np.ndarray) -> tuple[float, float] | None:
    """(fill of the bounding box, top-half / bottom-half mean width) of one frame's mask."""
    rows = np.nonzero(mask.any(axis=1))[0]
    cols = np.nonzero(mask.any(axis=0))[0]
    if len(rows) < 4 or len(cols) < 4:
        return None
    box = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    widths = box.sum(axis=1).astype(np.float64)
    half = len(widths) // 2
    bottom = widths[len(widths) - half :].mean()
    return float(box.mean()), float(widths[:half].mean() / bottom) if bottom > 0 else 0.0


def read_shape(masks: np.ndarray) -> str | None:
    """The shape of the object in (T, H, W) masks (frames where it touches the border are used
    only when all do)."""
    inside = [m for m in masks if not (m[0].any() or m[-1].any() or m[:, 0].any() or m[:, -1].any())]
    found = [s for s in map(_silhouette, inside or list(masks)) if s is not None]
    if not found:
        return None
    fill, taper = np.median(np.asarray(found), axis=0)
    if taper < TRIANGLE_TAPER:
        return "triangle"
    return "square" if fill > SQUARE_FILL else "circle"


def score_frames(
    frames: Any,
    *,
    colors: Sequence[str] | None = None,
    threshold: float = 60.0,
    min_pixels: int = 4,
    min_motion: float = 0.05,
) -> ClipScore:
    """Colour and direction of the moving object in ``frames`` (T, H, W, 3) uint8.

    ``colors`` restricts the colour classes (default: the whole palette). ``min_motion`` is the
    smallest displacement, as a fraction of the frame's shorter side, that counts as motion.
    """
    frames = _as_frames(frames)
    num_frames, height, width, _ = frames.shape
    masks = object_masks(frames, threshold)
    coverage = float(masks.mean())
    t_idx, y_idx, x_idx = np.nonzero(masks)
    counts = np.bincount(t_idx, minlength=num_frames)
    visible = counts >= min_pixels
    if not visible.any():
        return ClipScore(None, None, None, (0.0, 0.0), coverage, 0, None)
    safe = np.maximum(counts, 1)
    cx = np.bincount(t_idx, weights=x_idx, minlength=num_frames) / safe
    cy = np.bincount(t_idx, weights=y_idx, minlength=num_frames) / safe
    ts = np.nonzero(visible)[0]
    xs, ys = cx[visible], cy[visible]

    # saturation-weighted circular mean of the hue over the object's pixels (visible frames only)
    keep = visible[t_idx]
    hue_px, sat_px, _ = rgb_to_hsv(frames[t_idx[keep], y_idx[keep], x_idx[keep]])
    angles = np.deg2rad(hue_px)
    vec = np.array([(sat_px * np.cos(angles)).sum(), (sat_px * np.sin(angles)).sum()])
    hue = None
    color = None
    if sat_px.sum() > 0 and np.linalg.norm(vec) > 1e-9:
        hue = float(np.rad2deg(math.atan2(vec[1], vec[0])) % 360.0)
        candidates = palette_hues(colors)
        color = min(candidates, key=lambda name: _hue_distance(hue, candidates[name]))

    displacement = (0.0, 0.0)
    direction = None
    if len(ts) >= 2:
        t = ts.astype(np.float64)
        slope_x = np.polyfit(t, xs, 1)[0]
        slope_y = np.polyfit(t, ys, 1)[0]
        span = float(num_frames - 1)
        displacement = (float(slope_x * span), float(slope_y * span))
        dx, dy = displacement
        if max(abs(dx), abs(dy)) >= min_motion * min(height, width):
            if abs(dx) >= abs(dy):
                direction = "right" if dx > 0 else "left"
            else:
                direction = "down" if dy > 0 else "up"
    return ClipScore(color, direction, hue, displacement, coverage, len(ts), read_shape(masks[visible]))


def read_frames(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode a video file to (T, H, W, 3) uint8 (decord when installed, else PyAV)."""
    try:
        import decord
    except ImportError:
        from pfctl.sampling.video_io import read_video_frames

        return read_video_frames(path)
    reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
    return reader.get_batch(list(range(len(reader)))).asnumpy()


def score_video(path: str | os.PathLike[str], **kwargs: Any) -> ClipScore:
    """:func:`score_frames` on a video file."""
    return score_frames(read_frames(path), **kwargs)


def score_clips(
    items: Iterable[tuple[str, Any]], *, colors: Sequence[str] | None = None, **kwargs: Any
) -> ScoreReport:
    """Score (caption, frames-or-path) pairs: the share whose colour / direction match the caption."""
    rows = []
    for caption, source in items:
        if isinstance(source, (str, os.PathLike)):
            result = score_video(source, colors=colors, **kwargs)
        else:
            result = score_frames(source, colors=colors, **kwargs)
        want_color, want_shape, want_direction = parse_caption(caption)
        rows.append(
            {
                "caption": caption,
                "source": str(source) if isinstance(source, (str, os.PathLike)) else None,
                "expected_color": want_color,
                "expected_direction": want_direction,
                "color": result.color,
                "direction": result.direction,
                "expected_shape": want_shape,
                "shape": result.shape,
                "hue": result.hue,
                "displacement": list(result.displacement),
                "color_ok": result.color == want_color,
                "direction_ok": result.direction == want_direction,
                "shape_ok": result.shape == want_shape,
            }
        )
    n = len(rows)

    def share(key: str) -> float:
        return sum(r[key] for r in rows) / n if n else 0.0

    both = sum(r["color_ok"] and r["direction_ok"] for r in rows) / n if n else 0.0
    return ScoreReport(n, share("color_ok"), share("direction_ok"), both, rows, share("shape_ok"))


def score_annotations(annotation_file: str | os.PathLike[str], **kwargs: Any) -> ScoreReport:
    """Score every clip listed in a shapes annotation JSONL (``video`` relative to the file)."""
    path = Path(annotation_file)
    items = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            video = Path(row["video"])
            items.append((row["text"], video if video.is_absolute() else path.parent / video))
    return score_clips(items, **kwargs)


__all__ = [
    "DIRECTIONS",
    "ClipScore",
    "ScoreReport",
    "object_masks",
    "palette_hues",
    "read_frames",
    "read_shape",
    "rgb_to_hsv",
    "score_annotations",
    "score_clips",
    "score_frames",
    "score_video",
]
