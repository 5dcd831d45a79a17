"""The encode-latents pipeline: annotations → decoded clips → VAE + text encoders → latent cache.

Read :func:`run_encode` top to bottom:

1. validate the inputs (annotation file, VAE spec, text-encoder folder, buckets, frame contract);
2. build the provenance record and its fingerprint, and check the output folder against it
   (resume, refuse to mix, or ``--overwrite``);
3. shard the items over ranks (rank r takes items r, r+W, ...), skip clips already cached;
4. decode in DataLoader workers (or a prefetch thread) while the main thread encodes;
5. write one clip file per clip (atomic), then a per-rank manifest part; the main process merges
   the parts into ``manifest.jsonl`` and ``failures.jsonl`` once every rank is done.

A bad input never stops the run: it becomes a failure row with a reason (see
:data:`pfctl.data.video.REASONS`). Only too many failures (``max_failures``) make it exit 1.

Test hook: ``PFCTL_TEST_SLEEP_PER_CLIP=<seconds>`` sleeps after each written clip, so a test can
kill a real run half way and check that the rerun only encodes what is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pfctl.data import latent_cache as lc
from pfctl.data.annotations import Item, load_annotations
from pfctl.data.buckets import as_buckets
from pfctl.data.video import (
    REASONS,
    DecodedItem,
    FrameContract,
    FrameSettings,
    MediaError,
    clip_id_for,
    decode_item,
    open_video,
    plan_clips,
    plan_image,
    probe_image,
    probe_video,
    require_decord,
    to_model_input,
)
from pfctl.errors import CheckFailed, ConfigError, DistributedError, PfctlError
from pfctl.runtime import faults
from pfctl.runtime import logging as pflog
from pfctl.utils.io import fingerprint as stable_hash

if TYPE_CHECKING:
    from pfctl.config.encode import EncodeConfig
    from pfctl.config.schema import RecipeConfig
    from pfctl.runtime.accelerator import Runtime

STORAGE_DTYPE = torch.bfloat16
PREPROCESSING_VERSION = 1
"""Bumped when decoding/resizing changes in a way that changes pixels (part of the fingerprint)."""
_SLEEP_ENV = "PFCTL_TEST_SLEEP_PER_CLIP"
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class PlanRow:
    """Dry-run plan of one bucket × clip length."""

    bucket: str
    num_frames: int
    latent_shape: tuple[int, ...]
    clips: int
    cached: int
    bytes_per_clip: int


@dataclass
class EncodeReport:
    """What a run did (or, with ``dry_run``, would do). ``failed`` counts inputs; the rest count clips."""

    output_dir: str
    fingerprint: str
    dry_run: bool = False
    encoded: int = 0
    skipped: int = 0
    failed: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    manifest_clips: int = 0
    items: int = 0
    seconds: float = 0.0
    encode_seconds: float = 0.0
    world_size: int = 1
    is_main: bool = True
    stopped_early: bool = False
    plan: list[PlanRow] = field(default_factory=list)
    estimated_bytes: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def clips_per_s(self) -> float:
        """Encoded clips per second of the decode+encode loop (model loading excluded; slowest rank)."""
        return self.encoded / self.encode_seconds if self.encode_seconds > 0 else 0.0

    @property
    def manifest_path(self) -> Path:
        return Path(self.output_dir) / lc.MANIFEST_FILE

    @property
    def failures_path(self) -> Path:
        return Path(self.output_dir) / lc.FAILURES_FILE


# ------------------------------------------------------------------------------------- resolution


def resolve_dtype(config: RecipeConfig) -> torch.dtype:
    name = config.encode.dtype or config.model.dtype
    if name == "fp16":
        raise ConfigError(
            "model.dtype = 'fp16' cannot be used to encode latents: the causal VAE gives NaN latents in fp16",
            hint="set encode.dtype=bf16 (default) or fp32",
        )
    return _DTYPES[name]


def resolve_vae_spec(config: RecipeConfig) -> str:
    """``model.vae`` (folder or built-in name), else the model folder (its ``causal_video_vae/``)."""
    if config.model.vae:
        return config.model.vae
    if config.model.path:
        return config.model.path
    raise ConfigError(
        "no VAE given",
        hint="pass --vae FOLDER|NAME (e.g. causal-vae-tiny) or --model CHECKPOINT_FOLDER (uses causal_video_vae/)",
    )


def resolve_text_folder(config: RecipeConfig) -> tuple[Path, str] | None:
    """(folder, text-encoder kind) or None when text is not encoded. Raises :class:`ConfigError`."""
    if not config.encode.text:
        return None
    from pfctl.models.text_encoder import FLUX_SUBFOLDERS, detect_text_encoder_kind

    raw = config.encode.text_encoder or config.model.path
    if raw is None:
        raise ConfigError(
            "no text encoder folder: captions cannot be encoded",
            hint="set encode.text_encoder=FOLDER (or --model CHECKPOINT_FOLDER), or encode.text=false for latents only",
        )
    folder = Path(raw).expanduser()
    kind = detect_text_encoder_kind(folder) if folder.is_dir() else None
    if kind is None:
        raise ConfigError(
            f"{folder} has no text encoders (expected subfolders {', '.join(s + '/' for s in FLUX_SUBFOLDERS)})",
            hint="point encode.text_encoder at a Pyramid Flow checkpoint folder, or set encode.text=false",
        )
    return folder, kind


def text_identity(folder: Path, kind: str, max_sequence_length: int) -> dict[str, Any]:
    """The text encoder's identity without loading it: kind, length and a digest of its folders."""
    from pfctl.models.checkpoint import folder_digest
    from pfctl.models.text_encoder import TEXT_ENCODERS

    subfolders = TEXT_ENCODERS[kind].subfolders
    return {
        "kind": kind,
        "max_sequence_length": max_sequence_length,
        "folders": {s: folder_digest(folder / s) for s in subfolders},
    }


