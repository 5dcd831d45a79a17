"""Annotation inputs: a JSONL file, a CSV file, or a folder of media with ``.txt`` captions.

Every input becomes an :class:`Item` (one video or one image with its caption). Structural
problems — a missing file, a missing column, malformed JSON, duplicated ids — are
:class:`InputError` (exit 2) naming the file and line, because no run could succeed with them.
Problems with a single media file (missing, corrupt, too short) are found later, per item, and
only skip that item.

Relative media paths resolve against the annotation file's folder, so an annotation file and
its videos can move together.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pfctl.errors import InputError

VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".flv", ".ts"})
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})
_KNOWN_KEYS = ("id", "video", "image", "text", "frames", "fps")
_MAX_LISTED = 5


@dataclass(frozen=True)
class Item:
    """One annotated input.

    ``line`` is the 1-based line (JSONL), row (CSV, header = line 1) or file index (folder) that
    produced it, so every message can point at the annotation.
    """

    id: str
    kind: str  # "video" | "image"
    path: Path
    text: str
    line: int
    source: str  # the path as written in the annotation
    frames: tuple[int, ...] | None = None
    fps: float | None = None


def load_annotations(path: str | Path) -> list[Item]:
    """Read and validate an annotation file or folder. Raises :class:`InputError`."""
    path = _expand(path, "annotations")
    if not path.exists():
        raise InputError(
            f"annotation file {path} does not exist",
            hint="pass --annotations FILE.jsonl|FILE.csv|FOLDER (or set encode.annotations)",
        )
    if path.is_dir():
        items = _read_folder(path)
    elif path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        items = _read_jsonl(path)
    elif path.suffix.lower() in (".csv", ".tsv"):
        items = _read_csv(path)
    else:
        raise InputError(
            f"annotation file {path} has an unknown type '{path.suffix}'",
            hint="use a .jsonl or .csv file, or a folder of videos with same-name .txt captions",
        )
    _check_unique_ids(items, path)
    return items


# --------------------------------------------------------------------------------------------- rows


def _parse_frames(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            value = (
                json.loads(text) if text.startswith("[") else [int(v) for v in text.replace(",", " ").split()]
            )
        except ValueError:
            raise InputError(
                f"{where}: 'frames' = {value!r} is not a list of frame indices",
                hint='write e.g. [0, 2, 4] (JSONL) or "0 2 4" (CSV)',
            ) from None
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and v >= 0 for v in value):
        raise InputError(
            f"{where}: 'frames' must be a non-empty list of frame indices >= 0, got {value!r}",
            hint="or leave it out to resample the whole video to encode.fps",
        )
    return tuple(value)


def _parse_fps(value: Any, where: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        fps = float(value)
    except (TypeError, ValueError):
        fps = math.nan
    if not math.isfinite(fps) or fps <= 0:
        raise InputError(f"{where}: 'fps' must be a positive number, got {value!r}")
    return fps


def derive_id(media: str) -> str:
    """The id of a row without ``id``: its media path without the suffix (``clips/a.mp4`` → ``clips/a``)."""
    return str(Path(media).with_suffix("")).replace("\\", "/")


def _make_item(row: dict[str, Any], base: Path, line: int, where: str) -> Item:
    video, image = row.get("video"), row.get("image")
    if video not in (None, "") and image not in (None, ""):
        raise InputError(f"{where}: a row has either 'video' or 'image', not both")
    media, kind = (video, "video") if video not in (None, "") else (image, "image")
    if media in (None, ""):
        raise InputError(
            f"{where}: missing 'video' (or 'image') path",
            hint="each row needs a 'video' or 'image' path and a 'text' caption",
        )
    if not isinstance(media, str):
        raise InputError(f"{where}: '{kind}' must be a path string, got {media!r}")
    text = row.get("text")
    if text is None:
        raise InputError(f"{where}: missing 'text' caption", hint="use an empty string for no caption")
    if not isinstance(text, str):
        raise InputError(f"{where}: 'text' must be a string, got {type(text).__name__}")
    raw_id = row.get("id")
    item_id = derive_id(media) if raw_id in (None, "") else str(raw_id)
    for key, value in (("text", text), ("id", item_id), (kind, media)):
        _check_utf8(value, key, where)
    media_path = _expand(media, where)
    if not media_path.is_absolute():
        media_path = base / media_path
    return Item(
        id=item_id,
        kind=kind,
        path=media_path,
        text=text,
        line=line,
        source=media,
        frames=_parse_frames(row.get("frames"), where) if kind == "video" else None,
        fps=_parse_fps(row.get("fps"), where) if kind == "video" else None,
    )


def _expand(path: str | Path, where: str) -> Path:
    """``~`` / ``~user`` expansion; an unknown user is a bad input, not a crash."""
    try:
        return Path(path).expanduser()
    except RuntimeError as exc:
        raise InputError(f"{where}: cannot expand {str(path)!r}: {exc}", hint="write the full path") from None


def _check_utf8(value: str, key: str, where: str) -> None:
    """JSON can carry lone surrogates (``"\\ud800"``) that no file or safetensors header can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"{where}: '{key}' is not valid UTF-8 text ({exc.reason} at position {exc.start})",
            hint="fix the escape sequence in the annotation (a lone \\uD800-\\uDFFF surrogate)",
        ) from None


