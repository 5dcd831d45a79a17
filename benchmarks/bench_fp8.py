"""FP8 (e4m3) matrix products for the DiT's linear layers on Hopper: does ``pfctl generate`` get faster?

Issue 29's question (item 4): is FP8 worth an option, i.e. is a 384p video at least 1.3x faster? This runs the
whole ``run_generate`` pipeline of ``bench_generate.py`` (real-size miniFLUX with random weights, the released
VAE architecture, random text features, 5 s at 384p, CUDA graphs) three times in one process:

* ``bf16``: as ``pfctl generate`` runs today;
* ``fp8 tensor``: every linear layer of the transformer blocks (not the modulation layers, whose products have
  one row per video) as ``torch._scaled_mm`` on e4m3 operands, one scale per tensor (the weight's fixed, the
  activation's taken from its absolute maximum at every call);
* ``fp8 row``: the same with one scale per row of the activation and per output channel of the weight.

The activation's quantisation is compiled (one fused pass); rows are padded to a multiple of 16 (what the FP8
product requires). Each variant makes two videos of one prompt (seeds 0 and 1; the first pays the graph
captures and compilation) and reports the later video's sampling time, the ratio to bf16, and the relative L2
of its latents against bf16's (same seed, same noise).

    python benchmarks/bench_fp8.py                  # H100 / H200 only (FP8 tensor cores)
    python benchmarks/bench_fp8.py --resolution 768p
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _quantize(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = (amax.float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).to(FP8), scale


class FP8Linear(nn.Module):
    """``linear`` with e4m3 operands: the weight quantised once, the input at every call."""

    quantize = None  # the compiled _quantize, shared by every layer

    def __init__(self, linear: nn.Linear, rowwise: bool) -> None:
        super().__init__()
        self.rowwise = rowwise
        weight = linear.weight.detach()
        w8, scale = _quantize(weight, rowwise)  # rows of the weight: output channels
        self.register_buffer("w8", w8)
        self.register_buffer("w_scale", scale.reshape(1, -1) if rowwise else scale)
        self.bias = linear.bias
        if FP8Linear.quantize is None:
            FP8Linear.quantize = torch.compile(_quantize, dynamic=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        if rows % 16:
            x2 = F.pad(x2, (0, 0, 0, 16 - rows % 16))
        x8, x_scale = FP8Linear.quantize(x2, self.rowwise)
        y = torch._scaled_mm(
            x8, self.w8.t(), scale_a=x_scale, scale_b=self.w_scale, bias=self.bias, out_dtype=x.dtype,
            use_fast_accum=True,
        )  # fmt: skip
        return y[:rows].reshape(*shape[:-1], -1)


def swap_linears(dit: nn.Module, rowwise: bool) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put :class:`FP8Linear` in place of the blocks' linear layers; returns what to put back."""
    swapped = []
    for _, block in dit.blocks_in_order():
        for path, parent in list(block.named_modules()):
            if "norm" in path:  # the modulation (norm1.linear, norm.linear, ...): one row per video
                continue
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0:
                    setattr(parent, name, FP8Linear(child, rowwise))
                    swapped.append((parent, name, child))
    return swapped


def restore(swapped: list[tuple[nn.Module, str, nn.Module]]) -> None:
    for parent, name, child in swapped:
        setattr(parent, name, child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", default="384p", choices=["384p", "768p"])
    parser.add_argument("--temp", type=int, default=16)
    parser.add_argument("--variants", default="bf16,tensor,row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("FP8 products need an Ada or Hopper GPU (compute capability 8.9+)")

    from bench_generate import REAL_VAE, build_components

    from pfctl.config import load_config
    from pfctl.config.generate import RESOLUTIONS
    from pfctl.sampling.generate import run_generate

    device, dtype = torch.device("cuda"), torch.bfloat16
    components, (dit_params, _) = build_components("miniflux", REAL_VAE, device, dtype, seed=0)
    width, height = RESOLUTIONS[args.resolution]
    config = load_config(
        None,
        [
            "runtime.device=cuda", f"generate.output_dir={tempfile.mkdtemp(prefix='pfctl-bench-fp8-')}",
            f"generate.width={width}", f"generate.height={height}", f"generate.temp={args.temp}",
            "generate.num_videos=2", "generate.seed=0", "generate.dtype=bf16", "generate.encoder_threads=0",
        ],
    )  # fmt: skip
    rows, base = [], None
    for variant in args.variants.split(","):
        swapped = swap_linears(components.dit, variant == "row") if variant != "bf16" else []
        report = run_generate(config, ["a red circle moving left"], components=components, keep_latents=True)
        restore(swapped)
        first, later = (json.loads(v.sidecar.read_text())["timing_s"] for v in report.videos)
        latents = report.videos[1].latents.float()
        if base is None:
            base = latents
        err = float((latents - base).norm() / base.norm())
        rows.append({"variant": variant, "layers": len(swapped), "first_sample_s": first["sample"],
                     "sample_s": later["sample"], "latents_rel_l2": err})  # fmt: skip
    for row in rows:
        row["speedup"] = rows[0]["sample_s"] / row["sample_s"]
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "dit_params": dit_params}, indent=2))
    print(f"\nFP8 linear layers in pfctl generate — {torch.cuda.get_device_name()}, miniFLUX "
          f"({dit_params / 1e9:.2f}B), {width}x{height}, temp {args.temp}, CUDA graphs; later video of 2")  # fmt: skip
    print(f"{'variant':>8} {'layers':>7} {'first s':>8} {'sample s':>9} {'speedup':>8} {'latents rel L2':>15}")
    for r in rows:
        print(f"{r['variant']:>8} {r['layers']:>7} {r['first_sample_s']:>8.2f} {r['sample_s']:>9.2f} "
              f"{r['speedup']:>7.2f}x {r['latents_rel_l2']:>15.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
