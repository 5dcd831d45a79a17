"""Exact chunked encode, memory side: sliced statistics and normalisation (bounded temporaries, same
results), parked norm inputs offloaded to host memory, time shards for several processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers.tolerance import assert_rounding_close
from pfctl.models import exact_chunked as exact
from pfctl.models.diffusers_vae import load_diffusers_vae
from pfctl.models.exact_chunked import (
    LayerSyncEngine,
    exact_chunked_encode,
    group_norm_with_stats,
    group_sums,
    shard_frames,
    sums_to_mean_var,
)
from pfctl.verify.synthetic import synthetic_clip


class _LargestAllocation(TorchDispatchMode):
    """Bytes of the largest tensor any op allocates (views and in-place results excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 60 elements: a (2, 4, 3, 5, 6) tensor is cut along time and along rows."""
    monkeypatch.setattr(exact, "SLICE_ELEMENTS", 60)


def _clip(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 3, 5, 6, generator=g) * 3 + 100).to(dtype)


def test_slices_cover_the_tensor_once(small_slices):
    x = torch.zeros(2, 4, 3, 5, 6)
    for ts, hs in exact._slices(x):
        assert x[:, :, ts, hs].numel() <= 60
        x[:, :, ts, hs] += 1
    assert torch.equal(x, torch.ones_like(x))


def test_group_sums_sliced_match_two_pass_and_leave_input_alone(small_slices):
    x = _clip()
    before = x.clone()
    mean, var = sums_to_mean_var(group_sums(x, 2))
    xg = x.reshape(2, 2, -1)
    assert torch.equal(x, before)  # a float64 input is summed from a copy, never squared in place
    assert torch.allclose(mean, xg.mean(-1), rtol=0, atol=1e-10)
    assert torch.allclose(var, xg.var(-1, correction=0), rtol=1e-9)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("permuted", [False, True])
def test_group_norm_with_stats_matches_group_norm(small_slices, affine, permuted):
    x = _clip(torch.float32)
    if permuted:  # (B, T, C, H, W) in memory, as the CogVideoX downsampler returns it
        x = x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    gn = nn.GroupNorm(2, 4, affine=affine)
    if affine:
        with torch.no_grad():
            gn.weight.uniform_(0.5, 1.5)
            gn.bias.uniform_(-1, 1)
    mean, var = sums_to_mean_var(group_sums(x, 2))
    with torch.no_grad():
        y = group_norm_with_stats(x, gn, mean, var)
    assert y.dtype == x.dtype
    # fp64 statistics vs the fp32 kernel's own sums over a group (helpers.tolerance)
    assert_rounding_close(y, F.group_norm(x, 2, gn.weight, gn.bias, gn.eps), reduction=x[0].numel() // 2, depth=2)


def test_statistics_and_norm_allocate_no_widened_copy_of_the_chunk(small_slices):
    x = _clip(torch.bfloat16)
    gn = nn.GroupNorm(2, 4)
    with torch.no_grad(), _LargestAllocation() as probe:
        mean, var = sums_to_mean_var(group_sums(x, 2))
        y = group_norm_with_stats(x, gn, mean, var)
    # the output (x's dtype and size) is the largest tensor: no float64/fp32 copy of the whole chunk
    assert probe.largest == y.numel() * y.element_size() == x.numel() * x.element_size()


def _run_two_chunks(offload_above: int | None, share_storage: bool):
    """Two chunks meeting at one norm; chunk 1 looks at chunk 0's norm input while chunk 0 is parked."""
    engine = LayerSyncEngine(2, offload_above=offload_above)
    gn = nn.GroupNorm(2, 4)
    clip = _clip(torch.float32)
    inputs: list[torch.Tensor] = [clip[:, :, :2], clip[:, :, 2:]]
    if not share_storage:
        inputs = [t.clone() for t in inputs]
    parked_bytes: list[int] = []

    def chunk(k: int):
        def fn() -> torch.Tensor:
            if k == 1:
                parked_bytes.append(inputs[0].untyped_storage().nbytes())
            return engine.group_norm("norm", gn, inputs[k])

        return fn

    with torch.no_grad():
        out = torch.cat(engine.run([chunk(0), chunk(1)]), dim=2)
        ref = F.group_norm(clip, 2, gn.weight, gn.bias, gn.eps)
    assert_rounding_close(out, ref, reduction=clip[0].numel() // 2, depth=2)  # chunked vs one call
    return engine, parked_bytes[0], inputs


def test_offload_frees_a_parked_norm_input_until_its_chunk_resumes():
    engine, parked, inputs = _run_two_chunks(offload_above=0, share_storage=False)
    assert parked == 0  # chunk 0's storage was in host memory while chunk 1 ran
    assert inputs[0].untyped_storage().nbytes() == inputs[0].numel() * 4  # and is back
    assert engine.peak_held_bytes == 0


def test_offload_keeps_views_into_shared_buffers_and_honours_the_budget():
    _, parked, _ = _run_two_chunks(offload_above=0, share_storage=True)
    assert parked > 0  # a view of the clip: other chunks may read the same storage
    engine, parked, inputs = _run_two_chunks(offload_above=1 << 20, share_storage=False)
    assert parked > 0 and engine.peak_held_bytes == sum(t.numel() * 4 for t in inputs)


def _run_chain(num_chunks: int, offload_above: int | None):
    """``num_chunks`` chunks through norm → +1 → norm. Each chunk notes, just after each of its norms
    returns (its pass B starting), which *other* chunks' parked norm inputs are on the device; the last
    chunk also notes it before its first norm (the others parked there, the norm incomplete)."""
    engine = LayerSyncEngine(num_chunks, offload_above=offload_above)
    gn = nn.GroupNorm(2, 4)
    clip = torch.randn(2, 4, 2 * num_chunks, 5, 6, generator=torch.Generator().manual_seed(1))
    firsts = [t.clone() for t in clip.split(2, dim=2)]
    seconds: list[torch.Tensor | None] = [None] * num_chunks
    seen: dict[tuple[int, str], list[int]] = {}

    def on_device(k: int) -> list[int]:
        """Other chunks whose parked input (first-norm input ahead of k, second-norm input behind) has
        device storage."""
        parked = [firsts[j] for j in range(k + 1, num_chunks)] + [seconds[j] for j in range(k)]
        ids = list(range(k + 1, num_chunks)) + list(range(k))
        return [j for j, t in zip(ids, parked, strict=True) if t is not None and t.untyped_storage().nbytes()]

    def chunk(k: int):
        def fn() -> torch.Tensor:
            if k == num_chunks - 1:
                seen[k, "arrive"] = [j for j in range(k) if firsts[j].untyped_storage().nbytes()]
            y = engine.group_norm("a", gn, firsts[k])
            seen[k, "a"] = on_device(k)
            seconds[k] = y + 1
            z = engine.group_norm("b", gn, seconds[k])
            return z

        return fn

    with torch.no_grad():
        out = torch.cat(engine.run([chunk(k) for k in range(num_chunks)]), dim=2)
        ref = F.group_norm(
            F.group_norm(clip, 2, gn.weight, gn.bias, gn.eps) + 1, 2, gn.weight, gn.bias, gn.eps
        )
    assert_rounding_close(out, ref, reduction=clip[0].numel() // 2, depth=4)  # two norms, chunked vs one call
    return engine, out, seen


def test_offload_prefetches_the_next_parked_input_one_at_a_time():
    base_engine, base, _ = _run_chain(4, offload_above=None)
    engine, out, seen = _run_chain(4, offload_above=0)
    assert torch.equal(out, base)
    assert base_engine.num_offloaded == base_engine.num_prefetched == 0
    assert engine.num_offloaded == 8
    # every input was copied back ahead of its chunk's turn, chunk 0's at the first norm as soon as the
    # last chunk's arrival completed that norm
    assert engine.num_prefetched == 8
    # while the first norm is still incomplete nothing comes back early
    assert seen[3, "arrive"] == []
    # as chunk k starts its pass B, exactly the chunk that runs next has its input back: k+1 at this norm,
    # and after the last chunk, chunk 0 at the next norm
    assert [seen[k, "a"] for k in range(4)] == [[1], [2], [3], [0]]


def test_prefetch_with_a_budget_skips_inputs_kept_on_the_device():
    _, base, _ = _run_chain(4, offload_above=None)
    one_input = 2 * 4 * 2 * 5 * 6 * 4  # bytes of one chunk's norm input (fp32)
    engine, out, _ = _run_chain(4, offload_above=2 * one_input)
    assert torch.equal(out, base)
    assert 0 < engine.num_prefetched <= engine.num_offloaded < 8


@pytest.mark.parametrize("offload_gib", [0, 2e-5])
def test_exact_encode_with_offload_is_bitwise_the_same(offload_gib):
    cog = load_diffusers_vae("cogvideox-tiny")
    clip = synthetic_clip(17, 16, 16).video
    plan = [5, 4, 4, 4]
    base = exact_chunked_encode(cog, clip, plan)
    off = exact_chunked_encode(cog, clip, plan, offload_above=int(offload_gib * 2**30))
    assert torch.equal(off.moments, base.moments)
    assert off.peak_held_bytes < base.peak_held_bytes  # fewer parked norm inputs stay on the device
    assert base.num_offloaded == 0
    assert 0 < off.num_prefetched <= off.num_offloaded  # the copies back went through the prefetch path


def test_shard_frames():
    assert shard_frames(49, 2, 4) == [25, 24]
    assert shard_frames(17, 2, 4) == [9, 8]
    assert shard_frames(49, 3, 4) == [17, 16, 16]
    assert shard_frames(50, 4, 4) == [14, 12, 12, 12]
    with pytest.raises(ValueError, match="shards"):
        shard_frames(5, 2, 4)
