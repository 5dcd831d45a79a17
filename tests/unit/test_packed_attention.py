"""The ``flex`` attention backend: every column of a DiT call in one FlexAttention call
(:mod:`pfctl.models.packed_attention`) computes what one masked SDPA call per column computes, forward and
backward, in the layer, in both tiny DiTs, and in compiled blocks (Dynamo, dynamic sizes); its block-sparse
mask marks the tiles the per-column masks make visible.

PyTorch refuses FlexAttention's backward on the CPU (its compiled CPU kernel has none; training on the CPU
keeps the SDPA kernels, ``train.attention``). Its uncompiled implementation, which these tests run, computes
the backward like any other autograd operator: the ``cpu_backward`` fixture lifts the refusal for them."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from helpers.tiny_dit import LATENT_C, PLAIN, SUMS, build, checkpointed, clone_args, inputs
from helpers.tolerance import assert_rounding_close
from pfctl.models import attention_layout as al
from pfctl.models.packed_attention import BLOCK, ORDERS, packed_columns

#: columns of clips (t, h, w) in tokens: several tiles of ``BLOCK`` tokens, none a multiple of it
GRIDS = [[(1, 4, 6), (2, 8, 12)], [(3, 5, 5)], [(1, 2, 2), (1, 4, 4), (2, 9, 10)]]
TEXT_LEN, BATCH, HEADS, HEAD_DIM = 7, 2, 2, 8


@pytest.fixture
def cpu_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None, raising=False)
    # the uncompiled implementation says it is slow: it is what these tests mean to run
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def _layout(causal: bool, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    text_valid = torch.rand(len(GRIDS) * BATCH, TEXT_LEN, generator=gen) > 0.3
    frame_ids = [al.clip_frame_ids(grids, torch.device("cpu")) for grids in GRIDS]
    sizes = [TEXT_LEN + ids.shape[0] for ids in frame_ids]
    tails = [t * h * w for t, h, w in (grids[-1] for grids in GRIDS)]
    return text_valid, frame_ids, sizes, tails


def _dense_visibility(text_valid: torch.Tensor, frame_ids: list[torch.Tensor], causal: bool) -> torch.Tensor:
    """``[Bc, T, T]``: the per-column rules (:func:`visibility_rules`) on the diagonal, nothing across columns."""
    rules = al.visibility_rules(text_valid, frame_ids, len(frame_ids), causal)
    total = sum(size for _, size, _ in rules)
    dense, start = torch.zeros(BATCH, total, total, dtype=torch.bool), 0
    for bc, size, rule in rules:
        idx = torch.arange(size)
        dense[:, start : start + size, start : start + size] = rule(
            torch.arange(bc)[:, None, None], None, idx[:, None], idx[None, :]
        )
        start += size
    return dense


def _positions(sizes: list[int], tails: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per token order (:data:`ORDERS`) its queries' and keys' positions in the joint order."""
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    text = [torch.arange(a, a + TEXT_LEN) for a in starts[:-1]]
    image = [torch.arange(a + TEXT_LEN, b) for a, b in itertools.pairwise(starts)]
    every, streams = torch.arange(starts[-1]), torch.cat(text + image)
    rows = torch.cat([torch.arange(end - m, end) for end, m in zip(starts[1:], tails, strict=True)])
    return {"joint": (every, every), "streams": (streams, streams), "tails": (rows, every)}


