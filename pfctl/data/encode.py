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
   encodes clips batched by shape (:class:`pfctl.data.encode_batch.BatchEncoder`) and a writer thread
   writes one clip file per clip (atomic); then a per-rank manifest part;
6. :func:`_summarise`: the main process merges the parts into ``manifest.jsonl`` and ``failures.jsonl``
   once every rank is done.

A bad input never stops the run: it becomes a failure row with a reason (see
:data:`pfctl.data.video.REASONS`). Only too many failures (``max_failures``) make it exit 1.

Test hook: the fault point ``encode_written`` (``PFCTL_FAULT="encode_written:action=sleep:seconds=1"``,
:mod:`pfctl.runtime.faults`) slows each written clip down (on the writer thread), so a test can kill a real run half way and
check that the rerun only encodes what is missing.
"""

from __future__ import annotations

import contextlib
import os
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
from pfctl.data.decoding import Work, decoded_items, resolve_workers
from pfctl.data.encode_batch import BatchEncoder, Tally, failure_row, text_row
from pfctl.data.video import (
    REASONS,
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
)
from pfctl.errors import CheckFailed, ConfigError, DistributedError, PfctlError
from pfctl.runtime import logging as pflog

if TYPE_CHECKING:
    from pfctl.config.encode import EncodeConfig
    from pfctl.config.schema import RecipeConfig
    from pfctl.runtime.accelerator import Runtime

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
    """What a run did (or, with ``dry_run``, would do). ``failed`` counts inputs; the rest count clips.

    ``stage_seconds``: the slowest rank's seconds per stage of the loop: ``decode_wait`` (the encoder
    waiting for decoded clips), ``text``, ``h2d``, ``vae``, ``copy_back`` (device time on CUDA),
    ``write`` (the writer thread checking and writing files, not its wait for the device) and
    ``write_wait`` (the encoder waiting for room in the write queue). ``batch_size``: clips per VAE
    call at the end (lower than asked after a batch ran out of memory)."""

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
    batch_size: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
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
                report.failures.append(failure_row(item, exc, 0))
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
    workers: int
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
    workers = resolve_workers(cfg.num_workers, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    settings = setup.frame_settings(cfg, contract, decode_threads=1 if workers > 0 else 0)
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
        workers=workers,
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
            writer.write_null_text({k: v.cpu() for k, v in text_row(text_encoder.empty_embedding()).items()})
    run.runtime.barrier()
    return writer


@contextlib.contextmanager
def _on_device(run: _Run, mode: str) -> Iterator[BatchEncoder]:
    """The one context that holds the models on the device: loads the text encoder, prepares the
    folder (step 3) and yields the encoder; on the way out, whatever happens, the VAE and the text
    encoder are dropped and their device memory returned."""
    cfg = run.cfg
    text_encoder = (
        _load_text_encoder(*run.text_source, cfg, run.dtype, run.device) if run.text_source else None
    )
    writer = _open_folder(run, text_encoder, mode)
    encoder = BatchEncoder(
        cfg=cfg, vae=run.vae, text_encoder=text_encoder, writer=writer, device=run.device, dtype=run.dtype,
        seed=run.runtime.seed, rank=run.runtime.rank, batch_size=cfg.batch_size,
    )  # fmt: skip
    try:
        yield encoder
    finally:
        encoder.vae = encoder.text_encoder = encoder.captions = run.vae = text_encoder = None
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def _pending_work(run: _Run, encoder: BatchEncoder) -> Work:
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
            for row in cached.values():
                encoder.tally.cached(row)
        else:
            work.append((item, frozenset(cached)))
    pflog.log(
        f"encode-latents: {len(run.items)} inputs, {run.world} process(es); this rank: {len(work)} to decode, "
        f"{encoder.tally.skipped} clip(s) already cached; VAE {run.vae.name} on {run.device}, {run.cfg.chunking} "
        f"chunking, batches of {encoder.batch_size}, {run.workers} decode worker(s)"
    )
    return work


def _timed(stream: Iterator[Any], seconds: dict[str, float]) -> Iterator[Any]:
    """``stream``, adding the time spent waiting for each element to ``seconds["decode_wait"]``."""
    while True:
        start = time.perf_counter()
        got = next(stream, None)
        seconds["decode_wait"] += time.perf_counter() - start
        if got is None:
            return
        yield got


def _encode_all(run: _Run, encoder: BatchEncoder, work: Work, max_failures: int | None) -> dict[str, Any]:
    """Step 5: decode ahead, encode in batches, write behind; then this rank's manifest part. Returns
    its stats.

    The bar counts inputs, advanced once each clip of an input is written (or failed): clips wait for
    a batch of their shape, then for the writer thread (see :class:`BatchEncoder`)."""
    rank, cfg, tally = run.runtime.rank, run.cfg, encoder.tally
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
                decoded_items(work, run.settings, run.workers, cfg.prefetch, run.device.type == "cuda")
            ) as stream,
        ):
            shown = 0
            with encoder.running():  # on the way out: every batch queued is written
                for key, decoded in enumerate(_timed(stream, encoder.clock.seconds)):
                    encoder.add(decoded, key)
                    shown = _show_progress(bar, tally, shown, t0, len(work))
                    if max_failures is not None and len(tally.failures) > max_failures:
                        stopped_early = True
                        break
                encoder.flush()
            _show_progress(bar, tally, shown, t0, len(work), last=True)
    except BaseException as exc:
        aborted = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        stats = {
            "rank": rank, "encoded": tally.encoded, "skipped": tally.skipped, "failed": len(tally.failures),
            "stopped_early": stopped_early, "aborted": aborted, "loop_seconds": time.monotonic() - t0,
            "stage_seconds": dict(encoder.clock.seconds), "batch_size": encoder.batch_size, "notes": encoder.notes,
        }  # fmt: skip
        encoder.writer.write_part(tally.rows, tally.failures, stats)
    return stats


def _show_progress(bar: Any, tally: Tally, shown: int, t0: float, total: int, last: bool = False) -> int:
    """Advance the bar to the inputs done; it reaches ``total`` only with ``last`` (once everything is
    written), so its final line counts every clip."""
    done = tally.items_done if last else min(tally.items_done, total - 1)
    if done > shown or last:
        rate = tally.encoded / max(time.monotonic() - t0, 1e-9)
        bar.update(done - shown, clips=tally.encoded, clips_per_s=f"{rate:.2f}", failed=len(tally.failures))
    return done


def _summarise(run: _Run, encoder: BatchEncoder, stats: dict[str, Any], report: EncodeReport) -> None:
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
        all_stats = [stats]
        tally = encoder.tally
        report.encoded, report.skipped, report.failures = tally.encoded, tally.skipped, tally.failures
        report.stopped_early = stats["stopped_early"]
        report.encode_seconds = stats["loop_seconds"]
    for s in all_stats:  # the slowest rank's time per stage; every rank's notes
        for stage, seconds in s["stage_seconds"].items():
            report.stage_seconds[stage] = max(report.stage_seconds.get(stage, 0.0), seconds)
        report.notes.extend(n for n in s["notes"] if n not in report.notes)
    report.batch_size = min(s["batch_size"] for s in all_stats)
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
