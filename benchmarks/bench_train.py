"""Training throughput of ``pfctl train``: step time, tokens/s, MFU, host share, memory, warm-up.

Runs the real :class:`pfctl.training.trainer.Trainer` (data loader, temporal pyramid, DiT, objective,
optimizer, EMA, metric logging) on a synthetic latent cache, one step at a time:

* ``--recipe NAME``: a shipped recipe as users run it (its batch, accumulation, pyramid, checkpointing,
  FSDP, optimizer, EMA), the cache in the shapes of its first bucket and ``max_units`` frames, the DiT
  from ``model.path`` or, when it has none, the ``miniflux`` preset with random weights on CUDA
  (``tiny`` on the CPU). Scaled to the GPUs there are: one process per GPU (the script starts itself
  under ``torchrun``), the sync group cut to a divisor of the world size. ``--set KEY=VALUE`` overrides
  the recipe (e.g. ``--set model.dit_preset=tiny`` for a CPU smoke run). A checkpoint is written after
  the timed steps (timed on its own, not in the step times).
* without ``--recipe``: the built-in setting — CPU: the ``tiny`` preset on 8x8 latents, 4 latent frames;
  CUDA: the real-size ``miniflux`` preset at 384p (48x80 latents), 16 latent frames, bf16.

What it prints (per process, the slowest / the mean over processes):

* steady step time: the median of the timed steps (after ``--warmup``), synchronised with the GPU;
* image tokens/s per GPU and MFU = 6·N·image tokens / step time / peak (N = DiT parameters); with
  activation checkpointing the recomputed forwards (2·N_checkpointed·tokens) are counted separately,
  as a hardware utilisation beside the MFU; the analytic model FLOPs (attention and text tokens
  included) as before;
* host fraction: the host's busy time of a step (until ``train_step`` returns, less the step's one wait
  for the GPU's numbers) over its synchronised time, and the part of it spent loading batches. A host that
  launches faster than the GPU runs also waits inside launches once CUDA's queue is full, so a high fraction
  alone does not make a step host-bound: ``--profile`` prints the GPU's busy time in one profiled step;
* peak memory (CUDA: the largest allocation peak of a timed step, the trainer resetting it every step, and
  that of the warm-up; CPU: the process's peak RSS);
* time to steady state: from the first step's start to the end of the first step from which on the median
  of the last 5 step times stays within 10% of the steady step time (compilation and recording included);
* the checkpoint: the time the loop waits for it (a host copy when written in the background, the CUDA
  default) and the time until it is committed.

    python benchmarks/bench_train.py                                    # CPU tiny
    python benchmarks/bench_train.py --device cuda                      # H200: miniFLUX 384p, 16 frames
    python benchmarks/bench_train.py --recipe pyramid-flux-768p-8gpu    # the recipe, on every GPU here
    python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 \\
        --reference third_party/Pyramid-Flow                            # side by side, one GPU
    python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --device cpu \\
        --set model.dit_preset=tiny --frames 2 --height 8 --width 8     # CPU smoke run
    python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --progress \\
        --inductor triton.slow_path_cudagraph_asserts=False             # a warm-up experiment
    python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --host-profile 15
                                                                        # where the warm-up's host time goes
    python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --warmup 4 --steps 1 \
        --profile-step 3                                                # the operators of a step meeting new inputs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEAK_BF16 = {"H200": 790e12, "H100": 989.5e12, "A100": 312e12}
"""Dense bf16 matrix-product rates: the H200 figure is the one measured on the benchmark machine
(a large bf16 matmul), not the datasheet 989.5 TFLOP/s."""
STEADY_WINDOW, STEADY_WITHIN = 5, 0.10


def dit_flops_per_forward(cfg: dict, records: list[dict], text_len: int) -> float:
    """Analytic forward FLOPs of one micro-batch (2 FLOPs per MAC)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    blocks = cfg["num_layers"] + cfg["num_single_layers"]
    macs = 0.0
    for rec in records:
        cols = rec["columns"]
        per_col = rec["column_tokens"]
        for col, tokens in zip(cols, per_col, strict=False):
            n = len(col["ids"])
            seq = text_len + tokens
            macs += n * blocks * (12 * d * d * seq + 2 * seq * seq * d)  # linears + attention
            macs += n * (cfg["in_channels"] * d * tokens + d * cfg["in_channels"] * tokens)  # in/out proj
            macs += n * blocks * 12 * d * d  # adaLN modulation rows (per sample)
    return 2.0 * macs


