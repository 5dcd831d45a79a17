"""Training throughput of ``pfctl train``: step time, tokens/s and MFU with analytic FLOPs.

Runs the real :class:`pfctl.training.trainer.Trainer` (data loader, temporal pyramid, DiT,
AdamW, bf16 autocast on CUDA) on a synthetic latent cache:

* CPU (default there): the ``tiny`` preset on 8x8 latents, 4 latent frames — steps/s.
* CUDA: the real-size ``miniflux`` preset at 384p (48x80 latents), 16 latent frames, temporal
  pyramid, bf16 — step time, tokens/s and MFU.

FLOPs are counted analytically per forward from the inputs the step really built (the
assignment records): every linear layer of the double and single blocks (12·D² MACs per token
and block, image and text tokens), attention scores and values (2·S²·D MACs per column sample
and block, S = text + image tokens of the column, the mask does not save work in SDPA), the
modulation and the in/out projections; training = 3 x forward (no recomputation counted).

Where the host time goes: the host time of a step (until ``train_step`` returns), the part of it
spent loading batches (prefetched: overlapping the GPU's backward) and, on CUDA, the number of calls
in one step that make the host wait for the GPU (counted with ``torch.cuda.set_sync_debug_mode``).

    python benchmarks/bench_train.py                       # CPU tiny
    python benchmarks/bench_train.py --device cuda         # H200: miniFLUX 384p, 16 frames
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEAK_BF16 = {"H200": 790e12, "H100": 989.5e12, "A100": 312e12}
"""Dense bf16 matrix-product rates: the H200 figure is the one measured on the benchmark machine
(a large bf16 matmul), not the datasheet 989.5 TFLOP/s."""


def dit_flops_per_forward(cfg: dict, records: list[dict], text_len: int) -> float:
    """Analytic forward FLOPs of one micro-batch (2 FLOPs per MAC)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    blocks = cfg["num_layers"] + cfg["num_single_layers"]
    macs = 0.0
    for rec in records:
        cols = rec["columns"]
        per_col = rec["column_tokens"]
        for col, tokens in zip(cols, per_col, strict=False):
            n = len(col["ids"])
            seq = text_len + tokens
            macs += n * blocks * (12 * d * d * seq + 2 * seq * seq * d)  # linears + attention
            macs += n * (cfg["in_channels"] * d * tokens + d * cfg["in_channels"] * tokens)  # in/out proj
            macs += n * blocks * 12 * d * d  # adaLN modulation rows (per sample)
    return 2.0 * macs


