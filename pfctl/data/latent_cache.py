"""The latent cache: what encode-latents writes and the trainer reads (through :class:`LatentCache` only).

Layout of a cache folder::

    cache.json               header: format, format_version, fingerprint, provenance, VAE + normalisation
    manifest.jsonl           one row per clip (id, path, shapes, bucket, frames ...), sorted by id
    null_text.safetensors    the empty-prompt embedding (caption dropout / guidance), if text is cached
    clips/ab/<id>-<hash>.safetensors   one file per clip: tensors + string metadata
    failures.jsonl           inputs the last run skipped, with a reason
    .parts/                  per-rank manifest parts while a run is in flight (merged, then removed)

Clip tensors have no batch dimension: ``latent_mean`` / ``latent_std`` (or ``latent_sample``)
[C, T, h, w] bf16 — raw VAE posterior statistics, NOT normalised (the trainer applies the VAE
adapter's rule recorded in the header) — and ``prompt_embeds`` [L, D], ``prompt_attention_mask``
[L] int64, ``pooled_prompt_embeds`` [Dp].

The *fingerprint* hashes everything that changes the latents: the VAE (config + weights), the
text encoder's identity, the preprocessing parameters and the format version. A run whose
fingerprint differs from the folder's refuses to mix the two. Every file is written atomically
and each clip file carries the fingerprint too, so a killed run leaves only whole, attributable
files, and the manifest can be rebuilt from them.

Clip ids come from annotations (user text); file names are sanitised and hashed, and every path
read back is checked to stay inside the cache folder.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from pfctl.errors import CacheError
from pfctl.utils.io import atomic_save_safetensors, atomic_write_json, atomic_write_text

FORMAT_NAME = "pfctl-latent-cache"
FORMAT_VERSION = 1
HEADER_FILE = "cache.json"
MANIFEST_FILE = "manifest.jsonl"
NULL_TEXT_FILE = "null_text.safetensors"
FAILURES_FILE = "failures.jsonl"
CLIPS_DIR = "clips"
PARTS_DIR = ".parts"

LATENT_KEYS_MEAN_STD = ("latent_mean", "latent_std")
LATENT_KEYS_SAMPLE = ("latent_sample",)
TEXT_KEYS = ("prompt_embeds", "prompt_attention_mask", "pooled_prompt_embeds")
_OWNED = (HEADER_FILE, MANIFEST_FILE, NULL_TEXT_FILE, FAILURES_FILE, CLIPS_DIR, PARTS_DIR)
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_NEW_FOLDER_HINT = "pass --overwrite to re-encode into this folder, or --output-dir NEW_FOLDER to keep both"


# ------------------------------------------------------------------------------------------ names


def clip_relpath(clip_id: str) -> str:
    """Where a clip lives, relative to the cache root: ``clips/<h2>/<sanitised id>-<h10>.safetensors``.

    The id is reduced to ``[A-Za-z0-9._-]`` (no separators, no leading dots) and suffixed with a
    hash of the *original* id, so ``../../x``, ``a/b`` and ``a_b`` all stay inside ``clips/`` and
    never collide, even on case-insensitive file systems.
    """
    digest = hashlib.sha1(clip_id.encode("utf-8")).hexdigest()
    stem = _SAFE.sub("_", clip_id).strip("._-")[:80] or "clip"
    return f"{CLIPS_DIR}/{digest[:2]}/{stem}-{digest[:10]}.safetensors"


def _inside(root: Path, rel: str) -> Path:
    """``root / rel``, refusing anything that resolves outside ``root`` (a tampered manifest)."""
    base = root.resolve()
    path = (base / rel).resolve()
    if not path.is_relative_to(base):
        raise CacheError(
            f"cache entry path {rel!r} points outside the cache folder {root}",
            hint="the manifest was edited or corrupted; re-run encode-latents to rebuild it",
        )
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise CacheError(
                f"{path}:{number} is not valid JSON", hint="re-run encode-latents to rebuild the manifest"
            ) from None
    return rows


def _jsonl(rows: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows)


# ------------------------------------------------------------------------------------------ header


def read_header(root: str | Path) -> dict[str, Any] | None:
    """The folder's ``cache.json`` or None when there is none. Raises :class:`CacheError` if unreadable."""
    path = Path(root) / HEADER_FILE
    if not path.is_file():
        return None
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CacheError(f"cannot read cache header {path}: {exc}", hint=_NEW_FOLDER_HINT) from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise CacheError(f"{path} is not a pfctl latent cache header", hint=_NEW_FOLDER_HINT)
    return header


