"""The trainer's garbage collection at step boundaries (pfctl.runtime.collector)."""

from __future__ import annotations

import gc
import weakref

import pytest

from pfctl.runtime.collector import Collector


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


def _churn() -> None:
    """Allocate and drop far more container objects than Python's first automatic threshold."""
    for _ in range(50):
        junk = [[i] for i in range(1000)]
        del junk


@pytest.fixture(autouse=True)
def _gc_restored():
    enabled = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if enabled else gc.disable)()


def test_cycles_are_collected_at_step_boundaries_only() -> None:
    collector = Collector(every=3)
    try:
        assert not gc.isenabled()
        compiled = _cycle()  # garbage of the warm-up (the compilation's, in a real run)
        _churn()
        assert compiled() is not None  # no automatic pass freed it
        assert collector.after_step(1, warm=False) == 0 and compiled() is not None
        assert collector.after_step(2, warm=True) > 0 and compiled() is None  # the warm-up's end: everything
        later = _cycle()
        collector.after_step(4, warm=True)
        collector.after_step(5, warm=True)
        assert later() is not None
        collector.after_step(6, warm=True)  # every 3 steps: the young generations
        assert later() is None
    finally:
        collector.close()
    assert gc.isenabled()
    collector.close()  # idempotent
    assert gc.isenabled()


def test_zero_leaves_pythons_automatic_collection_alone() -> None:
    collector = Collector(every=0)
    assert gc.isenabled()
    dropped = _cycle()
    _churn()
    gc.collect()
    assert dropped() is None
    assert collector.after_step(50, warm=True) == 0
    collector.close()
    assert gc.isenabled()


def test_close_keeps_collection_off_where_it_was_off() -> None:
    gc.disable()
    collector = Collector(every=5)
    collector.close()
    assert not gc.isenabled()
