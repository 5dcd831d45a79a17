"""Benchmark the causal video VAE alone: decode and encode time and peak memory, pfctl vs the reference.

The real-size Pyramid Flow causal VAE (random weights, bf16) decodes the 16 latents of a 5 s video
at 384p (48x80) and 768p (96x160) and encodes a 121-frame 640x384 clip, each with the chunking /
tiling settings listed below. With ``--reference DIR`` (a jy0205/Pyramid-Flow checkout) the
reference's own VAE class gets the same weights and runs the same work in the same call, under
bf16 autocast as its pipeline does; outputs are compared (relative L2) so speed is not bought
with different pixels. ``--profile`` adds the top CUDA kernels of one 384p decode of each side (pfctl channels-last).

    python benchmarks/bench_vae.py --device cuda --reference third_party/Pyramid-Flow --json vae.json
    python benchmarks/bench_vae.py --device cpu --small            # a quick check of the harness

The last thing printed is a table: one row per (work, implementation, settings).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_generate import REAL_VAE  # noqa: E402
from reference_setup import import_reference, synchronize  # noqa: E402

from pfctl.models.fast import FastPaths, apply_fast_paths  # noqa: E402

# (work, latent or pixel shape, window, tile); window/tile None = no chunking / no tiling
DECODE_384 = (1, 16, 16, 48, 80)
DECODE_768 = (1, 16, 16, 96, 160)
ENCODE_384 = (1, 3, 121, 384, 640)
SMALL = {"decode384": (1, 16, 3, 8, 12), "decode768": (1, 16, 3, 16, 24), "encode384": (1, 3, 17, 64, 96)}


def cases(small: bool) -> list[tuple[str, tuple[int, ...], int | None, int | None, bool]]:
    """(work, shape, window, tile, run the reference too)."""
    d384 = SMALL["decode384"] if small else DECODE_384
    d768 = SMALL["decode768"] if small else DECODE_768
    e384 = SMALL["encode384"] if small else ENCODE_384
    t256, t384, t512 = (32, 64, 96) if small else (256, 384, 512)
    return [
        ("decode384", d384, 1, t256, True),  # the reference pipeline's save_memory decode
        ("decode384", d384, 2, None, False),
        ("decode384", d384, 1, None, False),
        ("decode384", d384, 1, t512, False),
        ("encode384", e384, 16 if not small else 8, None, True),
        ("decode768", d768, 2, None, True),  # the untiled time to beat
        ("decode768", d768, 1, t256, True),  # the low-memory mode
        ("decode768", d768, 2, t256, False),
        ("decode768", d768, 1, t384, False),
        ("decode768", d768, 1, t512, False),
    ]


def build(device: torch.device, dtype: torch.dtype, small: bool):
    from pfctl.models.causal_vae import CausalVideoVAE

    config = dict(REAL_VAE)
    if small:
        config.update(
            encoder_block_out_channels=(32, 32, 64, 64), decoder_block_out_channels=(32, 32, 64, 64)
        )
    torch.manual_seed(0)
    model = CausalVideoVAE(**config)
    with torch.no_grad():  # non-trivial outputs: the default init zeroes biases only, fine for speed
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.02).add_(1.0 if p.shape[0] % 32 == 0 else 0.0)
    return model.to(device=device, dtype=dtype).eval(), config


def build_reference(root: Path, pfctl_model, config: dict, device: torch.device, dtype: torch.dtype):
    import_reference(root)  # stubs and sys.path
    from video_vae.modeling_causal_vae import CausalVideoVAE as Reference

    ref = Reference(**{k: v for k, v in config.items()})
    missing, unexpected = ref.load_state_dict(pfctl_model.state_dict(), strict=False)
    if missing or unexpected:
        raise SystemExit(f"reference VAE keys differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return ref.to(dtype=dtype).eval()  # kept on the CPU, on the GPU only while it is measured (`resident`)


@contextlib.contextmanager
def resident(model, device: torch.device):
    """``model`` on ``device`` for the duration, then back on the CPU: each implementation's peak
    memory counts its own weights only, not the other one's."""
    model.to(device)
    try:
        yield model
    finally:
        model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure(fn, device: torch.device, repeats: int) -> tuple[torch.Tensor, float, float | None]:
    """Warm-up once, then the best of ``repeats`` timed runs and the peak memory over them (the
    previous run's output is released first, so it is not counted twice)."""
    out = fn()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(repeats):
        del out
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return out, best, peak


