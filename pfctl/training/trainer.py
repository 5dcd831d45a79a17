"""``pfctl train``: pyramidal flow matching with video sync groups.

Read :meth:`Trainer.train` first: resume → loop (``train_step`` → log → checkpoint → eval) →
final checkpoint and export. Everything it calls is set up, in named steps, by
:meth:`Trainer.setup`. The pyramid math lives in :mod:`pfctl.flow`, the data rules in
:mod:`pfctl.data.dataset`, the checkpoint format in :mod:`pfctl.training.checkpoint`.

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
import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pfctl.config.train import TrainConfig, check_train_constraints, columns_to_stages
from pfctl.data.dataset import (
    ClipInfo,
    LatentClipLoader,
    SyncGroupSampler,
    TrainBatch,
    group_rng,
    stored_latent,
    unbatch,
)
from pfctl.errors import CacheError, CheckFailed, CheckpointError, ConfigError
from pfctl.flow.loss import flow_matching_loss
from pfctl.flow.pyramid import (
    PyramidBatch,
    RandomSource,
    build_full_sequence_batch,
    build_temporal_pyramid_batch,
    plan_stage_lengths,
    pyramid_latents,
)
from pfctl.flow.scheduler import PyramidFlowScheduler
from pfctl.models.attention_layout import right_padded_lengths
from pfctl.runtime import faults
from pfctl.runtime import logging as pflog
from pfctl.training import checkpoint as ckpt
from pfctl.training.ema import EMA
from pfctl.training.optim import build_lr_scheduler, build_optimizer
from pfctl.training.plan import assignment
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


@dataclass
class _Prefetched:
    """A micro-step's batch loaded ahead (:meth:`Trainer.prefetch`): the batch, or the data error that
    loading it raised, and the sampler state before it was drawn (what a checkpoint records meanwhile)."""

    position: dict[str, Any]
    batch: TrainBatch | None = None
    error: CacheError | None = None


class Trainer:
    """Owns the run: runtime, data, model, optimizer, EMA, checkpoints, logs."""

    def __init__(self, config: Any) -> None:
        self.config = config  # pfctl.config.schema.RecipeConfig
        self.cfg: TrainConfig = config.train
        self.out = Path(self.cfg.output_dir)
        self.step = 0  # optimizer steps done
        self.micro_step = 0  # forwards done by this rank (indexes the sampler and the unit schedule)
        self.tokens_seen = 0
        self.losses: list[float] = []
        self.saved: list[str] = []
        self.lora_targets: list[str] | None = None  # adapted module names of a LoRA run
        self.model_info: dict[str, Any] = {}
        self.loaded: ckpt.LoadedCheckpoint | None = None
        self.prefetched: _Prefetched | None = None  # the batch of micro-step `micro_step`, loaded ahead

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
            if cfg.eval_every and self.step == 0:  # the baseline the held-out curve starts from
                self.log_metrics({"heldout_loss": self.heldout_loss()})
            while self.step < cfg.max_steps:
                metrics = self.train_step()
                if metrics is None:  # a non-finite loss with nan_policy=stop
                    break
                self.losses.append(metrics["loss"])
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    self.log_metrics(metrics)
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.max_steps:
                    self.save_checkpoint()
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    with self.off_the_training_graphs():
                        self.log_metrics({"heldout_loss": self.heldout_loss()})
                if cfg.validation_every and self.step % cfg.validation_every == 0:
                    with self.off_the_training_graphs():
                        self.validate()
            export = self.export() if cfg.export and self.step == cfg.max_steps else None
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
        the device until then. Right after each backward is launched, the next micro-step's batch is
        loaded (:meth:`prefetch`), so the host's data work runs while the GPU computes that backward.
        """
        cfg, acc = self.cfg, self.runtime.accelerator
        tic = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses
        self.model.train()
        stages = sorted(set(columns_to_stages(cfg.sample_ratios)))
        # [loss, loss per stage..., tokens, samples], summed over micro-batches then over ranks
        stats = torch.zeros(len(stages) + 3, dtype=torch.float64, device=self.runtime.device)
        # whether a micro-batch of this rank had a non-finite loss: read only when the step's numbers are
        # not finite (to name this rank's clips), so it costs no wait otherwise
        local_bad = torch.zeros((), dtype=torch.bool, device=self.runtime.device)
        faults.fault("train_step", rank=self.runtime.rank, step=self.step + 1)  # test hook
        step_ids = []  # for the message when the loss is not finite
        for micro in range(cfg.grad_accum):
            batch = self.next_batch()
            if faults.poisoned("train_nan", rank=self.runtime.rank, step=self.step + 1):  # test hook
                batch.latents = torch.full_like(batch.latents, float("nan"))
            step_ids.extend(batch.ids)
            last = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                loss, per_stage, record = self.forward(batch)
                acc.backward(loss / cfg.grad_accum)
            self.micro_step += 1
            if not (last and self.step + 1 >= cfg.max_steps):  # no batch after the run's last step
                self.prefetch()
            loss = loss.detach()
            stats[0] += loss.double() / cfg.grad_accum
            local_bad |= ~torch.isfinite(loss)
            for i, stage in enumerate(stages):
                stats[1 + i] += per_stage[stage].double() / cfg.grad_accum
            stats[-2] += record["tokens"]  # python numbers: no host-to-device copy
            stats[-1] += cfg.batch_size
            self.write_assignment(record)

        # every rank takes the same decision from the same (all-reduced) numbers
        stats = acc.reduce(stats, reduction="sum")
        world = self.runtime.world_size
        max_norm = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
        totals = torch.cat([stats, norm.reshape(1).to(stats)]).tolist()  # the step's one wait for the GPU
        mean_loss, grad_norm = totals[0] / world, totals[-1]
        skipped = None
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
            skipped = "non-finite"
        elif cfg.skip_loss_above is not None and mean_loss >= cfg.skip_loss_above:
            skipped = f"loss {mean_loss:.4f} >= skip_loss_above {cfg.skip_loss_above}"
        if skipped is None:
            self.optimizer.step()
        else:
            pflog.warn(f"step {self.step + 1}: skipped the update ({skipped})")
        with warnings.catch_warnings():  # a skipped update still advances the schedule (by design)
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.ema is not None and self.ema.should_update(self.step):
            self.ema.update(self.trained_state())

        tokens, samples = totals[-3], totals[-2]
        self.tokens_seen += int(tokens)
        seconds = time.perf_counter() - tic
        return {
            "step": self.step,
            "loss": mean_loss,
            **{f"loss_stage{stage}": totals[1 + i] / world for i, stage in enumerate(stages)},
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": skipped is not None,
            "tokens_per_s": tokens / seconds,
            "samples_per_s": samples / seconds,
            "step_time_s": seconds,
        }

    def off_the_training_graphs(self) -> contextlib.AbstractContextManager:
        """Under ``train.cuda_graphs``, the held-out loss and validation samples run the DiT blocks eagerly:
        every shape those occasional calls bring would otherwise be recorded as CUDA graphs that keep their
        memory for the rest of the run."""
        return torch.compiler.set_stance("force_eager") if self.cfg.cuda_graphs else contextlib.nullcontext()

    def next_batch(self) -> TrainBatch:
        """The batch of micro-step ``self.micro_step`` on the device: the prefetched one, else loaded now."""
        ahead, self.prefetched = self.prefetched, None
        if ahead is None:
            return self.to_device(self.loader.next_batch(self.micro_step))
        if ahead.error is not None:
            raise ahead.error
        return ahead.batch

    def prefetch(self) -> None:
        """Load the batch of micro-step ``self.micro_step`` now and queue its copy to the device.

        Called right after a backward is launched, before anything waits for the GPU. It runs on the
        main thread, in the same order on every rank, because the loader may all-reduce load failures
        over the sync group. The data position before the draw is kept: until the batch is used, a
        checkpoint records that position, so a resumed run draws the same batch again. A data error
        (:class:`CacheError`) is raised by the micro-step that uses the batch, as without prefetching
        (the step before still completes and checkpoints); anything else, e.g. a failed collective, at once.
        """
        position = self.sampler.state_dict()
        try:
            batch = self.loader.next_batch(self.micro_step)
        except CacheError as exc:
            self.prefetched = _Prefetched(position, error=exc)
            return
        self.prefetched = _Prefetched(position, batch=self.to_device(batch))

    def data_position(self) -> dict[str, Any]:
        """The sampler state a checkpoint records: before the prefetched batch, if one is waiting."""
        return self.prefetched.position if self.prefetched is not None else self.sampler.state_dict()

    def to_device(self, batch: TrainBatch) -> TrainBatch:
        """The batch with its tensors on the training device.

        On a GPU the copies are queued from pinned memory without blocking: a copy from pageable memory
        first waits for every kernel already queued (during a prefetch: the whole backward).
        """
        device = self.runtime.device
        pinned = device.type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pinned else t).to(device, non_blocking=pinned)

        lengths = right_padded_lengths(batch.prompt_attention_mask) if self.cfg.skip_future_keys else None
        return dataclasses.replace(
            batch,
            text_lengths=lengths,  # before the copy: no wait for the GPU
            latents=move(batch.latents),
            prompt_embeds=move(batch.prompt_embeds),
            prompt_attention_mask=move(batch.prompt_attention_mask),
            pooled_prompt_embeds=move(batch.pooled_prompt_embeds),
        )

    def forward(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[str, Any]]:
        """Pyramid inputs for this rank's units → DiT → flow-matching loss (+ the assignment record).

        ``batch`` is on the device already (:meth:`next_batch`)."""
        cfg = self.cfg
        pyramid = pyramid_latents(batch.latents, num_stages=3)
        rng = RandomSource.of(self.noise)
        units = None
        if cfg.use_temporal_pyramid:
            units = self.lengths.lengths(self.micro_step, self.runtime.rank, clip_units=batch.bucket[0])
        inputs = self._noise_inputs(pyramid, units, rng, draw_unused_corruption=False)
        predictions = self._predict(
            inputs,
            batch.prompt_embeds,
            batch.prompt_attention_mask,
            batch.pooled_prompt_embeds,
            batch.text_lengths,
        )
        result = flow_matching_loss(predictions, inputs.targets, inputs.column_to_stage)
        record = self.assignment_record(batch, inputs)
        return result.loss, result.per_stage, record

    def _noise_inputs(
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

    def _predict(
        self,
        inputs: PyramidBatch,
        prompt_embeds: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        pooled_prompt_embeds: torch.Tensor,
        text_lengths: list[int] | None = None,
    ) -> list[torch.Tensor]:
        """The DiT on one noised batch under the runtime's autocast (text rows on the device already;
        ``text_lengths``, their valid tokens known on the host, lets ``skip_future_keys`` drop the padding)."""
        if self.cfg.cuda_graphs and self.runtime.device.type == "cuda":
            # a new forward: the blocks' graphs may overwrite what the last one left (nothing reads it now)
            torch.compiler.cudagraph_mark_step_begin()
        with self.runtime.accelerator.autocast():
            return self.model(
                sample=inputs.sample,
                encoder_hidden_states=prompt_embeds,
                encoder_attention_mask=prompt_attention_mask,
                pooled_projections=pooled_prompt_embeds,
                timestep_ratio=inputs.timesteps,
                text_lengths=text_lengths,
            )

    # ------------------------------------------------------------------------------------------
    # setup, in the order it happens
    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """1 layout checks → 2 runtime → 3 data → 4 model → 5 optimizer/LR → 6 EMA → 7 logs."""
        from pfctl.runtime.accelerator import build_runtime, world_size_from_env

        cfg = self.cfg
        # 1. every layout rule, before any process group exists (all ranks fail alike, exit 2)
        check_train_constraints(cfg, world_size_from_env())
        self.lengths = (
            plan_stage_lengths(cfg.max_units, cfg.video_sync_group) if cfg.use_temporal_pyramid else None
        )
        # 2. runtime: processes, device, precision, sync groups, seeds
        self.out.mkdir(parents=True, exist_ok=True)
        self.runtime = build_runtime(
            self.config.runtime,
            sync_group_size=cfg.video_sync_group,
            project_dir=str(self.out),
            log_with="tensorboard" if cfg.tensorboard else None,
            fsdp_plugin=build_fsdp_plugin(cfg, self.config.model.name),
        )
        rt = self.runtime
        # 3. data: the cache (format + fingerprint checked), the group's sampler, the loader
        self.cache = open_cache(cache_path(self.config))
        clips = cache_clips(self.cache)
        self.heldout = split_heldout(clips, cfg.heldout_clips, rt.seed)
        held_ids = {c.id for c in self.heldout}
        self.sampler = SyncGroupSampler(
            [c for c in clips if c.id not in held_ids],
            num_groups=rt.sync.plan.num_groups,
            group_index=rt.sync.index,
            batch_size=cfg.batch_size,
            seed=rt.seed,
            max_units=cfg.max_units,
            image_ratio=cfg.image_ratio,
        )
        self.loader = LatentClipLoader(
            self.cache,
            self.sampler,
            normalize=cache_normalizer(self.cache),
            caption_dropout=cfg.caption_dropout,
            agree=self.agree_on_failures,
        )
        # 4. model: fp32 master weights (bf16 only inside autocast), LoRA adapters (the rest frozen,
        #    optionally stored in bf16), checkpointing, resume weights. Only the DiT is loaded:
        #    the cache holds the text embeddings and latents, so no text encoder and no VAE exist here.
        self.model_name, model, self.base_model_path, self.model_info = build_model(self.config)
        check_cache_matches_model(self.cache, model)
        model.set_attention_backend(cfg.attention, cfg.skip_future_keys)
        self.lora_targets = setup_lora(model, cfg, rt) if cfg.lora.enabled else None
        compiled = cfg.compile and rt.device.type == "cuda"  # after LoRA: the graphs include the adapters
        if cfg.compile and not compiled:
            pflog.log("train.compile is ignored on the CPU")
        if self.config.fast.any_on or cfg.gradient_checkpointing or compiled:
            from pfctl.models.fast import FastPaths, apply_fast_paths

            ratio = cfg.gradient_checkpointing_ratio if cfg.gradient_checkpointing else 0.0
            # column sizes change independently every step
            paths = FastPaths(
                self.config.fast, ratio, compiled, independent_sizes=True, cuda_graphs=cfg.cuda_graphs
            )
            pflog.log("fast paths: " + (", ".join(apply_fast_paths(model, paths)) or "none"))
        self.resume_from = ckpt.resolve_resume(cfg.resume, self.out / "checkpoints")
        self.loaded = ckpt.load_checkpoint(self.resume_from, rank=rt.rank) if self.resume_from else None
        if self.loaded is not None:
            self.check_resumable(self.loaded.train_state)
            if self.lora_targets is not None:
                from pfctl.models.lora import load_lora_state

                load_lora_state(model, self.loaded.model_state, source=self.resume_from / "model")
            else:
                model.load_state_dict(self.loaded.model_state, strict=True)
        self.flow = PyramidFlowScheduler()
        self.model = rt.accelerator.prepare(model)
        self.unwrapped = rt.accelerator.unwrap_model(self.model)
        # 5. optimizer + LR schedule (created on the prepared model's parameters: FSDP needs that)
        self.optimizer = rt.accelerator.prepare(build_optimizer(self.model, cfg))
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        # 6. EMA (fp32 shadow) and the per-rank noise generator
        self.ema = EMA(self.trained_state(), cfg.ema_decay, cfg.ema_every) if cfg.ema_decay else None
        noise_seed = int(group_rng(rt.seed, _NOISE, rt.rank).integers(2**62))
        self.noise = torch.Generator(device=rt.device).manual_seed(noise_seed)
        # 7. logs: resolved config, trackers, assignment files
        if rt.is_main:
            from pfctl.config import dump_config

            atomic_write_text(self.out / "config.yaml", dump_config(self.config))
            if cfg.tensorboard:
                rt.accelerator.init_trackers("tensorboard", config=flat_config(cfg))

    def resume(self) -> Path | None:
        """Restore optimizer, LR schedule, EMA, counters, data position and RNGs (weights: in setup)."""
        loaded = self.loaded
        if loaded is None:
            self.trim_logs(0)
            return None
        if loaded.optimizer_state is not None:
            state = loaded.optimizer_state
            if self.cfg.fsdp != "none":  # name-keyed full state → this rank's shards
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

                state = FSDP.optim_state_dict_to_load(self.model, self.optimizer.optimizer, state)
            self.optimizer.load_state_dict(state)
        if loaded.scheduler_state is not None:
            self.lr_scheduler.load_state_dict(loaded.scheduler_state)
        if self.ema is not None:
            if loaded.ema_state is None:
                raise CheckpointError(f"{loaded.path} has no EMA weights but train.ema_decay is set")
            self.ema.load_state_dict(loaded.ema_state)
        state = loaded.train_state
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.micro_step = int(loaded.rank_state["micro_step"])
        self.sampler.load_state_dict(loaded.rank_state["sampler"])
        ckpt.restore_rng_state(loaded.rank_tensors, loaded.rank_state["rng"], self.noise)
        self.trim_logs(self.step)
        self.loaded = None  # free the tensors
        return loaded.path

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What the run trains (and checkpoints, and averages): the adapter with LoRA, else the DiT."""
        if self.lora_targets is not None:
            from pfctl.models.lora import lora_state_dict

            return lora_state_dict(self.unwrapped)
        if self.cfg.fsdp != "none":
            # state_dict() on the unwrapped module would lazily initialise the inner FSDP blocks as
            # roots and break the next forward; gather through the root instead (collective: every
            # rank calls this at the same point; the full state lands on the main process, {} elsewhere).
            return self.runtime.accelerator.get_state_dict(self.model)
        return self.unwrapped.state_dict()

    def lora_signature(self) -> dict[str, Any] | None:
        """The adapter's shape-defining options (a resume must match them)."""
        if self.lora_targets is None:
            return None
        lora = self.cfg.lora
        return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "modules": len(self.lora_targets),
                "targets_fingerprint": _fingerprint(self.lora_targets), "base_dtype": self.cfg.base_dtype,
                "optimizer": self.cfg.optimizer}  # fmt: skip

    def check_resumable(self, state: dict[str, Any]) -> None:
        """A bit-exact continuation needs the same layout; say which number differs."""
        cfg, rt = self.cfg, self.runtime
        if bool(self.loaded is not None and self.loaded.is_lora) != (self.lora_targets is not None):
            kind = "a LoRA adapter" if self.loaded is not None and self.loaded.is_lora else "full DiT weights"
            raise CheckpointError(
                f"cannot resume {self.resume_from}: it holds {kind} but train.lora.enabled is {cfg.lora.enabled}",
                hint="resume with the train.lora settings the checkpoint was written with",
            )
        now = {
            "world_size": rt.world_size,
            "video_sync_group": cfg.video_sync_group,
            "batch_size": cfg.batch_size,
            "grad_accum": cfg.grad_accum,
            "seed": rt.seed,
        }
        if self.lora_targets is not None:
            now["lora"] = self.lora_signature()
            now["base_fingerprint"] = self.model_info.get("base_fingerprint")
        diff = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if diff:
            text = ", ".join(f"{k} was {a}, now {b}" for k, (a, b) in diff.items())
            raise CheckpointError(
                f"cannot resume {self.resume_from}: {text}",
                hint="resume with the layout the checkpoint was written with",
            )

    # ------------------------------------------------------------------------------------------
    # pieces of the loop
    # ------------------------------------------------------------------------------------------
    def agree_on_failures(self, ok: list[bool]) -> list[bool]:
        """OR-reduce load failures over the sync group so every rank replaces the same slots.

        On a GPU the collective waits for the kernels queued before it (during a prefetch: the backward);
        a group of one rank agrees with itself, so it skips the collective."""
        sync = self.runtime.sync
        if sync.process_group is None or sync.size == 1:
            return ok
        failed = torch.tensor(
            [0 if good else 1 for good in ok], dtype=torch.int64, device=self.runtime.device
        )
        self.runtime.sync.all_reduce(failed, op="max")
        return [int(f) == 0 for f in failed.tolist()]

    def assignment_record(self, batch: TrainBatch, inputs: Any) -> dict[str, Any]:
        """The plan's record for this forward, with units and tokens measured from the real inputs."""
        from pfctl.data.dataset import BatchChoice, ResolvedBatch

        choice = BatchChoice(step=batch.step, epoch=batch.epoch, bucket=batch.bucket, ids=batch.ids)
        resolved = ResolvedBatch(choice, batch.ids, batch.replaced, batch.dropped)
        record = assignment(
            self.cfg, resolved, step=self.step + 1, micro_step=self.micro_step, rank=self.runtime.rank
        )
        record["units"] = list(inputs.units_per_stage) if inputs.units_per_stage is not None else None
        record["tokens"] = sum(
            clip.shape[0] * clip.shape[2] * (clip.shape[3] // 2) * (clip.shape[4] // 2)
            for column in inputs.sample
            for clip in column
        )
        return record

    def write_assignment(self, record: dict[str, Any]) -> None:
        if self.cfg.log_assignments:
            path = self.out / "assignments" / f"rank-{self.runtime.rank:05d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(record, sort_keys=True) + "\n")

    def trim_logs(self, step: int) -> None:
        """Drop log lines past ``step`` (left by a run that died after its last checkpoint)."""
        files = [self.out / "assignments" / f"rank-{self.runtime.rank:05d}.jsonl"]
        if self.runtime.is_main:
            files.append(self.out / "metrics.jsonl")
        for path in files:
            if path.is_file():
                keep = [ln for ln in path.read_text().splitlines() if _log_step(ln) <= step]
                atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    def log_metrics(self, metrics: dict[str, Any], console: bool = True) -> None:
        metrics = {"step": self.step, **metrics}
        acc = self.runtime.accelerator
        if self.runtime.is_main:
            with (self.out / "metrics.jsonl").open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(metrics, sort_keys=True) + "\n")
            if console:
                pflog.log(format_metrics(metrics, self.cfg.max_steps))
        if self.cfg.tensorboard:
            acc.log(
                {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"},
                step=self.step,
            )

    def save_checkpoint(self) -> None:
        rt, cfg = self.runtime, self.cfg
        rng_tensors, rng_meta = ckpt.rng_state(self.noise)
        if self.lora_targets is not None:
            model_state = self.trained_state()
        else:
            model_state = rt.accelerator.get_state_dict(self.model)  # full state dict (FSDP: gathered)
        payload = ckpt.CheckpointPayload(
            step=self.step,
            train_state={
                "tokens_seen": self.tokens_seen,
                "world_size": rt.world_size,
                "video_sync_group": cfg.video_sync_group,
                "batch_size": cfg.batch_size,
                "grad_accum": cfg.grad_accum,
                "seed": rt.seed,
                "model_name": self.model_name,
                "losses_tail": self.losses[-10:],
                **(
                    {
                        "lora": self.lora_signature(),
                        "base_fingerprint": self.model_info.get("base_fingerprint"),
                    }
                    if self.lora_targets is not None
                    else {}
                ),
            },
            rank_state={"micro_step": self.micro_step, "sampler": self.data_position(), "rng": rng_meta},
            rank_tensors=rng_tensors,
            model=self.unwrapped,
            model_state=model_state,
            ema_state=self.ema.state_dict() if self.ema is not None else None,
            optimizer_state=optimizer_state(self),
            scheduler_state=self.lr_scheduler.state_dict(),
            adapter_config=self.adapter_config() if self.lora_targets is not None else None,
        )
        path = ckpt.save_checkpoint(
            self.out / "checkpoints", payload, rank=rt.rank, is_main=rt.is_main, barrier=rt.barrier,
            keep_last=cfg.keep_last,
        )  # fmt: skip
        self.saved.append(str(path))
        pflog.log(f"saved checkpoint {path}")

    def adapter_config(self) -> dict[str, Any]:
        from pfctl.models.lora import adapter_config_dict

        lora = self.cfg.lora
        return adapter_config_dict(lora.rank, lora.alpha, lora.dropout, self.lora_targets, self.lora_base())

    def lora_base(self) -> str | None:
        """The model folder a LoRA run adapted (what ``generate --lora`` loads under it)."""
        path = self.config.model.path
        return str(Path(path).expanduser().resolve()) if path is not None else None

    def export_lora(self, out: Path) -> None:
        """A LoRA run exports the adapter folder (+ marker naming the base model), not a DiT."""
        from pfctl.config import dump_config
        from pfctl.models.checkpoint import _config_dict
        from pfctl.models.lora import save_lora_folder

        m, lora = self.config.model, self.cfg.lora
        marker = {
            "base_model_path": self.lora_base(),
            "variant": m.variant if m.path is not None else None,
            "dit_preset": m.dit_preset,
            "model_name": self.model_name,
            "dit_class": type(self.unwrapped).__name__,
            "dit_config": {k: v for k, v in _config_dict(self.unwrapped).items() if k != "_class_name"},
            "base_dit_fingerprint": self.model_info.get("dit_fingerprint"),
            "base_fingerprint": self.model_info.get("base_fingerprint"),
            "rank": lora.rank,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "targets": lora.targets,
            "target_modules": list(self.lora_targets or []),
            "base_dtype": self.cfg.base_dtype,
            "steps": self.step,
            "extra": {"cache": cache_path(self.config), **cache_vae_info(self.cache)},
        }
        save_lora_folder(
            out,
            self.trained_state(),
            self.adapter_config(),
            marker=marker,
            config_yaml=dump_config(self.config),
            ema_state=self.ema.state_dict() if self.ema is not None else None,
        )

    def export(self) -> Path | None:
        """``output_dir/export``: a model folder ``pfctl generate --model`` loads (main process);
        for a LoRA run the adapter folder ``pfctl generate --lora`` loads."""
        from pfctl.config import dump_config
        from pfctl.models.checkpoint import save_export

        out = self.out / "export"
        if self.runtime.is_main and self.lora_targets is not None:
            self.export_lora(out)
            pflog.log(f"exported the LoRA adapter to {out}")
        elif self.lora_targets is None:
            state = self.trained_state()  # collective under FSDP: every rank gathers
            if self.runtime.is_main:
                save_export(
                    out,
                    self.plain_dit(state),
                    base_model_path=self.base_model_path,
                    ema_dit=self.plain_dit(self.ema.state_dict()) if self.ema is not None else None,
                    config_yaml=dump_config(self.config),
                    extra={
                        "steps": self.step,
                        "cache": cache_path(self.config),
                        **cache_vae_info(self.cache),
                    },
                )
                pflog.log(f"exported the model to {out}")
        self.runtime.barrier()
        return out

    def plain_dit(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A plain single-device DiT of the trained architecture holding ``state``.

        Exports are built from a state dict rather than from the training module, which under
        FSDP is sharded and cannot be copied or saved directly.
        """
        model = type(self.unwrapped).from_config(self.unwrapped.config)
        model.load_state_dict(state, strict=True)
        return model

    @torch.no_grad()
    def heldout_loss(self) -> float:
        """Mean loss over the held-out clips with fixed noise (comparable across steps).

        Each clip fills all K columns of a batch (so every stage is measured on it) and is
        noised by a generator seeded from the clip's index — the training RNGs are not touched.
        """
        cfg, device = self.cfg, self.runtime.device
        k = sum(cfg.sample_ratios)
        self.model.eval()
        losses = []
        for i, clip in enumerate(self.heldout):
            entry = self.cache.load(clip.id)
            frames = min(clip.num_latent_frames, cfg.max_units)
            latent = self.loader.normalize(stored_latent(entry)[None, :, :frames].float())
            gen = torch.Generator(device=device).manual_seed(
                int(group_rng(self.runtime.seed, 301, i).integers(2**62))
            )
            pyramid = pyramid_latents(latent.repeat(k, 1, 1, 1, 1).to(device), num_stages=3)
            units = None
            if cfg.use_temporal_pyramid:
                units = plan_stage_lengths(cfg.max_units, 1).lengths(i, 0, clip_units=frames)
            inputs = self._noise_inputs(pyramid, units, gen, draw_unused_corruption=True)
            text = {
                key: unbatch(entry[key], nd).unsqueeze(0).repeat_interleave(k, 0).to(device)
                for key, nd in _TEXT
            }
            predictions = self._predict(
                inputs,
                text["prompt_embeds"].float(),
                text["prompt_attention_mask"].long(),
                text["pooled_prompt_embeds"].float(),
            )
            losses.append(float(flow_matching_loss(predictions, inputs.targets).loss))
        self.model.train()
        return sum(losses) / max(len(losses), 1)

    @torch.no_grad()
    def validate(self) -> Path | None:
        """Sample a few clips' captions (cached embeddings, null text as negative) with fixed noise.

        Latents are saved normalised (``pfctl generate`` decodes with the VAE); the same seed every
        time, so samples of successive steps are comparable. Under FSDP every rank takes part.
        """
        from pfctl.models.text_embeddings import TextEmbeddings
        from pfctl.sampling.sampler import TextConditioning, generate_latents
        from pfctl.utils.io import atomic_save_safetensors

        cfg, rt = self.cfg, self.runtime
        ids = cfg.validation_clips or [c.id for c in self.heldout] or self.cache.ids()[:2]
        if not (rt.is_main or cfg.fsdp != "none"):
            return None
        entries = [self.cache.load(cid) for cid in ids]
        text = {key: torch.stack([unbatch(e[key], nd) for e in entries]) for key, nd in _TEXT}
        null = {key: unbatch(self.cache.null_text()[key], nd)[None] for key, nd in _TEXT}
        first = self.cache.row(ids[0])
        dit = self.model if cfg.fsdp != "none" else self.unwrapped
        self.model.eval()
        with rt.accelerator.autocast():
            latents = generate_latents(
                dit,
                TextConditioning(TextEmbeddings.from_dict(text).to(dtype=torch.float32),
                                 TextEmbeddings.from_dict(null).to(dtype=torch.float32)),
                temp=cfg.validation_units, height=int(first["height"]), width=int(first["width"]),
                num_inference_steps=10, video_num_inference_steps=10,
                generator=torch.Generator(device=rt.device).manual_seed(rt.seed), device=rt.device,
                latent_channels=int(first.get("latent_channels", 16)),
            )  # fmt: skip
        self.model.train()
        path = self.out / "validation" / f"step-{self.step:06d}.safetensors"
        if rt.is_main:
            atomic_save_safetensors({"latents": latents.float()}, path, metadata={"clip_ids": ",".join(ids)})
            pflog.log(f"validation latents of {ids} → {path}")
        return path

    def close(self) -> None:
        if getattr(self, "runtime", None) is not None and self.cfg.tensorboard:
            self.runtime.accelerator.end_training()


def _log_step(line: str) -> float:
    """The step of a metrics/assignment log line; a line torn by a kill (or empty) sorts last (dropped)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


# ----------------------------------------------------------------------------------------------
# helpers used by setup (plain functions: the dry-run shares them)
# ----------------------------------------------------------------------------------------------

_TEXT = (("prompt_embeds", 2), ("prompt_attention_mask", 1), ("pooled_prompt_embeds", 1))


def optimizer_state(trainer: Trainer) -> dict[str, Any]:
    """The full optimizer state (under FSDP: gathered by name on the main process)."""
    if trainer.cfg.fsdp != "none":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.optim_state_dict(trainer.model, trainer.optimizer.optimizer)
    return trainer.optimizer.state_dict()


def flat_config(cfg: TrainConfig) -> dict[str, Any]:
    """Tracker hyper-parameters must be scalars."""
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.model_dump().items()}


def format_metrics(m: dict[str, Any], max_steps: int) -> str:
    if "loss" not in m:
        return "  ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())
    stages = " ".join(
        f"s{k[len('loss_stage') :]}={v:.4f}" for k, v in m.items() if k.startswith("loss_stage")
    )
    return (
        f"step {m['step']}/{max_steps}  loss {m['loss']:.4f} ({stages})  lr {m['lr']:.3g}  "
        f"grad_norm {m['grad_norm']:.3g}  {m['tokens_per_s']:.0f} tok/s  {m['samples_per_s']:.2f} samples/s"
        + ("  [skipped]" if m.get("skipped") else "")
    )


def build_fsdp_plugin(cfg: TrainConfig, model_name: str) -> Any:
    """accelerate's FSDP plugin for ``train.fsdp`` (None for ``none``).

    Blocks of the DiT are the wrap units (the model class lists them in ``_no_split_modules``),
    prefetching BACKWARD_PRE, full state dict for checkpoints — the reference's setup.
    """
    if cfg.fsdp == "none":
        return None
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"train.fsdp={cfg.fsdp} needs CUDA devices (accelerate's FSDP does not run on the CPU)",
            hint="use train.fsdp=none on the CPU",
        )
    from accelerate import FullyShardedDataParallelPlugin

    from pfctl.models.checkpoint import MODEL_NAME_TO_CLASS, dit_class

    blocks = list(getattr(dit_class(MODEL_NAME_TO_CLASS[model_name]), "_no_split_modules", None) or [])
    if not blocks:
        raise ConfigError(f"the {model_name} DiT declares no block classes to wrap with FSDP")
    return FullyShardedDataParallelPlugin(
        fsdp_version=1,
        sharding_strategy="SHARD_GRAD_OP" if cfg.fsdp == "shard_grad_op" else "FULL_SHARD",
        backward_prefetch="BACKWARD_PRE",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=blocks,
        state_dict_type="FULL_STATE_DICT",
        cpu_offload=cfg.fsdp_cpu_offload,
        use_orig_params=True,
        sync_module_states=True,
    )


