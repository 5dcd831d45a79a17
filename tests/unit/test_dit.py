"""Unit tests of the pyramid DiTs with tiny configs (CPU, random weights, no reference vectors). The compiled
blocks' tests are in test_dit_compile.py."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from helpers.tiny_dit import (
    LATENT_C,
    MODELS,
    SUMS,
    AttentionKernelRuns,
    build,
    checkpointed,
    clone_args,
    inputs,
    narrowing_block_products,
    run,
)
from helpers.tolerance import assert_rounding_close
from pfctl.config.fast import FastPathsConfig
from pfctl.errors import ConfigError, InputError
from pfctl.models.attention_layout import clip_frame_ids
from pfctl.models.dit_layers import num_checkpointed

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


@pytest.mark.parametrize("kind", MODELS)
def test_columns_of_two_batches_side_by_side_predict_as_apart(kind: str) -> None:
    """What merged micro-batches rely on (``train.merge_micro_batches``): one call holding the columns of two
    batches, of other clip sizes and histories, with their text and timestep rows in the merged order
    (``b*K + k``), predicts every column as the batch's own call does."""
    from pfctl.flow.pyramid import merged_row_order

    gen = torch.Generator().manual_seed(4)
    first = inputs(seed=1)  # 2 columns of 2 samples, 4 x 4 latents
    second = clone_args(first)
    second["sample"] = [
        [torch.randn(2, LATENT_C, t, h, w, generator=gen) for t, h, w in col]
        for col in ([(2, 4, 8)], [(1, 2, 4), (1, 4, 8), (1, 4, 8)])
    ]
    for key in ("encoder_hidden_states", "pooled_projections"):
        second[key] = torch.randn(second[key].shape, generator=gen)
    second["encoder_attention_mask"] = second["encoder_attention_mask"].flip(0)
    second["timestep_ratio"] = torch.tensor([600.0, 30.0, 900.0, 120.0])
    order = merged_row_order([2, 2], per_column=2)
    merged = {key: torch.cat([first[key], second[key]])[order] for key in first if key != "sample"}
    merged["sample"] = first["sample"] + second["sample"]
    model = build(kind)
    apart = run(model, first) + run(model, second)
    together = run(model, merged)
    assert len(together) == 4
    for a, b in zip(together, apart, strict=True):
        assert_rounding_close(a, b, **SUMS)


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


@pytest.mark.parametrize("kind", MODELS)
def test_selective_checkpointing_attends_once_and_matches_full(kind: str) -> None:
    """``selective`` keeps the attention kernels' results: the backward recomputes the blocks without
    attending again, with the outputs and gradients of ``full`` (which attends twice). ``selective_narrow``
    also keeps the blocks' narrowing products: the backward runs none of them again."""
    args = inputs()
    results, runs = [], {}
    for policy in ("full", "selective", "selective_narrow"):
        model = checkpointed(build(kind).train(), 1.0, policy=policy)
        with AttentionKernelRuns() as counter:
            outs = model(**clone_args(args))
            forward, narrow_forward = counter.runs, counter.narrow_runs
            sum(o.square().mean() for o in outs).backward()
        runs[policy] = (forward, counter.runs - forward, counter.narrow_runs - narrow_forward)
        results.append((outs, {n: p.grad.clone() for n, p in model.named_parameters()}))
    full, selective, narrow = runs["full"], runs["selective"], runs["selective_narrow"]
    assert full[0] == selective[0] == narrow[0] > 0
    assert full[1] == full[0]  # every block checkpointed: each call recomputed once
    assert selective[1] == narrow[1] == 0
    products = len(narrowing_block_products(model))
    assert products > 0 and full[2] == selective[2] == narrow[2] + products
    for outs, grads in results[1:]:
        for a, b in zip(results[0][0], outs, strict=True):
            assert_rounding_close(b, a, **SUMS)  # two models: other addresses
        for name, grad in results[0][1].items():
            assert_rounding_close(grads[name], grad, **SUMS, msg=name)


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
        model.set_attention_backend("flash3")
    with pytest.raises(ConfigError, match="row-group minimum 0 is not a row count"):
        model.set_attention_backend("auto", skip_future_keys=True, min_rows=0)
    with pytest.raises(ConfigError, match="row-group threshold -1 is not a token count"):
        model.set_attention_backend("auto", skip_future_keys=True, min_tokens=-1)


