"""Masked attention kernels on the DiT's real masks: which one should pfctl's attention call use?

One DiT column's attention (miniFLUX: 30 heads x 64, bf16) under pfctl's own masks
(``build_attention_bias``: text padding + temporal causality), timed forward and forward+backward for

* ``efficient``: SDPA's memory-efficient kernel with the additive mask (pfctl's training default);
* ``cudnn``: SDPA's cuDNN kernel with the same additive mask;
* ``flex``: compiled FlexAttention with a block mask from the same rule (mask creation timed on its own:
  eager and compiled). pfctl had it as a backend until this benchmark measured it slower than cuDNN;
* ``efficient`` / ``cudnn, row groups``: pfctl's ``skip_future_keys`` without the text lengths: the
  query rows in groups of whole frames, each against its causal key prefix only (the keys the mask hides
  from the whole group are not computed);
* ``efficient`` / ``cudnn, groups no mask``: ``skip_future_keys`` as the sampler and trainer run it, text
  lengths known: a group of one frame attends its items' valid text and the frames up to its own with no
  mask at all (one call per item here: the two items' texts differ in length);
* ``flash`` / ``cudnn (no mask)``: the kernels without any mask: not a result pfctl may use (they ignore
  the mask), the floor the masked kernels are measured against.

The text is left-aligned (as pfctl's ``left_align_text`` leaves it), item 0 with 24 valid tokens and
item 1 with 1 (a prompt and the empty negative prompt). Outputs of every masked kernel are compared with the first masked kernel's (the efficient one on CUDA). Cases:
``train`` is a 384p training column (two full-resolution frames after lower-resolution history),
``gen768`` a synthetic large 768p sampling call (CFG batch 2, a full frame after lower-resolution
history). ``dense TF/s`` counts every score, masked or skipped, so it compares wall times.

    python benchmarks/bench_attention.py --device cuda --json attention.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

HEADS, HEAD_DIM, TEXT_LEN, TEXT_VALID = 30, 64, 128, (24, 1)
CASES = {  # name: (batch, image tokens per frame in temporal order; the last frame is the current one)
    "train": (2, [60, 240, 240, 960, 960]),
    "gen768": (2, [240] * 4 + [960] * 4 + [3840, 3840]),
}


def layout(batch: int, frames: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    text_valid = torch.zeros(batch, TEXT_LEN, dtype=torch.bool, device=device)
    for item in range(batch):
        text_valid[item, TEXT_LEN - TEXT_VALID[item % len(TEXT_VALID)] :] = True
    frame_ids = torch.cat([torch.full((n,), i + 1, device=device) for i, n in enumerate(frames)])
    return text_valid, frame_ids


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (compilation, plans)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, backend: object
) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, backend: str, groups: list
) -> torch.Tensor:
    """pfctl's row-grouped attention (``[B, H, S, hd]`` in and out, like the SDPA calls it is timed against)."""
    from pfctl.models.attention_layout import masked_attention

    heads = q.shape[1]
    out = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, backend, groups)
    return out.unflatten(-1, (heads, -1)).transpose(1, 2)


