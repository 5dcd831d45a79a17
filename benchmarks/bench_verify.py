"""One-call vs framewise vs exact-chunked encode of a real-size CogVideoX VAE.

The verify-groupnorm acceptance benchmark: ``AutoencoderKLCogVideoX`` with its default config
(random weights, 215.6 M parameters) encoding 49 frames at 480x720. For each path: wall time
(CUDA events, median of ``--repeats`` after a warm-up), peak extra device memory
(``torch.cuda.max_memory_allocated`` above the baseline) and the error of the posterior mean
against the one-call encode computed in fp32.

    python benchmarks/bench_verify.py --device cuda                     # H200, bf16
    python benchmarks/bench_verify.py --device cpu --frames 9 --size 64x96   # smoke test

Prints a short table last; ``--json PATH`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, int, torch.Tensor]:
    """Median seconds over ``repeats`` (after one warm-up), peak extra memory, last output."""
    out = fn()
    times = []
    peak = 0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak, out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--frames", type=int, default=49)
    parser.add_argument("--size", default="480x720", help="HxW")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from diffusers import AutoencoderKLCogVideoX

    from pfctl.models.diffusers_vae import DiffusersVideoVAE
    from pfctl.verify.measure import latent_metrics

    device = torch.device(args.device)
    height, width = (int(v) for v in args.size.split("x"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    module = AutoencoderKLCogVideoX().eval()
    params = sum(p.numel() for p in module.parameters())
    video = torch.rand(1, 3, args.frames, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1

    # fp32 one-call reference (the ground truth every path is compared with)
    ref_vae = DiffusersVideoVAE(
        torch.nn.Module.to(module, device, torch.float32), spec="AutoencoderKLCogVideoX", is_demo=False
    )
    with torch.no_grad():
        ref = ref_vae.encode_moments(video.to(device), chunking="none").float()
    ref_mean = ref[:, : ref.shape[1] // 2].cpu()
    del ref

    vae = DiffusersVideoVAE(
        torch.nn.Module.to(module, device, dtype), spec="AutoencoderKLCogVideoX", is_demo=False
    )
    x = video.to(device, dtype)
    rows = []
    for name, chunking in (
        ("one-call", "none"),
        ("framewise (library)", "framewise"),
        ("exact chunked", "exact"),
    ):
        seconds, peak, out = _timed(
            lambda c=chunking: vae.encode_moments(x, chunking=c), device, args.repeats
        )
        mean = out[:, : out.shape[1] // 2].float().cpu()
        err = latent_metrics(ref_mean, mean)
        rows.append(
            {
                "path": name,
                "seconds": seconds,
                "peak_gib": peak / 2**30,
                "rel_l2_vs_fp32_one_call": err["rel_l2"],
                "max_abs_vs_fp32_one_call": err["max_abs"],
            }
        )
        del out
    info = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": params,
        "frames": args.frames,
        "size": [height, width],
        "dtype": args.dtype,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    print(
        f"\nCogVideoX VAE ({params / 1e6:.1f} M params), {args.frames}x{height}x{width}, {args.dtype}, {info['device']}"
    )
    print(f"{'path':<22}{'seconds':>9}{'peak GiB':>10}{'relL2 vs fp32':>15}{'max abs':>10}")
    for r in rows:
        print(
            f"{r['path']:<22}{r['seconds']:>9.3f}{r['peak_gib']:>10.2f}"
            f"{r['rel_l2_vs_fp32_one_call']:>15.2e}{r['max_abs_vs_fp32_one_call']:>10.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
