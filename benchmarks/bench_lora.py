"""Memory levers of ``pfctl train``: peak GPU memory and step time per option vs the dry-run estimate.

Each configuration runs in its own process (accelerate's state and the CUDA allocator's peak are
per process) on the real :class:`pfctl.training.trainer.Trainer`: real-size miniFLUX with random
weights, 384p latents (48 x 80), 16 latent frames, temporal pyramid, batch 4 (columns [0,1,1,2]),
bf16 autocast, a synthetic latent cache (text length 128). Configurations:

    full            full fine-tuning, AdamW, fp32 master weights
    lora            LoRA rank 64 (default targets), AdamW, fp32 frozen base
    lora-bf16       + frozen base in bf16
    lora-bf16-ckpt  + gradient checkpointing of every block (ratio 1.0)
    lora-bf16-sgd   bf16 base, SGD with momentum
    lora-bf16-adafactor  bf16 base, Adafactor
    lora-all        bf16 base + checkpointing + Adafactor

For each: the median step time, ``torch.cuda.max_memory_allocated`` over the timed steps, and
:func:`pfctl.training.memory.estimate_memory` for the largest forward the timed steps built (the
same tokens), so "ratio" is measured / estimated. The table is printed last.

    python benchmarks/bench_lora.py                    # every configuration (H200: ~10 min)
    python benchmarks/bench_lora.py --only lora-bf16   # one
    python benchmarks/bench_lora.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict] = {
    "full": {},
    "lora": {"train.lora.enabled": True},
    "lora-bf16": {"train.lora.enabled": True, "train.base_dtype": "bf16"},
    "lora-bf16-ckpt": {"train.lora.enabled": True, "train.base_dtype": "bf16",
                       "train.gradient_checkpointing": True, "train.gradient_checkpointing_ratio": 1.0},
    "lora-bf16-sgd": {"train.lora.enabled": True, "train.base_dtype": "bf16", "train.optimizer": "sgd_momentum"},
    "lora-bf16-adafactor": {"train.lora.enabled": True, "train.base_dtype": "bf16", "train.optimizer": "adafactor"},
    "lora-all": {"train.lora.enabled": True, "train.base_dtype": "bf16", "train.optimizer": "adafactor",
                 "train.gradient_checkpointing": True, "train.gradient_checkpointing_ratio": 1.0},
}  # fmt: skip


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration in this process → a result dict."""
    import torch

    from pfctl.config import load_config
    from pfctl.data.dataset import write_synthetic_cache
    from pfctl.models.registry import preset_config
    from pfctl.training.trainer import Trainer

    if not torch.cuda.is_available():
        raise SystemExit("bench_lora.py measures CUDA memory; no GPU is visible")
    cfg = preset_config(args.preset)
    text_len = 128
    with tempfile.TemporaryDirectory(prefix="pfctl-bench-lora-") as tmp:
        cache = Path(tmp) / "cache"
        write_synthetic_cache(
            str(cache), [args.frames] * 8, height=args.height, width=args.width, text_len=text_len,
            text_dim=cfg["joint_attention_dim"], pooled_dim=cfg["pooled_projection_dim"],
        )  # fmt: skip
        overrides = {
            "runtime.device": "cuda",
            "runtime.mixed_precision": "bf16",
            "model.dit_preset": args.preset,
            "train.cache": str(cache),
            "train.output_dir": str(Path(tmp) / "out"),
            "train.max_steps": args.steps + args.warmup + 1,
            "train.batch_size": 4,
            "train.max_units": args.frames,
            "train.warmup_steps": 1,
            "train.log_assignments": False,
            "train.export": False,
            "train.lora.rank": args.rank,
            "train.lora.alpha": float(args.rank),
            **CONFIGS[name],
        }
        config = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
        trainer = Trainer(config)
        trainer.setup()
        records: list[dict] = []
        trainer.write_assignment = records.append
        times, largest = [], None
        for i in range(args.steps + args.warmup):
            if i == args.warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            records.clear()
            torch.cuda.synchronize()
            tic = time.perf_counter()
            trainer.train_step()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - tic)
                for rec in records:
                    if largest is None or rec["tokens"] > largest["tokens"]:
                        largest = rec
        peak = torch.cuda.max_memory_allocated()
        trainer.close()

    estimate = estimate_for(config, largest, text_len)
    return {
        "config": name,
        "step_s": statistics.median(times),
        "peak_gib": peak / 2**30,
        "estimate_gib": estimate.total / 2**30,
        "ratio": peak / estimate.total,
        "largest_forward_tokens": largest["tokens"],
        "estimate_rows": {n: b / 2**30 for n, b, _ in estimate.rows},
    }


def estimate_for(config: Any, largest: dict, text_len: int) -> Any:
    """:func:`pfctl.training.memory.estimate_memory` of ``config`` for the largest forward the timed steps built
    (``largest``: its assignment record, the same columns and tokens)."""
    from pfctl.training.memory import Workload, estimate_memory, meta_dit
    from pfctl.training.plan import column_tokens

    f, h, w = largest["bucket"]
    k = len(largest["columns"])
    columns = tuple(
        (
            4 // k,
            column_tokens(
                c["stage"], None if largest["units"] is None else largest["units"][c["stage"]], f, h, w
            ),
        )
        for c in largest["columns"]
    )
    train = config.train
    model = meta_dit(config)
    targets = None
    if train.lora.enabled:
        from pfctl.models.lora import resolve_targets

        targets = resolve_targets(model, train.lora.targets)
    estimate = estimate_memory(
        model, Workload(columns, text_len), lora_targets=targets, lora_rank=train.lora.rank,
        base_dtype=train.base_dtype, compute_dtype="bf16", optimizer=train.optimizer, ema=False,
        gradient_checkpointing=train.gradient_checkpointing, checkpointing_ratio=train.gradient_checkpointing_ratio,
    )  # fmt: skip
    return estimate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", action="append", choices=list(CONFIGS), help="run only these (repeatable)")
    parser.add_argument("--preset", default="miniflux")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--height", type=int, default=48, help="latent height (384p → 48)")
    parser.add_argument("--width", type=int, default=80, help="latent width (640 px → 80)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the per-config child process
    args = parser.parse_args()

    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    passthrough = [f"--preset={args.preset}", f"--rank={args.rank}", f"--frames={args.frames}",
                   f"--height={args.height}", f"--width={args.width}", f"--steps={args.steps}",
                   f"--warmup={args.warmup}"]  # fmt: skip
    results = []
    for name in args.only or list(CONFIGS):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", name, *passthrough], capture_output=True, text=True
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            results.append({"config": name, "error": " | ".join(tail)})
            print(f"{name}: failed: {results[-1]['error']}", file=sys.stderr)
        else:
            results.append(json.loads(line[len("RESULT ") :]))
            print(f"{name}: {line[len('RESULT ') :]}", file=sys.stderr)
        if args.json:  # after every configuration, so a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\npfctl LoRA memory benchmark: {args.preset}, rank {args.rank}, {args.frames} latent frames "
          f"{args.height}x{args.width}, batch 4, bf16 autocast")  # fmt: skip
    head = f"{'config':<20} {'step ms':>9} {'peak GiB':>9} {'est. GiB':>9} {'meas/est':>9}"
    print(head)
    print("-" * len(head))
    for r in results:
        if "error" in r:
            print(f"{r['config']:<20} failed: {r['error'][:80]}")
            continue
        print(f"{r['config']:<20} {r['step_s'] * 1e3:>9.0f} {r['peak_gib']:>9.2f} {r['estimate_gib']:>9.2f} "
              f"{r['ratio']:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
