"""What each rank trains, as data — the dry-run table and the real run's assignment log.

:func:`assignment` is the one definition of "what rank r trains at micro-step i" given the
group's resolved batch: sync group, clip ids, the clip ids of every stage column, the
``(low, mid, high)`` units and the image tokens. The trainer writes exactly these records
(``assignments/rank-NNNNN.jsonl``) from the tensors it really built, and ``pfctl train
--dry-run`` computes them for any world size W and group size G without a GPU or a process
group — so a test can check that the plan is what the run did.

Tokens are DiT image tokens (2x2 latent patches), history included, text excluded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pfctl.config.train import TrainConfig, check_train_constraints, columns_to_stages, resolve_train_speed
from pfctl.data.buckets import check_buckets, grid_multiple
from pfctl.data.dataset import (
    BatchChoice,
    ClipInfo,
    ResolvedBatch,
    SyncGroupSampler,
    TrainBatch,
    resolve_batch,
)
from pfctl.flow.pyramid import PyramidBatch, history_layout, sample_stage_length
from pfctl.runtime.sync_groups import SyncGroupPlan

PATCH = 2
NUM_STAGES = 3


def frame_grid(height: int, width: int, stage: int, num_stages: int = NUM_STAGES) -> tuple[int, int]:
    """Token rows and columns of one latent frame at ``stage`` (stage ``num_stages - 1`` = full resolution)."""
    shrink = 2 ** (num_stages - 1 - stage)
    return height // shrink // PATCH, width // shrink // PATCH


def tokens_per_frame(height: int, width: int, stage: int, num_stages: int = NUM_STAGES) -> int:
    """Image tokens of one latent frame at ``stage``."""
    rows, cols = frame_grid(height, width, stage, num_stages)
    return rows * cols


def column_grids(stage: int, units: int, height: int, width: int) -> list[tuple[int, int, int]]:
    """The clips of one sample of a temporal-pyramid column as token grids ``(t, h, w)``, oldest first: its
    history at the stages :func:`~pfctl.flow.pyramid.history_layout` gives, then the unit being trained."""
    history = range(units - 1)
    clips = [(len(history[sl]), *frame_grid(height, width, k)) for k, sl in history_layout(stage, units - 1)]
    return [*reversed(clips), (1, *frame_grid(height, width, stage))]


def column_tokens(stage: int, units: int | None, frames: int, height: int, width: int) -> int:
    """Tokens of one sample of a column: the current unit plus its history (temporal pyramid),
    or all ``frames`` at the column's stage (non-AR mode, ``units`` None)."""
    if units is None:
        return frames * tokens_per_frame(height, width, stage)
    return sum(t * h * w for t, h, w in column_grids(stage, units, height, width))


def token_count_sets(
    train: TrainConfig, rank: int, clips: Iterable[ClipInfo]
) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """Every distinct DiT input this rank's forwards build from ``clips``, as ``{(bucket, units): tokens of
    each column}``: one per clip bucket (:meth:`ClipInfo.bucket`) and, with the temporal pyramid, per unit
    position the rank cycles through (``max_units / video_sync_group`` of them). These are the shapes compiled
    blocks compile (and CUDA graphs record) once each."""
    stages = columns_to_stages(train.sample_ratios)
    turns = train.max_units // train.video_sync_group if train.use_temporal_pyramid else 1
    out: dict[tuple[Any, ...], tuple[int, ...]] = {}
    for frames, height, width in sorted({c.bucket(train.max_units) for c in clips}):
        for counter in range(turns):
            units = stage_units(train, counter, rank, frames)
            tokens = tuple(
                column_tokens(s, None if units is None else units[s], frames, height, width) for s in stages
            )
            out[((frames, height, width), units)] = tokens
    return out


