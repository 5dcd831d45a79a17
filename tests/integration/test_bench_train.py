"""``benchmarks/bench_train.py``: the whole trainer from a shipped recipe (CPU smoke run), and its
time-to-steady-state rule."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"


def _bench(name: str = "bench_train"):
    """The script (or its neighbour ``name``) as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_time_to_steady_is_the_first_step_from_which_the_rolling_median_stays_near_the_steady_time() -> None:
    report = _bench("train_report")
    # 3 slow steps (compilation), then ~1 s: the median of the last 5 is within 10% of 1.0 from step 6 on
    times = [30.0, 20.0, 10.0, 1.0, 1.05, 0.98, 1.0, 1.02, 0.99, 1.0, 1.01, 1.0]
    assert report.time_to_steady(times, 1.0) == (6, pytest.approx(sum(times[:6])))
    assert report.time_to_steady([1.0] * 4, 1.0) == (1, 1.0)
    assert report.time_to_steady([5.0, 4.0, 3.0, 2.0, 1.0, 1.0], 1.0) == (6, pytest.approx(16.0))
    # a warm-up longer than half the run, with a stretch of moderately slow steps (each input's first
    # occurrence) between slower ones (recording): steady only once the last slow stretch is over
    times = [60.0, 3.0, 2.5, 2.0, 2.5, 2.0, 5.0, 5.0, 4.5, 5.0, 4.0, 0.3, 0.3, 0.3, 0.3]
    assert report.time_to_steady(times, 0.3) == (14, pytest.approx(sum(times[:14])))


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


