"""Recipe loading: YAML file → ``--set`` overrides → flags → validated :class:`RecipeConfig`."""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pfctl.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parents[1]
RECIPES_DIR = _PACKAGE / "recipes" if (_PACKAGE / "recipes").is_dir() else _PACKAGE.parent / "recipes"
"""Named recipes shipped with pfctl (``--recipe debug-tiny`` → ``debug-tiny.yaml``): ``pfctl/recipes/`` in an
installed wheel (pyproject.toml maps the package ``pfctl.recipes`` to the top-level ``recipes/`` folder, the
one source), or ``recipes/`` itself in a source checkout or an editable install."""


def recipe_dirs() -> list[Path]:
    """Folders searched for named recipes: ``$PFCTL_RECIPES_DIR`` (if set), then the shipped ones."""
    dirs = [Path(p) for p in os.environ.get("PFCTL_RECIPES_DIR", "").split(os.pathsep) if p]
    return [*dirs, RECIPES_DIR]


def available_recipes() -> list[str]:
    names = {p.stem for d in recipe_dirs() if d.is_dir() for p in d.glob("*.yaml")}
    return sorted(names)


def resolve_recipe_path(recipe: str) -> Path:
    """A recipe is a path to a YAML file or the name of a shipped recipe."""
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    for folder in recipe_dirs():
        candidate = folder / f"{recipe}.yaml"
        if candidate.is_file():
            return candidate
    names = available_recipes()
    close = difflib.get_close_matches(recipe, names, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"available recipes: {', '.join(names) or 'none'}"
    raise ConfigError(f"recipe '{recipe}' is neither a file nor a known recipe name", hint=hint)


def read_recipe(recipe: str) -> dict[str, Any]:
    path = resolve_recipe_path(recipe)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte {exc.start}): is it a YAML file?") from None
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.lr=1e-4"`` → (["train", "lr"], 1e-4). Values are parsed as YAML scalars/lists."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"bad override '{text}'", hint="use --set section.key=value, e.g. --set train.lr=1e-4"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        # YAML 1.1 reads "1e-4" as a string; people mean a number.
        with contextlib.suppress(ValueError):
            value = float(value) if value.strip().lower() not in ("nan", "inf", "-inf", "infinity") else value
    return key.split("."), value


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def _model_at(schema: type[BaseModel], loc: Iterable[Any]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for close-match suggestions)."""
    model: type[BaseModel] | None = schema
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _format_errors(exc: ValidationError, schema: type[BaseModel]) -> ConfigError:
    lines: list[str] = []
    hints: list[str] = []
    for err in exc.errors():
        loc = list(err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            parent = _model_at(schema, loc[:-1])
            allowed = sorted(parent.model_fields) if parent else []
            lines.append(f"unknown key '{key}'")
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            if close:
                hints.append(f"did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?")
            elif allowed:
                hints.append(f"allowed keys here: {', '.join(allowed)}")
        else:
            shown = repr(value) if not isinstance(value, dict) else "{...}"
            lines.append(f"{key} = {shown}: {err['msg']}")
    return ConfigError("invalid config: " + "; ".join(lines), hint=" ".join(hints) or None)


def load_config(
    recipe: str | None = None,
    overrides: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    schema: type[BaseModel] | None = None,
) -> Any:
    """Build the validated config.

    ``flags`` maps dotted keys to values given by command options (None = not given).
    """
    if schema is None:
        from pfctl.config.schema import RecipeConfig

        schema = RecipeConfig
    data: dict[str, Any] = read_recipe(recipe) if recipe else {}
    for text in overrides:
        path, value = parse_override(text)
        _set_path(data, path, value)
    for dotted, value in (flags or {}).items():
        if value is not None:
            _set_path(data, dotted.split("."), value)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _format_errors(exc, schema) from None


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML (what ``--print-config`` shows and checkpoints embed)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
