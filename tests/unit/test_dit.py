"""Unit tests of the pyramid DiTs with tiny configs (CPU, random weights, no reference vectors)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.tolerance import assert_rounding_close
from pfctl.config.fast import FastPathsConfig
from pfctl.errors import ConfigError, InputError
from pfctl.models.attention_layout import clip_frame_ids
from pfctl.models.dit_flux import PyramidFluxTransformer
from pfctl.models.dit_layers import num_checkpointed
from pfctl.models.dit_mmdit import PyramidDiffusionMMDiT

LATENT_C = 4

FLUX_TINY = dict(
    patch_size=1,
    in_channels=4 * LATENT_C,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=12,
    pooled_projection_dim=10,
    axes_dims_rope=[2, 2, 4],
    use_flash_attn=False,
    use_temporal_causal=True,
    interp_condition_pos=True,
)
MMDIT_TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=LATENT_C,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    caption_projection_dim=16,
    pooled_projection_dim=10,
    pos_embed_max_size=8,
    joint_attention_dim=12,
    qk_norm="rms_norm",
    pos_embed_type="sincos",
    temp_pos_embed_type="rope",
    add_temp_pos_embed=True,
    use_t5_mask=True,
    use_temporal_causal=True,
    interp_condition_pos=True,
    use_flash_attn=False,
)
SUMS = {"reduction": 128, "depth": 32}
"""The tiny DiTs' sums: at most 128 terms (a 64-input MLP layer, an attention over at most ~100 keys), about 16
chained per forward and as many again backward (helpers.tolerance derives the tolerance from these)."""

MODELS = {"flux": (PyramidFluxTransformer, FLUX_TINY), "mmdit": (PyramidDiffusionMMDiT, MMDIT_TINY)}


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Tiny model with random (non-zero) weights: the reference init zeroes the output layers."""
    cls, cfg = MODELS[kind]
    model = cls(**{**cfg, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


PLAIN = FastPathsConfig(fused_qk_rope=False, fused_products=False, lean_autograd=False, fused_vae_norm=False)


def checkpointed(model: torch.nn.Module, ratio: float, kernels: FastPathsConfig = PLAIN) -> torch.nn.Module:
    """``model`` with activation checkpointing of its first ``floor(L * ratio)`` blocks (the speed layer)."""
    from pfctl.models.fast import FastPaths, apply_fast_paths

    apply_fast_paths(model, FastPaths(kernels, checkpointing_ratio=ratio))
    return model


def inputs(seed: int = 1, text_len: int = 5) -> dict:
    """K=2 columns, Bc=2. Column 0: history (1 frame) + current clip (2 frames). Column 1: low-res history,
    history, current clip (2 frames). Text rows interleaved (r = b*K + k) with right padding."""
    gen = torch.Generator().manual_seed(seed)

    def clip(t: int, h: int, w: int) -> torch.Tensor:
        return torch.randn(2, LATENT_C, t, h, w, generator=gen)

    sample = [[clip(1, 4, 4), clip(2, 4, 4)], [clip(1, 2, 2), clip(1, 4, 4), clip(2, 4, 4)]]
    rows = 4
    valid = torch.tensor([3, 5, 1, 4])
    mask = (torch.arange(text_len)[None] < valid[:, None]).long()
    return dict(
        sample=sample,
        encoder_hidden_states=torch.randn(rows, text_len, 12, generator=gen),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(rows, 10, generator=gen),
        timestep_ratio=torch.tensor([999.0, 500.0, 250.0, 10.0]),
    )


def run(model: torch.nn.Module, args: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return model(**args)


def clone_args(args: dict) -> dict:
    out = {k: v.clone() for k, v in args.items() if k != "sample"}
    out["sample"] = [[c.clone() for c in col] for col in args["sample"]]
    return out


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODELS)
def test_forward_shapes_and_backward(kind: str) -> None:
    model = build(kind).train()
    args = inputs()
    outs = model(**args)
    assert [tuple(o.shape) for o in outs] == [tuple(col[-1].shape) for col in args["sample"]]
    sum(o.square().mean() for o in outs).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("kind", MODELS)
def test_fresh_model_predicts_zero(kind: str) -> None:
    """Reference init (AdaLN-Zero, zero output projection): a new model outputs exactly 0."""
    cls, cfg = MODELS[kind]
    outs = run(cls(**cfg).eval(), inputs())
    assert all(torch.count_nonzero(o) == 0 for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_save_load_roundtrip_safetensors(kind: str, tmp_path) -> None:
    cls, _ = MODELS[kind]
    model, args = build(kind), inputs()
    model.save_pretrained(tmp_path / "single", safe_serialization=True)
    assert (tmp_path / "single" / "diffusion_pytorch_model.safetensors").is_file()
    assert not list((tmp_path / "single").glob("*.bin"))
    loaded = cls.from_pretrained(tmp_path / "single").eval()
    public = lambda cfg: {k: v for k, v in dict(cfg).items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.config) == public(model.config)
    for a, b in zip(run(model, args), run(loaded, args), strict=True):
        assert_rounding_close(b, a, **SUMS)  # loaded weights sit at other addresses: maybe other kernels

    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    shards = list((tmp_path / "sharded").glob("diffusion_pytorch_model-*.safetensors"))
    assert (
        len(shards) > 1
        and (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    )
    sharded = cls.from_pretrained(tmp_path / "sharded").eval()
    for key, value in model.state_dict().items():
        assert torch.equal(value, sharded.state_dict()[key]), key
    for a, b in zip(run(model, args), run(sharded, args), strict=True):
        assert_rounding_close(b, a, **SUMS)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("causal", [True, False])
def test_temporal_causal_mask(kind: str, causal: bool) -> None:
    """Changing the last frame of the current clip must not change the prediction of its earlier frame when
    causal, and must change it when causality is off. Other columns are never affected."""
    model = build(kind, use_temporal_causal=causal)
    args = inputs()
    base = run(model, args)
    changed = clone_args(args)
    changed["sample"][1][-1][:, :, 1] += 3.0  # column 1, current clip, frame 1 of 2
    out = run(model, changed)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=0)  # column 0 is independent
    assert not torch.allclose(out[1][:, :, 1], base[1][:, :, 1])
    if causal:
        assert_rounding_close(out[1][:, :, 0], base[1][:, :, 0], **SUMS)
    else:
        assert (out[1][:, :, 0] - base[1][:, :, 0]).abs().max() > 1e-4

    # history is visible to the current clip in both modes
    hist = clone_args(args)
    hist["sample"][1][0] += 3.0
    assert (run(model, hist)[1] - base[1]).abs().max() > 1e-4


@pytest.mark.parametrize("kind", MODELS)
def test_text_padding_is_masked(kind: str) -> None:
    model = build(kind)
    args = inputs()
    base = run(model, args)
    changed = clone_args(args)
    pad = changed["encoder_attention_mask"] == 0
    changed["encoder_hidden_states"][pad] += 5.0
    for a, b in zip(base, run(model, changed), strict=True):
        assert_rounding_close(b, a, **SUMS)


def test_mmdit_use_t5_mask_off_really_attends_padding() -> None:
    model = build("mmdit", use_t5_mask=False)
    args = inputs()
    changed = clone_args(args)
    changed["encoder_hidden_states"][changed["encoder_attention_mask"] == 0] += 5.0
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(run(model, args), run(model, changed), strict=True))


@pytest.mark.parametrize("kind", MODELS)
def test_flash_flag_keeps_the_masked_sdpa_path(kind: str) -> None:
    """use_flash_attn is accepted for checkpoint compatibility but never drops the mask."""
    plain = build(kind, use_flash_attn=False)
    flash = build(kind, use_flash_attn=True)
    assert flash.config.use_flash_attn is True
    args = inputs()
    for a, b in zip(run(plain, args), run(flash, args), strict=True):
        assert_rounding_close(b, a, **SUMS)  # two models: their weights sit at other addresses
    changed = clone_args(args)
    changed["sample"][0][-1][:, :, 1] -= 2.0
    assert_rounding_close(run(flash, changed)[0][:, :, 0], run(flash, args)[0][:, :, 0], **SUMS)


def test_flux_interp_condition_pos_flag() -> None:
    interp = build("flux", interp_condition_pos=True)
    plain = build("flux", interp_condition_pos=False)
    grids = [(1, 2, 2), (1, 4, 4)]
    pos_i = interp._positions(grids, torch.device("cpu"))
    pos_p = plain._positions(grids, torch.device("cpu"))
    # low-res history clip: fractional positions spanning the current grid vs plain integers
    assert not torch.equal(pos_i[:4, 1:], pos_i[:4, 1:].round())
    assert torch.equal(pos_p[:4, 1:], torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]))
    torch.testing.assert_close(pos_i[4:], pos_p[4:], rtol=0, atol=0)  # same-size clips: identical
    assert torch.equal(pos_i[:, 0], torch.tensor([0.0] * 4 + [1.0] * 16))  # frames continue across clips
    args = inputs()
    out_i, out_p = run(interp, args), run(plain, args)
    assert_rounding_close(out_i[0], out_p[0], **SUMS)  # column 0 has no low-res history
    assert (out_i[1] - out_p[1]).abs().max() > 1e-5


