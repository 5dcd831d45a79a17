"""``benchmarks/bench_train_attention.py`` on the CPU: the calls each row-group setting makes, the same
attention and gradients for all, the table last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.tolerance import rounding_rtol

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_attention.py"


def test_bench_compares_row_group_settings(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    cmd = [
        sys.executable, str(SCRIPT), "--device", "cpu", "--settings", "0:512,0:512:op,0:1,6144:512",
        "--max-units", "4",
        "--repeats", "1", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    # one call per short column, one per frame with one frame a group; the operator makes the same calls
    assert rows["6144:512"]["calls_per_forward"] == 4 < rows["0:1"]["calls_per_forward"]
    assert rows["0:512:op"]["calls_per_forward"] == rows["0:512"]["calls_per_forward"]
    for row in rows.values():
        assert row["total_ms"] >= row["host_ms"] > 0
        # float32, the same attention up to summation order: sums over fewer than 1,024 keys, forward and backward
        assert row["rel_l2_vs_first"] < rounding_rtol(1024, depth=2)
    assert done.stdout.strip().splitlines()[-1].split()[0] == "6144:512"  # the table is last
