"""``pfctl train``: pyramidal flow matching with video sync groups.

Read :meth:`Trainer.train` first: resume → loop (``train_step`` → log → checkpoint → eval) →
final checkpoint, export, run summary. Everything it calls is set up, in named steps, by
:meth:`Trainer.setup`: runtime → data → model (with what trains on it: :mod:`pfctl.training.weights`)
→ speed layer (activation checkpointing → compile → sharding) → optimizer → EMA, noise, logs. The
pyramid math lives in :mod:`pfctl.flow`, the data rules in :mod:`pfctl.data.dataset` and
:mod:`pfctl.training.data`, the checkpoint format in :mod:`pfctl.training.checkpoint`.

Randomness, by owner (what makes a resumed run bit-identical and a sync group consistent):

* group-shared choices (batch, bucket, replacements, caption dropout, posterior sample):
  generators seeded by ``(seed, group, micro-step)`` inside the data module — stateless;
* per-rank noise, timesteps and history corruption: ``self.noise``, a ``torch.Generator``
  seeded by ``(seed, rank)`` whose state is checkpointed;
* python / numpy / torch global RNGs: checkpointed per rank (nothing in the loop should draw
  from them, but third-party code might).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pfctl.config.train import TrainConfig, check_train_constraints, columns_to_stages, resolve_train_speed
from pfctl.data.dataset import ClipInfo, LatentClipLoader, TrainBatch, group_rng
from pfctl.errors import CheckFailed, CheckpointError
from pfctl.flow.loss import flow_matching_loss
from pfctl.flow.pyramid import (
    PyramidBatch,
    RandomSource,
    build_full_sequence_batch,
    build_temporal_pyramid_batch,
    merge_pyramid_batches,
    plan_stage_lengths,
    pyramid_latents,
)
from pfctl.flow.scheduler import PyramidFlowScheduler
from pfctl.runtime import faults, sharding
from pfctl.runtime import logging as pflog
from pfctl.runtime.collector import Collector
from pfctl.training import checkpoint as ckpt
from pfctl.training import optim
from pfctl.training.build import (
    apply_fast_paths,
    build_model,
    load_optimizer_state,
    optimizer_state,
    shard_dit,
)
from pfctl.training.data import (
    BatchFeed,
    TextRows,
    build_data,
    cache_clips,
    cache_path,
    cache_vae_info,
    check_cache_matches_model,
    group_agreement,
    merged_text_rows,
)
from pfctl.training.ema import EMA
from pfctl.training.evaluate import ValidationSamples, heldout_loss, sample_validation
from pfctl.training.logs import RunLogs, mfu, peak_flops
from pfctl.training.plan import (
    check_cache_buckets,
    estimate_for_run,
    measured_assignment,
    merge_too_big,
    token_count_sets,
)
from pfctl.training.step_graphs import StepGraphs, average_gradients, gradient_buffers, records_first_apart
from pfctl.training.summary import write_summary
from pfctl.training.trackers import flat_config, log_validation, start_trackers
from pfctl.training.warmup import WarmupWatch, watch_warmup
from pfctl.training.weights import trained_weights
from pfctl.utils.io import atomic_write_text

_NOISE = 201


@dataclass
class TrainReport:
    """What a finished run returns (main process values)."""

    output_dir: str
    steps: int
    resumed_from: str | None
    final_loss: float | None
    checkpoints: list[str]
    export_dir: str | None
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    is_main: bool = True


class Trainer:
    """Owns the run: runtime, data, model, optimizer, EMA, checkpoints, logs."""

    def __init__(self, config: Any) -> None:
        self.config = config  # pfctl.config.schema.RecipeConfig
        self.cfg: TrainConfig = config.train
        self.out = Path(self.cfg.output_dir)
        self.stages = sorted(set(columns_to_stages(self.cfg.sample_ratios)))  # the stages a step trains
        self.step = 0  # optimizer steps done
        self.micro_step = 0  # forwards done by this rank (indexes the sampler and the unit schedule)
        self.tokens_seen = 0
        self.losses: list[float] = []
        self.saved: list[str] = []
        self.loaded: ckpt.LoadedCheckpoint | None = None
        self.started = time.perf_counter()  # wall time of the run: metrics' elapsed_s
        self.data_seconds = 0.0  # host time spent loading batches in the current step
        self.wait_seconds = 0.0  # host time the current step spent waiting for the GPU (its one read)
        self.warmup: WarmupWatch | None = None  # compiled blocks: the warm-up in the log
        self.collector: Collector | None = None  # garbage collection at step boundaries (train.gc_every)
        self.saver: ckpt.BackgroundSaver | None = None  # checkpoints written in the background
        self.step_graphs: StepGraphs | None = None  # train.cuda_graphs=step: the step's CUDA graphs
        self.grad_buffers: list[torch.Tensor] = []  # CUDA graphs: the gradients' memory (views of it)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def train(self) -> TrainReport:
        """Resume → step until ``max_steps`` (log, checkpoint, eval) → final checkpoint + export."""
        self.setup()
        resumed = self.resume()
        cfg, start = self.cfg, time.perf_counter()
        pflog.log(
            f"training {self.model_name} for {cfg.max_steps} steps on {self.runtime.world_size} process(es), "
            f"sync groups of {cfg.video_sync_group}, batch {cfg.batch_size}x{cfg.grad_accum} per rank"
            + (f", resumed at step {self.step} from {resumed}" if resumed else "")
        )
        try:
            if self.step == 0:  # the baselines the held-out curve and the validation sheets start from
                with self.off_the_training_graphs():
                    if cfg.eval_every:
                        self.logs.metrics(self.step, self.heldout_loss())
                    if cfg.validation_every:
                        self.validate()
            while self.step < cfg.max_steps:
                metrics = self.train_step()
                if metrics is None:  # a non-finite loss with nan_policy=stop
                    break
                self.losses.append(metrics["loss"])
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    self.logs.metrics(self.step, metrics)
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.max_steps:
                    self.save_checkpoint()
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    with self.off_the_training_graphs():
                        self.logs.metrics(self.step, self.heldout_loss())
                last = self.step == cfg.max_steps  # the final samples show where the run ended
                if cfg.validation_every and (self.step % cfg.validation_every == 0 or last):
                    with self.off_the_training_graphs():
                        self.validate()
            export = self.export() if cfg.export and self.step == cfg.max_steps else None
            self.finish_checkpoints()
            if self.runtime.is_main and self.step == cfg.max_steps:
                summary = write_summary(self.out)
                pflog.log(f"run summary: {summary.path} (loss curve: {summary.plot})")
        finally:
            self.close()
        return TrainReport(
            output_dir=str(self.out),
            steps=self.step,
            resumed_from=str(resumed) if resumed else None,
            final_loss=self.losses[-1] if self.losses else None,
            checkpoints=self.saved,
            export_dir=str(export) if export else None,
            losses=self.losses,
            seconds=time.perf_counter() - start,
            is_main=self.runtime.is_main,
        )

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step: ``grad_accum`` forward/backwards, clip, (maybe) update, EMA.

        The step reads device values on the host once, for the skip decision (all-reduced loss and grad
        norm, in one transfer): every read waits for all queued GPU work, so the other numbers stay on
        the device until then. Before each micro-step is launched, the batches to come (the next
        micro-step's; with merged micro-batches the next step's) are drawn and handed to the feed's thread to
        assemble (:meth:`next_micro_batch`), so the host's tensor work on the data runs while the main thread
        launches the forward and backward.
        """
        cfg, acc, world = self.cfg, self.runtime.accelerator, self.runtime.world_size
        tic = time.perf_counter()
        if self.collector is None:  # automatic collection off from the first step until close()
            self.collector = Collector(cfg.gc_every)
        lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses
        self.model.train()
        faults.fault("train_step", rank=self.runtime.rank, step=self.step + 1)  # test hook
        stats, local_bad, step_ids = self.accumulate_gradients()
        # every rank takes the same decision from the same (all-reduced) numbers
        stats = acc.reduce(stats, reduction="sum")
        if not self.sharded:
            acc.unscale_gradients()  # fp16: the loss scale off the gradients first (a no-op otherwise)
        clip_norm, norm = optim.gradient_norm(self.model.parameters())  # the whole model's, on every rank
        wait = time.perf_counter()
        totals = torch.cat([stats, norm.reshape(1).to(stats)]).tolist()  # the step's one wait for the GPU
        self.wait_seconds = time.perf_counter() - wait
        mean_loss, grad_norm = totals[0] / world, totals[-1]
        skipped = self.skip_reason(mean_loss, grad_norm, local_bad, step_ids)
        if skipped is None and cfg.grad_clip is not None:  # a pass over the gradients only where it clips
            optim.clip_gradients(self.model.parameters(), cfg.grad_clip, clip_norm, grad_norm)
        self.update(skipped)

        tokens, samples = totals[-3], totals[-2]
        self.tokens_seen += int(tokens)
        if self.warmup is not None:
            self.warmup.after_step(self.step, time.perf_counter())
        self.collector.after_step(self.step, warm=self.warmup is None or self.warmup.done)
        seconds = time.perf_counter() - tic
        return self.step_metrics(seconds, tokens) | {
            "step": self.step,
            "loss": mean_loss,
            **{f"loss_stage{stage}": totals[1 + i] / world for i, stage in enumerate(self.stages)},
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": skipped is not None,
            "tokens_per_s": tokens / seconds,
            "samples_per_s": samples / seconds,
            "step_time_s": seconds,
        }

    def step_metrics(self, seconds: float, tokens: float) -> dict[str, float]:
        """The step's host time loading data and waiting for the GPU, the run's wall time so far, and on CUDA
        the peak memory (reset for the next step) and the MFU (on a GPU of known peak)."""
        device, data_seconds, self.data_seconds = self.runtime.device, self.data_seconds, 0.0
        out = {
            "data_time_s": data_seconds,
            "gpu_wait_s": self.wait_seconds,
            "elapsed_s": time.perf_counter() - self.started,
        }
        if device.type == "cuda":
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        if self.peak_flops is not None:
            out["mfu"] = mfu(self.num_parameters, tokens, seconds, self.runtime.world_size, self.peak_flops)
        return out

    def accumulate_gradients(self) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """``grad_accum`` micro-batches, each drawn and noised in turn, then run through the DiT each with its own
        forward and backward, or all in one (``train.merge_micro_batches``, as settled: their columns side by
        side, :func:`pfctl.flow.pyramid.merge_pyramid_batches`; each micro-batch has the same columns, so the
        loss and the losses per stage are the means of theirs). Returns the summed ``[loss, loss per stage...,
        tokens, samples]`` (on the device), whether this rank's loss was non-finite (read only when the step's
        numbers are not finite, to name this rank's clips: no wait otherwise), and the clip ids of the step."""
        cfg, device = self.cfg, self.runtime.device
        stats = torch.zeros(len(self.stages) + 3, dtype=torch.float64, device=device)
        local_bad = torch.zeros((), dtype=torch.bool, device=device)
        step_ids = []  # for the message when the loss is not finite
        merged = cfg.merge_micro_batches is True  # (settled: false with one micro-batch a step)
        drawn: list[tuple[TrainBatch, PyramidBatch]] = []
        for micro in range(cfg.grad_accum):
            tic = time.perf_counter()
            last = micro == cfg.grad_accum - 1
            batch = self.next_micro_batch(merged)
            step_ids.extend(batch.ids)
            inputs, record = self.noised(batch)
            self.micro_step += 1
            if self.warmup is not None:
                self.warmup.saw(record["bucket"], record["units"], tic)
            stats[-2] += record["tokens"]  # python numbers: no host-to-device copy
            stats[-1] += cfg.batch_size
            self.write_assignment(record)
            if merged:
                drawn.append((batch, inputs))
                continue
            with contextlib.nullcontext() if last else self.no_sync():
                loss, per_stage = self.forward_backward(inputs, TextRows.of(batch), cfg.grad_accum, micro == 0)
            local_bad |= self.tally(stats, loss, per_stage, cfg.grad_accum)
        if merged:
            batches, parts = zip(*drawn, strict=True)
            text = merged_text_rows(list(batches), columns=len(parts[0].sample))
            loss, per_stage = self.forward_backward(merge_pyramid_batches(parts), text, 1, True)
            local_bad |= self.tally(stats, loss, per_stage, 1)
        if self.step_graphs is not None and self.runtime.world_size > 1:  # (recorded without DDP's all-reduce)
            average_gradients(self.grad_buffers, self.runtime.world_size)
        return stats, local_bad, step_ids

    def next_micro_batch(self, merged: bool) -> TrainBatch:
        """The batch of this micro-step on the device. The batches to come are drawn and handed to the feed's
        thread, to be assembled while this step is launched: the next micro-step's, or with merged micro-batches
        (which all wait for the one forward) every micro-step's of the next step; none beyond the run."""
        tic, accum = time.perf_counter(), self.cfg.grad_accum
        batch = self.feed.next_batch(self.micro_step)
        through = (self.micro_step // accum + 2) * accum - 1 if merged else self.micro_step + 1
        self.feed.prefetch_through(self.micro_step, min(through, self.cfg.max_steps * accum - 1))
        self.data_seconds += time.perf_counter() - tic
        if faults.poisoned("train_nan", rank=self.runtime.rank, step=self.step + 1):  # test hook
            batch.latents = torch.full_like(batch.latents, float("nan"))
        return batch

    def forward_backward(
        self, inputs: PyramidBatch, text: TextRows, parts: int, first: bool
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`loss_and_backward`, through the step's CUDA graphs under ``train.cuda_graphs=step`` (keyed by
        the text's valid lengths only where row groups read them; a step's ``first`` one replaces the gradients)."""
        if self.step_graphs is None:
            return self.loss_and_backward(inputs, text, parts)
        if not self.unwrapped.row_groups_active:
            text = dataclasses.replace(text, text_lengths=None)
        return self.step_graphs(self.loss_and_backward, inputs, text, parts, fresh=first)

    def loss_and_backward(
        self, inputs: PyramidBatch, text: TextRows, parts: int
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`loss` (one of ``parts`` equal parts of the step), its backward; the losses, detached."""
        loss, per_stage = self.loss(inputs, text)
        self.runtime.accelerator.backward(loss / parts if parts > 1 else loss)
        return loss.detach(), {stage: value.detach() for stage, value in per_stage.items()}

    def tally(
        self, stats: torch.Tensor, loss: torch.Tensor, per_stage: dict[int, torch.Tensor], parts: int
    ) -> torch.Tensor:
        """Add a forward's loss and losses per stage (one of ``parts`` equal parts of the step) to ``stats``;
        returns whether the loss is non-finite (on the device)."""
        loss = loss.detach()
        stats[0] += loss.double() / parts
        for i, stage in enumerate(self.stages):
            stats[1 + i] += per_stage[stage].double() / parts
        return ~torch.isfinite(loss)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A non-final micro-step's backward keeps its gradients local (no all-reduce / reduce-scatter)."""
        if self.sharded:
            return sharding.no_gradient_sync(self.model)
        return self.runtime.accelerator.no_sync(self.model)

    def skip_reason(
        self, mean_loss: float, grad_norm: float, local_bad: torch.Tensor, step_ids: list[str]
    ) -> str | None:
        """Why this step's update is skipped (None: it is applied); ``nan_policy=stop`` raises instead."""
        cfg, world = self.cfg, self.runtime.world_size
        if not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            what = f"non-finite loss {mean_loss} / grad norm {grad_norm} at step {self.step + 1}"
            if bool(local_bad):  # the rank(s) whose own loss is NaN name their clips
                where = f" on rank {self.runtime.rank}" if world > 1 else ""
                pflog.log(f"{what}{where}: clips {step_ids}", all_ranks=True)
            if cfg.nan_policy == "stop":
                self.optimizer.zero_grad(set_to_none=True)
                raise CheckFailed(
                    f"{what} (train.nan_policy=stop); clips of this step on rank {self.runtime.rank}: {step_ids}",
                    hint="the last checkpoint is intact; inspect those clips, or set train.nan_policy=skip "
                    "to skip such steps, then resume with --resume latest",
                )
            return "non-finite"
        if cfg.skip_loss_above is not None and mean_loss >= cfg.skip_loss_above:
            return f"loss {mean_loss:.4f} >= skip_loss_above {cfg.skip_loss_above}"
        return None

    def update(self, skipped: str | None) -> None:
        """Apply the step (unless ``skipped``), advance the LR schedule and the step count, update the EMA."""
        if skipped is None:
            self.optimizer.step()
        else:
            pflog.warn(f"step {self.step + 1}: skipped the update ({skipped})")
        with warnings.catch_warnings():  # a skipped update still advances the schedule (by design)
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.step()
        if self.step_graphs is None:  # (the step's graphs: the next step's first micro-batch replaces them)
            self.optimizer.zero_grad(set_to_none=not self.keeps_gradients)
        self.step += 1
        if self.ema is not None and self.ema.should_update(self.step):
            self.ema.update(self.trained_state())

    def off_the_training_graphs(self) -> contextlib.AbstractContextManager:
        """Under ``train.cuda_graphs=true``, the held-out loss and validation samples run the blocks eagerly: the
        shapes of those occasional calls would otherwise be recorded as graphs that keep their memory."""
        return torch.compiler.set_stance("force_eager") if self.cfg.cuda_graphs is True else contextlib.nullcontext()

    def noised(self, batch: TrainBatch) -> tuple[PyramidBatch, dict[str, Any]]:
        """Pyramid inputs for this rank's units of this micro-step, and the assignment record.

        ``batch`` is on the device already (:meth:`next_micro_batch`)."""
        cfg = self.cfg
        pyramid = pyramid_latents(batch.latents, num_stages=3)
        units = None
        if cfg.use_temporal_pyramid:
            units = self.lengths.lengths(self.micro_step, self.runtime.rank, clip_units=batch.bucket[0])
        inputs = self.noise_inputs(pyramid, units, RandomSource.of(self.noise), draw_unused_corruption=False)
        record = measured_assignment(
            cfg, batch, inputs, step=self.step + 1, micro_step=self.micro_step, rank=self.runtime.rank,
            group=self.runtime.sync.index,
        )  # fmt: skip
        return inputs, record

    def loss(self, inputs: PyramidBatch, text: TextRows) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """DiT → flow-matching loss: the loss (the mean over every column and sample) and the losses per stage."""
        result = flow_matching_loss(self.predict(inputs, text), inputs.targets, inputs.column_to_stage)
        return result.loss, result.per_stage

    def noise_inputs(
        self,
        pyramid: list[torch.Tensor],
        units: Sequence[int] | None,
        rng: RandomSource | torch.Generator,
        *,
        draw_unused_corruption: bool,
    ) -> PyramidBatch:
        """Noised DiT inputs in the configured mode: the temporal pyramid over ``units`` (required then),
        or the full sequence at once."""
        cfg = self.cfg
        if cfg.use_temporal_pyramid:
            return build_temporal_pyramid_batch(
                pyramid,
                self.flow,
                units,
                sample_ratios=cfg.sample_ratios,
                corrupt_ratio=cfg.corrupt_ratio,
                rng=rng,
            )
        return build_full_sequence_batch(
            pyramid,
            self.flow,
            sample_ratios=cfg.sample_ratios,
            rng=rng,
            draw_unused_corruption=draw_unused_corruption,
        )

    def predict(self, inputs: PyramidBatch, text: TextRows) -> list[torch.Tensor]:
        """The DiT on one noised batch under the runtime's autocast (text rows on the device already; their
        valid tokens, when known on the host, let ``skip_future_keys`` drop the padding)."""
        if self.graphed:
            # a new forward: the blocks' graphs may overwrite what the last one left (nothing reads it now)
            torch.compiler.cudagraph_mark_step_begin()
        model = self.model if self.step_graphs is None else self.unwrapped  # (a recording holds no collective)
        with self.runtime.accelerator.autocast():
            return model(
                sample=inputs.sample,
                encoder_hidden_states=text.prompt_embeds,
                encoder_attention_mask=text.prompt_attention_mask,
                pooled_projections=text.pooled_prompt_embeds,
                timestep_ratio=inputs.timesteps,
                text_lengths=text.text_lengths,
            )

    # ------------------------------------------------------------------------------------------
    # setup, in the order it happens
    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """runtime → data → model → speed layer → optimizer/LR → EMA, noise, logs."""
        self.setup_runtime()
        self.setup_data()
        self.resolve_speed()
        model = self.setup_model()
        self.num_parameters = sum(p.numel() for p in model.parameters())  # N of the MFU's 6·N per token
        self.model = self.apply_speed(model)
        self.unwrapped = self.runtime.accelerator.unwrap_model(self.model)
        self.setup_optimizer()
        self.setup_state()
        self.setup_warmup()

    def setup_runtime(self) -> None:
        """Every layout rule before any process group exists (all ranks fail alike, exit 2); then the
        processes, device, precision, sync groups and seeds."""
        from pfctl.runtime.accelerator import build_runtime, world_size_from_env

        cfg = self.cfg
        check_train_constraints(cfg, world_size_from_env())
        self.lengths = (
            plan_stage_lengths(cfg.max_units, cfg.video_sync_group) if cfg.use_temporal_pyramid else None
        )
        self.out.mkdir(parents=True, exist_ok=True)
        self.runtime = build_runtime(
            self.config.runtime,
            sync_group_size=cfg.video_sync_group,
            project_dir=str(self.out),
            log_with=list(cfg.trackers) or None,
        )
        self.logs = RunLogs(self.out, self.cfg, self.runtime)

    def resolve_speed(self) -> None:
        """The ``auto`` speed options settled for this device and world size
        (:func:`pfctl.config.train.resolve_train_speed`; merged micro-batches where the memory estimate of the
        merged step fits the GPU): the run's config holds the settled values from here on (and its
        ``config.yaml`` shows them)."""
        from pfctl.models.fast.compile import compiler_missing

        cfg, device = self.cfg, self.runtime.device
        no_compiler = compiler_missing() if device.type == "cuda" else None
        too_big = None
        if device.type == "cuda" and cfg.merge_micro_batches == "auto" and cfg.grad_accum > 1:
            too_big = self.merged_step_too_big()
        speed = resolve_train_speed(cfg, device.type, self.runtime.world_size, no_compiler, too_big)
        settled = {
            "compile": speed.compile,
            "cuda_graphs": speed.cuda_graphs,
            "attention": speed.attention,
            "fsdp": speed.fsdp,
            "merge_micro_batches": bool(speed.merge_micro_batches),
        }
        self.cfg = cfg.model_copy(update=settled)
        self.config = self.config.model_copy(update={"train": self.cfg})
        pflog.log("speed: " + speed.describe())

    def merged_step_too_big(self) -> str | None:
        """Why this GPU cannot hold a step with merged micro-batches (its memory estimate over 90% of the GPU),
        or another rank's cannot: every rank decides alike, as their collectives per forward must match."""
        device, world = self.runtime.device, self.runtime.world_size
        peak = estimate_for_run(self.config, self.data.cache, self.training_clips(), merged=True, world_size=world)
        too_big = merge_too_big(peak.total, torch.cuda.get_device_properties(device).total_memory)
        if world > 1:
            flag = torch.tensor([int(too_big is not None)], device=device)
            if int(self.runtime.accelerator.reduce(flag, reduction="sum")) and too_big is None:
                too_big = "another rank's GPU cannot hold the merged step"
        return too_big

    def setup_data(self) -> None:
        """The cache (format + fingerprint checked), the group's sampler and loader, the batch feed."""
        rt = self.runtime
        self.data = build_data(
            self.config, num_groups=rt.sync.plan.num_groups, group_index=rt.sync.index, seed=rt.seed,
            agree=group_agreement(rt.sync, rt.device),
        )  # fmt: skip
        self.feed = BatchFeed(self.data, rt.device, skip_future_keys=self.cfg.skip_future_keys)

    def training_clips(self) -> list[ClipInfo]:
        """The cache's clips this run trains on (the held-out ones left out)."""
        heldout = {c.id for c in self.data.heldout}
        return [c for c in cache_clips(self.data.cache) if c.id not in heldout]

    @property
    def loader(self) -> LatentClipLoader:
        return self.data.loader

    def setup_model(self) -> torch.nn.Module:
        """The DiT: fp32 master weights (bf16 only inside autocast), what trains on it (all of it, or LoRA
        adapters on a frozen base), and the weights of the checkpoint to resume from. Only the DiT is
        loaded: the cache holds the text embeddings and latents, so no text encoder and no VAE exist here."""
        cfg, rt = self.cfg, self.runtime
        self.model_name, model, base_model_path, model_info = build_model(self.config)
        check_cache_matches_model(self.data.cache, model)
        check_cache_buckets(cache_clips(self.data.cache), model, cfg)
        model.set_attention_backend(
            cfg.attention, cfg.skip_future_keys, cfg.row_group_min_tokens, cfg.row_group_min_rows
        )
        self.weights = trained_weights(
            self.config, model_name=self.model_name, base_model_path=base_model_path, model_info=model_info
        )
        self.weights.prepare(model, seed=rt.seed, mixed_precision=rt.mixed_precision)
        self.resume_from = ckpt.resolve_resume(cfg.resume, self.out / "checkpoints")
        self.loaded = ckpt.load_checkpoint(self.resume_from, rank=rt.rank) if self.resume_from else None
        if self.loaded is not None:
            self.check_resumable(self.loaded.train_state)
            self.weights.load(model, self.loaded.model_state, self.resume_from / "model")
        return model

    @property
    def sharded(self) -> bool:
        """``train.fsdp`` is on: the DiT's parameters, gradients, optimizer and EMA state are sharded."""
        return self.cfg.fsdp != "none"

    def apply_speed(self, model: torch.nn.Module) -> torch.nn.Module:
        """The speed layer, in torchtitan's order: kernels → activation checkpointing → compile
        (:func:`apply_fast_paths`) → sharding: FSDP2 per block and root (:func:`pfctl.training.build.shard_dit`;
        accelerate does not wrap the sharded model), or accelerate's ``prepare`` (DDP when there are several
        processes)."""
        apply_fast_paths(model, self.config, self.runtime.device)
        if self.sharded:
            return shard_dit(model, self.cfg, self.runtime)
        return self.runtime.accelerator.prepare(model)

    @property
    def graphed(self) -> bool:
        """The DiT blocks run as CUDA graphs (:meth:`resolve_speed`)."""
        return self.cfg.cuda_graphs is True and self.runtime.device.type == "cuda"

    @property
    def keeps_gradients(self) -> bool:
        """The gradients are made once and kept (CUDA graphs write into the same memory each replay)."""
        return self.graphed or self.cfg.cuda_graphs == "step"  # (settled: CUDA only)

    def setup_optimizer(self) -> None:
        """Optimizer + LR schedule, created on the sharded / prepared model's parameters (FSDP needs that).

        With CUDA graphs the gradients are tensors of their own from the start, kept rather than freed after
        each update: the blocks' graphs would leave a first ``.grad`` in their pool, which the next forward
        reuses (so they are zeroed); the step's graphs write into the tensors they were recorded with."""
        self.optimizer = self.runtime.accelerator.prepare(optim.build_optimizer(self.model, self.cfg))
        self.lr_scheduler = optim.build_lr_scheduler(self.optimizer, self.cfg)
        if self.keeps_gradients:
            trained = [p for p in self.model.parameters() if p.requires_grad]
            self.grad_buffers = gradient_buffers(trained)
            if self.cfg.cuda_graphs == "step":
                self.step_graphs = StepGraphs(self.runtime.device, trained, records_first_apart(self.cfg))

    def setup_state(self) -> None:
        """EMA (fp32 shadow), the pyramid scheduler, the per-rank noise generator, the checkpoint writer; the
        resolved config and the trackers."""
        cfg, rt = self.cfg, self.runtime
        self.ema = EMA(self.trained_state(), cfg.ema_decay, cfg.ema_every) if cfg.ema_decay else None
        self.flow = PyramidFlowScheduler()
        noise_seed = int(group_rng(rt.seed, _NOISE, rt.rank).integers(2**62))
        self.noise = torch.Generator(device=rt.device).manual_seed(noise_seed)
        self.peak_flops = peak_flops(rt.device)
        background = cfg.checkpoint_async is True or (cfg.checkpoint_async == "auto" and rt.device.type == "cuda")
        self.saver = (
            ckpt.BackgroundSaver(
                self.out / "checkpoints", rank=rt.rank, world_size=rt.world_size, is_main=rt.is_main,
                barrier=rt.barrier, keep_last=cfg.keep_last,
                on_saved=lambda path: pflog.log(f"saved checkpoint {path}"),
            )
            if background
            else None
        )  # fmt: skip
        if rt.is_main:
            from pfctl.config import dump_config

            atomic_write_text(self.out / "config.yaml", dump_config(self.config))
            resume_step = int(self.loaded.train_state["step"]) if self.loaded is not None else None
            start_trackers(rt.accelerator, cfg, self.out, flat_config(cfg), resume_step)

    def setup_warmup(self) -> None:
        """With compiled blocks or the step's CUDA graphs: the warm-up's inputs announced, and its end logged
        (:func:`pfctl.training.warmup.watch_warmup`)."""
        rt = self.runtime
        self.warmup = watch_warmup(
            self.cfg, lambda: token_count_sets(self.cfg, rt.rank, self.training_clips()), self.out, rt.device,
            rt.is_main, self.step_graphs,
        )  # fmt: skip

    def resume(self) -> Path | None:
        """Restore optimizer, LR schedule, EMA, counters, data position and RNGs (weights: in setup)."""
        loaded = self.loaded
        if loaded is None:
            self.logs.trim(0)
            return None
        if loaded.optimizer_state is not None:
            load_optimizer_state(self.unwrapped, self.optimizer, loaded.optimizer_state, sharded=self.sharded)
        if loaded.scheduler_state is not None:
            self.restore_schedule(loaded)
        if self.ema is not None:
            if loaded.ema_state is None:
                raise CheckpointError(f"{loaded.path} has no EMA weights but train.ema_decay is set")
            self.ema.load_state_dict(loaded.ema_state)
        state = loaded.train_state
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.micro_step = int(loaded.rank_state["micro_step"])
        self.data.sampler.load_state_dict(loaded.rank_state["sampler"])
        ckpt.restore_rng_state(loaded.rank_tensors, loaded.rank_state["rng"], self.noise)
        self.logs.trim(self.step)
        self.loaded = None  # free the tensors
        return loaded.path

    def restore_schedule(self, loaded: ckpt.LoadedCheckpoint) -> None:
        """The checkpoint's step on this run's LR schedule: another ``max_steps`` rescales it (logged)."""
        lr = optim.restore_lr_scheduler(self.lr_scheduler, loaded.scheduler_state, self.cfg)
        was = loaded.train_state.get("max_steps", self.cfg.max_steps)
        if was != self.cfg.max_steps:
            pflog.log(
                f"LR schedule rescaled to max_steps {self.cfg.max_steps} (the checkpoint was written for "
                f"{was}): step {int(loaded.train_state['step']) + 1} uses lr {lr:.3g}"
            )

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What the run trains (and checkpoints, and averages): the adapter with LoRA, else the DiT."""
        return self.weights.trained_state(self.model, self.unwrapped, self.runtime.accelerator)

    def layout(self) -> dict[str, Any]:
        """What a bit-exact continuation needs to be the same (recorded in ``train_state.json``)."""
        rt, cfg = self.runtime, self.cfg
        return {
            "world_size": rt.world_size,
            "video_sync_group": cfg.video_sync_group,
            "batch_size": cfg.batch_size,
            "grad_accum": cfg.grad_accum,
            "seed": rt.seed,
            **self.weights.signature(),
        }

    def check_resumable(self, state: dict[str, Any]) -> None:
        """A bit-exact continuation needs the same layout; say which number differs."""
        if self.loaded is not None and self.loaded.is_lora != self.weights.is_lora:
            kind = "a LoRA adapter" if self.loaded.is_lora else "full DiT weights"
            raise CheckpointError(
                f"cannot resume {self.resume_from}: it holds {kind} but train.lora.enabled is "
                f"{self.cfg.lora.enabled}",
                hint="resume with the train.lora settings the checkpoint was written with",
            )
        diff = {k: (state.get(k), v) for k, v in self.layout().items() if state.get(k) != v}
        if diff:
            text = ", ".join(f"{k} was {a}, now {b}" for k, (a, b) in diff.items())
            raise CheckpointError(
                f"cannot resume {self.resume_from}: {text}",
                hint="resume with the layout the checkpoint was written with",
            )

    # ------------------------------------------------------------------------------------------
    # pieces of the loop
    # ------------------------------------------------------------------------------------------
    def write_assignment(self, record: dict[str, Any]) -> None:
        self.logs.assignment(record)

    def save_checkpoint(self) -> None:
        rt, cfg = self.runtime, self.cfg
        rng_tensors, rng_meta = ckpt.rng_state(self.noise)
        model_state = self.weights.checkpoint_state(self.model, self.unwrapped, rt.accelerator)
        payload = ckpt.CheckpointPayload(
            step=self.step,
            train_state={
                "tokens_seen": self.tokens_seen,
                "max_steps": cfg.max_steps,  # a resume with another one rescales the LR schedule (and says so)
                **self.layout(),
                "model_name": self.model_name,
                "losses_tail": self.losses[-10:],
            },
            rank_state={"micro_step": self.micro_step, "sampler": self.feed.position(), "rng": rng_meta},
            rank_tensors=rng_tensors,
            model=self.unwrapped,
            model_state=model_state,
            ema_state=self.ema.state_dict() if self.ema is not None else None,
            optimizer_state=optimizer_state(self.unwrapped, self.optimizer, sharded=self.sharded),
            scheduler_state=self.lr_scheduler.state_dict(),
            adapter_config=self.weights.adapter_config(),
        )
        if self.saver is not None:
            path = self.saver.save(payload)
            pflog.log(f"writing checkpoint {path} in the background")
        else:
            path = ckpt.save_checkpoint(
                self.out / "checkpoints", payload, rank=rt.rank, is_main=rt.is_main, barrier=rt.barrier,
                keep_last=cfg.keep_last,
            )  # fmt: skip
            pflog.log(f"saved checkpoint {path}")
        self.saved.append(str(path))

    def finish_checkpoints(self) -> None:
        """The checkpoint written in the background (if any) is complete on every rank (raises its error)."""
        if self.saver is not None:
            self.saver.wait()
            self.runtime.barrier()

    def export(self) -> Path:
        """``output_dir/export`` (main process): a model folder ``pfctl generate --model`` loads, or for a
        LoRA run the adapter folder ``pfctl generate --lora`` loads; with ``train.export_format``
        ``official``/``both`` also ``output_dir/export-official`` (the official layout, from that export)."""
        out = self.out / "export"
        rt = self.runtime
        # collectives when sharded: every rank gathers, the main process gets the whole weights
        state = self.weights.checkpoint_state(self.model, self.unwrapped, rt.accelerator)
        ema_state = self.ema.state_dict() if self.ema is not None else None
        if rt.is_main:
            self.weights.export(
                out, self.unwrapped, state, ema_state,
                steps=self.step, extra={"cache": cache_path(self.config), **cache_vae_info(self.data.cache)},
            )  # fmt: skip
            if self.cfg.export_format != "pfctl":
                from pfctl.training.export import export_official

                official = export_official(out, self.out / "export-official", replace=True).output_dir
                pflog.log(f"exported the model in the official Pyramid Flow layout to {official}")
                if self.cfg.export_format == "official":
                    shutil.rmtree(out)
        self.runtime.barrier()
        return self.out / ("export-official" if self.cfg.export_format == "official" else "export")

    def heldout_loss(self) -> dict[str, float]:
        """The held-out losses of this step (:func:`pfctl.training.evaluate.heldout_loss`)."""
        return heldout_loss(self)

    def validate(self) -> ValidationSamples | None:
        """Validation samples of this step (:func:`pfctl.training.evaluate.sample_validation`): latents,
        and when the cache names its VAE, the videos and their contact sheet, also sent to the trackers."""
        dit = self.model if self.sharded else self.unwrapped
        self.model.eval()
        samples = sample_validation(self.config, self.runtime, self.data, dit, self.out, self.step)
        self.model.train()
        if samples is not None and samples.image is not None and self.cfg.trackers:
            log_validation(self.runtime.accelerator, samples.image, samples.videos, self.step)
        return samples

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        if self.saver is not None:  # a failed run still completes the save in flight
            try:
                self.saver.wait()
            except CheckpointError as exc:  # (a run that ends well has raised it in finish_checkpoints)
                pflog.warn(str(exc))
        if getattr(self, "runtime", None) is not None and self.cfg.trackers:
            self.runtime.accelerator.end_training()


def run_training(config: Any) -> TrainReport:
    """Entry point of ``api.train``."""
    return Trainer(config).train()


__all__ = ["TrainReport", "Trainer", "run_training"]
