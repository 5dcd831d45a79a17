"""Video and image I/O for generation: mp4 writing with PyAV, image loading for image-to-video.

Why PyAV and not ``diffusers.utils.export_to_video``: the latter multiplies numpy frames by 255,
so uint8 frames come out garbled. Frames here are always ``(T, H, W, 3)`` uint8 RGB.

Files are written to a temporary name in the target folder and renamed into place, so a killed
run never leaves a half mp4 that looks finished.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pfctl.errors import InputError

if TYPE_CHECKING:
    import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass(frozen=True)
class VideoInfo:
    """What a written (or any) video file holds, as read back by PyAV."""

    num_frames: int
    width: int
    height: int
    fps: float
    codec: str
    pix_fmt: str


def _as_uint8_frames(frames: np.ndarray | torch.Tensor) -> np.ndarray:
    """Accept ``(T, H, W, 3)`` uint8 as numpy or torch; refuse anything that would be silently rescaled."""
    if not isinstance(frames, np.ndarray):
        frames = frames.detach().cpu().numpy()
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3) RGB, got shape {tuple(frames.shape)}")
    if frames.dtype != np.uint8:
        raise ValueError(
            f"frames must be uint8 (0..255), got {frames.dtype}; convert explicitly, e.g. "
            "(x * 127.5 + 127.5).clamp(0, 255).byte() for [-1, 1] decoder output"
        )
    if frames.shape[0] == 0:
        raise ValueError("cannot write a video with 0 frames")
    return np.ascontiguousarray(frames)


def fps_fraction(fps: float) -> Fraction:
    """A frame rate as an exact fraction (24 → 24/1, 23.976 → 24000/1001), as the muxer wants."""
    if not (fps > 0 and math.isfinite(fps)):
        raise ValueError(f"fps must be a positive number, got {fps}")
    return Fraction(fps).limit_denominator(1001)


def rgb_to_yuv420p(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 RGB → planar yuv420p as PyAV wants it ((H * 3 / 2, W): Y, then U, then V).

    BT.601 limited range, the matrix players assume for untagged streams. Done here rather than
    by libswscale because swscale's conversion result depended on which frames had been
    converted before in the same process (its cached context), so identical frames did not
    always give identical files. Chroma is the mean of each 2x2 block.
    """
    x = rgb.astype(np.float32)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    y = 16.0 + 0.256788 * r + 0.504129 * g + 0.097906 * b
    u = 128.0 - 0.148223 * r - 0.290993 * g + 0.439216 * b
    v = 128.0 + 0.439216 * r - 0.367788 * g - 0.071427 * b
    h, w = y.shape

    def pool(c: np.ndarray) -> np.ndarray:
        return c.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))

    def to_u8(c: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(c), 0, 255).astype(np.uint8)

    planes = [to_u8(y).reshape(-1), to_u8(pool(u)).reshape(-1), to_u8(pool(v)).reshape(-1)]
    return np.concatenate(planes).reshape(h * 3 // 2, w)


def _encode_to_temp(
    target: Path,
    frames: np.ndarray | torch.Tensor,
    fps: float,
    *,
    crf: int,
    codec: str,
    pix_fmt: str,
    preset: str,
    threads: int,
    options: dict[str, str] | None,
) -> str:
    """Encode into a hidden temporary file next to ``target``; returns its name (fsynced, chmod'ed)."""
    import av

    array = _as_uint8_frames(frames)
    num_frames, height, width, _ = array.shape
    if pix_fmt == "yuv420p" and (width % 2 or height % 2):
        raise ValueError(f"yuv420p needs even width and height, got {width}x{height}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        with av.open(tmp_name, mode="w", format="mp4") as container:
            rate = fps_fraction(fps)
            stream = container.add_stream(codec, rate=rate)
            stream.codec_context.time_base = 1 / rate
            stream.width = width
            stream.height = height
            stream.pix_fmt = pix_fmt
            stream_options = {"crf": str(crf), "preset": preset, "threads": str(threads)}
            if threads == 1 and codec == "libx264":
                # x264's macroblock-tree rate control made the output depend on earlier encodes in
                # the same process (seen with clips shorter than its 40-frame lookahead); without
                # it, equal frames give equal bytes. Costs a few % of file size at equal quality.
                stream_options["x264-params"] = "mbtree=0"
            stream_options.update(options or {})
            stream.options = stream_options
            for index in range(num_frames):
                if pix_fmt == "yuv420p":
                    frame = av.VideoFrame.from_ndarray(rgb_to_yuv420p(array[index]), format="yuv420p")
                else:
                    frame = av.VideoFrame.from_ndarray(array[index], format="rgb24")
                frame.pts = index  # explicit timestamps (without them x264 output varies run to run)
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        with open(tmp_name, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return tmp_name


def _publish_exclusive(tmp_name: str, target: Path) -> None:
    """Move ``tmp_name`` to ``target`` only if ``target`` does not exist (FileExistsError otherwise).

    A hard link is atomic and never replaces an existing file; where links are unsupported the
    exists-check + rename fallback has a tiny race, acceptable for output naming.
    """
    try:
        os.link(tmp_name, target)
    except FileExistsError:
        raise
    except OSError:
        if target.exists():
            raise FileExistsError(str(target)) from None
        os.replace(tmp_name, target)
        return
    Path(tmp_name).unlink(missing_ok=True)


def write_video(
    path: str | os.PathLike[str],
    frames: np.ndarray | torch.Tensor,
    fps: float = 24,
    *,
    crf: int = 18,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    preset: str = "medium",
    threads: int = 1,
    options: dict[str, str] | None = None,
    overwrite: bool = True,
) -> Path:
    """Encode ``frames`` (T, H, W, 3) uint8 RGB to an H.264 mp4 at ``path``, atomically.

    yuv420p is chosen because every player reads it; it needs even width and height (odd sizes
    are refused rather than silently cropped). ``crf`` 18 is visually lossless for x264.
    ``threads=1`` (default) makes the file a pure function of the frames — multi-threaded x264
    output varies from run to run, and so does macroblock-tree rate control, which is then off —
    at a cost that is small next to sampling; 0 = x264's choice (faster, not reproducible).
    ``overwrite=False`` raises ``FileExistsError`` instead of replacing an existing file.
    Returns the final path.
    """
    target = Path(path)
    tmp_name = _encode_to_temp(
        target,
        frames,
        fps,
        crf=crf,
        codec=codec,
        pix_fmt=pix_fmt,
        preset=preset,
        threads=threads,
        options=options,
    )
    try:
        if overwrite:
            os.replace(tmp_name, target)
        else:
            _publish_exclusive(tmp_name, target)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    return target


def write_video_unique(
    path: str | os.PathLike[str],
    frames: np.ndarray | torch.Tensor,
    fps: float = 24,
    *,
    taken: Callable[[Path], bool] | None = None,
    max_tries: int = 10_000,
    **kwargs: Any,
) -> Path:
    """Like :func:`write_video`, but never replaces a file: ``name.mp4`` → ``name-1.mp4``, ``name-2.mp4`` ...

    The video is encoded once, then published under the first free name (atomic, no race between
    processes). ``taken(candidate)`` can veto names whose companions exist (e.g. a JSON sidecar).
    """
    target = Path(path)
    tmp_name = _encode_to_temp(
        target,
        frames,
        fps,
        crf=kwargs.pop("crf", 18),
        codec=kwargs.pop("codec", "libx264"),
        pix_fmt=kwargs.pop("pix_fmt", "yuv420p"),
        preset=kwargs.pop("preset", "medium"),
        threads=kwargs.pop("threads", 1),
        options=kwargs.pop("options", None),
    )
    if kwargs:
        Path(tmp_name).unlink(missing_ok=True)
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    try:
        for index in range(max_tries):
            candidate = target if index == 0 else target.with_name(f"{target.stem}-{index}{target.suffix}")
            if taken is not None and taken(candidate):
                continue
            try:
                _publish_exclusive(tmp_name, candidate)
            except FileExistsError:
                continue
            return candidate
        raise FileExistsError(f"no free name for {target} after {max_tries} tries")
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def probe_video(path: str | os.PathLike[str]) -> VideoInfo:
    """Frame count, size, fps, codec and pixel format of a video (frames are counted by decoding)."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            count = sum(1 for _ in container.decode(stream))
            rate = stream.average_rate or stream.base_rate
            return VideoInfo(
                num_frames=count,
                width=stream.codec_context.width,
                height=stream.codec_context.height,
                fps=float(rate) if rate else 0.0,
                codec=stream.codec_context.name,
                pix_fmt=str(stream.codec_context.pix_fmt),
            )
    except (OSError, av.FFmpegError, IndexError) as exc:
        raise InputError(f"cannot read video {path}: {exc}") from None


def read_video_frames(path: str | os.PathLike[str]) -> np.ndarray:
    """All frames of a video as (T, H, W, 3) uint8 RGB (PyAV; for tests and small clips)."""
    import av

    try:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (OSError, av.FFmpegError) as exc:
        raise InputError(f"cannot read video {path}: {exc}") from None
    if not frames:
        raise InputError(f"video {path} has no frames")
    return np.stack(frames)


def _pil_available() -> bool:
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        return False
    return True


def load_image(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an image file as (H, W, 3) uint8 RGB.

    PIL is used when installed (it is a dependency of diffusers), else PyAV's image decoders.
    Any alpha channel or palette is flattened the way PIL's ``convert("RGB")`` does, as the
    reference's callers do.
    """
    source = Path(path)
    if not source.is_file():
        raise InputError(
            f"image {source} does not exist or is not a file", hint="pass --image with a PNG/JPEG path"
        )
    if not os.access(source, os.R_OK):
        raise InputError(f"image {source} is not readable (permission denied)")
    if _pil_available():
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(source) as img:
                img.load()
                return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise InputError(
                f"cannot read image {source}: {exc}", hint="use a PNG, JPEG or WebP file"
            ) from None
    import av

    try:
        with av.open(str(source)) as container:
            frame = next(container.decode(video=0))
            return frame.to_ndarray(format="rgb24")
    except (OSError, av.FFmpegError, StopIteration) as exc:
        raise InputError(f"cannot read image {source}: {exc}", hint="use a PNG, JPEG or WebP file") from None


def resize_cover_center_crop(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Scale ``image`` (H, W, 3) uint8 so it covers ``width`` x ``height``, then cut the centred box.

    This is what the reference's demo app does before image-to-video (LANCZOS, scale =
    max(Wt/W, Ht/H), new size rounded, crop box edges rounded half-to-even), so an image that
    already has the target size passes through unchanged.
    """
    src_h, src_w = image.shape[:2]
    if (src_w, src_h) == (width, height):
        return image.copy()
    scale = max(width / src_w, height / src_h)
    new_w, new_h = max(round(src_w * scale), width), max(round(src_h * scale), height)
    left, top = (new_w - width) / 2, (new_h - height) / 2
    box = (round(left), round(top), round(left) + width, round(top) + height)
    if _pil_available():
        from PIL import Image

        img = Image.fromarray(image, mode="RGB") if image.dtype == np.uint8 else Image.fromarray(image)
        img = img.resize((new_w, new_h), resample=Image.LANCZOS)
        return np.asarray(img.crop(box), dtype=np.uint8).copy()
    return _resize_with_torch(image, new_w, new_h)[box[1] : box[3], box[0] : box[2]].copy()


def _resize_with_torch(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Fallback resize when PIL is absent (antialiased bicubic; close to, not equal to, LANCZOS)."""
    import torch

    x = torch.from_numpy(image).permute(2, 0, 1)[None].float()
    y = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True)
    return y[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def image_to_tensor(image: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 → (1, 3, 1, H, W) float32 in [-1, 1], exactly ``(u8 / 255 - 0.5) / 0.5``.

    Same arithmetic as torchvision ``ToTensor`` + ``Normalize(0.5, 0.5)`` in the reference.
    """
    import torch

    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div(255.0)
    x = (x - 0.5) / 0.5
    return x[None, :, None]


def frames_to_uint8(video: torch.Tensor) -> torch.Tensor:
    """Decoder output (B, 3, T, H, W) in [-1, 1] → (B, T, H, W, 3) uint8, as the reference rounds.

    ``x * 127.5 + 127.5``, clamped, then truncated to integers (``.byte()``), like
    ``decode_latent``; the input is not modified.
    """
    import torch

    out = video.float().mul(127.5).add(127.5).clamp(0, 255).to(torch.uint8)
    return out.permute(0, 2, 3, 4, 1).contiguous()
