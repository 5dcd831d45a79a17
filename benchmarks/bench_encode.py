"""Benchmark `encode-latents`: clips/s and peak memory, decoding alone vs the full pipeline.

CPU (default when no GPU): the tiny causal VAE on small clips. CUDA: the real-size Pyramid Flow
causal VAE (random weights, 16 latent channels, ~0.34 B parameters) on 121-frame 640x384 clips.
Source videos are H.264 files written on the fly (PyAV), so nothing is downloaded.

    python benchmarks/bench_encode.py                       # auto: CUDA if present
    python benchmarks/bench_encode.py --device cpu --clips 4
    python benchmarks/bench_encode.py --device cuda --chunking none,framewise --num-workers 4

The last thing printed is a table with one row per configuration.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REAL_VAE_OVERRIDES = {"encoder_out_channels": 16, "decoder_in_channels": 16, "scaling_factor": 0.13025}
"""The released causal VAE: the CausalVideoVAE defaults (128/256/512/512 channels) with 16 latent channels."""


def _peak_rss_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, workers) / 1024


def _make_sources(folder: Path, clips: int, frames: int, width: int, height: int) -> Path:
    from pfctl.data.synthetic import moving_frames, write_video

    rows = []
    for k in range(clips):
        path = write_video(folder / f"v{k}.mp4", moving_frames(frames, height, width, seed=k), fps=24)
        rows.append({"video": path.name, "text": f"clip {k}"})
    ann = folder / "train.jsonl"
    ann.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ann


def _real_vae_folder(folder: Path) -> Path:
    import torch

    from pfctl.models.causal_vae import CausalVideoVAE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CausalVideoVAE(**REAL_VAE_OVERRIDES)
    out = folder / "causal_video_vae"
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _decode_only(ann: Path, config, settings) -> float:
    from pfctl.data.annotations import load_annotations
    from pfctl.data.decoding import decoded_items

    items = load_annotations(ann)
    start = time.monotonic()
    n = sum(
        len(d.frames)
        for d in decoded_items(
            [(i, frozenset()) for i in items], settings, config.encode.num_workers, config.encode.prefetch
        )
    )
    return n / (time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--clips", type=int, default=None, help="clips to encode (default: 6 CPU / 24 CUDA)")
    parser.add_argument(
        "--frames", type=int, default=None, help="pixel frames per clip (default 17 CPU / 121 CUDA)"
    )
    parser.add_argument("--size", default=None, help="WxH (default 128x80 CPU / 640x384 CUDA)")
    parser.add_argument("--vae", choices=["auto", "tiny", "real"], default="auto")
    parser.add_argument("--chunking", default="none", help="comma-separated: none,framewise,exact")
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 CUDA / fp32 CPU"
    )
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument(
        "--chunk-frames",
        default="",
        help="comma-separated encode.chunk_frames values to time for each chunked run (default: the adapter's)",
    )
    args = parser.parse_args(argv)

    import torch

    from pfctl.config.load import load_config
    from pfctl.config.schema import RuntimeConfig
    from pfctl.data.encode import run_encode
    from pfctl.data.encode_setup import frame_settings
    from pfctl.data.video import FrameContract
    from pfctl.errors import CheckFailed
    from pfctl.runtime.accelerator import build_runtime

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    clips = args.clips or (24 if cuda else 6)
    frames = args.frames or (121 if cuda else 17)
    width, height = (int(v) for v in (args.size or ("640x384" if cuda else "128x80")).split("x"))
    vae_kind = args.vae if args.vae != "auto" else ("real" if cuda else "tiny")
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    runtime = build_runtime(RuntimeConfig(device=device))

    rows = []
    with tempfile.TemporaryDirectory(prefix="pfctl-bench-") as tmp:
        tmp = Path(tmp)
        t0 = time.monotonic()
        ann = _make_sources(tmp / "src", clips, frames, width, height)
        print(
            f"wrote {clips} source videos ({frames} frames, {width}x{height}) in {time.monotonic() - t0:.1f} s"
        )
        vae_spec = str(_real_vae_folder(tmp)) if vae_kind == "real" else "causal-vae-tiny"
        windows = [int(v) for v in args.chunk_frames.split(",") if v] or [None]
        runs = [(c, w) for c in args.chunking.split(",") for w in (windows if c != "none" else [None])]
        for chunking, window in runs:
            name = chunking if window is None else f"{chunking}, {window} frames"
            flags = {
                "encode.annotations": str(ann),
                "encode.output_dir": str(tmp / f"cache-{chunking}-{window}"),
                "encode.chunk_frames": window,
                "model.vae": vae_spec,
                "encode.buckets": [[width, height]],
                "encode.num_frames": frames,
                "encode.num_workers": args.num_workers,
                "encode.text": False,
                "encode.chunking": chunking,
                "encode.dtype": dtype,
            }
            config = load_config(None, [], flags)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                report = run_encode(config, runtime=runtime)
            except CheckFailed:  # show why clips failed: the failure log dies with the temp folder
                log = tmp / f"cache-{chunking}-{window}" / "failures.jsonl"
                print("".join(log.read_text().splitlines(keepends=True)[:3]) if log.is_file() else "no log")
                raise
            assert report.encoded == clips and report.failed == 0, report
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else _peak_rss_mib() / 1024
            rows.append((f"encode ({name})", report.clips_per_s, peak, report.encode_seconds))
        settings = frame_settings(config.encode, FrameContract.one_plus_multiple(8, frames), decode_threads=1)
        rows.append(("decode only", _decode_only(ann, config, settings), float("nan"), float("nan")))

    name = "real-size causal VAE" if vae_kind == "real" else "causal-vae-tiny"
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\nencode-latents benchmark — {name}, {dtype}, {clips} clips x {frames} frames @ {width}x{height}, "
          f"{args.num_workers} decode workers, {gpu}")  # fmt: skip
    memory = "peak GPU mem (GiB)" if cuda else "peak RSS (GiB)"
    print(f"| {'stage':<30} | {'clips/s':>8} | {memory:>18} | {'loop s':>7} |")
    print(f"|{'-' * 32}|{'-' * 10}|{'-' * 20}|{'-' * 9}|")
    for stage, rate, peak, seconds in rows:
        print(f"| {stage:<30} | {rate:>8.2f} | {peak:>18.2f} | {seconds:>7.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
