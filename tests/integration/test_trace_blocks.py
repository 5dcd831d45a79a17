"""``benchmarks/trace_blocks.py`` on the CPU: the merged step's columns under ``flex`` trace three block
graphs (double, single, last single), each with a forward and a backward, and the table is printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trace_blocks.py"


@pytest.mark.slow
def test_trace_blocks_counts_the_graphs_of_a_merged_flex_step() -> None:
    cmd = [sys.executable, str(SCRIPT), "--attention", "flex", "--micro-batches", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    attention, columns, dynamo, forward, backward, seconds = done.stdout.strip().splitlines()[-1].split()
    assert (attention, columns) == ("flex", "8")  # two micro-batches of the recipe's four columns
    assert all(len(nodes.split("/")) == 3 for nodes in (dynamo, forward, backward))
    assert float(seconds) > 0
