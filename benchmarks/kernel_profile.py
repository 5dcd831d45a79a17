"""GPU kernel time of a piece of work, by kind: what the benchmarks' ``--profile`` options print.

One profiler pass (CUDA activity only, so the host-side cost of profiling stays small) over ``repeats``
calls; kernels are sorted into kinds by name (first match wins), the GPU's busy time is the union of the
kernels' intervals, and the costliest kernels are listed by name. The host's own work in a profiled step
is its CPU time less the calls that wait for the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

KERNEL_KINDS = (  # (kind, name fragments), first match wins; the rest is "other"
    ("attention", ("fmha", "sdpa", "flash", "attention")),
    ("convolution", ("implicit_gemm", "conv")),  # (cuDNN's convolutions are named cudnn too: not attention)
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("optimizer", ("adam", "multi_tensor")),
    ("compiled (inductor)", ("triton",)),
    ("elementwise", ("elementwise", "vectorized")),
    ("reduction", ("reduce", "norm")),
    ("copy", ("copy", "cat", "fill")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name."""
    name = name.lower()
    return next((k for k, parts in KERNEL_KINDS if any(p in name for p in parts)), "other")


def kernel_breakdown(fn: Callable[[], object], repeats: int = 2, top: int = 0) -> dict:
    """Profile ``repeats`` calls of ``fn`` on CUDA: wall and GPU busy time, kernel time by kind (and the
    ``top`` costliest kernels by name), per call."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        ms = e.time_range.elapsed_us() / 1e3 / repeats
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        entry = by_name.setdefault(e.name, [kind, 0.0, 0])
        entry[1] += ms
        entry[2] += 1
    costliest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "wall_ms": 1e3 * wall / repeats,
        "gpu_busy_ms": 1e3 * gpu_busy_seconds(kernels) / repeats,
        "kernels_per_call": len(kernels) / repeats,
        "kernel_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {"kernel": name[:100], "kind": kind, "ms": ms, "launches": n // repeats}
            for name, (kind, ms, n) in costliest
        ],
    }


def gpu_busy_seconds(events: Iterable) -> float:
    """Seconds in which at least one GPU kernel or copy ran: the union of the profiler's device events'
    intervals (overlapping streams and nested events count once; host events not at all)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, reached = 0.0, float("-inf")
    for start, end in spans:
        if end > reached:
            busy_us += end - max(start, reached)
            reached = end
    return busy_us / 1e6


# the host calls that wait for the GPU: syncs, device-to-host copies, and a launch into a full queue
GPU_WAITS = (
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
    "cudaMemcpy", "Command Buffer Full",
)  # fmt: skip


def host_work_seconds(events: Iterable) -> float:
    """Seconds the host's threads spent in a profiled step's own work: every CPU event's self time, less the
    calls that wait for the GPU (:data:`GPU_WAITS`)."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    return sum(e.self_cpu_time_total for e in cpu if e.name not in GPU_WAITS) / 1e6


def print_breakdown(label: str, profile: dict) -> None:
    """A few lines: busy vs wall, time by kind, then the costliest kernels."""
    kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in profile["kernel_ms_by_kind"].items())
    print(
        f"{label}: wall {profile['wall_ms']:.1f} ms, GPU busy {profile['gpu_busy_ms']:.1f} ms, "
        f"{profile['kernels_per_call']:.0f} kernels; ms by kind: {kinds}"
    )
    for row in profile["top_kernels"]:
        print(f"  {row['ms']:9.1f} ms {row['launches']:>7} x  [{row['kind']}] {row['kernel']}")
