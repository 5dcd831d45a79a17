"""CausalVideoVAE and its adapter on tiny models (CPU, a second or two each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from helpers.tolerance import assert_rounding_close
from pfctl.errors import ConfigError, InputError, ModelLoadError
from pfctl.models.causal_vae import CausalVideoVAE, FrameCache
from pfctl.models.vae import (
    FLUX_LATENT_NORM,
    SD3_LATENT_NORM,
    LatentNorm,
    Posterior,
    PyramidCausalVAE,
    VideoVAE,
    build_tiny_causal_vae,
    denormalize_latents,
    load_vae,
    normalize_latents,
)

TOL = 1e-5
ENCODE = {"reduction": 16 * 27, "depth": 20}
"""The tiny VAE's sums for an encode (or a decode): 3x3x3 convolutions over at most 16 channels, about 20 of
them chained (helpers.tolerance derives the tolerance from these)."""


@pytest.fixture(scope="module")
def vae() -> CausalVideoVAE:
    return build_tiny_causal_vae()


@pytest.fixture(scope="module")
def video() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.rand(1, 3, 17, 8, 8, generator=gen) * 2 - 1


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- shapes and chunking ---------------------------------------------------------------------------


def test_shapes(vae: CausalVideoVAE, video: torch.Tensor) -> None:
    with torch.no_grad():
        post = vae.encode(video)
        assert post.mean.shape == (1, 16, 3, 1, 1)
        assert post.std.shape == post.mean.shape == post.logvar.shape
        assert post.moments.shape == (1, 32, 3, 1, 1)
        assert vae.decode(post.mean).shape == (1, 3, 17, 8, 8)
        # an image is a one-frame video
        assert vae.encode(video[:, :, :1]).mean.shape == (1, 16, 1, 1, 1)
        assert vae.decode(torch.zeros(1, 16, 1, 2, 3)).shape == (1, 3, 1, 16, 24)


def test_chunked_equals_full(vae: CausalVideoVAE, video: torch.Tensor) -> None:
    """Per-frame norms + causal convs with carried context: chunking is exact up to rounding."""
    with torch.no_grad():
        full = vae.encode(video)
        for window in (8, 16):
            chunked = vae.encode(video, temporal_chunk=True, window_size=window)
            assert _max_diff(chunked.mean, full.mean) < TOL
            assert _max_diff(chunked.std, full.std) < TOL
        z = full.mean
        decoded = vae.decode(z)
        for window in (1, 2):
            assert _max_diff(vae.decode(z, temporal_chunk=True, window_size=window), decoded) < TOL


def test_chunking_has_no_hidden_state(vae: CausalVideoVAE, video: torch.Tensor) -> None:
    """Two chunked calls never interfere: nothing is stored on the modules between calls."""
    before = {name: set(vars(m)) for name, m in vae.named_modules()}
    other = torch.flip(video, dims=[2])
    with torch.no_grad():
        a1 = vae.encode(video, temporal_chunk=True, window_size=8).mean
        vae.encode(other, temporal_chunk=True, window_size=8)
        a2 = vae.encode(video, temporal_chunk=True, window_size=8).mean
        d1 = vae.decode(a1, temporal_chunk=True, window_size=1)
        vae.decode(a1.flip(2), temporal_chunk=True, window_size=1)
        d2 = vae.decode(a1, temporal_chunk=True, window_size=1)
    assert torch.equal(a1, a2)
    assert torch.equal(d1, d2)
    assert {name: set(vars(m)) for name, m in vae.named_modules()} == before


def test_frame_cache_is_per_call() -> None:
    cache = FrameCache()
    assert cache.first_chunk
    cache.next_chunk()
    assert not cache.first_chunk
    with pytest.raises(RuntimeError):
        cache.get(torch.nn.Identity())


def test_chunked_encode_validation(vae: CausalVideoVAE, video: torch.Tensor) -> None:
    with pytest.raises(ConfigError, match="12"):
        vae.encode(video, temporal_chunk=True, window_size=12)
    with pytest.raises(InputError, match="16"):
        vae.encode(video[:, :, :16], temporal_chunk=True, window_size=8)
    with pytest.raises(ConfigError, match="0"):
        vae.decode(torch.zeros(1, 16, 3, 1, 1), temporal_chunk=True, window_size=0)
    with pytest.raises(InputError, match="shape"):
        vae.encode(video[0])


# ---- tiling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [16, 24, 48, 0, -32, 33])
def test_tile_size_validation(vae: CausalVideoVAE, video: torch.Tensor, size: int) -> None:
    with pytest.raises(ConfigError) as info:
        vae.encode(video[:, :, :1], tile_sample_min_size=size)
    assert str(size) in info.value.message and "32" in info.value.message
    with pytest.raises(ConfigError):
        vae.decode(torch.zeros(1, 16, 1, 2, 2), tile_sample_min_size=size)


def test_tiled_shapes_and_no_tiling_when_small(vae: CausalVideoVAE) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(1, 3, 9, 56, 40, generator=gen) * 2 - 1  # not square, not a tile multiple
    with torch.no_grad():
        tiled = vae.encode(x, tile_sample_min_size=32)
        assert tiled.mean.shape == (1, 16, 2, 7, 5)
        chunked = vae.encode(x, tile_sample_min_size=32, temporal_chunk=True, window_size=8)
        assert _max_diff(chunked.mean, tiled.mean) < TOL
        out = vae.decode(tiled.mean[:, :, :1], tile_sample_min_size=32)
        assert out.shape == (1, 3, 1, 56, 40)
        # tile larger than the frame: the untiled path, bitwise
        assert torch.equal(vae.encode(x, tile_sample_min_size=128).mean, vae.encode(x).mean)
        z = tiled.mean[:, :, :1]
        assert torch.equal(vae.decode(z, tile_sample_min_size=128), vae.decode(z))


def _reference_stitch(tiles: list[list[torch.Tensor]], extent: int, keep: int) -> torch.Tensor:
    """The reference's tiling epilogue, written out independently: collect every tile, blend
    row by row with Python-float weights (above first, then left), keep the top-left parts."""

    def blend(prev: torch.Tensor, cur: torch.Tensor, dim: int) -> torch.Tensor:
        e = min(prev.shape[dim], cur.shape[dim], extent)
        cur = cur.clone()
        for y in range(e):
            mixed = prev.select(dim, prev.shape[dim] - e + y) * (1 - y / e) + cur.select(dim, y) * (y / e)
            cur.select(dim, y).copy_(mixed)
        return cur

    rows = []
    for r, row in enumerate(tiles):
        done = []
        for c, tile in enumerate(row):
            if r:
                tile = blend(tiles[r - 1][c], tile, 3)
            if c:
                tile = blend(done[-1], tile, 4)
            done.append(tile)
        tiles[r] = done
        rows.append(torch.cat([t[:, :, :, :keep, :keep] for t in done], dim=4))
    return torch.cat(rows, dim=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_stitching_is_the_reference_bitwise(dtype: torch.dtype) -> None:
    """Tiles stream into the output keeping only their edges; the result must be exactly the
    collect-then-blend epilogue of the reference (ragged last row and column included)."""
    vae = build_tiny_causal_vae().to(dtype)
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(1, 16, 2, 11, 7, generator=gen).to(dtype)  # tile 4 latents, step 3: ragged edges
    x = (torch.rand(1, 3, 9, 88, 56, generator=gen) * 2 - 1).to(dtype)  # tile 32 px, step 24
    with torch.no_grad():
        ours = vae.decode(z, temporal_chunk=True, window_size=1, tile_sample_min_size=32)
        tiles = [
            [
                vae.decode(z[..., i : i + 4, j : j + 4], temporal_chunk=True, window_size=1)
                for j in range(0, 7, 3)
            ]
            for i in range(0, 11, 3)
        ]
        assert torch.equal(ours, _reference_stitch(tiles, extent=8, keep=24))
        ours = vae.encode(x, tile_sample_min_size=32).moments
        tiles = [
            [vae.encode(x[..., i : i + 32, j : j + 32]).moments for j in range(0, 56, 24)]
            for i in range(0, 88, 24)
        ]
        assert torch.equal(ours, _reference_stitch(tiles, extent=1, keep=3))


def test_decode_output_dtype_is_a_lossless_cast() -> None:
    vae = build_tiny_causal_vae().to(torch.bfloat16)
    z = torch.randn(1, 16, 3, 6, 5, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for kwargs in ({}, {"temporal_chunk": True, "window_size": 1}, {"tile_sample_min_size": 32}):
        with torch.no_grad():
            plain = vae.decode(z, **kwargs)
            wide = vae.decode(z, output_dtype=torch.float32, **kwargs)
        assert plain.dtype == torch.bfloat16 and wide.dtype == torch.float32
        assert torch.equal(wide, plain.float()), kwargs


def test_frame_cache_holds_only_the_context_frames(vae: CausalVideoVAE) -> None:
    """Each conv keeps the few frames the next chunk needs as its own copy: a view would keep the
    chunk's whole (padded) input alive, which at full resolution is hundreds of MB per layer."""
    cache = FrameCache()
    z = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        vae.decoder(vae.post_quant_conv(z, cache), cache)
    kept = list(cache._tails.values())
    assert kept
    for frames in kept:
        assert frames.shape[2] <= 2
        assert frames.untyped_storage().nbytes() == frames.numel() * frames.element_size()


