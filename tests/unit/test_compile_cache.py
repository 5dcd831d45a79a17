"""The compiler's artifacts kept beside a run (``train.compile_cache``, :mod:`pfctl.models.fast.compile_cache`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pfctl.models.fast.compile_cache import CompileCacheFiles, compile_cache_identity, load_compile_cache
from pfctl.utils.io import current_umask, sha256_file

# One process compiles a small function with Inductor (CPU code), saves the artifacts twice and into the cache
# shared at DIRECTORY-shared, and prints the log lines and its compiler counters; run with "load" it loads them
# first into its own empty caches, with "load-shared" it loads the shared cache first and then saves into it.
_COMPILE = """
import json, sys
import torch
from torch._dynamo.utils import counters
from pfctl.models.fast.compile_cache import load_compile_cache, load_shared_compile_cache, save_compile_cache

mode, directory = sys.argv[1], sys.argv[2]
lines = []
if mode == "load":
    lines.append(load_compile_cache(directory, torch.device("cpu")))
if mode == "load-shared":
    lines.append(load_shared_compile_cache(directory + "-shared", torch.device("cpu")))
f = torch.compile(lambda x: x @ x.t(), backend="inductor", dynamic=False)  # one library call: no C++ to build
with torch.no_grad():
    f(torch.randn(4, 8))
if mode == "save":
    lines += [save_compile_cache(directory, torch.device("cpu"), step=7) for _ in range(2)]
if mode in ("save", "load-shared"):
    lines.append(save_compile_cache(directory + "-shared", torch.device("cpu"), step=7, shared=True))
print(json.dumps({"lines": lines, "inductor": dict(counters["inductor"])}))
"""


def _compile(mode: str, directory: Path, inductor_cache: Path) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache),
        "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, mode, str(directory)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_saved_artifacts_make_a_process_with_empty_caches_skip_the_compilation(tmp_path: Path) -> None:
    """What a resumed run on another machine gets: a process whose compiler caches are empty loads the file
    the first run wrote and compiles nothing (every graph a cache hit). The record names what wrote it. A new
    run on a third machine gets the same from the cache the first run shared."""
    run = tmp_path / "run"
    first = _compile("save", run, tmp_path / "machine-a")
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1  # it did compile
    saved, again, shared = first["lines"]
    assert saved.startswith("compile cache saved:") and "inductor" in saved
    assert again.startswith("compile cache unchanged:")  # the same artifacts are not written twice

    files = CompileCacheFiles(run)
    record = json.loads(files.record.read_text())
    assert record["sha256"] == sha256_file(files.artifacts)
    assert record["bytes"] == files.artifacts.stat().st_size and record["step"] == 7
    assert {k: record[k] for k in ("torch", "triton", "device")} == compile_cache_identity(torch.device("cpu"))
    for path in (files.artifacts, files.record):  # as a plain open() would create them
        assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()

    second = _compile("load", run, tmp_path / "machine-b")
    [(loaded, line)] = second["lines"]
    assert loaded and line.startswith("compile cache loaded:")
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1

    # a new run (no cache of its own) on a third machine, from the cache the first run shared
    assert shared.startswith("compile cache saved:")
    third = _compile("load-shared", tmp_path / "run", tmp_path / "machine-c")
    [(loaded, line)], saved_again = third["lines"]
    assert loaded and line.startswith("compile cache loaded:")
    assert third["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert third["inductor"].get("fxgraph_cache_hit", 0) >= 1
    # the same configuration: its entry again, not one more
    assert saved_again.split()[-1] == shared.split()[-1]
    (setup,) = (tmp_path / "run-shared").iterdir()
    assert len(list(setup.iterdir())) == 1


def _write_cache(directory: Path, blob: bytes, **record: object) -> CompileCacheFiles:
    files = CompileCacheFiles(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files.artifacts.write_bytes(blob)
    identity = compile_cache_identity(torch.device("cpu"))
    files.record.write_text(json.dumps({**identity, "sha256": sha256_file(files.artifacts), **record}))
    return files


def test_no_cache_is_no_message(tmp_path: Path) -> None:
    assert load_compile_cache(tmp_path, torch.device("cpu")) == (False, None)


def test_a_cache_written_by_another_setup_is_not_loaded(tmp_path: Path) -> None:
    _write_cache(tmp_path, b"artifacts", torch="1.0.0")
    loaded, line = load_compile_cache(tmp_path, torch.device("cpu"))
    assert not loaded
    assert "torch 1.0.0" in line and f"here {torch.__version__}" in line and "compiling afresh" in line


@pytest.mark.parametrize("damage", ["artifacts changed", "artifacts missing", "record unreadable"])
def test_a_damaged_cache_is_not_loaded_and_the_run_goes_on(tmp_path: Path, damage: str) -> None:
    files = _write_cache(tmp_path, b"artifacts")
    if damage == "artifacts changed":
        files.artifacts.write_bytes(b"artifactz")
    elif damage == "artifacts missing":
        files.artifacts.unlink()
    else:
        files.record.write_text("{not json")
    loaded, line = load_compile_cache(tmp_path, torch.device("cpu"))
    assert not loaded and "compiling afresh" in line
    assert ("unreadable" if damage == "record unreadable" else "missing or damaged") in line


def test_artifacts_pytorch_cannot_read_are_not_loaded(tmp_path: Path) -> None:
    """A file whose record matches but whose content is not PyTorch's format: refused, never a crash."""
    _write_cache(tmp_path, b"\x00 not a cache")
    loaded, line = load_compile_cache(tmp_path, torch.device("cpu"))
    assert not loaded and line.startswith("compile cache not loaded:")


