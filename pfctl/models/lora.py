"""LoRA adapters on the pyramid DiTs, through peft: add, save, load, apply at a scale, merge.

Why peft and not a home-made LoRA layer: the files it defines (``adapter_model.safetensors`` +
``adapter_config.json``) are what the rest of the ecosystem (peft, diffusers) reads, and its
layers already handle dropout, scaling, several adapters on one layer, and merging.

An adapter folder written by pfctl (:func:`save_lora_folder`)::

    <lora>/adapter_model.safetensors   peft layout: keys ``base_model.model.<module>.lora_{A,B}.weight``
    <lora>/adapter_config.json         peft's LoraConfig (r, lora_alpha, lora_dropout, target_modules =
                                       the explicit list of full module names that carry an adapter)
    <lora>/pfctl_lora.json             marker: base_model_path, base DiT class/config/fingerprint, the
                                       train options (rank, alpha, dropout, targets as given), extra
    <lora>/config.yaml                 the resolved recipe that trained it (provenance)
    <lora>/ema/                        (optional) the EMA adapter, a complete adapter folder itself

``adapter_config.json`` names full module names (not the patterns the user gave), so a folder
loads onto exactly the layers it was trained on, whatever pattern semantics are in fashion.

Target selection (:func:`resolve_targets`): a list of module-name suffixes matched, at a ``.``
boundary, against the Linear layers *inside the transformer blocks* (so ``proj_out`` means the
single blocks' output projection, not the model's final layer); or a string, a regular
expression full-matched against every module name (peft's rule). Every list entry must match a
layer: a typo fails with exit code 2 instead of silently training fewer adapters.

Scale: an adapter adds ``scale · (alpha / r) · B A x`` to its layer; ``scale`` 1 is what was trained.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pfctl.errors import CheckpointError, ConfigError, ModelLoadError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LORA_MARKER = "pfctl_lora.json"
LORA_FORMAT = "pfctl-lora"
LORA_FORMAT_VERSION = 1
PEFT_PREFIX = "base_model.model."
"""Prefix of every key in a peft ``adapter_model.safetensors`` (PeftModel wraps the base model)."""
TRAIN_ADAPTER = "default"


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is an optional dependency
        raise ConfigError(
            f"LoRA needs the peft package ({exc})", hint="pip install 'pfctl[lora]' (or pip install peft)"
        ) from None
    return peft


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------


def block_prefixes(model: nn.Module) -> list[str]:
    """Module-name prefixes of the transformer blocks (``transformer_blocks.0``, ...)."""
    blocks = getattr(model, "blocks_in_order", None)
    if callable(blocks):
        return [name for name, _ in blocks()]
    return [n for n, _ in model.named_modules() if re.search(r"(^|\.)(\w*blocks)\.\d+$", n)]


def resolve_targets(
    model: nn.Module, targets: Sequence[str] | str, *, key: str = "train.lora.targets"
) -> list[str]:
    """Full names of the Linear layers ``targets`` selects (rules in the module docstring).

    Raises :class:`ConfigError` naming ``key`` when a suffix (or the regex) matches no Linear layer.
    Works on a model built on the meta device (the dry-run does that).
    """
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise ConfigError(f"{key} = {targets!r} is not a valid regular expression: {exc}") from None
        found = [n for n in linears if pattern.fullmatch(n)]  # model order
        if not found:
            raise ConfigError(
                f"{key} = {targets!r} matches no Linear layer of the {type(model).__name__}",
                hint=f"the pattern is full-matched against names like {_examples(linears)}",
            )
        return found
    prefixes = tuple(p + "." for p in block_prefixes(model))
    inside = [n for n in linears if n.startswith(prefixes)]
    selected: set[str] = set()
    for entry in targets:
        suffix = entry.strip().strip(".")
        hits = [n for n in inside if n == suffix or n.endswith("." + suffix)]
        if not hits:
            raise ConfigError(
                f"{key}: entry {entry!r} matches no Linear layer inside the {type(model).__name__}'s "
                "transformer blocks",
                hint=f"suffixes of names like {_examples(inside)}; or give a regex string to match any module",
            )
        selected.update(hits)
    return [n for n in linears if n in selected]  # model order


def _examples(names: Iterable[str], n: int = 4) -> str:
    names = list(names)
    picks = names[:2] + names[len(names) // 2 : len(names) // 2 + 2]
    return ", ".join(dict.fromkeys(picks[:n])) or "(no Linear layers)"


# --------------------------------------------------------------------------------------------
# Adding adapters for training
# --------------------------------------------------------------------------------------------


def peft_lora_config(rank: int, alpha: float, dropout: float, target_names: Sequence[str]) -> Any:
    """peft's LoraConfig for explicit module names (standard LoRA: B = 0 at start, kaiming A)."""
    if rank < 1:
        raise ConfigError(f"train.lora.rank = {rank}: must be >= 1")
    return _peft().LoraConfig(
        r=int(rank),
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=list(target_names),
        bias="none",
        init_lora_weights=True,
    )