@pytest.mark.parametrize("causal", [True, False])
def test_block_masks_mark_the_tiles_the_column_masks_make_visible(causal: bool) -> None:
    """In every token order a tile with a visible pair is in the mask, a tile visible throughout is a full one
    (the kernel skips the rule there), a tile with none is skipped."""
    text_valid, frame_ids, sizes, tails = _layout(causal)
    packed = packed_columns(text_valid, frame_ids, len(GRIDS), causal, ORDERS, tails)
    dense = _dense_visibility(text_valid, frame_ids, causal)
    for order, (queries, keys) in _positions(sizes, tails).items():
        mask, visible = getattr(packed, order), dense[:, queries][:, :, keys]
        q_len, kv_len = visible.shape[1:]
        assert mask.shape[-2:] == (q_len, kv_len)
        padded = torch.zeros(BATCH, -(-q_len // BLOCK) * BLOCK, -(-kv_len // BLOCK) * BLOCK, dtype=torch.int64)
        padded[:, :q_len, :kv_len] = visible
        count = padded.view(BATCH, padded.shape[1] // BLOCK, BLOCK, -1, BLOCK).sum((2, 4))
        full = _tiles(mask.full_kv_num_blocks, mask.full_kv_indices, count.shape)
        partial = _tiles(mask.kv_num_blocks, mask.kv_indices, count.shape)
        assert torch.equal(full, count == BLOCK * BLOCK), order
        assert torch.equal(partial, (count > 0) & (count < BLOCK * BLOCK)), order
        assert (count == 0).any(), f"{order}: the layout has tiles to skip"


def _tiles(num: torch.Tensor, indices: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    tiles = torch.zeros(shape, dtype=torch.bool)
    for b in range(shape[0]):
        for row in range(shape[1]):
            tiles[b, row, indices[b, 0, row, : num[b, 0, row]].long()] = True
    return tiles


@pytest.mark.parametrize("causal", [True, False])
def test_one_call_attends_as_one_masked_call_per_column(causal: bool, cpu_backward: None) -> None:
    """In every token order the packed call's outputs and q/k/v gradients equal the per-column SDPA calls'
    (float64: only the summation order differs)."""
    text_valid, frame_ids, sizes, tails = _layout(causal)
    packed = packed_columns(text_valid, frame_ids, len(GRIDS), causal, ORDERS, tails)
    masks = al.build_attention_bias(text_valid, frame_ids, len(GRIDS), causal, torch.float64)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(BATCH, sum(sizes), HEADS, HEAD_DIM, generator=gen, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    per_column = zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), masks, strict=True)
    expected = torch.cat([al.masked_attention(*call) for call in per_column], dim=1)  # every row, joint order
    for order, (queries, keys) in _positions(sizes, tails).items():
        out = packed.attend(q[:, queries], k[:, keys], v[:, keys], order)
        want = expected[:, queries]
        grad = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        assert_rounding_close(out, want, reduction=max(sizes), depth=2, msg=order)
        pairs = zip(
            torch.autograd.grad(out, (q, k, v), grad),
            torch.autograd.grad(want, (q, k, v), grad, retain_graph=True),  # the next order's too
            strict=True,
        )
        for got, wanted in pairs:
            assert_rounding_close(got, wanted, reduction=max(sizes), depth=4, msg=order)


@pytest.mark.parametrize("kind", ["flux", "mmdit"])
def test_dits_train_alike_with_one_attention_call_per_block(kind: str, cpu_backward: None) -> None:
    """The tiny DiTs with ``flex``: outputs and every parameter's gradient as with the memory-efficient kernel
    (one call per column), within fp32 rounding; no additive masks are built."""
    args, results = inputs(), []
    for backend in ("efficient", "flex"):
        model = build(kind).train()
        model.set_attention_backend(backend, skip_future_keys=True, min_tokens=0)  # flex: no row groups
        outs = model(**clone_args(args))
        sum(o.square().mean() for o in outs).backward()
        results.append((outs, {n: p.grad for n, p in model.named_parameters()}))
    layout = model.build_layout([[(1, 2, 2)]], args["encoder_attention_mask"][:2], 2, torch.float32)
    assert layout.packed is not None and not layout.attn_masks and layout.row_groups is None
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert_rounding_close(b, a, **SUMS)
    for name, grad in results[0][1].items():
        assert_rounding_close(results[1][1][name], grad, **SUMS, msg=name)


def test_selective_checkpointing_keeps_the_packed_attention(cpu_backward: None, monkeypatch) -> None:
    """``selective`` keeps FlexAttention's results as it keeps the SDPA kernels': the backward of every block
    checkpointed attends no column again (``full`` attends each block twice), with ``full``'s gradients."""
    from torch._C import DispatchKey

    attended, hop = [], torch.ops.higher_order.flex_attention
    dense = hop.py_kernels[DispatchKey.CompositeExplicitAutograd]  # the uncompiled attention itself
    monkeypatch.setitem(
        hop.py_kernels, DispatchKey.CompositeExplicitAutograd, lambda *a, **k: attended.append(1) or dense(*a, **k)
    )
    monkeypatch.setattr(hop, "_dispatch_cache", {})  # kernels resolved before the patch
    args, results = inputs(), {}
    for policy in ("full", "selective"):
        model = checkpointed(build("flux").train(), 1.0, policy=policy)
        model.set_attention_backend("flex")
        attended.clear()
        outs = model(**clone_args(args))
        forward = len(attended)
        sum(o.square().mean() for o in outs).backward()
        results[policy] = (forward, len(attended) - forward, outs, {n: p.grad for n, p in model.named_parameters()})
    blocks = len(model.blocks_in_order())
    assert results["full"][:2] == (blocks, blocks) and results["selective"][:2] == (blocks, 0)
    for a, b in zip(results["full"][2], results["selective"][2], strict=True):
        assert_rounding_close(b, a, **SUMS)
    for name, grad in results["full"][3].items():
        assert_rounding_close(results["selective"][3][name], grad, **SUMS, msg=name)


@pytest.mark.slow
def test_compiled_blocks_attend_in_one_call_without_recompiling(cpu_backward: None) -> None:
    """Blocks compiled with dynamic sizes (Dynamo and AOTAutograd, ``aot_eager``) take the packed call and its
    block mask as graph inputs, the double block checkpointed inside its graph (``selective``: torchtitan's
    stack): three training steps with other token counts trace each block kind once, and give the eager
    blocks' outputs and gradients. (The eager model runs first: PyTorch's uncompiled FlexAttention traces
    graphs of its own, which the count leaves out.)"""
    from torch._dynamo.utils import counters

    from pfctl.models.fast import FastPaths, apply_fast_paths

    gen = torch.Generator().manual_seed(0)
    steps = []
    for frames in [(1, 2), (3, 2), (2, 4)]:
        args = inputs(text_len=4)
        args["sample"] = [
            [torch.randn(2, LATENT_C, 1, 4, 4, generator=gen), torch.randn(2, LATENT_C, t, 4, 4, generator=gen)]
            for t in frames
        ]
        steps.append(args)
    eager, compiled = build("flux").train(), build("flux").train()
    for model in (eager, compiled):
        model.set_attention_backend("flex")
    checkpointed = {"checkpointing_ratio": 1 / 3, "checkpointing_policy": "selective"}  # the first of 3 blocks
    apply_fast_paths(eager, FastPaths(PLAIN, **checkpointed))
    torch._dynamo.reset()
    try:
        expected = [_train_step(eager, args) for args in steps]
        counters.clear()
        paths = FastPaths(PLAIN, **checkpointed, compile=True, compile_backend="aot_eager", independent_sizes=True)
        apply_fast_paths(compiled, paths)
        for step, args in enumerate(steps):
            outs, grads = _train_step(compiled, args)
            for a, b in zip(expected[step][0], outs, strict=True):
                assert_rounding_close(b, a, **SUMS)
            for name, grad in expected[step][1].items():
                assert_rounding_close(grads[name], grad, **SUMS, msg=f"step {step}: {name}")
        assert counters["stats"]["unique_graphs"] == 3  # double, single, and the last single block
    finally:
        torch._dynamo.reset()


def _train_step(model: torch.nn.Module, args: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs and gradients of one forward and backward (on the CPU)."""
    model.zero_grad(set_to_none=True)
    outs = model(**clone_args(args))
    sum(o.square().mean() for o in outs).backward()
    return [o.detach().cpu() for o in outs], {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_flex_blocks_train_like_eager_sdpa_blocks_on_cuda() -> None:
    """What ``train.attention=flex`` runs on a GPU: blocks compiled by Inductor (FlexAttention's generated
    kernels, forward and backward) against the eager blocks with one memory-efficient SDPA call per column;
    outputs and gradients within fp32 rounding, over two steps of other token counts."""
    from pfctl.models.fast import FastPaths, apply_fast_paths

    head_16 = {"attention_head_dim": 16, "axes_dims_rope": [4, 6, 6]}  # Inductor's FlexAttention: 16 or more
    eager, fast = (build("flux", **head_16).cuda().train() for _ in range(2))
    eager.set_attention_backend("efficient")
    fast.set_attention_backend("flex")
    torch._dynamo.reset()
    apply_fast_paths(fast, FastPaths(PLAIN, compile=True, independent_sizes=True))
    for step in range(2):
        args = inputs(seed=step, text_len=4 + step)
        args = {
            k: [[c.cuda() for c in col] for col in v] if k == "sample" else v.cuda() for k, v in args.items()
        }
        (outs, grads), (fast_outs, fast_grads) = (_train_step(model, args) for model in (eager, fast))
        for a, b in zip(outs, fast_outs, strict=True):
            assert_rounding_close(b, a, **SUMS)
        for name, grad in grads.items():
            assert_rounding_close(fast_grads[name], grad, **SUMS, msg=f"step {step}: {name}")
    torch._dynamo.reset()
