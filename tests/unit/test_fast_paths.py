"""The speed layer (:mod:`pfctl.models.fast`): module swaps, compiled DiT blocks, CUDA-graph replay of a stage.

All must compute what the plain model computes. The CUDA tests run only where a GPU is present;
on the CPU the sampler ignores ``cuda_graphs`` and compiled blocks are traced with the ``aot_eager``
backend (the same dynamo capture and dynamic shapes as inductor, without code generation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.tiny_models import tiny_dit
from helpers.tolerance import assert_rounding_close
from pfctl.config.fast import FastPathsConfig
from pfctl.models.fast import FastPaths, apply_fast_paths
from pfctl.models.fast.cuda_graph import StageGraph, flatten_tensors, signature, unflatten_tensors
from pfctl.models.text_embeddings import TextEmbeddings
from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SAMPLING = {"reduction": 128, "depth": 200}
"""A ``_sample`` call's sums: the tiny DiT's longest is its MLP's 128 inputs; about 10 are chained per forward
and about 20 forwards per video (helpers.tolerance derives the tolerance from these)."""


def _text(dit: torch.nn.Module, device: str = "cpu", seed: int = 0) -> TextConditioning:
    gen = torch.Generator().manual_seed(seed)
    cfg = dit.config

    def features(valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = torch.ones(1, 6, dtype=torch.long)
        mask[:, valid:] = 0  # padded text: the masks must survive the graph
        return (
            torch.randn(1, 6, cfg.joint_attention_dim, generator=gen).to(device),
            mask.to(device),
            torch.randn(1, cfg.pooled_projection_dim, generator=gen).to(device),
        )

    return TextConditioning(TextEmbeddings(*features(4)), TextEmbeddings(*features(2)))


def _sample(
    dit: torch.nn.Module, device: str, temp: int = 3, cuda_graphs: bool = False, **kwargs: object
) -> torch.Tensor:
    return generate_latents(
        dit,
        _text(dit, device),
        SamplingSettings(
            num_inference_steps=(3, 3, 3), video_num_inference_steps=(3, 2, 1), cuda_graphs=cuda_graphs
        ),
        temp=temp,
        height=16,
        width=16,
        generator=torch.Generator(device).manual_seed(5),
        device=device,
        latent_channels=dit.config.in_channels // 4,
        **kwargs,
    )


@pytest.fixture(scope="module")
def eager_sample() -> torch.Tensor:
    """:func:`_sample` of the plain tiny DiT on the CPU (eager blocks, one-call attention): what the compiled
    blocks below must sample. Computed once for this module (a tiny DiT of one seed samples it every time)."""
    return _sample(tiny_dit(), "cpu")


def test_flatten_round_trip_and_signature():
    a, b, t = torch.zeros(2, 3), torch.ones(1, dtype=torch.long), torch.zeros(2)
    nest = {"sample": [[a, b]], "timestep": t, "flag": True, "pair": (t, 3)}
    leaves, spec = flatten_tensors(nest)
    assert [x is y for x, y in zip(leaves, [a, b, t, t], strict=True)] == [True] * 4
    rebuilt = unflatten_tensors(spec, [x + 1 for x in leaves])
    assert rebuilt["flag"] is True and rebuilt["pair"][1] == 3 and isinstance(rebuilt["pair"], tuple)
    assert torch.equal(rebuilt["sample"][0][1], b + 1)
    same = signature(*flatten_tensors({**nest, "timestep": torch.ones(2)}))
    assert same == signature(leaves, spec)
    for changed in ({**nest, "timestep": torch.ones(3)}, {**nest, "timestep": t.double()}):
        assert signature(*flatten_tensors(changed)) != signature(leaves, spec)


@gpu
def test_kept_graphs_sample_videos_as_eager_sampling():
    """A run of videos with kept graphs samples what eager calls sample; once every stage has been seen
    twice (a one-step stage is only warmed up the first time), nothing new is captured."""
    dit = tiny_dit().cuda()
    graphs = StageGraph(dit, keep=True)
    eager = _sample(dit, "cuda")
    captured = []
    for _ in range(3):
        got = _sample(dit, "cuda", cuda_graphs=True, graphs=graphs)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        captured.append(graphs.captures)
    assert 0 < captured[0] <= captured[1] == captured[2]


def test_cuda_graphs_are_ignored_off_cuda():
    dit = tiny_dit()
    assert torch.equal(_sample(dit, "cpu", cuda_graphs=True), _sample(dit, "cpu"))


def test_compiled_blocks_trace_once_for_every_token_count(eager_sample: torch.Tensor):
    """Compiled blocks sample what eager blocks sample, with one graph per block type for every stage shape
    (the ``cudnn`` kernel-set context traced into the blocks' graphs: no graph break)."""
    from torch._dynamo.utils import counters

    compiled = tiny_dit()
    compiled.set_attention_backend("cudnn")
    torch._dynamo.reset()
    counters.clear()
    apply_fast_paths(compiled, FastPaths(compile=True, compile_backend="aot_eager"))
    assert_rounding_close(_sample(compiled, "cpu"), eager_sample, **SAMPLING)
    # 2 block types, 9 stage shapes: nothing recompiled per shape, no graph break
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    assert set(compiled.state_dict()) == set(tiny_dit().state_dict())
    torch._dynamo.reset()


def test_compiled_blocks_with_skip_future_keys_sample_like_eager(monkeypatch, eager_sample: torch.Tensor):
    """Row-grouped attention is one operator inside compiled blocks (opaque to the compiler: no graph break,
    no guard on the group layouts), compiled as ``pfctl generate`` compiles (automatic dynamic shapes); the
    samples are the eager one-call ones, with the sampler handing the DiT its text lengths (negative and
    positive prompts of different lengths: the single-frame groups attend with no mask, one call per prompt)."""
    from torch._dynamo.utils import counters

    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)  # several groups per call at these sizes
    monkeypatch.setattr(dc, "ROW_GROUP_MIN_TOKENS", 0)  # grouped however short the columns
    grouped, mask_free = dc._attention_by_row_groups, []

    def recording(*args: object) -> torch.Tensor:
        mask_free.extend(g.key_starts for g in args[5] if g.key_starts is not None)  # the row groups
        return grouped(*args)

    monkeypatch.setattr(dc, "_attention_by_row_groups", recording)
    compiled = tiny_dit()
    compiled.set_attention_backend("auto", skip_future_keys=True)
    torch._dynamo.reset()
    counters.clear()
    # dynamo's capture and guards, no AOT tracing
    apply_fast_paths(compiled, FastPaths(compile=True, compile_backend="eager", dynamic=None))
    # row groups sum the attention in another order: fp32 rounding, compounded over the sampler's steps
    assert_rounding_close(_sample(compiled, "cpu"), eager_sample, **SAMPLING)
    assert set(mask_free) == {(2, 0)}  # text cut to 4 tokens; the negative prompt's 2 start at 2
    assert not counters["graph_break"]
    # longer videos have other group layouts (more history): once the sizes that change are dynamic, they
    # compile nothing new (with the groups traced, this took 19 graphs and hit dynamo's recompile limit)
    _sample(compiled, "cpu", temp=5)
    graphs = counters["stats"]["unique_graphs"]
    _sample(compiled, "cpu", temp=4)
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]
    torch._dynamo.reset()


