"""Speed and memory of ``pfctl generate``: seconds per video and peak GPU memory.

Runs the real pipeline (:func:`pfctl.sampling.generate.run_generate`: pyramid sampler with CFG,
de-normalisation, chunked/tiled VAE decode, mp4 + sidecar writing) on models with random weights:

* CUDA (default there): real-size miniFLUX (~2B) + the released causal-VAE architecture in bf16,
  a 5 s 384p video — 640x384, temp 16 (121 frames), steps [20,20,20] / [10,10,10], CFG 7 / 5,
  decode window 1 with 256-px tiles (the reference's ``save_memory``). Text encoders are replaced
  by random features of the real widths (T5-XXL 4096 x 128 tokens, CLIP-L 768): their one-off cost
  is not what this measures.
* CPU: the ``tiny`` preset and the tiny causal VAE, 64x64, temp 3, one step per stage.

The DiT is randomly re-initialised so its output is not the constant 0 of a fresh model (same
work either way; it keeps the latents realistic in magnitude for the decoder).

    python benchmarks/bench_generate.py                        # CPU tiny
    python benchmarks/bench_generate.py --device cuda          # H200: miniFLUX 384p, 5 s
    python benchmarks/bench_generate.py --device cuda --temp 31 --resolution 768p --videos 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

REAL_VAE = {
    "encoder_out_channels": 16,
    "decoder_in_channels": 16,
    "scaling_factor": 0.13025,
    "interpolate": False,
}
"""The released causal VAE: library defaults (128/256/512/512, 2/3 resnets, 32 groups) + 16 channels."""


@dataclass
class RandomTextEncoder:
    """Stands in for CLIP + T5: random features of the right widths (seeded by the prompt)."""

    seq_len: int
    dim: int
    pooled_dim: int
    device: torch.device
    dtype: torch.dtype

    def encode(self, prompts):
        from pfctl.models.text_embeddings import TextEmbeddings

        # seeded by the prompts' bytes, not hash(): string hashes differ between processes
        gen = torch.Generator().manual_seed(zlib.crc32("\0".join(prompts).encode()))
        n = len(prompts)
        return TextEmbeddings(
            prompt_embeds=torch.randn(n, self.seq_len, self.dim, generator=gen).to(self.device, self.dtype),
            prompt_attention_mask=torch.ones(n, self.seq_len, dtype=torch.int64, device=self.device),
            pooled_prompt_embeds=torch.randn(n, self.pooled_dim, generator=gen).to(self.device, self.dtype),
        )

    def empty_embedding(self):
        return self.encode([""])

    def to(self, device=None, dtype=None):
        return self

    def fingerprint(self) -> str:
        return "random-text"


def build_components(preset: str, vae_config: dict, device: torch.device, dtype: torch.dtype, seed: int):
    from pfctl.models.causal_vae import CausalVideoVAE
    from pfctl.models.checkpoint import Components
    from pfctl.models.registry import build_dit, preset_config
    from pfctl.models.vae import PyramidCausalVAE

    torch.manual_seed(seed)
    with torch.device(device):
        dit = build_dit(preset)
        with torch.no_grad():
            for p in dit.parameters():  # non-trivial output (a fresh DiT predicts exactly 0)
                if p.ndim >= 2:
                    p.normal_(0.0, p.shape[-1] ** -0.5)
        vae = CausalVideoVAE(**vae_config)
    dit = torch.nn.Module.to(dit, dtype=dtype).eval()  # (diffusers' .to warns about fp32 modules)
    vae = torch.nn.Module.to(vae, dtype=dtype).eval()
    cfg = preset_config(preset)
    text = RandomTextEncoder(128, cfg["joint_attention_dim"], cfg["pooled_projection_dim"], device, dtype)
    info = {"layout": "benchmark", "root": f"random {preset} + causal VAE", "model_name": "pyramid_flux"}
    params = sum(p.numel() for p in dit.parameters()), sum(p.numel() for p in vae.parameters())
    return Components(dit=dit, vae=PyramidCausalVAE(vae), text_encoder=text, info=info), params


class CallTimes:
    """Records every DiT call made through :class:`pfctl.models.fast.cuda_graph.StageGraph`: the tokens of its
    column, what the call was (``eager``: a new signature's warm-up, ``capture``: recorded then replayed,
    ``replay``) and CUDA events around it, so that replay times and the cost of warm-ups and captures can be
    told apart without a profiler."""

    log: ClassVar[list[dict]] = []

    @classmethod
    def install(cls) -> list[dict]:
        from pfctl.models.fast import cuda_graph

        call = cuda_graph.StageGraph.__call__

        def timed(self, **kwargs):
            captures, replays = self.captures, self.replays
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = call(self, **kwargs)
            end.record()
            # the runner's own counters tell what the call was (a capture is replayed at once)
            replayed = self.replays > replays
            cls.log.append(
                {
                    "tokens": sum(c.shape[2] * c.shape[3] * c.shape[4] // 4 for c in kwargs["sample"][0]),
                    "kind": "capture" if self.captures > captures else "replay" if replayed else "eager",
                    "start": start,
                    "end": end,
                }
            )
            return out

        cuda_graph.StageGraph.__call__ = timed
        return cls.log


def call_times(log: list[dict]) -> dict:
    """One video's DiT calls by kind (ms of GPU time between each call's events), and what the warm-ups and
    captures cost beyond a replay of the same token count."""
    torch.cuda.synchronize()
    for rec in log:
        rec["ms"] = rec["start"].elapsed_time(rec["end"])
    fastest: dict[int, float] = {}
    for rec in log:
        if rec["kind"] == "replay":
            fastest[rec["tokens"]] = min(rec["ms"], fastest.get(rec["tokens"], rec["ms"]))
    out = {}
    for kind in ("replay", "eager", "capture"):
        calls = [r for r in log if r["kind"] == kind]
        out[kind] = {
            "calls": len(calls),
            "ms": sum(r["ms"] for r in calls),
            "extra_ms": sum(r["ms"] - fastest[r["tokens"]] for r in calls if r["tokens"] in fastest),
        }
    out["replay_ms_by_tokens"] = {str(n): ms for n, ms in sorted(fastest.items())}
    out["calls_ms"] = sum(r["ms"] for r in log)
    out["span_ms"] = log[0]["start"].elapsed_time(log[-1]["end"])
    return out


def print_call_times(times: dict) -> None:
    print(f"DiT calls of the last video: {times['calls_ms'] / 1e3:.2f} s inside calls, {times['span_ms'] / 1e3:.2f} s "
          "from the first call's start to the last one's end (GPU events)")  # fmt: skip
    for kind in ("replay", "eager", "capture"):
        t = times[kind]
        print(
            f"{kind:>8}: {t['calls']:>4} calls, {t['ms'] / 1e3:6.2f} s, {t['extra_ms'] / 1e3:5.2f} s more than replays"
        )


def parse_args() -> argparse.Namespace:
    """The command line (sizes default to the device: miniFLUX at 384p on CUDA, the tiny DiT at 64x64 on the CPU)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--preset", default=None, help="DiT preset (default: miniflux on CUDA, tiny on CPU)")
    parser.add_argument("--temp", type=int, default=None, help="latent frames (default 16 on CUDA, 3 on CPU)")
    parser.add_argument(
        "--resolution", default=None, help="384p / 768p / WxH (default 384p on CUDA, 64x64 on CPU)"
    )
    parser.add_argument(
        "--videos", type=int, default=2, help="videos to time (the first one includes warm-up)"
    )
    parser.add_argument("--decode-window", type=int, default=1)
    parser.add_argument(
        "--decode-tile",
        type=lambda v: v if v == "auto" else int(v),
        default=256,
        help="pixels, or auto (pfctl's default: untiled when it fits in free memory)",
    )
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run every DiT call eagerly")
    parser.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "efficient", "cudnn"],
        help="the DiT's attention backend",
    )
    parser.add_argument(
        "--skip-future-keys",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate.skip_future_keys (on by default, as in pfctl generate)",
    )
    parser.add_argument(
        "--row-group-min-tokens",
        type=int,
        default=None,
        help="generate.row_group_min_tokens: the shortest column attended in row groups (default: generate's, 0)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then generate one more video under the profiler: GPU kernel time by kind, the costliest kernels",
    )
    parser.add_argument(
        "--call-times",
        action="store_true",
        help="CUDA graphs: time every DiT call of the last video on the GPU (replays, warm-ups, captures)",
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def generate_overrides(
    args: argparse.Namespace, device: torch.device, out: Path, size: tuple[int, int], temp: int, steps: tuple
) -> list[str]:
    """The ``--set`` overrides of the timed ``pfctl generate`` run."""
    cuda = device.type == "cuda"
    width, height = size
    overrides = [
        f"runtime.device={device.type}",
        f"generate.output_dir={out}",
        f"generate.width={width}",
        f"generate.height={height}",
        f"generate.temp={temp}",
        f"generate.num_inference_steps={steps[0]}",
        f"generate.video_num_inference_steps={steps[1]}",
        f"generate.num_videos={args.videos}",
        f"generate.decode_window={args.decode_window}",
        f"generate.decode_tile={args.decode_tile}",
        f"generate.dtype={'bf16' if cuda else 'fp32'}",
        f"generate.compile={str(args.compile).lower()}",
        f"generate.offload={str(args.offload).lower()}",
        f"generate.cuda_graphs={str(not args.no_cuda_graphs).lower()}",
        f"generate.attention={args.attention}",
        f"generate.skip_future_keys={str(args.skip_future_keys).lower()}",
        "generate.seed=0",
        # the mp4 write is not timed (as the reference's figures, it is not part of a video's seconds); the
        # random-weight frames are noise, slow to compress on one thread
        "generate.encoder_threads=0",
    ]
    if args.row_group_min_tokens is not None:
        overrides.append(f"generate.row_group_min_tokens={args.row_group_min_tokens}")
    return overrides


def profile_one_video(overrides: list[str], components: Any) -> dict:
    """GPU kernel time by kind of one more video of the same run, under the profiler."""
    from kernel_profile import kernel_breakdown

    from pfctl.config import load_config
    from pfctl.sampling.generate import run_generate

    once = load_config(None, [*overrides, "generate.num_videos=1"])
    return kernel_breakdown(
        lambda: run_generate(once, ["a red circle moving left"], components=components), repeats=1, top=15
    )


def print_result(result: dict) -> None:
    """The timing table, then the per-call times and the kernel profile when measured."""
    temp, dit_calls = result["temp"], result["dit_calls_cfg_batch2"]
    dit_params, vae_params = result["dit_params"], result["vae_params"]
    print()
    print(f"pfctl generate benchmark — {result['device']}, {result['preset']} ({dit_params / 1e9:.2f}B) + causal VAE "
          f"({vae_params / 1e6:.0f}M), {result['dtype']}, CUDA graphs {'on' if result['cuda_graphs'] else 'off'}, "
          f"compile {'on' if result['compile'] else 'off'}")  # fmt: skip
    print(f"{'size':>10} {'temp':>5} {'frames':>7} {'DiT calls':>10} {'sample s':>9} {'decode s':>9} "
          f"{'s/video':>8} {'ms/call':>8} {'peak GiB':>9}")  # fmt: skip
    peak = f"{result['peak_memory_gib']:.1f}" if result["peak_memory_gib"] is not None else "-"
    print(f"{result['size']:>10} {temp:>5} {result['frames']:>7} {dit_calls:>10} {result['sample_s']:>9.2f} "
          f"{result['decode_s']:>9.2f} {result['seconds_per_video']:>8.2f} "
          f"{1000 * result['sample_s'] / dit_calls:>8.1f} {peak:>9}")  # fmt: skip
    if "call_times" in result:
        print_call_times(result["call_times"])
    if "profile" in result:
        from kernel_profile import print_breakdown

        print_breakdown("one more video under the profiler (sampling and decode)", result["profile"])


def main() -> None:
    args = parse_args()

    import pfctl.models.attention_layout as attention_layout
    from pfctl.config import load_config
    from pfctl.config.generate import RESOLUTIONS
    from pfctl.models.vae import TINY_CAUSAL_VAE_CONFIG
    from pfctl.sampling.generate import run_generate

    device = torch.device(
        "cuda" if (args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())) else "cpu"
    )
    cuda = device.type == "cuda"
    preset = args.preset or ("miniflux" if cuda else "tiny")
    temp = args.temp or (16 if cuda else 3)
    resolution = args.resolution or ("384p" if cuda else "64x64")
    width, height = RESOLUTIONS[resolution] if resolution in RESOLUTIONS else map(int, resolution.split("x"))
    steps = ([20, 20, 20], [10, 10, 10]) if cuda else ([1, 1, 1], [1, 1, 1])
    dtype = torch.bfloat16 if cuda else torch.float32
    vae_config = REAL_VAE if cuda else TINY_CAUSAL_VAE_CONFIG

    t0 = time.perf_counter()
    components, (dit_params, vae_params) = build_components(preset, vae_config, device, dtype, seed=0)
    if cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0

    out = Path(tempfile.mkdtemp(prefix="pfctl-bench-generate-"))
    overrides = generate_overrides(args, device, out, (width, height), temp, steps)
    config = load_config(None, overrides)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timed = CallTimes.install() if args.call_times and cuda and not args.no_cuda_graphs else None
    report = run_generate(config, ["a red circle moving left"], components=components)
    rows = []
    for video in report.videos:
        timing = json.loads(video.sidecar.read_text())["timing_s"]
        rows.append({"seed": video.seed, "total_s": video.seconds, **timing})
    steady = rows[1:] or rows
    dit_calls = sum(steps[0]) + sum(steps[1]) * (temp - 1)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "preset": preset,
        "dit_params": dit_params,
        "vae_params": vae_params,
        "dtype": str(dtype).replace("torch.", ""),
        "size": f"{width}x{height}",
        "temp": temp,
        "frames": report.videos[0].num_frames,
        "dit_calls_cfg_batch2": dit_calls,
        "cuda_graphs": cuda and not args.no_cuda_graphs,
        "compile": cuda and args.compile,
        "skip_future_keys": args.skip_future_keys,
        "row_group_min_tokens": (
            attention_layout.ROW_GROUP_MIN_TOKENS
            if config.generate.row_group_min_tokens is None
            else config.generate.row_group_min_tokens
        ),
        "row_group_min_rows": attention_layout.ROW_GROUP_MIN_ROWS,
        "build_s": build_s,
        "videos": rows,
        "seconds_per_video": sum(r["total_s"] for r in steady) / len(steady),
        "sample_s": sum(r["sample"] for r in steady) / len(steady),
        "decode_s": sum(r["decode"] for r in steady) / len(steady),
        "peak_memory_gib": (report.peak_memory_bytes or 0) / 2**30 if cuda else None,
        "torch": torch.__version__,
    }
    if timed is not None:
        calls_per_video = len(timed) // args.videos
        result["call_times"] = call_times(timed[-calls_per_video:])
    if args.profile and cuda:
        result["profile"] = profile_one_video(overrides, components)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))

    print_result(result)


if __name__ == "__main__":
    main()