def pfctl_fn(model, work: str, x: torch.Tensor, window: int | None, tile: int | None):
    if work.startswith("decode"):
        return lambda: model.decode(
            x, temporal_chunk=window is not None, window_size=window or 2, tile_sample_min_size=tile
        )
    return lambda: (
        model.encode(
            x, temporal_chunk=window is not None, window_size=window or 16, tile_sample_min_size=tile
        ).mean
    )


def reference_fn(ref, work: str, x: torch.Tensor, window: int | None, tile: int | None, device: torch.device):
    def run():
        try:
            return call()
        finally:  # its convs keep their last input frames on the module after a chunked call (GBs at
            # 768p): drop them, so they count neither in its next run's peak nor in pfctl's
            for module in ref.modules():
                if hasattr(module, "_clear_context_parallel_cache"):
                    module._clear_context_parallel_cache()

    def call():
        ref.enable_tiling(tile is not None)
        amp = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else contextlib.nullcontext()
        )
        with torch.no_grad(), amp:
            if work.startswith("decode"):
                return ref.decode(
                    x,
                    temporal_chunk=window is not None,
                    window_size=window or 2,
                    tile_sample_min_size=tile or 256,
                ).sample
            return ref.encode(
                x,
                temporal_chunk=window is not None,
                window_size=window or 16,
                tile_sample_min_size=tile or 256,
            ).latent_dist.mean

    return run


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def top_kernels(fn, n: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.key != "Command Buffer Full"
    ]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    rows = []
    for e in events[:n]:
        rows.append(
            {
                "kernel": e.key[:90],
                "calls": e.count,
                "ms": e.self_device_time_total / 1e3,
                "share": e.self_device_time_total / max(total, 1),
            }
        )
    return {"kernel_s": total / 1e6, "top": rows}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reference", type=Path, default=None, help="a jy0205/Pyramid-Flow checkout")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--small", action="store_true", help="a narrow VAE on small inputs (harness check)")
    p.add_argument("--only", default="", help="comma-separated works to run (decode384,encode384,decode768)")
    p.add_argument(
        "--layouts",
        default="contiguous,channels_last",
        help="pfctl activation layouts to time (channels_last = CausalVideoVAE.use_channels_last, with the "
        "fused Triton norms on CUDA; channels_last_unfused = the same without them)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="print the top CUDA kernels of the first tiled decode and encode of each work",
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


class Run:
    """One benchmark run: pfctl's VAE with its plain and fused modules (:mod:`pfctl.models.fast.vae_norm`,
    swapped per layout), the reference's when given, and the rows and profiles measured so far (printed and
    written to ``--json`` as each is done, so a run cut short by a time limit keeps them)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.device = args, torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model, config = build(self.device, self.dtype, args.small)
        self.ref = build_reference(args.reference, self.model, config, self.device, self.dtype) if args.reference else None
        self.plain = {m: type(m) for m in self.model.modules()}
        apply_fast_paths(self.model, FastPaths())
        self.fused = {m: type(m) for m in self.model.modules()}
        self.results: list[dict] = []
        self.profiles: dict[str, dict] = {}

    def add(self, row: dict) -> None:
        self.results.append(row)
        report(row, self.results, self.profiles, self.args.json)

    def pfctl_layouts(self, work: str, x: torch.Tensor, window: int, tile: int | None) -> dict:
        """pfctl on ``x`` in each ``--layouts`` layout; each layout's rows compared with the contiguous one."""
        outputs = {}
        for layout in self.args.layouts.split(","):
            self.model.use_channels_last(layout.startswith("channels_last"))
            for module, cls in (self.plain if layout == "channels_last_unfused" else self.fused).items():
                module.__class__ = cls
            try:
                out, sec, peak = measure(pfctl_fn(self.model, work, x, window, tile), self.device, self.args.repeats)
            except torch.OutOfMemoryError:
                out, sec, peak = None, float("nan"), float("nan")
            outputs[layout] = out
            self.add({"work": work, "impl": f"pfctl/{layout}", "window": window, "tile": tile, "seconds": sec,
                      "peak_gib": peak})  # fmt: skip
            del out
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if outputs.get("contiguous") is not None:  # each other layout vs contiguous
            for row, (layout, out) in zip(self.results[-len(outputs) :], outputs.items(), strict=True):
                if layout != "contiguous" and out is not None:
                    row["rel_l2_vs_pfctl"] = rel_l2(out, outputs["contiguous"])
        return outputs

    def reference(self, work: str, x: torch.Tensor, window: int, tile: int | None, pfctl_out: torch.Tensor | None) -> None:
        """The reference on ``x`` (pfctl's VAE moved off the device meanwhile), compared with ``pfctl_out``."""
        self.model.to("cpu")
        with resident(self.ref, self.device):
            out, sec, peak = measure(
                reference_fn(self.ref, work, x, window, tile, self.device), self.device, self.args.repeats
            )
        self.model.to(self.device)
        self.add({"work": work, "impl": "reference", "window": window, "tile": tile, "seconds": sec, "peak_gib": peak,
                  "rel_l2_vs_pfctl": rel_l2(pfctl_out, out) if pfctl_out is not None else None})  # fmt: skip

    def profile(self, work: str, x: torch.Tensor, window: int, tile: int | None) -> None:
        """The top kernels of the first tiled decode and the first encode of each work: is it launch-bound
        (kernel time well under the wall time)? which kernels dominate?"""
        self.model.use_channels_last(True)
        case = f"{work} (window {window}, tile {tile})"
        wall = next(r["seconds"] for r in self.results if r["impl"] == "pfctl/channels_last" and r["work"] == work
                    and r["window"] == window and r["tile"] == tile)  # fmt: skip
        self.profiles[f"pfctl {work}"] = {
            "case": case, "wall_s": wall, **top_kernels(pfctl_fn(self.model, work, x, window, tile))
        }  # fmt: skip
        if self.ref is not None and work == "decode384":
            with resident(self.ref, self.device):
                self.profiles[f"reference {work}"] = {
                    "case": case, **top_kernels(reference_fn(self.ref, work, x, window, tile, self.device))
                }  # fmt: skip


def main() -> None:
    args = parse_args()
    run = Run(args)
    only = set(filter(None, args.only.split(",")))
    gen = torch.Generator(device="cpu").manual_seed(0)
    for work, shape, window, tile, with_ref in cases(args.small):
        if only and work not in only:
            continue
        x = torch.randn(shape, generator=gen).clamp(-1, 1).to(device=run.device, dtype=run.dtype)
        outputs = run.pfctl_layouts(work, x, window, tile)
        if run.ref is not None and with_ref:
            run.reference(work, x, window, tile, next((o for o in outputs.values() if o is not None), None))
        outputs.clear()
        first = not any(key.split()[1] == work for key in run.profiles)
        if args.profile and run.device.type == "cuda" and first and (tile is not None or work.startswith("encode")):
            run.profile(work, x, window, tile)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"results": run.results, "profiles": run.profiles}, indent=1))
    print_profiles(run.profiles)
    print(f"\n{HEADER}")
    for r in run.results:
        print(row_text(r))