@gpu
@torch.no_grad()
def test_stage_graph_replays_the_eager_result():
    dit = tiny_dit().cuda()
    calls = []

    def counted(**kwargs: object) -> list[torch.Tensor]:
        calls.append(1)
        return dit(**kwargs)

    runner = StageGraph(counted)
    x = torch.randn(2, 16, 1, 4, 4, device="cuda")
    inputs = _text(dit, "cuda").model_inputs(True, "cuda", torch.float32)
    outs = []
    for step in range(4):
        kwargs = dict(
            sample=[[x + step]],
            timestep_ratio=torch.full((2,), 900.0 - 100 * step, device="cuda"),
            encoder_hidden_states=inputs[0],
            encoder_attention_mask=inputs[1],
            pooled_projections=inputs[2],
        )
        outs.append((runner(**kwargs)[0], dit(**kwargs)[0]))
    assert runner.replays == 3 and len(calls) == 2  # one warm-up, one capture, then replays
    for graphed, eager in outs:
        torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)
    assert outs[1][0].data_ptr() != outs[2][0].data_ptr()  # fresh outputs, not the static buffer


@gpu
@torch.no_grad()
def test_kept_stage_graphs_replay_a_signature_seen_before_from_its_first_call():
    """``keep=True`` (a run of several videos): each signature's graph stays, all in one memory pool; the
    second pass over the same signatures runs no warm-up and captures nothing, and every result is still
    the eager one (graphs sharing a pool must not overwrite each other's results). Only the first signature
    is warmed up eagerly: a later one is captured at its first call and replayed."""
    dit = tiny_dit().cuda()
    calls = []

    def counted(**kwargs: object) -> list[torch.Tensor]:
        calls.append(1)
        return dit(**kwargs)

    runner = StageGraph(counted, keep=True)
    inputs = _text(dit, "cuda").model_inputs(True, "cuda", torch.float32)

    def kwargs(size: int, step: int) -> dict:
        x = torch.full((2, 16, 1, size, size), 0.1 * step, device="cuda")
        return dict(
            sample=[[x]],
            timestep_ratio=torch.full((2,), 900.0 - 100 * step, device="cuda"),
            encoder_hidden_states=inputs[0],
            encoder_attention_mask=inputs[1],
            pooled_projections=inputs[2],
        )

    for video in range(2):
        for size in (4, 8):  # two stages, three steps each
            for step in range(3):
                got = runner(**kwargs(size, step))[0]
                torch.testing.assert_close(got, dit(**kwargs(size, step))[0], rtol=1e-5, atol=1e-6)
        if video == 0:
            assert len(calls) == 3 and runner.captures == 2  # warm-up + capture, then a capture alone
    assert len(calls) == 3 and runner.captures == 2 and runner.replays == (2 + 3) + 2 * 3
    runner.release()
    got = runner(**kwargs(4, 0))[0]
    torch.testing.assert_close(got, dit(**kwargs(4, 0))[0], rtol=1e-5, atol=1e-6)
    assert len(calls) == 4 and runner.captures == 3  # released: the signature is captured again