def test_mmdit_interp_condition_pos_flag() -> None:
    args = inputs()
    out_i = run(build("mmdit", interp_condition_pos=True), args)
    out_p = run(build("mmdit", interp_condition_pos=False), args)
    assert_rounding_close(out_i[0], out_p[0], **SUMS)  # two models: other addresses
    assert (out_i[1] - out_p[1]).abs().max() > 1e-5


def test_frame_ids_follow_clip_order() -> None:
    ids = clip_frame_ids([(2, 1, 2), (1, 2, 1)], torch.device("cpu"))
    assert ids.tolist() == [0, 0, 1, 1, 2, 2]


# ---------------------------------------------------------------------------------------------------------
# gradient checkpointing: blocks with execution index < floor(L * ratio), L = all blocks, input side first


@pytest.mark.parametrize(
    ("kind", "ratio", "expected"),
    [
        ("flux", 0.0, []),
        ("flux", 0.3, []),
        ("flux", 0.34, ["transformer_blocks.0"]),
        ("flux", 0.6, ["transformer_blocks.0"]),
        ("flux", 0.7, ["transformer_blocks.0", "single_transformer_blocks.0"]),
        ("flux", 1.0, ["transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"]),
        ("mmdit", 0.49, []),
        ("mmdit", 0.6, ["transformer_blocks.0"]),
        ("mmdit", 1.0, ["transformer_blocks.0", "transformer_blocks.1"]),
    ],
)
def test_checkpointed_block_set(kind: str, ratio: float, expected: list[str]) -> None:
    from pfctl.models.fast import checkpointed_block_names

    assert checkpointed_block_names(build(kind), ratio) == expected


