"""Decode latents to frames and encode the i2v first frame: the VAE steps of ``pfctl generate``, which the
parity tests and benchmarks call directly."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

__all__ = [
    "AUTO_TILE",
    "UNTILED_DECODE_BYTES_PER_PIXEL",
    "decode_latents",
    "encode_image_latent",
    "free_memory",
    "host_frames",
    "prepare_image",
    "resolve_decode_tile",
]


def prepare_image(path: str | os.PathLike[str], width: int, height: int) -> tuple[np.ndarray, torch.Tensor]:
    """Read an image, resize it to cover ``width`` x ``height`` and cut the centre (as the
    reference's demo app does). Returns the uint8 pixels (H, W, 3) and the VAE input
    (1, 3, 1, H, W) in [-1, 1]."""
    from pfctl.sampling.video_io import image_to_tensor, load_image, resize_cover_center_crop

    pixels = resize_cover_center_crop(load_image(path), width, height)
    return pixels, image_to_tensor(pixels)


def decode_latents(
    vae: Any,
    latents: torch.Tensor,
    *,
    chunking: str = "framewise",
    window: int = 1,
    tile: int | None = 256,
    normalized: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents → (decoder output (B, 3, T, H, W) float32, frames (B, T, H, W, 3) uint8).

    ``normalized=True`` first applies the VAE adapter's ``denormalize`` (frame 0 image factors,
    later frames video factors) — into a new tensor, the caller's latents are left alone.
    ``chunking="framewise"`` decodes ``window`` latent frames at a time (the reference: 1 with
    ``save_memory``, else 2); ``tile`` is the spatial tile in pixels (None = never tile).
    uint8 conversion is the reference's: ``x * 127.5 + 127.5``, clamp, truncate.
    """
    from pfctl.sampling.video_io import frames_to_uint8

    # fp32 for the affine map: bf16 sampler output would lose bits to the 1/scale multiply
    z = vae.denormalize(latents.float()) if normalized else latents
    video = vae.decode(z, chunking=chunking, chunk_frames=window if chunking != "none" else None, tile=tile)
    return video, frames_to_uint8(video)


AUTO_TILE = 256
"""The tile ``decode_tile: auto`` falls back to when an untiled decode would not fit."""
UNTILED_DECODE_BYTES_PER_PIXEL = (19_000, 12_500)
"""Peak memory of an untiled causal-VAE decode in bf16 with a float32 result, per pixel of a frame:
(fixed, per latent frame of the window). Measured on an H200 at 640x384, 16 latent frames, channels-last
with the fused norms (window 1: 7.00 GiB, window 2: 9.82 GiB, bf16 result; the float32 result adds
726 bytes per pixel to the fixed part)."""


def host_frames(frames: torch.Tensor) -> np.ndarray:
    """Decoded uint8 frames as a host array, copied from a GPU through pinned memory: on an H200 a 768p
    video's frames (357 MB) took 224 ms to copy into pageable memory and 6.5 ms into pinned memory (PyTorch
    caches the pinned block, so later videos reuse it)."""
    if frames.device.type != "cuda":
        return frames.numpy()
    host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
    host.copy_(frames)
    return host.numpy()


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation could use: the device's free memory plus what PyTorch holds unused
    (CUDA), or the host's available memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_decode_tile(
    tile: int | str | None,
    *,
    height: int,
    width: int,
    window: int,
    dtype: torch.dtype,
    available: int,
) -> int | None:
    """The tile size a decode of ``height`` x ``width`` frames uses: ``tile`` itself unless it is
    ``"auto"``, then no tiling when the untiled decode's estimated peak (``window`` latent frames per
    decoder call) fits in 80% of ``available`` bytes, else :data:`AUTO_TILE`. Untiled decoding is
    both faster (a tile grid decodes ~2x the pixels: its tiles overlap) and free of blending seams."""
    if tile != "auto":
        return tile  # type: ignore[return-value]
    fixed, per_frame = UNTILED_DECODE_BYTES_PER_PIXEL
    need = (fixed + per_frame * window) * height * width * dtype.itemsize / 2
    return None if need <= 0.8 * available else AUTO_TILE


def encode_image_latent(
    vae: Any, image_tensor: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, Any]:
    """The i2v unit 0: VAE posterior of the image, a *sample* of it (as the reference draws),
    normalised with the image factors. Returns (normalised latent (1, C, 1, h, w), posterior)."""
    posterior = vae.encode(image_tensor, chunking="none", tile=None)
    sample = posterior.sample(generator)
    return vae.normalize(sample), posterior
