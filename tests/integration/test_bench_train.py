"""``benchmarks/bench_train.py``: the whole trainer from a shipped recipe (CPU smoke run), and its
time-to-steady-state rule."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_time_to_steady_is_the_first_step_whose_rolling_median_is_near_the_final_one() -> None:
    bench = _bench()
    # 3 slow steps (compilation), then ~1 s: the median of the last 5 is within 10% of 1.0 at step 6
    times = [30.0, 20.0, 10.0, 1.0, 1.05, 0.98, 1.0, 1.02, 0.99, 1.0, 1.01, 1.0]
    assert bench.time_to_steady(times) == (6, pytest.approx(sum(times[:6])))
    assert bench.time_to_steady([1.0] * 4) == (1, 1.0)
    assert bench.time_to_steady([5.0, 4.0, 3.0, 2.0, 1.0, 1.0]) == (6, pytest.approx(16.0))


def test_gpu_busy_time_counts_overlapping_and_nested_device_events_once() -> None:
    """The profiled step's GPU busy time is the union of the device events' intervals (microseconds): two
    streams' overlapping kernels and a copy inside a kernel's span count once; host events not at all."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(start: float, end: float, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device)

    spec = importlib.util.spec_from_file_location("kernel_profile", SCRIPT.parent / "kernel_profile.py")
    kernel_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_profile)
    events = [event(0, 100), event(50, 150), event(60, 70), event(300, 400), event(0, 1000, DeviceType.CPU)]
    assert kernel_profile.gpu_busy_seconds(events) == pytest.approx(250e-6)
    assert kernel_profile.gpu_busy_seconds([]) == 0.0


@pytest.mark.slow
def test_recipe_runs_the_whole_trainer_on_the_cpu(tmp_path: Path) -> None:
    """The 768p recipe (FSDP shard_grad_op, checkpointing 75%, 2 micro-steps) on a tiny DiT: every figure."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--recipe", "pyramid-flux-768p-8gpu", "--device", "cpu",
           "--set", "model.dit_preset=tiny", "--frames", "2", "--height", "8", "--width", "8",
           "--steps", "2", "--warmup", "1", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert rows["recipe"] == "pyramid-flux-768p-8gpu"
    assert rows["fsdp / gradient checkpointing"] == "shard_grad_op / 0.75"
    assert rows["batch per rank"] == "4 clips x 2 micro-steps, sync group 1"
    assert rows["precision"] == "no"
    assert rows["latents (T x H x W)"] == "2 x 8 x 8"
    assert float(rows["image tokens/s per GPU"].replace(",", "")) > 0
    assert rows["with recomputation (+2·N_ckpt·tokens)"].startswith("n/a (")  # counted (no peak rate on CPU)
    assert rows["time to steady state"].endswith("within 10%)")
    assert "GiB RSS" in rows["peak memory (timed steps)"] and rows["checkpoint save (not timed above)"].endswith(" s")
    assert "steady step time (median)" in proc.stdout