def stage_units(train: TrainConfig, micro_step: int, rank: int, frames: int) -> tuple[int, int, int] | None:
    """``(low, mid, high)`` units of a rank's forward number ``micro_step`` (None in non-AR mode)."""
    if not train.use_temporal_pyramid:
        return None
    return sample_stage_length(micro_step, rank, train.video_sync_group, train.max_units, frames)


def assignment(
    train: TrainConfig, batch: ResolvedBatch, *, step: int, micro_step: int, rank: int, group: int
) -> dict[str, Any]:
    """The record of what ``rank`` (of sync group ``group``) trains at ``micro_step`` (optimizer step
    ``step``, 1-based)."""
    frames, height, width = batch.choice.bucket
    stages = columns_to_stages(train.sample_ratios)
    k = len(stages)
    units = stage_units(train, micro_step, rank, frames)
    columns = []
    tokens = 0
    for col, stage in enumerate(stages):
        ids = batch.ids[col::k]
        n = None if units is None else units[stage]
        tokens += len(ids) * column_tokens(stage, n, frames, height, width)
        columns.append({"stage": stage, "ids": ids})
    return {
        "step": step,
        "micro_step": micro_step,
        "rank": rank,
        "group": group,
        "epoch": batch.choice.epoch,
        "bucket": list(batch.choice.bucket),
        "ids": list(batch.ids),
        "replaced": {str(s): v for s, v in batch.replaced.items()},
        "dropped": list(batch.dropped),
        "columns": columns,
        "units": None if units is None else list(units),
        "tokens": tokens,
    }