def test_num_checkpointed_rule() -> None:
    assert [num_checkpointed(24, r) for r in (0.0, 0.5, 0.6, 1.0)] == [0, 12, 14, 24]
    assert num_checkpointed(10, 0.3) == 3  # no float round-down surprise (10 * 0.3 = 2.9999...)


@pytest.mark.parametrize("kind", MODELS)
def test_gradient_checkpointing_recomputes_exactly_those_blocks_and_matches(kind: str) -> None:
    args = inputs()
    from pfctl.models.fast import checkpointed_block_names

    plain = build(kind).train()
    ckpt = checkpointed(build(kind).train(), 0.7)

    calls: dict[str, int] = {}
    for name, block in ckpt.blocks_in_order():
        block.register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))

    results = []
    for model in (plain, ckpt):
        outs = model(**args)
        sum(o.square().mean() for o in outs).backward()
        results.append((outs, {n: p.grad.clone() for n, p in model.named_parameters()}))

    recomputed = sorted(n for n, c in calls.items() if c == 2)
    assert recomputed == sorted(checkpointed_block_names(ckpt, 0.7)) and recomputed
    assert all(c in (1, 2) for c in calls.values())
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert_rounding_close(b, a, **SUMS)  # two models: other addresses
    for name, grad in results[0][1].items():
        assert_rounding_close(results[1][1][name], grad, **SUMS, msg=name)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_blocks() -> None:
    """``train.compile``: compiled blocks (traced with ``aot_eager``: dynamo capture and AOT autograd's
    backward without code generation) give the eager forward and gradients, checkpointed blocks included,
    with LoRA adapters injected before compiling (as the trainer does). One ~50 s trace covers both kinds
    of fine-tuning: base weights and adapters all train here. Flux only: it has both block types (the
    MMDiT's share Flux's dual-stream block)."""
    from pfctl.models.lora import add_lora

    args, models = inputs(), []
    for _ in range(2):
        model = build("flux").train()
        torch.manual_seed(0)  # the same adapter init in both models
        add_lora(model, rank=2, alpha=2, targets=["attn.to_q", "attn.to_out.0", "ff.net.2"])
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.requires_grad_(True)  # the base trains too
                if "lora_B" in name:  # B starts at 0: make the adapters matter
                    p.copy_(torch.linspace(-0.1, 0.1, p.numel()).view_as(p))
        models.append(model)
    from pfctl.models.fast import FastPaths, apply_fast_paths

    eager, compiled = models
    torch._dynamo.reset()
    apply_fast_paths(eager, FastPaths(checkpointing_ratio=0.5))
    apply_fast_paths(compiled, FastPaths(checkpointing_ratio=0.5, compile=True, compile_backend="aot_eager"))
    results = []
    for model in (eager, compiled):
        outs = model(**clone_args(args))
        sum(o.square().mean() for o in outs).backward()
        results.append((outs, {n: p.grad for n, p in model.named_parameters()}))
    torch._dynamo.reset()
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert_rounding_close(b, a, **SUMS)
    assert results[1][1].keys() == results[0][1].keys()
    assert any(".lora_B" in name for name in results[0][1])
    for name, grad in results[0][1].items():
        assert_rounding_close(results[1][1][name], grad, **SUMS, msg=name)


@pytest.mark.parametrize(
    ("kind", "stack"), [("flux", "compile"), ("mmdit", "compile"), ("flux", "torchtitan")]
)
def test_compiled_blocks_trace_each_block_kind_once(kind: str, stack: str) -> None:
    """Over a training forward and backward Dynamo traces each kind of block once, and the last block once
    more (Flux's computes only the clips' rows, the MMDiT's has no text output): the first block, whose text
    input is a view of the embedder's product, no longer traces its kind a second time (a second Inductor
    compilation of its forward and backward on a GPU). The same with torchtitan's stack (checkpointing,
    compile, FSDP2 on a one-process group): FSDP2's gradient hook hands the blocks views in the forward but
    not in the checkpointed recomputation, and blocks compiled around the module call were traced again in
    the middle of the backward."""
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.runtime.sharding import shard_model

    traced: list[str] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        traced.append(gm.code)
        return gm.forward

    model = build(kind, num_layers=2, **({"num_single_layers": 2} if kind == "flux" else {})).train()
    torch._dynamo.reset()
    ratio = 0.5 if stack == "torchtitan" else 0.0
    paths = FastPaths(
        PLAIN, checkpointing_ratio=ratio, compile=True, compile_backend=counting, independent_sizes=True
    )
    apply_fast_paths(model, paths)
    lone_group = stack == "torchtitan" and not torch.distributed.is_initialized()
    try:
        if stack == "torchtitan":  # the 768p recipe's sharding, on a process group of this process alone
            blocks = [b for _, b in model.blocks_in_order()]
            shard_model(model, blocks, strategy="shard_grad_op", device=torch.device("cpu"))
        sum(o.square().mean() for o in model(**inputs())).backward()
    finally:
        torch._dynamo.reset()
        if lone_group:  # ranks forked by later tests must not inherit it
            torch.distributed.destroy_process_group()
    kinds = {type(block).__name__ for _, block in model.blocks_in_order()}
    assert len(traced) == len(kinds) + 1


