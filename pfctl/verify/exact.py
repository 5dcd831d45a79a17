"""Exact chunked encoding for VAEs whose GroupNorms take statistics over time.

Why: chunked ("framewise") encoding with a causal-conv cache is exact for every op except a norm whose
reduction spans T. Such a norm needs the statistics of the *whole* clip at its own depth, which exist only
after every chunk has reached it. The schedule here is layer-synchronous (SPEC-verify-groupnorm §5 (a)):

- every chunk runs up to the next time-coupled GroupNorm and stops there;
- pass A: each chunk adds its per-(sample, group) sums (N, Σx, Σx²) in float64 — fp32 Σx² cancels
  catastrophically at N≈10⁸ — and, on several processes, one all-reduce of those O(G) numbers replaces
  gathering the activations (``reduce_fn``);
- pass B: each chunk normalises with the global mean and variance and runs on to the next norm.

Chunks are cooperatively scheduled threads, exactly one running at a time (lowest index first), so the
library's own forward code runs unchanged; only GroupNorm and causal-conv padding are routed through the
engine. Causal convs get their left context from the previous chunk (the frames of the padded input the
previous chunk did not consume), which is what the full-sequence pass sees. What stays in memory at a norm
boundary is one activation per chunk (plus what the library's frames hold, e.g. residuals) — the same
order as one norm input of the full pass, but never the full pass's stack of temporaries.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ReduceFn = Callable[[torch.Tensor], torch.Tensor]
"""Reduces stacked per-group statistics (3, B, G) float64 = (N, Σx, Σx²) across processes (sum)."""


# ---------------------------------------------------------------------------------------- statistics
def group_sums(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(N, Σx, Σx²) per (sample, group) of a (B, C, …) tensor, stacked as (3, B, G) float64."""
    B = x.shape[0]
    xg = x.reshape(B, num_groups, -1).to(torch.float64)
    n = torch.full((B, num_groups), float(xg.shape[-1]), dtype=torch.float64, device=x.device)
    return torch.stack([n, xg.sum(-1), (xg * xg).sum(-1)])


def sums_to_mean_var(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and (biased) variance from summed (N, Σx, Σx²)."""
    n, s1, s2 = stats
    mean = s1 / n
    var = (s2 / n - mean * mean).clamp_min(0.0)
    return mean, var


def chan_merge(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge (N, mean, M2) of two disjoint parts (Chan et al.): M2 = M2_a + M2_b + δ²·N_a·N_b/N.

    The alternative to float64 sums when accumulating in lower precision: it never forms Σx² − N·μ².
    """
    na, ma, m2a = a
    nb, mb, m2b = b
    n = na + nb
    delta = mb - ma
    mean = ma + delta * nb / n
    m2 = m2a + m2b + delta * delta * na * nb / n
    return n, mean, m2


def group_norm_with_stats(
    x: torch.Tensor, module: nn.GroupNorm, mean: torch.Tensor, var: torch.Tensor
) -> torch.Tensor:
    """Apply ``module`` (an nn.GroupNorm) to ``x`` with given per-(sample, group) statistics."""
    B, C = x.shape[:2]
    G = module.num_groups
    rstd = torch.rsqrt(var + module.eps).to(torch.float32)
    xg = x.reshape(B, G, -1).to(torch.float32)
    y = ((xg - mean.to(torch.float32)[..., None]) * rstd[..., None]).reshape(x.shape)
    if module.affine:
        shape = (1, C) + (1,) * (x.ndim - 2)
        y = y * module.weight.to(torch.float32).view(shape) + module.bias.to(torch.float32).view(shape)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------- allocator
_MALLOC_TUNED = [False]


def tune_malloc_for_threads() -> bool:
    """glibc only: one malloc arena and a fixed 128 KiB mmap threshold, process-wide, once.

    Why: each chunk runs in its own (short-lived) thread; with per-thread arenas and the dynamic mmap
    threshold, memory a chunk frees stays cached in *its* arena and the resident set grows with the number
    of chunks although the live tensors do not. Only one chunk computes at a time, so a single arena costs
    no contention. Returns False where this is not glibc.
    """
    if _MALLOC_TUNED[0]:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-8, 1) == 1  # M_ARENA_MAX
        ok = libc.mallopt(-3, 128 * 1024) == 1 and ok  # M_MMAP_THRESHOLD (disables the dynamic one)
    except (OSError, AttributeError):
        return False
    _MALLOC_TUNED[0] = ok
    return ok


# ---------------------------------------------------------------------------------------- engine
class _Abort(Exception):
    """Raised in a chunk thread when another chunk failed (the real error is re-raised by run())."""


@dataclass
class _Barrier:
    arrived: int = 0
    sums: torch.Tensor | None = None
    stats: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class HaloExchange:
    """Causal-conv context across process boundaries (contiguous time shards, rank order = time order).

    ``recv(key)`` returns the previous rank's leftover padded frames for conv call ``key``;
    ``send(key, tensor)`` hands this rank's leftover to the next rank. Either may be None on the
    first/last rank.
    """

    recv: Callable[[str], torch.Tensor] | None = None
    send: Callable[[str, torch.Tensor], None] | None = None


