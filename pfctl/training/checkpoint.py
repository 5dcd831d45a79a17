"""Training checkpoints: complete, atomic, resumable bit-exactly.

Layout of ``output_dir/checkpoints/step-NNNNNN/``::

    model/config.json + diffusion_pytorch_model.safetensors   the DiT (a diffusers model folder)
      (LoRA runs: model/adapter_model.safetensors + adapter_config.json — the adapter only, peft layout)
    ema/...                                                    same, EMA weights (when EMA is on)
    optimizer.safetensors + optimizer.json                    AdamW state (tensors) + param groups
    lr_scheduler.json                                          LambdaLR state (the LR is a function of step)
    ranks/rank-NNNNN.json + .safetensors                       per rank: python/numpy/torch RNG states, the
                                                               noise generator, the data position
    train_state.json                                           step, counters, layout, config — written LAST

A checkpoint is written into ``checkpoints/.tmp-step-NNNNNN`` and renamed into place by the
main process after every rank has written its files; ``latest`` only considers folders named
``step-NNNNNN`` that contain a ``train_state.json``, so a run killed mid-save never leaves a
checkpoint that a resume would pick. :class:`BackgroundSaver` writes the same folders from a
thread while training goes on. Nothing here is pickled: tensors go to safetensors, the rest to JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfctl.errors import CheckpointError
from pfctl.runtime import logging as pflog
from pfctl.utils.io import atomic_save_safetensors, atomic_write_bytes, atomic_write_json

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{6,})$")
MODEL_WEIGHTS = "diffusion_pytorch_model.safetensors"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / "train_state.json").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def find_latest(root: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(spec: str | None, root: str | os.PathLike[str]) -> Path | None:
    """``None`` → fresh start; ``latest`` → newest complete checkpoint or None; else a folder."""
    if spec is None or spec in ("", "none", "no"):
        return None
    if spec == "latest":
        return find_latest(root)
    path = Path(spec).expanduser()
    if path.is_dir() and not (path / "train_state.json").is_file() and find_latest(path) is not None:
        path = find_latest(path)  # a checkpoints/ folder or an output_dir/checkpoints
    elif path.is_dir() and (path / "checkpoints").is_dir() and not (path / "train_state.json").is_file():
        path = find_latest(path / "checkpoints") or path
    if not (path / "train_state.json").is_file():
        raise CheckpointError(
            f"resume checkpoint {path} is missing or incomplete (no train_state.json)",
            hint="pass a checkpoints/step-NNNNNN folder, or --resume latest",
        )
    return path


# --------------------------------------------------------------------------------------------
# flat (de)serialisation of state dicts: tensors → safetensors, everything else → JSON
# --------------------------------------------------------------------------------------------


def optimizer_to_files(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``optimizer.state_dict()`` → (tensors keyed ``state.<param>.<name>``, JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = value
            else:
                scalars.setdefault(str(pid), {})[name] = value
    meta = {
        "param_groups": state["param_groups"],
        "scalars": scalars,
        "param_keys": [str(k) for k in state["state"]],
    }
    meta["key_is_int"] = all(isinstance(k, int) for k in state["state"])
    return tensors, meta


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[Any, dict[str, Any]] = {}
    for key in meta["param_keys"]:
        pid: Any = int(key) if meta["key_is_int"] else key
        state[pid] = dict(meta["scalars"].get(key, {}))
    for flat, value in tensors.items():
        _, key, name = flat.split(".", 2) if meta["key_is_int"] else _split_fqn(flat)
        pid = int(key) if meta["key_is_int"] else key
        state[pid][name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _split_fqn(flat: str) -> tuple[str, str, str]:
    """``state.<dotted.param.name>.<stat>`` for FSDP's name-keyed optimizer state."""
    body = flat[len("state.") :]
    key, _, name = body.rpartition(".")
    return "state", key, name


def rng_state(noise_generator: torch.Generator | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every random state of this rank: (tensors, JSON)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda.{i}"] = s
    if noise_generator is not None:
        tensors["noise_generator"] = noise_generator.get_state()
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, meta


def restore_rng_state(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], noise_generator: torch.Generator | None
) -> None:
    """The Python, NumPy and torch (CPU, CUDA) random states and the noise generator's, as a checkpoint saved them."""
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    if noise_generator is not None and "noise_generator" in tensors:
        noise_generator.set_state(tensors["noise_generator"])


