"""The compiler's work kept beside a run: ``torch.compiler``'s cache artifacts in one file.

A cold start compiles every block graph (forward and backward), generates and tunes their kernels; a process
on a machine whose caches are warm skips most of it. :func:`save_compile_cache` writes what this process
compiled or loaded (PyTorch's "mega-cache": the AOTAutograd and Inductor graph caches with their Triton
kernels and tuning results) to a file, and :func:`load_compile_cache` puts a file's artifacts into this
machine's caches before the first compilation, so the compiled blocks hit them. The record beside it names
what wrote it (PyTorch, Triton, GPU model) and the file's SHA-256; a file from another setup or a damaged one
is left unloaded and said so, and the run compiles as if there were none. The same
artifacts can also be kept in a cache shared by a user's runs (``train.compile_cache_shared``): a few entries
per setup, each one configuration's, all loaded by a run that has no cache of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pfctl.utils.io import atomic_write_bytes, atomic_write_json, sha256_file

__all__ = [
    "CompileCacheFiles",
    "compile_cache_identity",
    "describe_compile_cache",
    "load_compile_cache",
    "load_shared_compile_cache",
    "save_compile_cache",
]


@dataclass(frozen=True)
class CompileCacheFiles:
    """The artifacts file and its record, in ``directory``."""

    directory: Path

    @property
    def artifacts(self) -> Path:
        return self.directory / "compile-cache.bin"

    @property
    def record(self) -> Path:
        return self.directory / "compile-cache.json"


def compile_cache_identity(device: torch.device) -> dict[str, str | None]:
    """What a cache's artifacts depend on beyond their own keys: PyTorch, Triton and the GPU model."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"torch": torch.__version__, "triton": triton_version, "device": gpu or device.type}


def save_compile_cache(
    directory: str | Path, device: torch.device, step: int, *, shared: bool = False
) -> str | None:
    """Write this process's cache artifacts to ``directory`` (the artifacts first, then their record, each
    atomically: a killed write leaves the previous pair or a record whose hash the new file fails). Returns
    the log line, or None when nothing was compiled.

    ``shared``: ``directory`` is the root of a cache shared by runs (:func:`load_shared_compile_cache`): the
    artifacts go to their configuration's entry in this setup's folder (:func:`_configuration`), and only the
    newest :data:`SHARED_ENTRIES` entries are kept, so runs of different configurations do not overwrite each
    other's, and runs of one configuration keep one entry."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    blob, info = saved
    digest = hashlib.sha256(blob).hexdigest()
    if shared:
        directory = _shared_setup(directory, device) / _configuration(info)
    files = CompileCacheFiles(Path(directory))
    counts = _counts(info)
    if files.artifacts.is_file() and _read_record(files).get("sha256") == digest == sha256_file(files.artifacts):
        line = f"compile cache unchanged: {_describe(counts)} in {files.artifacts}"
    else:
        atomic_write_bytes(files.artifacts, blob)
        record = {
            **compile_cache_identity(device),
            "sha256": digest,
            "bytes": len(blob),
            "artifacts": counts,
            "step": step,
        }
        atomic_write_json(files.record, record)
        line = f"compile cache saved: {_describe(counts)}, {len(blob) / 2**20:.1f} MiB -> {files.artifacts}"
    if shared:
        os.utime(files.directory)  # the newest entry, also when unchanged
        for stale in _shared_entries(files.directory.parent)[SHARED_ENTRIES:]:
            shutil.rmtree(stale, ignore_errors=True)
    return line


#: How many entries (the artifacts of one configuration each) a shared cache keeps per setup.
SHARED_ENTRIES = 4


def _configuration(info: Any) -> str:
    """The name of a shared entry: a hash of the artifacts' cache keys, which the compiled graphs and kernels
    determine. Their bytes do not name a configuration: a later run of the same one stores other tuning
    timings, and named by them every run would add an entry, until one configuration's runs displaced the
    others'."""
    keys = {kind: sorted(keys) for kind, keys in info.artifacts.items() if keys}
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def _shared_setup(root: str | Path, device: torch.device) -> Path:
    """The folder under ``root`` (``~`` expanded) for this setup's entries: one per PyTorch, Triton and GPU
    model, so setups that share ``root`` do not displace each other's entries."""
    name = "_".join(f"{key}-{value}" for key, value in compile_cache_identity(device).items())
    return Path(root).expanduser() / re.sub(r"[^A-Za-z0-9.+-]+", "-", name)