_FUSED_CHECK = """
import torch, torch.nn.functional as F
from pfctl.models.causal_vae.conv import FrameGroupNorm
from pfctl.models.fast import vae_norm as fused
torch.manual_seed(0)
worst = 0.0
for c, g, t, h, w, affine in [(64, 32, 3, 5, 7, True), (96, 32, 2, 9, 4, False), (48, 16, 1, 33, 17, True)]:
    norm = FrameGroupNorm(g, c, eps=1e-6, affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.normal_(), norm.bias.normal_()
    x = (torch.randn(2, c, t, h, w) * 3 + 1).to(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        ref = norm(x.contiguous())  # the nn.GroupNorm path, frame by frame
        for silu in (False, True):
            y = fused.group_norm_act(x, g, norm.weight if affine else None, norm.bias if affine else None, 1e-6, silu)
            assert y.is_contiguous(memory_format=torch.channels_last_3d)
            expected = F.silu(ref) if silu else ref
            worst = max(worst, (y - expected).abs().max().item())
            # written behind a causal conv's two context frames, per clip of the batch
            front = torch.randn(2, c, 2, h, w).to(memory_format=torch.channels_last_3d)
            y = fused.group_norm_act(x, g, norm.weight if affine else None, norm.bias if affine else None, 1e-6, silu, front)
            worst = max(worst, (y - torch.cat([front, expected], dim=2)).abs().max().item())
            # a conv's left-out bias folded into the statistics and the shift
            xb = torch.randn(c)
            want = norm((x + xb.view(-1, 1, 1, 1)).contiguous())
            want = F.silu(want) if silu else want
            y = fused.group_norm_act(x, g, norm.weight if affine else None, norm.bias if affine else None, 1e-6, silu, None, xb)
            worst = max(worst, (y - want).abs().max().item())
    # bias (+ residual) added in place, channels innermost
    r = torch.randn(x.shape).to(memory_format=torch.channels_last_3d)
    for residual in (None, r):
        y = x.clone()
        fused.add_bias(y, xb, residual)
        want = x + xb.view(-1, 1, 1, 1) + (0 if residual is None else residual)
        assert y.is_contiguous(memory_format=torch.channels_last_3d)
        worst = max(worst, (y - want).abs().max().item())
print(worst)
"""

