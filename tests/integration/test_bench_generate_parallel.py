"""``benchmarks/bench_generate_parallel.py --processes`` on the CPU: one video sampled by 1 and 2 real processes
(gloo, tiny models): the same video, the layout each run recorded, the table last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_generate_parallel.py"


@pytest.mark.slow
def test_processes_mode_compares_the_same_video_across_process_counts(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--processes", "1,2", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["processes"], r["layout"]["world_size"], r["layout"]["cfg"]) for r in rows] == [
        (1, 1, 1),
        (2, 2, 2),
    ]
    assert rows[0]["latents_relative_l2"] == 0.0
    # the same weights, prompt and seed: fp32 rounding apart (~1e-6 here); another video is O(1) away
    assert rows[1]["latents_relative_l2"] < 1e-3
    assert all(r["timing_s"]["sample"] > 0 for r in rows)
    lines = done.stdout.strip().splitlines()
    assert lines[-3].split()[0] == "processes" and [line.split()[0] for line in lines[-2:]] == ["1", "2"]