def print_profiles(profiles: dict[str, dict]) -> None:
    for name, prof in profiles.items():
        busy = f", GPU busy {prof['kernel_s'] / prof['wall_s']:.0%} of the timed run" if "wall_s" in prof else ""
        print(f"\ntop CUDA kernels, {name} {prof['case']}: {prof['kernel_s']:.3f} s of kernels{busy}")
        for r in prof["top"]:
            print(f"  {r['ms']:9.1f} ms {r['share']:6.1%} {r['calls']:6d}x  {r['kernel']}")


HEADER = f"{'work':<10} {'impl':<28} {'window':>6} {'tile':>5} {'seconds':>8} {'peak GiB':>9} {'relL2 vs pfctl':>15}"


def row_text(r: dict) -> str:
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
    err = r.get("rel_l2_vs_pfctl")
    return (
        f"{r['work']:<10} {r['impl']:<28} {r['window']!s:>6} {r['tile']!s:>5} {r['seconds']:>8.3f} {peak:>9} "
        f"{'' if err is None else f'{err:.2e}':>15}"
    )


def report(row: dict, results: list[dict], profiles: dict, path: Path | None) -> None:
    """Print a finished measurement at once and rewrite the JSON file, so a run cut short by a time
    limit still leaves every row it finished."""
    print("  row:", row_text(row), flush=True)
    if path:
        path.write_text(json.dumps({"results": results, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
