"""Stage tables, inference grids, Euler steps and stage-transition renoising.

Numbers follow the reference scheduler exactly (same float32 / float64 choices), because the DiT
was trained on these tables: the training timestep of a sample is looked up in
``timesteps_per_stage`` (float32) and its interpolation ratio in ``sigmas_per_stage`` (float64).
See :mod:`pfctl.flow` for the sign conventions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pfctl.errors import ConfigError

__all__ = ["PyramidFlowScheduler", "StageSchedule", "StageTable", "block_noise"]


@dataclass(frozen=True)
class StageTable:
    """Everything training and sampling need to know about one stage.

    ``start_sigma`` is the jump-corrected noise level of the stage's start point (the level that the
    renoised, upsampled previous stage actually has); ``ori_start_sigma`` is the uncorrected level on
    the global grid (= the previous stage's ``end_sigma``), from which the renoise coefficients follow.
    """

    stage: int
    start_sigma: float
    end_sigma: float
    ori_start_sigma: float
    timestep_ratio: tuple[float, float]  # share of the 0..1 training axis owned by the stage
    timestep_start: float  # first entry of ``timesteps`` (0..1000 scale)
    timestep_end: float  # value the table would reach at ratio 0 (not itself in the table)
    timesteps: torch.Tensor  # [num_train_timesteps] float32, ratio 1 -> ratio 0.001
    sigmas: torch.Tensor  # [num_train_timesteps] float64, 1.0 -> 0.001 (local ratio r)


@dataclass(frozen=True)
class StageSchedule:
    """Inference grid of one stage: ``timesteps[i]`` is fed to the DiT while the sample sits at local
    ratio ``sigmas[i]``; the Euler step moves it to ``sigmas[i + 1]`` (``sigmas[-1] == 0``)."""

    stage: int
    timesteps: torch.Tensor  # [n] float64
    sigmas: torch.Tensor  # [n + 1] float64

    def __len__(self) -> int:
        return int(self.timesteps.shape[0])

    def steps(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield ``(i, timestep, sigma, sigma_next)`` as 0-dim float64 tensors."""
        for i in range(len(self)):
            yield i, self.timesteps[i], self.sigmas[i], self.sigmas[i + 1]


def _check_gamma(gamma: float) -> None:
    if not (0.0 < gamma <= 1.0 / 3.0 + 1e-12):
        raise ConfigError(
            f"scheduler gamma={gamma} is outside (0, 1/3]",
            hint="the 2x2 block-noise covariance (1+g)I - g*11^T is only positive semi-definite for g <= 1/3, "
            "and renoising divides by sqrt(g); the reference uses 1/3",
        )


def block_noise(
    shape: Sequence[int],
    generator: torch.Generator | None = None,
    *,
    gamma: float = 1.0 / 3.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Gaussian noise whose every 2x2 spatial block has covariance ``(1+gamma) I - gamma 11^T``.

    Why this distribution: nearest-upsampling a noisy low-resolution latent copies each noise value
    into a 2x2 block (correlation 1 inside the block). Adding ``beta * block_noise`` with the
    renoise ``beta`` cancels that correlation exactly, so the result has i.i.d. noise again.

    Construction (no matrix factorisation; at gamma = 1/3 the covariance is singular and the
    reference's ``MultivariateNormal`` raises on recent torch): the covariance has the block mean
    direction ``1/2 * (1,1,1,1)`` as an eigenvector with eigenvalue ``1 - 3 gamma`` and the 3-d
    zero-sum subspace with eigenvalue ``1 + gamma``. With ``z`` i.i.d. N(0, 1) and ``m`` its block
    mean (broadcast back over the block),

        n = sqrt(1 + gamma) * (z - m) + sqrt(1 - 3 gamma) * m

    has covariance ``(1+gamma)(I - 11^T/4) + (1-3gamma) 11^T/4 = (1+gamma) I - gamma 11^T``. At
    gamma = 1/3 the second term vanishes and every block sums to exactly zero (up to rounding).

    ``shape`` is ``(..., H, W)`` with even ``H`` and ``W``; blocks are the aligned 2x2 tiles.
    """
    _check_gamma(gamma)
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or shape[-1] % 2 or shape[-2] % 2:
        raise ValueError(f"block_noise needs even spatial sizes (..., H, W), got shape {shape}")
    if device is None and generator is not None:
        device = generator.device
    z = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    h, w = shape[-2], shape[-1]
    blocks = z.reshape(*shape[:-2], h // 2, 2, w // 2, 2)
    mean = blocks.mean(dim=(-3, -1), keepdim=True)
    mean_coeff = math.sqrt(max(0.0, 1.0 - 3.0 * gamma))
    noise = math.sqrt(1.0 + gamma) * (blocks - mean) + mean_coeff * mean
    return noise.reshape(shape).to(dtype)


class PyramidFlowScheduler:
    """Piecewise flow-matching schedule over ``stages`` resolution stages.

    Global grid: timesteps 1000, 999, ..., 1 (float32) and sigmas = timesteps / 1000 (then the SD3
    ``shift``). Stage ``k`` covers the global sigmas from ``stage_range[k]`` to ``stage_range[k+1]``;
    for ``k > 0`` its start sigma is jump-corrected (see :meth:`renoise_coefficients`). The 0..1000
    timestep axis is divided between stages in proportion to their (corrected) sigma lengths.

    Reference quirks kept for parity (the released weights were trained on these tables): stage
    timestep ranges do not meet exactly (stage 0 ends at ~744.256, stage 1 starts at 744.0, because
    the boundaries are read off the integer global grid), and the default inference grid ends each
    stage with a 0.001-long step (see :meth:`set_timesteps`, ``exact_stage_end``).
    """

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        shift: float = 1.0,
        stages: int = 3,
        stage_range: Sequence[float] = (0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0),
        gamma: float = 1.0 / 3.0,
    ) -> None:
        _check_gamma(gamma)
        if len(stage_range) != stages + 1:
            raise ConfigError(
                f"stage_range has {len(stage_range)} entries for {stages} stages",
                hint="give stages + 1 boundaries, e.g. [0, 1/3, 2/3, 1]",
            )
        self.num_train_timesteps = int(num_train_timesteps)
        self.shift = float(shift)
        self.num_stages = int(stages)
        self.stage_range = tuple(float(x) for x in stage_range)
        self.gamma = float(gamma)

        n = self.num_train_timesteps
        # Global grid, float32 like the reference: 1000 -> 1 and 1.0 -> 0.001.
        grid = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy())
        sigmas = grid / n
        sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        self.sigmas = sigmas  # [n] float32
        self.timesteps = sigmas * n  # [n] float32
        self.sigma_min = float(self.sigmas[-1].item())
        self.sigma_max = float(self.sigmas[0].item())
        self.stages: list[StageTable] = self._build_stage_tables()
        self._device_tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ tables
    def training_table(self, stage: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``stage``'s (timesteps, sigmas) training tables on ``device``, copied there once.

        Training looks up a drawn index in them every column; indexing a copy that already lives on
        the GPU keeps the lookup on the GPU (no host round trip, which would stall the launch queue).
        """
        key = (stage, torch.device(device))
        if key not in self._device_tables:
            table = self.stages[stage]
            self._device_tables[key] = (table.timesteps.to(device), table.sigmas.to(device))
        return self._device_tables[key]

    def _build_stage_tables(self) -> list[StageTable]:
        n = self.num_train_timesteps
        starts, ends, ori_starts, distances = [], [], [], []
        for k in range(self.num_stages):
            i0 = max(int(self.stage_range[k] * n), 0)
            i1 = min(int(self.stage_range[k + 1] * n), n)
            start = float(self.sigmas[i0].item())
            end = float(self.sigmas[i1].item()) if i1 < n else 0.0
            ori_starts.append(start)
            if k > 0:
                signal = 1 - start
                start = 1 - (1 / (math.sqrt(1 + (1 / self.gamma)) * (1 - signal) + signal)) * signal
            starts.append(start)
            ends.append(end)
            distances.append(start - end)

        total = sum(distances)
        tables = []
        for k in range(self.num_stages):
            r0 = 0.0 if k == 0 else sum(distances[:k]) / total
            r1 = 1.0 if k == self.num_stages - 1 else sum(distances[: k + 1]) / total
            t_start = self.timesteps[int(r0 * n)]
            t_end = self.timesteps[min(int(r1 * n), n - 1)]
            # numpy linspace on float32 scalars keeps float32 arithmetic, as the reference does.
            t_table = np.linspace(np.float32(t_start.item()), np.float32(t_end.item()), n + 1)
            s_table = np.linspace(1, 0, n + 1)
            tables.append(
                StageTable(
                    stage=k,
                    start_sigma=starts[k],
                    end_sigma=ends[k],
                    ori_start_sigma=ori_starts[k],
                    timestep_ratio=(r0, r1),
                    timestep_start=float(t_start.item()),
                    timestep_end=float(t_end.item()),
                    timesteps=torch.from_numpy(np.ascontiguousarray(t_table[:-1])),
                    sigmas=torch.from_numpy(np.ascontiguousarray(s_table[:-1])),
                )
            )
        return tables

    @property
    def start_sigmas(self) -> list[float]:
        return [s.start_sigma for s in self.stages]

    @property
    def end_sigmas(self) -> list[float]:
        return [s.end_sigma for s in self.stages]

    @property
    def ori_start_sigmas(self) -> list[float]:
        return [s.ori_start_sigma for s in self.stages]

    @property
    def timesteps_per_stage(self) -> list[torch.Tensor]:
        return [s.timesteps for s in self.stages]

    @property
    def sigmas_per_stage(self) -> list[torch.Tensor]:
        return [s.sigmas for s in self.stages]

    def _stage(self, stage: int) -> StageTable:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        return self.stages[stage]

    # ---------------------------------------------------------------- sampling
    def set_timesteps(
        self, num_inference_steps: int, stage: int, *, exact_stage_end: bool = False
    ) -> StageSchedule:
        """Inference grid of ``stage`` with ``num_inference_steps`` DiT calls.

        Default (reference behaviour): timesteps = linspace(first, last table entry, n) and local
        sigmas = linspace(1, 0.001, n) followed by 0. With n >= 2 the grid therefore reaches 0.001
        one step early and the last Euler step only moves sigma by 0.001: n steps act like n - 1.

        ``exact_stage_end=True``: sigmas = linspace(1, 0, n + 1) — n evenly spaced steps that cover
        the whole stage — and each timestep is the stage's linear map of its sigma
        (``t = t_end + r * (t_start - t_end)``, the same map as the training table).
        """
        n = int(num_inference_steps)
        if n < 1:
            raise ConfigError(
                f"num_inference_steps={n} for stage {stage}", hint="each stage needs at least 1 step"
            )
        table = self._stage(stage)
        if exact_stage_end:
            sigmas = torch.from_numpy(np.linspace(1.0, 0.0, n + 1))
            t0, t1 = table.timestep_start, table.timestep_end
            timesteps = t1 + sigmas[:-1] * (t0 - t1)
            return StageSchedule(stage=stage, timesteps=timesteps, sigmas=sigmas)
        timesteps = torch.from_numpy(np.linspace(table.timesteps[0].item(), table.timesteps[-1].item(), n))
        ratios = torch.from_numpy(np.linspace(table.sigmas[0].item(), table.sigmas[-1].item(), n))
        sigmas = torch.cat([ratios, torch.zeros(1, dtype=ratios.dtype)])
        return StageSchedule(stage=stage, timesteps=timesteps, sigmas=sigmas)

    @staticmethod
    def step(
        model_output: torch.Tensor,
        sample: torch.Tensor,
        sigma: torch.Tensor | float,
        sigma_next: torch.Tensor | float,
    ) -> torch.Tensor:
        """One Euler step ``sample + (sigma_next - sigma) * v``, accumulated in float32 (like the
        reference) and returned in ``model_output``'s dtype. Returns a new tensor."""
        prev = sample.to(torch.float32) + (sigma_next - sigma) * model_output
        return prev.to(model_output.dtype)

    # ---------------------------------------------------------- stage changes
    def renoise_coefficients(self, stage: int) -> tuple[float, float]:
        """``(alpha, beta)`` for entering ``stage`` (>= 1): ``x <- alpha * up(x) + beta * block_noise``.

        The previous stage ends at sigma s = ``ori_start_sigma[stage]`` with signal c = 1 - s.
        Nearest upsampling leaves per-block perfectly correlated noise of variance s^2; adding
        ``beta * n`` with ``beta = alpha * s / sqrt(gamma)`` cancels the off-diagonal
        ``alpha^2 s^2 - beta^2 gamma = 0`` and leaves i.i.d. noise of std
        ``alpha * s * sqrt(1 + 1/gamma)``. ``alpha`` rescales so signal + noise coefficients sum to
        one: ``alpha = 1 / (sqrt(1 + 1/gamma) * s + c)``. The result has signal ``1 - start_sigma`` and
        noise std ``start_sigma`` — exactly the stage's training start marginal.
        """
        if stage < 1:
            raise ValueError("renoising happens when entering stage >= 1")
        signal = 1 - self._stage(stage).ori_start_sigma
        alpha = 1 / (math.sqrt(1 + (1 / self.gamma)) * (1 - signal) + signal)
        beta = alpha * (1 - signal) / math.sqrt(self.gamma)
        return alpha, beta

    def renoise(self, upsampled: torch.Tensor, stage: int, noise: torch.Tensor) -> torch.Tensor:
        """``alpha * upsampled + beta * noise`` for entering ``stage`` (new tensor)."""
        alpha, beta = self.renoise_coefficients(stage)
        return alpha * upsampled + beta * noise.to(device=upsampled.device, dtype=upsampled.dtype)

    def block_noise(
        self,
        shape: Sequence[int],
        generator: torch.Generator | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """:func:`block_noise` with this scheduler's gamma."""
        return block_noise(shape, generator, gamma=self.gamma, dtype=dtype, device=device)