@gpu
def test_cuda_graph_sampling_equals_eager_sampling():
    dit = tiny_dit().cuda()
    torch.testing.assert_close(
        _sample(dit, "cuda", cuda_graphs=True), _sample(dit, "cuda"), rtol=1e-5, atol=1e-5
    )


def test_stage_graph_runs_cpu_inputs_eagerly():
    calls = []

    def fn(**kwargs: object) -> torch.Tensor:
        calls.append(1)
        return kwargs["x"] * 2

    runner = StageGraph(fn)
    for _ in range(3):
        assert torch.equal(runner(x=torch.ones(2)), torch.full((2,), 2.0))
    assert len(calls) == 3 and runner.replays == 0


@gpu
def test_causal_vae_channels_last_on_cuda_equals_default() -> None:
    """On CUDA, cuDNN keeps the channels-last layout end to end (norms, upsamplers, chunk cache), the
    norms run as the fused Triton kernels: encode and decode equal the default layout's (fp32, TF32
    off, so only summation order differs)."""
    from pfctl.models.fast import vae_norm as fused
    from pfctl.models.vae import build_tiny_causal_vae

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    calls = []
    kernel = fused.group_norm_act

    def counted(x, groups, weight, bias, eps, silu, front=None, x_bias=None):
        calls.append(silu)
        return kernel(x, groups, weight, bias, eps, silu, front, x_bias)

    try:
        model = build_tiny_causal_vae().cuda()
        assert "fused VAE norms" in apply_fast_paths(model, FastPaths())
        with torch.no_grad():  # non-zero biases: a conv bias left out and not folded back in shows
            for p in model.parameters():
                if p.ndim == 1:
                    p.normal_(0.0, 0.1)
        video = torch.rand(1, 3, 17, 32, 48, generator=torch.Generator().manual_seed(0)).cuda() * 2 - 1
        with torch.no_grad():
            mean = model.encode(video, temporal_chunk=True, window_size=8).mean
            pixels = model.decode(mean, temporal_chunk=True, window_size=1)
            assert not calls
            model.use_channels_last()
            fused.group_norm_act = counted
            mean_cl = model.encode(video, temporal_chunk=True, window_size=8).mean
            pixels_cl = model.decode(mean, temporal_chunk=True, window_size=1)
            whole = model.decode(mean)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        fused.group_norm_act = kernel
    assert whole.is_contiguous(memory_format=torch.channels_last_3d)
    # every FrameGroupNorm of this VAE is followed by SiLU (frame attention has its own nn.GroupNorm)
    assert calls and all(calls)
    torch.testing.assert_close(mean_cl, mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pixels_cl, pixels, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("silu", [False, True])
def test_fused_group_norm_bf16_equals_pytorch_path(silu: bool) -> None:
    """bf16 on CUDA: the Triton norm (+ SiLU) against FrameGroupNorm's PyTorch channels-last path,
    within one bf16 rounding (the fused kernel rounds once, the unfused path once per op)."""
    import torch.nn.functional as F

    from pfctl.models.causal_vae.conv import FrameGroupNorm
    from pfctl.models.fast import swap_class
    from pfctl.models.fast.vae_norm import FusedFrameGroupNorm

    norm = FrameGroupNorm(32, 256, eps=1e-6).cuda()
    swap_class(norm, FusedFrameGroupNorm)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 256, 5, 40, 24, device="cuda").mul(4).add(1).to(torch.bfloat16)
    x = x.to(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        norm.to(torch.bfloat16)
        ref = norm._channels_last(x)
        ref = F.silu(ref) if silu else ref
        out = norm.forward_act(x, torch.nn.SiLU()) if silu else norm(x)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)


