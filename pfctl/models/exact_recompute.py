"""Exact chunked encoding that recomputes instead of parking (SPEC-verify-groupnorm §5 (b), checkpointed).

Why: the layer-synchronous schedule (:mod:`pfctl.models.exact_chunked`, ``exact_schedule="parked"``)
keeps every chunk's activation at each time-coupled GroupNorm, about one full-clip activation plus what
the library's frames hold (residuals): twice the framewise path's peak. This schedule keeps none of that.

The encoder is given as a list of *stages* (the adapter's ``exact_stages()``: conv_in, each resnet, each
downsampler, …, the tail), functions of one chunk's tensor whose composition is the one-call encoder. It
runs in *passes*; a pass runs the chunks one after another, in time order, from the current checkpoint:

- a GroupNorm whose statistics are known normalises with them (:func:`group_norm_with_stats`);
- the first one that is not known is the pass's *target*: every chunk adds its (N, Σx, Σx²) there and
  stops (its activations are dropped); after the last chunk the sums are reduced (``reduce_fn``: one
  all-reduce of O(groups) numbers per norm, on every rank alike) and the next pass goes one norm further;
- the pass that finds no unknown norm is the last one and returns the moments.

Checkpoint: the input of the target's stage is final (every norm before it is known). A chunk keeps it in
place of its previous checkpoint, and starts its next passes there, as far as ``checkpoint_bytes`` allows
(the last chunks first: a chunk needs the causal context of the one before it, so it may not start
earlier than that one). With room for the whole clip a resnet costs three passes — its input's
statistics, its first conv again for the second norm, then the whole block — with one whole-clip
activation alive between passes: about 1.5x the convolutions. A chunk without a checkpoint recomputes
from its last one (at worst the input clip): less memory, more passes over the widest layers.

Memory: the checkpoint (at most one whole-clip activation) plus one chunk's working set. A real VAE's
working set is many activations of its chunk (the library's block code keeps its inputs, pads, copies),
so with the smallest chunks (:meth:`DiffusersVideoVAE.exact_plan`) the sum stays under the framewise
path's peak with its larger chunks (figures: benchmarks/RESULTS.md).

Causal convs get the previous chunk's leftover padded frames (recomputed in each pass, as the chunks run
in order). Across processes the first chunk gets them from the previous rank (``halo``); a stage that has
run to completion once is final, so the halos of its convs are exchanged in that pass only and reused
after, which lets each rank keep its own checkpoint. Attention over all earlier frames (HunyuanVideo's
mid block) gets its keys and values the same way (:meth:`RecomputeEngine.prefix`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pfctl.models.exact_chunked import (
    HaloExchange,
    PatchedForwards,
    ReduceFn,
    group_norm_patches,
    group_norm_with_stats,
    group_sums,
    sums_to_mean_var,
)

Stage = tuple[str, Callable[[torch.Tensor], torch.Tensor]]
"""(name, fn): one step of the encoder on one chunk; the names only label errors."""


class _StopChunk(Exception):
    """Raised at a pass's target norm once the chunk's sums are in: the rest of the chunk is not needed."""


@dataclass
class RecomputeResult:
    """Output of the recompute schedule and what it cost."""

    moments: torch.Tensor
    plan: list[int]
    num_passes: int
    num_reductions: int
    """All-reduces of statistics (one per time-coupled norm, the same on every rank)."""
    peak_checkpoint_bytes: int
    """Largest total of the checkpoints kept across passes (this process)."""


class RecomputeEngine:
    """The state of one recompute encode: known statistics, the pass's target, causal carries and halos.

    Patched modules call :meth:`group_norm`, :meth:`causal_input` and :meth:`prefix` (the same
    interface as :class:`pfctl.models.exact_chunked.LayerSyncEngine`, single-threaded).
    """

    def __init__(self, num_chunks: int, *, reduce_fn: ReduceFn | None, halo: HaloExchange | None) -> None:
        self.n = num_chunks
        self.reduce_fn = reduce_fn
        self.halo = halo or HaloExchange()
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.target: str | None = None
        self.sums: torch.Tensor | None = None
        self.carries: dict[str, torch.Tensor] = {}
        self.received: dict[str, torch.Tensor] = {}
        """Halos from the previous rank by key; reused for stages that are final."""
        self.done_stages: set[int] = set()
        """Stages that ran to completion in an earlier pass (final: same result in every later pass)."""
        self.k = 0
        self.stage = 0
        self.calls: dict[str, int] = defaultdict(int)
        self.num_reductions = 0

    def enter(self, k: int, stage: int) -> None:
        """Chunk ``k`` starts stage ``stage`` (call keys count per stage, so skipping stages keeps them)."""
        self.k, self.stage = k, stage
        self.calls = defaultdict(int)

    def _key(self, name: str) -> str:
        idx = self.calls[name]
        self.calls[name] = idx + 1
        return f"{self.stage}:{name}#{idx}"

    # -- norms
    def group_norm(self, name: str, module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        """GroupNorm with the whole clip's statistics, or the pass's target (sums added, chunk stopped)."""
        key = self._key(name)
        known = self.stats.get(key)
        if known is not None:
            return group_norm_with_stats(x, module, *known)
        if self.target is None:
            self.target = key
        elif self.target != key:
            raise RuntimeError(f"chunks disagree on the layers run ({key} after {self.target})")
        sums = group_sums(x, module.num_groups)
        self.sums = sums if self.sums is None else self.sums + sums
        raise _StopChunk

    def finish_pass(self) -> bool:
        """Reduce the target's sums into statistics; False when the pass had no target (it was the last)."""
        if self.target is None:
            return False
        total = self.sums
        if self.reduce_fn is not None:
            total = self.reduce_fn(total)
        self.stats[self.target] = sums_to_mean_var(total)
        self.num_reductions += 1
        self.target, self.sums = None, None
        self.carries.clear()
        return True

    # -- context from earlier frames
    def _carried(self, key: str) -> torch.Tensor | None:
        """What the previous chunk (or rank) left for call ``key``; None on the clip's first chunk."""
        if self.k > 0:
            return self.carries.pop(key)
        if self.halo.recv is None:
            return None
        if self.stage not in self.done_stages:
            self.received[key] = self.halo.recv(key)
        return self.received[key]

    def _carry(self, key: str, t: torch.Tensor) -> None:
        if self.k < self.n - 1:
            self.carries[key] = t
        elif self.halo.send is not None and self.stage not in self.done_stages:
            self.halo.send(key, t)

    def causal_input(
        self,
        name: str,
        x: torch.Tensor,
        kernel_t: int,
        stride_t: int,
        pad_first: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The time-padded input of a causal conv for this chunk, equal to the full pass's window
        (the clip's first chunk pads as the model does; later ones prepend the previous chunk's
        unconsumed padded frames)."""
        key = self._key(name)
        prev = self._carried(key)
        padded = pad_first(x) if prev is None else torch.cat([prev.to(x), x], dim=2)
        length = padded.shape[2]
        n_out = (length - kernel_t) // stride_t + 1 if length >= kernel_t else 0
        self._carry(key, padded[:, :, n_out * stride_t :].clone())
        return padded

    def prefix(self, name: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` with everything earlier chunks (and ranks) passed here prepended along ``dim`` (e.g. the
        keys and values of attention over all earlier frames)."""
        key = self._key(name)
        prev = self._carried(key)
        full = x if prev is None else torch.cat([prev.to(x), x], dim=dim)
        self._carry(key, full)
        return full


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _advance_from(per_frame: float, plan: Sequence[int], held: Sequence[int], budget: int | None) -> int:
    """First chunk whose checkpoint moves forward this pass: the chunks from there on move (estimated
    ``per_frame`` bytes per input frame each) and the ones before keep what they ``held``, within
    ``budget``. Only a suffix can move: a chunk needs its causal context from the one before it, which
    must therefore start at the same stage or earlier."""
    if budget is None:
        return 0
    for k0 in range(len(plan) + 1):
        if sum(held[:k0]) + per_frame * sum(plan[k0:]) <= budget:
            return k0
    return len(plan)


def _run_chunk(
    engine: RecomputeEngine, stages: Sequence[Stage], k: int, h: torch.Tensor, base: int
) -> tuple[torch.Tensor | None, int, torch.Tensor]:
    """Chunk ``k`` from stage ``base``: (output or None when it stopped, the stage it stopped in or
    len(stages), that stage's input)."""
    s = base
    h_in = h
    try:
        for s in range(base, len(stages)):
            engine.enter(k, s)
            h_in = h
            h = stages[s][1](h)
    except _StopChunk:
        return None, s, h_in
    return h, len(stages), h_in


def recompute_forward(
    x: torch.Tensor,
    plan: Sequence[int],
    stages: Sequence[Stage],
    engine: RecomputeEngine,
    checkpoint_bytes: int | None,
) -> RecomputeResult:
    """Run ``stages`` over ``x`` split on time by ``plan`` in passes (module docstring).

    ``checkpoint_bytes``: bytes the checkpoints may hold (None: no limit)."""
    if sum(plan) != x.shape[2]:
        raise ValueError(f"chunk plan {list(plan)} does not add up to {x.shape[2]} frames")
    starts = [sum(plan[:i]) for i in range(len(plan))]
    ckpt = [x[:, :, s : s + n] for s, n in zip(starts, plan, strict=True)]
    bases = [0] * len(plan)
    held = [0] * len(plan)  # bytes of each chunk's checkpoint (0: a view of the input clip)
    passes, peak = 0, 0
    while True:
        passes += 1
        outs: list[torch.Tensor] = []
        stop, first_moving = len(stages), len(plan)
        for k in range(engine.n):
            out, stop, h_in = _run_chunk(engine, stages, k, ckpt[k], bases[k])
            if out is not None:
                outs.append(out)
                continue
            if k == 0:
                first_moving = _advance_from(_nbytes(h_in) / plan[0], plan, held, checkpoint_bytes)
            if k >= first_moving and stop > bases[k]:
                ckpt[k], bases[k], held[k] = h_in, stop, _nbytes(h_in)  # the previous one is freed here
            del h_in
        peak = max(peak, sum(held))
        engine.done_stages.update(range(stop))
        if not engine.finish_pass():
            break
    return RecomputeResult(
        moments=torch.cat(outs, dim=2),
        plan=list(plan),
        num_passes=passes,
        num_reductions=engine.num_reductions,
        peak_checkpoint_bytes=peak,
    )


def exact_recompute_encode(
    vae: Any,
    video: torch.Tensor,
    plan: Sequence[int],
    *,
    reduce_fn: ReduceFn | None = None,
    halo: HaloExchange | None = None,
    checkpoint_bytes: int | None = None,
) -> RecomputeResult:
    """Encoder moments of ``video`` equal to the one-call encode, computed chunk by chunk in passes.

    ``vae`` is an adapter offering ``exact_stages(engine)`` (the encoder as a list of stages) and
    ``exact_patches(engine)`` (its causal convs routed through the engine), e.g.
    :class:`pfctl.models.diffusers_vae.DiffusersVideoVAE`. Several processes: as for
    :func:`pfctl.models.exact_chunked.exact_chunked_encode` (time shards, ``reduce_fn``, ``halo``).
    ``checkpoint_bytes``: the most this process keeps across passes (None: no limit; module docstring).
    """
    module = vae.module
    root = getattr(module, "encoder", module)
    p = next(module.parameters())
    x = video.to(device=p.device, dtype=p.dtype)
    engine = RecomputeEngine(len(plan), reduce_fn=reduce_fn, halo=halo)
    pairs = group_norm_patches(root, engine) + vae.exact_patches(engine)
    with torch.no_grad(), PatchedForwards(pairs):
        return recompute_forward(x, plan, vae.exact_stages(engine), engine, checkpoint_bytes)
