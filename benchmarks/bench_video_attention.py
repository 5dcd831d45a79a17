"""The attention of a whole ``pfctl generate`` video, call by call: which row-group setting is fastest?

The sampler is run with a stand-in DiT that records every call's column (the clips' token grids: the
history at each stage's resolution, then the clip being denoised), so the layouts are exactly the ones a
video goes through. Each distinct layout's attention is then timed with pfctl's own attention function
(``masked_attention`` with the row groups ``skip_future_keys`` builds; miniFLUX's 30 heads x 64, CFG pair,
left-aligned text of 24 and 1 valid tokens as a prompt and the empty negative prompt), replayed as a CUDA
graph as the sampler replays its calls, and the times are summed over the video's calls and the DiT's 24
attention layers.

Settings are ``MIN_TOKENS:MIN_ROWS``: columns of ``MIN_TOKENS``+ tokens are attended in row groups that
close at ``MIN_ROWS`` rows (``generate.row_group_min_tokens`` and ``ROW_GROUP_MIN_ROWS``); ``none`` is one
masked call for every column. Each setting's output is compared with the first setting's. On the CPU every
resolution runs at a tiny 8x16 latent (a check of the harness, not a measurement).

    python benchmarks/bench_video_attention.py --device cuda --resolutions 768p,384p \\
        --settings none,6144:1024,0:1024,0:512
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pfctl.models import attention_layout as dc  # noqa: E402
from pfctl.models.registry import preset_config  # noqa: E402
from pfctl.models.text_embeddings import TextEmbeddings  # noqa: E402
from pfctl.sampling.sampler import TextConditioning, generate_latents  # noqa: E402

RESOLUTIONS = {"768p": (96, 160), "384p": (48, 80)}  # latent height, width
TEXT_VALID = (1, 24)  # [negative, positive] valid text tokens, as the sampler batches a CFG pair
TEXT_LEN = max(TEXT_VALID)  # the text as the DiT cuts it (to its longest row)
Grids = tuple[tuple[int, int, int], ...]


def video_columns(height: int, width: int, temp: int) -> collections.Counter[Grids]:
    """How often each column layout (token grids ``(t, h, w)`` of its clips) occurs in one t2v video."""
    calls: collections.Counter[Grids] = collections.Counter()

    def record(sample: list[list[torch.Tensor]], **_: object) -> list[torch.Tensor]:
        clips = sample[0]
        calls[tuple((c.shape[2], c.shape[3] // 2, c.shape[4] // 2) for c in clips)] += 1
        return [torch.zeros_like(clips[-1])]

    embeds, mask, pooled = torch.zeros(1, 4, 4), torch.ones(1, 4, dtype=torch.int64), torch.zeros(1, 4)
    text = TextConditioning(TextEmbeddings(embeds, mask, pooled), TextEmbeddings(embeds, mask, pooled))
    generate_latents(record, text, temp=temp, height=height, width=width, latent_channels=1, device="cpu")
    return calls


def parse_setting(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    min_tokens, min_rows = text.split(":")
    return int(min_tokens), int(min_rows)


def graph_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Milliseconds per call of ``fn``: a CUDA graph of ``repeats`` calls replayed (eager on the CPU)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        begin = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - begin) * 1e3 / repeats
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / (3 * repeats)


def measure(
    resolution: str,
    settings: list[str],
    device: torch.device,
    temp: int,
    heads: int,
    head_dim: int,
    layers: int,
) -> dict:
    height, width = RESOLUTIONS[resolution] if device.type == "cuda" else (8, 16)
    columns = video_columns(height, width, temp)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    starts = [TEXT_LEN - n for n in TEXT_VALID]
    seconds = dict.fromkeys(settings, 0.0)
    worst = dict.fromkeys(settings, 0.0)
    gen = torch.Generator(device=device).manual_seed(0)
    for grids, count in columns.items():
        size = TEXT_LEN + sum(t * h * w for t, h, w in grids)
        q, k, v = (
            torch.randn(2, size, heads, head_dim, generator=gen, device=device, dtype=dtype) for _ in range(3)
        )
        valid = torch.zeros(2, TEXT_LEN, dtype=torch.bool, device=device)
        for item, start in enumerate(starts):
            valid[item, start:] = True
        mask = dc.padded_attention_bias(valid, [dc.clip_frame_ids(list(grids), device)], 1, True, dtype)[0]
        real = valid.new_ones(2, size)  # rows that are real tokens (text padding rows differ by design)
        real[:, :TEXT_LEN] = valid
        first = None
        for setting in settings:
            parsed = parse_setting(setting)
            groups = None if parsed is None else dc.column_row_groups(TEXT_LEN, grids, starts, *parsed)

            attend = functools.partial(dc.masked_attention, q, k, v, mask, "cudnn", groups)

            out = attend().float()[real]
            first = out if first is None else first
            worst[setting] = max(worst[setting], float((out - first).norm() / first.norm()))
            seconds[setting] += graph_ms(attend, device, 4) * count * layers / 1e3
    return {
        "calls": sum(columns.values()),
        "layouts": len(columns),
        "seconds_per_video": seconds,
        "rel_l2_vs_first": worst,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--resolutions", default="768p,384p")
    parser.add_argument("--settings", default="none,6144:1024,0:1024,0:512")
    parser.add_argument("--temp", type=int, default=16, help="latent frames (16: a 5 s video)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    config = preset_config("miniflux")
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    layers = config["num_layers"] + config["num_single_layers"]
    settings = args.settings.split(",")
    results = {
        res: measure(res, settings, device, args.temp, heads, head_dim, layers)
        for res in args.resolutions.split(",")
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\nattention of one video ({layers} layers x {heads} heads x {head_dim}, CFG pair), {gpu}")
    print(f"{'video':>6} {'calls':>6} {'setting':>11} {'seconds':>8} {'rel. L2':>8}")
    for res, row in results.items():
        for setting in settings:
            print(
                f"{res:>6} {row['calls']:>6} {setting:>11} {row['seconds_per_video'][setting]:>8.2f} "
                f"{row['rel_l2_vs_first'][setting]:>8.1e}"
            )


if __name__ == "__main__":
    main()
