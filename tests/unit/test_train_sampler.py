"""The sync-group sampler: group-shared choices, disjoint shards, agreed replacements, resumable."""

from __future__ import annotations

import pytest

from pfctl.data.dataset import ClipInfo, SyncGroupSampler, resolve_batch
from pfctl.errors import CacheError


def clips(lengths: dict[int, int], hw: int = 8) -> list[ClipInfo]:
    out = []
    for t, n in lengths.items():
        out += [ClipInfo(f"t{t}-{i:02d}", t, hw, hw) for i in range(n)]
    return out


def sampler(
    group: int, groups: int = 2, *, data=None, seed: int = 7, batch: int = 4, **kw
) -> SyncGroupSampler:
    return SyncGroupSampler(
        data or clips({8: 12, 5: 12, 1: 8}),
        num_groups=groups,
        group_index=group,
        batch_size=batch,
        seed=seed,
        max_units=8,
        **kw,
    )


def draw(s: SyncGroupSampler, steps: int, bad: frozenset[str] = frozenset()) -> list[list[str]]:
    return [resolve_batch(s, i, lambda ids: [c not in bad for c in ids], 0.1).ids for i in range(steps)]


def test_ranks_of_a_group_draw_the_same_batches() -> None:
    # two "ranks" of group 1 each own a sampler: they must agree without talking
    assert draw(sampler(1), 20) == draw(sampler(1), 20)


def test_groups_are_disjoint_within_an_epoch() -> None:
    a, b = sampler(0), sampler(1)
    assert set(a.shard(0)).isdisjoint(b.shard(0))
    assert sorted(a.shard(0) + b.shard(0)) == sorted(c.id for c in a.clips)
    seen_a = {cid for batch in draw(a, 3) for cid in batch}
    seen_b = {cid for batch in draw(b, 3) for cid in batch}
    assert seen_a.isdisjoint(seen_b)


def test_batches_have_one_length_and_different_seeds_differ() -> None:
    s = sampler(0)
    for i in range(15):
        choice = s.next_batch(i)
        assert len({s.by_id[c].bucket(8) for c in choice.ids}) == 1
        assert choice.bucket[0] == s.by_id[choice.ids[0]].num_latent_frames
    assert draw(sampler(0, seed=1), 6) != draw(sampler(0, seed=2), 6)


def test_clips_longer_than_max_units_share_the_cut_bucket() -> None:
    s = sampler(0, groups=1, data=clips({8: 4, 12: 4}), batch=8)
    choice = s.next_batch(0)
    assert choice.bucket == (8, 8, 8) and len(choice.ids) == 8


def test_failed_clip_is_replaced_identically_in_the_group() -> None:
    first = sampler(0).next_batch(0).ids
    bad = frozenset({first[1]})
    x = [resolve_batch(sampler(0), 0, lambda ids: [c not in bad for c in ids], 0.0) for _ in range(2)]
    assert x[0].ids == x[1].ids
    assert x[0].ids[1] != first[1] and x[0].replaced == {1: [first[1]]}
    bucket = sampler(0).by_id[first[1]].bucket(8)
    assert sampler(0).by_id[x[0].ids[1]].bucket(8) == bucket


def test_unloadable_cache_gives_a_clear_error() -> None:
    everything = frozenset(c.id for c in clips({8: 12, 5: 12, 1: 8}))
    with pytest.raises(CacheError, match="replacement clips in a row failed"):
        draw(sampler(0), 1, everything)


def test_caption_dropout_is_group_shared_and_about_the_rate() -> None:
    s = sampler(0)
    rows = [s.caption_dropout(i, 0.25) for i in range(400)]
    assert rows == [sampler(0).caption_dropout(i, 0.25) for i in range(400)]
    rate = sum(map(sum, rows)) / (400 * 4)
    assert 0.2 < rate < 0.3
    assert not any(map(any, (s.caption_dropout(i, 0.0) for i in range(50))))


def test_state_dict_resumes_the_same_sequence() -> None:
    full = draw(sampler(1), 12)
    s = sampler(1)
    draw(s, 5)
    state = s.state_dict()
    t = sampler(1)
    t.load_state_dict(state)
    rest = [resolve_batch(t, i, lambda ids: [True] * len(ids), 0.1).ids for i in range(5, 12)]
    assert rest == full[5:]


def test_image_ratio_mixes_images_by_ratio() -> None:
    data = clips({1: 400, 8: 400})
    only_images = sampler(0, groups=1, data=data, image_ratio=1.0)
    assert all(only_images.next_batch(i).bucket[0] == 1 for i in range(20))
    half = sampler(0, groups=1, data=data, image_ratio=0.5)
    share = sum(half.next_batch(i).bucket[0] == 1 for i in range(100)) / 100
    assert 0.3 < share < 0.7


def test_shard_too_small_for_a_batch() -> None:
    with pytest.raises(CacheError, match="batch_size=4"):
        sampler(0, groups=4, data=clips({8: 6})).next_batch(0)


def test_clip_latent_samples_the_whole_clip_then_keeps_the_first_frames() -> None:
    """mean + std * eps with eps drawn for the whole stored clip: a shorter bucket sees the same first
    frames as a longer one, written into the batch row in float32 (the bf16 inputs read as they are)."""
    import torch

    from pfctl.data.dataset import clip_latent

    gen = torch.Generator().manual_seed(1)
    entry = {
        "latent_mean": torch.randn(4, 9, 3, 5).bfloat16(),
        "latent_std": torch.rand(4, 9, 3, 5).bfloat16(),
    }
    eps = torch.randn(4, 9, 3, 5, generator=torch.Generator().manual_seed(7))
    expected = entry["latent_mean"].float() + entry["latent_std"].float() * eps
    full = clip_latent(entry, torch.Generator().manual_seed(7))
    row = torch.empty(4, 5, 3, 5)
    assert clip_latent(entry, torch.Generator().manual_seed(7), 5, out=row) is row
    assert full.dtype == torch.float32 and torch.equal(full, expected) and torch.equal(row, expected[:, :5])
    assert torch.equal(
        clip_latent({"latent_sample": entry["latent_mean"]}, gen, 2), entry["latent_mean"][:, :2].float()
    )
    assert torch.equal(clip_latent({"latent_mean": entry["latent_mean"]}, gen), entry["latent_mean"].float())