def _shared_entries(setup: Path) -> list[Path]:
    """The entries of a setup's folder, the most recently saved first (one that another run removes meanwhile
    is left out)."""
    try:
        entries = list(setup.iterdir())
    except OSError:
        return []
    saved = []
    for entry in entries:
        try:
            info = entry.stat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            saved.append((info.st_mtime, entry))
    return [entry for _, entry in sorted(saved, key=lambda pair: pair[0], reverse=True)]


def load_shared_compile_cache(root: str | Path, device: torch.device) -> list[tuple[bool, str]]:
    """Load the entries of the shared cache at ``root`` for this setup (:func:`save_compile_cache` with
    ``shared``), the newest first. Returns each entry's outcome as :func:`load_compile_cache` gives it (none:
    no entry)."""
    outcomes = (load_compile_cache(entry, device) for entry in _shared_entries(_shared_setup(root, device)))
    return [(ok, line) for ok, line in itertools.islice(outcomes, SHARED_ENTRIES) if line is not None]


def load_compile_cache(directory: str | Path, device: torch.device) -> tuple[bool, str | None]:
    """Load ``directory``'s cache artifacts into this machine's compiler caches. Returns whether it did and the
    line to log (None: there is no cache there)."""
    files = CompileCacheFiles(Path(directory))
    if not files.record.is_file():
        return False, None
    record = _read_record(files)
    if not record:
        return False, f"compile cache not loaded: {files.record} is unreadable; compiling afresh"
    here = compile_cache_identity(device)
    differ = [f"{key} {record.get(key)} (here {value})" for key, value in here.items() if record.get(key) != value]
    if differ:
        return False, f"compile cache not loaded: written with {', '.join(differ)}; compiling afresh"
    try:
        blob = files.artifacts.read_bytes()
    except OSError:
        blob = None
    if blob is None or hashlib.sha256(blob).hexdigest() != record.get("sha256"):
        return False, f"compile cache not loaded: {files.artifacts} is missing or damaged; compiling afresh"
    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as exc:  # a cache must never stop a run: PyTorch raises what its own format check finds
        return False, f"compile cache not loaded: {type(exc).__name__}: {exc}; compiling afresh"
    if info is None:  # PyTorch's own check of the format failed (it logged why)
        return False, f"compile cache not loaded: PyTorch could not read {files.artifacts}; compiling afresh"
    return True, f"compile cache loaded: {_describe(_counts(info))} from {files.artifacts}"


def describe_compile_cache(directory: str | Path, shared: str | Path | None = None) -> str:
    """What ``directory`` holds for a run to load (``pfctl train --dry-run``): the record's setup and step;
    without one, where the shared cache is (``shared``: its root, whose entries for the run's setup it loads)."""
    files = CompileCacheFiles(Path(directory))
    record = _read_record(files)
    if not record:
        where = f"; until then the entries of the shared cache {shared} for its setup" if shared is not None else ""
        return f"no compile cache of this run yet (saved when the warm-up ends){where}"
    setup = ", ".join(f"{key} {record.get(key)}" for key in ("torch", "triton", "device"))
    return f"compile cache {files.artifacts} ({setup}; written at step {record.get('step')})"


def _read_record(files: CompileCacheFiles) -> dict[str, Any]:
    """The record's fields; empty where it is missing or not a JSON object."""
    try:
        record = json.loads(files.record.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _counts(info: Any) -> dict[str, int]:
    """How many artifacts of each kind a ``torch.compiler`` cache info lists."""
    return {kind: len(keys) for kind, keys in info.artifacts.items() if keys}


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "no artifacts"