_FUSED_MODEL_CHECK = """
import torch, torch.nn.functional as F
import pfctl.models.fast as fast
from pfctl.models.causal_vae.conv import is_channels_last
from pfctl.models.fast import vae_norm as fused
from pfctl.models.vae import build_tiny_causal_vae
fast._vae_kernels_work = lambda: None  # the interpreter runs them on the CPU
conv3d = F.conv3d
def keep_layout(x, *args, **kwargs):  # cuDNN keeps channels-last; the CPU's convs do not
    y = conv3d(x, *args, **kwargs)
    return y.contiguous(memory_format=torch.channels_last_3d) if is_channels_last(x) else y
F.conv3d = keep_layout
fused.applies = lambda x: x.ndim == 5 and is_channels_last(x) and not torch.is_grad_enabled()
calls = {"folded": 0, "bias": 0, "residual": 0}
norm_act, add_bias = fused.group_norm_act, fused.add_bias
def counted_norm(*args):
    calls["folded"] += args[-1] is not None
    return norm_act(*args)
def counted_bias(y, bias, residual=None):
    calls["residual" if residual is not None else "bias"] += 1
    return add_bias(y, bias, residual)
fused.group_norm_act, fused.add_bias = counted_norm, counted_bias
model = build_tiny_causal_vae()
for p in model.parameters():
    if p.ndim == 1:
        torch.nn.init.normal_(p, 0.0, 0.1)  # non-zero biases: a lost or doubled bias shows
video = torch.rand(1, 3, 17, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1
with torch.no_grad():  # the plain model, default layout
    mean = model.encode(video, temporal_chunk=True, window_size=8).mean
    pixels = model.decode(mean, temporal_chunk=True, window_size=1)
    assert not any(calls.values())
    assert fast.apply_fast_paths(model, fast.FastPaths()) == ["fused VAE norms"]
    model.use_channels_last()
    mean_cl = model.encode(video, temporal_chunk=True, window_size=8).mean
    pixels_cl = model.decode(mean, temporal_chunk=True, window_size=1)
assert all(calls.values()), calls
print(max((mean_cl - mean).abs().max().item(), (pixels_cl - pixels).abs().max().item()))
"""