def test_causal_row_groups_skip_only_masked_keys() -> None:
    """Every key a row group skips (at or after its end) is masked for every row of the group, under the real
    mask with text padding; groups tile the sequence and close at frame boundaries after ``min_rows``, a frame
    that large standing alone. A group marked mask-free (``key_starts``, left-aligned text) is one frame's,
    the first with the text: its rows see exactly the keys from each item's valid text to its end, those of
    the text padding only the padding."""
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
            single_frame = (start >= text_len and end - start in frame_rows and start in frame_ends) or (
                start == 0 and end == frame_ends[0]  # the text and the first frame
            )
            assert (starts is not None) == single_frame
            for item, first in enumerate(starts or ()):
                valid, padding = slice(max(start, first), end), slice(start, max(start, first))
                assert bool((bias[item, :, valid, first:end] == 0).all())
                assert bool((bias[item, :, valid, :first] == MASKED).all())
                assert bool((bias[item, :, padding, :first] == 0).all())  # the padding sees only itself
                assert bool((bias[item, :, padding, first:end] == MASKED).all())
    one_per_frame = causal_row_groups(text_len, grids, 1, key_starts)
    assert len(one_per_frame) == 6 and all(g.key_starts == (2, 0) for g in one_per_frame)
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
        table_text_len,
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
        table = group_table(groups, 2, text_len)
        assert table_groups(table) == groups and table_text_len(table) == text_len
        got = torch.ops.pfctl.row_group_attention(q, k, v, bias, table, "auto")
        assert got.shape == want.shape
        assert_rounding_close(got, want, **SUMS)
    torch.library.opcheck(row_group_attention, (q, k, v, bias, group_table(groups, 2, text_len), "auto"))


def test_left_aligned_text_keeps_the_valid_tokens() -> None:
    from pfctl.models.attention_layout import left_align_text, right_padded_lengths

    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    assert right_padded_lengths(mask) == [2, 3, 0]
    assert right_padded_lengths(torch.tensor([[1, 0, 1]])) is None
    text = torch.arange(15.0).view(3, 5)
    aligned, aligned_mask = left_align_text(text, mask, [2, 3, 0])
    assert aligned_mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 0]]
    assert aligned[aligned_mask.bool()].tolist() == [0.0, 1.0, 5.0, 6.0, 7.0]
    aligned, aligned_mask = left_align_text(text, mask, [2, 3, 0], multiple=2)  # 3 rounded up to 4
    assert aligned_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0]]
    assert aligned[aligned_mask.bool()].tolist() == [0.0, 1.0, 5.0, 6.0, 7.0]
    assert left_align_text(text, mask, [2, 3, 0], multiple=8)[1].shape == (3, 5)  # never past the text


def test_grouped_columns_build_only_the_mask_their_masked_groups_read(monkeypatch) -> None:
    """In row groups the mask is built only up to the end of the last group attended under it (the
    single-frame groups attend without one); a column in one masked call gets its whole mask."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 16)  # each 16-token frame after the first is a group
    args = long_inputs()
    model = build("flux")
    model.set_attention_backend("auto", skip_future_keys=True, min_tokens=80)  # column 1 (89 tokens) grouped
    grids = [[(c.shape[2], c.shape[3] // 2, c.shape[4] // 2) for c in col] for col in args["sample"]]
    mask = args["encoder_attention_mask"]
    # with the text lengths known every group is a single frame's (the first with the text): no mask read (its
    # two rows kept: a compiled block taking the mask would specialise on a size of 0 or 1)
    for text_lengths, extents in ((None, [69, 89]), (dc.right_padded_lengths(mask), [69, 2])):
        layout = model.build_layout(grids, mask, 2, torch.float32, text_lengths)
        assert [m.shape[2] for m in layout.attn_masks] == extents
        masked = [g for g in layout.row_groups[1] if g.key_starts is None]
        assert layout.row_groups[0] is None and max((g.end for g in masked), default=2) == extents[1]
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
    row, mask-free single-frame groups) too, also cut only to a multiple of some tokens (as under ``cudnn``);
    models without temporal causality ignore it."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)  # several groups on these small columns
    monkeypatch.setattr(dc, "CUDNN_TEXT_MULTIPLE", 3)  # the longest row (5 tokens) cut to 6: one padding kept
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
    variants = ((False, None, "auto"), (True, None, "auto"), (True, lengths, "auto"), (True, lengths, "cudnn"))
    for skip, text_lengths, backend in variants:
        calls.clear()
        model = checkpointed(build(kind).train(), 0.5)
        model.set_attention_backend(backend, skip_future_keys=skip)
        outs = model(**clone_args(args), text_lengths=text_lengths)
        sum(o.square().mean() for o in outs).backward()
        results.append(outs + [p.grad for p in model.parameters()])
        with torch.no_grad():  # the sampler's path: the groups as one operator
            for got, want in zip(model(**clone_args(args), text_lengths=text_lengths), outs, strict=True):
                assert_rounding_close(got, want, **SUMS)
        assert bool(calls) == skip and all(len(groups) > 2 for groups in calls)
        mask_free = [g for groups in calls for g in groups if g.key_starts is not None]
        assert bool(mask_free) == (text_lengths is not None)
        if mask_free:  # the valid text starts at the cut width less the item's length
            width = 6 if backend == "cudnn" else max(lengths)
            assert max(s for g in mask_free for s in g.key_starts) == width - min(lengths)
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
