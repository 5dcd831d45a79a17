"""The per-rank plan: unit schedule (= the reference table), token counts (= the real inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pfctl.config import load_config
from pfctl.config.train import TrainConfig, columns_to_stages
from pfctl.data.dataset import ClipInfo
from pfctl.flow.pyramid import build_full_sequence_batch, build_temporal_pyramid_batch, pyramid_latents
from pfctl.flow.scheduler import PyramidFlowScheduler
from pfctl.training.plan import column_grids, column_tokens, plan_run, stage_units


def _tokens(sample: list[list[torch.Tensor]]) -> list[int]:
    return [sum(c.shape[2] * (c.shape[3] // 2) * (c.shape[4] // 2) for c in column) for column in sample]


@pytest.mark.parametrize("units", [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 5, 4), (6, 6, 6), (4, 4, 7)])
def test_column_tokens_and_grids_equal_the_built_inputs(units: tuple[int, int, int]) -> None:
    frames, h, w = 7, 16, 24
    pyramid = pyramid_latents(torch.randn(4, 16, frames, h, w))
    flow = PyramidFlowScheduler()
    batch = build_temporal_pyramid_batch(pyramid, flow, units, rng=torch.Generator().manual_seed(0))
    expected = [column_tokens(s, units[s], frames, h, w) for s in batch.column_to_stage]
    assert _tokens(batch.sample) == expected
    grids = [[(c.shape[2], c.shape[3] // 2, c.shape[4] // 2) for c in column] for column in batch.sample]
    assert grids == [column_grids(s, units[s], h, w) for s in batch.column_to_stage]  # clips, oldest first
    full = build_full_sequence_batch(pyramid, flow, rng=torch.Generator().manual_seed(0))
    assert _tokens(full.sample) == [column_tokens(s, None, frames, h, w) for s in full.column_to_stage]


def test_units_equal_the_reference_table(refdir: Path) -> None:
    table = json.loads((refdir / "sample_stage_length.json").read_text())["table"]
    checked = 0
    for entry in table:
        if not entry["valid_in_trainer"]:
            continue
        cfg = TrainConfig(max_units=entry["max_temporal_length"], video_sync_group=entry["video_sync_group"])
        for key, calls in entry["results"].items():
            fields = dict(part.split("=") for part in key.split("|"))
            for call, expected in enumerate(calls):
                got = stage_units(cfg, call, int(fields["rank"]), int(fields["max_units"]))
                assert list(got) == expected, (entry["video_sync_group"], key, call)
                checked += 1
    assert checked > 100


def test_plan_groups_share_clips_and_split_positions() -> None:
    clips = [ClipInfo(f"c{i:02d}", 8, 8, 8) for i in range(32)]
    cfg = TrainConfig(batch_size=4, video_sync_group=4, max_units=8, grad_accum=2)
    report = plan_run(cfg, clips, world_size=8, seed=3, steps=2, can_load=lambda cid: cid != "c05")
    assert len(report.rows) == 8 * 2 * 2
    by_key: dict[tuple[int, int], list[dict]] = {}
    for row in report.rows:
        by_key.setdefault((row["micro_step"], row["group"]), []).append(row)
    for rows in by_key.values():
        assert len({tuple(r["ids"]) for r in rows}) == 1  # one batch per group
        highs = sorted(r["units"][2] for r in rows)
        assert highs == sorted({h for h in highs}) and len(highs) == 4  # each rank its own position
        assert "c05" not in rows[0]["ids"]
    for micro in range(4):
        assert set(by_key[(micro, 0)][0]["ids"]).isdisjoint(by_key[(micro, 1)][0]["ids"])
    text = report.render()
    assert "rank" in text and "tokens per sync group" in text


@pytest.mark.parametrize(
    ("overrides", "rank", "expected"),
    [
        (["train.video_sync_group=1"], 0, 16),  # one process: every unit position of M = 16
        (["train.video_sync_group=8"], 3, 2),  # G = 8: a rank cycles through M / G positions
        (["train.use_temporal_pyramid=false", "train.video_sync_group=8"], 0, 1),  # one input per bucket
    ],
)
def test_token_count_sets_are_the_inputs_a_rank_builds(
    overrides: list[str], rank: int, expected: int
) -> None:
    """The warm-up's inputs (what compiled blocks compile once each) are exactly those the rank's forwards
    cycle through, with the tokens each column's sample has."""
    from pfctl.training.plan import token_count_sets

    train = load_config("pyramid-flux-384p-8gpu", overrides).train
    bucket = (16, 48, 80)

    def clip(frames: int) -> ClipInfo:
        return ClipInfo(id=f"c{frames}", num_latent_frames=frames, height=48, width=80)

    sets = token_count_sets(train, rank, [clip(16), clip(16)])
    assert len(sets) == expected
    stages = columns_to_stages(train.sample_ratios)
    for micro_step in range(3 * train.max_units):  # several cycles: nothing new beyond the sets
        units = stage_units(train, micro_step, rank, bucket[0])
        key = (bucket, units)
        assert key in sets
        assert sets[key] == tuple(
            column_tokens(s, None if units is None else units[s], *bucket) for s in stages
        )
    shorter = token_count_sets(train, rank, [clip(3), clip(40)])  # clips shorter / longer than M
    assert {b for b, _ in shorter} == {(3, 48, 80), (16, 48, 80)}