def _in_triton_interpreter(script: str, timeout: float) -> float:
    """Run ``script`` in a fresh interpreter with Triton's CPU interpreter on; the last number it prints."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout.split()[-1])


def test_fused_group_norm_kernels_in_the_triton_interpreter() -> None:
    """The Triton norm (+ SiLU) and bias kernels the channels-last VAE uses on CUDA, run on CPU by
    Triton's interpreter against nn.GroupNorm frame by frame (float32: agreement to 1e-5). Odd channel
    counts, frame sizes that do not fill a block, no affine parameters, output behind context frames, a
    conv bias folded in, and the bias (+ residual) kernel."""
    assert _in_triton_interpreter(_FUSED_CHECK, timeout=120) < 1e-5


def test_fused_kernels_in_a_channels_last_model_in_the_triton_interpreter() -> None:
    """The whole tiny VAE, channels-last, with the Triton kernels (interpreter, CPU convs made to keep
    the layout as cuDNN does): the convs' biases folded into the next norm, the residual sums and the
    upsamplers' copies give the default path's encode and decode (float32: agreement to 1e-4)."""
    assert _in_triton_interpreter(_FUSED_MODEL_CHECK, timeout=300) < 1e-4


def test_a_vae_kernel_that_cannot_run_is_left_off_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback is decided once, when the fast paths are applied: kernels that do not compile for the
    GPU leave the VAE's modules as they are, with one warning; nothing switches at run time."""
    import pfctl.models.fast as fast
    from pfctl.models.fast.vae_norm import FusedFrameGroupNorm

    warnings: list[str] = []
    monkeypatch.setattr(fast, "_vae_kernels_work", lambda: "RuntimeError: no kernel image for this device")
    monkeypatch.setattr(fast.pflog, "warn", warnings.append)
    model = build_tiny_causal_vae()
    assert fast.apply_fast_paths(model, fast.FastPaths()) == []
    assert len(warnings) == 1 and "fused VAE norms" in warnings[0] and "no kernel image" in warnings[0]
    assert not any(isinstance(m, FusedFrameGroupNorm) for m in model.modules())


