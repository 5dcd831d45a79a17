"""Peak GPU memory and time of ``pfctl generate`` at each ``generate.low_memory`` level; with
``--processes``, the speed-up of one video sampled by several processes (one GPU each).

Each level runs in a process of its own (a clean allocator, a clean peak), on models with random weights of
the real sizes: the miniFLUX DiT (~2B) and the released causal-VAE architecture from
``benchmarks/bench_generate.py``, and, unlike that benchmark, **real-size text encoders** (T5-XXL v1.1
encoder, ~4.7B, and CLIP-L's text tower) run on random token ids, so the peak includes them. One video:
temp 16 (5 s), steps [20,20,20] / [10,10,10], CFG 7 / 5, bf16. The peak is
``torch.cuda.max_memory_allocated`` over the whole ``run_generate`` call (encoding, sampling, decoding);
the time is the call's, without building the models.

    python benchmarks/bench_generate_parallel.py --levels none,offload,stream --resolution 384p
    python benchmarks/bench_generate_parallel.py --levels none,stream --resolution 768p --temp 16
    python benchmarks/bench_generate_parallel.py --device cpu          # tiny models: a smoke run
    python benchmarks/bench_generate_parallel.py --processes 1,2 --resolution 768p

On the CPU the tiny presets stand in (64x64, one step per stage): nothing moves there, so it only shows that
every level runs.

``--processes N,...``: the same video (same weights, prompt and seed) sampled by each number of processes
under ``torchrun``, with ``generate.parallel`` left on ``auto`` (one video: CFG halves on two ranks, the rest
splitting the sequence), and by one process without CUDA graphs (several ranks on one video run without
them), so that what the graphs give and what the processes give can be told apart. It reports the sampling
time of each (the sidecar's), the speed-up over one process, the layout the sidecar records and the latents'
relative L2 against the one-process video. The DiT and VAE have random weights of the real sizes (the
text encoders are stand-ins: the text encoding is not what is timed). On the CPU, 2 processes of the tiny
preset (gloo): a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

T5_XXL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64, "vocab_size": 32128}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
TINY_T5 = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 128}
TINY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


class RandomWeightTextEncoder(nn.Module):
    """T5 encoder + CLIP text tower with random weights, run on random token ids (seeded by the prompt):
    the memory and the work of the real text encoders, without their tokenizers or weights."""

    def __init__(self, t5: dict, clip: dict, joint_dim: int, pooled_dim: int) -> None:
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        super().__init__()
        self.t5 = T5EncoderModel(T5Config(**t5, feed_forward_proj="gated-gelu"))
        self.clip = CLIPTextModel(CLIPTextConfig(**clip, vocab_size=49408, max_position_embeddings=77))
        self.proj = nn.Linear(t5["d_model"], joint_dim) if t5["d_model"] != joint_dim else nn.Identity()
        self.pool = nn.Linear(clip["hidden_size"], pooled_dim) if clip["hidden_size"] != pooled_dim else nn.Identity()

    @torch.no_grad()
    def encode(self, prompts: list[str]):
        from pfctl.models.text_embeddings import TextEmbeddings

        device = next(self.parameters()).device
        gen = torch.Generator().manual_seed(abs(hash(tuple(prompts))) % 2**31)
        n = len(prompts)
        t5_ids = torch.randint(0, self.t5.config.vocab_size, (n, 128), generator=gen).to(device)
        clip_ids = torch.randint(0, 49408, (n, 77), generator=gen).to(device)
        embeds = self.proj(self.t5(input_ids=t5_ids).last_hidden_state)
        pooled = self.pool(self.clip(input_ids=clip_ids).pooler_output)
        mask = torch.ones(n, 128, dtype=torch.int64, device=device)
        return TextEmbeddings(prompt_embeds=embeds, prompt_attention_mask=mask, pooled_prompt_embeds=pooled)

    def empty_embedding(self):
        return self.encode([""])

    def fingerprint(self) -> str:
        return "random-weight text encoders"


PROMPT = "a red circle moving left"


def preset(cuda: bool) -> str:
    """The DiT preset of the benchmark: real size on CUDA, tiny on the CPU."""
    return "miniflux" if cuda else "tiny"


def one_video(args: argparse.Namespace, device: torch.device, *overrides: str) -> tuple[Any, Any]:
    """The benchmark's one video on ``device``: the random-weight DiT and VAE (seed 0; real sizes on CUDA, tiny
    presets at 64x64 with one step per stage on the CPU) and its config, ``overrides`` after the common settings."""
    from bench_generate import REAL_VAE, build_components

    from pfctl.config import load_config
    from pfctl.config.generate import RESOLUTIONS
    from pfctl.models.vae import TINY_CAUSAL_VAE_CONFIG

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    vae = REAL_VAE if cuda else TINY_CAUSAL_VAE_CONFIG
    components, _ = build_components(preset(cuda), vae, device, dtype, seed=0)
    width, height = RESOLUTIONS[args.resolution] if cuda else (64, 64)
    steps = ([20, 20, 20], [10, 10, 10]) if cuda else ([1, 1, 1], [1, 1, 1])
    config = load_config(
        None,
        [
            f"runtime.device={device.type}", f"generate.width={width}", f"generate.height={height}",
            f"generate.temp={args.temp if cuda else 2}", f"generate.num_inference_steps={steps[0]}",
            f"generate.video_num_inference_steps={steps[1]}", f"generate.dtype={'bf16' if cuda else 'fp32'}",
            "generate.seed=0", "generate.encoder_threads=0", *overrides,
        ],
    )  # fmt: skip
    return components, config


def run_level(args: argparse.Namespace) -> dict:
    """One level in this process: build the parts (on the CPU when they are to move), generate, measure."""
    from pfctl.models.registry import preset_config
    from pfctl.sampling.generate import run_generate

    cuda = args.device == "cuda"
    device = torch.device(args.device)
    components, config = one_video(
        args,
        device,
        f"generate.output_dir={tempfile.mkdtemp(prefix='pfctl-bench-lowmem-')}",
        f"generate.low_memory={args.only}",
    )
    cfg = preset_config(preset(cuda))
    with torch.device(device):  # built where the random init is fast, then moved where the level keeps it
        text = RandomWeightTextEncoder(
            T5_XXL if cuda else TINY_T5, CLIP_L if cuda else TINY_CLIP, cfg["joint_attention_dim"],
            cfg["pooled_projection_dim"],
        )  # fmt: skip
    components.text_encoder = nn.Module.to(text, dtype=next(components.dit.parameters()).dtype).eval()
    if args.only != "none":  # the parts wait on the CPU
        for part in (components.dit, components.vae.module, components.text_encoder):
            nn.Module.to(part, "cpu")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    start = time.perf_counter()
    report = run_generate(config, [PROMPT], components=components)
    seconds = time.perf_counter() - start
    (video,) = report.videos
    sidecar = json.loads(video.sidecar.read_text())
    return {
        "level": args.only,
        "size": f"{config.generate.width}x{config.generate.height}",
        "temp": config.generate.temp,
        "seconds": seconds,
        "timing_s": sidecar["timing_s"],
        "peak_gib": (report.peak_memory_bytes or 0) / 2**30 if cuda else None,
        "expected_peak_gib": sidecar["runtime"]["memory"]["expected_peak_bytes"] / 2**30,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def run_processes(args: argparse.Namespace) -> dict | None:
    """One run of the ``--processes`` mode in this rank (started by ``torchrun``): every rank builds the same
    random-weight models on its device and samples the one video; the rank that writes it returns its
    figures (the others None)."""
    from pfctl.sampling.generate import run_generate

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    components, config = one_video(
        args,
        device,
        f"generate.output_dir={args.out}",
        f"generate.cuda_graphs={not args.no_graphs}",
        "generate.save_latents=true",
    )
    report = run_generate(config, [PROMPT], components=components)
    if not report.videos:
        return None
    (video,) = report.videos
    sidecar = json.loads(video.sidecar.read_text())
    return {
        "processes": int(os.environ.get("WORLD_SIZE", "1")),
        "cuda_graphs": cuda and sidecar["settings"]["generate"]["cuda_graphs"],  # as the run settled it
        "size": f"{config.generate.width}x{config.generate.height}",
        "temp": config.generate.temp,
        "timing_s": sidecar["timing_s"],
        "layout": sidecar["runtime"].get("parallel"),
        "latents": str(video.path.with_suffix(".latents.safetensors")),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def compare_processes(args: argparse.Namespace) -> list[dict]:
    """The ``--processes`` mode: each count under ``torchrun`` (and one process without CUDA graphs on CUDA),
    the table last."""
    from safetensors.torch import load_file

    runs = [(n, False) for n in (int(x) for x in args.processes.split(","))]
    if args.device == "cuda":
        runs.insert(1, (1, True))
    rows = []
    for n, no_graphs in runs:
        out = tempfile.mkdtemp(prefix=f"pfctl-bench-{n}proc-")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__]
        cmd += ["--rank-run", "--out", out, "--device", args.device, "--resolution", args.resolution]
        cmd += ["--temp", str(args.temp), *(["--no-graphs"] if no_graphs else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{n} process(es) failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    base = rows[0]
    reference = load_file(base["latents"])["latents"].double()
    for row in rows:
        latents = load_file(row["latents"])["latents"].double()
        row["latents_relative_l2"] = float((latents - reference).norm() / reference.norm())
        row["speedup_sample"] = base["timing_s"]["sample"] / row["timing_s"]["sample"]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"\npfctl generate on several processes — {base['device']}, {base['size']}, temp {base['temp']}")
    print(f"{'processes':>9} {'graphs':>6} {'sample s':>9} {'speed-up':>8} {'decode s':>9} {'latents rel. L2':>15}  layout")
    for row in rows:
        print(
            f"{row['processes']:>9} {'yes' if row['cuda_graphs'] else 'no':>6} {row['timing_s']['sample']:>9.2f} "
            f"{row['speedup_sample']:>7.2f}x {row['timing_s']['decode']:>9.2f} {row['latents_relative_l2']:>15.2e}  "
            f"{json.dumps(row['layout'])}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="none,offload,stream", help="comma-separated generate.low_memory levels")
    parser.add_argument("--resolution", default="384p", choices=["384p", "768p"])
    parser.add_argument("--temp", type=int, default=16, help="latent frames (16 = 5 s)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--processes", default=None, help="comma-separated process counts: the speed-up mode (not the levels)"
    )
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one level, in a child process
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)  # a --processes rank
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-graphs", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.rank_run:
        result = run_processes(args)
        if result is not None:
            print("RESULT " + json.dumps(result))
        return
    if args.processes is not None:
        compare_processes(args)
        return
    if args.only is not None:
        print("RESULT " + json.dumps(run_level(args)))
        return
    rows = []
    for level in args.levels.split(","):
        cmd = [sys.executable, __file__, "--only", level, "--device", args.device, "--resolution", args.resolution]
        proc = subprocess.run([*cmd, "--temp", str(args.temp)], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"level {level} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    base = rows[0]["seconds"]
    print(f"\npfctl generate --low-memory — {rows[0]['device']}, {rows[0]['size']}, temp {rows[0]['temp']}")
    print(f"{'level':>8} {'seconds':>8} {'x first':>8} {'sample s':>9} {'decode s':>9} {'peak GiB':>9} {'expected':>9}")
    for row in rows:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        print(
            f"{row['level']:>8} {row['seconds']:>8.1f} {row['seconds'] / base:>8.2f} {row['timing_s']['sample']:>9.1f} "
            f"{row['timing_s']['decode']:>9.1f} {peak:>9} {row['expected_peak_gib']:>9.2f}"
        )


if __name__ == "__main__":
    main()