@gpu
@pytest.mark.parametrize("residual", [False, True])
def test_fused_add_bias_bf16_equals_pytorch(residual: bool) -> None:
    """The bias (+ residual) kernel on a bf16 channels-last CUDA tensor whose size is not a multiple of
    its block: the PyTorch sum within one bf16 rounding (it rounds once, PyTorch once per op)."""
    from pfctl.models.fast import vae_norm as fused

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 96, 3, 17, 29)
    y = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    y = y.to(memory_format=torch.channels_last_3d)
    r = (
        torch.randn(shape, device="cuda", generator=gen)
        .to(torch.bfloat16)
        .to(memory_format=torch.channels_last_3d)
    )
    bias = torch.randn(96, device="cuda", generator=gen).to(torch.bfloat16)
    ref = y + bias.view(-1, 1, 1, 1) + (r if residual else 0)
    out = fused.add_bias(y.clone(), bias, r if residual else None)
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)


@gpu
def test_attention_settings_on_cuda_agree(monkeypatch) -> None:
    """``efficient`` runs the DiT's masked attention on the memory-efficient kernel and ``cudnn`` on cuDNN's
    (neither launches the other); with ``skip_future_keys`` in row groups. All give the same results within
    bf16 rounding: a training forward + backward under bf16 autocast with every block checkpointed (the
    recomputation must pick the forward's kernel), padded text, and a video sampled with CUDA graphs
    (relative L2 of the latents)."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 64)  # several groups per column at these sizes
    monkeypatch.setattr(dc, "ROW_GROUP_MIN_TOKENS", 0)  # grouped however short the columns
    head_64 = {"attention_head_dim": 64, "axes_dims_rope": [16, 24, 24]}  # miniFLUX's head width
    dit = tiny_dit(overrides=head_64).cuda()
    sampler_dit = tiny_dit(overrides=head_64).cuda().to(torch.bfloat16).eval()
    apply_fast_paths(dit, FastPaths(checkpointing_ratio=1.0))
    apply_fast_paths(sampler_dit, FastPaths())
    cfg = dit.config
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).cuda()

    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 3:] = mask[2, 5:] = 0
    args = dict(
        sample=[
            [rand(2, 16, 1, 16, 16), rand(2, 16, 3, 16, 16)],
            [rand(2, 16, 1, 8, 8), rand(2, 16, 2, 16, 16)],
        ],
        encoder_hidden_states=rand(4, 6, cfg.joint_attention_dim),
        encoder_attention_mask=mask.cuda(),
        pooled_projections=rand(4, cfg.pooled_projection_dim),
        timestep_ratio=torch.tensor([900.0, 500.0, 300.0, 10.0]).cuda(),
    )
    results, kernels = {}, {}
    for setting in ("efficient", "cudnn", "cudnn+skip"):
        backend, skip = setting.split("+")[0], setting.endswith("+skip")
        dit.set_attention_backend(backend, skip)
        sampler_dit.set_attention_backend(backend, skip)
        dit.train().zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.autocast("cuda", torch.bfloat16):
                outs = dit(**args)
            sum(o.float().square().mean() for o in outs).backward()
            torch.cuda.synchronize()
        kernels[setting] = {e.name.lower() for e in prof.events()}
        grads = [p.grad.clone() for p in dit.parameters()]
        latents = _sample(sampler_dit, "cuda", cuda_graphs=True, dtype=torch.bfloat16)
        results[setting] = ([o.detach().float() for o in outs], grads, latents.float())
    assert any("fmha" in k for k in kernels["efficient"]) and not any(
        "cudnn" in k for k in kernels["efficient"]
    )
    assert any("cudnn" in k for k in kernels["cudnn"]) and not any("fmha" in k for k in kernels["cudnn"])
    outs, grads, latents = results["efficient"]
    for setting in ("cudnn", "cudnn+skip"):
        s_outs, s_grads, s_latents = results[setting]
        for got, want in zip(s_outs + s_grads, outs + grads, strict=True):
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        # a sampled video compounds bf16 rounding over 21 CFG steps: compared as a whole, with the tolerance
        # of the side-by-side harness for the same noise (benchmarks/bench_reference.py)
        rel_l2 = float((s_latents - latents).norm() / latents.norm())
        assert rel_l2 <= 5e-2, (setting, rel_l2)


@gpu
def test_fused_qk_kernel_on_cuda_matches_the_pytorch_path() -> None:
    """The q/k norm + rotation kernel (``pfctl::rms_norm_rope``) on bf16 gives the PyTorch path's values
    (the same rounding steps; a sum of squares in another order may move one by a step), and a video sampled
    with it inside compiled blocks replayed as CUDA graphs, as ``pfctl generate`` runs it, matches the video
    sampled with the PyTorch ops."""
    from pfctl.models.dit_layers import AttentionOps, RMSNorm
    from pfctl.models.fast.qk_norm_rope import FusedQKRope, applies
    from pfctl.models.rope import rope_tables, rotary_table

    class Fused(FusedQKRope, AttentionOps):
        pass

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen) * 0.3 + 1)
    positions = torch.stack([torch.arange(300) // 60, torch.arange(300) // 10 % 6, torch.arange(300) % 10], 1)
    table = rotary_table(*rope_tables(positions.float().cuda(), [16, 24, 24]))
    x = (torch.randn(2, 300, 30, 64, generator=gen) * 3 + 0.5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        assert applies(x, norm.weight)
        got = Fused().norm_rope(x, norm, table).float()
        want = AttentionOps().norm_rope(x, norm, table).float()
    assert (got == want).float().mean() > 0.99
    assert float(((got - want).abs() / want.abs().clamp_min(1.0)).max()) < 2 * 2**-7  # two bf16 steps

    assert _sampled_with_and_without("fused_qk_rope") == {False: False, True: True}


def _sampled_with_and_without(path: str, kernel: str = "rms_norm_rope") -> dict[bool, bool]:
    """Sample a video with the fast path ``path`` (a ``fast:`` key) on and off, in compiled blocks replayed
    as CUDA graphs as ``pfctl generate`` runs them; the two must match as the side-by-side harness compares
    videos. Returns, for each setting, whether a CUDA kernel named with ``kernel`` ran."""
    head_64 = {"attention_head_dim": 64, "axes_dims_rope": [16, 24, 24]}
    latents, ran = {}, {}
    for enabled in (False, True):
        dit = tiny_dit(overrides=head_64).cuda().to(torch.bfloat16).eval()
        dit.set_attention_backend("auto", skip_future_keys=True)
        torch._dynamo.reset()
        apply_fast_paths(dit, FastPaths(FastPathsConfig(**{path: enabled}), compile=True, dynamic=None))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            latents[enabled] = _sample(dit, "cuda", cuda_graphs=True, dtype=torch.bfloat16).float()
            torch.cuda.synchronize()
        ran[enabled] = any(kernel in e.name for e in prof.events())
    torch._dynamo.reset()
    # a sampled video compounds bf16 rounding over 21 CFG steps: compared as a whole
    rel_l2 = float((latents[True] - latents[False]).norm() / latents[False].norm())
    assert rel_l2 <= 5e-2, rel_l2
    return ran


@gpu
def test_fused_linear_products_on_cuda_match_the_pytorch_ops() -> None:
    """On bf16 CUDA inference the GELU in the product's epilogue and the single blocks' output projection
    summed part by part agree with the PyTorch ops to a bf16 rounding step or two (one rounding fewer in the
    first, one more in the second); LoRA layers keep the PyTorch path; a sampled video matches."""
    import torch.nn.functional as F

    from pfctl.models.fast import products as fused_linear
    from pfctl.models.lora import add_lora

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 300, 64, generator=gen) * 2).cuda().to(torch.bfloat16)
    mlp = torch.nn.Linear(64, 256).cuda().to(torch.bfloat16)
    out = torch.nn.Linear(64 + 256, 64).cuda().to(torch.bfloat16)
    with torch.no_grad():
        assert fused_linear.applies(mlp, x)
        act = fused_linear.linear_gelu(mlp, x)
        want_act = F.gelu(mlp(x), approximate="tanh")
        got = fused_linear.concat_linear(out, [x, act])
        want = out(torch.cat([x, act], -1))
    assert act.shape == want_act.shape and got.shape == want.shape
    scale = want_act.float().abs().clamp_min(1.0)
    assert float(((act.float() - want_act.float()).abs() / scale).max()) <= 2 * 2**-7
    torch.testing.assert_close(got, want, rtol=2 * 2**-7, atol=2 * 2**-7)

    host = torch.nn.Sequential()
    host.add_module("proj", torch.nn.Linear(64, 256))
    add_lora(host, rank=2, alpha=2, targets=".*proj")
    host = host.cuda().to(torch.bfloat16)
    with torch.no_grad():
        assert not fused_linear.applies(host.proj, x)  # its update would be dropped
        assert not fused_linear.applies(mlp, x.float())
    assert not fused_linear.applies(mlp, x.requires_grad_())

    _sampled_with_and_without("fused_products")


@gpu
def test_host_frames_copies_cuda_frames_through_pinned_memory() -> None:
    from pfctl.sampling.decode import host_frames

    frames = torch.randint(0, 256, (9, 16, 24, 3), dtype=torch.uint8, device="cuda")
    first, second = host_frames(frames), host_frames(frames.flip(0))
    assert np.array_equal(first, frames.cpu().numpy())
    assert np.array_equal(second, frames.flip(0).cpu().numpy())  # a second copy leaves the first intact
    assert np.array_equal(first, frames.cpu().numpy())


def test_host_frames_of_cpu_frames_share_their_memory() -> None:
    from pfctl.sampling.decode import host_frames

    frames = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    host_frames(frames)[0, 0, 0, 0] = 7
    assert int(frames[0, 0, 0, 0]) == 7


@gpu
@pytest.mark.parametrize("weights_channels_last", [False, True])
def test_causal_vae_encodes_a_channels_last_input_on_cuda(weights_channels_last: bool) -> None:
    """encode-latents feeds the VAE a (T, H, W, C)-stored clip (uint8 frames permuted, scaled on the
    GPU); with either weight layout it must encode like a contiguous input."""
    from pfctl.data.video import to_model_input
    from pfctl.models.vae import build_tiny_causal_vae

    model = build_tiny_causal_vae().cuda().to(torch.bfloat16).use_channels_last(weights_channels_last)
    frames = torch.randint(
        0, 256, (17, 32, 48, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    video = to_model_input(frames.cuda()).to(torch.bfloat16).unsqueeze(0)
    assert video.is_contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        mean = model.encode(video, temporal_chunk=True, window_size=8).mean
        ref = model.encode(video.contiguous(), temporal_chunk=True, window_size=8).mean
    assert torch.isfinite(mean).all()
    torch.testing.assert_close(mean.float(), ref.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------------------
# The layer itself: off means not imported; on means the same numbers; a kernel that cannot run is left off


_PLAIN_MODELS = """
import sys