def test_the_warm_up_loads_the_cache_first_and_saves_it_once_when_over(tmp_path: Path, monkeypatch) -> None:
    """The trainer's wiring (:class:`pfctl.training.warmup.WarmupWatch`): artifacts loaded before the first
    step, this run's saved once, by the writing process only, after the step that completes the warm-up; a
    failing save is a warning, not the end of the run."""
    from pfctl.models.fast import compile_cache
    from pfctl.runtime import logging as pflog
    from pfctl.training.warmup import CompileCacheSite, WarmupWatch

    said: list[str] = []
    monkeypatch.setattr(pflog, "log", lambda message, **_: said.append(message))
    monkeypatch.setattr(pflog, "warn", lambda message: said.append("warn: " + message))
    monkeypatch.setattr(compile_cache, "load_compile_cache", lambda d, dev: (True, f"loaded {d}"))
    saves: list[int] = []
    monkeypatch.setattr(
        compile_cache, "save_compile_cache", lambda d, dev, step, shared: saves.append(step) or "saved"
    )
    expected = {((8, 8, 2), (1,)): (64,), ((8, 8, 2), (2,)): (128,)}

    def run(writes: bool) -> None:
        watch = WarmupWatch(expected, need=2, cache=CompileCacheSite(tmp_path, torch.device("cpu"), writes))
        watch.start()
        assert said[-1] == f"loaded {tmp_path}"
        for step, units in enumerate([(1,), (2,), (1,), (2,), (1,)], start=1):
            watch.saw((8, 8, 2), units, now=float(step))
            watch.after_step(step, now=float(step))

    run(writes=True)
    assert saves == [4]  # the step in which each input was met twice; not again at step 5
    assert said[-1] == "saved" and said[-2].startswith("warm-up over at step 4")
    run(writes=False)  # another rank: loads, never writes
    assert saves == [4]

    def full_disk(d, dev, step, shared):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compile_cache, "save_compile_cache", full_disk)
    run(writes=True)
    assert said[-1] == "warn: compile cache not saved: OSError: [Errno 28] No space left on device"


