"""Flow math: interpolation round trips, block noise, renoising marginals, determinism, layouts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from helpers.tolerance import assert_rounding_close
from pfctl.errors import ConfigError, InputError
from pfctl.flow.loss import flow_matching_loss
from pfctl.flow.pyramid import (
    build_full_sequence_batch,
    build_temporal_pyramid_batch,
    endpoints_from_velocity,
    flow_target,
    history_layout,
    interpolate,
    merge_pyramid_batches,
    merged_row_order,
    pyramid_latents,
    pyramid_noise,
    upsample_nearest2,
)
from pfctl.flow.scheduler import PyramidFlowScheduler, block_noise
from pfctl.models.text_embeddings import TextEmbeddings
from pfctl.models.vae import FLUX_LATENT_NORM, denormalize_latents, normalize_latents
from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents, guidance_schedule


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., H, W) -> (N, 4) rows of aligned 2x2 blocks."""
    h, w = x.shape[-2], x.shape[-1]
    return x.reshape(-1, h // 2, 2, w // 2, 2).permute(0, 1, 3, 2, 4).reshape(-1, 4)


# --------------------------------------------------------------------- interpolation
def test_interpolation_round_trip_float64():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(3, 4, 2, 6, 6, generator=gen, dtype=torch.float64)
    end = torch.randn(3, 4, 2, 6, 6, generator=gen, dtype=torch.float64)
    r = torch.rand(3, 1, 1, 1, 1, generator=gen, dtype=torch.float64)
    x = interpolate(start, end, r)
    v = flow_target(start, end)
    s2, e2 = endpoints_from_velocity(x, v, r)
    torch.testing.assert_close(s2, start, rtol=0, atol=1e-12)
    torch.testing.assert_close(e2, end, rtol=0, atol=1e-12)
    # an Euler step with the exact velocity moves along the path
    torch.testing.assert_close(
        x + (0.25 - r) * v, interpolate(start, end, torch.full_like(r, 0.25)), rtol=0, atol=1e-12
    )


def test_normalisation_round_trip_and_no_mutation():
    z = torch.randn(2, 16, 3, 4, 4, dtype=torch.float64)
    before = z.clone()
    back = denormalize_latents(normalize_latents(z, FLUX_LATENT_NORM), FLUX_LATENT_NORM)
    assert torch.equal(z, before)
    torch.testing.assert_close(back, z, rtol=0, atol=1e-12)


def test_pyramid_levels_and_noise_amplitude():
    x = torch.randn(2, 3, 2, 8, 8)
    levels = pyramid_latents(x, 3)
    assert [lvl.shape[-1] for lvl in levels] == [2, 4, 8]
    # bilinear /2 with align_corners=False is the 2x2 block mean
    block_mean = x.reshape(2, 3, 2, 4, 2, 4, 2).mean(dim=(4, 6))
    assert_rounding_close(levels[1], block_mean, reduction=4, depth=2)  # another order of the same four terms
    noise = pyramid_noise(torch.randn(64, 16, 1, 32, 32, generator=torch.Generator().manual_seed(1)), 3)
    for lvl in noise:
        assert lvl.std().item() == pytest.approx(1.0, abs=0.02)


# ----------------------------------------------------------------------- block noise
@pytest.mark.parametrize("gamma", [1 / 3, 0.2])
def test_block_noise_covariance(gamma):
    gen = torch.Generator().manual_seed(2)
    noise = block_noise((16, 16, 1, 32, 32), gen, gamma=gamma)  # 65,536 blocks
    rows = _blocks(noise.double())
    cov = rows.T @ rows / rows.shape[0]
    target = (1 + gamma) * torch.eye(4, dtype=torch.float64) - gamma * torch.ones(4, 4, dtype=torch.float64)
    # standard error of an entry <= sqrt(2) * (1 + gamma) / sqrt(65536) ~ 0.007; allow ~4 s.e.
    torch.testing.assert_close(cov, target, rtol=0, atol=0.03)
    if gamma == 1 / 3:  # singular case: every block sums to zero by construction
        assert rows.sum(dim=1).abs().max().item() < 1e-5


def test_block_noise_rejects_bad_gamma_and_odd_sizes():
    with pytest.raises(ConfigError):
        block_noise((1, 1, 1, 4, 4), gamma=0.5)
    with pytest.raises(ValueError):
        block_noise((1, 1, 1, 3, 4))


def test_block_noise_is_deterministic_per_generator():
    a = block_noise((1, 2, 1, 4, 4), torch.Generator().manual_seed(5))
    b = block_noise((1, 2, 1, 4, 4), torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


# ------------------------------------------------------------------------- renoising
@pytest.mark.parametrize("stage", [1, 2])
def test_renoise_lands_on_next_stage_start_marginal(stage):
    sch = PyramidFlowScheduler()
    table = sch.stages[stage]
    alpha, _ = sch.renoise_coefficients(stage)
    sigma = table.ori_start_sigma  # where the previous stage ended
    # signal coefficient: alpha * (1 - sigma) == 1 - start_sigma (algebra, not statistics)
    assert alpha * (1 - sigma) == pytest.approx(1 - table.start_sigma, abs=1e-12)

    gen = torch.Generator().manual_seed(3)
    signal = torch.randn(1, 4, 1, 16, 16, generator=gen)
    eps = torch.randn(64, 4, 1, 16, 16, generator=gen)  # i.i.d. noise of the previous stage
    prev_end = (1 - sigma) * signal + sigma * eps
    x = sch.renoise(upsample_nearest2(prev_end), stage, sch.block_noise((64, 4, 1, 32, 32), gen))
    resid = (x - (1 - table.start_sigma) * upsample_nearest2(signal)).double()
    rows = _blocks(resid)  # 65,536 blocks
    cov = rows.T @ rows / rows.shape[0]
    expected = table.start_sigma**2 * torch.eye(4, dtype=torch.float64)
    # i.i.d. with std start_sigma: diagonal start_sigma^2, no within-block correlation
    torch.testing.assert_close(cov, expected, rtol=0, atol=0.02)
    assert resid.mean().abs().item() < 0.01


# ----------------------------------------------------------------- history layout
def test_history_layout_follows_the_temporal_pyramid():
    # stage 2 with 5 history units: newest at stage 2, next at stage 1, 3 oldest at stage 0
    assert history_layout(2, 5) == [(2, slice(-1, None)), (1, slice(-2, -1)), (0, slice(None, -2))]
    # stage 1: newest at stage 1, the rest at stage 0
    assert history_layout(1, 3) == [(1, slice(-1, None)), (0, slice(None, -1))]
    # stage 0: newest and the rest both at stage 0, as two clips
    assert history_layout(0, 3) == [(0, slice(-1, None)), (0, slice(None, -1))]
    assert history_layout(2, 2) == [(2, slice(-1, None)), (1, slice(-2, -1))]
    assert history_layout(2, 0) == []


# -------------------------------------------------------------- training builders
def _pyramid(seed=0, b=8, t=4, size=8):
    gen = torch.Generator().manual_seed(seed)
    return pyramid_latents(torch.randn(b, 16, t, size, size, generator=gen), 3)


def test_temporal_builder_is_deterministic_and_pure():
    sch = PyramidFlowScheduler()
    pyr = _pyramid()
    copies = [p.clone() for p in pyr]
    a = build_temporal_pyramid_batch(pyr, sch, (3, 3, 4), rng=torch.Generator().manual_seed(7))
    b = build_temporal_pyramid_batch(pyr, sch, (3, 3, 4), rng=torch.Generator().manual_seed(7))
    assert all(torch.equal(p, c) for p, c in zip(pyr, copies, strict=True))
    for ca, cb in zip(a.sample, b.sample, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(ca, cb, strict=True))
    assert torch.equal(a.timesteps, b.timesteps)
    # column 3 (stage 2, 4 units incl. current) = [oldest @2x2, one @4x4, newest @8x8, current @8x8]
    assert [tuple(c.shape[2:]) for c in a.sample[3]] == [(1, 2, 2), (1, 4, 4), (1, 8, 8), (1, 8, 8)]
    assert a.timesteps.shape == (8,)
    loss = flow_matching_loss([torch.zeros_like(t) for t in a.targets], a.targets, a.column_to_stage)
    assert set(loss.per_stage) == {0, 1, 2} and loss.loss.ndim == 0


def test_merged_batches_keep_every_column_and_average_the_losses():
    """Two micro-batches (other units, other clip sizes) as one DiT input: every column keeps its clips, target
    and stage; each DiT row (timestep or text, order ``b*K + k``) lands at its column's place; the loss of the
    merged predictions is the mean of the two losses, and so are the losses per stage."""
    sch = PyramidFlowScheduler()
    a = build_temporal_pyramid_batch(_pyramid(0), sch, (3, 3, 4), rng=torch.Generator().manual_seed(1))
    other = _pyramid(1, t=2, size=16)
    b = build_temporal_pyramid_batch(other, sch, (1, 1, 2), rng=torch.Generator().manual_seed(2))
    merged = merge_pyramid_batches([a, b])
    same = lambda xs, ys: len(xs) == len(ys) and all(x is y for x, y in zip(xs, ys, strict=True))  # noqa: E731
    assert all(same(x, y) for x, y in zip(merged.sample, a.sample + b.sample, strict=True))
    assert same(merged.targets, a.targets + b.targets) and same(merged.ratios, a.ratios + b.ratios)
    assert merged.column_to_stage == a.column_to_stage + b.column_to_stage
    order = merged_row_order([4, 4], per_column=2)
    assert sorted(order) == list(range(16))
    assert torch.equal(merged.timesteps, torch.cat([a.timesteps, b.timesteps])[order])
    # row b*K + k of the merged input is column k's sample b: column 5 is b's column 1
    assert torch.equal(merged.timesteps[1 * 8 + 5], b.timesteps_per_column[1][1])

    gen = torch.Generator().manual_seed(3)
    predictions = [torch.randn(t.shape, generator=gen) for t in merged.targets]
    whole = flow_matching_loss(predictions, merged.targets, merged.column_to_stage)
    parts = [
        flow_matching_loss(predictions[:4], a.targets, a.column_to_stage),
        flow_matching_loss(predictions[4:], b.targets, b.column_to_stage),
    ]
    assert_rounding_close(whole.loss, (parts[0].loss + parts[1].loss) / 2, reduction=16)
    for stage, value in whole.per_stage.items():
        assert_rounding_close(value, (parts[0].per_stage[stage] + parts[1].per_stage[stage]) / 2, reduction=16)
    other = build_temporal_pyramid_batch(_pyramid(b=4), sch, (3, 3, 4), rng=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="samples per column"):
        merge_pyramid_batches([a, other])


def test_builders_reject_bad_batch():
    sch = PyramidFlowScheduler()
    with pytest.raises(ConfigError, match="multiple"):
        build_full_sequence_batch(_pyramid(b=6), sch)


def test_given_draws_are_shape_checked():
    sch = PyramidFlowScheduler()
    with pytest.raises(ValueError, match="shape"):
        build_full_sequence_batch(_pyramid(), sch, rng=[torch.zeros(1)])


# ---------------------------------------------------------------------- sampling
class TinyDiT(torch.nn.Module):
    """Deterministic stand-in: velocity from the current clip, its history and the text."""

    def forward(
        self, *, sample, timestep_ratio, encoder_hidden_states, encoder_attention_mask, pooled_projections
    ):
        outs = []
        for clips in sample:
            cur = clips[-1]
            ctx = sum(c.mean() for c in clips[:-1]) if len(clips) > 1 else 0.0
            bias = pooled_projections.mean(dim=1).view(-1, 1, 1, 1, 1)
            outs.append(0.5 * cur + 0.1 * ctx + bias + 1e-4 * timestep_ratio.view(-1, 1, 1, 1, 1))
        return outs


def _text(b=1, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def mk():
        return (
            torch.randn(b, 5, 8, generator=gen),
            torch.ones(b, 5, dtype=torch.long),
            torch.randn(b, 6, generator=gen),
        )

    return TextConditioning(TextEmbeddings(*mk()), TextEmbeddings(*mk()))


STEPS = SamplingSettings(num_inference_steps=(2, 2, 2), video_num_inference_steps=(1, 1, 1))


def _gen_kwargs():
    return dict(settings=STEPS, temp=3, height=8, width=8)


def test_sampling_given_noise_is_deterministic():
    dit, text = TinyDiT(), _text()
    a = generate_latents(dit, text, generator=torch.Generator().manual_seed(11), **_gen_kwargs())
    b = generate_latents(dit, text, generator=torch.Generator().manual_seed(11), **_gen_kwargs())
    assert torch.equal(a, b) and a.shape == (1, 16, 3, 8, 8)
    # replaying the generator's draws as given noise reproduces the run
    gen = torch.Generator().manual_seed(11)
    noise = torch.randn((1, 16, 3, 8, 8), generator=gen)
    sch = PyramidFlowScheduler()
    blocks = [sch.block_noise((1, 16, 1, 4 * 2**i, 4 * 2**i), gen) for _ in range(3) for i in range(2)]
    c = generate_latents(dit, text, initial_noise=noise, block_noises=blocks, **_gen_kwargs())
    assert torch.equal(a, c)


def test_sampling_i2v_keeps_the_image_and_checks_inputs():
    dit, text = TinyDiT(), _text()
    image = torch.randn(1, 16, 1, 8, 8)
    out = generate_latents(
        dit, text, image_latent=image, generator=torch.Generator().manual_seed(0), **_gen_kwargs()
    )
    assert torch.equal(out[:, :, :1], image) and out.shape[2] == 3
    with pytest.raises(InputError):
        generate_latents(dit, text, initial_noise=torch.zeros(1, 16, 2, 8, 8), **_gen_kwargs())
    with pytest.raises(ConfigError):
        generate_latents(dit, text, **{**_gen_kwargs(), "height": 6})


def test_sampling_exact_stage_end_runs_n_full_steps():
    calls = []
    generate_latents(
        TinyDiT(),
        _text(),
        generator=torch.Generator().manual_seed(0),
        on_dit_call=lambda info: calls.append((info["sigma"], info["sigma_next"])),
        **{**_gen_kwargs(), "settings": replace(STEPS, exact_stage_end=True)},
    )
    assert calls[:2] == [(1.0, 0.5), (0.5, 0.0)]


def test_guidance_schedule():
    assert guidance_schedule(3, guidance_scale=7, video_guidance_scale=5) == [7, 5, 5]
    ref = guidance_schedule(
        4,
        guidance_scale=7,
        video_guidance_scale=5,
        use_linear_guidance=True,
        alpha=1.5,
        min_guidance_scale=3,
        reference_compat=True,
    )
    assert ref == [7, 5.5, 4, 3]
    fixed = guidance_schedule(
        4, guidance_scale=7, video_guidance_scale=5, use_linear_guidance=True, alpha=1.5, min_guidance_scale=3
    )
    assert fixed == [7, 5, 3.5, 3]
    assert math.isclose(guidance_schedule(1, guidance_scale=7, video_guidance_scale=5)[0], 7)


def test_sampling_settings_take_every_sampler_setting_of_the_config():
    from dataclasses import fields

    from pfctl.config import load_config

    gen = load_config(
        None,
        ["generate.num_inference_steps=[3,2,1]", "generate.video_num_inference_steps=[4,4,2]",
         "generate.guidance_scale=6.5", "generate.video_guidance_scale=4.5", "generate.use_linear_guidance=true",
         "generate.alpha=0.25", "generate.min_guidance_scale=1.5", "generate.exact_stage_end=true",
         "generate.reference_compat=true", "generate.cuda_graphs=false"],
    ).generate  # fmt: skip
    settings = SamplingSettings.from_config(gen)
    assert (settings.num_inference_steps, settings.video_num_inference_steps) == ((3, 2, 1), (4, 4, 2))
    for f in fields(settings):
        if f.name in type(gen).model_fields and f.name not in (
            "num_inference_steps",
            "video_num_inference_steps",
        ):
            assert getattr(settings, f.name) == getattr(gen, f.name), f.name
    assert (settings.alpha, settings.exact_stage_end, settings.cuda_graphs) == (0.25, True, False)