def test_checkpointing_applies_only_in_training_with_gradients() -> None:
    """Checkpointed blocks recompute in the backward of a training forward, never in eval or no-grad calls;
    the plain model (no speed layer) never recomputes."""
    for model, recomputes in (
        (build("flux").train(), False),
        (checkpointed(build("flux").train(), 1.0), True),
    ):
        calls: dict[str, int] = {}
        for name, block in model.blocks_in_order():
            block.register_forward_pre_hook(lambda *_, n=name, c=calls: c.__setitem__(n, c.get(n, 0) + 1))
        sum(o.sum() for o in model(**inputs())).backward()
        assert set(calls.values()) == ({2} if recomputes else {1})
        calls.clear()
        model.eval()
        run(model, inputs())  # eval / no grad: never checkpointed
        assert set(calls.values()) == {1}


def test_fsdp_wrap_classes_exist() -> None:
    for kind, (cls, _) in MODELS.items():
        names = {type(m).__name__ for m in build(kind).modules()}
        assert set(cls._no_split_modules) <= names, kind
        # the speed layer keeps the class names, and blocks of one kind one class (FSDP wraps by class), also
        # when only some of them are checkpointed
        fast = checkpointed(build(kind), 0.5, FastPathsConfig())
        assert {type(m).__name__ for m in fast.modules()} == names, kind
        for name in cls._no_split_modules:
            assert len({type(m) for m in fast.modules() if type(m).__name__ == name}) == 1, name


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODELS)
def test_bf16_autocast_runs_close_to_fp32(kind: str) -> None:
    model, args = build(kind), inputs()
    ref = run(model, args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = run(model, args)
    for a, b in zip(ref, low, strict=True):
        assert torch.isfinite(b).all()
        assert ((a - b.float()).abs().max() / a.abs().max()) < 0.1


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("flux", {"patch_size": 2}),
        ("flux", {"axes_dims_rope": [2, 2, 2]}),
        ("flux", {"gradient_checkpointing_ratio": 1.5}),
        ("mmdit", {"caption_projection_dim": 24}),
        ("mmdit", {"pos_embed_type": "rope"}),
        ("mmdit", {"qk_norm": "group_norm"}),
    ],
)
def test_config_errors(kind: str, overrides: dict) -> None:
    cls, cfg = MODELS[kind]
    with pytest.raises(ConfigError):
        cls(**{**cfg, **overrides})


@pytest.mark.parametrize("kind", MODELS)
def test_input_errors(kind: str) -> None:
    model = build(kind)
    args = inputs()
    with pytest.raises(InputError):
        run(model, {**args, "sample": args["sample"][0][0][None]})  # not a list of columns
    with pytest.raises(InputError):
        run(model, {**args, "timestep_ratio": args["timestep_ratio"][:3]})
    bad = clone_args(args)
    bad["sample"][0][-1] = bad["sample"][0][-1][..., :3]  # odd width
    with pytest.raises(InputError):
        run(model, bad)


