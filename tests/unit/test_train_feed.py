"""The trainer's batch feed: a prefetched batch is assembled on the feed's thread and equals the batch the
loader builds in one call; until it is used, the data position before its draw is what a checkpoint keeps."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from pfctl.data.dataset import LatentClipLoader, SyncGroupSampler, write_synthetic_cache
from pfctl.training.data import BatchFeed, TrainData, cache_clips, cache_normalizer, open_cache


def _data(root: Path) -> TrainData:
    cache = open_cache(str(root))
    sampler = SyncGroupSampler(
        cache_clips(cache), num_groups=1, group_index=0, batch_size=2, seed=3, max_units=4
    )
    loader = LatentClipLoader(cache, sampler, normalize=cache_normalizer(cache), caption_dropout=0.5)
    return TrainData(cache=cache, heldout=[], sampler=sampler, loader=loader)


def test_prefetched_batches_are_assembled_off_the_main_thread_and_equal_loaded_ones(tmp_path: Path) -> None:
    write_synthetic_cache(str(tmp_path), [4, 4, 3, 3, 4, 3], seed=0)  # posterior mean + std: sampled noise
    direct, fed = _data(tmp_path), _data(tmp_path)
    feed = BatchFeed(fed, torch.device("cpu"), skip_future_keys=True)
    threads: list[str] = []
    assemble = fed.loader._assemble

    def recorded(*args: object) -> object:
        threads.append(threading.current_thread().name)
        return assemble(*args)

    fed.loader._assemble = recorded
    for step in range(4):
        expected = direct.loader.next_batch(step)
        got = feed.next_batch(step)  # step 0: nothing prefetched yet, loaded at once on this thread
        before_draw = fed.sampler.state_dict()
        feed.prefetch(step + 1)
        assert feed.position() == before_draw  # a checkpoint now resumes at the prefetched batch
        assert got.ids == expected.ids and got.dropped == expected.dropped
        for name in ("latents", "prompt_embeds", "prompt_attention_mask", "pooled_prompt_embeds"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (step, name)
        assert got.text_lengths is not None
    feed.ahead.batch.result()  # the last prefetch assembles in the background: wait before counting
    assert threads[0] == threading.current_thread().name
    assert all(name.startswith("pfctl-batch") for name in threads[1:]) and len(threads) == 5
