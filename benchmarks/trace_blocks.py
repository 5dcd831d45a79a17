"""What tracing the compiled DiT blocks costs in a training run's first step, by attention backend and the
number of micro-batches merged into one forward.

A cold ``pfctl train`` on a GPU spends its first step compiling the block graphs (double, single and last
single block): Dynamo's trace, AOTAutograd's joint graph, then Inductor's code (benchmarks/RESULTS.md,
session 35: about 100 s at 384p). All of it is Python over the graphs' nodes and their symbolic sizes. That
work does not depend on the widths or the token counts, so this measures the first two parts on the CPU. It
uses the tiny Flux DiT, which runs the real blocks' code with 2 heads x 16. It reports the nodes of every
graph (Dynamo's, and AOTAutograd's forward and backward) and the seconds of the first training forward and
backward. Inductor's code generation is not run.

The columns are those of one rank's first forward in the 384p recipe's cycle: stages 0, 1, 1, 2, each with
its history. ``--micro-batches 2`` gives the merged step's columns (``train.merge_micro_batches``). ``flex``
needs FlexAttention's backward, which PyTorch refuses on the CPU (its compiled CPU kernel has none, though its
uncompiled one computes it). This script lifts that refusal for its own measurement only.

    python benchmarks/trace_blocks.py --attention efficient,flex --micro-batches 1,2
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pfctl.flow.pyramid import DEFAULT_SAMPLE_RATIOS, column_to_stage, plan_stage_lengths  # noqa: E402
from pfctl.models.fast import FastPaths, apply_fast_paths  # noqa: E402
from pfctl.models.registry import build_dit  # noqa: E402
from pfctl.training.plan import column_grids  # noqa: E402

LATENT = (8, 16)  # latent height, width of the top stage (token counts do not change what is traced)
TEXT_LEN = 8


def forward_inputs(model: torch.nn.Module, micro_batches: int, gen: torch.Generator) -> dict:
    """One forward's DiT inputs: the 384p recipe's first columns (max_units 16, sync group 8), repeated."""
    plan, stages = plan_stage_lengths(16, 8), column_to_stage(DEFAULT_SAMPLE_RATIOS)
    lengths = plan.lengths(0, 0)
    channels, cfg = model.config.in_channels // 4, model.config
    sample = [
        [torch.randn(1, channels, t, 2 * h, 2 * w, generator=gen) for t, h, w in column_grids(s, lengths[s], *LATENT)]
        for _ in range(micro_batches)
        for s in stages
    ]
    rows = len(sample)
    mask = torch.ones(rows, TEXT_LEN, dtype=torch.long)
    mask[::2, TEXT_LEN // 2 :] = 0  # some captions padded
    return {
        "sample": sample,
        "encoder_hidden_states": torch.randn(rows, TEXT_LEN, cfg.joint_attention_dim, generator=gen),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(rows, cfg.pooled_projection_dim, generator=gen),
        "timestep_ratio": torch.rand(rows, generator=gen) * 1000,
    }


def trace(attention: str, micro_batches: int) -> dict:
    """Nodes of each graph and seconds of the first compiled training forward and backward."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[list[int]] = []

    def count(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs[-1].append(len(gm.graph.nodes))
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=count, bw_compiler=count)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append([len(gm.graph.nodes)])
        return aot(gm, example_inputs)

    torch._dynamo.reset()
    model = build_dit("tiny", {"num_single_layers": 2}, seed=0).train()
    model.set_attention_backend(attention)
    apply_fast_paths(model, FastPaths(compile=True, compile_backend=backend, independent_sizes=True))
    args = forward_inputs(model, micro_batches, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    outs = model(**args)
    sum(o.square().mean() for o in outs).backward()
    seconds = time.perf_counter() - start
    torch._dynamo.reset()
    return {"columns": len(args["sample"]), "graphs": graphs, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", default="efficient,flex", help="train.attention values, comma-separated")
    parser.add_argument("--micro-batches", default="1,2", help="micro-batches merged into one forward")
    args = parser.parse_args()
    import torch.nn.attention.flex_attention as flex

    flex._validate_device = lambda *a: None  # the CPU backward refusal (module docstring)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    print(f"{'attention':>10} {'columns':>7} {'Dynamo nodes':>18} {'forward nodes':>18} {'backward nodes':>18} {'s':>6}")
    for attention in args.attention.split(","):
        for micro_batches in (int(n) for n in args.micro_batches.split(",")):
            row = trace(attention, micro_batches)
            dynamo, forward, backward = ("/".join(str(g[i]) for g in row["graphs"]) for i in range(3))
            print(
                f"{attention:>10} {row['columns']:>7} {dynamo:>18} {forward:>18} {backward:>18} "
                f"{row['seconds']:>6.1f}"
            )


if __name__ == "__main__":
    main()
