"""The encode-latents pipeline: annotations → decoded clips → VAE + text encoders → latent cache.

Read :func:`run_encode` top to bottom; each step is one function:

1. :func:`_prepare`: validate the inputs (annotation file, model, text-encoder folder), load the VAE,
   settle the encode settings (the model's own, then the user's), refuse frame counts and buckets the
   model cannot use, and build the provenance header and its fingerprint;
2. check the output folder against it (resume, refuse to mix, or ``--overwrite``); a dry run plans here;
3. :func:`_on_device` (the one context that holds the models) loads the text encoder, and
   :func:`_open_folder` has the main process write the header and the null text, clear what a killed
   run left, and repair a torn ``manifest.jsonl`` from the clip files;
4. :func:`_pending_work`: shard the items over ranks (rank r takes items r, r+W, ...), skip clips already
   cached;
5. :func:`_encode_all`: decode in DataLoader workers (or a prefetch thread) while the main thread
   encodes; one clip file per clip (atomic), then a per-rank manifest part;
6. :func:`_summarise`: the main process merges the parts into ``manifest.jsonl`` and ``failures.jsonl``
   once every rank is done.

A bad input never stops the run: it becomes a failure row with a reason (see
:data:`pfctl.data.video.REASONS`). Only too many failures (``max_failures``) make it exit 1.

Test hook: the fault point ``encode_written`` (``PFCTL_FAULT="encode_written:action=sleep:seconds=1"``,
:mod:`pfctl.runtime.faults`) slows each written clip down, so a test can kill a real run half way and
check that the rerun only encodes what is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pfctl.data import encode_setup as setup
from pfctl.data import latent_cache as lc
from pfctl.data.annotations import Item, load_annotations
from pfctl.data.decoding import Work, decoded_items
from pfctl.data.video import (
    REASONS,
    DecodedItem,
    FrameContract,
    FrameSettings,
    MediaError,
    clip_id_for,
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

if TYPE_CHECKING:
    from pfctl.config.encode import EncodeConfig
    from pfctl.config.schema import RecipeConfig
    from pfctl.runtime.accelerator import Runtime

STORAGE_DTYPE = torch.bfloat16


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


# ------------------------------------------------------------------------------------- clips


def candidate_clip_ids(item: Item, cfg: EncodeConfig) -> list[str]:
    """Every clip id an item can produce (a short video may produce fewer in ``uniform`` mode)."""
    if item.kind == "video" and item.frames is None and cfg.clip_mode == "uniform":
        return [clip_id_for(item.id, k, "uniform") for k in range(cfg.clips_per_video)]
    return [item.id]


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
        faults.fault("encode_written", clip=job.plan.clip_id)  # test hook: a slow run to kill
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


def _probe(item: Item, settings: FrameSettings) -> list[Any]:
    """The clips an input would give, from its header alone (no frames decoded beyond the first)."""
    if item.kind == "image":
        width, height = probe_image(item.path, settings.max_source_pixels)
        return plan_image(item, width, height, settings)
    info = probe_video(item.path, settings.max_source_pixels, reader=open_video(item.path))
    return plan_clips(item, info, settings)


def _dry_run(run: _Run, report: EncodeReport) -> None:
    """Probe every input, plan clips and estimate the cache size (into ``report``)."""
    root, header, cfg = run.root, run.header, run.cfg
    existing = lc.read_header(root) if root.is_dir() else None
    same = existing is not None and existing.get("fingerprint") == header["fingerprint"]
    writer = lc.LatentCacheWriter(root, header) if same else None
    groups: dict[tuple[str, int], list[int]] = {}
    with pflog.progress("validating inputs", total=len(run.items)) as bar:
        for item in run.items:
            try:
                plans = _probe(item, run.settings)
            except MediaError as exc:
                report.failures.append(_failure_row(item, exc, 0))
                plans = []
            for plan in plans:
                counts = groups.setdefault((plan.bucket.name, plan.num_frames), [0, 0])
                counts[0] += 1
                counts[1] += int(writer is not None and writer.finished_row(plan.clip_id) is not None)
            bar.update(1, failed=len(report.failures))
    for (bucket_name, frames), (clips, cached) in sorted(groups.items()):
        width, height = (int(v) for v in bucket_name.split("x"))
        shape = _latent_shape(run.vae, frames, width, height)
        size = _bytes_per_clip(shape, cfg.store, run.text_dims, cfg.max_sequence_length)
        report.plan.append(PlanRow(bucket_name, frames, shape, clips, cached, size))
        report.estimated_bytes += size * (clips - cached)
    report.failed = len(report.failures)
    report.failures_by_reason = dict(Counter(f["reason"] for f in report.failures))
    report.skipped = sum(r.cached for r in report.plan)
    if run.text_dims is None and cfg.text:
        report.notes.append("text feature sizes unknown (no config.json found); estimate covers latents only")


# ------------------------------------------------------------------------------------------ run


def _load_text_encoder(folder: Path, kind: str, cfg: EncodeConfig, dtype: torch.dtype, device: torch.device):
    from pfctl.models.text_encoder import load_text_encoder

    return load_text_encoder(
        folder, model_name=kind, dtype=dtype, device=device, max_sequence_length=cfg.max_sequence_length
    )


@dataclass
class _Run:
    """What the steps of one run share (settled by :func:`_prepare`)."""

    cfg: EncodeConfig
    runtime: Runtime
    items: list[Item]
    root: Path
    dtype: torch.dtype
    device: torch.device
    vae: Any
    settings: FrameSettings
    header: dict[str, Any]
    text_source: tuple[Path, str] | None
    text_dims: tuple[int, int] | None
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.runtime.world_size


def _inputs(config: RecipeConfig) -> tuple[RecipeConfig, dict[str, Any] | None, list[Item]]:
    """The config with its model filled in, the embedded model's manifest (if it is the model), and
    the validated annotation items. Raises :class:`ConfigError` / input errors before any work."""
    if not config.encode.annotations:
        raise ConfigError(
            "no annotations given",
            hint="pass --annotations FILE.jsonl|FILE.csv|FOLDER (or set encode.annotations)",
        )
    items = load_annotations(config.encode.annotations)
    if any(item.kind == "video" for item in items):
        require_decord()
    config, manifest = setup.with_model(config)
    return config, manifest, items


def _prepare(config: RecipeConfig, runtime: Runtime, *, dry_run: bool) -> _Run:
    """Step 1: inputs, VAE, the settled encode settings, their checks, and the cache header."""
    from pfctl.models.vae import load_vae, with_fast_paths

    config, manifest, items = _inputs(config)
    vae_spec = setup.resolve_vae_spec(config)
    dtype = setup.resolve_dtype(config)
    text_source = setup.resolve_text_folder(config)
    device = torch.device("cpu") if dry_run else runtime.device
    vae = with_fast_paths(load_vae(vae_spec, dtype=dtype, device=device), config.fast)
    cfg = config.encode
    if hasattr(vae, "exact_schedule"):  # diffusers adapters: the exact encode's schedule
        vae.exact_schedule = cfg.exact_schedule
        vae.exact_checkpoint_bytes = (
            None if cfg.exact_checkpoint_gib is None else int(cfg.exact_checkpoint_gib * 2**30)
        )
    if manifest is not None:  # the embedded model: its trained size, frame rate and clip length
        cfg = setup.apply_model_settings(cfg, setup.model_encode_settings(manifest, vae.temporal_factor))
        config = config.model_copy(update={"encode": cfg})
    contract = FrameContract.from_vae(vae, max(cfg.num_frames, cfg.max_frames))
    settings = setup.frame_settings(cfg, contract, decode_threads=1 if cfg.num_workers > 0 else 0)
    setup.check_frames(cfg, settings, vae)
    setup.check_trainable_buckets(config, settings, vae)
    text_dims = setup.text_dims_from_folder(*text_source) if text_source else None
    header = setup.build_header(
        vae=vae,
        vae_spec=vae_spec,
        compute_dtype=dtype,
        text=setup.text_identity(*text_source, cfg.max_sequence_length) if text_source else None,
        text_dims=text_dims,
        preprocessing=setup.preprocessing_record(cfg, settings, runtime.seed),
        store=cfg.store,
    )
    run = _Run(
        cfg=cfg, runtime=runtime, items=items, root=Path(cfg.output_dir).expanduser(), dtype=dtype,
        device=device, vae=vae, settings=settings, header=header, text_source=text_source, text_dims=text_dims,
    )  # fmt: skip
    if settings.clip_frames != cfg.num_frames and cfg.clip_mode != "full":
        run.notes.append(
            f"num_frames {cfg.num_frames} snapped to {settings.clip_frames} (the VAE's frame contract)"
        )
    return run


def _open_folder(run: _Run, text_encoder: Any, mode: str) -> lc.LatentCacheWriter:
    """Step 3: every rank has checked the folder; the main process now prepares it."""
    header = run.header
    if text_encoder is not None:
        header["text_encoder"]["dim"] = int(text_encoder.joint_attention_dim)
        header["text_encoder"]["pooled_dim"] = int(text_encoder.pooled_dim)
    writer = lc.LatentCacheWriter(run.root, header, rank=run.runtime.rank)
    run.runtime.barrier()
    if run.runtime.is_main:
        root = run.root
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
        repaired = lc.repair_manifest(root)
        if repaired is not None:
            run.notes.append(
                f"{lc.MANIFEST_FILE} was unreadable: rebuilt from the {len(repaired)} clip file(s)"
            )
        if text_encoder is not None and not (root / lc.NULL_TEXT_FILE).is_file():
            writer.write_null_text({k: v.cpu() for k, v in _text_row(text_encoder.empty_embedding()).items()})
    run.runtime.barrier()
    return writer


@contextlib.contextmanager
def _on_device(run: _Run, mode: str) -> Iterator[_Encoder]:
    """The one context that holds the models on the device: loads the text encoder, prepares the
    folder (step 3) and yields the encoder; on the way out, whatever happens, the VAE and the text
    encoder are dropped and their device memory returned."""
    cfg = run.cfg
    text_encoder = (
        _load_text_encoder(*run.text_source, cfg, run.dtype, run.device) if run.text_source else None
    )
    writer = _open_folder(run, text_encoder, mode)
    encoder = _Encoder(
        cfg=cfg, vae=run.vae, text_encoder=text_encoder, writer=writer, device=run.device, dtype=run.dtype,
        seed=run.runtime.seed, rank=run.runtime.rank,
    )  # fmt: skip
    try:
        yield encoder
    finally:
        encoder.vae = encoder.text_encoder = run.vae = text_encoder = None
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def _pending_work(run: _Run, encoder: _Encoder) -> Work:
    """Step 4: this rank's items, minus the clips already cached (counted as skipped)."""
    old_rows = _old_manifest(run.root)
    work: Work = []
    for item in run.items[run.runtime.rank :: run.world]:
        cached = {}
        candidates = candidate_clip_ids(item, run.cfg)
        for clip_id in candidates:
            row = old_rows.get(clip_id)
            if row is not None and (run.root / row["path"]).is_file():
                cached[clip_id] = row
            elif (found := encoder.writer.finished_row(clip_id)) is not None:
                cached[clip_id] = found
        if len(cached) == len(candidates):
            encoder.rows.extend(cached.values())
            encoder.skipped += len(cached)
        else:
            work.append((item, frozenset(cached)))
    pflog.log(
        f"encode-latents: {len(run.items)} inputs, {run.world} process(es); this rank: {len(work)} to decode, "
        f"{encoder.skipped} clip(s) already cached; VAE {run.vae.name} on {run.device}, {run.cfg.chunking} chunking"
    )
    return work


