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


def _accepted(entry) -> bool:
    """pfctl's rule (``plan_stage_lengths``): 1 <= G <= M and G divides M. Whether the reference computed
    numbers for an entry (it does for some G that do not divide M) or marked it valid does not decide it."""
    m, g = _max_units(entry), entry["video_sync_group"]
    return 1 <= g <= m and m % g == 0


def _has_numbers(entry) -> bool:
    """The reference produced every call's units (no recorded ``error``, no ``null``)."""
    results = entry.get("results", {})
    return "error" not in entry and all(v is not None for calls in results.values() for v in calls)


def test_valid_entries_match_exactly(refdir):
    if not _check_accepted(_entries(refdir)):
        pytest.skip("no entry of this vector set is one pfctl accepts with reference numbers")


def _check_accepted(entries: list[dict]) -> int:
    """Every entry pfctl accepts and the reference computed gives the reference's units; returns the count."""
    checked = 0
    for entry in entries:
        if not (_accepted(entry) and _has_numbers(entry)):
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
    return checked


def test_invalid_entries_raise_config_error(refdir):
    if not _check_refused(_entries(refdir)):
        pytest.skip("no entry of this vector set is one pfctl refuses")


def _check_refused(entries: list[dict]) -> int:
    """Entries pfctl refuses are refused before any work, whatever the reference recorded for them (it
    computes numbers for some G that do not divide M); returns the count."""
    refused = [e for e in entries if not _accepted(e)]
    for entry in refused:
        m, g = _max_units(entry), entry["video_sync_group"]
        with pytest.raises(ConfigError) as err:
            plan_stage_lengths(m, g)
        assert str(g) in err.value.message and str(m) in err.value.message
        assert err.value.exit_code == 2
        for key in entry.get("results", {}):
            clip_units, rank = _parse_key(key)
            with pytest.raises(ConfigError):
                sample_stage_length(0, rank, g, m, clip_units)
    return len(refused)


def test_a_set_with_numbers_for_refused_entries():
    """Another vector set in the same format: the reference's numbers for G=5, M=12 (refused) are not
    read, the accepted G=3 entry is checked (its numbers here from the documented rule)."""

    def entry(m: int, g: int, calls: list[list[int]]) -> dict:
        results = {f"max_units={m}|rank={r}": calls for r in (0, g)}
        return {"max_temporal_length": m, "frame_per_unit": 1, "video_sync_group": g, "valid_in_trainer": True,
                "num_calls": len(calls), "results": results}  # fmt: skip

    turns = [(c + 1) % 4 for c in range(6)]  # M // G = 4 turns, call 0 uses turn 1
    accepted = entry(12, 3, [[12 - 3 * t, 12 - 3 * t, 1 + 3 * t] for t in turns])
    refused = entry(12, 5, [[7, 7, 6]] * 4)
    assert _check_accepted([accepted, refused]) == 2 * 6
    assert _check_refused([accepted, refused]) == 1


def test_group_not_dividing_max_units_is_rejected():
    with pytest.raises(ConfigError, match="not a multiple"):
        plan_stage_lengths(16, 3)


def test_first_call_uses_turn_one():
    """``counter`` is the 0-based call index; the reference increments before use, so call 0 trains turn 1
    (high position 1 + G, low = mid = M + 1 - high) and the cycle's last call, M // G - 1, turn 0."""
    m, g = 12, 3  # any G dividing M
    assert sample_stage_length(0, 0, g, m) == (m - g, m - g, 1 + g)
    assert sample_stage_length(m // g - 1, 0, g, m) == (m, m, 1)
    assert sample_stage_length(m // g, 0, g, m) == sample_stage_length(0, 0, g, m)  # turns cycle
