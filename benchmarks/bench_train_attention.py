"""The attention of a ``pfctl train`` step with row groups, forward and backward, by row-group setting.

One rank of a temporal-pyramid recipe trains a cycle of unit positions (``max_units`` / sync group); each
forward has one column per entry of the sample ratios (stages 0, 1, 1, 2), each column the history clips at
their stages' resolutions and the unit being trained. This replays every forward of that cycle's columns
through pfctl's own attention (the row groups ``train.skip_future_keys`` builds, miniFLUX's heads, gradients
on) and reports, per setting, the calls a forward makes, the host's time to issue one layer's attention of a
forward and its backward, and the time until the device has finished it (equal on the CPU). Settings are
``MIN_TOKENS:MIN_ROWS`` (``train.row_group_min_tokens`` and ``train.row_group_min_rows``), attended with SDPA
group by group (``masked_attention``, the eager blocks' path), or ``MIN_TOKENS:MIN_ROWS:op[:BACKEND]`` through
the row groups' training operator (``pfctl::row_group_attention_train``, the compiled blocks' path) on the
kernels of ``train.attention`` (``efficient``, the default here, or ``cudnn``). Each
setting's outputs and gradients are compared with the first setting's. On the CPU every resolution runs at
a tiny 16x32 latent: a check of the harness, not a measurement.

    python benchmarks/bench_train_attention.py --device cuda --resolution 768p --settings 0:512,0:512:op,0:512:op:cudnn
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pfctl.flow.pyramid import DEFAULT_SAMPLE_RATIOS, column_to_stage, plan_stage_lengths  # noqa: E402
from pfctl.models import attention_layout as dc  # noqa: E402
from pfctl.models.fast.row_groups import row_group_attention_train  # noqa: E402
from pfctl.models.registry import preset_config  # noqa: E402
from pfctl.training.plan import column_grids  # noqa: E402

RESOLUTIONS = {"384p": (48, 80), "768p": (96, 160)}  # latent height, width of the top stage
TEXT_LEN = 128  # the recipes' text length; the synthetic benchmark caches fill it
COLUMNS = len(column_to_stage(DEFAULT_SAMPLE_RATIOS))  # columns a forward has


def cycle_columns(height: int, width: int, max_units: int, group: int) -> list[list[tuple[int, int, int]]]:
    """Every column (its clips' token grids ``(t, h, w)``) of the forwards rank 0 makes in one cycle."""
    plan, stages = plan_stage_lengths(max_units, group), column_to_stage(DEFAULT_SAMPLE_RATIOS)
    return [
        column_grids(s, plan.lengths(counter, 0)[s], height, width)
        for counter in range(plan.turns)
        for s in stages
    ]


def attention_step(columns, setting: str, batch: int, heads: int, head_dim: int, device, dtype) -> dict:
    """One layer's attention of every forward of the cycle, forward and backward: host and device time."""
    min_tokens, min_rows, *path = setting.split(":")
    min_tokens, min_rows, operator = int(min_tokens), int(min_rows), path[:1] == ["op"]
    backend = path[1] if len(path) > 1 else "efficient"
    starts = [0] * batch  # every caption fills the text
    gen = torch.Generator(device=device).manual_seed(0)
    host = total = 0.0
    calls, outputs = 0, []
    for grids in columns:
        size = TEXT_LEN + sum(t * h * w for t, h, w in grids)
        qkv = torch.randn(batch, size, 3, heads, head_dim, generator=gen, device=device, dtype=dtype)
        grad = torch.randn(batch, size, heads * head_dim, generator=gen, device=device, dtype=dtype)
        valid = torch.ones(batch, TEXT_LEN, dtype=torch.bool, device=device)
        groups = dc.column_row_groups(TEXT_LEN, grids, starts, min_tokens, min_rows)
        extents = dc.mask_extents([groups], [size])
        mask = dc.padded_attention_bias(valid, [dc.clip_frame_ids(grids, device)], 1, True, dtype, extents)[0]
        calls += len(dc.row_group_calls(groups)) if groups is not None else 1
        leaf = qkv.requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        q, k, v = leaf.unbind(2)
        if operator:
            table = dc.group_table(groups or [dc.RowGroup(0, size)], batch, TEXT_LEN)
            out = row_group_attention_train(q, k, v, mask, table, backend)[0]
        else:
            out = dc.masked_attention(q, k, v, mask, "efficient", groups)
        out.backward(grad)
        issued = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        host, total = host + issued - start, total + time.perf_counter() - start
        if len(outputs) < COLUMNS:  # the first forward's columns, to compare settings
            outputs.append((out.detach().float().cpu(), leaf.grad.float().cpu()))
    per_forward = calls / len(columns) * COLUMNS
    return {
        "calls_per_forward": per_forward,
        "host_ms": host * 1e3,
        "total_ms": total * 1e3,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--resolution", default="768p", choices=sorted(RESOLUTIONS))
    parser.add_argument("--settings", default="0:512,0:1")
    parser.add_argument("--max-units", type=int, default=16, help="train.max_units")
    parser.add_argument(
        "--group", type=int, default=1, help="the sync group (1: one rank builds every position)"
    )
    parser.add_argument("--batch", type=int, default=1, help="items per column (batch size / columns)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed passes over the cycle (the best is kept)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    config = preset_config("miniflux")
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    height, width = RESOLUTIONS[args.resolution] if device.type == "cuda" else (16, 32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    columns = cycle_columns(height, width, args.max_units, args.group)
    rows, first = {}, None
    for setting in args.settings.split(","):
        attention_step(columns, setting, args.batch, heads, head_dim, device, dtype)  # warm-up
        runs = [
            attention_step(columns, setting, args.batch, heads, head_dim, device, dtype)
            for _ in range(args.repeats)
        ]
        best = min(runs, key=lambda run: run["total_ms"])
        first = first or best["outputs"]
        pairs = zip(best["outputs"], first, strict=True)
        worst = max(
            float((a - b).norm() / b.norm()) for got, ref in pairs for a, b in zip(got, ref, strict=True)
        )
        rows[setting] = {key: best[key] for key in ("calls_per_forward", "host_ms", "total_ms")} | {
            "rel_l2_vs_first": worst
        }
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (tiny latents: a harness check)"
    print(
        f"\none layer's attention, forward + backward, of the {len(columns)} columns of one cycle "
        f"({args.resolution}, {heads} heads x {head_dim}, {args.batch} item(s) a column), {name}"
    )
    print(f"{'setting':>16} {'calls/forward':>13} {'host ms':>9} {'total ms':>9} {'rel. L2':>8}")
    for setting, row in rows.items():
        print(
            f"{setting:>16} {row['calls_per_forward']:>13.1f} {row['host_ms']:>9.1f} {row['total_ms']:>9.1f} "
            f"{row['rel_l2_vs_first']:>8.1e}"
        )


if __name__ == "__main__":
    main()