def dit_overrides(config: Any) -> dict[str, Any]:
    """Constructor arguments the train options control (so booleans really turn things off)."""
    cfg = config.train
    return {
        "use_temporal_causal": cfg.use_temporal_causal,
        "interp_condition_pos": cfg.interp_condition_pos,
        "use_gradient_checkpointing": cfg.gradient_checkpointing,
        "gradient_checkpointing_ratio": cfg.gradient_checkpointing_ratio,
    }


def setup_lora(model: torch.nn.Module, cfg: TrainConfig, rt: Any) -> list[str]:
    """Add the adapters (A initialised from a generator seeded by the run's seed, B = 0), freeze the
    base, and store the frozen base in ``train.base_dtype``. Returns the adapted module names."""
    from pfctl.models.lora import add_lora, cast_frozen

    check_lora_runtime(cfg, rt.mixed_precision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(group_rng(rt.seed, 501).integers(2**62)))
        lora = cfg.lora
        names = add_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets)
    if cfg.base_dtype == "bf16":
        cast_frozen(model, torch.bfloat16)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    pflog.log(
        f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {len(names)} layers: {trainable:,} trainable of "
        f"{total:,} parameters; frozen base in {cfg.base_dtype}"
    )
    return names


def check_lora_runtime(cfg: TrainConfig, mixed_precision: str) -> None:
    """bf16 base weights compute only under bf16 autocast (fp32 activations x bf16 weights fail)."""
    if cfg.base_dtype == "bf16" and mixed_precision != "bf16":
        raise ConfigError(
            f"train.base_dtype=bf16 needs bf16 autocast, but the run's mixed precision is {mixed_precision!r}",
            hint="--set runtime.mixed_precision=bf16 (the CUDA default), or train.base_dtype=fp32",
        )


