"""The report of ``bench_train.py``: the figures of the timed steps (each the slowest process's, or the mean over
processes for tokens), the reference's step beside them, and how a warm-up's end is found."""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench_train import Setting, Timings

PEAK_BF16 = {"H200": 790e12, "H100": 989.5e12, "A100": 312e12}
"""Dense bf16 matrix-product rates: the H200 figure is the one measured on the benchmark machine
(a large bf16 matmul), not the datasheet 989.5 TFLOP/s."""
STEADY_WINDOW, STEADY_WITHIN = 5, 0.10


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


@dataclass(frozen=True)
class Profiled:
    """The step run under the profiler (``--profile``, CUDA): its time, the GPU's busy time, and the host's own
    work in it, less its waits for the GPU (seconds)."""

    wall_s: float
    gpu_busy_s: float
    host_work_s: float


@dataclass
class Measured:
    """What one process measured (:func:`measure`), for :func:`report_rows`."""

    t: Timings
    params: int
    recomputed: int
    checkpoint_s: float
    written_s: float
    rss_gib: float | None  # the CPU: the process's peak resident set
    device_name: str
    world: int
    precision: str
    cfg: Any  # the trainer's settled train config
    profiled: Profiled | None = None


def report_rows(run: Measured, config: Any, setting: Setting, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The report: the run's setting, then its figures over the timed steps (each the slowest process's, or
    the mean across processes for tokens)."""
    t, cfg = run.t, run.cfg
    step_max = across_processes(t.step, "max")
    host_max = across_processes([h - w for h, w in zip(t.host, t.wait, strict=True)], "max")
    load_max = across_processes(t.load, "max")
    tokens = across_processes([float(x) for x in t.tokens], "mean")
    analytic = across_processes(t.analytic, "mean")
    timed = range(setting.warmup, len(t.step))
    if setting.cuda:  # the trainer resets the peak after every step: the maximum of the steps' peaks
        peaks = across_processes(t.peak, "max")
        warm = max(peaks[: setting.warmup], default=0.0)
        peak = f"{max(peaks[i] for i in timed):.2f} GiB allocated ({warm:.2f} in the warm-up)"
        reserved = across_processes(t.reserved[-1:], "max")[0]
        peak += f"; {reserved:.2f} GiB reserved at the end (CUDA graphs keep their pool reserved, not allocated)"
    else:
        peak = f"{across_processes([run.rss_gib], 'max')[0]:.2f} GiB RSS"
    step_s = statistics.median(step_max[i] for i in timed)
    seconds = sum(step_max[i] for i in timed)
    tok_s = sum(tokens[i] for i in timed) / seconds
    steady_step, steady_s = time_to_steady(step_max, step_s)
    rate = next((v for k, v in PEAK_BF16.items() if k in run.device_name), None) if setting.cuda else None

    def util(flops_per_token: float) -> str:
        achieved = flops_per_token * tok_s
        return (
            f"{achieved / rate:.1%} of {rate / 1e12:.0f} TFLOP/s bf16 dense"
            if rate
            else f"n/a ({achieved / 1e12:.3g} TFLOP/s, no peak rate known)"
        )

    params, recomputed = run.params, run.recomputed
    checkpoint = f"{run.checkpoint_s:.2f} s in the loop, written after {run.written_s:.2f} s"
    return [
        ("device", f"{run.device_name} x {run.world}"),
        ("recipe", args.recipe or "(built-in)"),
        ("overrides", " ".join(args.overrides) or "-"),
        ("inductor options", " ".join(args.inductor) or "-"),
        ("model / params", f"{config.model.dit_preset or config.model.path} / {params / 1e6:.1f} M"),
        ("latents (T x H x W)", f"{setting.frames} x {setting.height} x {setting.width}"),
        ("batch per rank", f"{cfg.batch_size} clips x {cfg.grad_accum} micro-steps, sync group {cfg.video_sync_group}"),
        ("precision", run.precision),
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
        ("profiled step (--profile)", profiled_row(run.profiled) if setting.cuda else "n/a (CUDA only)"),
        ("batch loading / step (host)", f"{statistics.median(load_max[i] for i in timed) * 1e3:.1f} ms"),
        ("Python GC: step 1 / rest of warm-up / timed", gc_row(t, setting.warmup)),
        ("blocking host syncs / step", sync_row(t.syncs)),
        ("peak memory (timed steps)", peak),
        ("checkpoint save (not timed above)", "skipped (--no-checkpoint)" if args.no_checkpoint else checkpoint),
        ("last loss", f"{t.metrics['loss']:.4f}"),
        ("step times (s, in order)", " ".join(f"{x:.2f}" for x in step_max)),
        ("CUDA graphs in the timed steps", graph_row(t, setting.warmup)),
    ]  # fmt: skip


def profiled_row(profiled: Profiled | None) -> str:
    """The profiled step's GPU busy share, and the host's own work against the GPU's busy time."""
    if profiled is None:
        return "not profiled"
    busy, work = profiled.gpu_busy_s, profiled.host_work_s
    return (
        f"{profiled.wall_s * 1e3:.1f} ms, the GPU busy {busy / profiled.wall_s:.0%}; the host's own work "
        f"(less its waits for the GPU) {work * 1e3:.1f} ms, {work / busy:.0%} of the GPU's busy time"
    )


def graph_row(t: Timings, warmup: int) -> str:
    """The graph trees' calls in the timed steps by outcome (this process; every one a replay when all is well),
    and the steps in which any call was not; under ``train.cuda_graphs=step``, the step graphs' calls and
    replays."""
    from graph_events import describe

    if t.step_graphs:
        return step_graph_row(t.step_graphs, warmup)
    total = sum(t.graphs[warmup:], collections.Counter())
    if not total:
        return "none (no CUDA graphs)"
    off = [i + 1 for i in range(warmup, len(t.graphs)) if t.graphs[i]["replayed"] != t.graphs[i]["calls"]]
    return describe(total) + (f"; steps with calls not replayed: {' '.join(map(str, off))}" if off else "")


def step_graph_row(counts: list[tuple[int, int]], warmup: int) -> str:
    """The step graphs' calls in the timed steps and how many were replays (``counts``: the running totals
    after each step), and the steps that ran any call eagerly."""
    before = counts[warmup - 1] if warmup else (0, 0)
    calls, replays = (counts[-1][k] - before[k] for k in (0, 1))
    totals = [before, *counts[warmup:]]
    eager = [warmup + i + 1 for i, (a, b) in enumerate(itertools.pairwise(totals)) if b[0] - a[0] != b[1] - a[1]]
    line = f"the whole step: {calls} calls, {replays} replayed"
    return line + (f"; steps with eager calls: {' '.join(map(str, eager))}" if eager else "")


def sync_row(sites: list[str] | None) -> str:
    """How many times a warm-up step made the host wait for the GPU, and where (each site once, with its
    count)."""
    if sites is None:
        return "n/a (counted on CUDA, in a warm-up step)"
    if not sites:
        return "0"
    where = ", ".join(f"{site} x{n}" if n > 1 else site for site, n in collections.Counter(sites).items())
    return f"{len(sites)} ({where})"


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
    import bench_reference as br
    import torch
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