def counting_syncs(step: Callable[[], Any]) -> tuple[Any, int]:
    """``step()`` under CUDA's sync debug mode: its result and the number of calls in it that made the
    host wait for the GPU (``.item()``, ``float(t)``, device-to-host and pageable host-to-device copies)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchronizing" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--preset", default=None, help="DiT preset (default: miniflux on CUDA, tiny on CPU)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None, help="latent frames per clip (M)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--profile", action="store_true", help="print the top ops of one profiled step")
    parser.add_argument(
        "--attention", default="efficient", choices=["auto", "efficient", "cudnn"], help="train.attention"
    )
    parser.add_argument("--compile", action="store_true", help="train.compile (compiled DiT blocks)")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="train.cuda_graphs (compiled blocks as CUDA graphs; with --compile)",
    )
    parser.add_argument("--skip-future-keys", action="store_true", help="train.skip_future_keys")
    args = parser.parse_args()

    import torch

    from pfctl.config import load_config
    from pfctl.data.dataset import write_synthetic_cache
    from pfctl.models.registry import preset_config
    from pfctl.training.plan import column_tokens
    from pfctl.training.trainer import Trainer

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    preset = args.preset or ("miniflux" if cuda else "tiny")
    frames = args.frames or (16 if cuda else 4)
    height, width = args.height or (48 if cuda else 8), args.width or (80 if cuda else 8)
    # CUDA graphs: every new shape is recorded at its second occurrence, and the pyramid's shapes cycle
    steps = args.steps or (10 if cuda else 20)
    warmup = args.warmup if args.warmup is not None else (12 if args.cuda_graphs else 3)
    cfg = preset_config(preset)
    text_len = 128 if cuda else 8

    with tempfile.TemporaryDirectory(prefix="pfctl-bench-") as tmp:
        cache = Path(tmp) / "cache"
        write_synthetic_cache(
            str(cache), [frames] * max(args.batch * 2, 8), height=height, width=width, text_len=text_len,
            text_dim=cfg["joint_attention_dim"], pooled_dim=cfg["pooled_projection_dim"],
        )  # fmt: skip
        overrides = {
            "runtime.device": "cuda" if cuda else "cpu",
            "model.dit_preset": preset,
            "train.cache": str(cache),
            "train.output_dir": str(Path(tmp) / "out"),
            "train.max_steps": steps + warmup + 1,
            "train.batch_size": args.batch,
            "train.max_units": frames,
            "train.warmup_steps": 1,
            "train.log_assignments": False,
            "train.export": False,
            "train.gradient_checkpointing": args.gradient_checkpointing,
            "train.attention": args.attention,
            "train.compile": args.compile,
            "train.cuda_graphs": args.cuda_graphs,
            "train.skip_future_keys": args.skip_future_keys,
        }
        config = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
        trainer = Trainer(config)
        trainer.setup()
        records: list[dict] = []
        trainer.write_assignment = records.append  # keep the per-forward records in memory
        load_s: list[float] = []  # host time of the batch loads of the current step
        next_batch = trainer.loader.next_batch

        def timed_next_batch(step: int) -> Any:
            t = time.perf_counter()
            try:
                return next_batch(step)
            finally:
                load_s.append(time.perf_counter() - t)

        trainer.loader.next_batch = timed_next_batch
        params = sum(p.numel() for p in trainer.unwrapped.parameters())
        times, host, loads, tokens, flops = [], [], [], [], []
        syncs = None
        for i in range(steps + warmup):
            records.clear()
            load_s.clear()
            if cuda:
                torch.cuda.synchronize()
            tic = time.perf_counter()
            if cuda and i == warmup - 1:  # the last warm-up step counts the host's waits for the GPU
                metrics, syncs = counting_syncs(trainer.train_step)
            else:
                metrics = trainer.train_step()
            returned = time.perf_counter() - tic
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - tic
            for rec in records:
                f, h, w = rec["bucket"]
                rec["column_tokens"] = [
                    column_tokens(
                        c["stage"], None if rec["units"] is None else rec["units"][c["stage"]], f, h, w
                    )
                    for c in rec["columns"]
                ]
            if i >= warmup:
                times.append(elapsed)
                host.append(returned)
                loads.append(sum(load_s))
                tokens.append(sum(r["tokens"] for r in records))
                flops.append(3 * dit_flops_per_forward(cfg, records, text_len))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                trainer.train_step()
                if cuda:
                    torch.cuda.synchronize()
            key = "cuda_time_total" if cuda else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        device_name = torch.cuda.get_device_name() if cuda else "cpu"
        trainer.close()

    step_s = statistics.median(times)
    mean_s = sum(times) / len(times)
    tok_s = sum(tokens) / sum(times)
    tflops = sum(flops) / sum(times) / 1e12
    peak = next((v for k, v in PEAK_BF16.items() if k in device_name), None) if cuda else None
    rows = [
        ("device", device_name),
        ("preset / params", f"{preset} / {params / 1e6:.1f} M"),
        ("latents (T x H x W)", f"{frames} x {height} x {width}"),
        ("batch per step", f"{args.batch} clips, columns [0,1,1,2], temporal pyramid"),
        ("precision", "bf16 autocast, fp32 master weights" if cuda else "fp32"),
        ("gradient checkpointing", str(args.gradient_checkpointing)),
        ("attention", args.attention),
        ("compiled blocks", "yes" if args.compile else "no"),
        ("skip future keys", "yes" if args.skip_future_keys else "no"),
        ("steps timed (warmup)", f"{steps} ({warmup})"),
        ("step time median / mean", f"{step_s * 1e3:.1f} ms / {mean_s * 1e3:.1f} ms"),
        ("steps/s", f"{1 / mean_s:.2f}"),
        # on CUDA train_step returns once the optimizer update is queued (the GPU may still run it)
        ("host time / step (train_step call)", f"{statistics.median(host) * 1e3:.1f} ms"),
        ("batch loading / step (host)", f"{statistics.median(loads) * 1e3:.1f} ms"),
        (
            "blocking host syncs / step",
            "n/a (counted on CUDA, in a warm-up step)" if syncs is None else str(syncs),
        ),
        ("image tokens / step", f"{statistics.mean(tokens):.0f}"),
        ("tokens/s", f"{tok_s:,.0f}"),
        ("model TFLOP/s (analytic)", f"{tflops:.1f}"),
        ("MFU", f"{tflops * 1e12 / peak:.1%} of {peak / 1e12:.0f} TFLOP/s bf16 dense" if peak else "n/a"),
        ("peak GPU memory", f"{peak_mem:.1f} GiB" if cuda else "n/a"),
        ("last loss", f"{metrics['loss']:.4f}"),
    ]
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2))
    width_k = max(len(k) for k, _ in rows)
    print("\npfctl train benchmark")
    print("-" * (width_k + 40))
    for key, value in rows:
        print(f"{key:<{width_k}}  {value}")


if __name__ == "__main__":
    main()
