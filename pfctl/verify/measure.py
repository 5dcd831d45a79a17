"""Numbers for verify-groupnorm: per-layer statistics drift, latent and decoded errors, flicker at chunk
boundaries, peak memory. Pure functions of tensors (plus one hook context), so they are testable on toys.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pfctl.models.exact_chunked import chan_merge


# ---------------------------------------------------------------------------------------- GN statistics
@dataclass
class CallStats:
    """Statistics one GroupNorm call used: per (sample, group) count, mean, variance (float64)."""

    count: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor


@contextlib.contextmanager
def capture_group_stats(root: nn.Module) -> Iterator[dict[str, list[CallStats]]]:
    """Record, for every nn.GroupNorm under ``root`` that receives a 5D tensor, the statistics of each call."""
    records: dict[str, list[CallStats]] = {}
    handles = []
    current: list[str | None] = [None]

    def record(name: str, x: torch.Tensor, groups: int) -> None:
        xg = x.detach().reshape(x.shape[0], groups, -1).to(torch.float64)
        var, mean = torch.var_mean(xg, dim=-1, correction=0)
        count = torch.full_like(mean, float(xg.shape[-1]))
        records.setdefault(name, []).append(CallStats(count.cpu(), mean.cpu(), var.cpu()))

    for name, mod in root.named_modules():
        if isinstance(mod, nn.GroupNorm):
            plain = type(mod).forward is nn.GroupNorm.forward

            def pre(m: nn.GroupNorm, args: tuple, _n: str = name, _plain: bool = plain) -> None:
                if _plain:  # stats of what the module normalises (also under the exact engine's patch)
                    if args[0].ndim == 5:
                        record(_n, args[0], m.num_groups)
                else:  # a subclass may fold time away first: look at what reaches F.group_norm
                    current[0] = _n

            def post(m: nn.Module, args: tuple, out: Any) -> None:
                current[0] = None

            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post))
    original = F.group_norm

    def group_norm(x: torch.Tensor, num_groups: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        if current[0] is not None and x.ndim == 5:
            record(current[0], x, num_groups)
        return original(x, num_groups, *args, **kwargs)

    F.group_norm = group_norm
    try:
        yield records
    finally:
        F.group_norm = original
        for h in handles:
            h.remove()


def merge_calls(calls: Sequence[CallStats]) -> CallStats:
    """Whole-clip statistics from the calls of a pass that covered the clip in pieces (Chan merge)."""
    n, mean, m2 = calls[0].count, calls[0].mean, calls[0].var * calls[0].count
    for c in calls[1:]:
        n, mean, m2 = chan_merge((n, mean, m2), (c.count, c.mean, c.var * c.count))
    return CallStats(n, mean, m2 / n)


@dataclass
class LayerDrift:
    name: str
    chunks: int
    d_mu_max: float
    d_mu_p95: float
    d_sigma_max: float
    d_sigma_p95: float


def _p95(t: torch.Tensor) -> float:
    return float(torch.quantile(t.flatten().to(torch.float64), 0.95)) if t.numel() else 0.0


def layer_drift(
    full: dict[str, list[CallStats]],
    chunked: dict[str, list[CallStats]],
    eps: dict[str, float] | float = 1e-6,
) -> list[LayerDrift]:
    """Per layer and over (chunk, sample, group): d_mu = |mu_k - mu| / sigma, d_sigma = |ln(sigma_k / sigma)|.

    mu, sigma come from the full pass at that layer; mu_k, sigma_k are what chunk k's call actually used
    (so the drift of deep layers includes what earlier layers already changed). sigma includes the
    norm's eps, as the norm itself does. Layers keep the full pass's execution order.
    """
    out = []
    for name, calls in full.items():
        if name not in chunked:
            continue
        e = eps[name] if isinstance(eps, dict) else eps
        ref = merge_calls(calls)
        sigma = torch.sqrt(ref.var + e)
        d_mu = torch.stack([(c.mean - ref.mean).abs() / sigma for c in chunked[name]])
        d_sigma = torch.stack([(torch.log(torch.sqrt(c.var + e) / sigma)).abs() for c in chunked[name]])
        out.append(
            LayerDrift(
                name=name,
                chunks=len(chunked[name]),
                d_mu_max=float(d_mu.max()),
                d_mu_p95=_p95(d_mu),
                d_sigma_max=float(d_sigma.max()),
                d_sigma_p95=_p95(d_sigma),
            )
        )
    return out


def group_norm_eps(root: nn.Module) -> dict[str, float]:
    return {n: float(m.eps) for n, m in root.named_modules() if isinstance(m, nn.GroupNorm)}


# ---------------------------------------------------------------------------------------- latent / pixels
def latent_metrics(ref: torch.Tensor, out: torch.Tensor) -> dict[str, Any]:
    """Errors of posterior means ``out`` against ``ref`` (B, C, t, h, w), all float64."""
    ref = ref.detach().to(torch.float64).cpu()
    out = out.detach().to(torch.float64).cpu()
    if ref.shape != out.shape:
        raise ValueError(f"latent shapes differ: {tuple(ref.shape)} vs {tuple(out.shape)}")
    diff = out - ref
    ref_norm = float(ref.norm()) or 1.0
    per_frame = []
    for t in range(ref.shape[2]):
        denom = float(ref[:, :, t].norm()) or 1.0
        per_frame.append(float(diff[:, :, t].norm()) / denom)
    dims = (0, 2, 3, 4)
    std = ref.std(dim=dims).clamp_min(1e-12)
    mean_shift = ((out.mean(dim=dims) - ref.mean(dim=dims)).abs() / std).tolist()
    std_shift = ((out.std(dim=dims) - ref.std(dim=dims)).abs() / std).tolist()
    return {
        "max_abs": float(diff.abs().max()),
        "mean_abs": float(diff.abs().mean()),
        "rel_l2": float(diff.norm()) / ref_norm,
        "per_frame_rel_l2": per_frame,
        "channel_mean_shift": mean_shift,
        "channel_std_shift": std_shift,
    }


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 2.0) -> float:
    """PSNR in dB for videos in [-1, 1] (range 2); +inf when identical."""
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


def boundaries(plan: Sequence[int]) -> list[int]:
    """Frame indices where a new chunk starts (excluding 0)."""
    out, pos = [], 0
    for n in plan[:-1]:
        pos += n
        out.append(pos)
    return out


def flicker_score(full: torch.Tensor, chunked: torch.Tensor, plan: Sequence[int]) -> float | None:
    """Mean step of the per-frame mean-luminance *error* at chunk boundaries ÷ mean step within chunks.

    Measured on the error signal e_t = lum(chunked_t) - lum(full_t), so the clip's own fades and cuts
    do not count. ~1 means no seam; ≫1 means a brightness jump every chunk. None when there is no
    error to speak of (|e| < 1e-6) or no boundary.
    """
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64).view(1, 3, 1, 1, 1)
    lum = lambda v: (v.double().cpu() * weights).sum(1).mean(dim=(0, 2, 3))  # noqa: E731
    e = lum(chunked) - lum(full)
    bnd = [b for b in boundaries(plan) if 0 < b < e.shape[0]]
    if not bnd or float(e.abs().max()) < 1e-6:
        return None
    steps = (e[1:] - e[:-1]).abs()  # steps[t-1] = |e_t - e_{t-1}|
    at = torch.tensor([b - 1 for b in bnd])
    mask = torch.ones_like(steps, dtype=torch.bool)
    mask[at] = False
    within = float(steps[mask].mean()) if mask.any() else 0.0
    across = float(steps[at].mean())
    return across / max(within, 1e-12)


# ---------------------------------------------------------------------------------------- memory
class _MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc's struct mallinfo2 (all size_t)
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _heap_in_use_reader() -> Callable[[], int] | None:
    """A function returning the bytes glibc's malloc has handed out and not had back (in-use chunks of
    every arena plus mmapped blocks), or None where that is not available (not glibc ≥ 2.33).

    PyTorch's CPU allocator takes every tensor's memory from malloc and returns it on free, so this is
    the bytes of live tensors (plus the interpreter's small objects), whatever the operating system does
    with freed pages — unlike the resident set.
    """
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return read


#: a reading of malloc's statistics slower than this (a fragmented heap: a long-lived process) is not repeated
#: thousands of times: the CPU peak is then not measured (a young process reads it in ~0.2 ms)
SLOW_HEAP_READ_S = 0.005


def peak_memory(
    fn: Callable[[], Any], device: torch.device | str, module: nn.Module
) -> tuple[int | None, str]:
    """Peak memory allocated while ``fn()`` runs above what was allocated before, and how it was measured.

    CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's own statistics). CPU (glibc):
    malloc's bytes in use, read at the entry and exit of every module under ``module`` (forward hooks
    fire in whatever thread runs the module, so chunks run by the exact engine count too) and, for the
    temporaries inside one operator (a convolution's column buffer), every 0.2 ms by a sampling thread
    while operators run without the GIL; the peak is the largest reading. Both count allocations, not
    pages. Not measured (None, and the reason) where there are no such statistics, or where one reading
    takes longer than :data:`SLOW_HEAP_READ_S` (it walks the free blocks of the heap: a fragmented heap of a
    long-lived process made a measurement take minutes).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        return peak, "torch.cuda.max_memory_allocated above the allocation before the call"
    read = _heap_in_use_reader()
    if read is None:
        fn()
        return None, "not measured (needs glibc malloc statistics or CUDA)"
    gc.collect()
    took = []
    for _ in range(2):  # the faster of two: one reading held up by the scheduler is not a fragmented heap
        tic = time.perf_counter()
        base = read()
        took.append(time.perf_counter() - tic)
    if min(took) > SLOW_HEAP_READ_S:
        fn()
        return None, (
            f"not measured: one reading of malloc's statistics took {min(took) * 1e3:.0f} ms in this process "
            "(it walks every free block of a fragmented heap, and thousands are needed); a fresh process "
            "reads it in well under a millisecond (the pfctl verify-groupnorm command is one)"
        )
    peak = [base]
    lock = threading.Lock()
    stop = threading.Event()

    def sample(*_: Any) -> None:
        value = read()
        with lock:
            peak[0] = max(peak[0], value)

    def sampler() -> None:
        while not stop.wait(0.0002):
            sample()

    handles = []
    for mod in module.modules():
        handles += [mod.register_forward_pre_hook(sample), mod.register_forward_hook(sample)]
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        fn()
        sample()
    finally:
        stop.set()
        thread.join()
        for h in handles:
            h.remove()
    return peak[0] - base, "malloc bytes in use above the start (glibc mallinfo2, sampled)"