@pytest.mark.parametrize("kind", MODELS)
def test_attention_backends_set_the_sdpa_kernels_around_every_call(kind: str, monkeypatch) -> None:
    """Every SDPA call of the forward (and of checkpointing's recomputation) runs under its backend's kernel
    set: ``auto`` PyTorch's as it is, ``efficient`` without cuDNN, ``cudnn`` with cuDNN first; the global
    set is restored after each call. On the CPU all three run the same kernel: the same outputs and
    gradients (up to rounding: three models, their weights at other addresses)."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends  # introspection only

    sdpa = torch.nn.functional.scaled_dot_product_attention
    outside = _cur_sdpa_kernel_backends(with_priority=True)
    seen: list[list[SDPBackend]] = []

    def recording(*args, **kwargs):
        seen.append(_cur_sdpa_kernel_backends(with_priority=True))
        return sdpa(*args, **kwargs)

    results = {}
    for backend in ("auto", "efficient", "cudnn"):
        model = checkpointed(build(kind).train(), 1.0)
        model.set_attention_backend(backend)
        seen.clear()
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        outs = model(**inputs())
        sum(o.square().mean() for o in outs).backward()
        monkeypatch.undo()
        results[backend] = outs + [p.grad for p in model.parameters()]
        assert len(seen) == 2 * 2 * len(model.blocks_in_order())  # 2 columns, forward + recomputation
        for kernels in seen:
            if backend == "auto":
                assert kernels == outside
            elif backend == "efficient":
                assert SDPBackend.CUDNN_ATTENTION not in kernels and SDPBackend.EFFICIENT_ATTENTION in kernels
            else:
                assert kernels[0] == SDPBackend.CUDNN_ATTENTION
        assert _cur_sdpa_kernel_backends(with_priority=True) == outside
    for backend in ("efficient", "cudnn"):
        for got, want in zip(results[backend], results["auto"], strict=True):
            assert_rounding_close(got, want, **SUMS)
    with pytest.raises(ConfigError, match="attention backend"):
        model.set_attention_backend("flex")


def test_causal_row_groups_skip_only_masked_keys() -> None:
    """Every key a row group skips (at or after its end) is masked for every row of the group, under the real
    mask with text padding; groups tile the sequence and close at frame boundaries after ``min_rows``, a frame
    that large standing alone. A group marked mask-free (``key_starts``, left-aligned text) sees exactly the
    keys from each item's valid text to its end."""
    from pfctl.models.attention_layout import MASKED, build_attention_bias, causal_row_groups

    grids = [(1, 2, 3), (2, 4, 4), (3, 4, 4)]  # history clips, then the current clip: 6 frames
    text_len = 5
    text_valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)  # left-aligned
    key_starts = [2, 0]
    (bias,) = build_attention_bias(text_valid, [clip_frame_ids(grids, "cpu")], 1, True, torch.float32)
    size = bias.shape[-1]
    frame_rows = [h * w for t, h, w in grids for _ in range(t)]
    frame_ends = list(itertools.accumulate(frame_rows, initial=text_len))[1:]
    for min_rows in (1, 10, 16, 20, 1000):
        groups = causal_row_groups(text_len, grids, min_rows, key_starts)
        assert groups[0].start == 0 and groups[-1].end == size
        assert all(a.end == b.start for a, b in itertools.pairwise(groups))
        assert {g.end for g in groups} <= set(frame_ends)
        for g, after in itertools.pairwise(groups):  # short only where a large frame comes next
            assert g.end - g.start >= min_rows or (after.end - after.start >= min_rows and after.key_starts)
        for start, end, starts in groups:
            assert bool((bias[:, :, start:end, end:] == MASKED).all())
            single_frame = start >= text_len and end - start in frame_rows and start in frame_ends
            assert (starts is not None) == single_frame
            for item, first in enumerate(starts or ()):
                assert bool((bias[item, :, start:end, first:end] == 0).all())
                assert bool((bias[item, :, start:end, :first] == MASKED).all())
    one_per_frame = causal_row_groups(text_len, grids, 1, key_starts)
    assert len(one_per_frame) == 6 and all(g.key_starts == (2, 0) for g in one_per_frame[1:])
    assert [g.end - g.start for g in causal_row_groups(text_len, grids, 16)] == [
        text_len + 6,
        16,
        16,
        16,
        16,
        16,
    ]
    assert causal_row_groups(text_len, grids, 1000) == [(0, size, None)]
    assert all(g.key_starts is None for g in causal_row_groups(text_len, grids, 1))  # text offsets unknown


def test_row_group_attention_operator_is_the_masked_attention() -> None:
    """The operator compiled blocks call for row groups without gradients: the groups survive its host
    table, its result is the one-call masked attention's for any grouping (q, k, v strided as the blocks'
    splits leave them), and its schema, shape function and kernel agree (``torch.library.opcheck``)."""
    from pfctl.models.attention_layout import (
        RowGroup,
        build_attention_bias,
        causal_row_groups,
        group_table,
        masked_attention,
    )
    from pfctl.models.fast.row_groups import row_group_attention, table_groups

    grids, text_len = [(1, 2, 3), (2, 4, 4), (3, 4, 4)], 5
    text_valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)  # left-aligned
    (bias,) = build_attention_bias(text_valid, [clip_frame_ids(grids, "cpu")], 1, True, torch.float32)
    size = bias.shape[-1]
    q, k, v = torch.randn(2, size, 3, 2, 8).unbind(2)  # [B, S, H, hd] views with a gap between rows
    want = masked_attention(q, k, v, bias)
    for groups in (
        causal_row_groups(text_len, grids, 1, [2, 0]),
        causal_row_groups(text_len, grids, 10, [2, 0]),
        causal_row_groups(text_len, grids, 10),
        [RowGroup(0, size)],
    ):
        table = group_table(groups, 2)
        assert table_groups(table) == groups
        got = torch.ops.pfctl.row_group_attention(q, k, v, bias, table, "auto")
        assert got.shape == want.shape
        assert_rounding_close(got, want, **SUMS)
    torch.library.opcheck(row_group_attention, (q, k, v, bias, group_table(groups, 2), "auto"))


def test_left_aligned_text_keeps_the_valid_tokens() -> None:
    from pfctl.models.attention_layout import left_align_text, right_padded_lengths

    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    assert right_padded_lengths(mask) == [2, 3, 0]
    assert right_padded_lengths(torch.tensor([[1, 0, 1]])) is None
    text = torch.arange(15.0).view(3, 5)
    aligned, aligned_mask = left_align_text(text, mask, [2, 3, 0])
    assert aligned_mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 0]]
    assert aligned[aligned_mask.bool()].tolist() == [0.0, 1.0, 5.0, 6.0, 7.0]


