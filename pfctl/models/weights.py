"""Safe loading of weight files, strict key/shape checks, and conversion to safetensors.

Why this module exists: model folders in the wild ship pickled ``.bin`` files (the official Pyramid
Flow VAE does). Unpickling runs arbitrary code, so pfctl reads pickles only through
``torch.load(..., weights_only=True)``, which refuses anything but tensors and plain containers.
Every failure names the file and, for key problems, the key, so a user can tell a truncated
download from a wrong folder.

Lookup order in a folder (first match wins; safetensors always beats pickles, so a folder
converted with :func:`convert_folder_to_safetensors` never unpickles again):

1. ``<stem>.safetensors``          2. ``<stem>.safetensors.index.json`` (sharded)
3. ``<stem>.bin`` / ``.pt`` / ``.pth`` / ``.ckpt``   4. ``<stem>.bin.index.json`` (sharded pickles)

``stem`` defaults to ``diffusion_pytorch_model`` (diffusers); when no file with the stem exists,
a folder holding exactly one weight file (or one index) of any name is accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from pfctl.errors import ModelLoadError
from pfctl.utils.io import atomic_save_safetensors, atomic_write_json

__all__ = [
    "PICKLE_SUFFIXES",
    "LoadedWeights",
    "check_state_dict",
    "convert_folder_to_safetensors",
    "find_weight_files",
    "load_folder_weights",
    "load_into_module",
    "load_weight_file",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
DEFAULT_STEM = "diffusion_pytorch_model"
_WRAPPER_KEYS = ("state_dict", "model", "module")

_TRUST_HINT = (
    "pfctl only unpickles plain tensors (torch.load weights_only=True); a file that needs more is either "
    "not a weight file or was saved with custom objects. Load it only if you trust its source, re-save its "
    "state_dict as safetensors, and retry"
)


@dataclass
class LoadedWeights:
    """A state dict plus, for every key, the file it came from (for error messages)."""

    tensors: dict[str, Tensor]
    sources: dict[str, Path] = field(default_factory=dict)
    description: str = ""

    def source_of(self, key: str) -> str:
        return str(self.sources.get(key, self.description or "<state dict>"))


def _is_pickle(path: Path) -> bool:
    return path.name.endswith(PICKLE_SUFFIXES)


def load_weight_file(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read one weight file: safetensors directly, pickles only via ``weights_only=True``.

    A pickled checkpoint that wraps its weights in ``{"state_dict": ...}`` (or ``model`` /
    ``module``) is unwrapped. Raises ``ModelLoadError`` naming the file on any failure.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"weight file not found: {path}", hint="check the model folder path")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(
                f"cannot read safetensors file {path}: {exc}",
                hint="the file may be truncated (interrupted download); download it again",
            ) from exc
    if not _is_pickle(path):
        raise ModelLoadError(
            f"unknown weight file type: {path}",
            hint=f"expected .safetensors or a pickled torch file ({', '.join(PICKLE_SUFFIXES)})",
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"refused to unpickle {path}: it contains objects other than tensors ({first_line})",
            hint=_TRUST_HINT,
        ) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot read pickled weight file {path}: {exc}",
            hint="the file may be truncated or not a torch checkpoint",
        ) from exc
    return _as_state_dict(obj, path)


def _as_state_dict(obj: object, path: Path) -> dict[str, Tensor]:
    if isinstance(obj, Mapping):
        if not any(isinstance(v, Tensor) for v in obj.values()):
            for key in _WRAPPER_KEYS:
                if isinstance(obj.get(key), Mapping):
                    return _as_state_dict(obj[key], path)
        bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
        if not bad:
            return dict(obj)
        raise ModelLoadError(
            f"{path} is not a flat state dict: entry {bad[0]!r} is not a named tensor",
            hint="save model.state_dict() (name -> tensor) only",
        )
    raise ModelLoadError(
        f"{path} holds a {type(obj).__name__}, not a state dict",
        hint="save model.state_dict() (name -> tensor)",
    )


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"invalid shard index {path}: {exc}", hint="the index must be JSON with a 'weight_map' object"
        ) from exc
    return {str(k): str(v) for k, v in weight_map.items()}


def find_weight_files(
    folder: str | os.PathLike[str], stem: str = DEFAULT_STEM
) -> tuple[list[Path], Path | None]:
    """The weight files to read from ``folder`` (see the module docstring for the order).

    Returns ``(files, index)``; ``index`` is the shard index when the weights are sharded.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder not found: {folder}", hint="check the path")

    def sharded(index: Path) -> tuple[list[Path], Path]:
        names = sorted(set(_read_index(index).values()))
        files = [folder / n for n in names]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"shard {missing[0].name} listed in {index} is missing from {folder}",
                hint="the download is incomplete; fetch every shard listed in the index",
            )
        return files, index

    candidates = [f"{stem}.safetensors", f"{stem}.safetensors.index.json"]
    candidates += [f"{stem}{s}" for s in PICKLE_SUFFIXES] + [f"{stem}.bin.index.json"]
    for name in candidates:
        path = folder / name
        if path.is_file():
            return sharded(path) if name.endswith(".index.json") else ([path], None)

    # no file with the expected stem: accept one unambiguous index or weight file of any name
    groups = (
        sorted(folder.glob("*.safetensors.index.json")),
        sorted(folder.glob("*.safetensors")),
        sorted(folder.glob("*.bin.index.json")),
        sorted(p for s in PICKLE_SUFFIXES for p in folder.glob(f"*{s}")),
    )
    for group in groups:
        if len(group) == 1:
            path = group[0]
            return sharded(path) if path.name.endswith(".index.json") else ([path], None)
        if len(group) > 1:
            raise ModelLoadError(
                f"{folder} holds several candidate weight files ({', '.join(p.name for p in group[:4])}) "
                "and none is named as expected",
                hint=f"name the weights {stem}.safetensors, or keep one shard index next to its shards",
            )
    raise ModelLoadError(
        f"no weight file in {folder}",
        hint=f"expected {stem}.safetensors (or .bin), or a sharded *.index.json with its shards",
    )