def test_the_merged_step_is_estimated_with_every_micro_batch_at_once(tmp_path: Path) -> None:
    """``train.merge_micro_batches``: the memory estimate holds the activations of all ``grad_accum``
    micro-batches at once (and the gradients arrive during the one backward, as without accumulation); the
    dry-run's speed line names the GPU size from which ``auto`` merges, from that estimate; ``auto`` merges
    only on a GPU the estimate fits (:func:`merge_too_big`)."""
    from helpers.tiny_models import tiny_train_config
    from pfctl.data.dataset import write_synthetic_cache
    from pfctl.training.data import cache_clips, open_cache
    from pfctl.training.memory import format_bytes
    from pfctl.training.plan import MERGE_MEMORY_SHARE, dry_run, estimate_for_run, merge_too_big

    write_synthetic_cache(str(tmp_path / "cache"), [4] * 8, seed=0)
    config = tiny_train_config(tmp_path / "cache", tmp_path / "run", grad_accum=3)
    cache = open_cache(str(tmp_path / "cache"))
    clips = cache_clips(cache)
    one, merged = (estimate_for_run(config, cache, clips, merged=m) for m in (False, True))

    def activations(estimate) -> int:
        return sum(b for name, b, _ in estimate.rows if name.startswith("activations"))

    assert activations(merged) == 3 * activations(one) > 0
    assert merged.get("backward overlap") < 0 == one.get("backward overlap")
    assert merged.total > one.total
    assert any("3 micro-batches merged" in note for note in merged.notes)

    flat = "".join(" ".join(dry_run(config, world_size=1, steps=1).notes).split())
    size = format_bytes(merged.total / MERGE_MEMORY_SHARE)
    assert "".join(f"micro-batches merged on a GPU of {size} or more".split()) in flat
    assert merge_too_big(merged.total, int(merged.total / MERGE_MEMORY_SHARE) + 1) is None
    assert format_bytes(merged.total) in merge_too_big(merged.total, merged.total)


def test_every_rank_merges_its_micro_batches_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` merges where the GPU holds the merged step's estimate, and only if every rank's does (the ranks'
    collectives per forward must match): a rank whose GPU fits follows another that does not."""
    from types import SimpleNamespace

    from helpers.tiny_models import tiny_train_config
    from pfctl.data.dataset import write_synthetic_cache
    from pfctl.training.data import cache_clips, open_cache
    from pfctl.training.plan import estimate_for_run
    from pfctl.training.trainer import Trainer

    write_synthetic_cache(str(tmp_path / "cache"), [4] * 8, seed=0)
    config = tiny_train_config(tmp_path / "cache", tmp_path / "run", grad_accum=2)
    cache = open_cache(str(tmp_path / "cache"))
    peak = estimate_for_run(config, cache, cache_clips(cache), merged=True).total

    def too_big(gpu_bytes: int, other_ranks_failing: int) -> str | None:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=gpu_bytes))
        accelerator = SimpleNamespace(reduce=lambda flag, reduction: flag + other_ranks_failing)
        runtime = SimpleNamespace(device=torch.device("cpu"), world_size=2, accelerator=accelerator)
        data = SimpleNamespace(heldout=[], cache=cache)
        trainer = SimpleNamespace(data=data, config=config, runtime=runtime, training_clips=lambda: cache_clips(cache))
        return Trainer.merged_step_too_big(trainer)

    assert too_big(2 * peak, 0) is None
    assert too_big(2 * peak, 1) == "another rank's GPU cannot hold the merged step"
    assert "exceeds 90% of the GPU's" in too_big(peak, 0)