def measured_assignment(
    train: TrainConfig,
    batch: TrainBatch,
    inputs: PyramidBatch,
    *,
    step: int,
    micro_step: int,
    rank: int,
    group: int,
) -> dict[str, Any]:
    """The run's record of one forward: :func:`assignment` of its batch, with the units and tokens
    measured from the DiT inputs it really built."""
    choice = BatchChoice(step=batch.step, epoch=batch.epoch, bucket=batch.bucket, ids=batch.ids)
    resolved = ResolvedBatch(choice, batch.ids, batch.replaced, batch.dropped)
    record = assignment(train, resolved, step=step, micro_step=micro_step, rank=rank, group=group)
    record["units"] = list(inputs.units_per_stage) if inputs.units_per_stage is not None else None
    record["tokens"] = sum(
        clip.shape[0] * clip.shape[2] * (clip.shape[3] // PATCH) * (clip.shape[4] // PATCH)
        for column in inputs.sample
        for clip in column
    )
    return record


# ------------------------------------------------------------------------------------------
# the dry-run
# ------------------------------------------------------------------------------------------


@dataclass
class PlanReport:
    """``rows``: one assignment per (micro-step, rank); ``group_tokens``: (step, group) → tokens."""

    layout: SyncGroupPlan
    steps: int
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    memory: Any = None  # pfctl.training.memory.MemoryEstimate of the worst-case forward

    def group_totals(self) -> dict[tuple[int, int], dict[str, int]]:
        totals: dict[tuple[int, int], dict[str, int]] = {}
        for row in self.rows:
            entry = totals.setdefault((row["step"], row["group"]), {"tokens": 0, "ranks": 0})
            entry["tokens"] += row["tokens"]
            entry["ranks"] += 1
        return totals

    def render(self) -> str:
        """A plain-text table (one line per rank and micro-step), then totals per group."""
        head = f"{'step':>4} {'micro':>5} {'rank':>4} {'group':>5}  {'units(l,m,h)':<12} {'tokens':>7}  columns (stage: clip ids)"
        lines = [
            f"dry run: world size {self.layout.world_size}, video_sync_group {self.layout.group_size}, "
            f"{self.layout.num_groups} groups, first {self.steps} steps",
            head,
            "-" * len(head),
        ]
        for row in self.rows:
            units = "-" if row["units"] is None else ",".join(map(str, row["units"]))
            cols = "  ".join(f"{c['stage']}:{'/'.join(c['ids'])}" for c in row["columns"])
            extra = f"  replaced {row['replaced']}" if row["replaced"] else ""
            lines.append(
                f"{row['step']:>4} {row['micro_step']:>5} {row['rank']:>4} {row['group']:>5}  "
                f"{units:<12} {row['tokens']:>7}  {cols}{extra}"
            )
        lines.append("")
        lines.append("tokens per sync group and step:")
        for (step, group), entry in sorted(self.group_totals().items()):
            lines.append(
                f"  step {step} group {group}: {entry['tokens']} tokens over {entry['ranks']} rank-forwards"
            )
        lines.extend(self.notes)
        if self.memory is not None:
            lines.append("")
            lines.append(self.memory.render())
        return "\n".join(lines)


def plan_run(
    train: TrainConfig,
    clips: list[ClipInfo],
    *,
    world_size: int,
    seed: int,
    steps: int,
    can_load: Callable[[str], bool],
    heldout: set[str] | None = None,
) -> PlanReport:
    """Simulate every rank of a ``world_size`` run for ``steps`` optimizer steps.

    Each group's sampler runs once (its ranks share it by construction); ``can_load(id)``
    probes the cache so that replacements of broken clips appear as in the real run.
    """
    layout = check_train_constraints(train, world_size)
    pool = [c for c in clips if not heldout or c.id not in heldout]
    rows = []
    for group, ranks in enumerate(layout.groups):
        sampler = SyncGroupSampler(
            pool,
            num_groups=layout.num_groups,
            group_index=group,
            batch_size=train.batch_size,
            seed=seed,
            max_units=train.max_units,
            image_ratio=train.image_ratio,
        )
        for step in range(1, steps + 1):
            for micro in range(train.grad_accum):
                micro_step = (step - 1) * train.grad_accum + micro
                batch = resolve_batch(
                    sampler, micro_step, lambda ids: [can_load(i) for i in ids], train.caption_dropout
                )
                for rank in ranks:
                    rows.append(
                        assignment(train, batch, step=step, micro_step=micro_step, rank=rank, group=group)
                    )
    rows.sort(key=lambda r: (r["micro_step"], r["rank"]))
    return PlanReport(layout=layout, steps=steps, rows=rows)


def dry_run(config: Any, *, world_size: int | None = None, steps: int | None = None) -> PlanReport:
    """``pfctl train --dry-run``: validate config, model spec and cache, and plan the first steps.

    Runs in one process without a GPU for any simulated ``world_size`` (default: the launcher's).
    Every clip the plan touches is really read, so a broken file shows up as a replacement here
    exactly as it will in the run.
    """
    from pfctl.runtime.accelerator import world_size_from_env
    from pfctl.training.data import cache_clips, cache_normalizer, cache_path, open_cache, split_heldout
    from pfctl.training.memory import meta_dit

    train = config.train
    world = world_size or world_size_from_env()
    check_train_constraints(train, world)  # before the cache is read: a bad layout is a usage error
    notes = [check_model_spec(config)]
    cache = open_cache(cache_path(config))
    cache_normalizer(cache)  # the header's normalisation rule must be understood
    cache.null_text()
    clips = cache_clips(cache)
    check_cache_buckets(clips, meta_dit(config), train)
    heldout = {c.id for c in split_heldout(clips, train.heldout_clips, config.runtime.seed)}
    probed: dict[str, bool] = {}

    def can_load(cid: str) -> bool:
        if cid not in probed:
            try:
                cache.load(cid)
                probed[cid] = cache.metadata(cid).get("fingerprint", cache.fingerprint) == cache.fingerprint
            except Exception:
                probed[cid] = False
        return probed[cid]

    report = plan_run(
        train, clips, world_size=world, seed=config.runtime.seed, steps=min(steps or train.plan_steps, train.max_steps),
        can_load=can_load, heldout=heldout,
    )  # fmt: skip
    bad = sorted(c for c, ok in probed.items() if not ok)
    notes.append(f"cache {cache.root}: {len(clips)} clips, fingerprint {cache.fingerprint}, format ok")
    merged_peak = None
    if resolve_train_speed(train, "cuda", world).merge_micro_batches:
        merged_peak = estimate_for_run(config, cache, clips, merged=True, world_size=world).total
    notes.append(speed_note(train, world, [c for c in clips if c.id not in heldout], merged_peak))
    if bad:
        notes.append(f"clips that fail to load (replaced in the run): {', '.join(bad)}")
    report.notes = notes
    report.memory = estimate_for_run(
        config, cache, clips, merged=train.merge_micro_batches is True, world_size=world
    )
    return report


def speed_note(
    train: TrainConfig, world_size: int, clips: list[ClipInfo], merged_peak: int | None = None
) -> str:
    """What the run settles its speed options to on CUDA (:func:`resolve_train_speed`) and, with compiled
    blocks, how many distinct inputs rank 0 builds (each compiled once, and recorded once with graphs);
    ``merged_peak``: the memory estimate of a step with merged micro-batches, which ``auto`` merges only on a
    GPU it fits (:func:`merge_too_big`)."""
    from pfctl.training.memory import format_bytes

    speed = resolve_train_speed(train, "cuda", world_size)
    note = f"on CUDA with {world_size} process(es): {speed.describe()}"
    if merged_peak is not None and train.merge_micro_batches == "auto":
        note += (
            f"; micro-batches merged on a GPU of {format_bytes(merged_peak / MERGE_MEMORY_SHARE)} or more (the"
            f" merged step's estimated peak: {format_bytes(merged_peak)}), one by one on a smaller one"
        )
    if speed.compile:
        note += f"; warm-up: {len(token_count_sets(train, 0, clips))} distinct inputs on rank 0"
        if train.compile_cache:
            from pfctl.models.fast.compile_cache import describe_compile_cache

            note += f"; {describe_compile_cache(train.output_dir, train.compile_cache_shared)}"
    return note + " (the CPU runs eager blocks)"


#: The share of a GPU's memory the estimated peak of a merged step may take (``train.merge_micro_batches``
#: ``auto``): the estimate leaves out the CUDA context, fragmentation and workspaces.
MERGE_MEMORY_SHARE = 0.9


def merge_too_big(merged_peak: int, gpu_bytes: int) -> str | None:
    """Why a step with merged micro-batches, of estimated peak ``merged_peak``, is not run on a GPU of
    ``gpu_bytes`` (None: it fits)."""
    from pfctl.training.memory import format_bytes

    if merged_peak <= MERGE_MEMORY_SHARE * gpu_bytes:
        return None
    return (
        f"the merged step's estimated peak {format_bytes(merged_peak)} exceeds {MERGE_MEMORY_SHARE:.0%} of the "
        f"GPU's {format_bytes(gpu_bytes)}"
    )


def estimate_for_run(
    config: Any, cache: Any, clips: list[ClipInfo], *, merged: bool = False, world_size: int = 1
) -> Any:
    """The memory estimate of the run's worst-case forward (largest bucket, all units) on one of ``world_size``
    processes (whose CUDA graphs ``train.cuda_graphs=auto`` settles on); ``merged``: of the step whose
    ``grad_accum`` micro-batches run as one forward (``train.merge_micro_batches``).

    Builds the DiT on the meta device (no weights), which also validates ``train.lora.targets``.
    """
    from pfctl.models.lora import resolve_targets
    from pfctl.runtime.accelerator import resolve_mixed_precision
    from pfctl.training.build import check_lora_runtime
    from pfctl.training.memory import Workload, estimate_memory, meta_dit

    train, runtime = config.train, config.runtime
    device = "cpu" if runtime.device == "cpu" else "cuda"
    precision = resolve_mixed_precision(runtime.mixed_precision, device)
    model = meta_dit(config)
    targets = resolve_targets(model, train.lora.targets) if train.lora.enabled else None
    if train.lora.enabled:
        check_lora_runtime(train, precision)
    frames, height, width = max(
        ((min(c.num_latent_frames, train.max_units), c.height, c.width) for c in clips),
        key=lambda b: b[0] * b[1] * b[2],
        default=(1, 8, 8),
    )
    stages = columns_to_stages(train.sample_ratios)
    per_column = train.batch_size // len(stages)
    units = frames if train.use_temporal_pyramid else None
    columns = tuple((per_column, column_tokens(s, units, frames, height, width)) for s in stages)
    forwards = train.grad_accum if merged else 1
    text_len = 128  # T5's length in the released models, if no clip can be read
    for cid in cache.ids()[:8]:  # a broken clip is the plan's business (it gets replaced), not ours
        try:
            text_len = int(cache.load(cid)["prompt_embeds"].shape[-2])
            break
        except Exception:
            continue
    estimate = estimate_memory(
        model, Workload(columns * forwards, text_len), lora_targets=targets, lora_rank=train.lora.rank,
        base_dtype=train.base_dtype, compute_dtype="bf16" if precision == "bf16" else "fp32",
        optimizer=train.optimizer, ema=train.ema_decay is not None,
        gradient_checkpointing=train.gradient_checkpointing, checkpointing_ratio=train.gradient_checkpointing_ratio,
        checkpointing_policy=train.gradient_checkpointing_policy,
        grad_accum=train.grad_accum // forwards,
        cuda_graphs=resolve_train_speed(train, device, world_size).cuda_graphs,
    )  # fmt: skip
    what = f"{forwards} micro-batches merged, " if merged else ""
    estimate.notes.append(
        f"worst-case forward: {what}bucket {frames}x{height}x{width} latents, "
        f"{len(stages) * forwards} columns of {per_column}, "
        f"text length {text_len}; compute {'fp32' if precision == 'no' else precision} on {device}"
        + ("" if runtime.device != "auto" else " (runtime.device auto: assumed a GPU)")
    )
    return estimate


def dit_patch(model: Any) -> int:
    """Latent pixels per token side of a built DiT: the Flux DiT's fixed 2x2 patchify (its config's
    ``patch_size`` only sizes ``proj_out``), else the MMDiT's ``patch_size``."""
    from pfctl.models.dit_flux import PATCH as FLUX_PATCH
    from pfctl.models.dit_flux import PyramidFluxTransformer

    return FLUX_PATCH if isinstance(model, PyramidFluxTransformer) else int(model.config["patch_size"])


def check_cache_buckets(clips: list[ClipInfo], model: Any, train: TrainConfig) -> None:
    """Every bucket of the cache (latent units) must split into the DiT's tokens at every pyramid
    stage: sides multiples of patch x 2^(stages - 1). Refused (exit 2) before the first step."""
    patch, stages = dit_patch(model), len(train.sample_ratios)
    sizes = sorted({(c.width, c.height) for c in clips})
    why = (
        f"DiT patch {patch} x 2^{stages - 1} for {stages} pyramid stages; re-encode with other encode.buckets"
    )
    check_buckets(
        sizes, grid_multiple(patch=patch, stages=stages), what="the cache", unit="latent px", why=why
    )


def check_model_spec(config: Any) -> str:
    """Validate ``model.dit_preset`` / ``model.path`` without building the model."""
    from pathlib import Path

    from pfctl.errors import ConfigError

    m = config.model
    if m.dit_preset is not None:
        from pfctl.models.registry import preset_config

        preset_config(m.dit_preset, m.dit_config)
        return f"model: preset {m.dit_preset} (from scratch)"
    if m.path is None:
        raise ConfigError(
            "train needs a model: set model.path or model.dit_preset", hint="e.g. --set model.dit_preset=tiny"
        )
    if not Path(m.path).is_dir():
        raise ConfigError(
            f"model.path {m.path} is not a folder", hint="an official checkpoint folder or a pfctl export"
        )
    return f"model: fine-tune {m.path}"