import torch

from pfctl.config.fast import FastPathsConfig
from pfctl.models.dit_flux import PyramidFluxTransformer
from pfctl.models.dit_mmdit import PyramidDiffusionMMDiT
from pfctl.models.vae import PyramidCausalVAE, build_tiny_causal_vae, with_fast_paths

off = FastPathsConfig(fused_qk_rope=False, fused_products=False, lean_autograd=False, fused_projections=False,
                      fused_vae_norm=False)
flux = PyramidFluxTransformer(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                              num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=10,
                              axes_dims_rope=[2, 2, 4])
mmdit = PyramidDiffusionMMDiT(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                              num_attention_heads=2, caption_projection_dim=16, pooled_projection_dim=10,
                              pos_embed_max_size=8, joint_attention_dim=12, add_temp_pos_embed=True,
                              temp_pos_embed_type="rope", use_temporal_causal=True, use_t5_mask=True)
text = dict(encoder_hidden_states=torch.randn(2, 5, 12), encoder_attention_mask=torch.ones(2, 5),
            pooled_projections=torch.randn(2, 10), timestep_ratio=torch.tensor([900.0, 100.0]))
for model, channels in ((flux, 4), (mmdit, 4)):
    model.set_attention_backend("auto", skip_future_keys=True, min_tokens=0)
    out = model([[torch.randn(1, channels, 2, 4, 4)], [torch.randn(1, channels, 1, 4, 4)]], **text)
    sum(o.sum() for o in out).backward()
