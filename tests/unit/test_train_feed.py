"""The trainer's batch feed: a prefetched batch is assembled on the feed's thread and equals the batch the
loader builds in one call; until it is used, the data position before its draw is what a checkpoint keeps."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetched_batches_are_assembled_off_the_main_thread_and_equal_loaded_ones(
    tmp_path: Path, depth: int
) -> None:
    """``depth`` micro-steps loaded ahead (1: the next one; 3: as merged micro-batches do, every micro-step of the
    next step): each batch equals the one the loader builds in one call, in order, and a checkpoint taken
    meanwhile records the data position before the first batch still waiting."""
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
        feed.prefetch_through(step, step + depth)
        assert [a.micro_step for a in feed.ahead] == list(range(step + 1, step + depth + 1))
        assert feed.position() == direct.sampler.state_dict()  # a resumed run draws step + 1 next
        assert got.ids == expected.ids and got.dropped == expected.dropped
        for name in ("latents", "prompt_embeds", "prompt_attention_mask", "pooled_prompt_embeds"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (step, name)
        assert got.text_lengths is not None
    for ahead in feed.ahead:  # the last prefetches assemble in the background: wait before counting
        ahead.batch.result()
    assert threads[0] == threading.current_thread().name
    assert all(name.startswith("pfctl-batch") for name in threads[1:]) and len(threads) == 4 + depth
    with pytest.raises(RuntimeError, match="micro-step 6 was asked for, 4 is next"):
        feed.next_batch(6)


def test_merged_text_rows_follow_the_merged_columns() -> None:
    """The text rows of micro-batches merged into one DiT call (3 columns x 2 samples each): row ``b*6 + k'`` is
    micro-batch ``k' // 3``'s row ``b*3 + k' % 3`` (:func:`pfctl.flow.pyramid.merged_row_order`), valid lengths
    alike; a shorter text is right-padded, its padding masked out."""
    from pfctl.data.dataset import TrainBatch
    from pfctl.flow.pyramid import merged_row_order
    from pfctl.training.data import merged_text_rows

    def batch(first: int, width: int) -> TrainBatch:
        rows = torch.arange(first, first + 6, dtype=torch.float32)
        return TrainBatch(
            step=0, ids=[], latents=torch.zeros(6, 1, 1, 1, 1), dropped=[False] * 6, replaced={}, bucket=(1, 1, 1),
            epoch=0, prompt_embeds=rows[:, None, None].expand(6, width, 2).clone(),
            prompt_attention_mask=torch.ones(6, width, dtype=torch.long), pooled_prompt_embeds=rows[:, None] * 10,
            text_lengths=[int(r) % 4 + 1 for r in rows],
        )  # fmt: skip

    a, b = batch(0, 5), batch(6, 4)
    merged = merged_text_rows([a, b], columns=3)
    order = merged_row_order([3, 3], per_column=2)
    assert order == [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]
    assert merged.pooled_prompt_embeds[:, 0].tolist() == [10.0 * i for i in order]
    assert merged.prompt_embeds[:, 0, 0].tolist() == [float(i) for i in order]
    assert merged.text_lengths == [i % 4 + 1 for i in order]
    assert merged.prompt_embeds.shape == (12, 5, 2) and merged.prompt_attention_mask.shape == (12, 5)
    from_b = torch.tensor([i >= 6 for i in order])
    assert torch.equal(merged.prompt_attention_mask[:, 4] == 0, from_b)  # b's padding column, masked
    assert not merged.prompt_embeds[from_b, 4].any()