def test_a_run_without_a_cache_of_its_own_loads_the_shared_one_and_saves_into_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.compile_cache_shared``: the run's own artifacts first (a resumed run, nothing else loaded);
    where there are none that load, the shared cache's; at the warm-up's end the main process saves beside the
    run, then into the shared cache, a failure of either a warning that leaves the other. With nothing to load
    anywhere, the log says that the first steps compile."""
    from pfctl.models.fast import compile_cache
    from pfctl.runtime import logging as pflog
    from pfctl.training.warmup import CompileCacheSite

    said: list[str] = []
    monkeypatch.setattr(pflog, "log", lambda message, **_: said.append(message))
    monkeypatch.setattr(pflog, "warn", lambda message: said.append("warn: " + message))
    own, shared = tmp_path / "run", tmp_path / "shared"
    monkeypatch.setattr(compile_cache, "load_shared_compile_cache", lambda root, dev: [(True, f"shared {root}")])
    site = CompileCacheSite(own, torch.device("cpu"), writes=True, shared=shared)

    monkeypatch.setattr(compile_cache, "load_compile_cache", lambda d, dev: (True, f"own {d}"))
    site.load()
    assert said == [f"own {own}"]
    monkeypatch.setattr(compile_cache, "load_compile_cache", lambda d, dev: (False, None))
    site.load()
    assert said[1:] == [f"shared {shared}"]
    monkeypatch.setattr(compile_cache, "load_compile_cache", lambda d, dev: (False, "not loaded: damaged"))
    site.load()
    assert said[2:] == ["warn: not loaded: damaged", f"shared {shared}"]

    def save(directory: Path, dev: torch.device, step: int, shared: bool) -> str:
        if directory == own:
            raise OSError(30, "Read-only file system")
        return f"saved {directory} shared={shared}"

    monkeypatch.setattr(compile_cache, "save_compile_cache", save)
    site.save(3)
    assert said[4:] == ["warn: compile cache not saved: OSError: [Errno 30] Read-only file system", f"saved {shared} shared=True"]
    # the first run of a setup: nothing of its own, nothing shared; the log says the first steps compile
    monkeypatch.setattr(compile_cache, "load_compile_cache", lambda d, dev: (False, None))
    monkeypatch.setattr(compile_cache, "load_shared_compile_cache", lambda root, dev: [])
    site.load()
    assert said[-1].startswith(f"compile cache: nothing saved for this setup yet (beside the run or in {shared})")
    CompileCacheSite(own, torch.device("cpu"), writes=True).load()
    assert said[-1].startswith("compile cache: nothing saved for this setup yet (beside the run): the first")


def test_the_shared_cache_keeps_one_entry_per_configuration_the_newest_few(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each configuration's artifacts are an entry of their own in the setup's folder, named by their cache keys:
    saving the same artifacts again writes nothing but makes that entry the newest, and a later run of a
    configuration (the same keys, other bytes: its kernels' tuning records) replaces its entry; past
    ``SHARED_ENTRIES`` the oldest go. A run loads every entry kept, the newest first, and passes over one that
    disappears while it looks."""
    from types import SimpleNamespace

    from pfctl.models.fast import compile_cache

    kept = compile_cache.SHARED_ENTRIES
    configurations = [
        SimpleNamespace(artifacts={"inductor": [f"graph {i}", "graph shared"], "autotune": [f"kernel {i}"]})
        for i in range(kept + 2)
    ]
    current: dict = {}
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (current["blob"], current["info"]))
    cpu = torch.device("cpu")
    # the first configuration again once the cache is full, then once more with other tuning records
    order = [*range(kept), 0, 0, *range(kept, kept + 2)]
    entries = []
    for i, configuration in enumerate(order):
        current["info"] = configurations[configuration]
        current["blob"] = f"artifacts of configuration {configuration}, run {i if i > kept else 0}".encode()
        line = compile_cache.save_compile_cache(tmp_path, cpu, step=i, shared=True)
        assert line.startswith("compile cache unchanged:" if i == kept else "compile cache saved:")
        entries.append(Path(line.split()[-1]).parent)
        os.utime(entries[-1], (i, i))  # mtimes in order, whatever the clock's resolution
    assert entries[kept] == entries[kept + 1] == entries[0]  # one entry for the first configuration's runs
    (setup,) = tmp_path.iterdir()  # one folder for this PyTorch, Triton and device
    assert "torch-" in setup.name and "device-cpu" in setup.name
    (setup / "removed meanwhile").symlink_to(tmp_path / "gone")  # an entry another run prunes as this one lists
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: loaded.append(blob) or configurations[0])
    outcomes = compile_cache.load_shared_compile_cache(tmp_path, cpu)
    assert len(outcomes) == kept
    assert all(ok and line.startswith("compile cache loaded:") for ok, line in outcomes)
    # newest first: the two saved after the first configuration's last run, that run, then the newest before
    newest_first = [entries[i].joinpath("compile-cache.bin").read_bytes() for i in (-1, -2, kept + 1, kept - 1)]
    assert loaded == newest_first
    assert newest_first[2] == f"artifacts of configuration 0, run {kept + 1}".encode()
    assert len([entry for entry in setup.iterdir() if entry.is_dir()]) == kept
    assert compile_cache.load_shared_compile_cache(tmp_path / "nothing", cpu) == []


def test_after_the_warm_up_a_step_that_records_cuda_graphs_again_is_named_once(monkeypatch) -> None:
    """With CUDA graphs every input is recorded in the warm-up; a later step that begins recordings again
    (the graph trees' checks failed) is named in one warning with the switch that turns the graphs off, and
    steps that only replay say nothing. Without a count (another PyTorch) nothing is said."""
    from pfctl.runtime import logging as pflog
    from pfctl.training.warmup import WarmupWatch

    warned: list[str] = []
    monkeypatch.setattr(pflog, "log", lambda message, **_: None)
    monkeypatch.setattr(pflog, "warn", warned.append)
    begun = iter([5, 5, 5, 7, 9, 9])  # the trees' recordings read at the end of the warm-up and after steps
    expected = {((8, 8, 2), (1,)): (64,)}
    watch = WarmupWatch(expected, need=2, recordings=lambda: next(begun))
    for step in range(1, 8):
        watch.saw((8, 8, 2), (1,), now=float(step))
        watch.after_step(step, now=float(step))
    assert len(warned) == 1
    assert warned[0].startswith("CUDA graphs: step 5 recorded graphs again after the warm-up (2 recordings")
    assert "train.cuda_graphs=false" in warned[0]
    unknown = WarmupWatch(expected, need=2, recordings=lambda: None)
    for step in range(1, 5):
        unknown.saw((8, 8, 2), (1,), now=float(step))
        unknown.after_step(step, now=float(step))
    assert len(warned) == 1
