"""Hypothesis fuzzing: annotation and recipe parsing raise only the documented error types."""

from __future__ import annotations

from reliability import fuzz


def test_annotation_parsing_never_crashes() -> None:
    counter = fuzz.fuzz_annotations(60)
    assert not counter.bugs and counter.ok + counter.rejected > 0


def test_recipe_parsing_never_crashes() -> None:
    counter = fuzz.fuzz_recipes(60)
    assert not counter.bugs and counter.rejected > 0
