"""Benchmark `encode-latents` end to end: clips/s, where the time goes, and the VAE alone beside it.

CPU (default when no GPU): the tiny causal VAE on small clips. CUDA: the real-size Pyramid Flow
causal VAE (random weights, 16 latent channels, ~0.34 B parameters) on 121-frame 640x384 clips.
Source videos are H.264 files written on the fly (PyAV) and the text encoders are tiny ones built on
the fly (or ``--text-encoder FOLDER``), so nothing is downloaded.

Each configuration (chunking x chunk frames x batch size) runs the whole pipeline (``run_encode``:
decode workers, batched VAE calls, text encoders, writer thread) into a fresh cache and reports:
clips/s of the encode loop, the command's whole time (model loading included), peak memory, and the
time per stage (``EncodeReport.stage_seconds``; device time on CUDA): waiting for decoded clips,
text encoders, host-to-device copies, VAE, copies back, file writes, waiting for the writer. Then
"VAE alone" rows: pfctl's VAE on one in-memory batch per batch size, and with ``--reference DIR`` (a
jy0205/Pyramid-Flow checkout, see bench_reference.py) the reference's VAE on one clip, same weights,
same input, under bf16 autocast as its pipeline runs it. ``decode only`` times the decode workers.
``--processes 1,2`` adds the same configuration as 2 real processes (torchrun, one GPU each): the
scaling figure; those runs include each process's own first-call warm-up (use enough clips).

    python benchmarks/bench_encode.py                       # auto: CUDA if present
    python benchmarks/bench_encode.py --device cpu --clips 4 --batch-size 1,2
    python benchmarks/bench_encode.py --device cuda --chunking framewise --chunk-frames 40 \\
        --batch-size 1,2,4 --num-workers 8 --reference third_party/Pyramid-Flow
    python benchmarks/bench_encode.py --device cuda --chunking framewise --chunk-frames 40 --batch-size 4 \
        --processes 1,2 --clips 48 --no-vae-alone      # on nvidia-h200-x2: the 2-GPU scaling

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
sys.path.insert(0, str(REPO / "benchmarks"))

REAL_VAE_OVERRIDES = {"encoder_out_channels": 16, "decoder_in_channels": 16, "scaling_factor": 0.13025}
"""The released causal VAE: the CausalVideoVAE defaults (128/256/512/512 channels) with 16 latent channels."""
STAGES = ("decode_wait", "text", "h2d", "vae", "copy_back", "write", "write_wait")


def _peak_rss_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, workers) / 1024


def _make_sources(folder: Path, clips: int, frames: int, width: int, height: int, captions: int) -> Path:
    """Write the clips and their annotation file into ``folder``; a folder written before with the same
    settings is reused as it is (``--sources``: clips made on a machine with PyAV, encoded on one without)."""
    ann = folder / "train.jsonl"
    stamp = folder / "settings.json"
    settings = json.dumps({"clips": clips, "frames": frames, "size": [width, height], "captions": captions})
    if ann.is_file() and stamp.is_file() and stamp.read_text() == settings:
        return ann
    from pfctl.data.synthetic import moving_frames, write_video

    rows = []
    for k in range(clips):
        path = write_video(folder / f"v{k}.mp4", moving_frames(frames, height, width, seed=k), fps=24)
        rows.append({"video": path.name, "text": f"a synthetic clip, caption {k % captions}"})
    ann.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stamp.write_text(settings)
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


def _decode_only(ann: Path, settings, workers: int, prefetch: int) -> float:
    from pfctl.data.annotations import load_annotations
    from pfctl.data.decoding import decoded_items

    items = load_annotations(ann)
    start = time.monotonic()
    n = sum(
        len(d.frames) for d in decoded_items([(i, frozenset()) for i in items], settings, workers, prefetch)
    )
    return n / (time.monotonic() - start)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _best_of(fn, device, repeats: int = 3) -> tuple[float, float]:
    """Seconds of the fastest of ``repeats`` calls after a warm-up, and the peak memory (GiB; RSS on CPU)."""
    import torch

    fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else _peak_rss_mib() / 1024
    return best, peak


def _vae_alone(args, vae_spec: str, shape: tuple[int, int, int], device, dtype_name: str) -> list[tuple]:
    """pfctl's VAE adapter (with the fast paths encode-latents uses) on one in-memory batch per batch size,
    and the reference's VAE on one clip (``--reference``): rows of the table."""
    import torch

    from pfctl.config.schema import FastPathsConfig
    from pfctl.data.encode_setup import _DTYPES
    from pfctl.models.vae import load_vae, with_fast_paths

    dtype = _DTYPES[dtype_name]
    vae = with_fast_paths(load_vae(vae_spec, dtype=dtype, device=device), FastPathsConfig())
    frames, height, width = shape
    gen = torch.Generator().manual_seed(0)
    clip = (torch.rand((1, 3, frames, height, width), generator=gen) * 2 - 1).to(device=device, dtype=dtype)
    rows, batches = [], _batch_sizes(args)
    for chunking, window in _runs(args):
        label = chunking if window is None else f"{chunking} {window}"
        for batch in batches:
            video = clip.expand(batch, -1, -1, -1, -1).contiguous()
            seconds, peak = _best_of(
                lambda v=video, c=chunking, w=window, m=vae: m.encode(v, chunking=c, chunk_frames=w), device
            )
            rows.append((f"VAE alone, pfctl ({label}, batch {batch})", batch / seconds, seconds, peak, {}))
        _print_work(vae, clip, chunking, window, label, rows[-len(batches)][1], batches[0])
    vae.module.to("cpu")  # the reference's peak memory counts its own weights only
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.reference is not None:
        rows.extend(_reference_rows(args, vae, clip, device))
    return rows


