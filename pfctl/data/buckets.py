"""Resolution buckets: every source goes to the bucket of nearest aspect ratio.

A bucket is a (width, height) in pixels. Aspect ratios are compared on a log scale, so
2:1 and 1:2 are equally far from 1:1. The source is then resized to *cover* the bucket
(the smaller scale factor that fills both sides) and center-cropped — no padding, no stretching.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pfctl.errors import ConfigError


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


def grid_multiple(*, patch: int, stages: int, vae_factor: int = 1) -> int:
    """The size every bucket side must be a multiple of for the pyramid DiT to train it.

    Stage ``s`` of ``stages`` sees the latents halved ``stages - 1 - s`` times and cuts them into
    ``patch`` × ``patch`` tokens, so the lowest stage needs latent sides divisible by
    ``patch * 2**(stages - 1)``; ``vae_factor`` turns that into pixels (1: latent units).
    """
    return patch * 2 ** (stages - 1) * vae_factor


def nearest_valid(size: int, multiple: int) -> list[int]:
    """The multiples of ``multiple`` nearest to ``size`` (below and above; one if ``size`` is one)."""
    below = max(multiple, size // multiple * multiple)
    above = -(-size // multiple) * multiple
    return sorted({below, above})


def check_buckets(sizes: Sequence[Sequence[int]], multiple: int, *, what: str, unit: str, why: str) -> None:
    """Refuse (``ConfigError``, exit 2) every (width, height) in ``sizes`` whose sides are not
    multiples of ``multiple``; the message names the first bad bucket and the nearest valid sizes.

    ``what`` names the source (``encode.buckets``, ``the cache``), ``unit`` the size unit and ``why``
    where the multiple comes from (the DiT's patch, the pyramid stages, the VAE).
    """
    bad = [(int(w), int(h)) for w, h in sizes if int(w) % multiple or int(h) % multiple]
    if not bad:
        return
    width, height = bad[0]
    near = [f"{w}x{h}" for w in nearest_valid(width, multiple) for h in nearest_valid(height, multiple)]
    others = (
        f" (and {len(bad) - 1} more: {', '.join(f'{w}x{h}' for w, h in bad[1:4])})" if len(bad) > 1 else ""
    )
    raise ConfigError(
        f"{what}: bucket {width}x{height} {unit} cannot be trained: both sides must be multiples of "
        f"{multiple} {unit} ({why}){others}",
        hint=f"nearest valid sizes: {', '.join(near)}",
    )
