"""Where the GPU time of one DiT call goes: kernel time by kind and by name, compiled blocks.

One miniFLUX forward (bf16, random weights, no gradient) at the shape of a large 768p sampling call, as
``pfctl generate`` runs it (CFG batch 2, ``skip_future_keys`` with the text lengths, blocks compiled with
dynamic shapes), profiled over a few calls; then the same with the blocks compiled for static shapes, and
with automatic dynamic shapes (static, then recompiled with only the sizes that changed dynamic: the sampler
calls it at the 384p shape first), to tell what dynamic shapes cost. ``--kernel-source`` writes the generated source of the costliest compiled
kernels (with Inductor's note of the operations each one fuses) to a file.

Cases (latent clips of one column, oldest first; the last is the clip being denoised):

* ``gen768``: 4 frames at 1/4 resolution, 4 at 1/2, one full 1280x768 frame, then the current full frame
  (12,608 image tokens);
* ``gen384``: the same at 640x384 (3,152 image tokens).

    python benchmarks/bench_dit_call.py --device cuda --kernel-source kernels.txt
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

CASES = {  # name: (latent height, width of a full frame)
    "gen768": (96, 160),
    "gen384": (48, 80),
}
TEXT_LEN, TEXT_VALID = 128, (24, 1)


def call_inputs(
    case: str, channels: int, text_dim: int, pooled_dim: int, device: torch.device, dtype
) -> dict:
    """The keyword arguments of one sampling call of ``case`` (CFG pair: a prompt and the empty prompt)."""
    h, w = CASES[case] if device.type == "cuda" else (8, 8)
    gen = torch.Generator().manual_seed(0)

    def clip(t: int, scale: int) -> torch.Tensor:
        return torch.randn(2, channels, t, h // scale, w // scale, generator=gen).to(device, dtype)

    mask = torch.zeros(2, TEXT_LEN, dtype=torch.int64)
    for item, valid in enumerate(TEXT_VALID):
        mask[item, :valid] = 1
    return {
        "sample": [[clip(4, 4), clip(4, 2), clip(1, 1), clip(1, 1)]],
        "encoder_hidden_states": torch.randn(2, TEXT_LEN, text_dim, generator=gen).to(device, dtype),
        "encoder_attention_mask": mask.to(device),
        "pooled_projections": torch.randn(2, pooled_dim, generator=gen).to(device, dtype),
        "timestep_ratio": torch.full((2,), 500.0, device=device),
        "text_lengths": list(TEXT_VALID),
    }


def kernel_sources(cache_dir: Path, names: list[str]) -> str:
    """The generated source of each named kernel (first found) in Inductor's cache, with its notes."""
    found: dict[str, str] = {}
    for path in sorted(cache_dir.rglob("*.py")):
        text = path.read_text(errors="replace")
        for name in names:
            if name in found:
                continue
            match = re.search(rf"{name} = async_compile\.triton\('{name}', '''(.*?)'''", text, re.S)
            if match:
                notes = re.findall(rf"# kernel path: .*?\n((?:#.*\n)*){name} =", text)
                found[name] = (notes[0] if notes else "") + match.group(1)
    return "\n\n".join(f"##### {n}\n{found.get(n, '(not found)')}" for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--case", default="gen768", choices=sorted(CASES))
    parser.add_argument(
        "--modes",
        default="dynamic,static,automatic",
        help="compiled blocks: dynamic shapes, static shapes, automatic (static, then dynamic where sizes change)",
    )
    parser.add_argument("--calls", type=int, default=5, help="profiled calls per mode")
    parser.add_argument(
        "--kernel-source", default=None, help="write the costliest compiled kernels' source here"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from bench_generate import REAL_VAE, build_components
    from kernel_profile import kernel_breakdown, print_breakdown

    from pfctl.models.fast import FastPaths, apply_fast_paths

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    components, (params, _) = build_components(
        "miniflux" if cuda else "tiny", REAL_VAE, device, dtype, seed=0
    )
    dit = components.dit
    dit.set_attention_backend("auto", skip_future_keys=True)
    cfg = dit.config
    widths = (cfg.in_channels // 4, cfg.joint_attention_dim, cfg.pooled_projection_dim)
    inputs = call_inputs(args.case, *widths, device, dtype)
    results = {"case": args.case, "dit_params": params, "modes": {}}
    sources = []
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        cache_dir = Path(tempfile.mkdtemp(prefix=f"pfctl-inductor-{mode}-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # this mode's kernels only (read per compile)
        dynamic = {"dynamic": True, "static": False, "automatic": None}[mode]
        apply_fast_paths(dit, FastPaths(compile=True, dynamic=dynamic))
        t0 = time.perf_counter()
        with torch.no_grad():
            if (
                mode == "automatic"
            ):  # compiled static first, then recompiled with the sizes that changed dynamic
                dit(**call_inputs("gen384" if args.case != "gen384" else "gen768", *widths, device, dtype))
            for _ in range(2):
                dit(**inputs)
        if cuda:
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        with torch.no_grad():
            profile = kernel_breakdown(lambda: dit(**inputs), repeats=args.calls, top=15) if cuda else None
        results["modes"][mode] = {"first_two_calls_s": first, "profile": profile}
        print(f"{mode} shapes: first two calls {first:.1f} s")
        if profile:
            print_breakdown(f"{args.case}, blocks compiled with {mode} shapes, per call", profile)
            names = [row["kernel"] for row in profile["top_kernels"] if row["kernel"].startswith("triton_")]
            sources.append(f"######## {mode} shapes\n{kernel_sources(cache_dir, names[:6])}")
    if args.kernel_source and sources:
        Path(args.kernel_source).write_text("\n\n".join(sources))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