def describe_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Which provenance parts differ, e.g. ``preprocessing.fps (24 → 30), vae``."""
    old_p, new_p = old.get("provenance", {}), new.get("provenance", {})
    parts = []
    for section in sorted(set(old_p) | set(new_p)):
        a, b = old_p.get(section), new_p.get(section)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            shown = [f"{section}.{k} ({a.get(k)!r} → {b.get(k)!r})" for k in keys[:4]]
            parts.append(", ".join(shown) + (" ..." if len(keys) > 4 else ""))
        else:
            parts.append(section)
    return "; ".join(parts) or "unknown fields"


def prepare_folder(root: str | Path, header: dict[str, Any], *, overwrite: bool = False) -> str:
    """Check that ``root`` can take a run with ``header``; return ``"new"``, ``"resume"`` or ``"overwrite"``.

    Read-only, so every rank can call it and fail the same way before anything is written.
    A folder with files but no header is refused even with ``overwrite`` (it is not ours to delete).
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CacheError(f"output path {root} exists and is not a folder", hint="choose another --output-dir")
    existing = read_header(root) if root.is_dir() else None
    if existing is None:
        others = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        if others:
            raise CacheError(
                f"output folder {root} is not empty and is not a pfctl latent cache "
                f"(found {', '.join(others[:5])}{' ...' if len(others) > 5 else ''})",
                hint="choose an empty or new --output-dir",
            )
        return "new"
    if overwrite:
        return "overwrite"
    if existing.get("format_version") != header["format_version"]:
        raise CacheError(
            f"cache {root} has format_version {existing.get('format_version')}, this pfctl writes "
            f"{header['format_version']}; the two cannot be mixed",
            hint=_NEW_FOLDER_HINT,
        )
    if existing.get("fingerprint") != header["fingerprint"]:
        raise CacheError(
            f"cache {root} was made with different settings (fingerprint {existing.get('fingerprint')} ≠ "
            f"{header['fingerprint']}): {describe_difference(existing, header)}; refusing to mix the two",
            hint=_NEW_FOLDER_HINT,
        )
    return "resume"


def remove_stale_temp_files(root: str | Path) -> int:
    """Delete half-written temp files a killed run left (atomic writes never rename them into place)."""
    removed = 0
    for path in [*Path(root).glob(".*.tmp"), *Path(root).glob(f"{CLIPS_DIR}/*/.*.tmp")]:
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def clear_folder(root: str | Path) -> None:
    """Delete what a previous run wrote (only pfctl's own files) — the ``--overwrite`` path."""
    root = Path(root)
    for name in _OWNED:
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# ------------------------------------------------------------------------------------------ writer