def test_grouped_columns_build_only_the_mask_their_masked_groups_read(monkeypatch) -> None:
    """In row groups the mask is built only up to the end of the last group attended under it (the
    single-frame groups after it attend without one); a column in one masked call gets its whole mask."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 16)  # each 16-token frame after the first is a group
    args = long_inputs()
    model = build("flux")
    model.set_attention_backend("auto", skip_future_keys=True, min_tokens=80)  # column 1 (89 tokens) grouped
    grids = [[(c.shape[2], c.shape[3] // 2, c.shape[4] // 2) for c in col] for col in args["sample"]]
    mask = args["encoder_attention_mask"]
    for text_lengths, extents in ((None, [69, 89]), (dc.right_padded_lengths(mask), [69, 9])):
        layout = model.build_layout(grids, mask, 2, torch.float32, text_lengths)
        assert [m.shape[2] for m in layout.attn_masks] == extents
        masked = [g for g in layout.row_groups[1] if g.key_starts is None]
        assert layout.row_groups[0] is None and masked[-1].end == extents[1]
        assert len(masked) < len(layout.row_groups[1]) or text_lengths is None


@pytest.mark.parametrize("min_rows", [None, 24, 16])
def test_the_last_block_computes_only_the_rows_the_output_reads(monkeypatch, min_rows: int | None) -> None:
    """The last single-stream block queries, feeds forward and returns only each column's last clip (the
    history rows and the text after it are read by nothing): outputs and every gradient equal those of a
    forward whose last block computes all rows (fp32 rounding), and the attention there has only the last
    clips' rows. With one masked call per column, in masked row groups of two 16-token frames (one spanning
    history and last clip), and in mask-free single-frame groups."""
    import pfctl.models.attention_layout as dc
    from pfctl.models.dit_flux import FluxSingleTransformerBlock

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", min_rows or 1)
    monkeypatch.setattr(dc, "ROW_GROUP_MIN_TOKENS", 0)
    args = long_inputs()
    grouped = min_rows is not None
    lengths = dc.right_padded_lengths(args["encoder_attention_mask"]) if grouped else None
    attend, query_rows = dc.PyramidLayout.attend, []

    def recording(layout, column, q, k, v):
        query_rows.append((q.shape[1], k.shape[1], layout.tail_lengths[column]))
        return attend(layout, column, q, k, v)

    monkeypatch.setattr(dc.PyramidLayout, "attend", recording)
    results = []
    for prune in (True, False):
        if not prune:  # every row of the last block, then the last clips' rows of its output
            forward = FluxSingleTransformerBlock.forward

            def full_rows(block, hidden, temb, layout, last=False, forward=forward):
                out = forward(block, hidden, temb, layout)
                return dc.column_tails(out, layout.joint_lengths, layout.tail_lengths) if last else out

            monkeypatch.setattr(FluxSingleTransformerBlock, "forward", full_rows)
        query_rows.clear()
        model = build("flux", num_single_layers=2).train()
        model.set_attention_backend("auto", skip_future_keys=grouped)
        outs = model(**clone_args(args), text_lengths=lengths)
        sum(o.square().mean() for o in outs).backward()
        results.append(outs + [p.grad for p in model.parameters()])
        last_calls = query_rows[-2:]  # the last block's attention, one call per column
        assert all(q == (tail if prune else k) and tail < k for q, k, tail in last_calls), last_calls
    for got, want in zip(*results, strict=True):
        assert_rounding_close(got, want, **SUMS)


@pytest.mark.parametrize("kind", MODELS)
def test_skip_future_keys_computes_the_same_attention(kind: str, monkeypatch) -> None:
    """``skip_future_keys``: row-grouped attention gives the one-call outputs and gradients (float32, to
    float rounding), checkpointed blocks included, and with the text lengths given (text cut to its longest
    row, mask-free single-frame groups) too; models without temporal causality ignore it."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)  # several groups on these small columns
    monkeypatch.setattr(dc, "ROW_GROUP_MIN_TOKENS", 0)  # grouped however short the columns
    grouped, calls = dc._attention_by_row_groups, []

    def counting(*args, **kwargs):
        calls.append(args[5])  # the row groups
        return grouped(*args, **kwargs)

    monkeypatch.setattr(dc, "_attention_by_row_groups", counting)
    args = long_inputs()
    pad = 3  # padding columns every row has: cut when the lengths are known
    args["encoder_hidden_states"] = F.pad(args["encoder_hidden_states"], (0, 0, 0, pad))
    args["encoder_attention_mask"] = F.pad(args["encoder_attention_mask"], (0, pad))
    lengths = dc.right_padded_lengths(args["encoder_attention_mask"])
    results = []
    for skip, text_lengths in ((False, None), (True, None), (True, lengths)):
        calls.clear()
        model = checkpointed(build(kind).train(), 0.5)
        model.set_attention_backend("auto", skip_future_keys=skip)
        outs = model(**clone_args(args), text_lengths=text_lengths)
        sum(o.square().mean() for o in outs).backward()
        results.append(outs + [p.grad for p in model.parameters()])
        with torch.no_grad():  # the sampler's path: the groups as one operator
            for got, want in zip(model(**clone_args(args), text_lengths=text_lengths), outs, strict=True):
                assert_rounding_close(got, want, **SUMS)
        assert bool(calls) == skip and all(len(groups) > 2 for groups in calls)
        mask_free = [g for groups in calls for g in groups if g.key_starts is not None]
        assert bool(mask_free) == (text_lengths is not None)
    for variant in results[1:]:
        for got, want in zip(variant, results[0], strict=True):
            assert_rounding_close(got, want, **SUMS)
    plain = build(kind, use_temporal_causal=False)
    plain.set_attention_backend("auto", skip_future_keys=True)
    assert plain.attention_row_groups(5, [[(2, 4, 4)]], None) is None
    monkeypatch.setattr(dc, "ROW_GROUP_MIN_TOKENS", 40)  # a short column takes one masked call
    short, long = [(1, 4, 4)], [(1, 4, 4), (2, 4, 4)]
    assert model.attention_row_groups(5, [short], None) is None
    assert [g is None for g in model.attention_row_groups(5, [short, long], None)] == [True, False]
    model.set_attention_backend("auto", skip_future_keys=True, min_tokens=0)  # the model's own threshold
    assert [g is None for g in model.attention_row_groups(5, [short, long], None)] == [False, False]
    model.set_attention_backend("auto", skip_future_keys=True, min_tokens=100)
    assert model.attention_row_groups(5, [short, long], None) is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="threshold"):
            model.set_attention_backend("auto", skip_future_keys=True, min_tokens=bad)