def measure(case: str, device: torch.device, dtype: torch.dtype, repeats: int, flex: Callable | None) -> dict:
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.flex_attention import create_block_mask

    from pfctl.models.attention_layout import build_attention_bias, causal_row_groups, visibility_rules

    batch, frames = CASES[case]
    text_valid, frame_ids = layout(batch, frames, device)
    size = TEXT_LEN + frame_ids.shape[0]
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(batch, HEADS, size, HEAD_DIM, generator=gen, device=device, dtype=dtype).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    (bias,) = build_attention_bias(text_valid, [frame_ids], 1, True, dtype)
    ((_, _, rule),) = visibility_rules(text_valid, [frame_ids], 1, True)  # the same rule as a flex mask_mod
    kernels = {
        "efficient": functools.partial(sdpa, q, k, v, bias, SDPBackend.EFFICIENT_ATTENTION),
        "cudnn": functools.partial(sdpa, q, k, v, bias, SDPBackend.CUDNN_ATTENTION),
        "flash (no mask)": functools.partial(sdpa, q, k, v, None, SDPBackend.FLASH_ATTENTION),
        "cudnn (no mask)": functools.partial(sdpa, q, k, v, None, SDPBackend.CUDNN_ATTENTION),
    }
    if flex is not None:
        block_mask = create_block_mask(rule, batch, None, size, size, device=device)
        kernels["flex"] = functools.partial(flex, q, k, v, block_mask=block_mask)
    grids = [(1, n, 1) for n in frames]
    starts = [TEXT_LEN - int(text_valid[item].sum()) for item in range(batch)]
    groups = causal_row_groups(TEXT_LEN, grids)
    plain_groups = causal_row_groups(TEXT_LEN, grids, key_starts=starts)
    for backend in ("efficient", "cudnn"):  # pfctl's skip_future_keys: query-row groups, causal key prefixes
        kernels[f"{backend}, row groups"] = functools.partial(grouped, q, k, v, bias, backend, groups)
        kernels[f"{backend}, groups no mask"] = functools.partial(
            grouped, q, k, v, bias, backend, plain_groups
        )
    row = {"batch": batch, "tokens": size, "visible_share": float(bias.eq(0).float().mean()), "kernels": {}}
    dense_flop = 4 * batch * HEADS * size * size * HEAD_DIM  # forward, every score computed
    reference = None
    for name, fn in kernels.items():
        try:
            with torch.no_grad():
                out = fn()
                fwd = timed(fn, device, repeats)
            both = timed(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad), device, repeats)
        except Exception as exc:  # a kernel this GPU / shape does not support: say so, go on
            row["kernels"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            continue
        err = None  # against the first masked kernel that ran (the flash row ignores the mask)
        if "(no mask)" not in name:
            reference = out if reference is None else reference
            err = float((out.float() - reference.float()).norm() / reference.float().norm())
        row["kernels"][name] = {
            "fwd_ms": fwd * 1e3,
            "fwd_bwd_ms": both * 1e3,
            "fwd_tflops_dense": dense_flop / fwd / 1e12,
            "rel_l2_vs_first_masked": err,
        }
    row["row_groups"] = [list(g) for g in plain_groups]
    for compiled in (False, True) if flex is not None else ():
        make = functools.partial(
            create_block_mask, rule, batch, None, size, size, device=device, _compile=compiled
        )
        row[f"block_mask_{'compiled' if compiled else 'eager'}_ms"] = timed(make, device, 3) * 1e3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--no-flex", action="store_true", help="leave FlexAttention out (its compilation is slow)"
    )
    args = parser.parse_args()

    from torch.nn.attention.flex_attention import flex_attention

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    flex = None if args.no_flex else flex
    results = {case: measure(case, device, dtype, args.repeats, flex) for case in args.cases.split(",")}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\nmasked attention, {HEADS} heads x {HEAD_DIM}, {dtype}, {gpu}")
    print(f"{'case':>7} {'kernel':>26} {'fwd ms':>8} {'fwd+bwd ms':>11} {'dense TF/s':>11} {'rel. L2':>8}")
    for case, row in results.items():
        for name, r in row["kernels"].items():
            if "error" in r:
                print(f"{case:>7} {name:>26}  {r['error']}")
                continue
            err = "-" if r["rel_l2_vs_first_masked"] is None else f"{r['rel_l2_vs_first_masked']:.1e}"
            print(
                f"{case:>7} {name:>26} {r['fwd_ms']:>8.2f} {r['fwd_bwd_ms']:>11.2f} "
                f"{r['fwd_tflops_dense']:>11.0f} {err:>8}"
            )
        masks = (
            f"; block mask {row['block_mask_eager_ms']:.1f} ms eager, {row['block_mask_compiled_ms']:.1f} ms compiled"
            if "block_mask_eager_ms" in row
            else ""
        )
        print(
            f"{case:>7} {row['tokens']} tokens x batch {row['batch']}, {row['visible_share']:.0%} of scores visible{masks}"
        )


if __name__ == "__main__":
    main()