def save_model_folder(folder: Path, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """A diffusers-style model folder: ``config.json`` (when the model has one) + safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_config"):
        model.save_config(folder)
    atomic_save_safetensors(state_dict, folder / MODEL_WEIGHTS, metadata={"format": "pt"})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing", hint="the checkpoint is incomplete")
    return load_file(str(path))


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------


@dataclass
class CheckpointPayload:
    """What one rank contributes to a checkpoint. Shared parts are only read on the main process."""

    step: int
    train_state: dict[str, Any]
    rank_state: dict[str, Any]  # JSON: data position etc.
    rank_tensors: dict[str, torch.Tensor]  # RNG states
    model: torch.nn.Module | None = None  # unwrapped, for its config
    model_state: dict[str, torch.Tensor] | None = None
    ema_state: dict[str, torch.Tensor] | None = None
    optimizer_state: dict[str, Any] | None = None
    scheduler_state: dict[str, Any] | None = None
    adapter_config: dict[str, Any] | None = None
    """Set for LoRA runs: ``model_state`` / ``ema_state`` are adapter tensors, written in peft's layout."""


def save_checkpoint(
    root: str | os.PathLike[str],
    payload: CheckpointPayload,
    *,
    rank: int,
    is_main: bool,
    barrier: Callable[[], None],
    keep_last: int | None = None,
) -> Path:
    """Write ``root/step-NNNNNN`` atomically (see module docstring). Every rank must call it."""
    final, tmp = _prepare(Path(root), payload.step, is_main, barrier)
    _write_files(tmp, payload, rank, is_main)
    barrier()
    if is_main:
        _commit(tmp, final, payload, keep_last)
    barrier()
    return final


def _prepare(root: Path, step: int, is_main: bool, barrier: Callable[[], None]) -> tuple[Path, Path]:
    """(the checkpoint's folder, its temporary folder, made empty by the main process before any rank writes)."""
    final, tmp = root / step_dir_name(step), root / f".tmp-{step_dir_name(step)}"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "ranks").mkdir(parents=True)
    barrier()
    return final, tmp


def _write_files(tmp: Path, payload: CheckpointPayload, rank: int, is_main: bool) -> None:
    """This rank's files; on the main process also the model, EMA, optimizer and LR schedule."""
    rank_name = f"rank-{rank:05d}"
    atomic_save_safetensors(payload.rank_tensors, tmp / "ranks" / f"{rank_name}.safetensors")
    atomic_write_json(tmp / "ranks" / f"{rank_name}.json", payload.rank_state)
    if not is_main:
        return
    assert payload.model is not None and payload.model_state is not None
    if payload.adapter_config is not None:
        from pfctl.models.lora import write_adapter_files

        write_adapter_files(tmp / "model", payload.model_state, payload.adapter_config)
        if payload.ema_state is not None:
            write_adapter_files(tmp / "ema", payload.ema_state, payload.adapter_config)
    else:
        save_model_folder(tmp / "model", payload.model, payload.model_state)
        if payload.ema_state is not None:
            save_model_folder(tmp / "ema", payload.model, payload.ema_state)
    if payload.optimizer_state is not None:
        tensors, meta = optimizer_to_files(payload.optimizer_state)
        atomic_save_safetensors(tensors, tmp / "optimizer.safetensors")
        atomic_write_json(tmp / "optimizer.json", meta)
    if payload.scheduler_state is not None:
        atomic_write_json(tmp / "lr_scheduler.json", payload.scheduler_state)


def _commit(tmp: Path, final: Path, payload: CheckpointPayload, keep_last: int | None) -> None:
    """Main process, once every rank has written: the commit marker last, the rename, the pruning."""
    state = {"format_version": FORMAT_VERSION, "step": payload.step, **payload.train_state}
    atomic_write_json(tmp / "train_state.json", state)  # the commit marker: written last
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune_checkpoints(final.parent, keep_last)


def host_copy(value: Any) -> Any:
    """``value`` (a payload, or any nesting of dicts, lists and tuples) with every tensor copied into host
    memory of its own and everything else deep-copied: what the run changes after this leaves it as it was."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    if isinstance(value, CheckpointPayload):
        return dataclasses.replace(value, **host_copy(_state_fields(value)))
    return copy.deepcopy(value)


def _state_fields(payload: CheckpointPayload) -> dict[str, Any]:
    """The payload's fields but the live module (kept for its config only)."""
    return {f.name: getattr(payload, f.name) for f in dataclasses.fields(payload) if f.name != "model"}


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (a payload, or any nesting of dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, CheckpointPayload):
        return tensor_bytes(_state_fields(value))
    return 0


