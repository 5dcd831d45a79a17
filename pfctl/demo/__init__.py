"""The shapes demo: a synthetic video dataset small enough to train a Pyramid Flow model on a laptop.

Clips show one coloured shape (circle, square, triangle) moving left, right, up or down on a
plain background, captioned "a red circle moving left". Because the caption is fully determined
by what is on screen, a model trained on them can be scored automatically
(:mod:`pfctl.demo.score` reads colour and direction back from decoded frames).

``make_shapes`` writes the clips and the annotation JSONL that ``pfctl encode-latents`` reads.
"""

from __future__ import annotations

from pfctl.demo.shapes import (
    COLORS,
    DIRECTIONS,
    SHAPES,
    ShapeClip,
    ShapesDataset,
    caption_for,
    make_shapes,
    parse_caption,
    render_clip,
)

__all__ = [
    "COLORS",
    "DIRECTIONS",
    "SHAPES",
    "ShapeClip",
    "ShapesDataset",
    "caption_for",
    "make_shapes",
    "parse_caption",
    "render_clip",
]
