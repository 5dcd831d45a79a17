"""Recompute schedule on two real processes (gloo on the CPU): each rank holds its time shard, GroupNorm
sums are all-reduced once per norm, causal-conv halos (and HunyuanVideo's attention keys and values) go
from rank 0 to rank 1. The ranks keep different checkpoints, so the halos of finished stages must be
reused rather than sent again."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

from helpers.ranks import record_errors, run_ranks
from helpers.tolerance import assert_rounding_close
from pfctl.models.diffusers_vae import load_diffusers_vae
from pfctl.verify.synthetic import synthetic_clip

FRAMES, SIZE, CHUNK = 17, 16, 4
MODELS = ("cogvideox-tiny", "hunyuan-tiny")
BUDGETS = (sys.maxsize, 0)
"""Checkpoint bytes per rank: rank 0 keeps whole-shard checkpoints, rank 1 recomputes from its input."""


def _rank(rank: int, world: int, port: int, out: Path) -> None:
    """One rank: the recompute encode of its time shard for each tiny model; rank 0 saves the gathered
    moments and every rank its number of all-reduces. Runs in a forked child."""
    import torch.distributed as dist

    from pfctl.models.exact_chunked import distributed_exchange, shard_frames
    from pfctl.models.exact_recompute import exact_recompute_encode

    with record_errors(rank, out):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        reduce_fn, halo = distributed_exchange(torch.device("cpu"), torch.float32)
        for name in MODELS:
            vae = load_diffusers_vae(name)
            sizes = shard_frames(FRAMES, world, vae.chunk_align())
            start = sum(sizes[:rank])
            shard = synthetic_clip(FRAMES, SIZE, SIZE).video[:, :, start : start + sizes[rank]]
            res = exact_recompute_encode(
                vae,
                shard,
                vae.chunk_plan(sizes[rank], CHUNK),
                reduce_fn=reduce_fn,
                halo=halo,
                checkpoint_bytes=BUDGETS[rank],
            )
            parts: list | None = [None] * world if rank == 0 else None
            dist.gather_object((res.moments, res.num_reductions, res.peak_checkpoint_bytes), parts, dst=0)
            if rank == 0:
                torch.save(parts, out / f"{name}.pt")
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_two_processes_match_one_call_and_one_process(tmp_path):
    clip = synthetic_clip(FRAMES, SIZE, SIZE).video
    run_ranks(_rank, 2, tmp_path, timeout=240)

    for name in MODELS:
        vae = load_diffusers_vae(name)
        parts = torch.load(tmp_path / f"{name}.pt")
        gathered = torch.cat([m for m, _, _ in parts], dim=2)
        reductions = {n for _, n, _ in parts}
        assert len(reductions) == 1  # every rank all-reduced once per time-coupled norm, in step
        assert parts[0][2] > 0 and parts[1][2] == 0  # the two ranks really kept different checkpoints
        one_call = vae.encode_moments(clip)
        single = vae.encode_moments(clip, chunking="exact", chunk_frames=CHUNK)
        assert_rounding_close(gathered, one_call, reduction=8 * 27, depth=20)
        assert_rounding_close(gathered, single, reduction=8 * 27, depth=20)