def _fingerprint(obj: Any) -> str:
    from pfctl.utils.io import fingerprint

    return fingerprint(obj)


def build_model(config: Any) -> tuple[str, torch.nn.Module, str | None, dict[str, Any]]:
    """(model name, fp32 DiT, base model path, info). ``model.dit_preset`` = from scratch with a
    registered architecture; ``model.path`` = fine-tune an official folder or a pfctl export.

    ``info["base_fingerprint"]`` identifies the starting weights (a LoRA resume checks it: an
    adapter continues bit-exactly only on the same base)."""
    m = config.model
    if m.dit_preset is not None:
        from pfctl.models.registry import build_dit
        from pfctl.utils.io import tensor_fingerprint

        dit = build_dit(m.dit_preset, {**m.dit_config, **dit_overrides(config)})
        info = {"dit_fingerprint": None}
        if config.train.lora.enabled:  # hashing is cheap next to training; only LoRA resumes need it
            info["base_fingerprint"] = tensor_fingerprint(dit.state_dict())
        return m.name, dit, None, info
    if m.path is None:
        raise ConfigError(
            "train needs a model: set model.path (an official folder or a pfctl export to fine-tune) "
            "or model.dit_preset (train from scratch)",
            hint="e.g. --set model.dit_preset=tiny",
        )
    from pfctl.models.checkpoint import load_components

    parts = load_components(
        m.path,
        variant=m.variant,
        need=("dit",),
        dtype=torch.float32,
        dit_dtype=torch.float32,
        dit_overrides=dit_overrides(config),
        model_name=m.name,
    )
    base = parts.info.get("base_model_path") or (m.path if parts.info.get("layout") == "official" else None)
    fps = parts.info.get("fingerprints") or {}
    info = {
        "dit_fingerprint": fps.get("dit"),
        "base_fingerprint": fps.get("dit"),
        "layout": parts.info.get("layout"),
    }
    return parts.model_name or m.name, parts.dit, base, info


