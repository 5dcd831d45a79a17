"""Video decoding for encode-latents: probe, fps resampling, clip extraction, bucket crop, [-1, 1].

The pipeline per input, all on the CPU (it runs in DataLoader workers):

1. :func:`probe_video` opens the file (decord for frames, PyAV for stream facts and as a
   fallback decoder) and classifies any failure into a short *reason* (``empty_file``, ``not_a_video``, ``audio_only``, ``truncated`` ...) so a bad file
   is skipped and reported instead of killing a long run.
2. :func:`resample_indices` maps the target-fps timeline onto source frames (the reference
   reads consecutive source frames whatever the fps — its issue #148).
3. :func:`plan_clips` cuts clips (``head`` / ``uniform`` / ``full``) whose lengths obey the VAE's
   frame contract (``valid_num_frames``, e.g. ``1 + 8k``), and rejects videos that are too short.
4. :func:`read_clip` decodes only the needed frames, in chunks, resizing each chunk to *cover*
   the bucket and center-cropping it, so memory stays at one bucket-sized clip.
5. :func:`to_model_input` turns uint8 (T, H, W, 3) frames into float (3, T, H, W) in [-1, 1].

Frame arithmetic never depends on the VAE object itself: the contract arrives as a plain
lookup table (:class:`FrameContract`), so workers need no model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from pfctl.data.buckets import Bucket, center_crop_box, cover_size, nearest_bucket
from pfctl.errors import ConfigError

if TYPE_CHECKING:
    from pfctl.data.annotations import Item
    from pfctl.models.vae import VideoVAE

DECODE_CHUNK = 16
"""Frames decoded and resized at a time (bounds memory for high-resolution sources)."""

# Signatures of common video containers: a file that starts like one but cannot be opened or
# decoded is reported as ``truncated`` (cut short or corrupt) rather than ``not_a_video``.
_CONTAINER_MAGIC: tuple[tuple[int, bytes], ...] = (
    (4, b"ftyp"),  # MP4 / MOV / M4V / 3GP
    (4, b"moov"),
    (4, b"mdat"),
    (4, b"wide"),
    (4, b"free"),
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska / WebM
    (0, b"RIFF"),  # AVI
    (0, b"OggS"),
    (0, b"FLV"),
    (0, b"\x00\x00\x01\xba"),  # MPEG-PS
    (0, b"\x00\x00\x01\xb3"),  # MPEG-1/2 video
    (0, b"\x47"),  # MPEG-TS sync byte (weak; only consulted after a failed open)
)

REASONS: dict[str, str] = {
    "missing": "the file does not exist",
    "unreadable": "the file cannot be read (permissions, or not a regular file)",
    "empty_file": "the file has zero bytes",
    "not_a_video": "the content is not a recognised video or image format",
    "audio_only": "the file has audio but no video stream",
    "truncated": "the container is recognised but the video cannot be fully decoded (cut short or corrupt)",
    "too_short": "fewer frames than the clip needs at the target fps",
    "resolution_too_large": "frame size exceeds encode.max_source_pixels",
    "decode_error": "the decoder failed for another reason",
    "encode_error": "the VAE or text encoder failed on this clip",
    "non_finite": "the VAE or text encoder produced NaN/inf values for this clip (not written)",
}
"""Every failure reason the summary and failures.jsonl can contain."""


class MediaError(Exception):
    """One input cannot be used; ``reason`` is a key of :data:`REASONS`, ``detail`` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self):  # rebuilt with both fields after crossing a DataLoader worker's pipe
        return (type(self), (self.reason, self.detail))


# ------------------------------------------------------------------------------------ contract


