"""``sample_stage_length`` vs every entry of ``sample_stage_length.json``."""

from __future__ import annotations

import json

import pytest

from pfctl.errors import ConfigError
from pfctl.flow.pyramid import plan_stage_lengths, sample_stage_length

pytestmark = pytest.mark.parity


def _entries(refdir):
    return json.loads((refdir / "sample_stage_length.json").read_text())["table"]


def _max_units(entry) -> int:
    return 1 + (entry["max_temporal_length"] - 1) // entry["frame_per_unit"]


def _parse_key(key: str) -> tuple[int, int]:
    fields = dict(part.split("=") for part in key.split("|"))
    return int(fields["max_units"]), int(fields["rank"])


def _is_valid(entry) -> bool:
    m, g = _max_units(entry), entry["video_sync_group"]
    return bool(entry.get("valid_in_trainer", True)) and "error" not in entry and g <= m and m % g == 0


def test_valid_entries_match_exactly(refdir):
    checked = 0
    for entry in _entries(refdir):
        if not _is_valid(entry):
            continue
        m, g = _max_units(entry), entry["video_sync_group"]
        plan_stage_lengths(m, g)  # accepted by the trainer's check
        for key, calls in entry["results"].items():
            clip_units, rank = _parse_key(key)
            assert len(calls) == entry["num_calls"]
            for counter, expected in enumerate(calls):
                got = sample_stage_length(counter, rank, g, m, clip_units)
                assert list(got) == expected, (entry["max_temporal_length"], g, key, counter)
                checked += 1
    assert checked > 0


def test_invalid_entries_raise_config_error(refdir):
    invalid = [e for e in _entries(refdir) if not _is_valid(e)]
    for entry in invalid:
        m, g = _max_units(entry), entry["video_sync_group"]
        assert all(v is None for calls in entry["results"].values() for v in calls)
        with pytest.raises(ConfigError) as err:
            plan_stage_lengths(m, g)
        assert str(g) in err.value.message and str(m) in err.value.message
        assert err.value.exit_code == 2
        for key in entry["results"]:
            clip_units, rank = _parse_key(key)
            with pytest.raises(ConfigError):
                sample_stage_length(0, rank, g, m, clip_units)


def test_group_not_dividing_max_units_is_rejected():
    with pytest.raises(ConfigError, match="not a multiple"):
        plan_stage_lengths(16, 3)


def test_first_call_uses_turn_one():
    # counter is the 0-based call index; the reference increments before use.
    assert sample_stage_length(0, 0, 4, 16) == (12, 12, 5)
    assert sample_stage_length(3, 0, 4, 16) == (16, 16, 1)