def test_host_work_of_a_profiled_step_leaves_out_its_waits_for_the_gpu() -> None:
    """The host's own work in a profiled step: its CPU events' self times (microseconds), less the calls that
    wait for the GPU (syncs, copies to the host, a launch into a full queue); device events do not count."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name: str, self_us: float, device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
        return SimpleNamespace(name=name, self_cpu_time_total=self_us, device_type=device)

    events = [
        event("aten::mm", 30.0),
        event("cudaLaunchKernel", 20.0),
        event("cudaMemcpyAsync", 5000.0),
        event("Command Buffer Full", 900.0),
        event("cudaStreamSynchronize", 700.0),
        event("a kernel", 400.0, DeviceType.CUDA),
    ]
    assert _bench("kernel_profile").host_work_seconds(events) == pytest.approx(50e-6)
    report = _bench("train_report")
    assert report.profiled_row(None) == "not profiled"
    row = report.profiled_row(report.Profiled(wall_s=0.25, gpu_busy_s=0.2, host_work_s=0.05))
    assert row == "250.0 ms, the GPU busy 80%; the host's own work (less its waits for the GPU) 50.0 ms, 25% of the GPU's busy time"


def test_the_reference_beside_several_processes_is_refused_before_any_work(tmp_path: Path) -> None:
    """The reference's step runs in one process: ``--reference`` with ``--processes 2`` stops before a cache is
    written or a process started."""
    cmd = [sys.executable, str(SCRIPT), "--recipe", "pyramid-flux-384p-8gpu", "--device", "cpu",
           "--processes", "2", "--reference", str(tmp_path / "Pyramid-Flow")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1
    assert "--reference times the reference in one process: use --processes 1" in proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []  # no trainer started, nothing written


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
    assert rows["Python GC: step 1 / rest of warm-up / timed"].endswith(" full passes)")
    assert rows["CUDA graphs in the timed steps"] == "none (no CUDA graphs)"
    assert "steady step time (median)" in proc.stdout


def test_bench_counts_the_garbage_collectors_pauses() -> None:
    import gc

    bench = _bench()
    with bench.GCPauses() as pauses:
        gc.collect()
        gc.collect(0)
    assert pauses.full == 1 and pauses.seconds > 0
    gc.collect()  # after the with: not counted
    assert pauses.full == 1
    timings = bench.Timings(gc=[0.5, 0.25, 0.25, 0.0], gc_full=[1, 0, 1, 0])
    assert _bench("train_report").gc_row(timings, 2) == "0.50 / 0.25 / 0.25 s (1 / 0 / 1 full passes)"


def test_graph_events_count_each_call_by_where_it_ends_and_put_the_methods_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each call of the trees' manager is counted by the method it ends in (replayed, recorded, a warm-up run;
    none of them: without a graph), its function's first call as new sizes, and every failed invariant check
    by status; leaving the ``with`` puts the classes' own methods back. Stand-in classes with the trees'
    method names (the trees themselves need CUDA)."""
    from enum import Enum

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as the script finds its neighbours
    import graph_events

    Status = Enum("Status", ["SUCCESS", "CudagraphManagedIdxMismatch"])

    class Node:
        def check_invariants(self, inputs: list) -> tuple:
            return (Status.SUCCESS if inputs else Status.CudagraphManagedIdxMismatch), str

    class Manager:
        def _run(self, new_inputs: list, function_id: str) -> str:
            if function_id == "r":  # a new path: the trees call themselves again, with the same call
                return self._run(new_inputs, "a")
            Node().check_invariants(new_inputs)
            ends = {"a": self.execute_node, "b": self.record_function, "c": self.run_eager}
            return ends[function_id]() if function_id in ends else "eager for good"

        def execute_node(self) -> str:
            return "replayed"

        def record_function(self) -> str:
            return "recorded"

        def run_eager(self) -> str:
            return "warmed up"

    own = {name: Manager.__dict__[name] for name in ("_run", "execute_node", "record_function", "run_eager")}
    m = Manager()
    with graph_events.GraphEvents(Manager, Node) as events:
        assert [m._run([1], f) for f in "abcd"] == ["replayed", "recorded", "warmed up", "eager for good"]
        first = events.take()
        m._run([1], "r"), m._run([], "a"), m._run([1], "b")
        second = events.take()
    assert {name: Manager.__dict__[name] for name in own} == own
    assert m._run([], "a") == "replayed" and not events.counts  # no longer counted
    assert first == {"calls": 4, "new sizes": 4, "replayed": 1, "recorded": 1, "warm-up runs": 1}
    assert graph_events.describe(first) == (
        "4 calls: 1 replayed, 1 recorded, 1 warm-up runs, 1 without a graph; 4 of new sizes"
    )
    assert graph_events.describe(second) == (
        "3 calls: 2 replayed, 1 recorded, 0 warm-up runs, 0 without a graph; 1 of new sizes; "
        "failed checks: CudagraphManagedIdxMismatch 1"
    )
    assert graph_events.describe(graph_events.GraphEvents().counts) == ""
    bench = _bench()
    assert _bench("train_report").graph_row(bench.Timings(graphs=[first, second, second]), 1) == (
        "6 calls: 4 replayed, 2 recorded, 0 warm-up runs, 0 without a graph; 2 of new sizes; "
        "failed checks: CudagraphManagedIdxMismatch 2; steps with calls not replayed: 2 3"
    )
    # the step graphs' running (calls, replays): warm-up step 1 records, step 3 meets a new input
    steps = bench.Timings(step_graphs=[(2, 0), (4, 2), (6, 3), (8, 5)])
    assert _bench("train_report").graph_row(steps, 1) == "the whole step: 6 calls, 5 replayed; steps with eager calls: 3"