def test_skip_future_keys_keeps_the_padding_an_unmasked_mmdit_attends(monkeypatch) -> None:
    """``use_t5_mask=False``: every text token is attended, padding included, so given text lengths must not
    cut it: the mask-free groups start at key 0 and the outputs are the one-call ones."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)
    monkeypatch.setattr(dc, "ROW_GROUP_MIN_TOKENS", 0)
    grouped, starts = dc._attention_by_row_groups, set()

    def recording(*args):
        starts.update(g.key_starts for g in args[5] if g.key_starts is not None)
        return grouped(*args)

    monkeypatch.setattr(dc, "_attention_by_row_groups", recording)
    args = long_inputs()
    model = build("mmdit", use_t5_mask=False)
    want = run(model, clone_args(args))
    model.set_attention_backend("auto", skip_future_keys=True)
    with torch.no_grad():
        got = model(**clone_args(args), text_lengths=dc.right_padded_lengths(args["encoder_attention_mask"]))
    assert starts == {(0, 0)}
    for a, b in zip(got, want, strict=True):
        assert_rounding_close(a, b, **SUMS)


def long_inputs(seed: int = 3) -> dict:
    """Like :func:`inputs` with longer columns (several frames of 16 tokens after the history)."""
    args = inputs(seed)
    gen = torch.Generator().manual_seed(seed)

    def clip(t: int, h: int, w: int) -> torch.Tensor:
        return torch.randn(2, LATENT_C, t, h, w, generator=gen)

    args["sample"] = [[clip(1, 8, 8), clip(3, 8, 8)], [clip(1, 4, 4), clip(2, 8, 8), clip(3, 8, 8)]]
    return args


def test_compiled_training_with_row_groups_recompiles_nothing_per_column(monkeypatch) -> None:
    """With row groups on (``skip_future_keys``), training steps whose columns are grouped in some steps and too
    short in others must not recompile per column: with gradients every attention call of a compiled block
    goes to the eager row-group function, which the compiled code hands the layout and column whole. (When a
    step without grouped columns traced the one-call path in the attention frame that a grouped step's graph
    break had made, that frame was compiled again for every column index, up to dynamo's recompile limit:
    benchmarks/RESULTS.md, session 20.)"""
    import pfctl.models.attention_layout as dc
    from pfctl.models.fast import FastPaths, apply_fast_paths

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)
    model = build("flux").train()
    # columns of 5 text and 4 + 4t image tokens: grouped from t = 4
    model.set_attention_backend("auto", skip_future_keys=True, min_tokens=25)
    torch._dynamo.reset()
    apply_fast_paths(model, FastPaths(PLAIN, compile=True, compile_backend="eager", independent_sizes=True))
    gen = torch.Generator().manual_seed(0)
    try:
        for frames in [(1, 2), (5, 1), (1, 1), (2, 6), (1, 5), (2, 2), (6, 4), (4, 1)]:
            args = inputs()
            args["sample"] = [
                [
                    torch.randn(2, LATENT_C, 1, 4, 4, generator=gen),
                    torch.randn(2, LATENT_C, t, 4, 4, generator=gen),
                ]
                for t in frames
            ]
            sum(o.square().mean() for o in model(**args)).backward()
        # why dynamo compiled each frame again, per code object
        reasons = {code.co_name: list(why) for code, why in torch._dynamo.guard_failures.items()}
    finally:
        torch._dynamo.reset()
    assert not [r for why in reasons.values() for r in why if "column" in r], reasons
    assert len(reasons.get("attend", [])) <= 1, reasons  # (the column index turning dynamic)


@pytest.mark.slow
def test_compiled_blocks_keep_one_graph_per_block_type_across_training_layouts() -> None:
    """Columns whose token counts change independently (as a training run's do every step) must not
    recompile the blocks: the layout hands them contiguous padded masks (no stride pattern to specialise
    on) and ``independent_sizes`` turns duck shaping off (no equality between sizes that happen to match)."""
    import torch.fx.experimental._config as shape_config
    from torch._dynamo.utils import counters

    duck_shape = shape_config.use_duck_shape  # process-wide: restored for the other tests
    try:
        model = build("flux")
        torch._dynamo.reset()
        counters.clear()
        from pfctl.models.fast import FastPaths, apply_fast_paths

        # guards and graphs as with inductor
        apply_fast_paths(model, FastPaths(compile=True, compile_backend="eager", independent_sizes=True))
        gen = torch.Generator().manual_seed(0)
        for frames in [
            (1, 2),
            (3, 2),
            (2, 2),
            (4, 1),
            (1, 3),
        ]:  # S = 4 + 4t: multiples of 8 or not, equal or not
            args = inputs(text_len=4)
            args["sample"] = [
                [
                    torch.randn(2, LATENT_C, 1, 4, 4, generator=gen),
                    torch.randn(2, LATENT_C, t, 4, 4, generator=gen),
                ]
                for t in frames
            ]
            run(model, args)
        assert counters["stats"]["unique_graphs"] == 3  # double, single, and the last single block
    finally:
        shape_config.use_duck_shape = duck_shape
        torch._dynamo.reset()


def test_compiled_blocks_take_their_float_attributes_as_constants() -> None:
    """With every size dynamic, Dynamo passed each float attribute of a block (norm eps, dropout p) to its graph
    as a 0-dim CPU tensor; on CUDA under FSDP2 and checkpointing, Inductor then generated CPU code for a block
    (the compose test below). The compiled blocks' graphs take no such input, forward or recomputed."""
    from pfctl.models.fast import FastPaths, apply_fast_paths

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    model = build("flux").train()
    torch._dynamo.reset()
    try:
        apply_fast_paths(model, FastPaths(PLAIN, checkpointing_ratio=0.5, compile=True, compile_backend=keep))
        sum(o.square().mean() for o in model(**inputs(seed=0))).backward()
    finally:
        torch._dynamo.reset()
    scalars = [
        node.name
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "placeholder"
        and isinstance(value := node.meta.get("example_value"), torch.Tensor)
        and value.dim() == 0
    ]
    assert graphs and not scalars, scalars


def _to(args: dict, device: str) -> dict:
    def move(v):
        return [move(x) for x in v] if isinstance(v, list) else v.to(device)

    return {k: move(v) for k, v in args.items()}


def _inductor_on_cuda_only(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Inductor, after checking that a compiled block computes nothing on the CPU: a CPU value fails at once and
    names its node, where Inductor would otherwise generate CPU code for it (the blocks' float attributes did,
    until compiled as constants)."""
    from torch._inductor.compile_fx import compile_fx

    on_cpu = [
        node.format_node()
        for node in gm.graph.nodes
        if isinstance(value := node.meta.get("example_value"), torch.Tensor) and value.device.type == "cpu"
    ]
    assert not on_cpu, "CPU values in a compiled block: " + "; ".join(on_cpu[:8])
    return compile_fx(gm, example_inputs)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["shard_grad_op", "full_shard"])
def test_checkpointing_compile_and_fsdp2_compose_on_cuda(strategy: str) -> None:
    """torchtitan's stack on one model, in its order: checkpointed blocks, compiled by Inductor, then sharded
    by FSDP2 (a one-process group): the eager model's outputs and gradients within fp32 rounding, over two
    AdamW steps (the second one runs the compiled code with sharded, updated weights)."""
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.runtime.sharding import shard_model

    eager, fast = build("flux").cuda().train(), build("flux").cuda().train()
    torch._dynamo.reset()
    paths = FastPaths(PLAIN, checkpointing_ratio=0.5, compile=True, compile_backend=_inductor_on_cuda_only)
    apply_fast_paths(fast, paths)
    shard_model(fast, [b for _, b in fast.blocks_in_order()], strategy=strategy, device=torch.device("cuda"))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, fast)]
    for step in range(2):
        results = []
        for model, optimizer in zip((eager, fast), optimizers, strict=True):
            outs = model(**_to(inputs(seed=step), "cuda"))
            sum(o.square().mean() for o in outs).backward()
            grads = {
                n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in model.named_parameters()
            }
            results.append(([o.detach().cpu() for o in outs], {n: g.cpu() for n, g in grads.items()}))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for a, b in zip(results[0][0], results[1][0], strict=True):
            assert_rounding_close(b, a, **SUMS)
        assert results[0][1].keys() == results[1][1].keys()
        for name, grad in results[0][1].items():
            assert_rounding_close(results[1][1][name], grad, **SUMS, msg=f"step {step}: {name}")
    torch._dynamo.reset()