def _encode_all(run: _Run, encoder: _Encoder, work: Work, max_failures: int | None) -> dict[str, Any]:
    """Step 5: decode ahead, encode, write; then this rank's manifest part. Returns its stats.

    The bar counts inputs, advanced once an input's last clip is written: clips are pipelined one
    deep (see :class:`_Encoder`), so an input whose clip is still in flight is not done yet."""
    rank, cfg = run.runtime.rank, run.cfg
    aborted: str | None = None
    stopped_early = False
    t0 = time.monotonic()
    try:
        with (
            pflog.progress(
                f"encoding (rank {rank})" if run.world > 1 else "encoding", total=len(work)
            ) as bar,
            # closed on the way out whatever happens (the decoders stop now, not whenever the error is freed)
            contextlib.closing(
                decoded_items(work, run.settings, cfg.num_workers, cfg.prefetch, run.device.type == "cuda")
            ) as stream,
        ):
            handled = shown = 0
            for decoded in stream:
                encoder.handle(decoded)
                handled += 1
                shown = _show_progress(bar, encoder, handled - (encoder.pending is not None), shown, t0)
                if max_failures is not None and len(encoder.failures) > max_failures:
                    stopped_early = True
                    break
            encoder.finish()  # the last clip in flight
            _show_progress(bar, encoder, handled, shown, t0)
    except BaseException as exc:
        aborted = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        stats = {
            "rank": rank, "encoded": encoder.encoded, "skipped": encoder.skipped, "failed": len(encoder.failures),
            "stopped_early": stopped_early, "aborted": aborted, "loop_seconds": time.monotonic() - t0,
        }  # fmt: skip
        encoder.writer.write_part(encoder.rows, encoder.failures, stats)
    return stats