def test_fused_modules_fold_every_bias_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fused modules leave the convs' biases out (folded into the next norm, the residual sum or
    a plain add), no bias is lost or doubled: with the kernels replaced by the same arithmetic in PyTorch,
    the channels-last model (CPU convs made to keep the layout, as cuDNN does) gives the plain model's
    encode and decode."""
    import torch.nn.functional as F

    import pfctl.models.fast as fast
    from pfctl.models.causal_vae.conv import from_frames, is_channels_last, to_frames
    from pfctl.models.fast import vae_norm

    conv3d = F.conv3d
    calls = {"norm": 0, "bias": 0}

    def keep_layout(x, *args, **kwargs):
        y = conv3d(x, *args, **kwargs)
        return y.contiguous(memory_format=torch.channels_last_3d) if is_channels_last(x) else y

    def norm_act(x, groups, weight, bias, eps, silu, front=None, x_bias=None):
        calls["norm"] += 1
        x = x if x_bias is None else x + x_bias.view(-1, 1, 1, 1)
        y = from_frames(F.group_norm(to_frames(x.contiguous()), groups, weight, bias, eps), x.shape[2])
        y = F.silu(y) if silu else y
        y = y if front is None else torch.cat([front, y], dim=2)
        return y.contiguous(memory_format=torch.channels_last_3d)

    def add_bias(y, bias, residual=None):
        calls["bias"] += 1
        y.add_(bias.view(-1, 1, 1, 1))
        return y if residual is None else y.add_(residual)

    monkeypatch.setattr(F, "conv3d", keep_layout)
    monkeypatch.setattr(fast, "_vae_kernels_work", lambda: None)
    monkeypatch.setattr(vae_norm, "applies", lambda x: x.ndim == 5 and is_channels_last(x))
    monkeypatch.setattr(vae_norm, "group_norm_act", norm_act)
    monkeypatch.setattr(vae_norm, "add_bias", add_bias)
    model = build_tiny_causal_vae()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
        video = torch.rand(1, 3, 9, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
        mean = model.encode(video, temporal_chunk=True, window_size=8).mean
        pixels = model.decode(mean, temporal_chunk=True, window_size=1)
        assert fast.apply_fast_paths(model, fast.FastPaths()) == ["fused VAE norms"]
        model.use_channels_last()
        mean_cl = model.encode(video, temporal_chunk=True, window_size=8).mean
        pixels_cl = model.decode(mean, temporal_chunk=True, window_size=1)
    assert calls["norm"] > 0 and calls["bias"] > 0
    assert_rounding_close(mean_cl, mean, **ENCODE)  # channels-last: other convolution kernels
    assert_rounding_close(pixels_cl, pixels, **ENCODE)


# ---- training / purity -------------------------------------------------------------------------------


def test_forward_backward_cpu() -> None:
    model = build_tiny_causal_vae().train()
    x = torch.rand(1, 3, 9, 16, 16) * 2 - 1  # 2x2 latent tokens: attention gets a gradient
    posterior, recon = model(x, sample_posterior=True, generator=torch.Generator().manual_seed(0))
    assert recon.shape == x.shape
    kl = 0.5 * (posterior.mean**2 + posterior.var - 1 - posterior.logvar).mean()
    loss = (recon - x).pow(2).mean() + 1e-3 * kl
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["encoder.mid_block.attentions.0.to_q.weight"].abs().sum() > 0
    assert grads["encoder.conv_in.conv.weight"].abs().sum() > 0


def test_gradient_checkpointing_same_grads() -> None:
    x = torch.rand(1, 3, 1, 8, 8) * 2 - 1
    grads = []
    for ckpt in (False, True):
        model = build_tiny_causal_vae().train()
        if ckpt:
            model.enable_gradient_checkpointing()
        _, recon = model(x)
        recon.pow(2).mean().backward()
        grads.append(model.decoder.conv_in.conv.weight.grad.clone())
    # two models, and a recomputed forward: the same sums, perhaps in another order
    assert_rounding_close(grads[1], grads[0], reduction=ENCODE["reduction"], depth=2 * ENCODE["depth"])


def test_inputs_not_mutated(vae: CausalVideoVAE, video: torch.Tensor) -> None:
    x = video.clone()
    with torch.no_grad():
        vae.encode(x)
        vae.encode(x, temporal_chunk=True, window_size=8)
        big = torch.nn.functional.interpolate(x[:, :, :1].flatten(1, 2), scale_factor=5).unflatten(1, (3, 1))
        big_copy = big.clone()
        vae.encode(big, tile_sample_min_size=32)
        z = torch.randn(1, 16, 2, 5, 5)
        z_copy = z.clone()
        vae.decode(z, temporal_chunk=True, window_size=1, tile_sample_min_size=32)
    assert torch.equal(x, video)
    assert torch.equal(big, big_copy)
    assert torch.equal(z, z_copy)
    n = normalize_latents(z, FLUX_LATENT_NORM)
    denormalize_latents(n, FLUX_LATENT_NORM)
    assert torch.equal(z, z_copy)


def test_posterior_sampling_is_reproducible(vae: CausalVideoVAE, video: torch.Tensor) -> None:
    with torch.no_grad():
        post = vae.encode(video[:, :, :1])
    a = post.sample(torch.Generator().manual_seed(1))
    b = post.sample(torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    eps = torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, post.mean + post.std * eps)
    p = Posterior(post.mean, post.std)
    assert torch.equal(p.sample(torch.Generator().manual_seed(1)), a)


# ---- normalisation -----------------------------------------------------------------------------------


def test_latent_norm_rules() -> None:
    z = torch.randn(2, 16, 3, 2, 2)
    n = normalize_latents(z, FLUX_LATENT_NORM)
    assert torch.allclose(n[:, :, 0], (z[:, :, 0] + 0.04) / 1.8726)
    assert torch.allclose(n[:, :, 1:], (z[:, :, 1:] + 0.2343) / 3.0986)
    assert torch.allclose(denormalize_latents(n, FLUX_LATENT_NORM), z, atol=1e-6)
    image = normalize_latents(z[:, :, :1], SD3_LATENT_NORM)
    assert torch.allclose(image, (z[:, :, :1] - 0.1490) / 1.8415)
    assert LatentNorm.from_dict(FLUX_LATENT_NORM.to_dict()) == FLUX_LATENT_NORM
    json.dumps(FLUX_LATENT_NORM.to_dict())


def test_latent_norm_carries_gradients() -> None:
    """The VAE's own training backpropagates through the normalisation (``out=`` ops have no gradient)."""
    z = torch.randn(2, 16, 3, 2, 2)
    for fn in (normalize_latents, denormalize_latents):
        leaf = z.clone().requires_grad_(True)
        y = fn(leaf, FLUX_LATENT_NORM)
        y.sum().backward()
        with torch.no_grad():
            plain = fn(z, FLUX_LATENT_NORM)
        assert torch.equal(y.detach(), plain)  # the same elementwise arithmetic, element by element
        assert leaf.grad is not None and (leaf.grad != 0).all()


