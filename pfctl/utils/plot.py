"""Pictures a person reads without any other file: labelled line charts and video contact sheets.

Drawn with Pillow alone (a dependency already), in its built-in font, so they work offline and on
a server without a display or matplotlib.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image, ImageFont

#: line colours, in order (distinguishable, also in grey)
PALETTE = (
    (31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (23, 190, 207),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34),
)  # fmt: skip
INK, GRID, PAPER = (20, 20, 20), (225, 225, 225), (255, 255, 255)


def builtin_font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's built-in font at ``size`` pixels (one fixed bitmap size before Pillow 10.1)."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def _printable(text: str) -> str:
    """The built-in font has Latin-1 glyphs only: dashes and arrows spelled plainly, the rest as '?'."""
    for fancy, plain in (("—", "-"), ("–", "-"), ("→", "->"), ("×", "x"), ("·", "."), ("…", "...")):
        text = text.replace(fancy, plain)
    return text.encode("latin-1", "replace").decode("latin-1")


def _fit(draw: Any, text: str, font: Any, width: float) -> str:
    """``text``, cut with "..." at its end so that it fits in ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def _vertical_text(img: Image.Image, centre: tuple[float, float], text: str, font: Any) -> None:
    """``text`` written bottom to top, its left edge at ``centre[0]``, centred on ``centre[1]`` (an axis
    label that fits beside the tick labels however long it is)."""
    from PIL import Image, ImageDraw

    strip = Image.new("RGB", (int(ImageDraw.Draw(img).textlength(text, font=font)) + 4, 20), PAPER)
    ImageDraw.Draw(strip).text((2, 2), text, font=font, fill=INK)
    turned = strip.rotate(90, expand=True)
    img.paste(turned, (int(centre[0]), int(centre[1] - turned.height / 2)))


def save_png(image: Image.Image, path: str | os.PathLike[str]) -> Path:
    """Write ``image`` as a PNG, atomically (the umask applies)."""
    from pfctl.utils.io import atomic_write_bytes

    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return atomic_write_bytes(path, buffer.getvalue())


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _label(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.2e}"


def line_chart(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    log_y: bool = False,
    marks: Sequence[float] = (),
    marks_label: str | None = None,
    size: tuple[int, int] = (960, 540),
) -> Image.Image:
    """One chart: each named series a line, a legend naming them, ticks and labels on both axes.

    ``marks``: x positions drawn as dashed vertical lines (e.g. chunk boundaries), named in the legend
    by ``marks_label``. ``log_y`` plots log10 of positive values (others are dropped).
    """
    from PIL import Image, ImageDraw

    def ty(v: float) -> float:
        return math.log10(v) if log_y else v

    points = {
        name: [(float(x), ty(float(y))) for x, y in zip(xs, ys, strict=True) if math.isfinite(y) and (y > 0 or not log_y)]
        for name, (xs, ys) in series.items()
    }
    xs = [p[0] for pts in points.values() for p in pts] or [0.0, 1.0]
    ys = [p[1] for pts in points.values() for p in pts] or [0.0, 1.0]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_lo, y_hi = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    pad = 0.05 * (y_hi - y_lo)
    y_lo, y_hi = y_lo - pad, y_hi + pad
    w, h = size
    left, right, top, bottom = 90, w - 200, 50, h - 60
    img = Image.new("RGB", size, PAPER)
    draw = ImageDraw.Draw(img)

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (right - left), bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top))

    small, big = builtin_font(14), builtin_font(18)
    for t in _ticks(y_lo, y_hi):
        y = px(x_lo, t)[1]
        draw.line([(left, y), (right, y)], fill=GRID)
        draw.text((left - 8, y), _label(10**t if log_y else t), font=small, fill=INK, anchor="rm")
    for t in _ticks(x_lo, x_hi):
        x = px(t, y_lo)[0]
        draw.line([(x, top), (x, bottom)], fill=GRID)
        draw.text((x, bottom + 6), _label(t), font=small, fill=INK, anchor="mt")
    for m in marks:
        x = px(float(m), y_lo)[0]
        for y in range(top, bottom, 10):
            draw.line([(x, y), (x, min(y + 5, bottom))], fill=(120, 120, 120), width=1)
    draw.rectangle([left, top, right, bottom], outline=INK)
    for i, pts in enumerate(points.values()):
        colour = PALETTE[i % len(PALETTE)]
        xy = [px(x, y) for x, y in pts]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy if len(xy) <= 64 else ():
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
    draw.text((w / 2, 12), _printable(title), font=big, fill=INK, anchor="mt")
    draw.text(((left + right) / 2, h - 22), _printable(xlabel), font=small, fill=INK, anchor="mt")
    _vertical_text(img, (12, (top + bottom) / 2), _printable(ylabel) + (" (log scale)" if log_y else ""), small)
    legend = [(name, PALETTE[i % len(PALETTE)], False) for i, name in enumerate(points)]
    if marks and marks_label:
        legend.append((marks_label, (120, 120, 120), True))
    for i, (name, colour, dashed) in enumerate(legend):
        y = top + 10 + 24 * i
        if dashed:
            draw.line([(right + 15, y), (right + 22, y)], fill=colour, width=2)
            draw.line([(right + 28, y), (right + 35, y)], fill=colour, width=2)
        else:
            draw.line([(right + 15, y), (right + 35, y)], fill=colour, width=3)
        draw.text((right + 42, y), _printable(name), font=small, fill=INK, anchor="lm")
    return img


def contact_sheet(
    rows: Sequence[tuple[str, np.ndarray]],
    *,
    title: str,
    frames: int = 3,
    cell: int = 160,
) -> Image.Image:
    """A grid: one row per video (its label above it), ``frames`` frames across its time, evenly
    spaced from the first to the last, each captioned with its frame index.

    ``rows``: (label, frames as uint8 (T, H, W, 3)). Small frames are enlarged (nearest neighbour) to
    ``cell`` pixels on their long side so a 64x64 video stays readable.
    """
    from PIL import Image, ImageDraw

    label_h, caption_h, gap, head = 22, 18, 8, 40
    widths = []
    for _, video in rows:
        _, hh, ww, _ = video.shape
        widths.append((cell, max(1, round(cell * hh / ww))) if ww >= hh else (max(1, round(cell * ww / hh)), cell))
    row_h = [label_h + h_ + caption_h + gap for _, h_ in widths]
    sheet_w = gap + frames * (max([w_ for w_, _ in widths], default=cell) + gap)
    img = Image.new("RGB", (max(sheet_w, 480), head + sum(row_h) + gap), PAPER)
    draw = ImageDraw.Draw(img)
    small, big = builtin_font(14), builtin_font(18)
    draw.text((img.width / 2, 10), _printable(title), font=big, fill=INK, anchor="mt")
    y = head
    for (label, video), (cw, ch), rh in zip(rows, widths, row_h, strict=True):
        draw.text((gap, y + 2), _fit(draw, _printable(label), small, img.width - 2 * gap), font=small, fill=INK)
        count = video.shape[0]
        picks = sorted({round(i * (count - 1) / max(frames - 1, 1)) for i in range(frames)})
        for j, t in enumerate(picks):
            x = gap + j * (cw + gap)
            frame = Image.fromarray(video[t]).resize((cw, ch), Image.NEAREST)
            img.paste(frame, (x, y + label_h))
            draw.text((x + cw / 2, y + label_h + ch + 2), f"frame {t + 1}/{count}", font=small, fill=INK, anchor="mt")
        y += rh
    return img
