"""One-call vs framewise vs exact-chunked encode of a real-size CogVideoX VAE, on one or several processes.

The verify-groupnorm acceptance benchmark: ``AutoencoderKLCogVideoX`` with its default config
(random weights, 215.6 M parameters) encoding 49 frames at 480x720. For each path: wall time
(median of ``--repeats`` after a warm-up), peak extra device memory (``torch.cuda.max_memory_allocated``
above the baseline) and the error of the posterior mean against the one-call encode computed in fp32.

    python benchmarks/bench_verify.py --device cuda                       # 1 GPU, bf16
    python benchmarks/bench_verify.py --device cuda --nproc 2             # 2 GPUs, half the frames each
    python benchmarks/bench_verify.py --device cpu --frames 9 --size 64x96             # smoke test
    python benchmarks/bench_verify.py --device cpu --frames 9 --size 64x96 --nproc 2   # smoke test, gloo

One process: rows one-call, library framewise, exact parked (all parked activations on the device), one
row of exact parked with offload per value of ``--offload-above-gib`` (parked norm inputs beyond that
many GiB wait in pinned host memory; the next to resume is copied back while the current chunk computes),
and one row of exact recompute per value of ``--checkpoint-gib`` (all: no limit, the default; or GiB). Comma-separated lists sweep the budgets in one run:

    python benchmarks/bench_verify.py --device cuda --offload-above-gib 0.5,1,2,3 --checkpoint-gib all,1
    python benchmarks/bench_verify.py --device cpu --dtype fp32 --channels 32,64,64,128 --frames 25 \
        --size 96x144 --offload-above-gib=-1 --checkpoint-gib all,0.05     # CPU, same structure

On the CPU the peak is glibc malloc's bytes in use (sampled), not a device figure.

``--nproc N``: N processes started with torch.multiprocessing (NCCL on CUDA, GPU r for rank r; gloo on
the CPU). Rank r holds the r-th contiguous time shard of the clip (rank 0 the first frames) and runs the
exact chunked encode (``--schedule``) on it; GroupNorm statistics are all-reduced and causal-conv halos go from rank r to
r + 1. Rank 0 gathers the latents and compares them with the fp32 one-call encode and with the
single-process exact encode, both computed on rank 0 afterwards. The table has one row per rank (and per
``--offload-above-gib`` value, every one run on every rank): its wall time, its own peak, and the error of
its own latent frames.

Prints a short table last; ``--json PATH`` writes every number.
"""

from __future__ import annotations

import argparse
import copy
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30


def _timed(
    fn: Callable[[], torch.Tensor], device: torch.device, repeats: int, module: torch.nn.Module
) -> tuple[float, int, torch.Tensor]:
    """Median seconds over ``repeats`` (after one warm-up), peak extra memory, last output. On the CPU
    the peak is glibc malloc's bytes in use during the warm-up (sampled; pfctl.verify.measure)."""
    from pfctl.verify.measure import peak_memory

    box: dict[str, torch.Tensor] = {}
    cpu_peak, _ = (
        peak_memory(lambda: box.setdefault("out", fn()), "cpu", module) if device.type == "cpu" else (0, "")
    )
    out = box.pop("out") if device.type == "cpu" else fn()
    times = []
    peak = cpu_peak or 0
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


