"""Autoregressive pyramidal sampling: text-to-video and image-to-video latents.

The video is produced one *unit* (latent frame) at a time. Each unit starts from low-resolution
noise and runs the stages coarse -> fine: inside a stage, Euler steps on the DiT velocity with
classifier-free guidance; between stages, nearest x2 upsampling plus block-noise renoising
(:meth:`PyramidFlowScheduler.renoise`). Earlier units are fed back as clean history in the same
temporal-pyramid layout as training (:func:`pfctl.flow.pyramid.history_layout`), without corruption.

Given noise (``initial_noise``, ``block_noises``) makes a run exactly reproducible — the parity
tests replay the reference's draws this way. Without it, noise comes from ``generator``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pfctl.errors import ConfigError, InputError
from pfctl.flow.pyramid import history_clips, pyramid_latents, pyramid_noise, upsample_nearest2
from pfctl.flow.scheduler import PyramidFlowScheduler
from pfctl.models.attention_layout import right_padded_lengths
from pfctl.models.text_embeddings import TextEmbeddings

if TYPE_CHECKING:
    from pfctl.config.generate import GenerateConfig
    from pfctl.models.fast.cuda_graph import StageGraph

__all__ = ["SamplingSettings", "TextConditioning", "generate_latents", "guidance_schedule"]

BlockNoiseSource = Iterable[torch.Tensor] | Callable[[tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True)
class SamplingSettings:
    """How the sampler walks the pyramid: the settings of one video that are not tensors.

    ``num_inference_steps``: per-stage Euler steps of the first frame (t2v unit 0);
    ``video_num_inference_steps``: per-stage steps of every later unit (i2v: all generated units); an int
    means that count at every stage. ``guidance_scale`` / ``video_guidance_scale`` /
    ``use_linear_guidance`` / ``alpha`` / ``min_guidance_scale``: see :func:`guidance_schedule` (CFG runs
    one batched forward ``[negative, positive]``; ``guidance_scale`` 0 turns it off).
    ``exact_stage_end``: n full Euler steps per stage (:meth:`PyramidFlowScheduler.set_timesteps`); the
    default reproduces the reference grid. ``reference_compat``: the reference's numerics where pfctl fixes
    a quirk (i2v unit u starts from noise frame u - 1; linear guidance overwrites both scales).
    ``cuda_graphs``: replay each stage's DiT forward as a CUDA graph after its first step (same kernels, no
    launch overhead); ignored off CUDA. ``frame_per_unit``: latent frames per autoregressive unit.
    """

    num_inference_steps: int | tuple[int, ...] = (20, 20, 20)
    video_num_inference_steps: int | tuple[int, ...] = (10, 10, 10)
    guidance_scale: float = 7.0
    video_guidance_scale: float = 5.0
    use_linear_guidance: bool = False
    alpha: float = 0.5
    min_guidance_scale: float = 2.0
    exact_stage_end: bool = False
    reference_compat: bool = False
    cuda_graphs: bool = False
    frame_per_unit: int = 1

    @classmethod
    def from_config(cls, gen: GenerateConfig) -> SamplingSettings:
        """The settings a ``generate:`` config section asks for (per-prompt guidance: :func:`dataclasses.replace`)."""
        return cls(
            num_inference_steps=tuple(gen.num_inference_steps),
            video_num_inference_steps=tuple(gen.video_num_inference_steps),
            guidance_scale=gen.guidance_scale,
            video_guidance_scale=gen.video_guidance_scale,
            use_linear_guidance=gen.use_linear_guidance,
            alpha=gen.alpha,
            min_guidance_scale=gen.min_guidance_scale,
            exact_stage_end=gen.exact_stage_end,
            reference_compat=gen.reference_compat,
            cuda_graphs=gen.cuda_graphs,
        )


@dataclass
class TextConditioning:
    """The prompt's text features and, for classifier-free guidance, the negative prompt's
    (:class:`~pfctl.models.text_embeddings.TextEmbeddings`). A negative of batch 1 is broadcast to B."""

    positive: TextEmbeddings
    negative: TextEmbeddings | None = None

    @classmethod
    def from_pair(cls, positive: TextEmbeddings, negative: TextEmbeddings | None = None) -> TextConditioning:
        return cls(positive, negative)

    @property
    def batch_size(self) -> int:
        return self.positive.batch_size

    def to(self, device: torch.device | str) -> TextConditioning:
        negative = None if self.negative is None else self.negative.to(device)
        return TextConditioning(self.positive.to(device), negative)

    def model_inputs(
        self, cfg: bool, device: torch.device | str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(embeds, mask, pooled)`` for the DiT; with CFG the batch is ``[negative, positive]``."""
        text = self.positive
        if cfg:
            if self.negative is None:
                raise InputError(
                    "classifier-free guidance needs negative prompt features",
                    hint="encode the negative prompt (or the empty prompt), or set guidance_scale to 0",
                )
            b, negative = self.batch_size, self.negative
            text = TextEmbeddings.cat([negative.expand(b) if len(negative) == 1 and b > 1 else negative, text])
        text = text.to(device)
        embeds, mask, pooled = text.prompt_embeds, text.prompt_attention_mask, text.pooled_prompt_embeds
        return embeds.to(dtype=dtype), mask, pooled.to(dtype=dtype)


