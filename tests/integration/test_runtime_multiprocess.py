"""The runtime in 1, 2 and 4 real CPU processes (gloo) with sync groups."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_runtime_worker.py")


def _launch(nproc: int, group_size: int, out: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(WORKER), str(group_size), str(out)]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *cmd[1:],
        ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _records(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_single_process(tmp_path: Path) -> None:
    proc = _launch(1, 1, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (rec,) = _records(tmp_path, 1)
    assert rec["world_size"] == 1 and rec["group_index"] == 0 and rec["received"] == 1000.0


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_sync_groups_of_two(tmp_path: Path, nproc: int) -> None:
    proc = _launch(nproc, 2, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(tmp_path, nproc)
    for rec in records:
        group = rec["rank"] // 2
        assert rec["world_size"] == nproc
        assert rec["group_index"] == group == rec["agreed_index"]
        assert rec["rank_in_group"] == rec["rank"] % 2
        assert rec["ranks"] == [2 * group, 2 * group + 1]
        # the broadcast came from this group's first rank only
        assert rec["received"] == 1000.0 * (group + 1) + 2 * group
        assert rec["group_rank_sum"] == float(4 * group + 1)


def test_bad_group_size_rejected_on_every_rank_without_hang(tmp_path: Path) -> None:
    """Each rank runs as its own process (no launcher that kills siblings): all four must
    reject the layout by themselves, before any collective could block."""
    import os

    start = time.monotonic()
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", LOCAL_WORLD_SIZE="4")
        cmd = [sys.executable, str(WORKER), "3", str(tmp_path)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [2, 2, 2, 2]
    for stdout, _ in outputs:
        assert "rejected: world size 4 is not divisible by train.video_sync_group 3" in stdout
    assert time.monotonic() - start < 60