def available_host_bytes() -> int | None:
    """The host memory available to new allocations (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def copy_fits(nbytes: int) -> bool:
    """Whether a host copy of ``nbytes`` of state leaves room for its serialisation (up to as much again, one
    file at a time): twice ``nbytes`` available, or nothing known about the host."""
    available = available_host_bytes()
    return available is None or 2 * nbytes <= available


class BackgroundSaver:
    """Checkpoints written while training goes on: :meth:`save` copies the payload into host memory (the only
    part the loop waits for) and a thread of each rank writes its files; the main process's thread then waits
    for every rank's ``.written`` marker (the folder is shared) and commits as :func:`save_checkpoint` does.
    One save is in flight at a time: the next :meth:`save` and :meth:`wait` join it (and raise its error).
    A run killed during the write leaves the previous checkpoint as the latest: never a partial one.
    ``on_saved(path)`` runs on the main process once a checkpoint is committed."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        is_main: bool,
        barrier: Callable[[], None],
        keep_last: int | None = None,
        on_saved: Callable[[Path], None] | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        self.root, self.rank, self.world_size, self.is_main = Path(root), rank, world_size, is_main
        self.barrier, self.keep_last, self.on_saved, self.timeout_s = barrier, keep_last, on_saved, timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, payload: CheckpointPayload) -> Path:
        """Start writing ``payload`` (every rank calls it); returns the folder it will be committed to.

        A rank whose host has too little free memory for the copy (:func:`copy_fits`) writes its files at once
        instead, and says so; the commit still follows the same markers, so the ranks need not agree."""
        self.wait()
        final, tmp = _prepare(self.root, payload.step, self.is_main, self.barrier)
        need = tensor_bytes(payload)
        if copy_fits(need):
            payload, written = host_copy(payload), False
        else:
            pflog.log(
                f"warning: {need / 2**30:.1f} GiB of checkpoint state do not fit twice in the host's free memory: "
                f"writing {final.name} before training goes on",
                all_ranks=True,
            )
            _write_files(tmp, payload, self.rank, self.is_main)
            written = True
        self._thread = threading.Thread(
            target=self._write, args=(payload, tmp, final, written), name=f"pfctl-{final.name}", daemon=False
        )
        self._thread.start()
        return final

    def wait(self) -> None:
        """Block until the save in flight is written (on the main process: committed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing the checkpoint failed: {error}") from error

    def _write(self, payload: CheckpointPayload, tmp: Path, final: Path, written: bool) -> None:
        try:
            if not written:
                _write_files(tmp, payload, self.rank, self.is_main)
            atomic_write_bytes(tmp / "ranks" / f"rank-{self.rank:05d}.written", b"")
            if not self.is_main:
                return
            markers = [tmp / "ranks" / f"rank-{r:05d}.written" for r in range(self.world_size)]
            deadline = time.monotonic() + self.timeout_s
            while not all(m.is_file() for m in markers):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"ranks did not finish writing {tmp} within {self.timeout_s:.0f} s")
                time.sleep(0.05)
            for marker in markers:
                marker.unlink()
            _commit(tmp, final, payload, self.keep_last)
            if self.on_saved is not None:
                self.on_saved(final)
        except BaseException as exc:  # raised on the training thread by the next save / wait
            self._error = exc


def prune_checkpoints(root: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and stale temp folders)."""
    removed = []
    for child in [*root.glob(".tmp-step-*"), *root.glob(".tmp-deleting-*")]:
        shutil.rmtree(child, ignore_errors=True)
    if keep_last is None:
        return removed
    for _, path in list_checkpoints(root)[:-keep_last]:
        # renamed first: a kill during the delete must not leave a "complete" half-deleted checkpoint
        doomed = path.with_name(f".tmp-deleting-{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


@dataclass
class LoadedCheckpoint:
    path: Path
    train_state: dict[str, Any]
    rank_state: dict[str, Any]
    rank_tensors: dict[str, torch.Tensor]
    model_state: dict[str, torch.Tensor]
    ema_state: dict[str, torch.Tensor] | None
    optimizer_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    is_lora: bool = False
    """``model_state`` / ``ema_state`` hold LoRA adapter tensors (keys ``<module>.lora_{A,B}.weight``)."""


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from pfctl.models.lora import ADAPTER_WEIGHTS, read_adapter_files

    if (folder / ADAPTER_WEIGHTS).is_file():
        return read_adapter_files(folder)[0]
    return load_tensors(folder / MODEL_WEIGHTS)


def load_checkpoint(path: str | os.PathLike[str], *, rank: int) -> LoadedCheckpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (every rank reads its own rank files)."""
    path = Path(path)
    try:
        train_state = json.loads((path / "train_state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path / 'train_state.json'}: {exc}") from None
    if train_state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format_version {train_state.get('format_version')}, "
            f"this pfctl reads {FORMAT_VERSION}"
        )
    rank_json = path / "ranks" / f"rank-{rank:05d}.json"
    if not rank_json.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no state for rank {rank} (it was written by "
            f"{train_state.get('world_size')} processes)",
            hint="resume with the same number of processes and train.video_sync_group",
        )
    optimizer_state = None
    if (path / "optimizer.json").is_file():
        meta = json.loads((path / "optimizer.json").read_text())
        optimizer_state = optimizer_from_files(load_tensors(path / "optimizer.safetensors"), meta)
    scheduler_file = path / "lr_scheduler.json"
    from pfctl.models.lora import ADAPTER_WEIGHTS

    return LoadedCheckpoint(
        path=path,
        train_state=train_state,
        rank_state=json.loads(rank_json.read_text()),
        rank_tensors=load_tensors(path / "ranks" / f"rank-{rank:05d}.safetensors"),
        model_state=_load_weights(path / "model"),
        ema_state=_load_weights(path / "ema") if (path / "ema").is_dir() else None,
        optimizer_state=optimizer_state,
        scheduler_state=json.loads(scheduler_file.read_text()) if scheduler_file.is_file() else None,
        is_lora=(path / "model" / ADAPTER_WEIGHTS).is_file(),
    )