class LayerSyncEngine:
    """Runs K chunk forwards as cooperatively scheduled threads that meet at every time-coupled norm."""

    def __init__(
        self,
        num_chunks: int,
        *,
        reduce_fn: ReduceFn | None = None,
        halo: HaloExchange | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if num_chunks < 1:
            raise ValueError("need at least one chunk")
        self.n = num_chunks
        self.reduce_fn = reduce_fn
        self.halo = halo or HaloExchange()
        self.timeout_s = timeout_s
        self.cv = threading.Condition()
        self.turn: int | None = None
        self.state = ["new"] * num_chunks
        self.preds: list[Callable[[], bool] | None] = [None] * num_chunks
        self.barriers: dict[str, _Barrier] = {}
        self.carries: dict[tuple[str, int], torch.Tensor] = {}
        self.error: BaseException | None = None
        self.local = threading.local()
        self.num_barriers = 0
        self.held_bytes = 0
        self.peak_held_bytes = 0

    # -- scheduling (callers hold self.cv)
    def _switch(self) -> None:
        for i in range(self.n):
            s = self.state[i]
            if s == "new" or (s == "waiting" and self.preds[i] is not None and self.preds[i]()):
                self.turn = i
                self.cv.notify_all()
                return
        self.turn = None
        if any(s != "done" for s in self.state) and self.error is None:
            self.error = RuntimeError(
                "layer-synchronous encode deadlocked (chunks disagree on the layers run)"
            )
        self.cv.notify_all()

    def _wait_turn(self, k: int) -> None:
        if not self.cv.wait_for(lambda: self.turn == k or self.error is not None, timeout=self.timeout_s):
            self.error = self.error or TimeoutError("layer-synchronous encode timed out")
        if self.error is not None:
            raise _Abort
        self.state[k] = "running"

    def _block(self, pred: Callable[[], bool]) -> None:
        k = self.local.k
        with self.cv:
            self.state[k] = "waiting"
            self.preds[k] = pred
            self._switch()
            self._wait_turn(k)
            self.preds[k] = None

    def _next_key(self, name: str) -> str:
        calls = self.local.calls
        idx = calls[name]
        calls[name] = idx + 1
        return f"{name}#{idx}"

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    # -- the two synchronisation points
    def group_norm(self, name: str, module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        """GroupNorm over the whole (possibly multi-process) clip, called from inside one chunk."""
        key = self._next_key(name)
        barrier = self.barriers.setdefault(key, _Barrier())
        sums = group_sums(x, module.num_groups)
        barrier.sums = sums if barrier.sums is None else barrier.sums + sums
        barrier.arrived += 1
        nbytes = x.numel() * x.element_size()
        self._hold(nbytes)
        if barrier.arrived == self.n:
            total = barrier.sums
            if self.reduce_fn is not None:
                total = self.reduce_fn(total)
            barrier.stats = sums_to_mean_var(total)
            barrier.sums = None
            self.num_barriers += 1
        self._block(lambda: barrier.stats is not None)
        self.held_bytes -= nbytes
        mean, var = barrier.stats
        return group_norm_with_stats(x, module, mean, var)

    def causal_input(
        self,
        name: str,
        x: torch.Tensor,
        kernel_t: int,
        stride_t: int,
        pad_first: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The time-padded input of a causal conv for this chunk, equal to the full pass's window.

        The first chunk of the clip pads as the model does (``pad_first``); later chunks prepend the
        frames of the previous chunk's padded input that its strided windows did not consume.
        """
        k = self.local.k
        key = self._next_key(name)
        if k == 0:
            if self.halo.recv is None:
                padded = pad_first(x)
            else:
                padded = torch.cat([self.halo.recv(key).to(x), x], dim=2)
        else:
            self._block(lambda: (key, k - 1) in self.carries)
            prev = self.carries.pop((key, k - 1))
            self.held_bytes -= prev.numel() * prev.element_size()
            padded = torch.cat([prev, x], dim=2)
        length = padded.shape[2]
        n_out = (length - kernel_t) // stride_t + 1 if length >= kernel_t else 0
        carry = padded[:, :, n_out * stride_t :].clone()
        if k < self.n - 1:
            self.carries[(key, k)] = carry
            self._hold(carry.numel() * carry.element_size())
        elif self.halo.send is not None:
            self.halo.send(key, carry)
        return padded

    # -- driver
    def run(self, chunk_fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run every chunk function to completion; return their results in chunk order."""
        if len(chunk_fns) != self.n:
            raise ValueError("one function per chunk")
        results: list[Any] = [None] * self.n
        grad = torch.is_grad_enabled()
        if self.n > 1:
            tune_malloc_for_threads()

        def body(k: int) -> None:
            self.local.k = k
            self.local.calls = defaultdict(int)
            try:
                with self.cv:
                    self._wait_turn(k)
                with torch.set_grad_enabled(grad):
                    results[k] = chunk_fns[k]()
            except _Abort:
                pass
            except BaseException as exc:
                with self.cv:
                    self.error = self.error or exc
                    self.cv.notify_all()
            finally:
                with self.cv:
                    self.state[k] = "done"
                    self._switch()

        threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(self.n)]
        for t in threads:
            t.start()
        with self.cv:
            self._switch()
        for t in threads:
            t.join()
        if self.error is not None:
            raise self.error
        return results


# ---------------------------------------------------------------------------------------- patching
class _Patched:
    """Temporarily replace ``forward`` of some modules (instance attribute; restored on exit)."""

    def __init__(self, pairs: Sequence[tuple[nn.Module, Callable[..., Any]]]) -> None:
        self.pairs = list(pairs)

    def __enter__(self) -> _Patched:
        for mod, fn in self.pairs:
            mod.__dict__["forward"] = fn
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, _ in self.pairs:
            mod.__dict__.pop("forward", None)


def group_norm_patches(root: nn.Module, engine: LayerSyncEngine) -> list[tuple[nn.Module, Callable]]:
    """Route every nn.GroupNorm under ``root`` that receives a video tensor (5D) through the engine.

    4D/3D inputs (time folded into the batch) are per-frame already and keep the library's forward, and
    so do GroupNorm subclasses that override ``forward``.
    """
    pairs = []
    for name, mod in root.named_modules():
        # subclasses with their own forward (e.g. a GroupNorm that folds T into the batch) keep it
        if isinstance(mod, nn.GroupNorm) and type(mod).forward is nn.GroupNorm.forward:

            def fwd(x: torch.Tensor, _m: nn.GroupNorm = mod, _n: str = name) -> torch.Tensor:
                if x.ndim == 5:
                    return engine.group_norm(_n, _m, x)
                return nn.GroupNorm.forward(_m, x)

            pairs.append((mod, fwd))
    return pairs


@dataclass
class ExactResult:
    """Output of the exact chunked encode and what it cost."""

    moments: torch.Tensor
    plan: list[int]
    num_barriers: int
    peak_held_bytes: int
    notes: list[str] = field(default_factory=list)


def layer_synchronous_forward(
    x: torch.Tensor,
    plan: Sequence[int],
    chunk_fn: Callable[[torch.Tensor], torch.Tensor],
    norm_root: nn.Module,
    extra_patches: Callable[[LayerSyncEngine], list[tuple[nn.Module, Callable]]] | None = None,
    *,
    reduce_fn: ReduceFn | None = None,
    halo: HaloExchange | None = None,
) -> ExactResult:
    """Generic driver: split ``x`` on time by ``plan``, run ``chunk_fn`` per chunk layer-synchronously,
    concatenate the outputs on time."""
    if sum(plan) != x.shape[2]:
        raise ValueError(f"chunk plan {list(plan)} does not add up to {x.shape[2]} frames")
    starts = [sum(plan[:i]) for i in range(len(plan))]
    chunks = [x[:, :, s : s + n] for s, n in zip(starts, plan, strict=True)]
    engine = LayerSyncEngine(len(plan), reduce_fn=reduce_fn, halo=halo)
    pairs = group_norm_patches(norm_root, engine)
    if extra_patches is not None:
        pairs += extra_patches(engine)
    with _Patched(pairs):
        outs = engine.run([lambda c=c: chunk_fn(c) for c in chunks])
    return ExactResult(
        moments=torch.cat(outs, dim=2),
        plan=list(plan),
        num_barriers=engine.num_barriers,
        peak_held_bytes=engine.peak_held_bytes,
    )


def exact_chunked_encode(
    vae: Any,
    video: torch.Tensor,
    plan: Sequence[int],
    *,
    reduce_fn: ReduceFn | None = None,
    halo: HaloExchange | None = None,
) -> ExactResult:
    """Encoder moments of ``video`` equal to the one-call encode, computed chunk by chunk.

    ``vae`` is an adapter offering ``exact_chunk_fn()`` (encoder on one chunk, no library cache) and
    ``exact_patches(engine)`` (its causal convs routed through the engine), e.g.
    :class:`pfctl.models.diffusers_vae.DiffusersVideoVAE` for CogVideoX. On several processes, give each
    rank its contiguous time shard, ``reduce_fn`` (sum-all-reduce of the (3, B, G) float64 statistics)
    and ``halo`` (previous/next rank's causal-conv context).
    """
    module = vae.module
    root = getattr(module, "encoder", module)
    p = next(module.parameters())
    x = video.to(device=p.device, dtype=p.dtype)
    with torch.no_grad():
        return layer_synchronous_forward(
            x, plan, vae.exact_chunk_fn(), root, vae.exact_patches, reduce_fn=reduce_fn, halo=halo
        )