def guidance_schedule(
    num_units: int,
    *,
    guidance_scale: float,
    video_guidance_scale: float,
    use_linear_guidance: bool = False,
    alpha: float = 0.5,
    min_guidance_scale: float = 2.0,
    reference_compat: bool = False,
) -> list[float]:
    """CFG scale of every unit (unit 0 = first frame).

    Constant: ``guidance_scale`` for unit 0, ``video_guidance_scale`` afterwards. Linear guidance,
    ``reference_compat=True``: ``max(guidance_scale - alpha * u, min_guidance_scale)`` for every unit
    (the reference overwrites both scales, so ``video_guidance_scale`` has no effect). Linear guidance,
    default: unit 0 keeps ``guidance_scale`` and video units decay from ``video_guidance_scale``:
    ``max(video_guidance_scale - alpha * (u - 1), min_guidance_scale)``.
    """
    if not use_linear_guidance:
        return [guidance_scale] + [video_guidance_scale] * (num_units - 1)
    if reference_compat:
        return [max(guidance_scale - alpha * u, min_guidance_scale) for u in range(num_units)]
    return [guidance_scale] + [
        max(video_guidance_scale - alpha * (u - 1), min_guidance_scale) for u in range(1, num_units)
    ]


def _steps(value: int | Sequence[int], num_stages: int, name: str) -> list[int]:
    steps = [int(value)] * num_stages if isinstance(value, int) else [int(v) for v in value]
    if len(steps) != num_stages or any(s < 1 for s in steps):
        raise ConfigError(
            f"{name}={list(steps)}", hint=f"give one step count >= 1 per stage ({num_stages} stages)"
        )
    return steps


