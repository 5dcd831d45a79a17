"""Exact chunked encode on two real processes (gloo on the CPU): each rank holds half of the frames,
GroupNorm statistics are all-reduced, causal-conv halos go from rank 0 to rank 1, rank 0 gathers."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from helpers.ranks import record_errors, run_ranks
from pfctl.models.diffusers_vae import load_diffusers_vae
from pfctl.verify.synthetic import synthetic_clip

FRAMES, SIZE, CHUNK = 17, 16, 4


def _rank(rank: int, world: int, port: int, out: Path) -> None:
    """One rank: exact encode of its time shard (with offload, so that path runs too); rank 0 saves the
    gathered moments. Runs in a forked child: torch and diffusers are already imported."""
    import torch.distributed as dist

    from pfctl.models.exact_chunked import distributed_exchange, exact_chunked_encode, shard_frames

    with record_errors(rank, out):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        vae = load_diffusers_vae("cogvideox-tiny")
        sizes = shard_frames(FRAMES, world, vae.chunk_align())
        start = sum(sizes[:rank])
        shard = synthetic_clip(FRAMES, SIZE, SIZE).video[:, :, start : start + sizes[rank]]
        reduce_fn, halo = distributed_exchange(torch.device("cpu"), torch.float32)
        res = exact_chunked_encode(
            vae, shard, vae.chunk_plan(sizes[rank], CHUNK), reduce_fn=reduce_fn, halo=halo, offload_above=0
        )
        parts: list[torch.Tensor] | None = [None] * world if rank == 0 else None
        dist.gather_object(res.moments, parts, dst=0)
        if rank == 0:
            torch.save(torch.cat(parts, dim=2), out / "moments.pt")
        dist.destroy_process_group()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_two_processes_match_the_single_process_exact_encode(tmp_path):
    cog = load_diffusers_vae("cogvideox-tiny")
    clip = synthetic_clip(FRAMES, SIZE, SIZE).video
    single = cog.encode_moments(clip, chunking="exact", chunk_frames=CHUNK)
    one_call = cog.encode_moments(clip)

    run_ranks(_rank, 2, tmp_path, timeout=60)

    gathered = torch.load(tmp_path / "moments.pt")
    assert gathered.shape == single.shape
    # fp32: same chunks, same float64 sums up to their summation order → at most a few fp32 ulps
    assert float((gathered - single).norm() / single.norm()) <= 1e-6
    assert float((gathered - single).abs().max()) <= 1e-5
    assert float((gathered - one_call).norm() / one_call.norm()) <= 1e-5