def _setup(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, int, int]:
    """The fp32 model (seeded: the same in every process), the clip, height and width."""
    from diffusers import AutoencoderKLCogVideoX

    height, width = (int(v) for v in args.size.split("x"))
    torch.manual_seed(0)
    kwargs = {"block_out_channels": tuple(args.channels)} if args.channels else {}
    module = AutoencoderKLCogVideoX(**kwargs).eval()
    video = torch.rand(1, 3, args.frames, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return module, video, height, width


def _vae(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> Any:
    from pfctl.models.diffusers_vae import DiffusersVideoVAE

    return DiffusersVideoVAE(
        torch.nn.Module.to(module, device, dtype), spec="AutoencoderKLCogVideoX", is_demo=False
    )


def _fp32_reference_mean(module: torch.nn.Module, video: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Posterior mean of the fp32 one-call encode (on the CPU); ``module`` is moved to ``device`` in fp32."""
    with torch.no_grad():
        ref = _vae(module, device, torch.float32).encode_moments(video.to(device), chunking="none").float()
    return ref[:, : ref.shape[1] // 2].cpu()


def _errors(ref_mean: torch.Tensor, moments: torch.Tensor) -> dict[str, float]:
    from pfctl.verify.measure import latent_metrics

    err = latent_metrics(ref_mean, moments[:, : moments.shape[1] // 2].float().cpu())
    return {"rel_l2_vs_fp32_one_call": err["rel_l2"], "max_abs_vs_fp32_one_call": err["max_abs"]}


def _offload_bytes(gib: float) -> int | None:
    """``offload_above`` in bytes for a budget in GiB; a negative budget means no offload."""
    return int(gib * GiB) if gib >= 0 else None


def _offload_label(gib: float) -> str:
    return f"offload>{gib:g}G" if gib >= 0 else "no offload"


def _checkpoint_bytes(budget: str) -> int | None:
    """``checkpoint_bytes`` of the recompute schedule: "all" (None: no limit, the default) or GiB."""
    return None if budget == "all" else int(float(budget) * GiB)


def _checkpoint_label(budget: str) -> str:
    return "checkpoint all" if budget == "all" else f"checkpoint<={budget}G"


def _parse_checkpoint_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    for v in values:
        if v != "all":
            try:
                float(v)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"not 'all' or a number of GiB: {v!r}") from exc
    return values


def _parse_gib_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from exc


def _info(args: argparse.Namespace, device: torch.device, params: int, height: int, width: int) -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": params,
        "frames": args.frames,
        "size": [height, width],
        "dtype": args.dtype,
        "nproc": args.nproc,
        "chunk_frames": args.chunk_frames,
        "offload_above_gib": args.offload_above_gib,
        "checkpoint_gib": args.checkpoint_gib,
        "schedule": args.schedule,
        "channels": args.channels,
    }


def _print_table(info: dict, rows: list[dict]) -> None:
    h, w = info["size"]
    print(
        f"\nCogVideoX VAE ({info['params'] / 1e6:.1f} M params), {info['frames']}x{h}x{w}, {info['dtype']}, "
        f"{info['device']}, chunk frames {info['chunk_frames']}, "
        f"offload above {', '.join(f'{g:g}' for g in info['offload_above_gib'])} GiB (parked), "
        f"checkpoint {', '.join(info['checkpoint_gib'])} (recompute)"
    )
    width = max(30, *(len(r["path"]) + 2 for r in rows))
    print(f"{'path':<{width}}{'seconds':>9}{'peak GiB':>10}{'relL2 vs fp32':>15}{'max abs':>10}")
    for r in rows:
        print(
            f"{r['path']:<{width}}{r['seconds']:>9.3f}{r['peak_gib']:>10.2f}"
            f"{r['rel_l2_vs_fp32_one_call']:>15.2e}{r['max_abs_vs_fp32_one_call']:>10.2e}"
        )


def _write_json(args: argparse.Namespace, info: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))


# ---------------------------------------------------------------------------------------- one process
def run_single(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    module, video, height, width = _setup(args)
    params = sum(p.numel() for p in module.parameters())
    ref_mean = _fp32_reference_mean(module, video, device)
    vae = _vae(module, device, dtype)
    x = video.to(device, dtype)
    exact = {"chunking": "exact", "chunk_frames": args.chunk_frames}
    parked = {**exact, "schedule": "parked"}
    paths: list[tuple[str, dict[str, Any]]] = [
        ("one-call", {"chunking": "none"}),
        ("framewise (library)", {"chunking": "framewise"}),
        ("exact parked", parked),
    ]
    for gib in args.offload_above_gib:
        if gib >= 0:  # a negative value is the no-offload row, which is always there
            paths.append(
                (f"exact parked, {_offload_label(gib)}", {**parked, "offload_above": _offload_bytes(gib)})
            )
    for budget in args.checkpoint_gib:
        paths.append(
            (
                f"exact recompute, {_checkpoint_label(budget)}",
                {**exact, "schedule": "recompute", "checkpoint_bytes": _checkpoint_bytes(budget)},
            )
        )
    rows = []
    for name, call in paths:
        seconds, peak, out = _timed(
            lambda c=call: vae.encode_moments(x, **c), device, args.repeats, vae.module
        )
        rows.append({"path": name, "seconds": seconds, "peak_gib": peak / GiB, **_errors(ref_mean, out)})
        del out
    info = {**_info(args, device, params, height, width), "rows": rows}
    _write_json(args, info)
    _print_table(info, rows)


# ---------------------------------------------------------------------------------------- N processes
def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    """One rank of ``--nproc``: the exact encode of its time shard; rank 0 gathers and reports."""
    import torch.distributed as dist

    from pfctl.models.exact_chunked import distributed_exchange, exact_chunked_encode, shard_frames
    from pfctl.models.exact_recompute import exact_recompute_encode

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc
    )
    try:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        module, video, height, width = _setup(args)
        params = sum(p.numel() for p in module.parameters())
        vae = _vae(copy.deepcopy(module), device, dtype)
        sizes = shard_frames(args.frames, args.nproc, vae.chunk_align())
        start = sum(sizes[:rank])
        shard = video[:, :, start : start + sizes[rank]].to(device, dtype)
        reduce_fn, halo = distributed_exchange(device, dtype)
        plan = vae.chunk_plan(sizes[rank], args.chunk_frames)
        runs, moments = [], None
        for budget in _rank_budgets(args):  # every rank runs the same budgets in the same order

            def encode(budget: Any = budget) -> torch.Tensor:
                if args.schedule == "recompute":
                    return exact_recompute_encode(
                        vae,
                        shard,
                        plan,
                        reduce_fn=reduce_fn,
                        halo=halo,
                        checkpoint_bytes=_checkpoint_bytes(budget),
                    ).moments
                return exact_chunked_encode(
                    vae, shard, plan, reduce_fn=reduce_fn, halo=halo, offload_above=_offload_bytes(budget)
                ).moments

            seconds, peak, out = _timed(encode, device, args.repeats, vae.module)
            out = out.cpu()
            if moments is None:
                moments = out
            elif not torch.equal(out, moments):  # budgets move or recompute bytes, never change them
                raise RuntimeError(f"rank {rank}: budget {budget} changed the latents")
            runs.append({"budget": budget, "seconds": seconds, "peak_gib": peak / GiB})
            del out
        mine = {
            "rank": rank,
            "frames": [start, start + sizes[rank]],
            "plan": plan,
            "runs": runs,
            "moments": moments,
        }
        gathered: list[Any] | None = [None] * args.nproc if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            _report_ranks(args, gathered, module, vae, video, device, params, height, width)
    finally:
        dist.destroy_process_group()


def _rank_budgets(args: argparse.Namespace) -> list[Any]:
    """The budgets every rank runs: checkpoint budgets (recompute) or offload budgets (parked)."""
    return list(args.checkpoint_gib) if args.schedule == "recompute" else list(args.offload_above_gib)


def _report_ranks(
    args: argparse.Namespace,
    gathered: list[dict],
    module: torch.nn.Module,
    vae: Any,
    video: torch.Tensor,
    device: torch.device,
    params: int,
    height: int,
    width: int,
) -> None:
    """Rank 0: the gathered latents against the fp32 one-call and the single-process exact encode."""
    from pfctl.verify.measure import latent_metrics

    moments = torch.cat([g["moments"] for g in gathered], dim=2)
    x = video.to(device, next(vae.module.parameters()).dtype)
    single = vae.encode_moments(
        x, chunking="exact", chunk_frames=args.chunk_frames, schedule=args.schedule
    ).cpu()
    ref_mean = _fp32_reference_mean(module, video, device)
    whole = _errors(ref_mean, moments)
    vs_single = latent_metrics(single, moments)  # both moments: mean and log-variance
    whole["rel_l2_vs_single_process_exact"] = vs_single["rel_l2"]
    whole["max_abs_vs_single_process_exact"] = vs_single["max_abs"]
    rows, t0, errs = [], 0, []
    for g in gathered:
        t = g["moments"].shape[2]
        errs.append(_errors(ref_mean[:, :, t0 : t0 + t], g["moments"]))
        t0 += t
    for i, budget in enumerate(_rank_budgets(args)):  # one block of rank rows per budget
        label = _checkpoint_label(budget) if args.schedule == "recompute" else _offload_label(budget)
        for g, err in zip(gathered, errs, strict=True):
            first, end = g["frames"]
            run = g["runs"][i]
            rows.append(
                {
                    "path": f"exact {args.schedule}, rank {g['rank']} (frames {first}-{end - 1}), {label}",
                    "budget": budget,
                    "seconds": run["seconds"],
                    "peak_gib": run["peak_gib"],
                    "plan": g["plan"],
                    **err,
                }
            )
    info = {**_info(args, device, params, height, width), "gathered": whole, "rows": rows}
    _write_json(args, info)
    print(
        f"\ngathered latents of {len(gathered)} ranks: relL2 vs fp32 one-call {whole['rel_l2_vs_fp32_one_call']:.2e}, "
        f"vs single-process exact (moments) {whole['rel_l2_vs_single_process_exact']:.2e} "
        f"(max abs {whole['max_abs_vs_single_process_exact']:.2e})"
    )
    _print_table(info, rows)


def run_multi(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args, port), nprocs=args.nproc, join=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--frames", type=int, default=49)
    parser.add_argument("--size", default="480x720", help="HxW")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1, help="processes, each with 1/N of the frames")
    parser.add_argument("--chunk-frames", type=int, default=4, help="frames per chunk of the exact path")
    parser.add_argument(
        "--offload-above-gib",
        type=_parse_gib_list,
        default=None,
        help="exact path: parked norm inputs beyond this many GiB on the device wait in host memory; a "
        "comma-separated list gives one row per value, e.g. 0.5,1,2,3 (default: 1 with one process, 0 "
        "with several; negative: no offload; write --offload-above-gib=-1,1 when a list starts negative)",
    )
    parser.add_argument(
        "--checkpoint-gib",
        type=_parse_checkpoint_list,
        default=["all"],
        help="exact recompute rows: checkpoint budget per row, a comma-separated list of all (no limit, "
        "the default) or GiB, e.g. all,1,0",
    )
    parser.add_argument(
        "--schedule",
        default="recompute",
        choices=["recompute", "parked"],
        help="--nproc > 1: the exact schedule the ranks run (recompute: one row per --checkpoint-gib)",
    )
    parser.add_argument(
        "--channels",
        type=lambda t: [int(v) for v in t.split(",")],
        default=None,
        help="block_out_channels of the model (default: CogVideoX's 128,256,256,512; e.g. 32,64,64,128 "
        "for a CPU run with the same structure)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not args.offload_above_gib:
        args.offload_above_gib = [1.0 if args.nproc == 1 else 0.0]
    if args.nproc > 1:
        run_multi(args)
    else:
        run_single(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