# ---- adapter -------------------------------------------------------------------------------------------


def test_adapter_contract(video: torch.Tensor) -> None:
    vae = load_vae("causal-vae-tiny")
    assert isinstance(vae, VideoVAE) and isinstance(vae, PyramidCausalVAE)
    assert (vae.latent_channels, vae.spatial_factor, vae.temporal_factor) == (16, 8, 8)
    assert [vae.valid_num_frames(n) for n in (0, 1, 8, 9, 16, 17, 24, 25, 100)] == [
        0,
        1,
        1,
        9,
        9,
        17,
        17,
        25,
        97,
    ]
    full = vae.encode(video)
    for mode in ("framewise", "exact"):
        chunked = vae.encode(video, chunking=mode, chunk_frames=8)
        assert _max_diff(chunked.mean, full.mean) < TOL
    assert full.mean.dtype == torch.float32
    out = vae.decode(full.mean, chunking="framewise", chunk_frames=1)
    assert _max_diff(out, vae.decode(full.mean)) < TOL
    with pytest.raises(ConfigError, match="blockwise"):
        vae.encode(video, chunking="blockwise")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="chunk_frames"):
        vae.encode(video, chunking="framewise", chunk_frames=6)
    with pytest.raises(InputError, match="16"):
        vae.encode(video[:, :, :16])
    with pytest.raises(InputError, match="12x8"):
        vae.encode(torch.zeros(1, 3, 1, 12, 8))
    with pytest.raises(ConfigError, match="24"):
        vae.encode(video, tile=24)


