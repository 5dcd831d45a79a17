"""``generate.parallel``: the layout for a world size (pure, checked before any model is loaded)."""

from __future__ import annotations

import pytest

from pfctl.config import load_config
from pfctl.errors import ConfigError
from pfctl.models.parallel.plan import check_heads, plan_parallel


def layout(world: int, videos: int, cfg: str = "auto", sequence: int | str = "auto", guidance: bool = True):
    plan = plan_parallel(world, videos, cfg, sequence, guidance)
    return plan.data, plan.cfg, plan.sequence


def test_auto_halves_cfg_then_splits_the_sequence_then_shares_videos():
    assert layout(1, 1) == (1, 1, 1)
    assert layout(2, 1) == (1, 2, 1)  # the CFG halves on the two ranks
    assert layout(4, 1) == (1, 2, 2)  # ... and each half's tokens over two
    assert layout(2, 1, guidance=False) == (1, 1, 2)  # no guidance: the sequence takes both
    assert layout(3, 1) == (1, 1, 3)  # odd: no CFG split
    assert layout(4, 2) == (2, 2, 1)  # two videos: one per pair of ranks
    assert layout(4, 3) == (2, 2, 1)  # three: the largest divisor of 4 not above 3
    assert layout(4, 9) == (4, 1, 1)  # more videos than ranks: plain data parallel
    assert layout(4, 1, cfg="off") == (1, 1, 4)
    assert layout(4, 1, sequence=4) == (1, 1, 4)
    assert layout(4, 4, sequence=2) == (1, 2, 2)  # an explicit split: the remaining 2 ranks halve CFG


def test_places_cover_every_rank_once():
    plan = plan_parallel(8, 2, "on", 2, True)
    assert (plan.data, plan.cfg, plan.sequence) == (2, 2, 2)
    places = [plan.place(r) for r in range(8)]
    assert len(set(places)) == 8
    assert plan.sequence_ranks(1, 1) == [6, 7] and plan.cfg_ranks(1, 0) == [4, 6]
    assert plan.record() == {"world_size": 8, "data": 2, "cfg": 2, "sequence": 2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 1, "auto", 3, True), r"(?s)generate\.parallel\.sequence = 3 does not divide the world size 2.*\[1, 2\]"),
        ((3, 1, "on", "auto", True), r"generate\.parallel\.cfg = on needs an even number"),
        ((2, 1, "on", "auto", False), r"generate\.parallel\.cfg = on needs classifier-free guidance"),
        ((2, 1, "maybe", "auto", True), r"(?s)generate\.parallel\.cfg = 'maybe'.*auto, on or off"),
        ((2, 1, "auto", 0, True), r"(?s)generate\.parallel\.sequence = 0.*auto or an integer >= 1"),
    ],
)
def test_bad_layouts_name_the_key_and_the_values_allowed(args, message):
    with pytest.raises(ConfigError, match=message):
        plan_parallel(*args)


def test_heads_must_divide_by_the_sequence_split():
    check_heads(24, 4)
    with pytest.raises(ConfigError, match=r"(?s)sequence = 5 does not divide the DiT's 24 attention heads.*\[1, 2, 3, 4, 6"):
        check_heads(24, 5)


def test_config_reads_yaml_on_off_and_refuses_other_values():
    assert load_config(None, ["generate.parallel.cfg=off"]).generate.parallel.cfg == "off"
    assert load_config(None, ["generate.parallel.cfg=on"]).generate.parallel.cfg == "on"
    assert load_config(None, ["generate.parallel.sequence=2"]).generate.parallel.sequence == 2
    with pytest.raises(ConfigError, match=r"generate\.parallel\.cfg"):
        load_config(None, ["generate.parallel.cfg=sometimes"])
    with pytest.raises(ConfigError, match=r"generate\.parallel\.sequence"):
        load_config(None, ["generate.parallel.sequence=0"])