def counting_syncs(step: Callable[[], Any]) -> tuple[Any, int]:
    """``step()`` under CUDA's sync debug mode: its result and the number of calls in it that made the
    host wait for the GPU (``.item()``, ``float(t)``, device-to-host and pageable host-to-device copies)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchronizing" in str(w.message) for w in caught)


def time_to_steady(times: list[float], steady: float) -> tuple[int, float]:
    """(1-based step, seconds from the first step's start to its end) of the first step from which on the
    median of the last :data:`STEADY_WINDOW` step times stays within :data:`STEADY_WITHIN` of ``steady`` (the
    steady step time: the timed steps' median)."""
    near = [
        abs(statistics.median(times[max(0, i + 1 - STEADY_WINDOW) : i + 1]) - steady) <= STEADY_WITHIN * steady
        for i in range(len(times))
    ]
    first = len(times)
    while first > 0 and near[first - 1]:
        first -= 1
    step = min(first + 1, len(times))
    return step, sum(times[:step])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--recipe", default=None, help="a shipped recipe (or a recipe file) to run as users do"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (repeatable), applied after the recipe and the options below",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="processes (one per GPU); default: every visible GPU with --recipe, else 1",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="the cache and run folder every process shares (default: a temporary one; "
        "needed when this script is started by a launcher)",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--preset", default=None, help="DiT preset (default: miniflux on CUDA, tiny on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None, help="latent frames per clip (M)")
    parser.add_argument("--height", type=int, default=None, help="latent height")
    parser.add_argument("--width", type=int, default=None, help="latent width")
    parser.add_argument(
        "--batch", type=int, default=None, help="train.batch_size (default: 4 / the recipe's)"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--profile", action="store_true", help="print the top ops of one profiled step")
    parser.add_argument("--progress", action="store_true", help="print each step's time as it ends")
    parser.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="sample the Python threads' stacks every 20 ms during the steps and print the N functions that "
        "took the most host time per phase (step 1, the rest of the warm-up, the timed steps) and thread",
    )
    parser.add_argument(
        "--host-phase-ends",
        default="",
        metavar="N,M",
        help="with --host-profile: the warm-up steps after which a phase of its own ends (e.g. 8: each input's "
        "first occurrence on one GPU, before the recordings)",
    )
    parser.add_argument(
        "--profile-step",
        type=int,
        default=0,
        metavar="N",
        help="run step N (1-based, e.g. a warm-up step that meets a new input) under the profiler and print its "
        "top operators by GPU and by host time",
    )
    parser.add_argument("--no-checkpoint", action="store_true", help="skip the timed checkpoint save")
    parser.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an experiment: set torch._inductor.config KEY (dotted, e.g. triton.slow_path_cudagraph_asserts) "
        "to the Python literal VALUE in this process before the run (repeatable; printed in the report)",
    )
    parser.add_argument(
        "--compile-times", action="store_true", help="print where the compilation's time went (Dynamo's table)"
    )
    parser.add_argument(
        "--attention",
        default=None,
        choices=["auto", "efficient", "cudnn"],
        help="train.attention (default: efficient / the recipe's)",
    )
    parser.add_argument("--compile", action="store_true", help="train.compile (compiled DiT blocks)")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="train.cuda_graphs (compiled blocks as CUDA graphs; with --compile)",
    )
    parser.add_argument("--skip-future-keys", action="store_true", help="train.skip_future_keys")
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        metavar="DIR",
        help="also time the reference's own training step (a jy0205/Pyramid-Flow clone, e.g. "
        "third_party/Pyramid-Flow) in the same configuration, after pfctl's (one process)",
    )
    return parser.parse_args(argv)  # fmt: skip


