"""Atomic writes and stable hashes.

Every file pfctl writes goes to a temporary name in the same folder and is renamed into
place, so a killed process never leaves a half file that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pfctl.runtime import faults

if TYPE_CHECKING:
    import torch


def current_umask() -> int:
    """The process umask, read without changing it (``/proc/self/status`` on Linux).

    ``os.umask`` can only be read by setting it; between the two calls another thread's files would
    be created under the wrong mask, so that is only the fallback where ``/proc`` has no ``Umask:`` line.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _atomic_target(path: str | os.PathLike[str]) -> tuple[Path, int, str]:
    """A temp file next to ``path``, with the mode a plain ``open(path, "w")`` would give it.

    ``mkstemp`` creates 0600 whatever the umask; the file is renamed into place, so without the
    ``fchmod`` every file pfctl writes would be owner-only.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return path, fd, tmp


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename).

    On any failure (disk full, read-only folder, a kill) the temp file is removed or left as a
    ``.*.tmp`` that readers never open, and ``path`` keeps its old content. An ``OSError`` names
    ``path`` (not the temp name) so the message says which file could not be written.
    """
    try:
        target, fd, tmp = _atomic_target(path)
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            view = memoryview(data)
            half = len(view) // 2
            fh.write(view[:half])
            faults.fault("write", path=target.as_posix())  # test hook: e.g. disk full mid-write
            fh.write(view[half:])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _naming(exc, target) from None
        raise
    return target


def _naming(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """The same error (errno kept) with ``filename`` = the file the caller asked to write."""
    if exc.errno is None:
        return exc
    return type(exc)(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def replace_dir(staging: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Move the finished folder ``staging`` to ``out``, replacing any folder there.

    The old folder is first renamed aside (same parent), so ``out`` is always either the old or
    the new complete folder, never a mix; the old one is deleted afterwards. ``staging`` gets the
    mode a plain ``mkdir`` would give ``out`` (``tempfile.mkdtemp`` makes it 0700 whatever the umask).
    """
    staging, out = Path(staging), Path(out)
    os.chmod(staging, 0o777 & ~current_umask())
    if out.exists():
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, trash)
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)
    return out


def atomic_save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> Path:
    """``safetensors.torch.save`` to bytes, then an atomic write (tensors made contiguous)."""
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    return atomic_write_bytes(path, data)


def sha256_file(path: str | os.PathLike[str], chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(obj: Any, length: int = 16) -> str:
    """A stable short hash of JSON-able data (sorted keys), e.g. a config or a provenance record."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:length]


def tensor_fingerprint(tensors: dict[str, torch.Tensor], length: int = 16) -> str:
    """A stable hash of a state dict's names, shapes, dtypes and bytes."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:length]