def load_folder_weights(folder: str | os.PathLike[str], stem: str = DEFAULT_STEM) -> LoadedWeights:
    """Load every tensor of a model folder (single file or shards), remembering each key's file."""
    files, index = find_weight_files(folder, stem)
    tensors: dict[str, Tensor] = {}
    sources: dict[str, Path] = {}
    expected = _read_index(index) if index is not None else None
    for path in files:
        for key, value in load_weight_file(path).items():
            if key in tensors:
                raise ModelLoadError(
                    f"key {key!r} appears in both {sources[key]} and {path}",
                    hint="the shards overlap; re-download or re-save the checkpoint",
                )
            tensors[key] = value
            sources[key] = path
    if expected is not None:
        for key, name in expected.items():
            if key not in tensors:
                raise ModelLoadError(
                    f"key {key!r} is listed in {index} for {name} but {Path(folder) / name} does not contain it",
                    hint="the shard does not match its index; re-download the checkpoint",
                )
    return LoadedWeights(tensors, sources, description=str(files[0] if len(files) == 1 else index))


def check_state_dict(
    module: nn.Module, weights: LoadedWeights | Mapping[str, Tensor], *, strict: bool = True
) -> None:
    """Raise ``ModelLoadError`` naming the key and the file on a missing/unexpected key or shape mismatch.

    Missing keys are always errors (a half-loaded model produces garbage); unexpected keys only
    with ``strict``.
    """
    if not isinstance(weights, LoadedWeights):
        weights = LoadedWeights(dict(weights))
    expected = module.state_dict()
    missing = [k for k in expected if k not in weights.tensors]
    if missing:
        where = weights.description or "the weights"
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"weight key {missing[0]!r}{more} missing from {where}",
            hint="the weights belong to a different model or config; check config.json and the files",
        )
    if strict:
        unexpected = [k for k in weights.tensors if k not in expected]
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise ModelLoadError(
                f"unexpected weight key {unexpected[0]!r}{more} in {weights.source_of(unexpected[0])}",
                hint="the weights belong to a different model or config; check config.json",
            )
    for key, ref in expected.items():
        got = weights.tensors[key]
        if tuple(got.shape) != tuple(ref.shape):
            raise ModelLoadError(
                f"shape mismatch for weight {key!r} in {weights.source_of(key)}: file has "
                f"{tuple(got.shape)}, model expects {tuple(ref.shape)}",
                hint="config.json does not match these weights (channel widths / layer counts)",
            )