def _clip_metadata(path: Path) -> tuple[dict[str, str], dict[str, list[int]], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
        shapes, dtypes = {}, {}
        for key in fh.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
            sl = fh.get_slice(key)
            shapes[key] = list(sl.get_shape())
            dtypes[key] = str(sl.get_dtype())
    return meta, shapes, dtypes


def manifest_row(
    clip_id: str, rel: str, meta: dict[str, str], shapes: dict[str, list[int]]
) -> dict[str, Any]:
    """The manifest row of a clip (derived from its file, so it can always be rebuilt)."""
    latent_key = "latent_mean" if "latent_mean" in shapes else "latent_sample"
    c, t, h, w = shapes[latent_key]
    return {
        "id": clip_id,
        "path": rel,
        "item_id": meta.get("item_id", clip_id),
        "kind": meta.get("kind", "video"),
        "num_frames": int(meta.get("num_frames", 0)),
        "num_latent_frames": t,
        "latent_channels": c,
        "height": h,
        "width": w,
        "bucket": meta.get("bucket", ""),
        "fps": float(meta.get("fps", 0.0)),
        "has_text": "prompt_embeds" in shapes,
        "shapes": shapes,
    }


class LatentCacheWriter:
    """Writes clip files into a prepared cache folder. One instance per rank; ranks never share a file.

    ``write`` is atomic per clip; the manifest is only (re)written by :func:`merge_parts` on the
    main process, from every rank's part file.
    """

    def __init__(self, root: str | Path, header: dict[str, Any], rank: int = 0) -> None:
        self.root = Path(root)
        self.header = header
        self.fingerprint = header["fingerprint"]
        self.rank = rank

    # -- setup (main process) ------------------------------------------------------------------
    def write_header(self) -> None:
        atomic_write_json(self.root / HEADER_FILE, self.header)

    def write_null_text(self, tensors: dict[str, torch.Tensor]) -> None:
        meta = {"fingerprint": self.fingerprint, "format_version": str(FORMAT_VERSION)}
        atomic_save_safetensors(tensors, self.root / NULL_TEXT_FILE, metadata=meta)

    # -- clips -----------------------------------------------------------------------------------
    def path(self, clip_id: str) -> Path:
        return self.root / clip_relpath(clip_id)

    def finished_row(self, clip_id: str) -> dict[str, Any] | None:
        """The manifest row of an already written clip of *this* fingerprint, else None.

        A file of another fingerprint or an unreadable file counts as not finished (it is
        replaced); that can only happen after ``clear_folder`` raced with a reader.
        """
        path = self.path(clip_id)
        if not path.is_file():
            return None
        try:
            meta, shapes, _ = _clip_metadata(path)
        except Exception:
            return None
        if meta.get("fingerprint") != self.fingerprint or meta.get("id") != clip_id:
            return None
        return manifest_row(clip_id, clip_relpath(clip_id), meta, shapes)

    def write(
        self, clip_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> dict[str, Any]:
        """Write one clip atomically; return its manifest row."""
        rel = clip_relpath(clip_id)
        meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
        meta.update(id=clip_id, fingerprint=self.fingerprint, format_version=str(FORMAT_VERSION))
        atomic_save_safetensors(tensors, _inside(self.root, rel), metadata=meta)
        shapes = {k: list(v.shape) for k, v in tensors.items()}
        return manifest_row(clip_id, rel, meta, shapes)

    # -- end of run ------------------------------------------------------------------------------
    def write_part(
        self, rows: list[dict[str, Any]], failures: list[dict[str, Any]], stats: dict[str, Any]
    ) -> None:
        """This rank's share of the manifest and failures; the stats file is written last (the signal)."""
        parts = self.root / PARTS_DIR
        atomic_write_text(parts / f"manifest.rank{self.rank:05d}.jsonl", _jsonl(rows))
        atomic_write_text(parts / f"failures.rank{self.rank:05d}.jsonl", _jsonl(failures))
        atomic_write_json(parts / f"stats.rank{self.rank:05d}.json", stats)


def wait_for_parts(
    root: str | Path, world_size: int, poll_s: float = 0.5, timeout_s: float | None = None
) -> list[dict]:
    """Wait (by polling files, not a collective, so a slow rank cannot time out a barrier) until
    every rank has written its stats part; return the stats in rank order."""
    parts = Path(root) / PARTS_DIR
    start = time.monotonic()
    while True:
        paths = [parts / f"stats.rank{r:05d}.json" for r in range(world_size)]
        if all(p.is_file() for p in paths):
            return [json.loads(p.read_text(encoding="utf-8")) for p in paths]
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            missing = [r for r, p in enumerate(paths) if not p.is_file()]
            raise CacheError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
        time.sleep(poll_s)


def merge_parts(root: str | Path, world_size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Main process only: old manifest ∪ every rank's part → ``manifest.jsonl`` (one row per id, sorted),
    parts' failures → ``failures.jsonl``; then remove the parts. Returns (manifest rows, failures)."""
    root = Path(root)
    parts = root / PARTS_DIR
    by_id: dict[str, dict[str, Any]] = {}
    old = root / MANIFEST_FILE
    if old.is_file():
        for row in _read_jsonl(old):
            if _inside(root, row["path"]).is_file():
                by_id[row["id"]] = row
    failures: list[dict[str, Any]] = []
    for rank in range(world_size):
        for row in _read_jsonl(parts / f"manifest.rank{rank:05d}.jsonl"):
            by_id[row["id"]] = row
        failures.extend(_read_jsonl(parts / f"failures.rank{rank:05d}.jsonl"))
    rows = [by_id[k] for k in sorted(by_id)]
    atomic_write_text(root / MANIFEST_FILE, _jsonl(rows))
    atomic_write_text(
        root / FAILURES_FILE, _jsonl(sorted(failures, key=lambda f: (f.get("line", 0), f["id"])))
    )
    shutil.rmtree(parts, ignore_errors=True)
    return rows, failures


def rebuild_manifest(root: str | Path) -> list[dict[str, Any]]:
    """Rebuild ``manifest.jsonl`` from the clip files of the header's fingerprint (recovery tool)."""
    root = Path(root)
    header = read_header(root)
    if header is None:
        raise CacheError(f"{root} has no {HEADER_FILE}", hint="this folder is not a latent cache")
    rows = []
    for path in sorted((root / CLIPS_DIR).glob("*/*.safetensors")):
        try:
            meta, shapes, _ = _clip_metadata(path)
        except Exception:
            continue
        clip_id = meta.get("id")
        if clip_id is None or meta.get("fingerprint") != header["fingerprint"]:
            continue
        rows.append(manifest_row(clip_id, clip_relpath(clip_id), meta, shapes))
    rows.sort(key=lambda r: r["id"])
    atomic_write_text(root / MANIFEST_FILE, _jsonl(rows))
    return rows


def repair_manifest(root: str | Path) -> list[dict[str, Any]] | None:
    """Rebuild ``manifest.jsonl`` from the clip files when it cannot be read (cut mid-line by a full
    disk or a crash, or edited); return the rebuilt rows, or None when it reads (or does not exist).
    The clip files are the truth: each carries its id and fingerprint."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        rows = _read_jsonl(path)
        if all(isinstance(r, dict) and "id" in r and "path" in r for r in rows):
            return None
    except (CacheError, UnicodeDecodeError):
        pass
    return rebuild_manifest(root)


# ------------------------------------------------------------------------------------------ reader


class LatentCache:
    """Read-only view of a finished cache: the trainer's only way into it.

    >>> cache = LatentCache.open("cache/")
    >>> row = cache.items()[0]            # id, num_latent_frames, height, width, bucket, path, ...
    >>> tensors = cache.load(row["id"])   # latent_mean, latent_std, prompt_embeds, ...
    >>> null = cache.null_text()          # empty-prompt embedding for caption dropout
    """

    def __init__(self, root: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        self.root = root
        self._header = header
        self._rows = rows
        self._index = {r["id"]: i for i, r in enumerate(rows)}
        self._null: dict[str, torch.Tensor] | None = None

    @classmethod
    def open(cls, path: str | Path, *, fingerprint: str | None = None) -> LatentCache:
        """Open a cache folder; checks format and version (and ``fingerprint`` when given)."""
        root = Path(path).expanduser()
        if not root.is_dir():
            raise CacheError(
                f"latent cache {root} does not exist",
                hint="run `pfctl encode-latents -o FOLDER` first, or point the trainer at the cache folder",
            )
        header = read_header(root)
        if header is None:
            raise CacheError(
                f"{root} has no {HEADER_FILE}; it is not a latent cache",
                hint="run `pfctl encode-latents` first",
            )
        version = header.get("format_version")
        if version != FORMAT_VERSION:
            raise CacheError(
                f"latent cache {root} has format_version {version}; this pfctl reads {FORMAT_VERSION}",
                hint="re-encode it with this pfctl version (`pfctl encode-latents --overwrite`)",
            )
        if fingerprint is not None and header.get("fingerprint") != fingerprint:
            raise CacheError(
                f"latent cache {root} has fingerprint {header.get('fingerprint')}, expected {fingerprint}",
                hint="the cache was made with another VAE, text encoder or preprocessing; re-encode it",
            )
        manifest = root / MANIFEST_FILE
        if not manifest.is_file():
            raise CacheError(
                f"latent cache {root} has no {MANIFEST_FILE} (the encode run did not finish)",
                hint="re-run the same `pfctl encode-latents` command: it resumes and writes the manifest",
            )
        rows = _read_jsonl(manifest)
        for row in rows:
            _inside(root, row["path"])
        return cls(root, header, rows)

    # -- header ----------------------------------------------------------------------------------
    @property
    def header(self) -> dict[str, Any]:
        return self._header

    @property
    def fingerprint(self) -> str:
        return self._header["fingerprint"]

    @property
    def vae(self) -> dict[str, Any]:
        """The VAE adapter's name, factors and latent normalisation rule."""
        return self._header["vae"]

    @property
    def latent_keys(self) -> tuple[str, ...]:
        return tuple(self._header["latent_keys"])

    # -- rows ------------------------------------------------------------------------------------
    def items(self) -> list[dict[str, Any]]:
        """Manifest rows (copies), sorted by id."""
        return [dict(r) for r in self._rows]

    def ids(self) -> list[str]:
        return [r["id"] for r in self._rows]

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, clip_id: object) -> bool:
        return clip_id in self._index

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.items())

    def row(self, clip_id: str) -> dict[str, Any]:
        if clip_id not in self._index:
            raise CacheError(f"clip {clip_id!r} is not in latent cache {self.root}")
        return dict(self._rows[self._index[clip_id]])

    # -- tensors ---------------------------------------------------------------------------------
    def load(self, clip_id: str, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """A clip's tensors (no batch dimension): latents [C, T, h, w] and text features."""
        from safetensors.torch import load_file

        path = _inside(self.root, self.row(clip_id)["path"])
        try:
            return load_file(str(path), device=str(device))
        except FileNotFoundError:
            raise CacheError(
                f"clip file {path} of {clip_id!r} is missing", hint="re-run encode-latents to re-create it"
            ) from None
        except Exception as exc:
            raise CacheError(
                f"cannot read clip file {path}: {exc}", hint="re-run encode-latents --overwrite"
            ) from None

    def metadata(self, clip_id: str) -> dict[str, str]:
        """A clip's string metadata: source, frame_indices, fps, bucket, VAE class, chunking ..."""
        meta, _, _ = _clip_metadata(_inside(self.root, self.row(clip_id)["path"]))
        return meta

    def null_text(self) -> dict[str, torch.Tensor]:
        """The empty-prompt embedding (``prompt_embeds`` [L, D], mask [L], pooled [Dp]), loaded once."""
        if self._null is None:
            from safetensors.torch import load_file

            path = self.root / NULL_TEXT_FILE
            if not path.is_file():
                raise CacheError(
                    f"latent cache {self.root} has no {NULL_TEXT_FILE} (text was not encoded)",
                    hint="re-encode with encode.text=true to train with caption dropout",
                )
            self._null = load_file(str(path))
        return {k: v.clone() for k, v in self._null.items()}