def test_a_failed_check_names_what_it_found_moved_or_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a failed invariant check found, read from what the trees keep on a recording (stand-ins with their
    attribute names): the compared inputs whose data pointers moved, by placeholder and sizes (only the
    positions that check compares); the path's outputs the recording saw freed that are alive now; nothing
    where the trees keep none of it. Counted under the check while the events are entered, and named last in
    the line."""
    from collections import Counter
    from enum import Enum
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import graph_events

    a, b, w = torch.zeros(2, 3), torch.zeros(4), torch.zeros(5)
    names = [SimpleNamespace(name=n) for n in ("primals_1", "getitem_3", "primals_9")]
    Status = Enum("Status", ["SUCCESS", "StaticInputIdxMismatch"])

    class Node(SimpleNamespace):
        def check_invariants(self, inputs: list) -> tuple:
            return Status.StaticInputIdxMismatch, str

    node = Node(
        static_input_data_ptrs=[a.data_ptr(), b.data_ptr() + 4, w.data_ptr() + 4],  # b and w moved
        cudagraph_managed_idxs=[0, 1],
        tensor_static_input_idxs=[2],
        wrapped_function=SimpleNamespace(placeholders=names),
    )
    why = graph_events.why_check_failed
    assert why(node, [a, b, w], "CudagraphManagedIdxMismatch") == ["getitem_3 [4] moved"]
    assert why(node, [a, b, w], "StaticInputIdxMismatch") == ["primals_9 [5] moved"]
    live, gone = torch.zeros(1), torch.zeros(1)
    node.path_weakrefs = [[_StorageRef(live), None], [_StorageRef(gone, alive=False)]]  # alive, no output, freed
    node.expected_dead_indices_before_graph = [(0, 0), (1, 0)]
    assert why(node, [], "ExpectedDeadIndicesBeforeGraphMismatch") == ["output 0 of graph 0 alive"]
    assert why(SimpleNamespace(), [a, b], "CudagraphManagedIdxMismatch") == []
    with graph_events.GraphEvents(None, Node) as events:
        node.check_invariants([a, b, w]), node.check_invariants([a, b, w])
    assert events.counts == {
        "failed check: StaticInputIdxMismatch": 2,
        "why: StaticInputIdxMismatch: primals_9 [5] moved": 2,
    }
    assert graph_events.describe(events.counts + Counter(calls=2)) == (
        "2 calls: 0 replayed, 0 recorded, 0 warm-up runs, 2 without a graph; failed checks: "
        "StaticInputIdxMismatch 2; found: StaticInputIdxMismatch: primals_9 [5] moved x2"
    )


def test_a_failed_checks_finding_names_the_graph_it_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check made within a call of the trees' manager names its graph, forward or backward, as the trees'
    mode of the call's function has it (stand-ins with their attribute names)."""
    from enum import Enum
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import graph_events

    Status = Enum("Status", ["SUCCESS", "CudagraphManagedIdxMismatch"])
    Mode = Enum("Mode", ["FORWARD", "BACKWARD"])
    moved = torch.zeros(2)

    class Node(SimpleNamespace):
        def check_invariants(self, inputs: list) -> tuple:
            return Status.CudagraphManagedIdxMismatch, str

    node = Node(
        static_input_data_ptrs=[moved.data_ptr() + 4], cudagraph_managed_idxs=[0],
        wrapped_function=SimpleNamespace(placeholders=[SimpleNamespace(name="tangents_1")]),
    )  # fmt: skip

    class Manager:
        def __init__(self) -> None:
            self.id_to_mode = {"f": Mode.FORWARD, "b": Mode.BACKWARD}

        def _run(self, new_inputs: list, function_id: str) -> None:
            node.check_invariants(new_inputs)

    with graph_events.GraphEvents(Manager, Node) as events:
        Manager()._run([moved], "b")
    assert events.counts["why: CudagraphManagedIdxMismatch: backward graph: tangents_1 [2] moved"] == 1


class _StorageRef:
    """A stand-in for the trees' weak reference to an output's storage: its pointer, and the storage while alive."""

    def __init__(self, tensor: object, alive: bool = True) -> None:
        self.pointer, self.tensor = tensor.untyped_storage().data_ptr(), tensor if alive else None

    def data_ptr(self) -> int:
        return self.pointer

    def __call__(self) -> object:
        return self.tensor


def test_a_moved_input_says_which_output_of_the_path_it_was_recorded_on_and_is_on_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph's two outputs alike in sizes, taken by the next graph in the other order than at its recording:
    the finding names the output it was recorded on and the one it is on now; an input that is no output of the
    path (an eager tensor) is named so, as is one whose recorded output has died."""
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import graph_events

    x, y, eager, dead = torch.zeros(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    node = SimpleNamespace(
        static_input_data_ptrs=[x.data_ptr(), dead.data_ptr()],
        cudagraph_managed_idxs=[0, 1],
        wrapped_function=SimpleNamespace(placeholders=[SimpleNamespace(name="a"), SimpleNamespace(name="b")]),
        path_weakrefs=[[_StorageRef(x), _StorageRef(y), _StorageRef(dead, alive=False)]],
    )
    why = graph_events.why_check_failed
    assert why(node, [y, y], "CudagraphManagedIdxMismatch") == [
        "a [3] moved (recorded output 0 of graph 0, now output 1 of graph 0)",
        "b [3] moved (recorded output 2 of graph 0, now output 1 of graph 0)",
    ]
    assert why(node, [eager, dead], "CudagraphManagedIdxMismatch") == [
        "a [3] moved (recorded output 0 of graph 0, now off the path outputs)"
    ]


def _spin(seconds: float) -> None:
    """Busy Python for ``seconds`` (what the host sampler must see as running)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(100))