def load_into_module(
    module: nn.Module,
    weights: LoadedWeights | Mapping[str, Tensor],
    *,
    strict: bool = True,
    assign: bool = False,
) -> nn.Module:
    """Check then load ``weights`` into ``module``.

    ``assign=True`` replaces the module's (e.g. meta-device) tensors by the loaded ones instead
    of copying into them; cast/move the module afterwards.
    """
    check_state_dict(module, weights, strict=strict)
    tensors = weights.tensors if isinstance(weights, LoadedWeights) else dict(weights)
    if not strict:
        own = module.state_dict()
        tensors = {k: v for k, v in tensors.items() if k in own}
    module.load_state_dict(tensors, strict=True, assign=assign)
    return module


def _safetensors_name(name: str) -> str:
    for suffix in PICKLE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".safetensors"
    raise ValueError(name)


def _detached_copies(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    # safetensors refuses tensors that share storage (tied weights); give each its own copy
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}


def convert_folder_to_safetensors(
    folder: str | os.PathLike[str], *, remove_pickles: bool = False
) -> list[Path]:
    """Write a ``.safetensors`` twin of every pickled weight file in ``folder`` (and of a pickle index).

    Pickles are read with ``weights_only=True``. Shard indexes ``*.bin.index.json`` get a
    ``*.safetensors.index.json`` twin pointing at the new files. Files are written atomically;
    originals are kept unless ``remove_pickles``. Since safetensors win the lookup, loading the
    folder afterwards never unpickles. Returns the files written.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder not found: {folder}", hint="check the path")
    pickles = sorted(p for s in PICKLE_SUFFIXES for p in folder.glob(f"*{s}") if p.is_file())
    written: list[Path] = []
    for path in pickles:
        target = path.with_name(_safetensors_name(path.name))
        atomic_save_safetensors(_detached_copies(load_weight_file(path)), target, metadata={"format": "pt"})
        written.append(target)
    for index in sorted(folder.glob("*.bin.index.json")):
        data = json.loads(index.read_text(encoding="utf-8"))
        _read_index(index)  # validates
        data["weight_map"] = {k: _safetensors_name(v) for k, v in data["weight_map"].items()}
        target = index.with_name(index.name.replace(".bin.index.json", ".safetensors.index.json"))
        atomic_write_json(target, data)
        written.append(target)
    if remove_pickles:
        for path in [*pickles, *sorted(folder.glob("*.bin.index.json"))]:
            path.unlink()
    return written


_DIGEST_EDGE = 1 << 20


def file_digest(path: str | os.PathLike[str]) -> str:
    """A cheap content digest: full sha256 up to 2 MiB, else size + first and last MiB.

    Hashing a 9 GB T5 on every load would take longer than loading it; name + size + both ends
    catches re-downloads, truncation and swapped files, which is what fingerprints are for.
    """
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        if size <= 2 * _DIGEST_EDGE:
            digest.update(fh.read())
        else:
            digest.update(fh.read(_DIGEST_EDGE))
            fh.seek(size - _DIGEST_EDGE)
            digest.update(fh.read(_DIGEST_EDGE))
    return digest.hexdigest()[:16]


def folder_digest(folder: str | os.PathLike[str]) -> str:
    """:func:`file_digest` of every (non-hidden) file under ``folder``, by relative path."""
    from pfctl.utils.io import fingerprint

    folder = Path(folder)
    entries = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            entries[rel.as_posix()] = file_digest(p)
    return fingerprint(entries)
