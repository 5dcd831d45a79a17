"""Exact chunked encoding for VAEs whose GroupNorms take statistics over time.

Why: chunked ("framewise") encoding with a causal-conv cache is exact for every op except a norm whose
reduction spans T. Such a norm needs the statistics of the *whole* clip at its own depth, which exist only
after every chunk has reached it. The schedule here (``exact_schedule="parked"``) is layer-synchronous
(SPEC-verify-groupnorm §5 (a)); :mod:`pfctl.models.exact_recompute` (``"recompute"``, the default) reuses
its statistics and normalisation but recomputes instead of parking. The parked schedule:

- every chunk runs up to the next time-coupled GroupNorm and stops there;
- pass A: each chunk adds its per-(sample, group) sums (N, Σx, Σx²) in float64 — built from fp32 Welford
  means and centred M2 per slice, as an fp32 Σx² cancels catastrophically at N≈10⁸ — and, on several
  processes, one all-reduce of those O(G) numbers replaces gathering the activations (``reduce_fn``);
- pass B: each chunk normalises with the global mean and variance and runs on to the next norm.

Both passes work slice by slice (a few frames or rows at a time), so their fp32 temporaries stay a fixed
size whatever the chunk's.

Chunks are cooperatively scheduled threads, exactly one running at a time (lowest index first), so the
library's own forward code runs unchanged; only GroupNorm and causal-conv padding are routed through the
engine. Causal convs get their left context from the previous chunk (the frames of the padded input the
previous chunk did not consume), which is what the full-sequence pass sees. What stays in memory at a norm
boundary is one activation per chunk (plus what the library's frames hold, e.g. residuals) — the same
order as one norm input of the full pass, but never the full pass's stack of temporaries. With
``offload_above`` the parked norm inputs beyond a byte budget wait in host memory instead, and the next one
to resume is copied back on a side stream while the chunk before it computes.
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
SLICE_ELEMENTS = 1 << 24
"""Elements per slice in the statistics and normalisation loops: what bounds their temporaries
(64 MiB in fp32) whatever the size of the chunk."""


def _slices(x: torch.Tensor) -> list[tuple[slice, slice]]:
    """(time, height) index ranges that cut a (B, C, T, H, …) tensor into pieces of at most
    :data:`SLICE_ELEMENTS` elements (one row of every frame at least)."""
    max_elements = SLICE_ELEMENTS
    T, H = x.shape[2], x.shape[3]
    row = x[:, :, :1, :1].numel()
    if row * H <= max_elements:
        step = max(1, max_elements // (row * H))
        return [(slice(t, t + step), slice(None)) for t in range(0, T, step)]
    step = max(1, max_elements // row)
    return [(slice(t, t + 1), slice(h, h + step)) for t in range(T) for h in range(0, H, step)]


def group_sums(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(N, Σx, Σx²) per (sample, group) of a (B, C, T, H, …) tensor, stacked as (3, B, G) float64.

    Slice by slice (:func:`_slices`): a mean and a centred sum of squares M2 per slice in fp32 (Welford, so
    no cancellation; float64 for float64 input), merged in float64 — the only temporary is one slice in
    fp32. Σx² = M2 + N·mean² is formed in float64, where turning it back into a variance loses nothing.
    """
    B, G = x.shape[0], num_groups
    dtype = torch.promote_types(x.dtype, torch.float32)
    means, m2s, counts = [], [], []
    for ts, hs in _slices(x):
        xg = x[:, :, ts, hs].to(dtype).unflatten(1, (G, -1))
        var, mean = torch.var_mean(xg, dim=tuple(range(2, xg.ndim)), correction=0)
        counts.append(xg[0, 0].numel())
        means.append(mean)
        m2s.append(var * counts[-1])
    ns = torch.tensor(counts, dtype=torch.float64).to(x.device, non_blocking=True).view(-1, 1, 1)
    slice_means = torch.stack(means).double()
    n = ns.sum(0).expand(B, G)
    mean = (ns * slice_means).sum(0) / n
    m2 = torch.stack(m2s).double().sum(0) + (ns * (slice_means - mean) ** 2).sum(0)
    return torch.stack([n, n * mean, m2 + n * mean * mean])


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
    """Apply ``module`` (an nn.GroupNorm) to a (B, C, T, H, …) ``x`` with given per-(sample, group)
    statistics; the output has ``x``'s dtype.

    As PyTorch's own kernel does, mean, 1/σ and the affine weights fold into one fp32 scale and shift per
    (sample, channel); ``y = x·scale + shift`` is computed in fp32 slice by slice straight into the output
    (on CUDA without any temporary, on the CPU with one slice-sized one). Inference only: writing into
    the preallocated output is not differentiable.
    """
    B, C = x.shape[:2]
    G = module.num_groups
    rstd = torch.rsqrt(var + module.eps).to(torch.float32).repeat_interleave(C // G, dim=1)
    scale = rstd * module.weight.to(torch.float32) if module.affine else rstd
    shift = -mean.to(torch.float32).repeat_interleave(C // G, dim=1) * scale
    if module.affine:
        shift = shift + module.bias.to(torch.float32)
    bcast = (B, C) + (1,) * (x.ndim - 2)
    scale, shift = scale.view(bcast), shift.view(bcast)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    for ts, hs in _slices(x):
        torch.addcmul(shift, x[:, :, ts, hs], scale, out=y[:, :, ts, hs])
    return y


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


class _HostCopy:
    """A parked activation moved to host memory: its device storage is freed (resized to 0 bytes, so
    every alias of it — the library's own references included — shrinks with it) until ``restore()``.

    On CUDA the copy out runs on a side stream into pinned memory, after the compute stream's pending work
    (which produced the tensor); ``record_stream`` keeps the freed block from being reused before the copy
    has read it, so compute never waits for the copy out. The copy back either runs on the compute stream
    when the chunk resumes (``restore()`` alone), or earlier on a second side stream (``prefetch()``,
    while another chunk computes), and then ``restore()`` only makes the compute stream wait for it.
    """

    def __init__(self, x: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        self.device = x.device
        self.storage = x.untyped_storage()
        self.nbytes = self.storage.nbytes()
        dev = torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.storage)
        self.host: torch.Tensor | None = torch.empty(
            self.nbytes, dtype=torch.uint8, pin_memory=stream is not None
        )
        self.copied: torch.cuda.Event | None = None
        self.restored: torch.cuda.Event | None = None
        self.refilled = False  # the storage has its device memory back and the copy back is issued
        if stream is None:
            self.host.copy_(dev)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.host.copy_(dev, non_blocking=True)
            self.copied = stream.record_event()
            dev.record_stream(stream)
        del dev
        self.storage.resize_(0)

    def _refill(self) -> torch.Tensor:
        """Give the storage its device memory back (allocated for the compute stream, which is the one
        that reads and eventually frees it) and return a byte view of it."""
        self.refilled = True
        self.storage.resize_(self.nbytes)
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.storage)

    def prefetch(self, stream: torch.cuda.Stream | None) -> None:
        """Start the copy back now, on ``stream`` (None: the CPU, copied at once), so that it overlaps with
        whatever the compute stream does until this chunk resumes."""
        if self.refilled:
            return
        dev = self._refill()
        if stream is None:
            dev.copy_(self.host)
            self.host = None
            return
        # The new block may have been freed by compute-stream kernels still queued: write it only after
        # them. And the host buffer holds the data only once the copy out has finished.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.copied is not None:
            stream.wait_event(self.copied)
        with torch.cuda.stream(stream):
            dev.copy_(self.host, non_blocking=True)
        self.restored = stream.record_event()
        # No record_stream: restore() — always reached, also when the encode aborts — makes the compute
        # stream wait for the copy before any use or free of the storage, and record_stream would hold the
        # block back after its free until the side stream's *later* copies have finished too.
        # Dropping the host buffer is safe: the pinned-memory allocator keeps it until the copy has run.
        self.host = None

    def restore(self) -> None:
        """Make the storage valid for the compute stream again (copying back unless prefetched)."""
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if self.refilled:
            if compute is not None and self.restored is not None:
                compute.wait_event(self.restored)
            return
        dev = self._refill()
        if compute is not None and self.copied is not None:
            compute.wait_event(self.copied)
        dev.copy_(self.host, non_blocking=True)
        self.host = None


class LayerSyncEngine:
    """Runs K chunk forwards as cooperatively scheduled threads that meet at every time-coupled norm."""

    def __init__(
        self,
        num_chunks: int,
        *,
        reduce_fn: ReduceFn | None = None,
        halo: HaloExchange | None = None,
        offload_above: int | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if num_chunks < 1:
            raise ValueError("need at least one chunk")
        self.n = num_chunks
        self.reduce_fn = reduce_fn
        self.halo = halo or HaloExchange()
        self.offload_above = offload_above
        # one stream per direction: copies out and copies back use different copy engines and must not
        # queue behind each other
        self.copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.prefetch_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.parked: dict[int, _HostCopy] = {}
        """Chunk index → its norm input waiting in host memory (while the chunk is blocked at that norm)."""
        self.prefetched: int | None = None
        """The chunk whose parked input is being copied back ahead of its resumption (at most one: it
        costs one parked activation of device memory on top of the budget)."""
        self.num_offloaded = 0
        self.num_prefetched = 0
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
        if barrier.arrived == self.n:
            total = barrier.sums
            if self.reduce_fn is not None:
                total = self.reduce_fn(total)
            barrier.stats = sums_to_mean_var(total)
            barrier.sums = None
            self.num_barriers += 1
        k = self.local.k
        nbytes = x.numel() * x.element_size()
        parked = self._offload(x) if self._should_offload(x, nbytes) else None
        if parked is None:
            self._hold(nbytes)
        else:
            self.parked[k] = parked
        # when this arrival completes the norm, chunk 0 resumes next: start its copy back now (the
        # steady state has started it already, when the last chunk resumed at the previous norm)
        self._prefetch_next(k, only_runnable=True)
        try:
            self._block(lambda: barrier.stats is not None)
        finally:
            if parked is None:
                self.held_bytes -= nbytes
            else:
                del self.parked[k]
                if self.prefetched == k:
                    self.prefetched = None
                parked.restore()
        # the copy back of the next parked input to resume overlaps with this chunk's pass B
        self._prefetch_next(k)
        mean, var = barrier.stats
        return group_norm_with_stats(x, module, mean, var)

    def _should_offload(self, x: torch.Tensor, nbytes: int) -> bool:
        """Offload when the activations parked on the device would exceed ``offload_above``, and only a
        tensor that spans its whole storage (a view into a larger buffer, e.g. the input clip, may be read
        by other chunks)."""
        return (
            self.offload_above is not None
            and self.held_bytes + nbytes > self.offload_above
            and x.untyped_storage().nbytes() == nbytes
        )

    @staticmethod
    def _stream(
        streams: dict[torch.device, torch.cuda.Stream], device: torch.device
    ) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    def _offload(self, x: torch.Tensor) -> _HostCopy:
        self.num_offloaded += 1
        return _HostCopy(x, self._stream(self.copy_streams, x.device))

    def _prefetch_next(self, k: int, *, only_runnable: bool = False) -> None:
        """Start copying back the parked input of the chunk that will need it first after chunk ``k``.

        Chunks resume in index order at each norm, and a chunk that has passed its norm parks at the next
        one, which completes only after the last chunk arrives: so, seen from chunk ``k``, the parked
        chunks resume in cyclic order k+1, …, n−1, 0, …, k−1. A wrong guess (not the case for this
        schedule) costs only memory: the input stays on the device until its chunk resumes. Nothing is
        started while an earlier prefetch is unconsumed, which bounds the extra memory to one input.

        ``only_runnable``: only if that chunk's norm is complete already. Called as ``k`` parks, this
        keeps the first norm from fetching chunk 0 back while the later chunks still run up to it.
        """
        if self.prefetched is not None or not self.parked:
            return
        for step in range(1, self.n):
            j = (k + step) % self.n
            if j in self.parked:
                pred = self.preds[j]
                if only_runnable and not (pred is not None and pred()):
                    return
                copy = self.parked[j]
                copy.prefetch(self._stream(self.prefetch_streams, copy.device))
                self.prefetched = j
                self.num_prefetched += 1
                return

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
        # a new thread starts on CUDA device 0: chunks run on the caller's device (one process per GPU)
        cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        if self.n > 1:
            tune_malloc_for_threads()

        def body(k: int) -> None:
            self.local.k = k
            self.local.calls = defaultdict(int)
            try:
                if cuda_device is not None:
                    torch.cuda.set_device(cuda_device)
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
class PatchedForwards:
    """Temporarily replace ``forward`` of some modules (instance attribute; restored on exit)."""

    def __init__(self, pairs: Sequence[tuple[nn.Module, Callable[..., Any]]]) -> None:
        self.pairs = list(pairs)

    def __enter__(self) -> PatchedForwards:
        for mod, fn in self.pairs:
            mod.__dict__["forward"] = fn
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, _ in self.pairs:
            mod.__dict__.pop("forward", None)


def group_norm_patches(root: nn.Module, engine: Any) -> list[tuple[nn.Module, Callable]]:
    """Route every nn.GroupNorm under ``root`` that receives a video tensor (5D) through the engine
    (anything with ``group_norm(name, module, x)``: this module's engine or the recompute one).

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
    num_offloaded: int = 0
    """Norm inputs that waited in host memory (``offload_above``)."""
    num_prefetched: int = 0
    """Of those, the ones copied back ahead of their chunk's resumption (overlapping other compute)."""


def layer_synchronous_forward(
    x: torch.Tensor,
    plan: Sequence[int],
    chunk_fn: Callable[[torch.Tensor], torch.Tensor],
    norm_root: nn.Module,
    extra_patches: Callable[[LayerSyncEngine], list[tuple[nn.Module, Callable]]] | None = None,
    *,
    reduce_fn: ReduceFn | None = None,
    halo: HaloExchange | None = None,
    offload_above: int | None = None,
) -> ExactResult:
    """Generic driver: split ``x`` on time by ``plan``, run ``chunk_fn`` per chunk layer-synchronously,
    concatenate the outputs on time."""
    if sum(plan) != x.shape[2]:
        raise ValueError(f"chunk plan {list(plan)} does not add up to {x.shape[2]} frames")
    starts = [sum(plan[:i]) for i in range(len(plan))]
    chunks = [x[:, :, s : s + n] for s, n in zip(starts, plan, strict=True)]
    engine = LayerSyncEngine(len(plan), reduce_fn=reduce_fn, halo=halo, offload_above=offload_above)
    pairs = group_norm_patches(norm_root, engine)
    if extra_patches is not None:
        pairs += extra_patches(engine)
    with PatchedForwards(pairs):
        outs = engine.run([lambda c=c: chunk_fn(c) for c in chunks])
    return ExactResult(
        moments=torch.cat(outs, dim=2),
        plan=list(plan),
        num_barriers=engine.num_barriers,
        peak_held_bytes=engine.peak_held_bytes,
        num_offloaded=engine.num_offloaded,
        num_prefetched=engine.num_prefetched,
    )


def exact_chunked_encode(
    vae: Any,
    video: torch.Tensor,
    plan: Sequence[int],
    *,
    reduce_fn: ReduceFn | None = None,
    halo: HaloExchange | None = None,
    offload_above: int | None = None,
) -> ExactResult:
    """Encoder moments of ``video`` equal to the one-call encode, computed chunk by chunk.

    ``vae`` is an adapter offering ``exact_chunk_fn()`` (encoder on one chunk, no library cache) and
    ``exact_patches(engine)`` (its causal convs routed through the engine), e.g.
    :class:`pfctl.models.diffusers_vae.DiffusersVideoVAE` for CogVideoX. On several processes, give each
    rank its contiguous time shard (:func:`shard_frames`), ``reduce_fn`` (sum-all-reduce of the (3, B, G)
    float64 statistics) and ``halo`` (previous/next rank's causal-conv context), e.g. both from
    :func:`distributed_exchange`.

    ``offload_above`` (bytes): once the norm inputs the engine keeps parked on the device exceed it, the
    next ones wait in (pinned) host memory until their chunk resumes — chunks arrive and resume in index
    order, so the first ones stay on the device. ``None`` keeps everything on the device, ``0`` offloads
    every parked norm input. What the library's own frames hold (e.g. residuals) stays on the device.
    The copy back of the next offloaded input to resume runs on a side stream while the current chunk
    computes (one such input at a time, on top of the budget), so the copies overlap with compute.
    """
    module = vae.module
    root = getattr(module, "encoder", module)
    p = next(module.parameters())
    x = video.to(device=p.device, dtype=p.dtype)
    with torch.no_grad():
        return layer_synchronous_forward(
            x,
            plan,
            vae.exact_chunk_fn(),
            root,
            vae.exact_patches,
            reduce_fn=reduce_fn,
            halo=halo,
            offload_above=offload_above,
        )


# ---------------------------------------------------------------------------------------- processes
def shard_frames(num_frames: int, world_size: int, align: int) -> list[int]:
    """Frames per rank for contiguous time shards (rank order = time order): whole ``align``-frame blocks
    spread evenly, the first rank also takes the remainder (the causal first frame), as chunk plans do."""
    blocks, rest = divmod(num_frames, align)
    if blocks < world_size:
        raise ValueError(f"{num_frames} frames do not make {world_size} shards of whole {align}-frame blocks")
    sizes = [align * (blocks // world_size + (r < blocks % world_size)) for r in range(world_size)]
    sizes[0] += rest
    return sizes


_HALO_HEADER = 8
"""int64 header sent ahead of each halo: CRC-32 of the conv call key, ndim, shape (up to 6 dims)."""


def distributed_exchange(device: torch.device, dtype: torch.dtype) -> tuple[ReduceFn, HaloExchange]:
    """``reduce_fn`` and ``halo`` over torch.distributed's default group, for contiguous time shards in
    rank order: the statistics are sum-all-reduced, rank r receives its causal-conv context from r − 1 and
    sends its leftover frames to r + 1 (point to point, shape and key checksum first).

    ``device`` holds the tensors the backend moves (the rank's GPU for NCCL, the CPU for gloo); ``dtype``
    is the activations' dtype. Every rank must run the same model on a shard from :func:`shard_frames`.
    """
    import zlib

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    def reduce_fn(stats: torch.Tensor) -> torch.Tensor:
        stats = stats.to(device)
        dist.all_reduce(stats)
        return stats

    def send(key: str, t: torch.Tensor) -> None:
        header = torch.zeros(_HALO_HEADER, dtype=torch.int64)
        header[0], header[1] = zlib.crc32(key.encode()), t.ndim
        header[2 : 2 + t.ndim] = torch.tensor(t.shape)
        dist.send(header.to(device), rank + 1)
        dist.send(t.to(device=device, dtype=dtype).contiguous(), rank + 1)

    def recv(key: str) -> torch.Tensor:
        header = torch.empty(_HALO_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, rank - 1)
        crc, ndim, *shape = header.tolist()
        if crc != zlib.crc32(key.encode()):
            raise RuntimeError(f"halo exchange out of order: rank {rank} expected {key} from rank {rank - 1}")
        buf = torch.empty(shape[:ndim], dtype=dtype, device=device)
        dist.recv(buf, rank - 1)
        return buf

    return reduce_fn, HaloExchange(recv=recv if rank > 0 else None, send=send if rank < world - 1 else None)