def _print_work(
    vae, clip, chunking: str, window: int | None, label: str, clips_per_s: float, batch: int
) -> None:
    """The encoder's arithmetic per clip (convolutions and products, counted by ``FlopCounterMode`` on one
    call) and the rate a VAE-alone row achieved: how far the VAE is from the device's peak."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.encode(clip, chunking=chunking, chunk_frames=window)
    tflop = counter.get_total_flops() / 1e12
    print(f"VAE encode ({label}): {tflop:.3g} TFLOP per clip; "
          f"at {clips_per_s:.2f} clips/s (batch {batch}) that is {tflop * clips_per_s:.3g} TFLOP/s")  # fmt: skip


def _reference_rows(args, vae, clip, device) -> list[tuple]:
    """The reference's CausalVideoVAE with pfctl's weights, one clip per call, as in its pipeline."""
    import torch
    from bench_vae import build_reference, reference_fn, resident

    config = {k: v for k, v in vae.module.config.items() if not k.startswith("_")}
    ref = build_reference(args.reference.resolve(), vae.module, config, device, clip.dtype)
    rows = []
    with resident(ref, device):
        for chunking, window in _runs(args):
            label = chunking if window is None else f"{chunking} {window}"
            fn = reference_fn(
                ref, "encode", clip, None if chunking == "none" else (window or 16), None, device
            )
            seconds, peak = _best_of(fn, device)
            rows.append((f"VAE alone, reference ({label})", 1 / seconds, seconds, peak, {}))
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _process_counts(args) -> list[int]:
    """1 first (the in-process run, always), then the counts > 1 asked for."""
    return [1, *sorted({int(v) for v in args.processes.split(",") if v and int(v) > 1})]


def _torchrun_row(name: str, processes: int, flags: dict, out: Path, device) -> tuple:
    """The same configuration as ``processes`` real processes (torchrun, one GPU each on CUDA): the
    command's own clips/s (the slowest rank's loop) and wall time, read from its summary."""
    import re
    import subprocess

    sets = [
        f"{k}={json.dumps(v)}" for k, v in {**flags, "encode.output_dir": str(out)}.items() if v is not None
    ]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
        "-m", "pfctl", "encode-latents", "--set", f"runtime.device={device.type}",
        *(arg for kv in sets for arg in ("--set", kv)),
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.monotonic() - start
    found = re.search(r"([\d.]+) clips/s \(", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(
            f"{processes} processes failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return (f"encode-latents ({name}, {processes} processes)", float(found.group(1)), wall, float("nan"), {})


def _runs(args) -> list[tuple[str, int | None]]:
    windows = [int(v) for v in args.chunk_frames.split(",") if v] or [None]
    return [(c, w) for c in args.chunking.split(",") for w in (windows if c != "none" else [None])]


def _batch_sizes(args) -> list[int]:
    return [int(v) for v in args.batch_size.split(",") if v]


def _parse(argv: list[str] | None) -> argparse.Namespace:
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
    parser.add_argument("--num-workers", default="auto", help="encode.num_workers: a number or auto")
    parser.add_argument(
        "--batch-size", default="1,4", help="comma-separated encode.batch_size values to time"
    )
    parser.add_argument(
        "--chunk-frames",
        default="",
        help="comma-separated encode.chunk_frames values to time for each chunked run (default: the adapter's)",
    )
    parser.add_argument(
        "--captions", type=int, default=None, help="distinct captions (default: one per clip)"
    )
    parser.add_argument("--no-text", action="store_true", help="latents only (encode.text=false)")
    parser.add_argument("--json", default=None, help="also write the table's rows here")
    parser.add_argument(
        "--sources",
        type=Path,
        default=None,
        help="keep the source clips in this folder (reused by a later run with the same settings)",
    )
    parser.add_argument(
        "--text-encoder", type=Path, default=None, help="a text-encoder folder (default: tiny, built here)"
    )
    parser.add_argument(
        "--reference", type=Path, default=None, help="a jy0205/Pyramid-Flow checkout: its VAE beside"
    )
    parser.add_argument("--no-vae-alone", action="store_true", help="skip the VAE-alone rows")
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="an experiment, not what encode-latents does: let cuDNN time its algorithms per shape "
        "(torch.backends.cudnn.benchmark) in this process's runs",
    )
    parser.add_argument(
        "--processes",
        default="1",
        help="comma-separated process counts: N > 1 runs `torchrun --nproc_per_node N -m pfctl encode-latents` "
        "(one GPU each on CUDA) on the same clips, for the scaling figure",
    )
    parser.add_argument(
        "--warmup-clips", type=int, default=None, help="clips encoded before timing (default 2 CUDA / 0 CPU)"
    )
    return parser.parse_args(argv)


def _text_folder(args, tmp: Path) -> Path | None:
    if args.no_text:
        return None
    if args.text_encoder is not None:
        return args.text_encoder
    from pfctl.models.text_encoder import build_tiny_text_encoder_folder

    build_tiny_text_encoder_folder(tmp / "text", seed=0, kind="pyramid_flux")
    return tmp / "text"


def _encode_rows(
    args, tmp: Path, ann: Path, vae_spec: str, text: Path | None, shape, device, dtype
) -> list[tuple]:
    """The whole pipeline, once per (chunking, chunk frames, batch size): rows of the table."""
    import torch

    from pfctl.config.load import load_config
    from pfctl.config.schema import RuntimeConfig
    from pfctl.data.encode import run_encode
    from pfctl.errors import CheckFailed
    from pfctl.runtime.accelerator import build_runtime

    runtime = build_runtime(RuntimeConfig(device=device.type))
    frames, height, width = shape
    workers = args.num_workers if args.num_workers == "auto" else int(args.num_workers)
    rows = []
    for chunking, window in _runs(args):
        for batch in _batch_sizes(args):
            name = f"{chunking}{'' if window is None else f' {window}'}, batch {batch}"
            out = tmp / f"cache-{chunking}-{window}-{batch}"
            flags = {
                "encode.annotations": str(ann), "encode.output_dir": str(out), "encode.chunk_frames": window,
                "model.vae": vae_spec, "encode.buckets": [[width, height]], "encode.num_frames": frames,
                "encode.num_workers": workers, "encode.batch_size": batch, "encode.text": text is not None,
                "encode.text_encoder": None if text is None else str(text), "encode.chunking": chunking,
                "encode.dtype": dtype,
            }  # fmt: skip
            if (
                args.warmup_clips
            ):  # first calls: cuDNN's algorithm choice, kernel compilation, allocator growth
                warm = ann.parent / "warmup.jsonl"  # the clips' paths are relative to it
                warm.write_text("".join(ann.read_text().splitlines(keepends=True)[: args.warmup_clips]))
                warm_flags = {
                    **flags,
                    "encode.annotations": str(warm),
                    "encode.output_dir": str(out) + "-warmup",
                }
                run_encode(load_config(None, [], warm_flags), runtime=runtime)
            for processes in _process_counts(args)[1:]:
                rows.append(_torchrun_row(name, processes, flags, tmp / f"{out.name}-p{processes}", device))
            config = load_config(None, [], flags)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                report = run_encode(config, runtime=runtime)
            except CheckFailed:  # show why clips failed: the failure log dies with the temp folder
                log = out / "failures.jsonl"
                print("".join(log.read_text().splitlines(keepends=True)[:3]) if log.is_file() else "no log")
                raise
            assert report.encoded == args.clips and report.failed == 0, report
            for note in report.notes:
                print(f"  {name}: {note}")
            cuda = device.type == "cuda"
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else _peak_rss_mib() / 1024
            rows.append(
                (f"encode-latents ({name})", report.clips_per_s, report.seconds, peak, report.stage_seconds)
            )
    return rows


def _cell(value: float) -> str:
    return "" if value != value else f"{value:.2f}"  # NaN: not measured


def _print_table(rows: list[tuple], title: str, cuda: bool) -> None:
    print(f"\n{title}")
    memory = "peak GPU GiB" if cuda else "peak RSS GiB"
    head = ["stage", "clips/s", "total s", memory, *(f"{s} s" for s in STAGES)]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, rate, seconds, peak, stages in rows:
        cells = [name, f"{rate:.2f}", _cell(seconds), _cell(peak)]
        cells += [f"{stages[s]:.2f}" if s in stages else "" for s in STAGES]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    import torch

    from pfctl.data.decoding import resolve_workers
    from pfctl.data.encode_setup import frame_settings
    from pfctl.data.video import FrameContract

    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    cuda = device.type == "cuda"
    args.clips = args.clips or (24 if cuda else 6)
    args.warmup_clips = (2 if cuda else 0) if args.warmup_clips is None else args.warmup_clips
    frames = args.frames or (121 if cuda else 17)
    width, height = (int(v) for v in (args.size or ("640x384" if cuda else "128x80")).split("x"))
    vae_kind = args.vae if args.vae != "auto" else ("real" if cuda else "tiny")
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark

    with tempfile.TemporaryDirectory(prefix="pfctl-bench-") as tmp:
        tmp = Path(tmp)
        t0 = time.monotonic()
        ann = _make_sources(
            args.sources or tmp / "src", args.clips, frames, width, height, args.captions or args.clips
        )
        print(
            f"wrote {args.clips} source videos ({frames} frames, {width}x{height}) in {time.monotonic() - t0:.1f} s"
        )
        vae_spec = str(_real_vae_folder(tmp)) if vae_kind == "real" else "causal-vae-tiny"
        text = _text_folder(args, tmp)
        rows = _encode_rows(args, tmp, ann, vae_spec, text, (frames, height, width), device, dtype)
        if not args.no_vae_alone:
            rows += _vae_alone(args, vae_spec, (frames, height, width), device, dtype)
        from pfctl.config.load import load_config

        cfg = load_config(None, [], {"encode.buckets": [[width, height]], "encode.num_frames": frames}).encode
        settings = frame_settings(cfg, FrameContract.one_plus_multiple(8, frames), decode_threads=1)
        workers = resolve_workers(args.num_workers if args.num_workers == "auto" else int(args.num_workers))
        rows.append(
            (
                f"decode only ({workers} workers)",
                _decode_only(ann, settings, workers, 2),
                float("nan"),
                float("nan"),
                {},
            )
        )

    name = "real-size causal VAE" if vae_kind == "real" else "causal-vae-tiny"
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    texts = "no text" if text is None else f"text encoders {'tiny' if args.text_encoder is None else text}"
    _print_table(
        rows,
        f"encode-latents benchmark — {name}, {dtype}, {args.clips} clips x {frames} frames @ {width}x{height}, "
        f"{args.num_workers} decode workers, {texts}, {gpu}{', cudnn.benchmark' if args.cudnn_benchmark else ''}; stage times: the slowest rank's seconds "
        "(device time on CUDA), VAE-alone rows: one call",
        cuda,
    )
    if args.json:
        keys = ("stage", "clips_per_s", "total_s", "peak_gib", "stage_s")
        Path(args.json).write_text(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