def _read_utf8(path: Path, what: str) -> str:
    """The file's text; bytes that are not UTF-8 are reported by line and column (1-based)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {column}, "
            f"file offset {exc.start})",
            hint="save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None


def _read_jsonl(path: Path) -> list[Item]:
    items: list[Item] = []
    lines = _read_utf8(path, "annotation file").splitlines()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(
                f"{where}: not valid JSON ({exc.msg})", hint="each line must be one JSON object"
            ) from None
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(row).__name__}")
        items.append(_make_item(row, path.parent, number, where))
    if not items:
        raise InputError(f"annotation file {path} has no rows")
    return items


def _read_csv(path: Path) -> list[Item]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    text = _read_utf8(path, "annotation file")
    try:
        with io.StringIO(text, newline="") as fh:
            reader = csv.DictReader(fh, delimiter=delimiter)
            columns = [c.strip() for c in (reader.fieldnames or [])]
            media_cols = [c for c in ("video", "image") if c in columns]
            if not media_cols or "text" not in columns:
                missing = [
                    c for c in ("video", "text") if c not in columns and not (c == "video" and media_cols)
                ]
                raise InputError(
                    f"{path}: missing column(s) {', '.join(repr(c) for c in missing)}; "
                    f"found {', '.join(repr(c) for c in columns) or 'none'}",
                    hint=f"the header needs 'video' (or 'image') and 'text'; optional: {', '.join(_KNOWN_KEYS[3:])}, 'id'",
                )
            rows = list(reader)
    except csv.Error as exc:
        raise InputError(f"{path}: malformed CSV ({exc})") from None
    items = []
    for number, row in enumerate(rows, start=2):
        clean = {(k or "").strip(): v for k, v in row.items()}
        if None in row:  # more fields than header columns
            raise InputError(
                f"{path}:{number}: more fields than columns", hint="quote captions that contain commas"
            )
        items.append(_make_item(clean, path.parent, number, f"{path}:{number}"))
    if not items:
        raise InputError(f"annotation file {path} has no rows")
    return items


def _read_folder(folder: Path) -> list[Item]:
    media = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES | IMAGE_SUFFIXES and not p.name.startswith(".")
    )
    if not media:
        raise InputError(
            f"folder {folder} has no videos or images",
            hint=f"supported: {', '.join(sorted(VIDEO_SUFFIXES | IMAGE_SUFFIXES))}",
        )
    missing = [p for p in media if not p.with_suffix(".txt").is_file()]
    if missing:
        listed = ", ".join(str(p.relative_to(folder)) for p in missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise InputError(
            f"{len(missing)} file(s) in {folder} have no caption: {listed}{more}",
            hint="add a same-name .txt caption next to each (e.g. a.mp4 → a.txt), or use a JSONL annotation file",
        )
    items = []
    for index, p in enumerate(media, start=1):
        rel = p.relative_to(folder).as_posix()
        text = _read_utf8(p.with_suffix(".txt"), "caption").strip()
        kind = "video" if p.suffix.lower() in VIDEO_SUFFIXES else "image"
        items.append(Item(id=derive_id(rel), kind=kind, path=p, text=text, line=index, source=rel))
    return items


def _check_unique_ids(items: list[Item], path: Path) -> None:
    first: dict[str, Item] = {}
    for item in items:
        if item.id in first:
            other = first[item.id]
            unit = "file" if path.is_dir() else "line"
            raise InputError(
                f"duplicated id '{item.id}' in {path}: {unit} {other.line} ({other.source}) and "
                f"{unit} {item.line} ({item.source})",
                hint="give each row a distinct 'id' (rows without one use their media path without suffix)",
            )
        first[item.id] = item