def test_tiny_is_deterministic_and_fingerprinted() -> None:
    a, b = load_vae("causal-vae-tiny"), load_vae("causal-vae-tiny")
    assert a.fingerprint() == b.fingerprint()
    with torch.no_grad():
        next(b.module.parameters()).add_(1.0)
    assert a.fingerprint() != b.fingerprint()


def test_fp16_refused_bf16_allowed(video: torch.Tensor) -> None:
    with pytest.raises(ConfigError, match="float16"):
        load_vae("causal-vae-tiny", dtype=torch.float16)
    with pytest.raises(ConfigError, match="float16"):
        PyramidCausalVAE(build_tiny_causal_vae().half())
    vae = load_vae("causal-vae-tiny", dtype="bf16")
    assert next(vae.module.parameters()).dtype == torch.bfloat16
    post = vae.encode(video[:, :, :1])
    assert post.mean.dtype == torch.float32 and torch.isfinite(post.mean).all()


def test_save_pretrained_round_trip(tmp_path, video: torch.Tensor) -> None:
    model = build_tiny_causal_vae()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").is_file()
    assert (tmp_path / "diffusion_pytorch_model.safetensors").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["_class_name"] == "CausalVideoVAE"
    again = CausalVideoVAE.from_pretrained(tmp_path)
    assert again.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    adapter = load_vae(tmp_path)
    assert adapter.fingerprint() == PyramidCausalVAE(model).fingerprint()
    image = video[:, :, :1]
    # the loaded weights sit at other addresses: the CPU may pick another convolution kernel
    assert_rounding_close(adapter.encode(image).mean, PyramidCausalVAE(model).encode(image).mean, **ENCODE)


def test_load_vae_checkpoint_root_and_errors(tmp_path) -> None:
    build_tiny_causal_vae().save_pretrained(tmp_path / "causal_video_vae")
    assert isinstance(load_vae(tmp_path), PyramidCausalVAE)  # the official checkpoint root layout
    with pytest.raises(ModelLoadError, match="no-such-vae"):
        load_vae("no-such-vae")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"_class_name": "SomethingElse"}))
    with pytest.raises(ModelLoadError, match="SomethingElse"):
        load_vae(odd)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"_class_name": "CausalVideoVAE", "interpolate": True}))
    with pytest.raises(ModelLoadError, match="interpolate"):
        load_vae(bad)


def test_load_vae_dispatches_to_diffusers(tmp_path, monkeypatch) -> None:
    calls = []
    fake = types.ModuleType("pfctl.models.diffusers_vae")
    fake.load_diffusers_vae = lambda spec, class_name, dtype, device: calls.append(
        (spec, class_name, dtype, device)
    )
    monkeypatch.setitem(sys.modules, "pfctl.models.diffusers_vae", fake)
    load_vae("wan-tiny")
    folder = tmp_path / "cog"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLCogVideoX"}))
    load_vae(folder, dtype="bf16")
    assert calls == [
        ("wan-tiny", None, torch.float32, "cpu"),
        (str(folder), "AutoencoderKLCogVideoX", torch.bfloat16, "cpu"),
    ]