def add_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] | str,
    adapter_name: str = TRAIN_ADAPTER,
) -> list[str]:
    """Inject trainable adapters into ``model`` in place; freeze everything else. Returns the
    adapted module names. Adapter weights are created in fp32 (before any base cast)."""
    names = resolve_targets(model, targets)
    _peft().inject_adapter_in_model(peft_lora_config(rank, alpha, dropout, names), model, adapter_name)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name and f".{adapter_name}." in name)
    return names


def is_lora_model(model: nn.Module) -> bool:
    return any(".lora_A." in n for n, _ in model.named_parameters())


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Cast every frozen floating-point parameter to ``dtype`` (the adapters stay as they are).
    Returns the number of parameters cast. The bf16 base of a LoRA run is made this way."""
    count = 0
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                count += param.numel()
    return count


def lora_state_dict(model: nn.Module, adapter_name: str = TRAIN_ADAPTER) -> dict[str, torch.Tensor]:
    """The adapter's tensors, keyed ``<module>.lora_{A,B}.weight`` (no adapter name, no prefix)."""
    state = _peft().get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {k: v for k, v in state.items()}


def load_lora_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    adapter_name: str = TRAIN_ADAPTER,
    *,
    source: Any = "",
) -> None:
    """Copy adapter tensors (keys as :func:`lora_state_dict`, or peft-prefixed) into ``model``, strictly:
    a missing or unexpected adapter key, or a shape mismatch, raises naming ``source``."""
    state = {_strip_prefix(k): v for k, v in state.items()}
    params = dict(model.named_parameters())
    expected = {}
    for name in params:
        if ".lora_" in name and f".{adapter_name}." in name:
            expected[name.replace(f".{adapter_name}.", ".")] = name
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"adapter weights {source} do not fit the model: {len(missing)} missing "
            f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})",
            hint="use the adapter with the base model and train.lora.targets it was trained with",
        )
    with torch.no_grad():
        for key, name in expected.items():
            target, value = params[name], state[key]
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"adapter weights {source}: {key} has shape {tuple(value.shape)}, the model's "
                    f"{tuple(target.shape)}",
                    hint="the rank (train.lora.rank) or the base model differs",
                )
            target.copy_(value.to(dtype=target.dtype, device=target.device))


def _strip_prefix(key: str) -> str:
    return key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def adapter_config_dict(
    rank: int, alpha: float, dropout: float, target_names: Sequence[str], base: Any
) -> dict:
    """``adapter_config.json`` content (peft's to_dict with JSON types)."""
    cfg = peft_lora_config(rank, alpha, dropout, target_names)
    cfg.base_model_name_or_path = str(base) if base else None
    data = cfg.to_dict()
    out = {}
    for k, v in data.items():
        if isinstance(v, set):
            v = sorted(v)
        elif hasattr(v, "value") and not isinstance(v, (int, float, str)):
            v = v.value
        out[k] = v
    out["target_modules"] = list(target_names)
    return out