vae = with_fast_paths(PyramidCausalVAE(build_tiny_causal_vae()), off)
vae.decode(vae.encode(torch.rand(1, 3, 9, 32, 32) * 2 - 1).mean)
print(sorted(m for m in sys.modules if m.startswith("pfctl.models.fast")))
"""


def test_plain_models_never_import_the_fast_package() -> None:
    """Both DiTs (forward and backward, row groups on) and the causal VAE (encode, decode) with every fast
    path off: nothing of :mod:`pfctl.models.fast` (Triton kernels, compile, CUDA graphs) is imported."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_MODELS], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _random_dit(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny DiT with random (non-zero) weights (the reference init zeroes the output layers)."""
    from pfctl.models.dit_mmdit import PyramidDiffusionMMDiT

    if kind == "flux":
        model = tiny_dit()
    else:
        model = PyramidDiffusionMMDiT(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, caption_projection_dim=16, pooled_projection_dim=10, pos_embed_max_size=8,
            joint_attention_dim=12, add_temp_pos_embed=True, temp_pos_embed_type="rope",
            use_temporal_causal=True, use_t5_mask=True,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / (p[0].numel() ** 0.5 if p.dim() > 1 else 10))
    return model.train().to(dtype)


@pytest.mark.parametrize("kind", ["flux", "mmdit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_paths_on_train_like_the_plain_model(kind: str, dtype: torch.dtype) -> None:
    """Every fast path on (on the CPU: the hand-written autograd Functions and, for Flux, the single blocks'
    product hooks; plus checkpointing of every block): a training forward and backward give the plain
    model's outputs (the same ops: bit for bit) and gradients (the same products and sums, summed in another
    order: fp32 rounding; bf16: a rounding step), and class names and state-dict keys stay."""
    results, keys, names = [], [], []
    for fast in (False, True):
        model = _random_dit(kind, dtype)
        cfg = model.config
        gen = torch.Generator().manual_seed(1)
        channels = cfg.in_channels // 4 if kind == "flux" else cfg.in_channels
        mask = torch.ones(4, 6, dtype=torch.long)
        mask[1, 3:] = mask[2, 5:] = 0
        sample = [
            [torch.randn(2, channels, 1, 4, 4, generator=gen), torch.randn(2, channels, 2, 4, 4, generator=gen)],
            [torch.randn(2, channels, 1, 2, 2, generator=gen), torch.randn(2, channels, 2, 4, 4, generator=gen)],
        ]
        args = dict(
            encoder_hidden_states=torch.randn(4, 6, cfg.joint_attention_dim, generator=gen).to(dtype),
            encoder_attention_mask=mask,
            pooled_projections=torch.randn(4, cfg.pooled_projection_dim, generator=gen).to(dtype),
            timestep_ratio=torch.tensor([900.0, 500.0, 300.0, 10.0]),
        )
        if fast:
            applied = apply_fast_paths(model, FastPaths(checkpointing_ratio=1.0))
            assert applied[0] == "lean autograd" and applied[-1].startswith("activation checkpointing")
        outs = model([[c.to(dtype) for c in col] for col in sample], **args)
        sum(o.float().square().mean() for o in outs).backward()
        results.append((outs, [p.grad for p in model.parameters()]))
        keys.append(list(model.state_dict()))
        names.append([type(m).__name__ for m in model.modules()])
    assert keys[0] == keys[1] and names[0] == names[1]
    (plain_outs, plain_grads), (fast_outs, fast_grads) = results
    for got, want in zip(fast_outs, plain_outs, strict=True):
        assert torch.equal(got, want)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    for got, want in zip(fast_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_a_kernel_that_cannot_run_is_left_off_with_one_warning(monkeypatch) -> None:
    """The q/k kernel's fallback is decided once, when the paths are applied: a kernel that does not
    compile is reported by one warning naming the path, and the model keeps the PyTorch ops."""
    import pfctl.models.fast as fast
    from pfctl.models.fast.qk_norm_rope import FusedQKRope

    warnings = []
    monkeypatch.setattr(fast, "_qk_kernel_works", lambda: "CompilationError: no sm_0 target")
    monkeypatch.setattr(fast.pflog, "warn", warnings.append)
    dit = tiny_dit()
    applied = apply_fast_paths(dit, FastPaths())
    assert "fused q/k norm + RoPE" not in applied and "lean autograd" in applied
    assert len(warnings) == 1 and "fused q/k norm + RoPE" in warnings[0] and "sm_0" in warnings[0]
    assert not any(isinstance(m, FusedQKRope) for m in dit.modules())
    monkeypatch.setattr(fast, "_qk_kernel_works", lambda: "no CUDA device")  # CPU: silently off
    warnings.clear()
    apply_fast_paths(tiny_dit(), FastPaths())
    assert not warnings


def test_print_config_shows_the_fast_paths() -> None:
    """``--print-config`` lists the ``fast:`` section, and a key set off there is shown off."""
    from pfctl.config.load import dump_config, load_config

    shown = dump_config(load_config(None, ["fast.fused_qk_rope=false"]))
    assert "fast:" in shown and "fused_qk_rope: false" in shown and "lean_autograd: true" in shown


def test_generate_auto_attention_settles_by_the_length_of_the_run():
    from pfctl.sampling.generate import CUDNN_MIN_VIDEOS, attention_kernel

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # a short run: the kernel that plans nothing, so the first video pays no plan per attention shape
    assert attention_kernel("auto", cuda, videos=1, keep_graphs=False) == "efficient"
    assert attention_kernel("auto", cuda, videos=CUDNN_MIN_VIDEOS - 1, keep_graphs=True) == "efficient"
    # many videos replaying kept graphs: cuDNN's plans are paid once, its faster kernel every later video
    assert attention_kernel("auto", cuda, videos=CUDNN_MIN_VIDEOS, keep_graphs=True) == "cudnn"
    assert attention_kernel("auto", cuda, videos=CUDNN_MIN_VIDEOS, keep_graphs=False) == "efficient"
    assert attention_kernel("auto", cpu, videos=CUDNN_MIN_VIDEOS, keep_graphs=True) == "auto"
    assert attention_kernel("cudnn", cuda, videos=1, keep_graphs=False) == "cudnn"
    assert attention_kernel("efficient", cuda, videos=99, keep_graphs=True) == "efficient"
