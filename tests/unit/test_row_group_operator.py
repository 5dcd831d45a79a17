"""The training row-group operator (:mod:`pfctl.models.fast.row_groups`): forward and backward from the fused
kernels, with the results and gradients of SDPA group by group."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_dit import SUMS
from helpers.tolerance import assert_rounding_close
from pfctl.models.attention_layout import (
    RowGroup,
    causal_row_groups,
    clip_frame_ids,
    group_table,
    masked_attention,
    padded_attention_bias,
)
from pfctl.models.fast import row_groups
from pfctl.models.fast.row_groups import row_group_attention_train

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GRIDS, TEXT_LEN = [(1, 2, 3), (2, 4, 4), (3, 4, 4)], 5


def _column(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
    text_valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)  # left-aligned
    (mask,) = padded_attention_bias(text_valid, [clip_frame_ids(GRIDS, "cpu")], 1, True, dtype)
    return mask, mask.shape[2]


def _groupings(size: int) -> list[list[RowGroup]]:
    return [
        causal_row_groups(TEXT_LEN, GRIDS, 1, [2, 0]),  # one frame a group, no mask
        causal_row_groups(TEXT_LEN, GRIDS, 10, [2, 0]),  # masked groups and mask-free ones
        causal_row_groups(TEXT_LEN, GRIDS, 1, [2, 2]),  # one run of items: whole-batch calls
        causal_row_groups(TEXT_LEN, GRIDS, 1, [TEXT_LEN, 0]),  # an item without valid text
        causal_row_groups(TEXT_LEN, GRIDS, 10),
        [RowGroup(0, size)],  # a column too short to be grouped
    ]


def _attend_with_gradients(attend, q, k, v, weight) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    (out * weight).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize(
    "device, backend",
    [
        ("cpu", "efficient"),
        ("cpu", "split"),
        pytest.param("cuda", "efficient", marks=gpu),
        pytest.param("cuda", "cudnn", marks=gpu),
    ],
)
def test_training_operator_matches_sdpa_by_groups_with_gradients(monkeypatch, device: str, backend: str) -> None:
    """Output and q/k/v gradients of ``row_group_attention_train`` equal SDPA's group by group with autograd
    (on CUDA in bfloat16, where the two are as far from float32 as each other: the flash and memory-efficient
    kernels under ``efficient``, cuDNN's under ``cudnn``, its mask-free calls split into image and text keys),
    for every kind of grouping and for the last block's tail queries (``q`` shorter than ``k``). ``split``:
    the CPU's kernel with the mask-free calls split as under ``cudnn``, equal within float32 rounding. On
    CUDA the log-sum-exp is that of the float32 scores."""
    if backend == "split":
        monkeypatch.setattr(row_groups, "_kernels", lambda q, backend: row_groups._Kernels("cpu", "cpu", "cpu"))
    dtype, head = (torch.float32, 8) if device == "cpu" else (torch.bfloat16, 64)
    mask, size = _column(dtype)
    mask = mask.to(device)
    gen = torch.Generator().manual_seed(0)
    for groups in _groupings(size):
        table = group_table(groups, 2, TEXT_LEN)
        for tail in (size, 16):
            q = torch.randn(2, tail, 3, head, generator=gen)
            k, v = torch.randn(2, 2, size, 3, head, generator=gen).unbind(1)  # strided [B, S, H, hd] views
            weight = torch.randn(2, tail, 3 * head, generator=gen)
            inputs = [t.to(device, dtype) for t in (q, k, v, weight)]
            sdpa = _attend_with_gradients(
                lambda q, k, v, groups=groups: masked_attention(q, k, v, mask, "efficient", groups), *inputs
            )
            ours = _attend_with_gradients(
                lambda q, k, v, table=table: row_group_attention_train(q, k, v, mask, table, backend)[0], *inputs
            )
            if dtype == torch.float32:
                for want, got, name in zip(sdpa, ours, ("out", "dq", "dk", "dv"), strict=True):
                    assert_rounding_close(got, want, **SUMS, msg=f"{name} {groups} tail {tail}")
                continue
            exact = _attend_with_gradients(  # float32, group by group
                lambda q, k, v, groups=groups: masked_attention(q, k, v, mask.float(), "efficient", groups),
                *(t.to(device, torch.float32) for t in (q, k, v, weight)),
            )
            for want, theirs, got, name in zip(exact, sdpa, ours, ("out", "dq", "dk", "dv"), strict=True):
                their_error = (theirs.float() - want).abs().max()
                error = (got.float() - want).abs().max()
                assert error <= 2 * their_error + 1e-3 * want.abs().max(), f"{name} {groups} tail {tail}"
            if any(g.key_starts not in (None, (2, 0)) for g in groups):
                continue  # text starts other than the mask's: the groups, not the mask, decide what is seen
            q32, k32 = (t.float() for t in inputs[:2])
            scores = torch.einsum("bqhd,bkhd->bhqk", q32, k32) / head**0.5
            want = (scores + mask.float()[:, :, size - tail :, :size]).logsumexp(-1)
            lse = row_group_attention_train(*inputs[:3], mask, table, backend)[1]
            # the kernels sum bf16 products in float32 (each score off by up to head float32 roundings of its
            # terms' magnitudes) and exponentiate to ~2^-22 relative
            magnitude = torch.einsum("bqhd,bkhd->bhqk", q32.abs(), k32.abs()).amax() / head**0.5
            bound = head * magnitude * 2**-23 + 2**-22 * want.abs().amax() + 1e-6
            assert (lse - want).abs().max() <= bound, f"lse {groups} tail {tail}"


def test_training_operator_log_sum_exp_and_schema() -> None:
    """The second output is every query row's log-sum-exp over the keys it may see, and the operator's schema,
    shape function, kernel and autograd agree (``torch.library.opcheck``). Inductor never records it in a
    CUDA graph (it reads its group table on the host)."""
    mask, size = _column()
    q, k, v = torch.randn(3, 2, size, 3, 8).unbind(0)
    groups = causal_row_groups(TEXT_LEN, GRIDS, 10, [2, 0])
    _, lse = row_group_attention_train(q, k, v, mask, group_table(groups, 2, TEXT_LEN), "efficient")
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5 + mask[:, :, :, :size]
    assert_rounding_close(lse, scores.logsumexp(-1), **SUMS)
    args = (*(t.requires_grad_() for t in (q, k, v)), mask, group_table(groups, 2, TEXT_LEN), "efficient")
    torch.library.opcheck(row_group_attention_train, args)
    if hasattr(torch.Tag, "cudagraph_unsafe"):
        assert torch.Tag.cudagraph_unsafe in torch.ops.pfctl.row_group_attention_train.default.tags


@pytest.mark.parametrize(("version", "takes"), [(None, False), (8907, False), (90100, True)])
def test_cudnn_masked_calls_need_cudnn_9(monkeypatch, version: int | None, takes: bool) -> None:
    """The ``cudnn`` backend sends the masked calls to cuDNN's fused attention only where PyTorch was built
    with cuDNN 9 or newer (this PyTorch's operator takes the mask); elsewhere they stay memory-efficient."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: version is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)
    row_groups._cudnn_takes_masks.cache_clear()
    try:
        assert row_groups._cudnn_takes_masks() is takes
    finally:
        row_groups._cudnn_takes_masks.cache_clear()


def test_split_calls_give_the_image_keys_one_shape_whatever_the_captions() -> None:
    """Under ``cudnn`` the mask-free groups' image rows take one call of every item against the image keys
    (cuDNN plans once per shape), whatever the items' valid text; the text goes to per-run calls."""
    shapes = set()
    for starts in ([0, 0], [2, 0], [3, 3], [TEXT_LEN, 1]):
        groups = causal_row_groups(TEXT_LEN, GRIDS, 1, starts)
        table = group_table(groups, 2, TEXT_LEN)
        plan = row_groups._table_plan(table, 0, True)
        split = [c for c, s in zip(plan.calls, plan.splits, strict=True) if s is not None]
        assert all(c.items == slice(None) and c.keys.start == TEXT_LEN for c in split)
        shapes.add(tuple((c.rows.start, c.rows.stop, c.keys.stop) for c in split))
        runs = [len(s.text) for s in plan.splits if s is not None]
        assert runs == [len({st for st in starts if st < TEXT_LEN})] * len(split)
    assert len(shapes) == 1


def test_calls_cudnn_refuses_go_to_the_other_kernels() -> None:
    """cuDNN's fused attention refuses one query against one key (a one-token frame's image rows): such a call
    runs on the kernel the other backend gives it, with or without a mask; any other stays on cuDNN."""
    one, two = torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 2, 64)
    mask = torch.zeros(1, 1, 1, 1)
    assert row_groups._runnable("cudnn", one, one, None) == "flash"
    assert row_groups._runnable("cudnn", one, one, mask) == "efficient"
    assert row_groups._runnable("cudnn", one, two, None) == "cudnn"
    assert row_groups._runnable("flash", one, one, None) == "flash"
