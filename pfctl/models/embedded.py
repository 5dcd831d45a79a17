"""The embedded default model: a tiny Pyramid Flow trained on synthetic shapes, shipped in the package.

``model.path: null`` (no ``--model``) means this model, so ``pfctl generate "a red circle moving
right"`` works right after ``pip install``. It lives in ``pfctl/assets/shapes-tiny/`` in the
official checkpoint layout (``causal_video_vae/``, ``diffusion_transformer_64p/``,
``text_encoder{,_2}/``, ``tokenizer{,_2}/``; safetensors only) plus ``manifest.json``:

* ``files`` — the sha256 and size of every file of the model. They are checked whenever the
  model is loaded (a few MB: milliseconds), so a truncated install or an edited weight file fails
  with a :class:`~pfctl.errors.ModelLoadError` naming the file instead of generating noise;
* ``variant`` / ``resolution`` — the DiT folder and the size (width, height) it was trained at;
* ``generate`` — the sampler settings the model was tuned with (steps, guidance, ``temp``, no
  aesthetic suffix or negative prompt: its captions never had them). ``pfctl generate`` uses them
  for every setting the user did not give (:func:`generate_defaults_for`);
* ``training`` — how the weights were made (``python -m pfctl.demo.build_default``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pfctl.errors import ModelLoadError

EMBEDDED_NAME = "shapes-tiny"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "pfctl-embedded-model"
MANIFEST_VERSION = 1
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_VARIANT = "diffusion_transformer_64p"

_HINT_REINSTALL = "reinstall pfctl (pip install --force-reinstall pfctl), or pass --model FOLDER"
_verified: dict[tuple[str, tuple[str, ...]], tuple[tuple[str, int, int], ...]] = {}


def embedded_model_path(*, verify: bool = False) -> Path:
    """Folder of the embedded model (official layout). ``verify`` also checks every fingerprint."""
    root = ASSETS_DIR / EMBEDDED_NAME
    if not (root / MANIFEST_NAME).is_file():
        raise ModelLoadError(
            f"the embedded default model is missing from this installation ({root / MANIFEST_NAME} not found)",
            hint=_HINT_REINSTALL + " (a source checkout builds it with python -m pfctl.demo.build_default)",
        )
    if verify:
        verify_embedded(root)
    return root


def has_embedded_model() -> bool:
    return (ASSETS_DIR / EMBEDDED_NAME / MANIFEST_NAME).is_file()


def read_manifest(root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    root = Path(root) if root is not None else ASSETS_DIR / EMBEDDED_NAME
    path = root / MANIFEST_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing", hint=_HINT_REINSTALL) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(
            f"cannot read the embedded model's manifest {path}: {exc}", hint=_HINT_REINSTALL
        ) from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ModelLoadError(f"{path} is not a pfctl embedded-model manifest", hint=_HINT_REINSTALL)
    if data.get("format_version") != MANIFEST_VERSION:
        raise ModelLoadError(
            f"{path}: manifest format_version {data.get('format_version')} is not supported "
            f"(this pfctl reads {MANIFEST_VERSION})",
            hint=_HINT_REINSTALL,
        )
    if not isinstance(data.get("files"), dict) or not data["files"]:
        raise ModelLoadError(f"{path} lists no files", hint=_HINT_REINSTALL)
    return data


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _selected(files: Mapping[str, Any], parts: Iterable[str] | None) -> list[str]:
    if parts is None:
        return sorted(files)
    prefixes = tuple(p.rstrip("/") + "/" for p in parts)
    return sorted(f for f in files if f.startswith(prefixes))


def verify_embedded(
    root: str | os.PathLike[str] | None = None, *, parts: Iterable[str] | None = None
) -> dict[str, Any]:
    """Check the sha256 of every file the manifest lists (or those under the subfolders ``parts``).

    Raises :class:`ModelLoadError` naming the first missing or altered file, with both hashes.
    Weight files the manifest does not know are refused too: a stray ``.bin`` next to the
    safetensors could otherwise be picked up by a loader. Results are remembered per file
    (path, size, mtime), so loading the model twice in a process hashes it once.
    Returns the manifest.
    """
    root = Path(root) if root is not None else ASSETS_DIR / EMBEDDED_NAME
    manifest = read_manifest(root)
    files: dict[str, Any] = manifest["files"]
    names = _selected(files, parts)
    stamp = []
    for name in names:
        path = root / name
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ModelLoadError(
                f"the embedded model is incomplete: {path} is missing (listed in {root / MANIFEST_NAME})",
                hint=_HINT_REINSTALL,
            ) from None
        stamp.append((name, st.st_size, st.st_mtime_ns))
    key = (str(root.resolve()), tuple(names))
    if _verified.get(key) == tuple(stamp):
        return manifest
    for name in names:
        path = root / name
        want = files[name]
        want_sha = want["sha256"] if isinstance(want, dict) else str(want)
        got = _sha256(path)
        if got != want_sha:
            raise ModelLoadError(
                f"the embedded model file {path} does not match its fingerprint "
                f"(sha256 {got[:16]}…, manifest says {want_sha[:16]}…): it was modified or damaged",
                hint=_HINT_REINSTALL,
            )
    folders = {n.split("/", 1)[0] for n in names if "/" in n}
    for folder in sorted(folders):
        for path in sorted((root / folder).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and rel not in files and not path.name.startswith("."):
                raise ModelLoadError(
                    f"the embedded model folder holds a file its manifest does not list: {path}",
                    hint=_HINT_REINSTALL,
                )
    _verified[key] = tuple(stamp)
    return manifest


def resolve_embedded(need: Iterable[str] = ("dit", "vae", "text")) -> tuple[Path, str, dict[str, Any]]:
    """(root, DiT variant, info) of the embedded model, after checking the files ``need`` uses.

    ``info`` goes into ``Components.info["embedded"]``: name, resolution, generate defaults.
    """
    root = embedded_model_path()
    manifest = read_manifest(root)
    variant = str(manifest.get("variant") or DEFAULT_VARIANT)
    parts = []
    need = tuple(need)
    if "dit" in need:
        parts.append(variant)
    if "vae" in need:
        parts.append("causal_video_vae")
    if "text" in need:
        parts += ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]
    verify_embedded(root, parts=parts)
    return root, variant, embedded_info(manifest, root)


def embedded_info(manifest: Mapping[str, Any], root: Path) -> dict[str, Any]:
    return {
        "name": manifest.get("name", EMBEDDED_NAME),
        "root": str(root),
        "variant": manifest.get("variant", DEFAULT_VARIANT),
        "resolution": manifest.get("resolution"),
        "generate": dict(manifest.get("generate") or {}),
        "prompt_set": manifest.get("prompt_set"),
    }


def embedded_vae_folder() -> Path:
    """``causal_video_vae/`` of the embedded model, fingerprint-checked (``load_vae("default")``)."""
    root = embedded_model_path()
    verify_embedded(root, parts=["causal_video_vae"])
    return root / "causal_video_vae"


def is_embedded_root(path: str | os.PathLike[str] | None) -> bool:
    if path is None:
        return False
    try:
        return Path(path).resolve() == (ASSETS_DIR / EMBEDDED_NAME).resolve()
    except OSError:
        return False


_SIZE_KEYS = ("resolution", "width", "height")


def generate_defaults_for(info: Mapping[str, Any]) -> dict[str, Any]:
    """Generation settings a loaded model asks for: those of the embedded model when ``info``
    (``Components.info``) says it is the embedded model, or an export fine-tuned from it."""
    embedded = info.get("embedded")
    if isinstance(embedded, Mapping):
        defaults = dict(embedded.get("generate") or {})
    elif is_embedded_root(info.get("base_model_path")):
        # an export fine-tuned from it: its size is the one it was trained at (its marker), not the model's
        generate = read_manifest().get("generate") or {}
        defaults = {k: v for k, v in generate.items() if k not in _SIZE_KEYS}
    else:
        return {}
    return defaults


def apply_generate_defaults(config: Any, info: Mapping[str, Any]) -> Any:
    """``config`` with the model's generation settings filled in where the user gave none.

    A key counts as given when it appears in the recipe, a ``--set`` or a flag (pydantic's
    ``model_fields_set``); giving any of resolution/width/height keeps the model's size out.
    """
    defaults = generate_defaults_for(info)
    if not defaults:
        return config
    gen = config.generate
    given = set(gen.model_fields_set)
    if given & set(_SIZE_KEYS):
        given |= set(_SIZE_KEYS)
    update = {k: v for k, v in defaults.items() if k in type(gen).model_fields and k not in given}
    if not update:
        return config
    merged = type(gen).model_validate({**gen.model_dump(), **update})
    # keep the record of what the user set (a second call must not treat defaults as given)
    object.__setattr__(merged, "__pydantic_fields_set__", set(gen.model_fields_set))
    return config.model_copy(update={"generate": merged})


__all__ = [
    "ASSETS_DIR",
    "EMBEDDED_NAME",
    "MANIFEST_NAME",
    "apply_generate_defaults",
    "embedded_model_path",
    "embedded_vae_folder",
    "generate_defaults_for",
    "has_embedded_model",
    "is_embedded_root",
    "read_manifest",
    "resolve_embedded",
    "verify_embedded",
]