def _block_noise_fn(
    block_noises: BlockNoiseSource | None, scheduler: PyramidFlowScheduler, generator, device
) -> Callable[[tuple[int, ...]], torch.Tensor]:
    if block_noises is None:
        gen_device = generator.device if generator is not None else device
        return lambda shape: scheduler.block_noise(shape, generator, device=gen_device)
    if callable(block_noises) and not isinstance(block_noises, Iterator):
        return block_noises
    it = iter(block_noises)
    count = 0

    def take(shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal count
        try:
            noise = next(it)
        except StopIteration:
            raise InputError(f"given block noises ran out at draw #{count} (shape {list(shape)})") from None
        if tuple(noise.shape) != tuple(shape):
            raise InputError(
                f"given block noise #{count} has shape {list(noise.shape)}, expected {list(shape)}"
            )
        count += 1
        return noise

    return take


@dataclass(frozen=True)
class _Plan:
    """What one call samples, checked: stages, steps, units, guidance per unit."""

    num_stages: int
    steps_first: list[int]
    steps_video: list[int]
    num_units: int
    first_unit: int
    scales: list[float]


def _plan(
    settings: SamplingSettings, num_stages: int, temp: int, height: int, width: int, i2v: bool
) -> _Plan:
    steps_first = _steps(settings.num_inference_steps, num_stages, "num_inference_steps")
    steps_video = _steps(settings.video_num_inference_steps, num_stages, "video_num_inference_steps")
    factor = 2 ** (num_stages - 1)
    if height % factor or width % factor or height < factor or width < factor:
        raise ConfigError(
            f"latent size {height}x{width} is not divisible by {factor} (= 2^(stages-1))",
            hint=f"use pixel sizes that are multiples of {8 * factor}",
        )
    fpu = int(settings.frame_per_unit)
    if temp < 1 or (not i2v and (temp - 1) % fpu) or (i2v and temp % fpu):
        raise ConfigError(
            f"temp={temp} latent frames does not fit frame_per_unit={fpu}",
            hint="t2v needs 1 + k*frame_per_unit latent frames, i2v k*frame_per_unit",
        )
    num_units, first_unit = (temp // fpu, 1) if i2v else (1 + (temp - 1) // fpu, 0)
    scales = guidance_schedule(
        num_units,
        guidance_scale=settings.guidance_scale,
        video_guidance_scale=settings.video_guidance_scale,
        use_linear_guidance=settings.use_linear_guidance,
        alpha=settings.alpha,
        min_guidance_scale=settings.min_guidance_scale,
        reference_compat=settings.reference_compat,
    )
    return _Plan(num_stages, steps_first, steps_video, num_units, first_unit, scales)


def _unit_frames(unit: int, fpu: int, i2v: bool, reference_compat: bool) -> slice:
    """The frames of the full-resolution noise a unit starts from."""
    if unit == 0:
        return slice(0, 1)
    if i2v and reference_compat:
        return slice((unit - 1) * fpu, unit * fpu)
    return slice(1 + (unit - 1) * fpu, 1 + unit * fpu)


def _history(generated: list[torch.Tensor], num_stages: int, unit: int, fpu: int, cfg: bool) -> list[list]:
    """Per stage, the clean earlier units in the temporal-pyramid layout (doubled for the CFG batch)."""
    if not generated:
        return [[] for _ in range(num_stages)]
    clean = pyramid_latents(torch.cat(generated, dim=2), num_stages)
    history = [history_clips(clean, s, unit, fpu) for s in range(num_stages)]
    return [[torch.cat([c, c], dim=0) for c in clips] for clips in history] if cfg else history


@dataclass
class _Step:
    """The DiT inputs shared by every step of a call, and where each step's record goes."""

    embeds: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor
    text_lengths: dict[str, Any]
    cfg: bool
    on_dit_call: Callable[[dict[str, Any]], None] | None

    @classmethod
    def build(
        cls, dit: Any, text: TextConditioning, cfg: bool, device: Any, dtype: torch.dtype, on_dit_call: Any
    ) -> _Step:
        embeds, mask, pooled = text.model_inputs(cfg, device, dtype)
        # a DiT attending in row groups drops the text padding when it knows the lengths on the host (read once)
        lengths = right_padded_lengths(mask) if getattr(dit, "skip_future_keys", False) else None
        return cls(
            embeds, mask, pooled, {} if lengths is None else {"text_lengths": lengths}, cfg, on_dit_call
        )


def _run_stage(
    call_dit: Callable[..., list[torch.Tensor]],
    x: torch.Tensor,
    history: list[torch.Tensor],
    schedule: Any,
    inputs: _Step,
    *,
    unit: int,
    stage: int,
    scale: float,
    scheduler: PyramidFlowScheduler,
    device: torch.device | str,
) -> torch.Tensor:
    """The Euler steps of one stage on the CFG-guided DiT velocity."""
    # on the device once per stage: a host tensor copied in at every step would make the host wait
    # for the GPU at every step
    timesteps = schedule.timesteps.to(device)
    for i, _, sigma, sigma_next in schedule.steps():
        model_input = torch.cat([x, x], dim=0) if inputs.cfg else x
        timestep = timesteps[i].expand(model_input.shape[0]).to(model_input.dtype)
        clips = [*history, model_input]
        out = call_dit(
            sample=[clips],
            timestep_ratio=timestep,
            encoder_hidden_states=inputs.embeds,
            encoder_attention_mask=inputs.mask,
            pooled_projections=inputs.pooled,
            **inputs.text_lengths,
        )[0]
        if inputs.cfg:
            uncond, cond = out.chunk(2)
            v = uncond + scale * (cond - uncond)
        else:
            v = out
        if inputs.on_dit_call is not None:
            inputs.on_dit_call(
                {
                    "unit": unit, "stage": stage, "step": i, "sample": clips, "timestep": timestep,
                    "output": out, "guided": v, "latents": x, "sigma": float(sigma),
                    "sigma_next": float(sigma_next), "guidance": scale,
                }
            )  # fmt: skip
        x = scheduler.step(v, x, sigma, sigma_next)
    return x


def _low_noise(
    initial_noise: torch.Tensor | None,
    shape: tuple[int, ...],
    generator: Any,
    device: Any,
    dtype: torch.dtype,
    num_stages: int,
) -> torch.Tensor:
    """The lowest stage of the full-resolution noise (given, or drawn from ``generator``)."""
    if initial_noise is None:
        gen_device = generator.device if generator is not None else device
        initial_noise = torch.randn(shape, generator=generator, device=gen_device, dtype=dtype)
    elif tuple(initial_noise.shape) != shape:
        raise InputError(f"initial_noise has shape {list(initial_noise.shape)}, expected {list(shape)}")
    return pyramid_noise(initial_noise.to(device=device, dtype=dtype), num_stages)[0]


def _image_unit(
    image_latent: torch.Tensor, shape: tuple[int, ...], device: Any, dtype: torch.dtype
) -> torch.Tensor:
    """The i2v unit 0, checked against the video's shape."""
    want = [*shape[:2], 1, *shape[3:]]
    if list(image_latent.shape) != want:
        raise InputError(f"image_latent has shape {list(image_latent.shape)}, expected {want}")
    return image_latent.to(device=device, dtype=dtype)


@torch.no_grad()
def generate_latents(
    dit: Callable[..., list[torch.Tensor]],
    text: TextConditioning,
    settings: SamplingSettings = SamplingSettings(),
    *,
    temp: int,
    height: int,
    width: int,
    latent_channels: int = 16,
    initial_noise: torch.Tensor | None = None,
    block_noises: BlockNoiseSource | None = None,
    generator: torch.Generator | None = None,
    image_latent: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    graphs: StageGraph | None = None,
    on_dit_call: Callable[[dict[str, Any]], None] | None = None,
) -> torch.Tensor:
    """Sample normalised video latents ``[B, C, temp, height, width]``.

    Args:
        dit: a Pyramid DiT (``forward(sample, encoder_hidden_states, encoder_attention_mask,
            pooled_projections, timestep_ratio) -> list[Tensor]``), already on ``device``.
        text: prompt features; ``text.negative`` required when ``settings.guidance_scale > 0``.
        settings: steps, guidance, numerics (:class:`SamplingSettings`).
        temp, height, width: latent frames and latent spatial size (pixels / 8); height and width
            must be divisible by ``2 ** (stages - 1)``.
        initial_noise: ``[B, C, temp, height, width]`` full-resolution noise (reduced to the lowest
            stage by bilinear /2 and x2 per level); drawn from ``generator`` when omitted.
        block_noises: stage-transition noises in draw order (unit 0 stage 1, unit 0 stage 2, unit 1
            stage 1, ...) as an iterable, or a callable ``shape -> tensor``; default
            ``scheduler.block_noise(shape, generator)``.
        image_latent: ``[B, C, 1, height, width]`` normalised latent of a conditioning image (i2v):
            it becomes unit 0 and units 1..temp-1 are generated.
        graphs: with ``settings.cuda_graphs``, a :class:`pfctl.models.fast.cuda_graph.StageGraph` (``keep=True``) the caller holds across
            calls: each stage replays the graph an earlier video of the same size captured (the caller
            releases it). Without it, each stage captures its own graph and releases it after the stage.
        on_dit_call: receives a dict (unit, stage, step, sample, timestep, output, guided, sigma,
            sigma_next) after every DiT call; for debugging and parity localisation.
    """
    scheduler = PyramidFlowScheduler()
    i2v = image_latent is not None
    plan = _plan(settings, scheduler.num_stages, temp, height, width, i2v)
    fpu = int(settings.frame_per_unit)
    if device is None:
        device = text.positive.device
    cuda_graphs = settings.cuda_graphs and torch.device(device).type == "cuda"
    call_dit = dit
    if cuda_graphs:  # the speed layer is imported only when it is used
        from pfctl.models.fast.cuda_graph import StageGraph

        # without the caller's: one for the whole video, released after each stage (only the first warms up)
        call_dit = graphs if graphs is not None else StageGraph(dit)
    shape = (text.batch_size, latent_channels, int(temp), int(height), int(width))

    low_noise = _low_noise(initial_noise, shape, generator, device, dtype, plan.num_stages)
    cfg = settings.guidance_scale > 0
    inputs = _Step.build(dit, text, cfg, device, dtype, on_dit_call)
    next_block_noise = _block_noise_fn(block_noises, scheduler, generator, device)
    generated = [] if image_latent is None else [_image_unit(image_latent, shape, device, dtype)]

    for unit in range(plan.first_unit, plan.num_units):
        history = _history(generated, plan.num_stages, unit, fpu, cfg)
        x = low_noise[:, :, _unit_frames(unit, fpu, i2v, settings.reference_compat)]
        for stage in range(plan.num_stages):
            steps = plan.steps_first[stage] if unit == 0 else plan.steps_video[stage]
            schedule = scheduler.set_timesteps(steps, stage, exact_stage_end=settings.exact_stage_end)
            if stage > 0:
                x = upsample_nearest2(x)
                x = scheduler.renoise(x, stage, next_block_noise(tuple(x.shape)))
            x = _run_stage(
                call_dit, x, history[stage], schedule, inputs,
                unit=unit, stage=stage, scale=plan.scales[unit], scheduler=scheduler, device=device,
            )  # fmt: skip
            if cuda_graphs and graphs is None:
                call_dit.release()
        generated.append(x)

    return torch.cat(generated, dim=2)
