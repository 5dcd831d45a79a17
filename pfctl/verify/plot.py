"""The ``--plot`` PNG of verify-groupnorm: per-latent-frame error of every path, readable on its own.

Drawn with Pillow (a dependency already) and its built-in font, so no plotting library is needed: a title
naming the VAE, the audit verdict and the result; a log y axis (relL2 per latent frame) and a latent-frame
x axis, both labelled with ticks; dashed verticals where the library path's chunks start; the tolerance
limits as dotted horizontals; a legend beside the plot naming each path and its status.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

from pfctl.utils.plot import builtin_font
from pfctl.verify.report import GroupNormReport, path_label

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
LOG_LO, LOG_HI = -8, 0
"""The y axis spans relL2 10^-8 … 10^0; smaller values (bit-exact frames) sit on the bottom edge."""


@dataclass(frozen=True)
class _Box:
    """The plot area in pixels."""

    left: int
    top: int
    right: int
    bottom: int
    pad: int = 14
    """Room between the frame and the data, so markers stay off the ticks and the legend."""

    def y(self, value: float) -> int:
        lv = min(LOG_HI, max(LOG_LO, math.log10(max(value, 1e-30))))
        span = self.bottom - self.top - 2 * self.pad
        return round(self.bottom - self.pad - (lv - LOG_LO) / (LOG_HI - LOG_LO) * span)

    def x(self, frame: float, num_frames: int) -> int:
        span = self.right - self.left - 2 * self.pad
        return round(self.left + self.pad + frame * span / max(num_frames - 1, 1))


def latent_boundaries(plan: list[int], temporal_factor: int) -> list[int]:
    """Latent frames where a chunk of ``plan`` (pixel frames, causal 1 + t·k first) starts, except 0."""
    if temporal_factor < 1:
        return []
    out, pos = [], 0
    for n in plan[:-1]:
        pos += n
        out.append((pos - 1) // temporal_factor + 1)
    return out


def _dashed(draw: Any, xy: tuple[int, int, int, int], colour: tuple[int, int, int], dash: int = 4) -> None:
    x0, y0, x1, y1 = xy
    length = max(abs(x1 - x0), abs(y1 - y0), 1)
    for s in range(0, length, 2 * dash):
        e = min(s + dash, length)
        draw.line(
            (x0 + (x1 - x0) * s // length, y0 + (y1 - y0) * s // length,
             x0 + (x1 - x0) * e // length, y0 + (y1 - y0) * e // length),
            fill=colour,
        )  # fmt: skip


def _axes(draw: Any, box: _Box, num_frames: int, font: Any) -> None:
    """Frame, decade grid with 1e-k labels, latent-frame ticks, both axis titles."""
    draw.rectangle((box.left, box.top, box.right, box.bottom), outline=(0, 0, 0))
    for d in range(LOG_LO, LOG_HI + 1):
        y = box.y(10.0**d)
        if LOG_LO < d < LOG_HI:
            _dashed(draw, (box.left, y, box.right, y), (215, 215, 215), dash=2)
        draw.text((box.left - 6, y), f"1e{d}", fill=(0, 0, 0), font=font, anchor="rm")
    step = max(1, math.ceil(num_frames / 16))
    for t in range(0, num_frames, step):
        x = box.x(t, num_frames)
        draw.line((x, box.bottom, x, box.bottom + 4), fill=(0, 0, 0))
        draw.text((x, box.bottom + 6), str(t), fill=(0, 0, 0), font=font, anchor="mt")
    draw.text(
        ((box.left + box.right) // 2, box.bottom + 24),
        "latent frame",
        fill=(0, 0, 0),
        font=font,
        anchor="mt",
    )
    draw.text((8, box.top - 18), "relL2 per latent frame vs one-call (log)", fill=(0, 0, 0), font=font)


def _limits(draw: Any, box: _Box, tolerances: dict[str, Any], font: Any) -> None:
    for key, label in (("exact_rel_l2", "exact limit"), ("approx_rel_l2_pass", "approx. pass")):
        value = tolerances.get(key)
        if value:
            y = box.y(value)
            _dashed(draw, (box.left, y, box.right, y), (120, 120, 120), dash=1)
            draw.text(
                (box.right - 4, y - 2), f"{label} {value:.0e}", fill=(90, 90, 90), font=font, anchor="rb"
            )


def _series(
    draw: Any, box: _Box, values: list[float], num_frames: int, colour: tuple[int, int, int], radius: int
) -> None:
    """One path's line; earlier paths get larger markers, so equal values stay visible as rings."""
    points = [(box.x(t, num_frames), box.y(v)) for t, v in enumerate(values)]
    if len(points) > 1:
        draw.line(points, fill=colour, width=2)
    for x, y in points:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=colour)


def plot_per_frame_error(report: GroupNormReport, width: int = 900, height: int = 480) -> bytes:
    """PNG bytes of the per-latent-frame relL2 of every measured path (see the module docstring)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font, title_font = builtin_font(12), builtin_font(15)
    vae, verdict = report.vae, report.audit["verdict"]
    title = (
        f"verify-groupnorm: {vae['name']} ({vae['spec']}), verdict {verdict}, result {report.status.upper()}"
    )
    draw.text((10, 8), title, fill=(0, 0, 0), font=title_font)
    draw.text((10, 28), report.input["description"], fill=(70, 70, 70), font=font)
    box = _Box(left=64, top=70, right=width - 230, bottom=height - 50)
    series = [p for p in report.paths if p.available and p.latent]
    num_frames = max((len(p.latent["per_frame_rel_l2"]) for p in series), default=1)
    _axes(draw, box, num_frames, font)
    _limits(draw, box, report.tolerances, font)
    library = next((p for p in series if p.name == "library"), None)
    bounds = latent_boundaries(library.chunk_plan, int(vae.get("temporal_factor") or 0)) if library else []
    for b in bounds:
        x = round((box.x(b - 1, num_frames) + box.x(b, num_frames)) / 2)
        _dashed(draw, (x, box.top, x, box.bottom), (160, 160, 160))
    for i, p in enumerate(series):
        radius = 3 + 3 * (len(series) - 1 - i) // 2
        _series(draw, box, p.latent["per_frame_rel_l2"], num_frames, COLOURS[i % len(COLOURS)], radius)
    _legend(draw, box, series, bounds, font)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _legend(draw: Any, box: _Box, series: list[Any], bounds: list[int], font: Any) -> None:
    x, y = box.right + 14, box.top
    draw.text((x, y), "path (status)", fill=(0, 0, 0), font=font)
    for i, p in enumerate(series):
        y += 18
        colour = COLOURS[i % len(COLOURS)]
        draw.line((x, y + 7, x + 22, y + 7), fill=colour, width=2)
        draw.ellipse((x + 8, y + 4, x + 14, y + 10), fill=colour)
        draw.text((x + 28, y), f"{path_label(p)} ({p.status})", fill=(0, 0, 0), font=font)
    if bounds:
        y += 18
        _dashed(draw, (x, y + 7, x + 22, y + 7), (160, 160, 160))
        draw.text((x + 28, y), "library chunk start", fill=(0, 0, 0), font=font)
    y += 24
    draw.text((x, y), "values below 1e-8 drawn at 1e-8", fill=(90, 90, 90), font=font)
