"""A real multi-GPU sync-group run of ``pfctl train`` and what it proves.

Writes a synthetic latent cache, launches ``torchrun --nproc_per_node N -m pfctl train`` with a
video sync group of G, then reads the per-rank assignment logs the trainer writes and checks the
group semantics on the real launcher and backend (NCCL on GPUs, gloo on CPU):

* every rank of a group trained the same clip ids in every micro-step;
* groups never share a clip;
* the ranks of a group trained different high-resolution units ``h = rank % G + 1 + turn * G``.

It also reports the median step time and tokens/s from the main process's metrics log.

    python benchmarks/bench_sync_group.py --nproc 2 --group 2 --preset miniflux   # 2x H200
    python benchmarks/bench_sync_group.py --nproc 2 --group 2 --preset tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--preset", default="miniflux")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--frames", type=int, default=16, help="latent frames per clip (max_units)")
    parser.add_argument("--size", default="48x80", help="latent HxW (48x80 = 384p)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def run_training(args: argparse.Namespace) -> tuple[list[dict], list[dict], float] | int:
    """``torchrun ... -m pfctl train`` on a synthetic cache in a temporary folder: every rank's assignment log
    rows, the main process's metrics and the wall time; the exit code (and its output printed) on failure."""
    from pfctl.data.dataset import write_synthetic_cache
    from pfctl.models.registry import preset_config

    cfg = preset_config(args.preset)
    height, width = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="pfctl-sync-") as tmp:
        root = Path(tmp)
        num_clips = args.batch * (args.nproc // args.group) * (args.steps + 2)
        write_synthetic_cache(
            str(root / "cache"), [args.frames] * num_clips, height=height, width=width,
            text_len=128 if args.device == "cuda" else 8, text_dim=cfg["joint_attention_dim"],
            pooled_dim=cfg["pooled_projection_dim"],
        )  # fmt: skip
        recipe = {
            "runtime": {"device": args.device, "seed": 7},
            "model": {"dit_preset": args.preset},
            "train": {
                "cache": str(root / "cache"), "output_dir": str(root / "out"), "max_steps": args.steps,
                "batch_size": args.batch, "max_units": args.frames, "video_sync_group": args.group,
                "warmup_steps": 1, "checkpoint_every": 10**6, "export": False, "log_every": 1,
            },
        }  # fmt: skip
        (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        cmd += ["-m", "pfctl", "train", "--recipe", str(root / "recipe.yaml")]
        tic = time.perf_counter()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PFCTL_LOG_FORMAT": "plain"}
        )
        wall = time.perf_counter() - tic
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:])
            return proc.returncode
        rows = []
        for rank in range(args.nproc):
            path = root / "out" / "assignments" / f"rank-{rank:05d}.jsonl"
            rows += [json.loads(line) for line in path.read_text().splitlines() if line]
        metrics = [
            json.loads(line) for line in (root / "out" / "metrics.jsonl").read_text().splitlines() if line
        ]
    return rows, metrics, wall


def check_groups(rows: list[dict]) -> dict[str, bool]:
    """The sync-group semantics in the assignment logs: the ranks of a group trained the same clips in every
    micro-step, groups never shared a clip, and a group's ranks trained different high-resolution units."""
    by_step: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)
    for row in rows:
        by_step[(row["micro_step"], row["group"])][row["rank"]] = row
    per_step_ids: dict[int, list[set]] = defaultdict(list)
    for (micro, _group), ranks in by_step.items():
        per_step_ids[micro].append(set(next(iter(ranks.values()))["ids"]))
    return {
        "same_ids_in_group": all(len({tuple(r["ids"]) for r in ranks.values()}) == 1 for ranks in by_step.values()),
        "groups_disjoint": all(
            not (a & b) for groups in per_step_ids.values() for i, a in enumerate(groups) for b in groups[i + 1 :]
        ),
        "high_units_differ_in_group": all(
            len({r["units"][2] for r in ranks.values()}) == len(ranks) for ranks in by_step.values()
        ),
    }


def main() -> int:
    args = parse_args()
    ran = run_training(args)
    if isinstance(ran, int):
        return ran
    rows, metrics, wall = ran
    checks = check_groups(rows)
    timed = [m for m in metrics if m.get("step", 0) > 2]
    step_s = (
        statistics.median(m["step_time_s"] for m in timed) if timed and "step_time_s" in timed[0] else None
    )
    tok_s = (
        statistics.median(m["tokens_per_s"] for m in timed) if timed and "tokens_per_s" in timed[0] else None
    )
    first = sorted(rows, key=lambda r: (r["micro_step"], r["rank"]))[: args.nproc * 2]
    result = {
        "nproc": args.nproc, "group": args.group, "preset": args.preset, "device": args.device,
        "steps": args.steps, "wall_s": wall, "median_step_s": step_s, "median_tokens_per_s_rank0": tok_s,
        **checks,
        "first_assignments": [
            {k: r[k] for k in ("micro_step", "rank", "group", "ids", "units", "tokens") if k in r} for r in first
        ],
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nsync-group run: {args.nproc} processes, G={args.group}, {args.preset}, {args.device}")
    for r in result["first_assignments"]:
        print(
            f"  micro {r['micro_step']} rank {r['rank']} group {r['group']} ids {r['ids']} units {r['units']}"
        )
    for key in ("wall_s", "median_step_s", "median_tokens_per_s_rank0", *checks):
        print(f"  {key}: {result[key]}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
