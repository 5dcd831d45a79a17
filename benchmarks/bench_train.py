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
  alone does not make a step host-bound: ``--profile`` prints the GPU's busy time in one profiled step and
  the host's own work in it, less its waits for the GPU (``--trace FILE`` writes that step's trace);
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
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours: the report, graph events

from train_report import Measured, Profiled, reference_rows, report_rows


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


def counting_syncs(step: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``step()`` under CUDA's sync debug mode: its result and where each call in it made the host wait for
    the GPU (``.item()``, ``float(t)``, device-to-host and pageable host-to-device copies): the last pfctl
    line on the stack (``pfctl/training/trainer.py:210``), else its innermost frames (:func:`outside_pfctl`)."""
    import torch

    from pfctl.runtime.logging import own_line

    sites: list[str] = []

    def note(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        if "called a synchronizing" in str(message):  # (not the mode's own "prototype" notice)
            frames = traceback.extract_stack()[:-1]
            sites.append(own_line(frames) or outside_pfctl(frames))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sites


def outside_pfctl(frames: list[traceback.FrameSummary]) -> str:
    """A wait with no pfctl line on its thread's stack: its innermost two frames, each as ``package/FILE:LINE
    function`` (under site-packages) or ``FILE:LINE function``, innermost first."""

    def site(frame: traceback.FrameSummary) -> str:
        parts = Path(frame.filename).parts
        under = parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-1:]
        return f"{'/'.join(under)}:{frame.lineno} {frame.name}"

    inner = [f for f in frames if "warnings" not in Path(f.filename).name][-2:]
    return " <- ".join(site(f) for f in reversed(inner))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_options(parser.add_argument_group("the run"))
    add_report_options(parser.add_argument_group("what to report"))
    return parser.parse_args(argv)


def add_run_options(run: argparse._ArgumentGroup) -> None:
    """The run: recipe and overrides, processes, sizes, the speed options, the reference beside it."""
    run.add_argument(
        "--recipe", default=None, help="a shipped recipe (or a recipe file) to run as users do"
    )
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (repeatable), applied after the recipe and the options below",
    )
    run.add_argument(
        "--processes",
        type=int,
        default=None,
        help="processes (one per GPU); default: every visible GPU with --recipe, else 1",
    )
    run.add_argument(
        "--workdir",
        default=None,
        help="the cache and run folder every process shares (default: a temporary one; "
        "needed when this script is started by a launcher)",
    )
    run.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    run.add_argument("--preset", default=None, help="DiT preset (default: miniflux on CUDA, tiny on CPU)")
    run.add_argument("--steps", type=int, default=None, help="timed steps (after the warm-up)")
    run.add_argument("--warmup", type=int, default=None)
    run.add_argument("--frames", type=int, default=None, help="latent frames per clip (M)")
    run.add_argument("--height", type=int, default=None, help="latent height")
    run.add_argument("--width", type=int, default=None, help="latent width")
    run.add_argument(
        "--batch", type=int, default=None, help="train.batch_size (default: 4 / the recipe's)"
    )
    run.add_argument("--gradient-checkpointing", action="store_true")
    run.add_argument("--no-checkpoint", action="store_true", help="skip the timed checkpoint save")
    run.add_argument(
        "--attention",
        default=None,
        choices=["auto", "efficient", "cudnn"],
        help="train.attention (default: efficient / the recipe's)",
    )
    run.add_argument("--compile", action="store_true", help="train.compile (compiled DiT blocks)")
    run.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="train.cuda_graphs (compiled blocks as CUDA graphs; with --compile)",
    )
    run.add_argument("--skip-future-keys", action="store_true", help="train.skip_future_keys")
    run.add_argument(
        "--reference",
        type=Path,
        default=None,
        metavar="DIR",
        help="also time the reference's own training step (a jy0205/Pyramid-Flow clone, e.g. "
        "third_party/Pyramid-Flow) in the same configuration, after pfctl's (one process)",
    )


def add_report_options(report: argparse._ArgumentGroup) -> None:
    """What is measured and printed beyond the report: progress, profiles, compile times, JSON."""
    report.add_argument("--json", default=None, help="also write the results here")
    report.add_argument("--profile", action="store_true", help="print the top ops of one profiled step")
    report.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="with --profile: also write the profiled step's trace (Chrome's format; gzipped when FILE ends in .gz)",
    )
    report.add_argument("--progress", action="store_true", help="print each step's time as it ends")
    report.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="sample the Python threads' stacks every 20 ms during the steps and print the N functions that "
        "took the most host time per phase (step 1, the rest of the warm-up, the timed steps) and thread",
    )
    report.add_argument(
        "--host-phase-ends",
        default="",
        metavar="N,M",
        help="with --host-profile: the warm-up steps after which a phase of its own ends (e.g. 8: each input's "
        "first occurrence on one GPU, before the recordings)",
    )
    report.add_argument(
        "--profile-step",
        type=int,
        default=0,
        metavar="N",
        help="run step N (1-based, e.g. a warm-up step that meets a new input) under the profiler and print its "
        "top operators by GPU and by host time",
    )
    report.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an experiment: set torch._inductor.config KEY (dotted, e.g. triton.slow_path_cudagraph_asserts) "
        "to the Python literal VALUE in this process before the run (repeatable; printed in the report)",
    )
    report.add_argument(
        "--compile-times", action="store_true", help="print where the compilation's time went (Dynamo's table)"
    )


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
    # on CUDA the warm-up covers each of the pyramid's inputs compiled and planned at its first occurrence, and
    # with train.cuda_graphs=true recorded at its second (the shapes cycle)
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
    reserved: list[float] = field(default_factory=list)  # CUDA: GiB the allocator holds after the step
    gc: list[float] = field(default_factory=list)  # seconds Python's garbage collector ran in the step
    gc_full: list[int] = field(default_factory=list)  # its full passes (every generation) in the step
    syncs: list[str] | None = None  # where the host waited for the GPU in a warm-up step (CUDA)
    metrics: dict = field(default_factory=dict)
    graphs: list[collections.Counter] = field(default_factory=list)  # CUDA-graph trees' calls by outcome
    step_graphs: list[tuple[int, int]] = field(default_factory=list)  # train.cuda_graphs=step: (calls, replays)


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
            steps = trainer.step_graphs
            if steps is not None:
                out.step_graphs.append((steps.calls, steps.replays))
            if setting.progress:
                events = describe(out.graphs[-1])
                if steps is not None:
                    events = f"step graphs: {steps.recorded} recorded, {steps.replays} replays"
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
        metrics, _ = profile_step(trainer, cuda)
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
    out.reserved.append(torch.cuda.memory_reserved() / 2**30 if cuda else 0.0)
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


def profile_step(trainer: Any, cuda: bool, trace: str | None = None) -> tuple[dict, Profiled | None]:
    """One ``train_step`` under the profiler: the top operators by GPU and by host time, the GPU's busy share;
    returns the step's metrics and (CUDA) its times."""
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
        from kernel_profile import gpu_busy_seconds, host_work_seconds

        events = prof.events()
        busy_s = gpu_busy_seconds(events)
        kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
        print(
            f"profiled step: {wall_s:.3f} s, the GPU busy {busy_s:.3f} s of it ({busy_s / wall_s:.0%}), "
            f"{kernels} GPU kernels and copies"
        )
        work_s = host_work_seconds(events)
        print(
            f"host work in the profiled step, less its waits for the GPU: {work_s:.3f} s, {work_s / busy_s:.0%} "
            "of the GPU's busy time (an upper bound: every thread, at the profiler's speed)"
        )
    if trace is not None:
        prof.export_chrome_trace(trace)
    return metrics, Profiled(wall_s, busy_s, work_s) if cuda else None


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
    profiled = profile_step(trainer, setting.cuda, args.trace)[1] if args.profile else None
    if bypasses is not None:  # --compile-times
        print_compile_times(bypasses)
    run = Measured(
        t=t, params=params, recomputed=recomputed, checkpoint_s=checkpoint_s, written_s=written_s,
        rss_gib=None if setting.cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB
        device_name=torch.cuda.get_device_name() if setting.cuda else "cpu",
        world=trainer.runtime.world_size, precision=trainer.runtime.mixed_precision, cfg=trainer.cfg,
        profiled=profiled,
    )  # fmt: skip
    trainer.close()
    return report_rows(run, config, setting, args)


def print_compile_times(bypasses: CacheBypasses) -> None:
    """Dynamo's compile times, the AOTAutograd / Inductor cache counters and why AOTAutograd's cache was bypassed."""
    from torch._dynamo.utils import compile_times, counters

    print(compile_times(repr="str", aggregate=True))
    caches = {f"{group}.{k}": v for group in ("aot_autograd", "inductor") for k, v in counters[group].items()}
    print("compile caches:", {k: v for k, v in sorted(caches.items()) if "cache" in k})
    for reason, times in bypasses.reasons.items():
        print(f"AOTAutograd cache ({times}x): {reason}")
    bypasses.close()


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


def refuse_reference_beside(processes: int, args: argparse.Namespace) -> None:
    """``--reference`` with several processes, refused before any work (the reference's step runs in one)."""
    if args.reference is not None and processes > 1:
        raise SystemExit("--reference times the reference in one process: use --processes 1")


def run_here(args: argparse.Namespace) -> None:
    """This process's part: plan, (a lone process: write the cache,) measure, print on the main process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    refuse_reference_beside(world, args)
    set_inductor_options(args.inductor)
    config, setting = plan_setting(args, world)
    if not Path(config.train.cache).is_dir():
        if world > 1:
            raise SystemExit(
                "under a launcher, pass --workdir with a cache this script wrote (or start it plainly)"
            )
        write_cache(config, setting)
    rows = measure(config, setting, args)
    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:  # before the reference's part, so that a time limit cutting it leaves pfctl's figures
        report(rows, rows, "pfctl train benchmark", args.json)
    if args.reference is not None:
        theirs = reference_rows(args.reference, config, setting, dict(rows))
        if main_process:
            report(theirs, rows + theirs, "the reference's step, same run", args.json)


def report(shown: list[tuple[str, str]], kept: list[tuple[str, str]], title: str, json_path: str | None) -> None:
    """Print ``shown`` under ``title``; write ``kept`` (every row so far) to ``json_path``."""
    if json_path:
        Path(json_path).write_text(json.dumps(dict(kept), indent=2))
    width_k = max(len(k) for k, _ in shown)
    print(f"\n{title}")
    print("-" * (width_k + 40))
    for key, value in shown:
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
    refuse_reference_beside(nproc, args)
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