def is_cuda(args: argparse.Namespace) -> bool:
    import torch

    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


@dataclass
class Setting:
    """What the run trains, for the report."""

    cuda: bool
    frames: int
    height: int
    width: int
    text_len: int
    steps: int
    warmup: int
    progress: bool = False
    phase_ends: tuple[int, ...] = ()  # --host-phase-ends
    profile_step: int = 0  # --profile-step


def plan_setting(args: argparse.Namespace, world: int) -> tuple[Any, Setting]:
    """The config to train (recipe or built-in, the options, ``--set``) and the synthetic cache's shapes."""
    from pfctl.config import load_config

    cuda, work = is_cuda(args), Path(args.workdir)
    recipe = load_config(args.recipe, args.overrides) if args.recipe else None
    preset = args.preset
    if recipe is None or (recipe.model.path is None and recipe.model.dit_preset is None):
        preset = preset or ("miniflux" if cuda else "tiny")
    if recipe is not None:  # the first bucket (width x height pixels, 8x VAE) and the recipe's M
        (bucket_w, bucket_h), frames = recipe.encode.buckets[0], recipe.train.max_units
        height, width, frames = (
            args.height or bucket_h // 8,
            args.width or bucket_w // 8,
            args.frames or frames,
        )
    else:
        frames = args.frames or (16 if cuda else 4)
        height, width = args.height or (48 if cuda else 8), args.width or (80 if cuda else 8)
    # compiled blocks as CUDA graphs (the CUDA default): every new shape is recorded at its second occurrence,
    # and the pyramid's shapes cycle
    steps = args.steps or 20
    warmup = args.warmup if args.warmup is not None else (20 if cuda else 3)
    flags = {
        "runtime.device": "cuda" if cuda else "cpu",
        "runtime.mixed_precision": None if cuda else "no",  # the CPU runs fp32 (its eager path)
        "model.dit_preset": preset,
        "train.cache": str(work / "cache"),
        "train.output_dir": str(work / "out"),
        "train.max_steps": steps + warmup + 1,
        "train.max_units": frames,
        "train.batch_size": args.batch or (None if recipe else 4),
        "train.warmup_steps": None if recipe else 1,
        "train.checkpoint_every": 10**6,
        "train.log_assignments": False,
        "train.export": False,
        "train.gradient_checkpointing": args.gradient_checkpointing or None,
        "train.attention": args.attention or (None if recipe else "efficient"),
        "train.compile": args.compile or None,
        "train.cuda_graphs": args.cuda_graphs or None,
        "train.skip_future_keys": args.skip_future_keys or None,
    }
    if recipe is not None:  # sync groups of a divisor of this world size
        flags["train.video_sync_group"] = math.gcd(recipe.train.video_sync_group, world)
    overrides = [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    overrides.append("train.skip_loss_above=null")  # random weights: every update is applied (and timed)
    config = load_config(args.recipe, [*overrides, *args.overrides])
    progress = args.progress and int(os.environ.get("RANK", "0")) == 0
    ends = tuple(int(end) for end in args.host_phase_ends.split(",") if end)
    return config, Setting(
        cuda, frames, height, width, 128 if cuda else 8, steps, warmup, progress, ends, args.profile_step
    )


def dit_dims(config: Any) -> dict[str, Any]:
    """The DiT's configuration (a preset's, or the model folder's)."""
    if config.model.dit_preset is not None:
        from pfctl.models.registry import preset_config

        return {**preset_config(config.model.dit_preset), **config.model.dit_config}
    from pfctl.training.build import build_model

    return dict(build_model(config)[1].config)


def write_cache(config: Any, setting: Setting) -> None:
    """The synthetic cache in the setting's shapes for the config's DiT."""
    from pfctl.data.dataset import write_synthetic_cache

    dims = dit_dims(config)
    write_synthetic_cache(
        config.train.cache, [setting.frames] * max(config.train.batch_size * 2, 8), height=setting.height,
        width=setting.width, text_len=setting.text_len, text_dim=dims["joint_attention_dim"],
        pooled_dim=dims["pooled_projection_dim"],
    )  # fmt: skip


@dataclass
class Timings:
    """Per step of this process: synchronised time, host time, batch loading, image tokens, FLOPs."""

    step: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    analytic: list[float] = field(default_factory=list)
    peak: list[float] = field(default_factory=list)  # CUDA: the step's peak allocation (the trainer's metric)
    gc: list[float] = field(default_factory=list)  # seconds Python's garbage collector ran in the step
    gc_full: list[int] = field(default_factory=list)  # its full passes (every generation) in the step
    syncs: int | None = None
    metrics: dict = field(default_factory=dict)
    graphs: list[collections.Counter] = field(default_factory=list)  # CUDA-graph trees' calls by outcome


def run_steps(
    trainer: Any, setting: Setting, dims: dict, phase: Callable[[str], None] | None = None
) -> Timings:
    """The training loop's body (step, loss, logging) ``warmup + steps`` times, each step timed; ``phase`` is
    told the phase each step starts (:func:`step_phase`). With CUDA graphs each step's calls of the graph trees
    are counted by outcome (:mod:`graph_events`)."""
    from graph_events import GraphEvents, describe

    records: list[dict] = []
    trainer.write_assignment = records.append  # keep the per-forward records in memory
    out = Timings()
    counting = setting.cuda and trainer.graphed
    graphs = GraphEvents() if counting else contextlib.nullcontext()
    with GCPauses() as pauses, graphs:
        for i in range(setting.steps + setting.warmup):
            seconds, full = pauses.seconds, pauses.full
            run_step(trainer, setting, dims, i, out, records, phase)
            out.gc.append(pauses.seconds - seconds)
            out.gc_full.append(pauses.full - full)
            out.graphs.append(graphs.take() if counting else collections.Counter())
            if setting.progress:
                events = describe(out.graphs[-1])
                print(f"bench step {i + 1}: {out.step[-1]:.3f} s" + (f" ({events})" if events else ""), flush=True)
    return out


class CacheBypasses(logging.Handler):
    """Why AOTAutograd's on-disk cache was bypassed or could not store or load a graph (its log: such a graph is
    traced again in every run), collected from construction until :meth:`close`."""

    LOGGER = "torch._functorch._aot_autograd.autograd_cache"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: collections.Counter[str] = collections.Counter()
        logger = logging.getLogger(self.LOGGER)
        self.level_before = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "bypass" in message.lower() or "unable to" in message:
            self.reasons[message[:400]] += 1

    def close(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self.level_before)
        super().close()


class GCPauses:
    """How long Python's cyclic garbage collector ran (in any thread: it holds the interpreter meanwhile),
    and how many of its passes covered every generation; counted while registered (``with``)."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_step(
    trainer: Any,
    setting: Setting,
    dims: dict,
    i: int,
    out: Timings,
    records: list[dict],
    phase: Callable[[str], None] | None,
) -> None:
    """Step ``i`` (0-based) of :func:`run_steps`, timed, its figures appended to ``out``."""
    import torch

    from pfctl.training.plan import column_tokens

    cuda = setting.cuda
    if phase is not None:
        phase(step_phase(i, setting.warmup, setting.phase_ends))
    records.clear()
    if cuda:
        torch.cuda.synchronize()
    tic = time.perf_counter()
    if cuda and i == setting.warmup - 1:  # the last warm-up step counts the host's waits for the GPU
        metrics, out.syncs = counting_syncs(trainer.train_step)
    elif i + 1 == setting.profile_step:
        metrics = profile_step(trainer, cuda)
    else:
        metrics = trainer.train_step()
    trainer.losses.append(metrics["loss"])
    if trainer.step % trainer.cfg.log_every == 0:
        trainer.logs.metrics(trainer.step, metrics)
    returned = time.perf_counter() - tic
    if cuda:
        torch.cuda.synchronize()
    out.step.append(time.perf_counter() - tic)
    out.host.append(returned)
    out.wait.append(metrics["gpu_wait_s"])
    out.peak.append(metrics.get("peak_memory_gib", 0.0))
    out.load.append(metrics["data_time_s"])  # the main thread's: drawing and waiting for batches
    out.tokens.append(sum(r["tokens"] for r in records))
    for rec in records:
        f, h, w = rec["bucket"]
        units = rec["units"]
        rec["column_tokens"] = [
            column_tokens(c["stage"], None if units is None else units[c["stage"]], f, h, w)
            for c in rec["columns"]
        ]
    out.analytic.append(3 * dit_flops_per_forward(dims, records, setting.text_len))
    out.metrics = metrics


def across_processes(values: list[float], op: str) -> list[float]:
    """``values`` reduced over every process (``max`` or ``mean``); as they are in a lone process."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    t = t if op == "max" else t / dist.get_world_size()
    return t.tolist()


def parameter_counts(trainer: Any) -> tuple[int, int]:
    """(DiT parameters N, those whose products activation checkpointing recomputes: the checkpointed blocks',
    less their narrowing products' under ``selective_narrow``, which keeps those products' outputs)."""
    model = trainer.unwrapped
    total = sum(p.numel() for p in model.parameters())
    if not trainer.cfg.gradient_checkpointing:
        return total, 0
    from pfctl.models.fast.checkpointing import checkpointed_blocks, narrowing_linears

    ratio = trainer.cfg.gradient_checkpointing_ratio
    blocks = [block for _, block in checkpointed_blocks(model.blocks_in_order(), ratio)]
    recomputed = sum(p.numel() for block in blocks for p in block.parameters())
    if trainer.cfg.gradient_checkpointing_policy == "selective_narrow":
        recomputed -= sum(linear.weight.numel() for block in blocks for linear in narrowing_linears(block))
    return total, recomputed


def step_phase(index: int, warmup: int, ends: tuple[int, ...] = ()) -> str:
    """The phase of the step at 0-based ``index``: the first step, a part of the rest of the warm-up (``ends``:
    the 1-based steps after which a part ends, besides the warm-up's last), or timed."""
    step = index + 1
    if step > warmup:
        return "timed steps"
    bounds = sorted({1, warmup, *(end for end in ends if 1 < end < warmup)})
    end = next(b for b in bounds if b >= step)
    start = bounds[bounds.index(end) - 1] + 1 if end > 1 else 1
    if start == end:
        return f"step {end}" + (" (warm-up)" if end > 1 else "")
    return f"steps {start}-{end} (warm-up)"


def profile_step(trainer: Any, cuda: bool) -> dict:
    """One ``train_step`` under the profiler: the top operators by GPU and by host time, the GPU's busy share;
    returns the step's metrics."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        tic = time.perf_counter()
        metrics = trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - tic
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    if cuda:  # under the profiler the host is slower: a low figure may be the profiler's own cost
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        from kernel_profile import gpu_busy_seconds

        busy_s = gpu_busy_seconds(prof.events())
        print(f"profiled step: {wall_s:.3f} s, the GPU busy {busy_s:.3f} s of it ({busy_s / wall_s:.0%})")
    return metrics


def measure(config: Any, setting: Setting, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Set the trainer up, run and time the steps and one checkpoint; the report's rows (every process)."""
    import resource

    import torch

    from pfctl.training.trainer import Trainer

    bypasses = CacheBypasses() if args.compile_times else None
    trainer = Trainer(config)
    trainer.setup()
    dims = dit_dims(config)
    params, recomputed = parameter_counts(trainer)
    if args.host_profile:
        from host_sampler import HostSampler

        with HostSampler() as sampler:
            t = run_steps(trainer, setting, dims, sampler.phase)
        if int(os.environ.get("RANK", "0")) == 0:
            print(sampler.report(args.host_profile))
    else:
        t = run_steps(trainer, setting, dims)
    if setting.cuda:
        torch.cuda.synchronize()
    tic = time.perf_counter()
    if not args.no_checkpoint:
        trainer.save_checkpoint()
    checkpoint_s = time.perf_counter() - tic  # what the loop waits for
    if not args.no_checkpoint:
        trainer.finish_checkpoints()
    written_s = time.perf_counter() - tic  # until the checkpoint is committed (the same with blocking saves)
    if args.profile:
        profile_step(trainer, setting.cuda)
    if bypasses is not None:  # --compile-times
        from torch._dynamo.utils import compile_times, counters

        print(compile_times(repr="str", aggregate=True))
        caches = {f"{group}.{k}": v for group in ("aot_autograd", "inductor") for k, v in counters[group].items()}
        print("compile caches:", {k: v for k, v in sorted(caches.items()) if "cache" in k})
        for reason, times in bypasses.reasons.items():
            print(f"AOTAutograd cache ({times}x): {reason}")
        bypasses.close()
    if not setting.cuda:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    device_name = torch.cuda.get_device_name() if setting.cuda else "cpu"
    world = trainer.runtime.world_size
    trainer.close()

    n = len(t.step)
    step_max = across_processes(t.step, "max")
    host_max = across_processes([h - w for h, w in zip(t.host, t.wait, strict=True)], "max")
    load_max = across_processes(t.load, "max")
    tokens = across_processes([float(x) for x in t.tokens], "mean")
    analytic = across_processes(t.analytic, "mean")
    timed = range(setting.warmup, n)
    if setting.cuda:  # the trainer resets the peak after every step: the maximum of the steps' peaks
        peaks = across_processes(t.peak, "max")
        warm = max(peaks[: setting.warmup], default=0.0)
        peak = f"{max(peaks[i] for i in timed):.2f} GiB allocated ({warm:.2f} in the warm-up)"
    else:
        peak = f"{across_processes([rss], 'max')[0]:.2f} GiB RSS"
    step_s = statistics.median(step_max[i] for i in timed)
    seconds = sum(step_max[i] for i in timed)
    tok_s = sum(tokens[i] for i in timed) / seconds
    steady_step, steady_s = time_to_steady(step_max, step_s)
    rate = next((v for k, v in PEAK_BF16.items() if k in device_name), None) if setting.cuda else None

    def util(flops_per_token: float) -> str:
        achieved = flops_per_token * tok_s
        return (
            f"{achieved / rate:.1%} of {rate / 1e12:.0f} TFLOP/s bf16 dense"
            if rate
            else f"n/a ({achieved / 1e12:.3g} TFLOP/s, no peak rate known)"
        )

    cfg = trainer.cfg
    return [
        ("device", f"{device_name} x {world}"),
        ("recipe", args.recipe or "(built-in)"),
        ("overrides", " ".join(args.overrides) or "-"),
        ("inductor options", " ".join(args.inductor) or "-"),
        ("model / params", f"{config.model.dit_preset or config.model.path} / {params / 1e6:.1f} M"),
        ("latents (T x H x W)", f"{setting.frames} x {setting.height} x {setting.width}"),
        ("batch per rank", f"{cfg.batch_size} clips x {cfg.grad_accum} micro-steps, sync group {cfg.video_sync_group}"),
        ("precision", trainer.runtime.mixed_precision),
        ("fsdp / gradient checkpointing", f"{cfg.fsdp} / {cfg.gradient_checkpointing_ratio if cfg.gradient_checkpointing else 'off'}"),
        ("attention / compile / cuda graphs (settled)", f"{cfg.attention} / {cfg.compile} / {cfg.cuda_graphs}"),
        ("steps timed (warmup)", f"{setting.steps} ({setting.warmup})"),
        ("steady step time (median)", f"{step_s * 1e3:.1f} ms"),
        ("time to steady state", f"{steady_s:.1f} s (step {steady_step}: median of {STEADY_WINDOW} within {STEADY_WITHIN:.0%})"),
        ("image tokens / step / GPU", f"{statistics.mean(tokens[i] for i in timed):.0f}"),
        ("image tokens/s per GPU", f"{tok_s:,.0f}"),
        ("MFU (6·N·image tokens)", util(6 * params)),
        ("with recomputation (+2·N_ckpt·tokens)", util(6 * params + 2 * recomputed) if recomputed else "no recomputation"),
        ("analytic model TFLOP/s per GPU (attention, text)", f"{sum(analytic[i] for i in timed) / seconds / 1e12:.3g}"),
        # on CUDA train_step returns once the optimizer update is queued (the GPU may still run it)
        ("host busy fraction of the step", f"{statistics.median(host_max[i] / step_max[i] for i in timed):.0%}"),
        ("batch loading / step (host)", f"{statistics.median(load_max[i] for i in timed) * 1e3:.1f} ms"),
        ("Python GC: step 1 / rest of warm-up / timed", gc_row(t, setting.warmup)),
        ("blocking host syncs / step", "n/a (counted on CUDA, in a warm-up step)" if t.syncs is None else str(t.syncs)),
        ("peak memory (timed steps)", peak),
        ("checkpoint save (not timed above)", "skipped (--no-checkpoint)" if args.no_checkpoint else f"{checkpoint_s:.2f} s in the loop, written after {written_s:.2f} s"),
        ("last loss", f"{t.metrics['loss']:.4f}"),
        ("step times (s, in order)", " ".join(f"{x:.2f}" for x in step_max)),
        ("CUDA graphs in the timed steps", graph_row(t, setting.warmup)),
    ]  # fmt: skip


def graph_row(t: Timings, warmup: int) -> str:
    """The graph trees' calls in the timed steps by outcome (this process; every one a replay when all is well),
    and the steps in which any call was not."""
    from graph_events import describe

    total = sum(t.graphs[warmup:], collections.Counter())
    if not total:
        return "none (no CUDA graphs)"
    off = [i + 1 for i in range(warmup, len(t.graphs)) if t.graphs[i]["replayed"] != t.graphs[i]["calls"]]
    return describe(total) + (f"; steps with calls not replayed: {' '.join(map(str, off))}" if off else "")


def gc_row(t: Timings, warmup: int) -> str:
    """Seconds the garbage collector ran in step 1, the rest of the warm-up and the timed steps (this process),
    and its full passes."""
    parts = [slice(0, 1), slice(1, warmup), slice(warmup, None)]
    seconds = " / ".join(f"{sum(t.gc[p]):.2f}" for p in parts)
    return f"{seconds} s ({' / '.join(str(sum(t.gc_full[p])) for p in parts)} full passes)"


def reference_rows(root: Path, config: Any, setting: Setting, ours: dict[str, str]) -> list[tuple[str, str]]:
    """The reference's own step (``bench_reference.ReferenceTraining``) in the run's configuration: its batch,
    latents, sync group (rank 0), checkpointing ratio and gradient accumulation (``grad_accum`` micro-batches a
    step, as its training loop runs them), the same random-weight DiT architecture; compared by image tokens
    per second and peak memory."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_reference as br
    from reference_setup import import_reference, prepare_checkpoint

    cfg, device = config.train, torch.device("cuda" if setting.cuda else "cpu")
    Reference, _ = import_reference(root.resolve())
    folder, _, text = prepare_checkpoint(device, torch.float32, None)
    inputs: list[dict] = []
    ref = br.ReferenceTraining(
        Reference, folder, text, device, frames=setting.frames, latent_hw=(setting.height, setting.width),
        group=cfg.video_sync_group, batch=cfg.batch_size,
        checkpointing_ratio=cfg.gradient_checkpointing_ratio if cfg.gradient_checkpointing else None,
        micro_batches=cfg.grad_accum,
    )  # fmt: skip
    if setting.cuda:
        torch.cuda.reset_peak_memory_stats()
    ref.record(inputs, [])
    runs = ref.run(setting.warmup + setting.steps)
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated" if setting.cuda else "n/a (CPU)"
    ref.close()

    timed = range(setting.warmup, len(runs))
    step_s = statistics.median(runs[i][1] for i in timed)
    timed_inputs = inputs[setting.warmup * cfg.grad_accum :]  # one DiT call per micro-batch
    tok_s = sum(br.image_tokens(x["sample"]) for x in timed_inputs) / sum(runs[i][1] for i in timed)
    ours_tok_s = float(ours["image tokens/s per GPU"].replace(",", ""))
    return [
        (f"reference step (median, {cfg.grad_accum} micro-batch(es))", f"{step_s * 1e3:.1f} ms"),
        ("reference image tokens/s", f"{tok_s:,.0f}"),
        ("reference peak memory", peak),
        ("pfctl / reference (image tokens/s)", f"{ours_tok_s / tok_s:.2f}x"),
    ]


def set_inductor_options(options: list[str]) -> None:
    """``KEY=VALUE`` pairs into ``torch._inductor.config`` (an unknown key is an error, not a no-op)."""
    import ast

    import torch._inductor.config as inductor_config

    for option in options:
        key, _, value = option.partition("=")
        *parents, name = key.split(".")
        target = inductor_config
        for part in parents:
            target = getattr(target, part)
        if not hasattr(target, name):
            raise SystemExit(f"--inductor {option}: torch._inductor.config has no {key}")
        setattr(target, name, ast.literal_eval(value))


def run_here(args: argparse.Namespace) -> None:
    """This process's part: plan, (a lone process: write the cache,) measure, print on the main process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    set_inductor_options(args.inductor)
    config, setting = plan_setting(args, world)
    if not Path(config.train.cache).is_dir():
        if world > 1:
            raise SystemExit(
                "under a launcher, pass --workdir with a cache this script wrote (or start it plainly)"
            )
        write_cache(config, setting)
    rows = measure(config, setting, args)
    if args.reference is not None:
        if world > 1:
            raise SystemExit("--reference times the reference in one process: use --processes 1")
        rows += reference_rows(args.reference, config, setting, dict(rows))
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2))
    width_k = max(len(k) for k, _ in rows)
    print("\npfctl train benchmark")
    print("-" * (width_k + 40))
    for key, value in rows:
        print(f"{key:<{width_k}}  {value}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workdir is not None or "LOCAL_RANK" in os.environ:
        if args.workdir is None:
            raise SystemExit("under a launcher, pass --workdir (a folder every process shares)")
        run_here(args)
        return 0
    import torch

    nproc = args.processes or (torch.cuda.device_count() if is_cuda(args) and args.recipe else 1)
    with tempfile.TemporaryDirectory(prefix="pfctl-bench-") as tmp:
        args.workdir = tmp
        if nproc <= 1:
            run_here(args)
            return 0
        config, setting = plan_setting(args, nproc)
        write_cache(config, setting)  # once, for every process
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        return subprocess.call(
            [*cmd, __file__, *(argv if argv is not None else sys.argv[1:]), "--workdir", tmp]
        )


if __name__ == "__main__":
    sys.exit(main())
