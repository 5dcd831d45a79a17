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
    from pfctl.models.fast.cuda_graph import StageGraph

__all__ = ["TextConditioning", "generate_latents", "guidance_schedule"]

BlockNoiseSource = Iterable[torch.Tensor] | Callable[[tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True)
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

    def model_inputs(self, cfg: bool, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


@torch.no_grad()
def generate_latents(
    dit: Callable[..., list[torch.Tensor]],
    text: TextConditioning,
    *,
    temp: int,
    height: int,
    width: int,
    num_inference_steps: int | Sequence[int] = (20, 20, 20),
    video_num_inference_steps: int | Sequence[int] = (10, 10, 10),
    guidance_scale: float = 7.0,
    video_guidance_scale: float = 5.0,
    use_linear_guidance: bool = False,
    alpha: float = 0.5,
    min_guidance_scale: float = 2.0,
    initial_noise: torch.Tensor | None = None,
    block_noises: BlockNoiseSource | None = None,
    generator: torch.Generator | None = None,
    image_latent: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    latent_channels: int = 16,
    frame_per_unit: int = 1,
    scheduler: PyramidFlowScheduler | None = None,
    exact_stage_end: bool = False,
    reference_compat: bool = False,
    cuda_graphs: bool = False,
    graphs: StageGraph | None = None,
    callback: Callable[[int, int], None] | None = None,
    on_dit_call: Callable[[dict[str, Any]], None] | None = None,
) -> torch.Tensor:
    """Sample normalised video latents ``[B, C, temp, height, width]``.

    Args:
        dit: a Pyramid DiT (``forward(sample, encoder_hidden_states, encoder_attention_mask,
            pooled_projections, timestep_ratio) -> list[Tensor]``), already on ``device``.
        text: prompt features; ``negative_*`` required when ``guidance_scale > 0``.
        temp, height, width: latent frames and latent spatial size (pixels / 8); height and width
            must be divisible by ``2 ** (stages - 1)``.
        num_inference_steps: per-stage steps of the first frame (t2v unit 0).
        video_num_inference_steps: per-stage steps of every later unit (i2v: all generated units).
        guidance_scale / video_guidance_scale / use_linear_guidance / alpha / min_guidance_scale:
            see :func:`guidance_schedule`. CFG runs one batched forward ``[negative, positive]``.
        initial_noise: ``[B, C, temp, height, width]`` full-resolution noise (reduced to the lowest
            stage by bilinear /2 and x2 per level); drawn from ``generator`` when omitted.
        block_noises: stage-transition noises in draw order (unit 0 stage 1, unit 0 stage 2, unit 1
            stage 1, ...) as an iterable, or a callable ``shape -> tensor``; default
            ``scheduler.block_noise(shape, generator)``.
        image_latent: ``[B, C, 1, height, width]`` normalised latent of a conditioning image (i2v):
            it becomes unit 0 and units 1..temp-1 are generated.
        reference_compat: reproduce the reference's numerics where pfctl fixes a quirk: i2v unit u
            starts from noise frame u - 1 (pfctl: frame u, as t2v), and linear guidance overwrites
            both scales (see :func:`guidance_schedule`).
        cuda_graphs: replay each stage's DiT forward as a CUDA graph after its first step
            (:class:`pfctl.models.fast.cuda_graph.StageGraph`: same kernels, no launch overhead);
            ignored off CUDA.
        graphs: with ``cuda_graphs``, a ``StageGraph(dit, keep=True)`` the caller holds across calls: each
            stage replays the graph an earlier video of the same size captured (the caller releases it).
        exact_stage_end: use n full Euler steps per stage (see
            :meth:`PyramidFlowScheduler.set_timesteps`); the default reproduces the reference grid.
        callback: ``callback(unit, num_units)`` before each unit.
        on_dit_call: receives a dict (unit, stage, step, sample, timestep, output, guided, sigma,
            sigma_next) after every DiT call; for debugging and parity localisation.
    """
    scheduler = scheduler or PyramidFlowScheduler()
    num_stages = scheduler.num_stages
    steps_first = _steps(num_inference_steps, num_stages, "num_inference_steps")
    steps_video = _steps(video_num_inference_steps, num_stages, "video_num_inference_steps")
    factor = 2 ** (num_stages - 1)
    if height % factor or width % factor or height < factor or width < factor:
        raise ConfigError(
            f"latent size {height}x{width} is not divisible by {factor} (= 2^(stages-1))",
            hint=f"use pixel sizes that are multiples of {8 * factor}",
        )
    fpu = int(frame_per_unit)
    i2v = image_latent is not None
    if temp < 1 or (not i2v and (temp - 1) % fpu) or (i2v and temp % fpu):
        raise ConfigError(
            f"temp={temp} latent frames does not fit frame_per_unit={fpu}",
            hint="t2v needs 1 + k*frame_per_unit latent frames, i2v k*frame_per_unit",
        )
    if device is None:
        device = text.positive.device
    cuda_graphs = cuda_graphs and torch.device(device).type == "cuda"
    if cuda_graphs:
        from pfctl.models.fast.cuda_graph import StageGraph
    batch = text.batch_size
    shape = (batch, latent_channels, int(temp), int(height), int(width))

    if initial_noise is None:
        gen_device = generator.device if generator is not None else device
        initial_noise = torch.randn(shape, generator=generator, device=gen_device, dtype=dtype)
    elif tuple(initial_noise.shape) != shape:
        raise InputError(f"initial_noise has shape {list(initial_noise.shape)}, expected {list(shape)}")
    low_noise = pyramid_noise(initial_noise.to(device=device, dtype=dtype), num_stages)[0]

    cfg = guidance_scale > 0
    embeds, mask, pooled = text.model_inputs(cfg, device, dtype)
    # a DiT attending in row groups drops the text padding when it knows the lengths on the host (read once)
    lengths = right_padded_lengths(mask) if getattr(dit, "skip_future_keys", False) else None
    text_lengths = {} if lengths is None else {"text_lengths": lengths}
    next_block_noise = _block_noise_fn(block_noises, scheduler, generator, device)

    if i2v:
        if tuple(image_latent.shape) != (batch, latent_channels, 1, height, width):
            raise InputError(
                f"image_latent has shape {list(image_latent.shape)}, expected {[batch, latent_channels, 1, height, width]}"
            )
        generated = [image_latent.to(device=device, dtype=dtype)]
        num_units, first_unit = temp // fpu, 1
    else:
        generated = []
        num_units, first_unit = 1 + (temp - 1) // fpu, 0
    scales = guidance_schedule(
        num_units,
        guidance_scale=guidance_scale,
        video_guidance_scale=video_guidance_scale,
        use_linear_guidance=use_linear_guidance,
        alpha=alpha,
        min_guidance_scale=min_guidance_scale,
        reference_compat=reference_compat,
    )

    for unit in range(first_unit, num_units):
        if callback is not None:
            callback(unit, num_units)
        if unit == 0:
            frames = slice(0, 1)
        elif i2v and reference_compat:
            frames = slice((unit - 1) * fpu, unit * fpu)
        else:
            frames = slice(1 + (unit - 1) * fpu, 1 + unit * fpu)
        if generated:
            clean = pyramid_latents(torch.cat(generated, dim=2), num_stages)
            history = [history_clips(clean, s, unit, fpu) for s in range(num_stages)]
            if cfg:
                history = [[torch.cat([c, c], dim=0) for c in clips] for clips in history]
        else:
            history = [[] for _ in range(num_stages)]

        x = low_noise[:, :, frames]
        for stage in range(num_stages):
            schedule = scheduler.set_timesteps(
                steps_first[stage] if unit == 0 else steps_video[stage],
                stage,
                exact_stage_end=exact_stage_end,
            )
            if stage > 0:
                x = upsample_nearest2(x)
                x = scheduler.renoise(x, stage, next_block_noise(tuple(x.shape)))
            call_dit = (graphs if graphs is not None else StageGraph(dit)) if cuda_graphs else dit
            # on the device once per stage: a host tensor copied in at every step would make the host wait
            # for the GPU at every step
            timesteps = schedule.timesteps.to(device)
            for i, _, sigma, sigma_next in schedule.steps():
                model_input = torch.cat([x, x], dim=0) if cfg else x
                timestep = timesteps[i].expand(model_input.shape[0]).to(model_input.dtype)
                clips = [*history[stage], model_input]
                out = call_dit(
                    sample=[clips],
                    timestep_ratio=timestep,
                    encoder_hidden_states=embeds,
                    encoder_attention_mask=mask,
                    pooled_projections=pooled,
                    **text_lengths,
                )[0]
                if cfg:
                    uncond, cond = out.chunk(2)
                    v = uncond + scales[unit] * (cond - uncond)
                else:
                    v = out
                if on_dit_call is not None:
                    on_dit_call(
                        {
                            "unit": unit,
                            "stage": stage,
                            "step": i,
                            "sample": clips,
                            "timestep": timestep,
                            "output": out,
                            "guided": v,
                            "latents": x,
                            "sigma": float(sigma),
                            "sigma_next": float(sigma_next),
                            "guidance": scales[unit],
                        }
                    )
                x = scheduler.step(v, x, sigma, sigma_next)
            if cuda_graphs and graphs is None:
                call_dit.release()
        generated.append(x)

    return torch.cat(generated, dim=2)