# -- the cache --------------------------------------------------------------------------------


def cache_path(config: Any) -> str:
    return config.train.cache or config.encode.output_dir


def open_cache(path: str) -> Any:
    """Open the encode-latents cache; the cache module checks its format version and fingerprint."""
    from pfctl.data.latent_cache import LatentCache

    return LatentCache.open(path)


def cache_clips(cache: Any) -> list[ClipInfo]:
    return [
        ClipInfo(
            id=str(r["id"]),
            num_latent_frames=int(r["num_latent_frames"]),
            height=int(r["height"]),
            width=int(r["width"]),
        )
        for r in cache.items()
    ]


def split_heldout(clips: list[ClipInfo], n: int, seed: int) -> list[ClipInfo]:
    """``n`` clips chosen by the seed alone (the same on every rank) and never trained on."""
    if n == 0:
        return []
    if n >= len(clips):
        raise ConfigError(f"train.heldout_clips {n} leaves no training clips (the cache has {len(clips)})")
    ordered = sorted(clips, key=lambda c: c.id)
    picks = group_rng(seed, 401).choice(len(ordered), size=n, replace=False)
    return [ordered[i] for i in sorted(picks)]


def cache_normalizer(cache: Any):
    """Raw VAE latents → DiT latents, with the rule the cache header records."""
    from pfctl.data.dataset import latent_normalizer

    return latent_normalizer(cache.vae)