def _text_dims_from_folder(folder: Path, kind: str) -> tuple[int, int] | None:
    """(token dim, pooled dim) read from config.json files (dry-run size estimates, no loading)."""
    try:
        if kind == "pyramid_flux":
            t5 = json.loads((folder / "text_encoder_2" / "config.json").read_text())
            clip = json.loads((folder / "text_encoder" / "config.json").read_text())
            return int(t5["d_model"]), int(clip["hidden_size"])
        t5 = json.loads((folder / "text_encoder_3" / "config.json").read_text())
        c1 = json.loads((folder / "text_encoder" / "config.json").read_text())
        c2 = json.loads((folder / "text_encoder_2" / "config.json").read_text())
        return int(t5["d_model"]), int(c1["projection_dim"]) + int(c2["projection_dim"])
    except (OSError, KeyError, ValueError):
        return None


def normalization_record(vae: Any) -> dict[str, Any]:
    """The latent normalisation the trainer must apply, as JSON (adapter name + rule + factors)."""
    record: dict[str, Any] = {"adapter": vae.name}
    norm = getattr(vae, "latent_norm", None)
    if norm is not None and hasattr(norm, "to_dict"):
        record.update(norm.to_dict())
        return record
    config = dict(getattr(vae.module, "config", {}) or {})
    record["rule"] = (
        "(z - latents_mean) * scaling_factor / latents_std, else (z - shift_factor) * scaling_factor"
    )
    for key in ("scaling_factor", "shift_factor", "latents_mean", "latents_std", "invert_scale_latents"):
        if config.get(key) is not None:
            value = config[key]
            record[key] = list(value) if isinstance(value, tuple) else value
    return record


def frame_settings(cfg: EncodeConfig, contract: FrameContract, decode_threads: int) -> FrameSettings:
    return FrameSettings(
        contract=contract,
        buckets=tuple(as_buckets(cfg.buckets)),
        fps=cfg.fps,
        clip_mode=cfg.clip_mode,
        clips_per_video=cfg.clips_per_video,
        num_frames=cfg.num_frames,
        max_frames=cfg.max_frames,
        min_frames=cfg.min_frames,
        max_source_pixels=cfg.max_source_pixels,
        decode_threads=decode_threads,
    )


def preprocessing_record(cfg: EncodeConfig, settings: FrameSettings, seed: int) -> dict[str, Any]:
    """The parameters that change the cached tensors (only those relevant to the clip mode)."""
    record: dict[str, Any] = {
        "version": PREPROCESSING_VERSION,
        "fps": cfg.fps,
        "clip_mode": cfg.clip_mode,
        "buckets": [b.name for b in settings.buckets],
        "resize": "cover-bicubic-antialias+center-crop",
        "value_range": "[-1,1]",
        "chunking": cfg.chunking,
        "chunk_frames": cfg.chunk_frames,
        "tile": cfg.tile,
        "store": cfg.store,
        "storage_dtype": "bfloat16",
    }
    if cfg.clip_mode == "full":
        record["max_frames"] = settings.contract.snap(cfg.max_frames)
    else:
        record["num_frames"] = settings.clip_frames
    if cfg.clip_mode == "uniform":
        record["clips_per_video"] = cfg.clips_per_video
    if cfg.store == "sample":
        record["sample_seed"] = seed
    return record


