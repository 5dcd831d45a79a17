"""``train:`` section — options of ``pfctl train``.

Every option has its default here and only here. The cross-field rules live in
:func:`check_train_constraints` (the sync-group layout, ``W % G`` and ``M % G``, through
:func:`pfctl.runtime.sync_groups.plan_sync_groups`), which the trainer and the dry-run call before
any process group exists, so a bad layout fails the same way on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from pfctl.config.base import Section
from pfctl.errors import ConfigError
from pfctl.runtime.sync_groups import SyncGroupPlan, plan_sync_groups

DEFAULT_LORA_TARGETS: list[str] = [
    # double-stream blocks: attention (image and text sides) and both feed-forwards
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    # single-stream blocks: q/k/v (above), the MLP input and the fused attention+MLP output
    "proj_mlp",
    "proj_out",
]
"""Module-name suffixes inside the DiT's transformer blocks (the AdaLN ``norm*.linear`` layers, the
embedders and the final ``proj_out`` outside the blocks stay frozen)."""


TrackerName = Literal["tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive"]
"""The experiment trackers accelerate integrates (``accelerate.tracking``)."""

TRACKER_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "pip install 'pfctl[tensorboard]'"),
    "wandb": (("wandb",), "pip install 'pfctl[wandb]'"),
    "comet_ml": (("comet_ml",), "pip install comet_ml"),
    "aim": (("aim",), "pip install aim"),
    "mlflow": (("mlflow",), "pip install mlflow"),
    "clearml": (("clearml",), "pip install clearml"),
    "dvclive": (("dvclive",), "pip install dvclive"),
}
"""Per tracker: the modules that provide it (any one) and how to install one."""


class TrainLoraConfig(Section):
    """``train.lora:`` — low-rank adapters (through peft) instead of full fine-tuning."""

    enabled: bool = False
    """Train LoRA adapters on the frozen DiT; off = full fine-tuning (every weight trains)."""
    rank: int = Field(default=64, ge=1)
    """r: the adapters' inner dimension (trainable parameters grow linearly with it)."""
    alpha: float = Field(default=64.0, gt=0.0)
    """The adapter output is scaled by alpha / rank (alpha = rank: scale 1)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter input (training only)."""
    targets: list[str] | str = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Which Linear layers get adapters. A list: module-name suffixes (matched at a ``.`` boundary)
    of Linear layers inside the transformer blocks; every entry must match at least one layer.
    A string: a regular expression full-matched against every module name of the DiT (peft's rule),
    e.g. ``'.*\\.attn\\.to_[qkv]'``."""

    @field_validator("targets")
    @classmethod
    def _targets_not_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str):
            import re

            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
            if not value:
                raise ValueError("an empty pattern matches no module")
        elif not value or any(not isinstance(v, str) or not v.strip() for v in value):
            raise ValueError("needs at least one non-empty module-name suffix")
        return value


class TrainConfig(Section):
    """Options of ``pfctl train`` (pyramidal flow matching on an encode-latents cache)."""

    # --- where --------------------------------------------------------------------------------
    output_dir: str = "outputs/train"
    """Checkpoints (``checkpoints/step-NNNNNN``), the final ``export/``, logs and assignments."""
    cache: str | None = None
    """The encode-latents cache folder; default: ``encode.output_dir``."""

    # --- how long, how big ----------------------------------------------------------------------
    max_steps: int = Field(default=1000, ge=1)
    """Optimizer steps (one step = ``grad_accum`` micro-batches on every rank)."""
    batch_size: int = Field(default=4, ge=1)
    """Clips per rank per micro-batch; must be a multiple of ``sum(sample_ratios)``."""
    sample_ratios: list[int] = Field(default_factory=lambda: [1, 2, 1])
    """Columns per stage (low, mid, high): [1,2,1] → 4 columns with stages [0,1,1,2]."""
    grad_accum: int = Field(default=1, ge=1)

    # --- sync groups and the temporal pyramid -----------------------------------------------------
    video_sync_group: int = Field(default=1, ge=1)
    """G: ranks r, r' read the same clips iff r // G == r' // G (world size % G == 0)."""
    max_units: int = Field(default=16, ge=1)
    """M: latent units (frames) per training clip; longer clips are cut. M % G == 0."""
    use_temporal_pyramid: bool = True
    """Autoregressive training on one unit with low-resolution history; off = the non-AR mode."""
    use_temporal_causal: bool = True
    """Attention sees only the current and earlier frames (passed to the DiT)."""
    interp_condition_pos: bool = True
    """History clips take positions interpolated onto the current clip's grid (passed to the DiT)."""
    corrupt_ratio: float = Field(default=1 / 3, ge=0.0, le=1.0)
    """History is corrupted as s·noise + (1-s)·history with s ~ U(0, corrupt_ratio)."""
    caption_dropout: float = Field(default=0.1, ge=0.0, le=1.0)
    """Probability that a clip's caption is replaced by the cache's empty-prompt embedding."""
    image_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Share of batches drawn from image (1-frame) buckets; None = their natural share."""

    # --- optimizer --------------------------------------------------------------------------------
    optimizer: Literal["adamw", "sgd_momentum", "adafactor"] = "adamw"
    """``adamw``: 2 fp32 states per trainable parameter (8 B). ``sgd_momentum``: one (4 B; uses
    ``momentum``, L2 weight decay). ``adafactor`` (transformers' Adafactor, no first moment, factored
    second moment): a matrix of m x n keeps m + n fp32 values instead of 2·m·n."""
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Momentum of ``sgd_momentum``."""
    lr: float = Field(default=5e-5, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=1e-4, ge=0.0)
    """Applied to matrices only; biases and 1-D parameters (norms) get none."""
    eps: float = 1e-8
    warmup_steps: int = Field(default=1000, ge=0)
    warmup_start_lr: float = Field(default=1e-6, ge=0.0)
    """Linear warmup from this LR to ``lr`` (the reference's constant_with_warmup)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr: float = Field(default=0.0, ge=0.0)
    """End of the cosine decay."""
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    """Max global gradient norm; None = no clipping (the norm is still logged)."""
    skip_loss_above: float | None = None
    """Skip the optimizer step when the step's mean loss is >= this (the reference used 2.0)."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """A non-finite loss stops the run (``stop``) or skips that step on every rank (``skip``)."""

    # --- EMA ----------------------------------------------------------------------------------
    ema_decay: float | None = Field(default=None, gt=0.0, lt=1.0)
    """EMA of the weights (e.g. 0.9999); None = off."""
    ema_every: int = Field(default=100, ge=1)
    """Update the EMA every N optimizer steps (the reference: 100)."""

    # --- LoRA ---------------------------------------------------------------------------------
    lora: TrainLoraConfig = Field(default_factory=TrainLoraConfig)

    # --- memory / parallelism -------------------------------------------------------------------
    base_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage dtype of the frozen base weights of a LoRA run (the adapters always train in fp32).
    ``bf16`` halves the base's memory; it needs bf16 autocast (``runtime.mixed_precision`` bf16,
    the CUDA default) and LoRA (full fine-tuning keeps fp32 master weights)."""
    gradient_checkpointing: bool = False
    gradient_checkpointing_ratio: float = Field(default=0.75, ge=0.0, le=1.0)
    """Share of DiT blocks recomputed in backward, counted from the input side."""
    gradient_checkpointing_policy: Literal["full", "selective", "selective_narrow"] = "selective"
    """What a checkpointed block recomputes: ``selective`` (default) keeps the results of its fused attention
    kernels from the forward (output and log-sum-exp: about one activation of the block's width per token)
    and recomputes the rest, so the backward does not attend twice; ``selective_narrow`` also keeps the
    outputs of its products that narrow the width (the feed-forward's down projection, the single blocks'
    ``proj_out``: one more activation of the block's width per token), so the recomputation skips a third
    of a double block's product work and 5/12 of a single block's; ``full`` recomputes everything (the
    reference's checkpointing, the least memory). Same loss either way: the kept results are those the
    recomputation would produce."""
    fsdp: Literal["none", "shard_grad_op", "full_shard"] = "none"
    """Shard the DiT over every process with FSDP2, each transformer block a unit: ``shard_grad_op``
    (ZeRO-2: parameters, gradients and optimizer state sharded, a block's gathered weights kept from its
    forward to its backward) or ``full_shard`` (ZeRO-3: gathered again for the backward; least memory);
    ``none``: a whole copy per process (data parallel). Under bf16 mixed precision the blocks compute
    from bf16 gathers and reduce gradients in fp32. Works on the CPU (gloo) too. Checkpoints hold whole
    weights."""
    fsdp_cpu_offload: bool = False
    """With ``fsdp`` on CUDA: keep the parameter shards, gradients and optimizer state in host memory (the
    optimizer steps there). Nothing to offload on the CPU."""
    attention: Literal["auto", "efficient", "cudnn", "flex"] = "auto"
    """The kernel of the DiT's masked attention: ``auto`` (default) cuDNN's when the blocks are compiled and
    either recorded as CUDA graphs or attending in row groups (``skip_future_keys``), else the memory-efficient
    one (compiled blocks without graphs are host-bound, and cuDNN's calls cost the host more); ``efficient``
    the memory-efficient kernel; ``cudnn`` cuDNN's, faster, but it builds a plan for every new shape: the
    pyramid's shapes change every step, so in eager training the planning and the host cost per call outweigh
    its faster kernel, while compiled blocks meet a fixed set of shapes (the log lists them), each planned once
    in the warm-up, and compiled row groups send it only calls whose shapes recur: the masked ones (the text cut
    to a multiple of 32 tokens) and the image keys of the mask-free ones (their valid text goes to the flash
    kernel). ``flex`` (CUDA): each block attends all its columns in one FlexAttention call, its kernels
    generated by PyTorch from a block-sparse mask that skips the tiles no query sees (across columns, and the
    keys temporal causality hides, so row groups are not needed), where the SDPA kernels take one call per
    column; on the CPU, which has no FlexAttention backward, it runs ``efficient``. Same loss within bf16
    rounding; no effect on the CPU. Measured step times: ``benchmarks/RESULTS.md``."""
    skip_future_keys: bool = False
    """Cut the text padding and attend the query rows of long columns (6,144+ tokens) in groups of whole
    frames (512+ rows; a frame that large alone), each against the keys up to its last frame only, forward
    and backward; a single frame's rows attend with no mask. Same loss up to float rounding. Off by
    default: with it on, every attention call of a compiled training step goes through the row groups'
    operator (grouped or not, so no step recompiles the blocks), which calls the kernels group by group, so
    it pays only for long columns (768p and longer clips); 384p columns are too short to be grouped at all.
    The 768p recipe turns it on."""
    row_group_min_tokens: int | None = Field(default=None, ge=0)
    """With ``skip_future_keys``: the shortest column (text + image tokens) attended in row groups; shorter ones
    take one masked call over all their keys. None (default): the model's own threshold (6,144 tokens); ``0``
    groups every column (what generate does)."""
    row_group_min_rows: int | None = Field(default=None, ge=1)
    """With ``skip_future_keys``: the fewest query rows a row group closes with (whole frames are gathered
    until it has them). None (default): the model's own, 512 rows (chosen for sampling); ``1``: one frame per
    group, so every call attends with no mask (the flash kernel; under ``cudnn`` cuDNN's for the image keys),
    at the cost of more, smaller calls."""
    compile: bool | Literal["auto"] = "auto"
    """``torch.compile`` each DiT block (dynamic shapes): fuses the norms, RoPE, modulation and residuals around
    the matmuls, forward and backward. ``auto`` (default): on CUDA, off on the CPU (where the blocks run
    eagerly). The first steps pay the compilation (the log reports the warm-up); weights and checkpoint keys
    are unchanged. ``false`` is the one switch back to the eager reference path (CUDA graphs need it)."""
    cuda_graphs: bool | Literal["auto", "step"] = "auto"
    """``step``: each distinct input's whole forward and backward (embedders, every block, the loss) is recorded
    as one CUDA graph right after its first, eager run, and replayed from then on: the host copies the batch
    into the graph's buffers and launches it, and the step takes what the GPU needs
    (:mod:`pfctl.training.step_graphs`). It works with compiled or eager blocks and with activation
    checkpointing; it needs CUDA, and refuses sharding (``train.fsdp`` over several processes, host offload).
    Several processes train data parallel: each records its own inputs, and the step's gradients are
    averaged across processes in one collective per buffer after its last micro-batch (not overlapped with
    the backward, as DDP's all-reduce is). On the CPU it is ignored, with a note. The gradients accumulate
    into buffers of their own.
    ``auto`` (default): ``step`` with compiled blocks on one CUDA process without host offload or activation
    checkpointing (on an H100 the 384p recipe's step ran 3.0x the reference's step, ``benchmarks/RESULTS.md``,
    session 43); off otherwise (several processes, checkpointing, ``train.compile=false``, the CPU).
    ``true``: with compiled blocks, each block's forward and backward is recorded as a CUDA graph instead, once
    per token count, and replayed (``torch.compile`` mode ``reduce-overhead``); on the H200 with torch 2.11 most
    steps of the 384p recipe recorded those graphs again (failed checks of the graph trees) and ran no faster
    than the reference's step (sessions 33-36). With gradient accumulation the gradients accumulate into
    tensors of their own (the graphs' memory is reused by the next micro-batch). Every distinct token count is
    recorded once, so the warm-up grows with the number of inputs a rank builds (the log lists them); a step
    after the warm-up that records graphs again is named in a warning. Held-out losses and validation samples
    run the blocks eagerly. ``true`` refuses gradient checkpointing and FSDP over several processes;
    ``false``: no graphs."""
    merge_micro_batches: bool | Literal["auto"] = "auto"
    """Run a step's ``grad_accum`` micro-batches as one forward and one backward: their columns side by side in
    one DiT call. Each micro-batch is drawn and noised as before, and the loss is the mean over all their
    columns either way, so loss and gradients are the same up to float rounding. Each block's products and
    kernels then run once per step rather than once per micro-batch, and no gradient is accumulated: fewer,
    larger launches for the host, which sets the pace of compiled blocks without CUDA graphs. The cost is
    memory: the activations of every micro-batch at once. ``auto`` (default): merged on CUDA with compiled
    blocks without CUDA graphs and without activation checkpointing (a run that checkpoints puts memory
    first), when the memory estimate of the merged step (``--dry-run`` prints it) fits in 90% of the GPU's
    memory; one forward per micro-batch otherwise, and always on the CPU. ``true`` / ``false`` force it."""
    compile_cache: bool = True
    """With compiled blocks: what the compiler built (graphs, generated kernels, tuning results) is saved to
    ``<output_dir>/compile-cache.bin`` when the warm-up ends, and loaded when a run starts on that output
    directory, so a resumed run on another machine skips the compilation a cold start pays (its first step
    and time to steady: ``benchmarks/RESULTS.md``). Written by the main process; loaded only when PyTorch,
    Triton and the GPU model match its record (``compile-cache.json``), else compiled afresh. The file is
    compiled code: copy it only between your own runs."""
    compile_cache_shared: str | None = Field(default="~/.cache/pfctl/compile", min_length=1)
    """With ``compile_cache``: the same artifacts also kept here for all your runs, one folder per PyTorch,
    Triton and GPU model. A run whose output directory holds no cache (a new run) loads this one, so only the
    first run of a setup pays the cold compilation; on a cluster, a folder every node sees (the home directory
    is one) does the same for runs on other nodes. Each configuration's artifacts are an entry of their own;
    the newest 4 entries per setup are kept and all of them loaded. ``null``: none kept."""
    gc_every: int = Field(default=50, ge=0)
    """Python's cyclic garbage collection during training: its automatic passes off, everything collected
    once when the warm-up ends and the young objects every N steps (torchtitan's ``gc_freq``), so no pass over
    the objects the compiler and the CUDA-graph recordings leave stalls a step at a random moment. Objects
    outside reference cycles (tensors included) are still freed at once. 0: Python's automatic collection."""

    # --- checkpoints ----------------------------------------------------------------------------
    checkpoint_every: int = Field(default=1000, ge=1)
    """Save every N optimizer steps; the last step is always saved."""
    keep_last: int | None = Field(default=3, ge=1)
    """Keep the newest K checkpoints; None = keep all."""
    checkpoint_async: bool | Literal["auto"] = "auto"
    """Write checkpoints in the background: the loop waits only for a copy of the state in host memory (about
    the checkpoint's size in RAM; a rank with less than twice that free writes at once), a thread per rank writes the files and the main process commits the folder
    once every rank is done (the log says ``saved checkpoint`` then). A run killed during the write resumes
    from the checkpoint before. ``auto`` (default): on CUDA; on the CPU checkpoints are written at once."""
    resume: str | None = None
    """``latest`` (newest complete checkpoint in output_dir, if any) or a checkpoint folder."""
    export: bool = True
    """Write ``output_dir/export`` (a model folder ``pfctl generate --model`` loads) at the end."""

    export_format: Literal["pfctl", "official", "both"] = "pfctl"
    """What the end of a run writes: ``pfctl`` = ``output_dir/export`` (what ``pfctl generate --model`` and
    ``--lora`` load); ``official`` = ``output_dir/export-official``, the official Pyramid Flow layout the
    reference's scripts and ComfyUI load (the EMA weights when there are; LoRA runs merged into their
    base), as ``pfctl export`` writes it; ``both`` = the two."""

    # --- observability --------------------------------------------------------------------------
    log_every: int = Field(default=10, ge=1)
    trackers: list[TrackerName] = Field(default_factory=list)
    """Experiment trackers fed through accelerate's tracker API, e.g. ``[tensorboard, wandb]``:
    the step metrics, held-out losses and validation contact sheets (and videos, where the tracker
    shows them). ``tensorboard`` writes ``output_dir/tensorboard/<tracker_project>``; the others
    follow their own settings. Each needs its package (``pip install 'pfctl[wandb]'``, ...)."""
    tracker_project: str = Field(default="pfctl", min_length=1)
    """The trackers' project (W&B project, TensorBoard sub-folder, MLflow experiment, ...)."""
    run_name: str | None = None
    """The run's name in the trackers; default: the name of ``output_dir``."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` (default: works without a network or an account) writes the W&B run under
    ``output_dir/wandb`` (upload it later with ``wandb sync``); ``online`` streams it to the W&B
    server (``wandb login`` first)."""
    log_assignments: bool = True
    """Write ``output_dir/assignments/rank-NNNNN.jsonl`` (what each rank trained, per micro-batch)."""
    heldout_clips: int = Field(default=0, ge=0)
    """Clips kept out of training for a held-out loss (0 = none)."""
    eval_every: int | None = Field(default=None, ge=1)
    """Compute the held-out loss every N steps."""
    validation_every: int | None = Field(default=None, ge=1)
    """Sample the validation captions at step 0, every N steps and at the last step: latents in
    ``output_dir/validation/step-NNNNNN.safetensors``; when the cache names its VAE, also decoded: one mp4
    per caption and the contact sheet ``step-NNNNNN.png`` (also sent to the trackers)."""
    validation_clips: list[str] = Field(default_factory=list)
    """Cache clip ids whose cached caption embeddings condition the validation samples (training
    needs no text encoder); default: the held-out clips, else the first two clips of the cache."""
    validation_units: int = Field(default=2, ge=1)
    """Latent frames of each validation sample (10 steps per stage, CFG 7 / 5 against the null text)."""
    plan_steps: int = Field(default=4, ge=1)
    """Steps shown by ``--dry-run``."""


def columns_to_stages(sample_ratios: list[int]) -> list[int]:
    """[1,2,1] → [0,1,1,2]: the stage trained by each batch column."""
    return [stage for stage, n in enumerate(sample_ratios) for _ in range(n)]


def fsdp_skipped_on_cuda(train: TrainConfig, world_size: int) -> bool:
    """``train.fsdp`` is set but shards nothing on CUDA: one process without host offload (skipped there)."""
    return train.fsdp != "none" and world_size == 1 and not train.fsdp_cpu_offload


def check_train_constraints(train: TrainConfig, world_size: int) -> SyncGroupPlan:
    """The layout rules of sync-group training, with the numbers in the message; returns the run's
    sync-group plan.

    Checked before any process group exists (and by ``--dry-run`` for a simulated world
    size), so a violation ends every rank with exit code 2 instead of a hang or an assert.
    """
    ratios = train.sample_ratios
    if not ratios or any(r < 0 for r in ratios) or sum(ratios) < 1:
        raise ConfigError(
            f"train.sample_ratios = {ratios}: needs non-negative column counts per stage with a positive sum",
            hint="the reference uses [1, 2, 1] (3 stages)",
        )
    columns = sum(ratios)
    if train.batch_size % columns != 0:
        raise ConfigError(
            f"train.batch_size {train.batch_size} is not divisible by sum(train.sample_ratios) = {columns} "
            f"(sample_ratios {ratios})",
            hint=f"use a multiple of {columns}, e.g. --set train.batch_size={columns * max(1, train.batch_size // columns)}",
        )
    layout = plan_sync_groups(
        world_size, train.video_sync_group, train.max_units if train.use_temporal_pyramid else None
    )
    if train.base_dtype == "bf16" and not train.lora.enabled:
        raise ConfigError(
            "train.base_dtype=bf16 needs train.lora.enabled=true: only a LoRA run has frozen base weights "
            "(full fine-tuning keeps fp32 master weights)",
            hint="--set train.lora.enabled=true, or keep train.base_dtype=fp32",
        )
    if train.fsdp_cpu_offload and train.fsdp == "none":
        raise ConfigError(
            "train.fsdp_cpu_offload=true needs train.fsdp (it offloads the shards)",
            hint="set train.fsdp=shard_grad_op or full_shard, or train.fsdp_cpu_offload=false",
        )
    if train.lora.enabled and train.fsdp != "none":
        raise ConfigError(
            f"train.lora.enabled=true with train.fsdp={train.fsdp}: LoRA runs are not sharded in this version",
            hint="use train.fsdp=none (several GPUs still work: data parallel), or full fine-tuning with FSDP",
        )
    sharded = world_size > 1 and train.fsdp != "none"
    if train.cuda_graphs == "step" and (sharded or train.fsdp_cpu_offload):
        why = f"train.fsdp={train.fsdp} over {world_size} processes" if sharded else "train.fsdp_cpu_offload=true"
        raise ConfigError(
            f"train.cuda_graphs=step does not work with {why}: a step is recorded with whole weights and gradients",
            hint="set train.fsdp=none (data parallel), or train.cuda_graphs=auto / true / false",
        )
    if train.cuda_graphs is True:
        clash = [
            f"{key} ({why})"
            for key, bad, why in (
                (
                    "train.compile=false",
                    train.compile is False,
                    "the graphs are recorded from the compiled blocks",
                ),
                (
                    "train.gradient_checkpointing=true",
                    train.gradient_checkpointing,
                    "recomputes inside backward",
                ),
                (
                    f"train.fsdp={train.fsdp}",
                    train.fsdp != "none" and not fsdp_skipped_on_cuda(train, world_size),
                    "gathers weights around every block",
                ),
            )
            if bad
        ]
        if clash:
            raise ConfigError(
                f"train.cuda_graphs=true does not work with {', '.join(clash)}",
                hint="set train.compile=true, train.gradient_checkpointing=false and train.fsdp=none, "
                "or train.cuda_graphs=auto / false",
            )
    check_trackers(train.trackers)
    if train.heldout_clips == 0 and train.eval_every is not None:
        raise ConfigError(
            "train.eval_every is set but train.heldout_clips is 0", hint="set train.heldout_clips=N (N > 0)"
        )
    return layout


@dataclass(frozen=True)
class TrainSpeed:
    """The speed settings a run resolves its ``auto`` options to (:func:`resolve_train_speed`)."""

    compile: bool
    cuda_graphs: bool | str  # True: the compiled blocks' graphs; "step": the whole step's (False: none)
    attention: str
    fsdp: str
    notes: tuple[str, ...] = ()
    checkpointing: str = "none"  # ``none``, or the ratio and policy, e.g. ``0.75 selective``
    merge_micro_batches: bool | None = None  # None: one micro-batch a step (nothing to merge)

    def describe(self) -> str:
        """One log line: what runs, and why where an ``auto`` decided."""
        graphs = {True: " + CUDA graphs", "step": ", CUDA graphs of the whole step"}.get(self.cuda_graphs, "")
        head = ("compiled blocks" if self.compile else "eager blocks") + graphs
        parts = [
            head,
            f"checkpointing {self.checkpointing}",
            f"attention {self.attention}",
            f"fsdp {self.fsdp}",
        ]
        if self.merge_micro_batches is not None:
            parts.append("micro-batches " + ("merged" if self.merge_micro_batches else "one by one"))
        return "; ".join(parts) + "".join(f" ({note})" for note in self.notes)


def resolve_train_speed(
    train: TrainConfig,
    device_type: str,
    world_size: int,
    no_compiler: str | None = None,
    merge_too_big: str | None = None,
) -> TrainSpeed:
    """The ``auto`` speed options for this device and world size: compiled blocks on CUDA, and the whole step
    recorded as CUDA graphs where it can be (:func:`records_steps`: one process, no checkpointing); cuDNN
    attention with compiled blocks under graphs or attending in row groups (their fixed set of shapes is
    planned once, and the graphs take its host cost off the step), the memory-efficient kernel otherwise; a
    step's micro-batches merged into one forward where the blocks are compiled without the blocks' own graphs
    and without activation checkpointing (a run that checkpoints puts memory first).
    ``train.fsdp`` with one CUDA process (no host offload) shards nothing: skipped (no gathers around the
    blocks). ``no_compiler``: why ``torch.compile`` cannot generate code here (no Triton): ``auto`` then keeps
    the eager blocks. ``merge_too_big``: why the merged step would not fit this GPU's memory (the caller's
    estimate): ``auto`` then runs the micro-batches one by one. Explicit ``true`` / ``false`` settings are
    kept."""
    cuda = device_type == "cuda"
    notes = []
    fsdp = train.fsdp
    if cuda and fsdp_skipped_on_cuda(train, world_size):
        fsdp = "none"
        notes.append(f"train.fsdp={train.fsdp} with one process shards nothing: not applied")
    compiled = cuda and (train.compile is True or (train.compile == "auto" and no_compiler is None))
    if train.compile is True and not cuda:
        notes.append("train.compile is ignored on the CPU")
    if cuda and train.compile == "auto" and no_compiler is not None:
        notes.append(f"eager blocks: torch.compile cannot generate code here ({no_compiler})")
    graphs = compiled and train.cuda_graphs is True
    step_graphs = cuda and (
        train.cuda_graphs == "step" or (train.cuda_graphs == "auto" and compiled and records_steps(train, world_size))
    )
    if train.cuda_graphs == "step" and not cuda:
        notes.append("train.cuda_graphs=step needs CUDA: eager steps")
    if cuda and compiled and train.cuda_graphs == "auto" and world_size > 1 and fsdp == "none":
        notes.append("the step's CUDA graphs with several processes: --set train.cuda_graphs=step")
    attention = train.attention
    if attention == "flex" and not cuda:
        attention = "efficient"
        notes.append("train.attention=flex needs CUDA (no FlexAttention backward on the CPU): efficient")
    if attention == "auto":  # cuDNN's kernel costs the host more a call: only where the host keeps up
        attention = "cudnn" if compiled and (graphs or step_graphs or train.skip_future_keys) else "efficient"
    checkpointing = "none"
    if train.gradient_checkpointing:
        checkpointing = f"{train.gradient_checkpointing_ratio:g} {train.gradient_checkpointing_policy}"
    merge = None
    if train.grad_accum > 1:
        merge = train.merge_micro_batches is True
        if train.merge_micro_batches == "auto" and compiled and not (graphs or train.gradient_checkpointing):
            merge = merge_too_big is None
            if not merge:
                notes.append(f"micro-batches one by one: {merge_too_big}")
    settled_graphs = "step" if step_graphs else graphs
    return TrainSpeed(compiled, settled_graphs, attention, fsdp, tuple(notes), checkpointing, merge)


def records_steps(train: TrainConfig, world_size: int) -> bool:
    """Whether ``train.cuda_graphs=auto`` records the whole step as CUDA graphs (with compiled blocks on CUDA):
    where a step can be recorded (one process, weights and gradients on the GPU) and the run does not put
    memory first (no activation checkpointing)."""
    return world_size == 1 and not train.fsdp_cpu_offload and not train.gradient_checkpointing


def check_trackers(trackers: list[str]) -> None:
    """Each tracker's package must be importable (looked up, not imported: no heavy import here)."""
    import importlib.util

    for name in trackers:
        modules, install = TRACKER_PACKAGES[name]
        if not any(importlib.util.find_spec(module) is not None for module in modules):
            raise ConfigError(
                f"train.trackers includes {name!r} but its package ({' or '.join(modules)}) is not installed",
                hint=f"{install}, or remove {name!r} from train.trackers",
            )