def cache_vae_info(cache: Any) -> dict[str, Any]:
    """What the export records about the latents it was trained on (generate needs a matching VAE)."""
    return {"vae": cache.vae, "cache_fingerprint": cache.fingerprint}


def check_cache_matches_model(cache: Any, model: torch.nn.Module) -> None:
    """Latent channels and text widths of the cache must fit the DiT (clear error, not a shape crash)."""
    config = getattr(model, "config", None)
    if config is None or not len(cache):
        return
    try:
        entry = cache.load(cache.ids()[0])
    except Exception:
        return  # a broken first clip is handled (replaced) by the loader
    latent = stored_latent(entry)  # the posterior mean or the stored sample: deterministic
    in_channels = int(config.get("in_channels", 0)) if hasattr(config, "get") else 0
    patch_channels = latent.shape[0] * 4
    if in_channels and in_channels not in (latent.shape[0], patch_channels):
        raise ConfigError(
            f"the cache's latents have {latent.shape[0]} channels but the DiT takes in_channels={in_channels}",
            hint="encode the cache with the VAE of this model, or pick a DiT preset for these latents",
        )
    width = int(config.get("joint_attention_dim", 0)) if hasattr(config, "get") else 0
    text = entry["prompt_embeds"]
    if width and text.shape[-1] != width:
        raise ConfigError(
            f"the cache's text features are {text.shape[-1]}-d but the DiT's joint_attention_dim is {width}",
            hint="encode the cache with this model's text encoder",
        )


def run_training(config: Any) -> TrainReport:
    """Entry point of ``api.train``."""
    return Trainer(config).train()


__all__ = ["TrainReport", "Trainer", "columns_to_stages", "run_training"]
