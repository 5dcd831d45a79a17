"""Spatial/temporal pyramids and the training-noise construction of Pyramid Flow.

Everything here is a pure function of tensors plus a :class:`RandomSource` (a ``torch.Generator``,
the global RNG, or a list of pre-drawn tensors so parity tests can replay the reference's draws).
No function modifies its inputs.

Batch packing (training): a batch of ``B`` clips is split into ``K = sum(sample_ratios)``
interleaved *columns*; column ``k`` takes batch rows ``k::K`` and trains stage
``column_to_stage[k]`` (``[0, 1, 1, 2]`` for the reference ratios ``(1, 2, 1)``). The DiT input is a
list with one entry per column; its text/timestep rows are ordered ``r = b*K + k`` — which is just
the original batch order, so text features need no reordering. Several such batches with the same ``Bc``
merge into one forward of all their columns side by side (:func:`merge_pyramid_batches`; their rows in the
merged order: :func:`merged_row_order`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pfctl.errors import ConfigError
from pfctl.flow.scheduler import PyramidFlowScheduler
from pfctl.runtime.sync_groups import plan_sync_groups

__all__ = [
    "DEFAULT_SAMPLE_RATIOS",
    "PyramidBatch",
    "RandomSource",
    "StageLengthPlan",
    "build_full_sequence_batch",
    "build_temporal_pyramid_batch",
    "column_to_stage",
    "downsample2",
    "endpoints_from_velocity",
    "flow_target",
    "history_clips",
    "history_layout",
    "interpolate",
    "merge_pyramid_batches",
    "merged_row_order",
    "plan_stage_lengths",
    "pyramid_latents",
    "pyramid_noise",
    "sample_stage_length",
    "stage_endpoints",
    "upsample_nearest2",
]

DEFAULT_SAMPLE_RATIOS: tuple[int, ...] = (1, 2, 1)


# --------------------------------------------------------------------------- resampling
def _framewise(x: torch.Tensor, fn) -> torch.Tensor:
    """Apply a 2-D op to every frame of ``(B, C, T, H, W)`` (the reference's ``(b t) c h w`` layout)."""
    b, c, t, h, w = x.shape
    frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    out = fn(frames)
    return out.reshape(b, t, c, out.shape[-2], out.shape[-1]).permute(0, 2, 1, 3, 4)


def downsample2(x: torch.Tensor) -> torch.Tensor:
    """Bilinear /2 of every frame (align_corners=False: each output is its 2x2 block's mean)."""
    h, w = x.shape[-2] // 2, x.shape[-1] // 2
    return _framewise(x, lambda f: F.interpolate(f, size=(h, w), mode="bilinear"))


def upsample_nearest2(x: torch.Tensor) -> torch.Tensor:
    """Nearest x2 of every frame (each value becomes a 2x2 block)."""
    h, w = x.shape[-2] * 2, x.shape[-1] * 2
    return _framewise(x, lambda f: F.interpolate(f, size=(h, w), mode="nearest"))


def pyramid_latents(x: torch.Tensor, num_stages: int = 3) -> list[torch.Tensor]:
    """Clean latents of every stage, lowest resolution first (bilinear /2 per level)."""
    levels = [x]
    for _ in range(num_stages - 1):
        levels.append(downsample2(levels[-1]))
    return levels[::-1]


def pyramid_noise(noise: torch.Tensor, num_stages: int = 3) -> list[torch.Tensor]:
    """Noise of every stage from one full-resolution draw, lowest resolution first.

    A 2x2 average of unit-variance i.i.d. noise has std 1/2, so each level is multiplied by 2 to
    stay unit-variance; using the *same* draw keeps the stages' noise consistent with each other.
    """
    levels = [noise]
    for _ in range(num_stages - 1):
        levels.append(downsample2(levels[-1]) * 2)
    return levels[::-1]


# ------------------------------------------------------------------------ randomness
class RandomSource:
    """Where the training-noise builders get their random numbers.

    * ``RandomSource.of(generator)``: draws from that ``torch.Generator`` (on its device);
    * ``RandomSource.of(None)``: draws from torch's global RNG, in the reference's order;
    * ``RandomSource.of([t0, t1, ...])``: replays pre-drawn tensors in order (parity tests); the
      shape of every replayed tensor is checked against the draw the builder asks for.

    Draw kinds: ``randn_like(ref)`` (standard normal, ref's shape/dtype) and ``rand(n)`` (uniform
    [0, 1), float32).
    """

    def __init__(self, generator: torch.Generator | None = None, draws: Iterable[torch.Tensor] | None = None):
        self.generator = generator
        self._draws = None if draws is None else list(draws)
        self._next = 0

    @classmethod
    def of(cls, rng: RandomSource | torch.Generator | Iterable[torch.Tensor] | None) -> RandomSource:
        if isinstance(rng, RandomSource):
            return rng
        if rng is None or isinstance(rng, torch.Generator):
            return cls(generator=rng)
        return cls(draws=rng)

    def _replay(self, shape: Sequence[int], kind: str) -> torch.Tensor:
        assert self._draws is not None
        if self._next >= len(self._draws):
            raise ValueError(
                f"ran out of given random draws: draw #{self._next} ({kind} {list(shape)}) requested"
            )
        draw = self._draws[self._next]
        if tuple(draw.shape) != tuple(shape):
            raise ValueError(
                f"given random draw #{self._next} has shape {list(draw.shape)}, the builder needs {kind} {list(shape)}"
            )
        self._next += 1
        return draw

    def randn_like(self, ref: torch.Tensor) -> torch.Tensor:
        if self._draws is not None:
            return self._replay(ref.shape, "randn").to(device=ref.device, dtype=ref.dtype)
        if self.generator is None:
            return torch.randn_like(ref)
        out = torch.randn(ref.shape, generator=self.generator, device=self.generator.device, dtype=ref.dtype)
        return out.to(ref.device)

    def rand(self, n: int, device: torch.device | str | None = None) -> torch.Tensor:
        if self._draws is not None:
            return self._replay((n,), "rand").to(device=device, dtype=torch.float32)
        gen_device = self.generator.device if self.generator is not None else "cpu"
        return torch.rand((n,), generator=self.generator, device=gen_device).to(device)

    @property
    def remaining(self) -> int:
        """Given draws not consumed yet (0 for generator sources)."""
        return 0 if self._draws is None else len(self._draws) - self._next


# ------------------------------------------------------------ unit allocation (AR training)
@dataclass(frozen=True)
class StageLengthPlan:
    """Validated unit-allocation settings of temporal-pyramid training.

    ``max_units`` (M) = latent units of the longest training clip (``1 + (max_frames - 1) //
    frame_per_unit``); ``group_size`` (G) = ``video_sync_group``. Ranks of one sync group read the
    same clips; rank r trains the high-res position ``r % G + 1 + turn * G``, ``turn`` cycling through
    ``M // G`` values, so the group covers positions 1..M in M // G micro-steps.
    """

    max_units: int
    group_size: int

    @property
    def turns(self) -> int:
        return self.max_units // self.group_size

    def lengths(self, counter: int, rank: int, clip_units: int | None = None) -> tuple[int, int, int]:
        """``(low, mid, high)`` units for call number ``counter`` (see :func:`sample_stage_length`)."""
        if counter < 0 or rank < 0:
            raise ValueError(f"counter and rank must be >= 0, got counter={counter}, rank={rank}")
        # The reference increments its counter *before* use: call 0 uses turn 1 (mod turns).
        turn = (counter + 1) % self.turns
        high = max(rank % self.group_size + 1 + turn * self.group_size, 1)
        mid = max(1 + self.max_units - high, 1)
        low = mid  # low and mid always get the same length ("token length sum fixed": mid + high = M + 1)
        if clip_units is not None:
            if clip_units < 1:
                raise ValueError(f"clip_units must be >= 1, got {clip_units}")
            low, mid, high = min(low, clip_units), min(mid, clip_units), min(high, clip_units)
        return low, mid, high


def plan_stage_lengths(max_units: int, group_size: int) -> StageLengthPlan:
    """The unit allocation of M units over sync groups of G ranks, validated before training starts by
    the one layout rule (:func:`pfctl.runtime.sync_groups.plan_sync_groups`; M's rule does not depend
    on the world size, so one group stands for any). Raises ``ConfigError``."""
    plan_sync_groups(group_size, group_size, max_units)
    return StageLengthPlan(max_units=int(max_units), group_size=int(group_size))


def sample_stage_length(
    counter: int, rank: int, group_size: int, max_units: int, clip_units: int | None = None
) -> tuple[int, int, int]:
    """Units ``(low, mid, high)`` trained per stage column for one forward (pure).

    ``counter`` is the 0-based index of this call — the number of forwards (micro-batches, gradient
    accumulation included) this rank ran before. The reference keeps a counter that it increments
    *before* use, so call 0 uses ``turn = 1 % (M // G)``; passing the call index reproduces that.
    ``rank`` is the global rank (only ``rank % G`` matters); ``max_units`` is M; ``clip_units`` clamps
    all three to the current clip's units (shorter clips). Raises ``ConfigError`` for invalid M/G.
    """
    return plan_stage_lengths(max_units, group_size).lengths(counter, rank, clip_units)


# ------------------------------------------------------------------- history layout
def history_layout(stage: int, num_history_units: int, frame_per_unit: int = 1) -> list[tuple[int, slice]]:
    """Which history frames the DiT sees, and at which stage's resolution, **newest first**.

    Returns ``(stage_of_clip, frame_slice)`` pairs; the slices index a tensor holding exactly the
    history frames (current unit excluded). Layout (temporal pyramid): the newest unit at the
    current stage's resolution, then one unit per lower stage >= 1, then everything older in one
    clip at stage 0's resolution. Shared by training and sampling, so both see the same context.
    """
    if num_history_units <= 0:
        return []
    fpu = frame_per_unit
    layout = [(stage, slice(-fpu, None))]
    taken, cur = 1, stage
    while taken < num_history_units:
        cur = max(cur - 1, 0)
        if cur == 0:
            break
        taken += 1
        layout.append((cur, slice(-(taken * fpu), -((taken - 1) * fpu))))
    if cur == 0 and taken < num_history_units:
        layout.append((0, slice(None, -(taken * fpu))))
    return layout


def history_clips(
    history: Sequence[torch.Tensor], stage: int, num_history_units: int, frame_per_unit: int = 1
) -> list[torch.Tensor]:
    """Clean history clips for ``stage`` in chronological order (oldest first), per :func:`history_layout`.

    ``history[k]`` holds the history frames at stage ``k``'s resolution.
    """
    clips = [history[k][:, :, sl] for k, sl in history_layout(stage, num_history_units, frame_per_unit)]
    return clips[::-1]


# ----------------------------------------------------------------------- endpoints
def interpolate(start: torch.Tensor, end: torch.Tensor, ratio: torch.Tensor | float) -> torch.Tensor:
    """Point at local ratio ``r`` on the stage path: ``r * start + (1 - r) * end`` (r = 1 is the start)."""
    return ratio * start + (1 - ratio) * end


def flow_target(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The velocity the DiT learns: ``start - end`` (constant along the straight path)."""
    return start - end


def endpoints_from_velocity(
    x: torch.Tensor, velocity: torch.Tensor, ratio: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert :func:`interpolate` given the velocity: ``start = x + (1 - r) v``, ``end = x - r v``.

    ``end`` is the model's estimate of the stage's end point (the clean latent at the last stage).
    """
    return x + (1 - ratio) * velocity, x - ratio * velocity


def column_to_stage(sample_ratios: Sequence[int]) -> list[int]:
    """Stage of every column: ``(1, 2, 1) -> [0, 1, 1, 2]``."""
    stages: list[int] = []
    for stage, count in enumerate(sample_ratios):
        stages.extend([stage] * int(count))
    return stages


def stage_endpoints(
    scheduler: PyramidFlowScheduler,
    stage: int,
    clean: torch.Tensor,
    noise: torch.Tensor,
    prev_clean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` of ``stage`` for clean latents ``clean`` (stage resolution) with the stage's noise.

    start = noise (stage 0) or ``start_sigma * noise + (1 - start_sigma) * up2(prev_clean)``;
    end = ``end_sigma * noise + (1 - end_sigma) * clean``, or ``clean`` for the last stage. The same
    noise is used at both ends, so the straight path between them is a single flow.
    """
    table = scheduler.stages[stage]
    if stage == 0:
        start = noise
    else:
        if prev_clean is None:
            raise ValueError(f"stage {stage} needs the previous stage's clean latents")
        start = table.start_sigma * noise + (1 - table.start_sigma) * upsample_nearest2(prev_clean)
    if stage == scheduler.num_stages - 1:
        end = clean
    else:
        end = table.end_sigma * noise + (1 - table.end_sigma) * clean
    return start, end


# ------------------------------------------------------------------ training batches
@dataclass
class PyramidBatch:
    """What one training forward needs.

    ``sample[k]``: clips of column k (history oldest first, noisy current clip last);
    ``timesteps``: ``[B]`` on the 0..1000 scale in DiT row order ``b*K + k``; ``targets[k]``: the
    velocity ``start - end`` of column k's current clip; ``ratios[k]``: ``[Bc,1,1,1,1]`` local sigma.
    """

    sample: list[list[torch.Tensor]]
    timesteps: torch.Tensor
    targets: list[torch.Tensor]
    ratios: list[torch.Tensor]
    column_to_stage: list[int]
    timesteps_per_column: list[torch.Tensor] = field(default_factory=list)
    units_per_stage: tuple[int, ...] | None = None


def _check_pyramid(pyramid: Sequence[torch.Tensor], scheduler: PyramidFlowScheduler, sample_ratios) -> int:
    if len(pyramid) != scheduler.num_stages or len(sample_ratios) != scheduler.num_stages:
        raise ConfigError(
            f"{len(pyramid)} pyramid levels and {len(sample_ratios)} sample_ratios for {scheduler.num_stages} stages",
            hint="give one latent level and one column ratio per stage",
        )
    total = pyramid[-1].shape[0]
    k = int(sum(sample_ratios))
    if total % k:
        raise ConfigError(
            f"batch size {total} is not a multiple of sum(sample_ratios)={k} (sample_ratios={list(sample_ratios)})",
            hint=f"use a per-device batch size divisible by {k}",
        )
    return k


def _draw_ratio(scheduler: PyramidFlowScheduler, stage: int, u: torch.Tensor, device):
    n = scheduler.num_train_timesteps
    timesteps, sigmas = scheduler.training_table(stage, device)
    idx = (u * n).long().clamp(0, n - 1).to(timesteps.device)
    return timesteps[idx], sigmas[idx]


def _interleave(timesteps: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.unsqueeze(-1) for t in timesteps], dim=-1).reshape(-1)


class _ColumnBatch:
    """The skeleton both training-noise builders share, so their RNG order and packing cannot drift apart:
    checks, one full-resolution ``randn`` for every stage's noise, then per column one ``rand(Bc)`` for the
    timestep (:meth:`point`), and the :class:`PyramidBatch` packing."""

    def __init__(
        self,
        pyramid: Sequence[torch.Tensor],
        scheduler: PyramidFlowScheduler,
        sample_ratios: Sequence[int],
        rng: RandomSource | torch.Generator | Iterable[torch.Tensor] | None,
    ) -> None:
        self.k_cols = _check_pyramid(pyramid, scheduler, sample_ratios)
        self.rs = RandomSource.of(rng)
        self.scheduler = scheduler
        top = pyramid[-1]
        self.dtype, self.device = top.dtype, top.device
        self.bc = top.shape[0] // self.k_cols
        self.noise_levels = pyramid_noise(self.rs.randn_like(top), scheduler.num_stages)
        self.stages = column_to_stage(sample_ratios)
        self.sample: list[list[torch.Tensor]] = []
        self.targets: list[torch.Tensor] = []
        self.ratios: list[torch.Tensor] = []
        self.timesteps: list[torch.Tensor] = []

    def point(self, stage: int, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Draw a column's timestep and return its noisy point; records its target, ratio and timestep."""
        bc = self.bc
        ts, r = _draw_ratio(self.scheduler, stage, self.rs.rand(bc, self.device), self.device)
        r = r.reshape(bc, 1, 1, 1, 1)
        # r is float64, so the interpolation is evaluated in float64 (as the reference) then cast.
        noisy = interpolate(start, end, r).to(self.dtype)
        self.targets.append(flow_target(start, end))
        self.ratios.append(r.to(self.dtype))
        self.timesteps.append(ts.to(self.dtype))
        return noisy

    def batch(self, units_per_stage: tuple[int, ...] | None = None) -> PyramidBatch:
        return PyramidBatch(
            sample=self.sample,
            timesteps=_interleave(self.timesteps),
            targets=self.targets,
            ratios=self.ratios,
            column_to_stage=self.stages,
            timesteps_per_column=self.timesteps,
            units_per_stage=units_per_stage,
        )


def merge_pyramid_batches(batches: Sequence[PyramidBatch]) -> PyramidBatch:
    """One DiT input holding the columns of every batch, in order (batch i's column k follows all the columns
    of the batches before it); each column keeps its clips, target, ratio, timesteps and stage. The batches
    must have the same samples per column ``Bc``; their text rows go in :func:`merged_row_order`. The loss of
    the merged predictions (the mean over all columns and samples) is the mean of the batches' losses, as
    their columns are equally many. ``units_per_stage`` is dropped (the batches may differ in it)."""
    if not batches:
        raise ValueError("no batch to merge")
    per_column = {col[-1].shape[0] for b in batches for col in b.sample}
    if len(per_column) != 1:
        raise ValueError(f"batches with different samples per column {sorted(per_column)} cannot be merged")
    per_col_timesteps = [t for b in batches for t in b.timesteps_per_column]
    return PyramidBatch(
        sample=[col for b in batches for col in b.sample],
        timesteps=_interleave(per_col_timesteps),
        targets=[t for b in batches for t in b.targets],
        ratios=[r for b in batches for r in b.ratios],
        column_to_stage=[s for b in batches for s in b.column_to_stage],
        timesteps_per_column=per_col_timesteps,
    )


def merged_row_order(columns: Sequence[int], per_column: int) -> list[int]:
    """The text rows of the merged batch (:func:`merge_pyramid_batches`) as indices into the batches' rows
    concatenated: batch i has ``columns[i]`` columns of ``per_column`` samples, its rows ``b*K_i + k``; the
    merged rows are ``b*sum(K) + k'`` with batch i's column k at ``k' = sum(columns[:i]) + k``."""
    starts = [sum(columns[:i]) * per_column for i in range(len(columns))]
    return [
        start + b * k_cols + k
        for b in range(per_column)
        for start, k_cols in zip(starts, columns, strict=True)
        for k in range(k_cols)
    ]


def build_temporal_pyramid_batch(
    pyramid: Sequence[torch.Tensor],
    scheduler: PyramidFlowScheduler,
    units_per_stage: Sequence[int],
    *,
    sample_ratios: Sequence[int] = DEFAULT_SAMPLE_RATIOS,
    corrupt_ratio: float = 1.0 / 3.0,
    frame_per_unit: int = 1,
    rng: RandomSource | torch.Generator | Iterable[torch.Tensor] | None = None,
) -> PyramidBatch:
    """Autoregressive temporal-pyramid training inputs (the ``--use_temporal_pyramid`` path).

    ``pyramid``: normalised clean latents per stage, lowest resolution first (see
    :func:`pyramid_latents`); ``units_per_stage``: ``(low, mid, high)`` from
    :func:`sample_stage_length`. Column k of stage s with n units trains unit n (0-based n-1) at
    stage s; its history is laid out per :func:`history_layout` and corrupted as
    ``c * eps + (1 - c) * h`` with one ``c = U(0,1) * corrupt_ratio`` per sample shared by all its
    history clips (robustness to the model's own imperfect past at inference).

    RNG draw order (matches the reference, so given draws replay it): one ``randn`` over the
    full-resolution latents; then per column ``rand(Bc)`` (timestep index), ``rand(Bc)``
    (corruption strength, drawn even without history), and one ``randn`` per history clip, newest
    first.
    """
    cols = _ColumnBatch(pyramid, scheduler, sample_ratios, rng)
    k_cols, rs, bc = cols.k_cols, cols.rs, cols.bc
    fpu = int(frame_per_unit)
    max_units = 1 + (pyramid[-1].shape[2] - 1) // fpu

    for col, s in enumerate(cols.stages):
        n_units = min(int(units_per_stage[s]), max_units)
        frames = 1 + (n_units - 1) * fpu
        cur = slice(frames - fpu, frames)  # the unit being trained
        clean = pyramid[s][col::k_cols]
        prev = None if s == 0 else pyramid[s - 1][col::k_cols][:, :, cur]
        start, end = stage_endpoints(
            scheduler, s, clean[:, :, cur], cols.noise_levels[s][col::k_cols][:, :, cur], prev
        )
        noisy = cols.point(s, start, end)

        corrupt = (rs.rand(bc, cols.device) * corrupt_ratio).reshape(bc, 1, 1, 1, 1)
        history = [level[col::k_cols][:, :, : frames - fpu] for level in pyramid]
        clips = []
        for k, sl in history_layout(s, n_units - 1, fpu):  # newest first = draw order
            h = history[k][:, :, sl]
            clips.append((corrupt * rs.randn_like(h) + (1 - corrupt) * h).to(cols.dtype))
        cols.sample.append([*clips[::-1], noisy])

    return cols.batch(units_per_stage=tuple(int(u) for u in units_per_stage))


def build_full_sequence_batch(
    pyramid: Sequence[torch.Tensor],
    scheduler: PyramidFlowScheduler,
    *,
    sample_ratios: Sequence[int] = DEFAULT_SAMPLE_RATIOS,
    rng: RandomSource | torch.Generator | Iterable[torch.Tensor] | None = None,
    draw_unused_corruption: bool = True,
) -> PyramidBatch:
    """Non-autoregressive training inputs: every column noises all T frames at once (no history).

    Used for image training and full-sequence video training. RNG order: one full-resolution
    ``randn``, then per column ``rand(Bc)`` for the timestep index and — with
    ``draw_unused_corruption`` (reference RNG compatibility) — one more ``rand(Bc)`` that the
    reference draws and never uses.
    """
    cols = _ColumnBatch(pyramid, scheduler, sample_ratios, rng)
    k_cols = cols.k_cols
    for col, s in enumerate(cols.stages):
        prev = None if s == 0 else pyramid[s - 1][col::k_cols]
        start, end = stage_endpoints(
            scheduler, s, pyramid[s][col::k_cols], cols.noise_levels[s][col::k_cols], prev
        )
        noisy = cols.point(s, start, end)
        if draw_unused_corruption:
            cols.rs.rand(cols.bc, cols.device)
        cols.sample.append([noisy])

    return cols.batch()