def test_host_sampler_files_each_phase_and_thread_under_its_own_name() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from host_sampler import HostSampler
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with HostSampler(interval=0.005) as sampler:
        sampler.phase("first")
        _spin(0.3)
        sampler.phase("second")
        worker = threading.Thread(target=_spin, args=(0.3,), name="spinner")
        worker.start()
        worker.join()
    totals = sampler.totals()
    spin = (__file__, "_spin")
    first, second = totals[("first", "MainThread")], totals[("second", "spinner")]
    # the sampler's own wake-ups are late on a busy machine, never early: at least most of each spin is seen
    assert first[0] >= 0.2 and first[1][spin] >= 0.2 and first[2][spin] >= 0.2  # total, inclusive, leaf
    assert second[1][spin] >= 0.2
    assert ("second", "MainThread") not in totals or totals[("second", "MainThread")][1][spin] < 0.1
    assert "host samples: first, MainThread" in sampler.report(top=3)


class _Token:
    pass


def _hold_while_sampled(seconds: float) -> weakref.ref:
    token = _Token()
    _spin(seconds)
    return weakref.ref(token)


def test_host_sampler_keeps_no_returned_function_alive() -> None:
    """A stack sample holds no frame once taken: a held frame keeps its function's locals alive after the return
    (on CUDA a graph tree then counted a tensor of its pool that no output explained, and the run failed)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from host_sampler import HostSampler
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with HostSampler(interval=0.002) as sampler:
        alive = [_hold_while_sampled(0.01)() is not None for _ in range(30)]
    assert sampler.samples and not any(alive)


def test_bench_prints_the_host_profile_per_phase(tmp_path: Path) -> None:
    bench = _bench()
    assert [bench.step_phase(i, 4) for i in range(5)] == ["step 1"] + ["steps 2-4 (warm-up)"] * 3 + ["timed steps"]
    assert bench.step_phase(1, 2) == "step 2 (warm-up)"
    split = [bench.step_phase(i, 6, (3,)) for i in range(7)]
    assert split == ["step 1"] + ["steps 2-3 (warm-up)"] * 2 + ["steps 4-6 (warm-up)"] * 3 + ["timed steps"]
    assert bench.step_phase(1, 6, (2, 9)) == "step 2 (warm-up)"
    # a tiny CPU step takes about one sampling interval: only the 20 timed steps are sure to be sampled
    cmd = [sys.executable, str(SCRIPT), "--steps", "20", "--warmup", "1", "--no-checkpoint", "--host-profile", "30"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    timed = proc.stdout.split("host samples: timed steps, MainThread:")[1].split("host samples:")[0]
    assert "pfctl/training/trainer.py:train_step" in timed


def test_the_host_syncs_of_a_step_are_named_by_pfctl_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sync CUDA's debug mode reports in the counted step is named by the last pfctl line on the stack
    (else the innermost frames), counted per site in the report; other warnings, the debug mode's own notice too,
    are not syncs."""
    import warnings

    import torch

    from helpers.step_graphs import Unrecorded
    from pfctl.models.fast.cuda_graph import record_graph

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)

    def sync() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    def step() -> str:
        sync()
        record_graph(Unrecorded(), None, None, sync)  # through a pfctl frame
        record_graph(Unrecorded(), None, None, sync)
        warnings.warn("something else", UserWarning, stacklevel=1)
        # the debug mode's own notice, which torch gives when the mode is set: no sync
        notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
        warnings.warn(notice, UserWarning, stacklevel=1)
        return "metrics"

    result, sites = _bench().counting_syncs(step)
    assert result == "metrics" and len(sites) == 3
    # no pfctl line on its stack: its innermost two frames, the sync's first
    assert sites[0].startswith("test_bench_train.py:") and " sync <- test_bench_train.py:" in sites[0]
    assert sites[1] == sites[2] and sites[1].startswith("pfctl/models/fast/cuda_graph.py:")
    row = _bench("train_report").sync_row(sites)
    assert row == f"3 ({sites[0]}, {sites[1]} x2)"
    assert _bench("train_report").sync_row([]) == "0"
