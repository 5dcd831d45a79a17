"""``benchmarks/bench_encode.py`` on the CPU: every row it promises, the table last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_encode.py"


@pytest.mark.slow
def test_bench_runs_end_to_end_and_prints_the_table_last() -> None:
    cmd = [
        sys.executable, str(SCRIPT), "--device", "cpu", "--clips", "3", "--frames", "9", "--size", "64x48",
        "--batch-size", "1,2", "--num-workers", "1", "--warmup-clips", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert lines[-len(table) :] == table  # the table is the last thing printed
    names = [row.split("|")[1].strip() for row in table[2:]]
    assert names == [
        "encode-latents (none, batch 1)",
        "encode-latents (none, batch 2)",
        "VAE alone, pfctl (none, batch 1)",
        "VAE alone, pfctl (none, batch 2)",
        "decode only (1 workers)",
    ]
    header = [cell.strip() for cell in table[0].split("|")[1:-1]]
    first = dict(zip(header, (cell.strip() for cell in table[2].split("|")[1:-1]), strict=True))
    assert float(first["clips/s"]) > 0 and float(first["vae s"]) > 0 and float(first["text s"]) > 0
    assert float(first["write s"]) > 0 and first["decode_wait s"]