def _show_progress(bar: Any, encoder: _Encoder, done: int, shown: int, t0: float) -> int:
    rate = encoder.encoded / max(time.monotonic() - t0, 1e-9)
    bar.update(done - shown, clips=encoder.encoded, clips_per_s=f"{rate:.2f}", failed=len(encoder.failures))
    return done


def _summarise(run: _Run, encoder: _Encoder, stats: dict[str, Any], report: EncodeReport) -> None:
    """Step 6: the main process waits for every rank's part and merges them; others report their own."""
    if run.runtime.is_main:
        all_stats = lc.wait_for_parts(run.root, run.world)
        rows, failures = lc.merge_parts(run.root, run.world)
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
        report.stopped_early = stats["stopped_early"]
        report.encode_seconds = stats["loop_seconds"]
    report.failed = len(report.failures)
    report.failures_by_reason = dict(Counter(f["reason"] for f in report.failures))


def _check_failures(report: EncodeReport, max_failures: int | None, is_main: bool) -> None:
    """Too many failed inputs, or nothing encoded at all: :class:`CheckFailed` carrying the report."""
    error = None
    if max_failures is not None and report.failed > max_failures:
        error = CheckFailed(
            f"{report.failed} input(s) failed, more than max_failures={max_failures}"
            + (" (stopped early)" if report.stopped_early else ""),
            hint=f"see {report.failures_path} for the reasons; finished clips are kept and a rerun resumes",
        )
    elif is_main and report.failed and report.manifest_clips == 0:
        error = CheckFailed(
            f"nothing was encoded: all {report.failed} input(s) failed",
            hint=f"see {report.failures_path} for the reasons",
        )
    if error is not None:
        error.report = report  # type: ignore[attr-defined]
        raise error


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
    if runtime is None:
        from pfctl.runtime.accelerator import build_runtime

        runtime = build_runtime(config.runtime)
    if dry_run and not runtime.is_main:
        _inputs(config)  # the same input errors on every rank
        root = str(Path(config.encode.output_dir).expanduser())
        return EncodeReport(
            output_dir=root, fingerprint="", dry_run=True, is_main=False, world_size=runtime.world_size
        )
    run = _prepare(config, runtime, dry_run=dry_run)
    limit = run.cfg.max_failures if max_failures is None else max_failures
    report = EncodeReport(
        output_dir=str(run.root), fingerprint=run.header["fingerprint"], dry_run=dry_run, items=len(run.items),
        world_size=run.world, is_main=runtime.is_main, notes=run.notes,
    )  # fmt: skip
    mode = lc.prepare_folder(run.root, run.header, overwrite=overwrite)  # read-only, every rank
    if dry_run:
        if mode == "overwrite":
            report.notes.append(f"--overwrite would delete the existing cache in {run.root}")
        _dry_run(run, report)
        report.seconds = time.monotonic() - start
        return report
    with _on_device(run, mode) as encoder:
        stats = _encode_all(run, encoder, _pending_work(run, encoder), limit)
    _summarise(run, encoder, stats, report)
    report.seconds = time.monotonic() - start
    _check_failures(report, limit, runtime.is_main)
    return report


def _old_manifest(root: Path) -> dict[str, dict[str, Any]]:
    path = root / lc.MANIFEST_FILE
    if not path.is_file():
        return {}
    try:
        return {row["id"]: row for row in lc._read_jsonl(path)}
    except PfctlError:
        return {}


__all__ = ["REASONS", "EncodeReport", "PlanRow", "run_encode"]