def write_adapter_files(
    folder: str | os.PathLike[str], state: Mapping[str, torch.Tensor], config: dict
) -> Path:
    """``adapter_model.safetensors`` (peft-prefixed keys) + ``adapter_config.json``, each atomically."""
    from pfctl.utils.io import atomic_save_safetensors, atomic_write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + _strip_prefix(k): v.detach().cpu().contiguous() for k, v in state.items()}
    atomic_save_safetensors(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    atomic_write_json(folder / ADAPTER_CONFIG, config)
    return folder


def read_adapter_files(folder: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors with the peft prefix stripped, adapter_config.json) of an adapter folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights, config = folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG
    if not weights.is_file() or not config.is_file():
        raise ModelLoadError(
            f"{folder} is not a LoRA adapter folder (needs {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG})",
            hint="pass the export/ folder of a LoRA run (or a peft adapter folder)",
        )
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {config}: {exc}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ModelLoadError(f"{config}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise ModelLoadError(f"{config}: DoRA adapters are not supported", hint="use a plain LoRA adapter")
    return {_strip_prefix(k): v for k, v in load_file(str(weights)).items()}, cfg


def read_lora_marker(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pfctl marker of an adapter folder, or None for a foreign (plain peft) adapter."""
    path = Path(folder) / LORA_MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if marker.get("format") != LORA_FORMAT or marker.get("format_version") != LORA_FORMAT_VERSION:
        raise ModelLoadError(
            f"{path}: format {marker.get('format')!r} version {marker.get('format_version')!r} is not "
            f"{LORA_FORMAT} {LORA_FORMAT_VERSION}",
            hint="re-export the adapter with this pfctl",
        )
    return marker


def save_lora_folder(
    out_dir: str | os.PathLike[str],
    state: Mapping[str, torch.Tensor],
    adapter_config: dict[str, Any],
    *,
    marker: Mapping[str, Any],
    config_yaml: str | None = None,
    ema_state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a LoRA export (layout in the module docstring): staged in a hidden sibling, renamed
    into place, marker last. Replaces an existing LoRA folder; refuses any other non-empty folder."""
    from pfctl import __version__
    from pfctl.utils.io import atomic_write_json, atomic_write_text, replace_dir

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / LORA_MARKER).is_file())):
        raise CheckpointError(
            f"{out} exists and is not a pfctl LoRA folder; refusing to overwrite it",
            hint="choose an empty or new folder",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.lora-", dir=out.parent))
    full = {
        "format": LORA_FORMAT,
        "format_version": LORA_FORMAT_VERSION,
        "pfctl_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **dict(marker),
    }
    try:
        write_adapter_files(staging, state, adapter_config)
        if config_yaml is not None:
            atomic_write_text(staging / "config.yaml", config_yaml)
        if ema_state is not None:
            write_adapter_files(staging / "ema", ema_state, adapter_config)
            atomic_write_json(staging / "ema" / LORA_MARKER, {**full, "ema": None, "is_ema": True})
        atomic_write_json(staging / LORA_MARKER, {**full, "ema": "ema" if ema_state is not None else None})
        replace_dir(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------------
# Using adapters: apply (unmerged, several at once, each with a scale) and merge
# --------------------------------------------------------------------------------------------


@dataclass
class LoadedLora:
    """One adapter folder read from disk."""

    path: Path
    state: dict[str, torch.Tensor]
    config: dict[str, Any]
    marker: dict[str, Any] | None
    scale: float = 1.0
    name: str = ""

    @property
    def target_names(self) -> list[str]:
        targets = self.config.get("target_modules")
        return sorted(targets) if isinstance(targets, list) else []

    @property
    def base_model_path(self) -> str | None:
        return (self.marker or {}).get("base_model_path") or self.config.get("base_model_name_or_path")


def read_lora(path: str | os.PathLike[str], scale: float = 1.0) -> LoadedLora:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"LoRA folder {folder} does not exist", hint="check --lora")
    state, config = read_adapter_files(folder)
    return LoadedLora(folder, state, config, read_lora_marker(folder), float(scale))


def apply_lora(
    dit: nn.Module, adapters: Sequence[LoadedLora], *, dtype: torch.dtype | None = None
) -> list[str]:
    """Attach each adapter (unmerged, frozen) with its scale; all are active together.

    The forward then computes ``W x + sum_i scale_i (alpha_i / r_i) B_i A_i x`` — the very layers
    the trainer used, so a trained adapter reloaded here gives the training model's outputs exactly.
    Returns the adapter names (``lora0``, ``lora1``, ...).
    """
    peft = _peft()
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = []
    device = next((p.device for p in dit.parameters()), torch.device("cpu"))
    for i, adapter in enumerate(adapters):
        name = adapter.name or f"lora{i}"
        adapter.name = name
        cfg = dict(adapter.config)
        targets = cfg.get("target_modules")
        if isinstance(targets, list):
            missing = [t for t in targets if t not in dict(dit.named_modules())]
            if missing:
                raise ModelLoadError(
                    f"LoRA {adapter.path} targets modules the DiT does not have, e.g. {missing[:3]}",
                    hint="use the adapter with the base model it was trained on",
                )
        known = set(peft.LoraConfig.__dataclass_fields__)
        lcfg = peft.LoraConfig(**{k: v for k, v in cfg.items() if k in known and k not in ("peft_type",)})
        lcfg.inference_mode = True
        with warnings.catch_warnings():  # "several adapters in one model" is the point here
            warnings.simplefilter("ignore", UserWarning)
            peft.inject_adapter_in_model(lcfg, dit, name)
        load_lora_state(dit, adapter.state, name, source=adapter.path)
        names.append(name)
    moves: dict[str, Any] = {"device": device} | ({"dtype": dtype} if dtype is not None else {})
    with torch.no_grad():
        for module in dit.modules():
            if not isinstance(module, BaseTunerLayer):
                continue
            present = [n for n in names if n in getattr(module, "lora_A", {})]
            if _accepts_inference(module):
                module.set_adapter(present, inference_mode=True)
            else:  # pragma: no cover - older peft
                module.set_adapter(present)
            for adapter in adapters:
                if adapter.name in present:
                    module.set_scale(adapter.name, adapter.scale)
                    module.lora_A[adapter.name].to(**moves)
                    module.lora_B[adapter.name].to(**moves)
    for name_, param in dit.named_parameters():
        if ".lora_" in name_:
            param.requires_grad_(False)
    return names


def _accepts_inference(module: Any) -> bool:
    import inspect

    return "inference_mode" in inspect.signature(module.set_adapter).parameters


def merge_and_unload(dit: nn.Module) -> nn.Module:
    """Fold every active adapter (at its scale) into the base weights and drop the peft layers, so
    the DiT is a plain model again (its state dict has the original keys). Merging runs in fp32."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    replacements = []
    for name, module in dit.named_modules():
        if isinstance(module, BaseTunerLayer):
            replacements.append((name, module))
    with torch.no_grad():
        for name, module in replacements:
            base = module.get_base_layer()
            active = [n for n in module.active_adapters if n in getattr(module, "lora_A", {})]
            if active:
                dtype = base.weight.dtype
                delta = sum(module.get_delta_weight(n).float() for n in active)
                base.weight.data = (base.weight.data.float() + delta).to(dtype)
            parent_name, _, child = name.rpartition(".")
            parent = dit.get_submodule(parent_name) if parent_name else dit
            setattr(parent, child, base)
    return dit


@dataclass
class MergeReport:
    output_dir: Path
    base: str
    adapters: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class MergedDit:
    """A base DiT with adapters folded in, and where it came from (see :func:`merge_adapters`)."""

    dit: nn.Module
    base: Path  # the model folder the adapters were merged into
    aux: str | None  # the folder holding the base's VAE and text encoders
    extra: dict[str, Any]  # provenance for the export marker: variant, merged_loras, merged_from


def merge_adapters(
    model: str | os.PathLike[str],
    loras: Sequence[tuple[str | os.PathLike[str], float]],
    *,
    variant: str = "diffusion_transformer_384p",
) -> MergedDit:
    """Load the base DiT of ``model`` in fp32 and fold each adapter in at its scale."""
    from pfctl.models.checkpoint import VAE_SUBFOLDER, load_components

    if not loras:
        raise ConfigError("merge-lora needs at least one --lora PATH")
    adapters = [read_lora(p, s) for p, s in loras]
    parts = load_components(model, variant=variant, need=("dit",), dtype=torch.float32)
    info = parts.info
    _check_base(adapters, info)
    apply_lora(parts.dit, adapters, dtype=torch.float32)
    dit = merge_and_unload(parts.dit)
    root = Path(info["root"])
    if info.get("layout") == "export":
        aux = root if (root / VAE_SUBFOLDER).is_dir() else info.get("base_model_path")
    elif info.get("layout") == "official":
        aux = root
    else:
        aux = None
    extra = dict(((info.get("export") or {}).get("extra")) or {})
    if info.get("layout") == "official":
        extra.setdefault("variant", variant)
    extra["merged_loras"] = [
        {
            "path": str(a.path.resolve()),
            "scale": a.scale,
            "rank": a.config.get("r"),
            "alpha": a.config.get("lora_alpha"),
        }
        for a in adapters
    ]
    extra["merged_from"] = str(root)
    return MergedDit(dit, root, None if aux is None else str(aux), extra)


def merge_lora_into_export(
    model: str | os.PathLike[str],
    loras: Sequence[tuple[str | os.PathLike[str], float]],
    out_dir: str | os.PathLike[str],
    *,
    variant: str = "diffusion_transformer_384p",
) -> MergeReport:
    """``pfctl merge-lora``: base model + adapters (each at its scale) → a full pfctl export.

    The merged DiT is written as an export whose ``base_model_path`` points where the base's VAE
    and text encoders are, so ``pfctl generate --model OUT`` works like with the base.
    """
    from pfctl.models.checkpoint import save_export

    merged = merge_adapters(model, loras, variant=variant)
    out = save_export(out_dir, merged.dit, base_model_path=merged.aux, extra=merged.extra)
    return MergeReport(output_dir=out, base=str(merged.base), adapters=merged.extra["merged_loras"])


def _check_base(adapters: Sequence[LoadedLora], info: Mapping[str, Any]) -> None:
    """Refuse an adapter trained on another DiT class; warn when the base fingerprint differs."""
    from pfctl.runtime import logging as pflog

    for adapter in adapters:
        marker = adapter.marker or {}
        cls = marker.get("dit_class")
        if cls and info.get("dit_class") and cls != info["dit_class"]:
            raise ModelLoadError(
                f"LoRA {adapter.path} was trained on a {cls}, the model is a {info['dit_class']}",
                hint="use the base model named in its pfctl_lora.json",
            )
        want = marker.get("base_dit_fingerprint")
        have = (info.get("fingerprints") or {}).get("dit")
        if want and have and want != have:
            pflog.warn(
                f"LoRA {adapter.path} was trained on base DiT {want} "
                f"({marker.get('base_model_path')}); this model's DiT is {have}"
            )