# ---------------------------------------------------------------------------------- channels-last layout
def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("affine", [True, False])
def test_frame_group_norm_channels_last_equals_default(affine: bool) -> None:
    """The channels-last norm (its own statistics code) = nn.GroupNorm per frame, values and gradients."""
    from pfctl.models.causal_vae.conv import FrameGroupNorm, is_channels_last

    gen = torch.Generator().manual_seed(3)
    norm = FrameGroupNorm(4, 16, eps=1e-6, affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16, generator=gen))
            norm.bias.copy_(torch.randn(16, generator=gen))
    x = torch.randn(2, 16, 3, 5, 7, generator=gen) * 3 + 1.5  # a non-zero mean, as activations have
    x_cl = _channels_last(x)
    assert is_channels_last(x_cl) and not is_channels_last(x)
    with torch.no_grad():
        ref, out = norm(x), norm(x_cl)
    assert is_channels_last(out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    a, b = x.clone().requires_grad_(), x_cl.clone().requires_grad_()
    w = torch.randn(x.shape, generator=gen)
    (norm(a) * w).sum().backward()
    grads_default = [p.grad.clone() for p in norm.parameters()]
    norm.zero_grad()
    (norm(b) * w).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
    for got, want in zip([p.grad for p in norm.parameters()], grads_default, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class _Passthrough(torch.nn.Module):
    """Stands in for an upsampler's conv (identity weights, a random bias), so the depth-to-space step
    sees a channels-last tensor on the CPU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = torch.nn.Module()
        self.conv.bias = torch.nn.Parameter(torch.randn(channels, generator=torch.Generator().manual_seed(2)))

    def forward(self, x: torch.Tensor, cache: FrameCache | None = None, bias: bool = True) -> torch.Tensor:
        return x + self.conv.bias.view(-1, 1, 1, 1) if bias else x


@pytest.mark.parametrize("kind", ["spatial", "temporal"])
@pytest.mark.parametrize("first_chunk", [True, False])
def test_upsamplers_channels_last_equal_default(kind: str, first_chunk: bool) -> None:
    from pfctl.models.causal_vae.blocks import SpatialUpsample, TemporalUpsample
    from pfctl.models.causal_vae.conv import is_channels_last

    up = SpatialUpsample(3) if kind == "spatial" else TemporalUpsample(3)
    up.conv = _Passthrough(12 if kind == "spatial" else 6)
    y = torch.randn(2, 12 if kind == "spatial" else 6, 3, 4, 5, generator=torch.Generator().manual_seed(1))
    cache = FrameCache()
    if not first_chunk:
        cache.next_chunk()
    with torch.no_grad():  # channels-last: the conv's bias is added in the rearranging copy instead
        ref, out = up(y, cache), up(_channels_last(y), cache)
    assert is_channels_last(out) or (kind == "temporal" and first_chunk)  # a sliced-off frame 0 is a view
    assert torch.equal(out, ref)


def test_channels_last_model_equals_default(video: torch.Tensor) -> None:
    """The whole VAE with channels-last weights: encode and decode give the default layout's numbers
    (on the CPU the convolutions return the default layout; on CUDA, cuDNN keeps channels-last)."""
    model = build_tiny_causal_vae()
    with torch.no_grad():
        ref_mean = model.encode(video).mean
        ref_pixels = model.decode(ref_mean, temporal_chunk=True, window_size=1)
        model.use_channels_last()
        mean = model.encode(video, temporal_chunk=True, window_size=8).mean
        pixels = model.decode(ref_mean, temporal_chunk=True, window_size=1)
    assert mean.is_contiguous()
    assert_rounding_close(mean, ref_mean, **ENCODE)  # channels-last: other convolution kernels
    assert_rounding_close(pixels, ref_pixels, **ENCODE)