def build_header(
    *,
    vae: Any,
    vae_spec: str,
    compute_dtype: torch.dtype,
    text: dict[str, Any] | None,
    text_dims: tuple[int, int] | None,
    preprocessing: dict[str, Any],
    store: str,
) -> dict[str, Any]:
    """cache.json: format, version, fingerprint and the provenance it hashes, plus what readers need."""
    from pfctl import __version__

    provenance = {
        "format_version": lc.FORMAT_VERSION,
        "vae": {
            "name": vae.name,
            "class": type(vae.module).__name__,
            "fingerprint": vae.fingerprint(),
            "compute_dtype": str(compute_dtype).removeprefix("torch."),
        },
        "text_encoder": text,
        "preprocessing": preprocessing,
    }
    latent_keys = lc.LATENT_KEYS_MEAN_STD if store == "mean_std" else lc.LATENT_KEYS_SAMPLE
    return {
        "format": lc.FORMAT_NAME,
        "format_version": lc.FORMAT_VERSION,
        "fingerprint": stable_hash(provenance),
        "provenance": provenance,
        "vae": {
            "name": vae.name,
            "class": type(vae.module).__name__,
            "spec": vae_spec,
            "latent_channels": vae.latent_channels,
            "spatial_factor": vae.spatial_factor,
            "temporal_factor": vae.temporal_factor,
            "normalization": normalization_record(vae),
        },
        "text_encoder": None
        if text is None
        else {
            "kind": text["kind"],
            "max_sequence_length": text["max_sequence_length"],
            "dim": text_dims[0] if text_dims else None,
            "pooled_dim": text_dims[1] if text_dims else None,
        },
        "store": store,
        "storage_dtype": "bfloat16",
        "latent_keys": list(latent_keys),
        "text_keys": list(lc.TEXT_KEYS) if text is not None else [],
        "null_text": lc.NULL_TEXT_FILE if text is not None else None,
        "tensor_layout": "latents [C, T, h, w] raw (not normalised); prompt_embeds [L, D]; mask [L]; pooled [Dp]",
        "created_by": f"pfctl {__version__}",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------- decoding


def candidate_clip_ids(item: Item, cfg: EncodeConfig) -> list[str]:
    """Every clip id an item can produce (a short video may produce fewer in ``uniform`` mode)."""
    if item.kind == "video" and item.frames is None and cfg.clip_mode == "uniform":
        return [clip_id_for(item.id, k, "uniform") for k in range(cfg.clips_per_video)]
    return [item.id]


class _DecodeDataset(torch.utils.data.Dataset):
    def __init__(self, work: list[tuple[Item, frozenset[str]]], settings: FrameSettings) -> None:
        self.work, self.settings = work, settings

    def __len__(self) -> int:
        return len(self.work)

    def __getitem__(self, index: int) -> DecodedItem:
        item, skip = self.work[index]
        return decode_item(item, self.settings, skip)


def _no_collate(x: Any) -> Any:
    return x


def _prefetch_thread(
    work: list[tuple[Item, frozenset[str]]],
    settings: FrameSettings,
    depth: int,
    pin: bool = False,
) -> Iterator[DecodedItem]:
    """Decode in one background thread (decord and torch release the GIL while they work).

    However the consumer stops (done, an error such as a full disk, or leaving the loop early), the thread
    is stopped and joined before this generator closes: it finishes the clip in hand, and the queue is
    drained so that a put it is blocked in returns. A decoder still running in native code when the
    interpreter exits can abort the process ("terminate called without an active exception") and turn a
    clean exit code into a crash."""
    box: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item, skip in work:
                if stop.is_set():
                    break
                decoded = decode_item(item, settings, skip)
                box.put(decoded.pin_memory() if pin else decoded)
        except BaseException as exc:
            box.put(exc)
        box.put(done)

    thread = threading.Thread(target=produce, name="pfctl-decode", daemon=True)
    thread.start()
    try:
        while True:
            got = box.get()
            if got is done:
                break
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                box.get(timeout=0.05)
        thread.join()


def decoded_items(
    work: list[tuple[Item, frozenset[str]]],
    settings: FrameSettings,
    num_workers: int,
    prefetch: int,
    pin: bool = False,
) -> Iterator[DecodedItem]:
    """Decoded items in order, decoded ahead of the consumer (workers or a thread); with ``pin``
    their frames arrive in page-locked memory (for a GPU encoder)."""
    if not work:
        return
    if num_workers > 0:
        loader = torch.utils.data.DataLoader(
            _DecodeDataset(work, settings),
            batch_size=None,
            shuffle=False,
            num_workers=min(num_workers, len(work)),
            prefetch_factor=prefetch,
            collate_fn=_no_collate,
            persistent_workers=False,
            pin_memory=pin,
        )
        yield from loader
        return
    yield from _prefetch_thread(work, settings, prefetch, pin)


# ---------------------------------------------------------------------------------------- encoding


def _clip_seed(seed: int, clip_id: str) -> int:
    return (seed * 1_000_003 + int(hashlib.sha1(clip_id.encode()).hexdigest()[:12], 16)) % (2**63)


def _text_row(embeddings: Any) -> dict[str, torch.Tensor]:
    """Batch-1 TextEmbeddings → cache tensors without the batch dimension (floats in bf16), left on
    the text encoder's device (the caller copies them to the host)."""
    return {
        "prompt_embeds": embeddings.prompt_embeds[0].to(STORAGE_DTYPE),
        "prompt_attention_mask": embeddings.prompt_attention_mask[0].to(torch.int64),
        "pooled_prompt_embeds": embeddings.pooled_prompt_embeds[0].to(STORAGE_DTYPE),
    }


def non_finite(tensors: dict[str, torch.Tensor]) -> str:
    """'' when every float tensor is finite, else which ones hold NaN/inf and how many values."""
    bad = []
    for name, t in sorted(tensors.items()):
        if t.is_floating_point():
            count = int((~torch.isfinite(t)).sum())
            if count:
                bad.append(f"{name} has {count} of {t.numel()} values NaN/inf")
    return "; ".join(bad)


def _failure_row(item: Item, error: MediaError, rank: int, clip_id: str | None = None) -> dict[str, Any]:
    return {
        "id": clip_id or item.id,
        "item_id": item.id,
        "line": item.line,
        "source": item.source,
        "reason": error.reason,
        "detail": error.detail,
        "rank": rank,
    }


@dataclass
class _InFlight:
    """A clip whose encode is queued on the device; its results are being copied to the host."""

    item: Item
    plan: Any
    latents: dict[str, torch.Tensor]  # host tensors, filled by copies queued without blocking
    text: dict[str, torch.Tensor]
    ready: Any = None  # a CUDA event recorded after those copies (None: already on the host)


def _to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Queue the copies to (page-locked) host memory; valid once the device reaches this point."""
    return {k: v.to("cpu", non_blocking=v.is_cuda) for k, v in tensors.items()}


@dataclass
class _Encoder:
    """The per-rank encoding state (models, writer, counters).

    Clips are pipelined one deep: :meth:`handle` queues a clip's encode on the device, then finishes
    the clip queued before it (waits for its latents, checks and writes them) while the device works
    on the new one, so the GPU does not idle while the host writes files. :meth:`finish` must be
    called once more at the end for the last clip; a clip still in flight when a run is killed was
    never written, and a resumed run encodes it again.
    """

    cfg: EncodeConfig
    vae: Any
    text_encoder: Any
    writer: lc.LatentCacheWriter
    device: torch.device
    dtype: torch.dtype
    seed: int
    rank: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    encoded: int = 0
    skipped: int = 0
    pending: _InFlight | None = None

    def posterior(self, frames: torch.Tensor) -> Any:
        """VAE posterior of uint8 (T, H, W, 3) frames.

        The uint8 frames go to the device first and are scaled there (in float32, then cast, as
        before): float32 pixels are 4x the bytes to move, and converting them on the host took a
        good part of a clip's GPU encode time. Page-locked frames (see ``decoded_items(pin=True)``)
        are copied without waiting for the clip before.
        """
        pixels = frames.to(self.device, non_blocking=frames.is_pinned())
        video = to_model_input(pixels).to(self.dtype).unsqueeze(0)  # (1, 3, T, H, W)
        return self.vae.encode(
            video, chunking=self.cfg.chunking, chunk_frames=self.cfg.chunk_frames, tile=self.cfg.tile
        )

    def encode_clip(self, frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """Posterior mean and std in the storage dtype, on the encoder's device."""
        posterior = self.posterior(frames)
        return {
            "latent_mean": posterior.mean[0].to(STORAGE_DTYPE),
            "latent_std": posterior.std[0].to(STORAGE_DTYPE),
        }

    def sample_clip(self, frames: torch.Tensor, clip_id: str) -> dict[str, torch.Tensor]:
        """One posterior sample (seeded by the clip id) in the storage dtype, on the encoder's device."""
        posterior = self.posterior(frames)
        generator = torch.Generator(device="cpu").manual_seed(_clip_seed(self.seed, clip_id))
        return {"latent_sample": posterior.sample(generator)[0].to(STORAGE_DTYPE)}

    def launch(self, item: Item, plan: Any, frames: torch.Tensor, text: dict[str, torch.Tensor]) -> _InFlight:
        """Queue one clip's encode and the copies of its results to the host."""
        if self.cfg.store == "sample":
            latents = self.sample_clip(frames, plan.clip_id)
        else:
            latents = self.encode_clip(frames)
        job = _InFlight(item=item, plan=plan, latents=_to_host(latents), text=_to_host(text))
        if self.device.type == "cuda":
            job.ready = torch.cuda.Event()
            job.ready.record()
        return job

    def clip_failed(self, item: Item, clip_id: str | None, reason: str, detail: str) -> int:
        """Record one clip's failure (it is not written; None: all clips of the item); return 1, the
        failure count it adds."""
        self.failures.append(_failure_row(item, MediaError(reason, detail), self.rank, clip_id))
        return 1

    def finish(self) -> int:
        """Write the clip in flight, if any; return 1 if it failed, else 0."""
        job, self.pending = self.pending, None
        if job is None:
            return 0
        try:
            if job.ready is not None:
                job.ready.synchronize()
        except Exception as exc:  # an error of the queued encode surfaces here
            return self.clip_failed(
                job.item, job.plan.clip_id, "encode_error", f"{type(exc).__name__}: {exc}"
            )
        latents, text = job.latents, job.text
        if faults.poisoned("encode_nan", clip=job.plan.clip_id):  # test hook
            latents = {k: torch.full_like(v, float("nan")) for k, v in latents.items()}
        bad = non_finite({**latents, **text})
        if bad:  # a NaN clip would poison every training step that draws it
            return self.clip_failed(job.item, job.plan.clip_id, "non_finite", bad)
        metadata = {
            "item_id": job.item.id,
            "kind": job.item.kind,
            "source": job.item.source,
            "source_path": str(job.item.path),
            "text": job.item.text,
            "line": str(job.item.line),
            "clip_index": str(job.plan.clip_index),
            "frame_indices": json.dumps(list(job.plan.frame_indices)),
            "num_frames": str(job.plan.num_frames),
            "fps": f"{job.plan.fps:g}",
            "source_fps": f"{job.plan.source_fps:g}",
            "source_size": f"{job.plan.source_width}x{job.plan.source_height}",
            "bucket": job.plan.bucket.name,
            "vae": self.vae.name,
            "vae_class": type(self.vae.module).__name__,
            "chunking": self.cfg.chunking,
            "chunk_frames": str(self.cfg.chunk_frames),
            "tile": str(self.cfg.tile),
            "store": self.cfg.store,
        }
        self.rows.append(self.writer.write(job.plan.clip_id, {**latents, **text}, metadata))
        self.encoded += 1
        sleep = float(os.environ.get(_SLEEP_ENV, "0") or 0)
        if sleep > 0:
            time.sleep(sleep)
        return 0

    def handle(self, decoded: DecodedItem) -> int:
        """Queue every clip of one decoded item (finishing the clip before each); return the number
        of failures that became known."""
        item = decoded.item
        if decoded.failure is not None:
            self.failures.append(_failure_row(item, decoded.failure, self.rank))
            return 1
        for clip_id in decoded.skipped:  # planned clips found in the cache
            row = self.writer.finished_row(clip_id)
            if row is not None:
                self.rows.append(row)
                self.skipped += 1
        if not decoded.plans:
            return 0
        try:
            text = _text_row(self.text_encoder.encode([item.text])) if self.text_encoder is not None else {}
        except PfctlError:
            raise
        except Exception as exc:
            return self.clip_failed(item, None, "encode_error", f"text: {exc}")
        failed = 0
        for plan, frames in zip(decoded.plans, decoded.frames, strict=True):
            try:
                job = self.launch(item, plan, frames, text)
            except PfctlError:
                raise  # a configuration problem (chunk size, tile): every clip would fail the same way
            except Exception as exc:
                failed += self.clip_failed(item, plan.clip_id, "encode_error", f"{type(exc).__name__}: {exc}")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            failed += self.finish()  # the clip before, while the device encodes this one
            self.pending = job
        return failed


# ------------------------------------------------------------------------------------------ run


def _load_text_encoder(folder: Path, kind: str, cfg: EncodeConfig, dtype: torch.dtype, device: torch.device):
    from pfctl.models.text_encoder import load_text_encoder

    return load_text_encoder(
        folder, model_name=kind, dtype=dtype, device=device, max_sequence_length=cfg.max_sequence_length
    )


def _latent_shape(vae: Any, num_frames: int, width: int, height: int) -> tuple[int, int, int, int]:
    latent_t = (num_frames - 1) // vae.temporal_factor + 1
    return (vae.latent_channels, latent_t, height // vae.spatial_factor, width // vae.spatial_factor)


def _bytes_per_clip(
    latent_shape: tuple[int, ...], store: str, text_dims: tuple[int, int] | None, seq: int
) -> int:
    n = 1
    for d in latent_shape:
        n *= d
    total = n * 2 * (2 if store == "mean_std" else 1) + 2048  # bf16 tensors + safetensors header/metadata
    if text_dims is not None:
        total += seq * text_dims[0] * 2 + seq * 8 + text_dims[1] * 2
    return total


def _dry_run(
    items: list[Item],
    cfg: EncodeConfig,
    settings: FrameSettings,
    vae: Any,
    header: dict[str, Any],
    text_dims: tuple[int, int] | None,
    root: Path,
    report: EncodeReport,
) -> EncodeReport:
    """Probe every input (no frames decoded beyond the first), plan clips and estimate the cache size."""
    existing = lc.read_header(root) if root.is_dir() else None
    writer = (
        lc.LatentCacheWriter(root, header)
        if existing and existing.get("fingerprint") == header["fingerprint"]
        else None
    )
    groups: dict[tuple[str, int], list[int]] = {}
    with pflog.progress("validating inputs", total=len(items)) as bar:
        for item in items:
            try:
                if item.kind == "image":
                    width, height = probe_image(item.path, settings.max_source_pixels)
                    plans = plan_image(item, width, height, settings)
                else:
                    info = probe_video(item.path, settings.max_source_pixels, reader=open_video(item.path))
                    plans = plan_clips(item, info, settings)
            except MediaError as exc:
                report.failures.append(_failure_row(item, exc, 0))
                bar.update(1, failed=len(report.failures))
                continue
            for plan in plans:
                counts = groups.setdefault((plan.bucket.name, plan.num_frames), [0, 0])
                counts[0] += 1
                counts[1] += int(writer is not None and writer.finished_row(plan.clip_id) is not None)
            bar.update(1, failed=len(report.failures))
    for (bucket_name, frames), (clips, cached) in sorted(groups.items()):
        width, height = (int(v) for v in bucket_name.split("x"))
        shape = _latent_shape(vae, frames, width, height)
        size = _bytes_per_clip(shape, cfg.store, text_dims, cfg.max_sequence_length)
        report.plan.append(PlanRow(bucket_name, frames, shape, clips, cached, size))
        report.estimated_bytes += size * (clips - cached)
    report.failed = len(report.failures)
    report.failures_by_reason = dict(Counter(f["reason"] for f in report.failures))
    report.skipped = sum(r.cached for r in report.plan)
    if text_dims is None and cfg.text:
        report.notes.append("text feature sizes unknown (no config.json found); estimate covers latents only")
    return report


def run_encode(
    config: RecipeConfig,
    *,
    runtime: Runtime | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    max_failures: int | None = None,
) -> EncodeReport:
    """Encode the annotated videos/images of ``config.encode`` into a latent cache.

    ``max_failures`` (or ``config.encode.max_failures``): more failed inputs than this raise
    :class:`CheckFailed` (exit 1) after the cache and failures.jsonl are written; the exception
    carries the report as ``.report``. With ``dry_run`` nothing is written.
    """
    start = time.monotonic()
    cfg = config.encode
    max_failures = cfg.max_failures if max_failures is None else max_failures

    # 1. inputs ----------------------------------------------------------------------------------
    if not cfg.annotations:
        raise ConfigError(
            "no annotations given",
            hint="pass --annotations FILE.jsonl|FILE.csv|FOLDER (or set encode.annotations)",
        )
    items = load_annotations(cfg.annotations)
    if any(item.kind == "video" for item in items):
        require_decord()
    vae_spec = resolve_vae_spec(config)
    dtype = resolve_dtype(config)
    text_source = resolve_text_folder(config)
    root = Path(cfg.output_dir).expanduser()

    if runtime is None:
        from pfctl.runtime.accelerator import build_runtime

        runtime = build_runtime(config.runtime)
    rank, world = runtime.rank, runtime.world_size
    if dry_run and not runtime.is_main:
        return EncodeReport(
            output_dir=str(root), fingerprint="", dry_run=True, is_main=False, world_size=world
        )

    from pfctl.models.vae import load_vae, with_fast_paths

    device = torch.device("cpu") if dry_run else runtime.device
    vae = with_fast_paths(load_vae(vae_spec, dtype=dtype, device=device), config.fast)
    need = max(cfg.num_frames, cfg.max_frames)
    contract = FrameContract.from_vae(vae, need)
    threads = 1 if cfg.num_workers > 0 else 0
    settings = frame_settings(cfg, contract, decode_threads=threads)
    _check_frames_and_buckets(cfg, settings, vae)

    # 2. provenance, fingerprint, folder check ---------------------------------------------------------
    text_id = text_identity(*text_source, cfg.max_sequence_length) if text_source else None
    text_dims = _text_dims_from_folder(*text_source) if text_source else None
    header = build_header(
        vae=vae,
        vae_spec=vae_spec,
        compute_dtype=dtype,
        text=text_id,
        text_dims=text_dims,
        preprocessing=preprocessing_record(cfg, settings, runtime.seed),
        store=cfg.store,
    )
    report = EncodeReport(
        output_dir=str(root), fingerprint=header["fingerprint"], dry_run=dry_run, items=len(items),
        world_size=world, is_main=runtime.is_main,
    )  # fmt: skip
    if settings.clip_frames != cfg.num_frames and cfg.clip_mode != "full":
        report.notes.append(
            f"num_frames {cfg.num_frames} snapped to {settings.clip_frames} (the VAE's frame contract)"
        )
    mode = lc.prepare_folder(root, header, overwrite=overwrite)  # read-only, every rank
    if dry_run:
        if mode == "overwrite":
            report.notes.append(f"--overwrite would delete the existing cache in {root}")
        report = _dry_run(items, cfg, settings, vae, header, text_dims, root, report)
        report.seconds = time.monotonic() - start
        return report

    text_encoder = _load_text_encoder(*text_source, cfg, dtype, device) if text_source else None
    if text_encoder is not None:
        header["text_encoder"]["dim"] = int(text_encoder.joint_attention_dim)
        header["text_encoder"]["pooled_dim"] = int(text_encoder.pooled_dim)
    writer = lc.LatentCacheWriter(root, header, rank=rank)
    runtime.barrier()  # every rank has checked the folder before the main process changes it
    if runtime.is_main:
        if mode == "overwrite":
            lc.clear_folder(root)
        root.mkdir(parents=True, exist_ok=True)
        if mode != "resume":
            writer.write_header()
        else:
            writer.header = lc.read_header(root) or header
        if (root / lc.PARTS_DIR).exists():  # left by a killed run; its clips are found by their files
            shutil.rmtree(root / lc.PARTS_DIR)
        lc.remove_stale_temp_files(root)
        if text_encoder is not None and not (root / lc.NULL_TEXT_FILE).is_file():
            writer.write_null_text({k: v.cpu() for k, v in _text_row(text_encoder.empty_embedding()).items()})
    runtime.barrier()

    # 3. this rank's share, minus finished clips ------------------------------------------------------
    old_rows = _old_manifest(root)
    encoder = _Encoder(
        cfg=cfg, vae=vae, text_encoder=text_encoder, writer=writer, device=device, dtype=dtype,
        seed=runtime.seed, rank=rank,
    )  # fmt: skip
    work: list[tuple[Item, frozenset[str]]] = []
    for item in items[rank::world]:
        cached = {}
        for clip_id in candidate_clip_ids(item, cfg):
            row = old_rows.get(clip_id)
            if row is not None and (root / row["path"]).is_file():
                cached[clip_id] = row
            else:
                found = writer.finished_row(clip_id)
                if found is not None:
                    cached[clip_id] = found
        if len(cached) == len(candidate_clip_ids(item, cfg)):
            encoder.rows.extend(cached.values())
            encoder.skipped += len(cached)
        else:
            work.append((item, frozenset(cached)))
    pflog.log(
        f"encode-latents: {len(items)} inputs, {world} process(es); this rank: {len(work)} to decode, "
        f"{encoder.skipped} clip(s) already cached; VAE {vae.name} on {device}, {cfg.chunking} chunking"
    )

    # 4. decode ahead, encode, write --------------------------------------------------------------------
    aborted: str | None = None
    failed_items = 0
    t0 = time.monotonic()
    try:
        with pflog.progress(f"encoding (rank {rank})" if world > 1 else "encoding", total=len(work)) as bar:
            pin = device.type == "cuda"
            # closed on the way out whatever happens (the decoders stop now, not whenever the error is freed)
            with contextlib.closing(
                decoded_items(work, settings, cfg.num_workers, cfg.prefetch, pin)
            ) as items:
                for decoded in items:
                    failed_items += encoder.handle(decoded)
                    rate = encoder.encoded / max(time.monotonic() - t0, 1e-9)
                    bar.update(1, clips=encoder.encoded, clips_per_s=f"{rate:.2f}", failed=failed_items)
                    if max_failures is not None and failed_items > max_failures:
                        report.stopped_early = True
                        break
            failed_items += encoder.finish()  # the last clip in flight
    except BaseException as exc:
        aborted = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        stats = {
            "rank": rank,
            "encoded": encoder.encoded,
            "skipped": encoder.skipped,
            "failed": len(encoder.failures),
            "stopped_early": report.stopped_early,
            "aborted": aborted,
            "loop_seconds": time.monotonic() - t0,
        }
        writer.write_part(encoder.rows, encoder.failures, stats)

    # 5. merge (main process) and summarise --------------------------------------------------------------
    if runtime.is_main:
        all_stats = lc.wait_for_parts(root, world)
        rows, failures = lc.merge_parts(root, world)
        broken = [s for s in all_stats if s.get("aborted")]
        if broken:
            raise DistributedError(
                f"rank {broken[0]['rank']} stopped with an error: {broken[0]['aborted']}",
                hint="see that rank's output; rerun the same command to resume (finished clips are kept)",
            )
        report.encoded = sum(s["encoded"] for s in all_stats)
        report.skipped = sum(s["skipped"] for s in all_stats)
        report.stopped_early = any(s["stopped_early"] for s in all_stats)
        report.encode_seconds = max(s["loop_seconds"] for s in all_stats)
        report.manifest_clips = len(rows)
        report.failures = failures
    else:
        report.encoded, report.skipped, report.failures = encoder.encoded, encoder.skipped, encoder.failures
        report.encode_seconds = stats["loop_seconds"]
    report.failed = len(report.failures)
    report.failures_by_reason = dict(Counter(f["reason"] for f in report.failures))
    report.seconds = time.monotonic() - start

    if max_failures is not None and report.failed > max_failures:
        error = CheckFailed(
            f"{report.failed} input(s) failed, more than max_failures={max_failures}"
            + (" (stopped early)" if report.stopped_early else ""),
            hint=f"see {report.failures_path} for the reasons; finished clips are kept and a rerun resumes",
        )
        error.report = report  # type: ignore[attr-defined]
        raise error
    if runtime.is_main and report.failed and report.manifest_clips == 0:
        error = CheckFailed(
            f"nothing was encoded: all {report.failed} input(s) failed",
            hint=f"see {report.failures_path} for the reasons",
        )
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report


def _old_manifest(root: Path) -> dict[str, dict[str, Any]]:
    path = root / lc.MANIFEST_FILE
    if not path.is_file():
        return {}
    try:
        return {row["id"]: row for row in lc._read_jsonl(path)}
    except PfctlError:
        return {}


def _check_frames_and_buckets(cfg: EncodeConfig, settings: FrameSettings, vae: Any) -> None:
    if cfg.clip_mode != "full" and settings.clip_frames < 1:
        raise ConfigError(
            f"encode.num_frames = {cfg.num_frames}: no valid frame count for VAE {vae.name} at or below it",
            hint=f"use e.g. {vae.valid_num_frames(max(cfg.num_frames, 1 + vae.temporal_factor) + vae.temporal_factor)}",
        )
    factor = vae.spatial_factor
    bad = [b.name for b in settings.buckets if b.width % factor or b.height % factor]
    if bad:
        raise ConfigError(
            f"encode.buckets {bad} are not multiples of the VAE's spatial factor {factor}",
            hint=f"round each side to a multiple of {factor} (e.g. 640x384)",
        )


__all__ = ["REASONS", "EncodeReport", "PlanRow", "run_encode"]
