"""``plan_sync_groups``: the one validator of the sync-group layout (W % G, M % G), as a table."""

from __future__ import annotations

import pytest

from pfctl.config import load_config
from pfctl.config.train import check_train_constraints
from pfctl.errors import ConfigError
from pfctl.flow.pyramid import plan_stage_lengths, sample_stage_length
from pfctl.runtime.sync_groups import plan_sync_groups

# (W, G, M) → (groups, positions of each rank by turn)
VALID = [
    (1, 1, None, [[0]], [[]]),
    (4, 1, None, [[0], [1], [2], [3]], [[], [], [], []]),
    (4, 2, None, [[0, 1], [2, 3]], [[], [], [], []]),
    (1, 1, 3, [[0]], [[1, 2, 3]]),
    (2, 2, 2, [[0, 1]], [[1], [2]]),
    (4, 2, 4, [[0, 1], [2, 3]], [[1, 3], [2, 4], [1, 3], [2, 4]]),
    (6, 3, 6, [[0, 1, 2], [3, 4, 5]], [[1, 4], [2, 5], [3, 6], [1, 4], [2, 5], [3, 6]]),
    (8, 4, 4, [[0, 1, 2, 3], [4, 5, 6, 7]], [[1], [2], [3], [4]] * 2),
]

# (W, G, M) → words the one-line error must contain
INVALID = [
    (0, 1, None, "world size must be >= 1"),
    (4, 0, None, "train.video_sync_group must be >= 1"),
    (4, 3, None, "world size 4 is not divisible by train.video_sync_group 3"),
    (2, 4, 8, "world size 2 is not divisible by train.video_sync_group 4"),
    (4, 4, 2, "train.video_sync_group 4 is larger than train.max_units 2"),
    (6, 3, 16, "train.max_units 16 is not divisible by train.video_sync_group 3"),
    (4, 2, 0, "train.max_units 0"),
]


@pytest.mark.parametrize(("world", "group", "units", "groups", "positions"), VALID)
def test_valid_layouts(world, group, units, groups, positions) -> None:
    plan = plan_sync_groups(world, group, units)
    assert plan.groups == groups and plan.num_groups == len(groups)
    assert [plan.positions(r) for r in range(world)] == positions
    for rank in range(world):
        assert rank in plan.groups[plan.group_index(rank)]
        assert plan.groups[plan.group_index(rank)][plan.rank_in_group(rank)] == rank
    if units is not None:  # a group covers the positions 1..M exactly once
        for ranks in plan.groups:
            assert sorted(p for r in ranks for p in plan.positions(r)) == list(range(1, units + 1))
        # the unit allocation trains these positions at full resolution, turn after turn
        for rank in range(world):
            highs = {sample_stage_length(c, rank, group, units)[2] for c in range(plan.turns)}
            assert highs == set(plan.positions(rank))


@pytest.mark.parametrize(("world", "group", "units", "words"), INVALID)
def test_invalid_layouts(world, group, units, words) -> None:
    with pytest.raises(ConfigError) as err:
        plan_sync_groups(world, group, units)
    assert words in err.value.message and err.value.exit_code == 2
    assert "\n" not in err.value.message and err.value.hint


@pytest.mark.parametrize(("world", "group", "units", "words"), [e for e in INVALID if e[2] and e[1] >= 1])
def test_config_check_and_unit_allocation_give_the_validators_error(world, group, units, words) -> None:
    """The config check and the flow's unit allocation refuse with the validator's own message."""
    overrides = [f"train.video_sync_group={group}", f"train.max_units={units}", "train.batch_size=4"]
    with pytest.raises(ConfigError) as err:
        check_train_constraints(load_config(None, overrides).train, world)
    assert err.value.message == _message(world, group, units)
    if world % group == 0:  # the M rule alone
        with pytest.raises(ConfigError) as err:
            plan_stage_lengths(units, group)
        assert err.value.message == _message(world, group, units)


def _message(world: int, group: int, units: int) -> str:
    with pytest.raises(ConfigError) as err:
        plan_sync_groups(world, group, units)
    return err.value.message


def test_config_check_returns_the_plan() -> None:
    train = load_config(None, ["train.video_sync_group=2", "train.max_units=4", "train.batch_size=4"]).train
    assert check_train_constraints(train, 4) == plan_sync_groups(4, 2, 4)