@dataclass(frozen=True)
class FrameContract:
    """The VAE's valid pixel-frame counts as a table: ``table[n]`` = largest valid count ≤ n (0: none).

    Built once from ``vae.valid_num_frames`` in the main process; picklable for workers.
    """

    table: tuple[int, ...]

    @classmethod
    def from_vae(cls, vae: VideoVAE, max_frames: int) -> FrameContract:
        return cls(tuple(int(vae.valid_num_frames(n)) for n in range(max_frames + 1)))

    @classmethod
    def one_plus_multiple(cls, factor: int, max_frames: int) -> FrameContract:
        """``1 + factor·k`` (the causal-VAE contract) — for planning without a VAE at hand."""
        return cls(tuple(0 if n < 1 else 1 + ((n - 1) // factor) * factor for n in range(max_frames + 1)))

    def snap(self, n: int) -> int:
        if n < 0:
            return 0
        return self.table[min(n, len(self.table) - 1)]


@dataclass(frozen=True)
class FrameSettings:
    """Everything a worker needs to plan and decode clips (picklable, no model)."""

    contract: FrameContract
    buckets: tuple[Bucket, ...]
    fps: float | None = 24.0
    clip_mode: str = "head"
    clips_per_video: int = 1
    num_frames: int = 121
    max_frames: int = 241
    min_frames: int = 9
    max_source_pixels: int = 4096 * 2304
    decode_threads: int = 1

    @property
    def clip_frames(self) -> int:
        """Snapped frames of a head/uniform clip."""
        return self.contract.snap(self.num_frames)


# ------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class VideoInfo:
    num_frames: int
    fps: float
    width: int
    height: int


@dataclass(frozen=True)
class ClipPlan:
    """One clip to encode: which source frames, at what fps, into which bucket."""

    clip_id: str
    item_id: str
    clip_index: int
    frame_indices: tuple[int, ...]
    bucket: Bucket
    fps: float
    source_fps: float
    source_width: int
    source_height: int

    @property
    def num_frames(self) -> int:
        return len(self.frame_indices)


def resample_indices(num_source_frames: int, source_fps: float, target_fps: float | None) -> list[int]:
    """Source frame shown at each tick of the target-fps timeline.

    Output frame j is at time j / target_fps; source frame i is on screen during
    [i / source_fps, (i+1) / source_fps), so j maps to floor(j · source_fps / target_fps). The
    timeline stops before the source runs out. Lower target fps skips frames, higher repeats them.
    """
    if num_source_frames <= 0:
        return []
    if target_fps is None or source_fps <= 0 or math.isclose(source_fps, target_fps, rel_tol=1e-6):
        return list(range(num_source_frames))
    step = source_fps / target_fps
    count = math.ceil(num_source_frames / step - 1e-9)
    indices = [math.floor(j * step + 1e-9) for j in range(count)]
    return [i for i in indices if i < num_source_frames]


def clip_starts(available: int, length: int, mode: str, clips_per_video: int) -> list[int]:
    """Start offsets (in target frames) of the clips of a video with ``available`` frames."""
    if length <= 0 or available < length:
        return []
    if mode != "uniform" or clips_per_video == 1:
        return [0]
    room = available - length
    starts = [round(k * room / (clips_per_video - 1)) for k in range(clips_per_video)]
    return sorted(set(starts))


def clip_id_for(item_id: str, clip_index: int, mode: str) -> str:
    """Clip ids: the item id, or ``<item id>#<k>`` for the k-th clip in ``uniform`` mode."""
    return f"{item_id}#{clip_index}" if mode == "uniform" else item_id


def plan_clips(item: Item, info: VideoInfo, settings: FrameSettings) -> list[ClipPlan]:
    """The clips of one probed video. Raises :class:`MediaError` (``too_short``)."""
    bucket = nearest_bucket(info.width, info.height, settings.buckets)
    source_fps = item.fps or info.fps
    contract = settings.contract
    limit = settings.max_frames if settings.clip_mode == "full" else settings.num_frames

    def make(index: int, frames: Sequence[int], fps: float) -> ClipPlan:
        return ClipPlan(
            clip_id=clip_id_for(item.id, index, settings.clip_mode),
            item_id=item.id,
            clip_index=index,
            frame_indices=tuple(int(f) for f in frames),
            bucket=bucket,
            fps=fps,
            source_fps=source_fps,
            source_width=info.width,
            source_height=info.height,
        )

    if item.frames is not None:  # explicit source frames: used as listed, no resampling
        bad = [f for f in item.frames if f >= info.num_frames]
        if bad:
            raise MediaError(
                "too_short",
                f"annotation lists frame {bad[0]} but the video has {info.num_frames} frames",
            )
        length = contract.snap(min(len(item.frames), limit))
        if length < 1:
            raise MediaError("too_short", f"{len(item.frames)} listed frames; the VAE needs more")
        return [make(0, item.frames[:length], source_fps)]

    timeline = resample_indices(info.num_frames, source_fps, settings.fps)
    target_fps = settings.fps or source_fps
    if settings.clip_mode == "full":
        length = contract.snap(min(len(timeline), settings.max_frames))
        if length < settings.min_frames or length < 1:
            raise MediaError(
                "too_short",
                f"{info.num_frames} frames at {source_fps:g} fps give {len(timeline)} frames at "
                f"{target_fps:g} fps; a full clip needs at least {settings.min_frames}",
            )
        return [make(0, timeline[:length], target_fps)]

    length = settings.clip_frames
    starts = clip_starts(len(timeline), length, settings.clip_mode, settings.clips_per_video)
    if not starts:
        seconds = length / target_fps
        raise MediaError(
            "too_short",
            f"{info.num_frames} frames at {source_fps:g} fps give {len(timeline)} frames at {target_fps:g} fps; "
            f"a clip needs {length} ({seconds:.2f} s)",
        )
    return [make(k, timeline[s : s + length], target_fps) for k, s in enumerate(starts)]


def plan_image(item: Item, width: int, height: int, settings: FrameSettings) -> list[ClipPlan]:
    """An image is a one-frame clip (valid for causal VAEs: 1 = 1 + 8·0)."""
    if settings.contract.snap(1) != 1:
        raise MediaError("too_short", "the VAE cannot encode single frames, so images are not supported")
    bucket = nearest_bucket(width, height, settings.buckets)
    return [
        ClipPlan(
            clip_id=item.id,
            item_id=item.id,
            clip_index=0,
            frame_indices=(0,),
            bucket=bucket,
            fps=0.0,
            source_fps=0.0,
            source_width=width,
            source_height=height,
        )
    ]


# -------------------------------------------------------------------------------------- probing


def _sniff_container(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return False
    return any(head[off : off + len(magic)] == magic for off, magic in _CONTAINER_MAGIC)


def check_file(path: Path) -> None:
    """Existence, type and size checks shared by videos and images."""
    if not path.exists():
        raise MediaError("missing", f"{path} does not exist")
    if not path.is_file():
        raise MediaError("unreadable", f"{path} is not a regular file")
    if not os.access(path, os.R_OK):
        raise MediaError("unreadable", f"{path} is not readable (permissions)")
    if path.stat().st_size == 0:
        raise MediaError("empty_file", f"{path} has zero bytes")


def _classify_failure(path: Path, message: str) -> MediaError:
    """Neither decoder could use the file: say what it looks like (audio only, cut short, not media)."""
    try:
        import av

        with av.open(str(path)) as container:
            if not container.streams.video:
                if container.streams.audio:
                    return MediaError(
                        "audio_only", f"{path} has {len(container.streams.audio)} audio stream(s), no video"
                    )
                return MediaError("not_a_video", f"{path} has no video stream")
            return MediaError("truncated", f"{path} has a video stream that cannot be decoded ({message})")
    except Exception as exc:
        message = str(exc)[:200] or message
    if _sniff_container(path):
        return MediaError(
            "truncated", f"{path} looks like a video container but cannot be opened ({message})"
        )
    return MediaError("not_a_video", f"{path} is not a recognised video format ({message})")


class VideoReader:
    """Frames from decord; stream facts (and, where decord fails, the frames too) from PyAV.

    decord 0.6 mis-sizes frames of some widths (e.g. 48 or 72 pixels: wrong shapes or a copy
    error) and cannot open some files PyAV reads; rather than lose those inputs, this reader
    checks every batch's shape against the stream's and falls back to sequential PyAV decoding.
    """

    def __init__(self, path: Path, threads: int = 1) -> None:
        import decord

        self._vr = None
        self._av: tuple[Any, Any] | None = None  # (container, frame iterator) while decoding with PyAV
        self._av_next = 0
        check_file(path)
        self.path = path
        self.backend = "decord"
        message = ""
        try:
            self._vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=threads)
        except Exception as exc:
            message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        facts = self._stream_facts()
        if facts is None:
            raise _classify_failure(path, message)
        self.width, self.height, av_fps, av_frames = facts
        if self._vr is not None:
            self.num_frames = len(self._vr)
            self.fps = float(self._vr.get_avg_fps() or 0.0) or av_fps
        else:
            self.backend = "pyav"
            self.num_frames, self.fps = av_frames or self._count_frames(), av_fps
        if not math.isfinite(self.fps) or self.fps <= 0:
            self.fps = 0.0

    def _stream_facts(self) -> tuple[int, int, float, int] | None:
        import av

        try:
            with av.open(str(self.path)) as container:
                if not container.streams.video:
                    return None
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate or 0
                width, height = stream.codec_context.width, stream.codec_context.height
                if not width or not height:
                    return None
                return int(width), int(height), float(rate), int(stream.frames or 0)
        except Exception:
            return None

    def _count_frames(self) -> int:
        import av

        with av.open(str(self.path)) as container:
            stream = container.streams.video[0]
            return sum(1 for packet in container.demux(stream) if packet.size)

    def __len__(self) -> int:
        return self.num_frames

    def get_frames(self, indices: Sequence[int]) -> np.ndarray:
        """uint8 (len(indices), H, W, 3) for sorted, unique ``indices``."""
        if self._vr is not None:
            try:
                batch = self._vr.get_batch(list(indices)).asnumpy()
                if batch.shape == (len(indices), self.height, self.width, 3):
                    return batch
            except Exception as exc:
                if "DECORDArrayCopyFromTo" not in str(exc):
                    raise MediaError(
                        "truncated",
                        f"frames {indices[0]}..{indices[-1]} cannot be decoded ({str(exc)[:200]})",
                    ) from None
            self._vr, self.backend = None, "pyav"  # decord mis-sized this stream: PyAV from here on
        return self._pyav_frames(indices)

    def _pyav_frames(self, indices: Sequence[int]) -> np.ndarray:
        import av

        if self._av is None or indices[0] < self._av_next:
            self.close()
            container = av.open(str(self.path))
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            self._av, self._av_next = (container, container.decode(stream)), 0
        wanted, out = set(indices), {}
        try:
            for frame in self._av[1]:
                index = self._av_next
                self._av_next += 1
                if index in wanted:
                    out[index] = frame.to_ndarray(format="rgb24")
                if index >= indices[-1]:
                    break
        except Exception as exc:
            raise MediaError(
                "truncated", f"decoding stopped at frame {self._av_next} ({str(exc)[:200]})"
            ) from None
        missing = [i for i in indices if i not in out]
        if missing:
            raise MediaError(
                "truncated",
                f"the stream ends after {self._av_next} frames; frame {missing[0]} (of {self.num_frames} declared) is missing",
            )
        return np.stack([out[i] for i in indices])

    def close(self) -> None:
        if self._av is not None:
            self._av[0].close()
            self._av = None

    def __del__(self) -> None:
        if getattr(self, "_av", None) is not None:
            self.close()


def open_video(path: Path, threads: int = 1) -> VideoReader:
    """A :class:`VideoReader`; failures become :class:`MediaError` with a classified reason."""
    return VideoReader(path, threads=threads)


def probe_video(
    path: Path, max_source_pixels: int | None = None, reader: VideoReader | None = None
) -> VideoInfo:
    """Frame count, fps and size of a video (no frame decoded); raises :class:`MediaError`."""
    reader = reader if reader is not None else open_video(path)
    if reader.num_frames <= 0:
        raise MediaError("truncated", f"{path} has a video stream without frames")
    width, height = reader.width, reader.height
    if max_source_pixels is not None and width * height > max_source_pixels:
        raise MediaError(
            "resolution_too_large",
            f"{path} is {width}x{height} ({width * height} pixels > encode.max_source_pixels {max_source_pixels})",
        )
    return VideoInfo(num_frames=reader.num_frames, fps=reader.fps, width=width, height=height)


def probe_image(path: Path, max_source_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of an image; raises :class:`MediaError`."""
    from PIL import Image, UnidentifiedImageError

    check_file(path)
    try:
        with Image.open(path) as img:
            width, height = img.size
    except UnidentifiedImageError:
        raise MediaError("not_a_video", f"{path} is not a recognised image format") from None
    except OSError as exc:
        raise MediaError("truncated", f"{path}: {exc}") from None
    if max_source_pixels is not None and width * height > max_source_pixels:
        raise MediaError(
            "resolution_too_large",
            f"{path} is {width}x{height} ({width * height} pixels > encode.max_source_pixels {max_source_pixels})",
        )
    return width, height


# ------------------------------------------------------------------------------------- decoding


def resize_cover_crop(frames: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """uint8 (T, H, W, 3) → uint8 (T, bucket.height, bucket.width, 3): resize to cover, center crop.

    Bicubic with antialiasing (the reference uses bicubic; antialiasing avoids aliasing when
    downscaling 1080p sources by 3x).
    """
    _, h, w, _ = frames.shape
    new_w, new_h = cover_size(w, h, bucket)
    if (new_w, new_h) != (w, h):
        x = frames.permute(0, 3, 1, 2).float()  # (T, 3, H, W)
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False)
        frames = x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    x0, y0 = center_crop_box(new_w, new_h, bucket)
    return frames[:, y0 : y0 + bucket.height, x0 : x0 + bucket.width, :].contiguous()


def require_decord() -> None:
    """Raise :class:`ConfigError` (exit 2) when decord cannot be imported.

    Called once before an encode that has videos to decode: otherwise every video would fail on
    its own, inside the decode workers, and the run would end with a failure log and no latents.
    """
    try:
        import decord  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"encode-latents decodes videos with decord, which cannot be imported here ({exc})",
            hint="install it: pip install decord (or the maintained fork decord2, same import name)",
        ) from None


def to_model_input(frames: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 (T, H, W, 3) → float (3, T, H, W) in [-1, 1] (0 → -1, 255 → 1); a batch (B, T, H, W, 3)
    → (B, 3, T, H, W)."""
    x = frames.movedim(-1, -4).to(dtype)
    return x.div_(127.5).sub_(1.0)


def read_clip(reader: VideoReader, plan: ClipPlan, chunk: int = DECODE_CHUNK) -> torch.Tensor:
    """Decode ``plan.frame_indices`` (chunked), resized and cropped to the bucket: uint8 (T, h, w, 3)."""
    unique = sorted(set(plan.frame_indices))
    decoded: dict[int, torch.Tensor] = {}
    for start in range(0, len(unique), chunk):
        part = unique[start : start + chunk]
        batch = reader.get_frames(part)
        resized = resize_cover_crop(torch.from_numpy(np.ascontiguousarray(batch)), plan.bucket)
        decoded.update(zip(part, resized, strict=True))
    return torch.stack([decoded[i] for i in plan.frame_indices])


def read_image(path: Path, plan: ClipPlan) -> torch.Tensor:
    """An image as a one-frame clip: uint8 (1, h, w, 3) cropped to the bucket."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            array = np.asarray(img.convert("RGB"))
    except OSError as exc:
        raise MediaError("truncated", f"{path}: {exc}") from None
    return resize_cover_crop(torch.from_numpy(array.copy()).unsqueeze(0), plan.bucket)


@dataclass
class DecodedItem:
    """What a worker hands the encoder for one item: its clips (uint8) or why it failed."""

    item: Item
    plans: list[ClipPlan] = field(default_factory=list)
    frames: list[torch.Tensor] = field(default_factory=list)
    failure: MediaError | None = None
    skipped: list[str] = field(default_factory=list)  # planned clip ids already in the cache

    def pin_memory(self) -> DecodedItem:
        """Page-locked frames (what ``DataLoader(pin_memory=True)`` calls): their copy to the GPU
        can then be queued without waiting for the GPU's earlier work."""
        return replace(self, frames=[f.pin_memory() for f in self.frames])


def _drop_cached(out: DecodedItem, plans: list[ClipPlan], skip: frozenset[str]) -> list[ClipPlan]:
    out.skipped = [p.clip_id for p in plans if p.clip_id in skip]
    return [p for p in plans if p.clip_id not in skip]


def decode_item(item: Item, settings: FrameSettings, skip: frozenset[str] = frozenset()) -> DecodedItem:
    """Probe, plan and decode every clip of ``item`` not in ``skip`` (already cached).

    Never raises for a bad input: the failure is returned so the run can continue.
    """
    out = DecodedItem(item=item)
    try:
        if item.kind == "image":
            width, height = probe_image(item.path, settings.max_source_pixels)
            out.plans = _drop_cached(out, plan_image(item, width, height, settings), skip)
            out.frames = [read_image(item.path, p) for p in out.plans]
            return out
        reader = open_video(item.path, threads=settings.decode_threads)
        try:
            info = probe_video(item.path, settings.max_source_pixels, reader=reader)
            out.plans = _drop_cached(out, plan_clips(item, info, settings), skip)
            out.frames = [read_clip(reader, p) for p in out.plans]
        finally:
            reader.close()
    except MediaError as exc:
        out.plans, out.frames, out.failure = [], [], exc
    except Exception as exc:
        out.plans, out.frames = [], []
        out.failure = MediaError("decode_error", f"{type(exc).__name__}: {exc}")
    return out
