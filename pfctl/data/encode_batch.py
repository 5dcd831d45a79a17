"""The per-rank encoder of encode-latents: clips batched by shape, captions encoded once, writes behind.

:class:`BatchEncoder` takes decoded items in input order (:meth:`BatchEncoder.add`) and

1. groups their clips by shape (frames x height x width): a group that reaches ``encode.batch_size``
   clips goes through the VAE in one call; :meth:`BatchEncoder.flush` sends the rest (the last batch of
   each shape may be smaller). The VAE works per sample (the causal VAE's norms are per frame, the
   diffusers VAEs' GroupNorms per sample), so a clip's latents do not depend on its batch beyond float
   rounding; with one clip per batch the calls are those of a clip-by-clip encode;
2. encodes a batch's captions not seen yet in one call of the text encoders (:class:`CaptionCache`:
   each caption once per run, as long as it stays among the last ``TEXT_CACHE_SIZE`` used);
3. queues the copies of the results to the host and hands the batch to the writer thread
   (:class:`pfctl.data.encode_writer.AsyncWriter`), which waits for the device, checks the values
   and writes one file per clip; meanwhile this thread queues the next batch on the device.

A batch the device cannot hold (out of memory) is split in halves and the smaller size kept; a batch
that fails otherwise is encoded clip by clip; a single clip that fails is a failure row, as before. Counters, manifest rows
and failures live in a :class:`Tally` both threads update.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pfctl.data import latent_cache as lc
from pfctl.data.annotations import Item
from pfctl.data.encode_writer import AsyncWriter, StageClock
from pfctl.data.video import DecodedItem, MediaError, to_model_input
from pfctl.errors import PfctlError
from pfctl.runtime import faults

STORAGE_DTYPE = torch.bfloat16
TEXT_CACHE_SIZE = 256
"""Captions whose text features stay in host memory (least recently used dropped first; ~1 MiB each
with T5-XXL at 128 tokens)."""
WRITE_QUEUE_DEPTH = 2
"""Batches waiting for the writer thread; the encoder waits when the queue is full."""


def text_row(embeddings: Any, index: int = 0) -> dict[str, torch.Tensor]:
    """Row ``index`` of TextEmbeddings → cache tensors without the batch dimension (floats in bf16),
    left on the text encoder's device (the caller copies them to the host)."""
    return {
        "prompt_embeds": embeddings.prompt_embeds[index].to(STORAGE_DTYPE),
        "prompt_attention_mask": embeddings.prompt_attention_mask[index].to(torch.int64),
        "pooled_prompt_embeds": embeddings.pooled_prompt_embeds[index].to(STORAGE_DTYPE),
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


def failure_row(item: Item, error: MediaError, rank: int, clip_id: str | None = None) -> dict[str, Any]:
    return {
        "id": clip_id or item.id,
        "item_id": item.id,
        "line": item.line,
        "source": item.source,
        "reason": error.reason,
        "detail": error.detail,
        "rank": rank,
    }


def clip_seed(seed: int, clip_id: str) -> int:
    return (seed * 1_000_003 + int(hashlib.sha1(clip_id.encode()).hexdigest()[:12], 16)) % (2**63)


def _to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Queue the copies to (page-locked) host memory; valid once the device reaches this point."""
    return {k: v.to("cpu", non_blocking=v.is_cuda) for k, v in tensors.items()}


class Tally:
    """What a rank did, updated by the encoding thread and the writer thread (under one lock).

    An input counts as done (``items_done``, the progress bar) once each of its clips is written or
    has failed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.encoded = self.skipped = self.items_done = 0
        self._open: dict[int, int] = {}  # input number -> clips not finished yet

    def expect(self, key: int, clips: int) -> None:
        with self.lock:
            if clips:
                self._open[key] = clips
            else:
                self.items_done += 1

    def _close(self, key: int | None) -> None:
        if key is not None:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]
                self.items_done += 1

    def written(self, row: dict[str, Any], key: int | None) -> None:
        with self.lock:
            self.rows.append(row)
            self.encoded += 1
            self._close(key)

    def failed(self, row: dict[str, Any], key: int | None = None) -> None:
        with self.lock:
            self.failures.append(row)
            self._close(key)

    def cached(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.rows.append(row)
            self.skipped += 1


class CaptionCache:
    """Text features per caption on the host, encoded once: :meth:`lookup` encodes the captions it does
    not hold in one call (one by one if that call fails, to find the failing caption)."""

    def __init__(self, text_encoder: Any, size: int = TEXT_CACHE_SIZE) -> None:
        self.text_encoder, self.size = text_encoder, size
        self.rows: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    def _encode(self, captions: list[str]) -> dict[str, dict[str, torch.Tensor] | str]:
        try:
            embeddings = self.text_encoder.encode(captions)
            return {c: _to_host(text_row(embeddings, i)) for i, c in enumerate(captions)}
        except PfctlError:
            raise
        except Exception as exc:
            if len(captions) == 1:
                return {captions[0]: f"text: {exc}"}
        return {k: v for c in captions for k, v in self._encode([c]).items()}

    def lookup(self, captions: list[str]) -> dict[str, dict[str, torch.Tensor] | str]:
        """Caption → its host tensors (filled by copies queued on the device), or why it failed."""
        missing = [c for c in dict.fromkeys(captions) if c not in self.rows]
        found = self._encode(missing) if missing else {}
        for caption in dict.fromkeys(captions):
            if caption in self.rows:
                self.rows.move_to_end(caption)
                found[caption] = self.rows[caption]
            elif isinstance(found[caption], dict):
                self.rows[caption] = found[caption]
        while len(self.rows) > self.size:
            self.rows.popitem(last=False)
        return found


@dataclass
class Clip:
    """One decoded clip waiting for its batch; ``key`` numbers its input (progress)."""

    item: Item
    plan: Any
    frames: torch.Tensor
    key: int


@dataclass
class Batch:
    """Clips whose encode is queued on the device; their results are being copied to the host."""

    clips: list[Clip]
    latents: list[dict[str, torch.Tensor]]  # host tensors, filled by copies queued without blocking
    texts: list[dict[str, torch.Tensor]]
    marks: list[tuple[str, Any]]
    ready: Any = None  # a CUDA event recorded after those copies (None: already on the host)


@dataclass
class BatchEncoder:
    """The per-rank encoding state: models, batches waiting by shape, caption cache, writer, tally."""

    cfg: Any
    vae: Any
    text_encoder: Any
    writer: lc.LatentCacheWriter
    device: torch.device
    dtype: torch.dtype
    seed: int
    rank: int
    batch_size: int = 1
    tally: Tally = field(default_factory=Tally)
    notes: list[str] = field(default_factory=list)
    groups: dict[tuple[int, ...], list[Clip]] = field(default_factory=dict)
    output: AsyncWriter | None = None

    def __post_init__(self) -> None:
        self.captions = CaptionCache(self.text_encoder) if self.text_encoder is not None else None
        self.clock = StageClock(self.device)
        self.static_meta = {
            "vae": self.vae.name, "vae_class": type(self.vae.module).__name__, "chunking": self.cfg.chunking,
            "chunk_frames": str(self.cfg.chunk_frames), "tile": str(self.cfg.tile), "store": self.cfg.store,
        }  # fmt: skip

    # -- taking decoded items (encoding thread) -------------------------------------------------------
    def add(self, decoded: DecodedItem, key: int) -> None:
        """Take one decoded item: its failure, its cached clips, and its clips into their shape's batch
        (a full batch is queued on the device at once)."""
        item = decoded.item
        if decoded.failure is not None:
            self.tally.expect(key, 0)
            self.tally.failed(failure_row(item, decoded.failure, self.rank))
            return
        for clip_id in decoded.skipped:  # planned clips found in the cache
            row = self.writer.finished_row(clip_id)
            if row is not None:
                self.tally.cached(row)
        self.tally.expect(key, len(decoded.plans))
        for plan, frames in zip(decoded.plans, decoded.frames, strict=True):
            group = self.groups.setdefault(tuple(frames.shape), [])
            group.append(Clip(item, plan, frames, key))
            if len(group) >= self.batch_size:
                del self.groups[tuple(frames.shape)]
                self.launch(group)

    def flush(self) -> None:
        """Queue every batch still waiting for clips of its shape."""
        groups, self.groups = self.groups, {}
        for clips in groups.values():
            self.launch(clips)

    @contextmanager
    def running(self) -> Iterator[BatchEncoder]:
        """The writer thread, for the time of the loop; on the way out (whatever happens) every batch
        queued before is written and the thread joined."""
        self.output = AsyncWriter(self.write_batch, WRITE_QUEUE_DEPTH)
        try:
            yield self
        finally:
            output, self.output = self.output, None
            output.close()
            self.clock.seconds["write_wait"] += output.wait_seconds

    # -- the device work (encoding thread) -------------------------------------------------------------
    def launch(self, clips: list[Clip]) -> None:
        """Queue ``clips`` (one shape) on the device in batches of at most ``batch_size``."""
        while clips:  # the size is read again for each batch: a failed batch may have lowered it
            batch, clips = clips[: self.batch_size], clips[self.batch_size :]
            self._launch(batch)

    def _launch(self, clips: list[Clip]) -> None:
        marks = self.clock.start()
        clips, texts = self._texts(clips)
        self.clock.mark(marks, "text")
        if not clips:
            return
        error = None
        try:
            latents = self._latents(clips, marks)
        except PfctlError:
            raise  # a configuration problem (chunk size, tile): every clip would fail the same way
        except Exception as exc:  # handled below, once its traceback (and the activations it holds) is freed
            error = f"{type(exc).__name__}: {exc}"
            out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)
        if error is not None:
            self._retry(clips, error, out_of_memory)
            return
        batch = Batch(clips, [_to_host(t) for t in latents], texts, marks)
        self.clock.mark(marks, "copy_back")
        if self.device.type == "cuda":
            batch.ready = torch.cuda.Event()
            batch.ready.record()
        self.output.put(batch)

    def _retry(self, clips: list[Clip], error: str, out_of_memory: bool) -> None:
        """After a failed call: one clip is a failure row; a batch out of memory is split in halves (the
        smaller size kept for the rest of the run); a batch that failed otherwise is encoded clip by
        clip, so only the clips that fail alone are failures."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(clips) == 1:
            self.fail(clips[0], "encode_error", error)
        elif out_of_memory:
            self.batch_size = max(1, len(clips) // 2)
            self.notes.append(
                f"a batch of {len(clips)} clips ran out of memory; batch size {self.batch_size} from then on"
            )
            self.launch(clips)
        else:
            for clip in clips:
                self._launch([clip])

    def _texts(self, clips: list[Clip]) -> tuple[list[Clip], list[dict[str, torch.Tensor]]]:
        """The clips whose captions encoded, and their text features ({} without text encoders); a clip
        whose caption failed is a failure row."""
        if self.captions is None:
            return clips, [{} for _ in clips]
        found = self.captions.lookup([c.item.text for c in clips])
        kept, texts = [], []
        for clip in clips:
            row = found[clip.item.text]
            if isinstance(row, str):
                self.fail(clip, "encode_error", row)
            else:
                kept.append(clip)
                texts.append(row)
        return kept, texts

    def posterior(self, clips: list[Clip], marks: list[tuple[str, Any]]) -> Any:
        """VAE posterior of the clips' uint8 (T, H, W, 3) frames, in one call.

        The uint8 frames go to the device first and are scaled there (in float32, then cast): float32
        pixels are 4x the bytes to move. Page-locked frames (``decoded_items(pin=True)``) are copied
        without waiting for the device's earlier work; a batch is stacked on the device."""
        moved = [c.frames.to(self.device, non_blocking=c.frames.is_pinned()) for c in clips]
        pixels = moved[0].unsqueeze(0) if len(moved) == 1 else torch.stack(moved)
        self.clock.mark(marks, "h2d")
        video = to_model_input(pixels).to(self.dtype)  # (B, 3, T, H, W)
        return self.vae.encode(
            video, chunking=self.cfg.chunking, chunk_frames=self.cfg.chunk_frames, tile=self.cfg.tile
        )

    def _latents(self, clips: list[Clip], marks: list[tuple[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """Per clip: posterior mean and std (or one sample seeded by the clip id) in the storage dtype,
        on the device."""
        posterior = self.posterior(clips, marks)
        if self.cfg.store == "sample":
            out = []
            for i, clip in enumerate(clips):
                generator = torch.Generator(device="cpu").manual_seed(clip_seed(self.seed, clip.plan.clip_id))
                one = type(posterior)(mean=posterior.mean[i : i + 1], std=posterior.std[i : i + 1])
                out.append({"latent_sample": one.sample(generator)[0].to(STORAGE_DTYPE)})
        else:
            mean, std = posterior.mean.to(STORAGE_DTYPE), posterior.std.to(STORAGE_DTYPE)
            out = [{"latent_mean": mean[i], "latent_std": std[i]} for i in range(len(clips))]
        self.clock.mark(marks, "vae")
        return out

    def fail(self, clip: Clip, reason: str, detail: str) -> None:
        """Record one clip's failure (it is not written)."""
        self.tally.failed(
            failure_row(clip.item, MediaError(reason, detail), self.rank, clip.plan.clip_id), clip.key
        )

    # -- writing (writer thread) -------------------------------------------------------------------
    def write_batch(self, batch: Batch) -> None:
        """Wait for the batch's results, then check and write each clip (one atomic file each)."""
        try:
            if batch.ready is not None:
                batch.ready.synchronize()
        except Exception as exc:  # an error of the queued encode surfaces here
            for clip in batch.clips:
                self.fail(clip, "encode_error", f"{type(exc).__name__}: {exc}")
            return
        self.clock.add(batch.marks)
        start = time.perf_counter()  # the checks and the files, not the wait for the device above
        for clip, latents, text in zip(batch.clips, batch.latents, batch.texts, strict=True):
            self._write_clip(clip, latents, text)
        self.clock.seconds["write"] += time.perf_counter() - start

    def _write_clip(
        self, clip: Clip, latents: dict[str, torch.Tensor], text: dict[str, torch.Tensor]
    ) -> None:
        plan, item = clip.plan, clip.item
        if faults.poisoned("encode_nan", clip=plan.clip_id):  # test hook
            latents = {k: torch.full_like(v, float("nan")) for k, v in latents.items()}
        bad = non_finite({**latents, **text})
        if bad:  # a NaN clip would poison every training step that draws it
            self.fail(clip, "non_finite", bad)
            return
        metadata = {
            "item_id": item.id, "kind": item.kind, "source": item.source, "source_path": str(item.path),
            "text": item.text, "line": str(item.line), "clip_index": str(plan.clip_index),
            "frame_indices": json.dumps(list(plan.frame_indices)), "num_frames": str(plan.num_frames),
            "fps": f"{plan.fps:g}", "source_fps": f"{plan.source_fps:g}",
            "source_size": f"{plan.source_width}x{plan.source_height}", "bucket": plan.bucket.name,
            **self.static_meta,
        }  # fmt: skip
        self.tally.written(self.writer.write(plan.clip_id, {**latents, **text}, metadata), clip.key)
        faults.fault("encode_written", clip=plan.clip_id)  # test hook: a slow run to kill


__all__ = ["STORAGE_DTYPE", "BatchEncoder", "CaptionCache", "Tally", "non_finite", "text_row"]
