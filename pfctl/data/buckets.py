"""Resolution buckets: every source goes to the bucket of nearest aspect ratio.

A bucket is a (width, height) in pixels. Aspect ratios are compared on a log scale, so
2:1 and 1:2 are equally far from 1:1. The source is then resized to *cover* the bucket
(the smaller scale factor that fills both sides) and center-cropped — no padding, no stretching.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Bucket:
    width: int
    height: int

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @classmethod
    def parse(cls, text: str) -> Bucket:
        width, _, height = text.partition("x")
        return cls(int(width), int(height))


def as_buckets(buckets: Sequence[Sequence[int]]) -> list[Bucket]:
    return [Bucket(int(w), int(h)) for w, h in buckets]


def nearest_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is nearest (log scale) to ``width/height``; ties → listed first."""
    if width <= 0 or height <= 0:
        raise ValueError(f"source size must be positive, got {width}x{height}")
    target = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b.aspect) - target))


def cover_size(width: int, height: int, bucket: Bucket) -> tuple[int, int]:
    """The (width, height) the source is resized to so that it covers ``bucket`` with the same aspect.

    The dimension that limits the scale matches the bucket exactly; the other is rounded up, so
    the crop never runs out of pixels.
    """
    scale = max(bucket.width / width, bucket.height / height)
    new_w = max(bucket.width, math.ceil(width * scale - 1e-6))
    new_h = max(bucket.height, math.ceil(height * scale - 1e-6))
    return new_w, new_h


def center_crop_box(width: int, height: int, bucket: Bucket) -> tuple[int, int]:
    """Top-left corner (x0, y0) of the centred ``bucket`` crop in a ``width`` × ``height`` image."""
    return (width - bucket.width) // 2, (height - bucket.height) // 2
