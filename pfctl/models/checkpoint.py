"""Loading model folders: the official Pyramid Flow layout, pfctl exports, fine-tuned DiT files.

Layouts :func:`load_components` understands (detected in this order):

1. **pfctl export** — a folder with the marker ``pfctl_export.json``, written by
   :func:`save_export` (the trainer's ``export`` step)::

       <export>/pfctl_export.json      marker: {"format": "pfctl-export", "format_version": 1,
                                       "model_name", "dit_class", "base_model_path" (absolute or null),
                                       "transformer", "transformer_ema" (subfolder or null),
                                       "dit_fingerprint", "ema_fingerprint", "pfctl_version", "extra"}
       <export>/transformer/           config.json (with ``_class_name``) + diffusion_pytorch_model.safetensors
       <export>/transformer_ema/       (optional) the EMA weights, same format
       <export>/config.yaml            the recipe that trained it (text, for provenance)

   The VAE and text encoders are looked up in the export itself first (``causal_video_vae/``,
   ``tokenizer/``, ``text_encoder/``, ... as in the official layout: copy them there to make an
   export self-contained) and otherwise in ``base_model_path``, the official folder the training
   started from. The marker is written last, so a folder without it is never a half export.

2. **Official folder** (README section 7 of the reference vectors)::

       <root>/<variant>/               DiT: config.json + diffusion_pytorch_model.safetensors
                                       (variants diffusion_transformer_{384p,768p,image})
       <root>/causal_video_vae/        config.json + diffusion_pytorch_model.bin (pickled fp32)
       <root>/tokenizer{,_2}/ text_encoder{,_2}/      miniFLUX text side (CLIP-L, T5)
       <root>/tokenizer_3/ text_encoder_3/            + SD3 MMDiT text side (CLIP-L, CLIP-G, T5)

3. **A bare DiT folder** (config.json with a DiT ``_class_name``): only ``need=("dit",)``.

The DiT class comes from ``config.json``'s ``_class_name`` (``PyramidFluxTransformer`` ->
``pyramid_flux``, ``PyramidDiffusionMMDiT`` -> ``pyramid_mmdit``). The reference's loader
forces ``axes_dims_rope=[16, 24, 24]`` for Flux whatever the config says; the published config
already says exactly that, so pfctl uses the config's value and falls back to ``[16, 24, 24]``
only when the key is absent. (Forcing it would break every smaller model, whose head dim is
not 64.) The same rule covers the MMDiT arguments the reference passes at load time
(``use_t5_mask``, ``add_temp_pos_embed``, ``temp_pos_embed_type="rope"``,
``interp_condition_pos``): see :data:`LOADER_DEFAULTS`. Callers pass run-time flags
(``use_flash_attn``, ``use_temporal_causal``, ``interp_condition_pos``, checkpointing) as
``dit_overrides``.

Weights are checked strictly before anything is loaded: a missing key, an unexpected key or a
shape mismatch raises :class:`~pfctl.errors.ModelLoadError` naming the file and the key.
Pickled files (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are read only with
``torch.load(..., weights_only=True)``; :func:`convert_to_safetensors` converts a folder once.

Fine-tuned DiT checkpoints written by the reference trainer (a torch file whose keys may carry a
``dit.`` prefix, with ``vae.*`` / ``text_encoder.*`` keys to skip) load with
:func:`load_dit_checkpoint`, or through ``load_components(..., dit_checkpoint=file)``.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pfctl.errors import CheckpointError, ConfigError, ModelLoadError, PfctlError
from pfctl.models.weights import file_digest, folder_digest

EXPORT_MARKER = "pfctl_export.json"
EXPORT_FORMAT = "pfctl-export"
EXPORT_FORMAT_VERSION = 1
VAE_SUBFOLDER = "causal_video_vae"
DIT_VARIANTS = ("diffusion_transformer_384p", "diffusion_transformer_768p", "diffusion_transformer_image")
WEIGHTS_NAME = "diffusion_pytorch_model"
LOADER_DEFAULTS: dict[str, dict[str, Any]] = {
    "PyramidFluxTransformer": {"axes_dims_rope": [16, 24, 24]},
    "PyramidDiffusionMMDiT": {
        "use_t5_mask": True,
        "add_temp_pos_embed": True,
        "temp_pos_embed_type": "rope",
        "interp_condition_pos": True,
        "use_temporal_causal": True,
        "use_flash_attn": False,
    },
}
"""Constructor arguments the reference pipeline passes when it loads a DiT folder.

The published configs omit them (the MMDiT config has no ``use_t5_mask`` / ``add_temp_pos_embed``
/ ``temp_pos_embed_type`` / ``interp_condition_pos``, whose class defaults differ), so pfctl
applies them to keys a config.json lacks; a key present in the config, or given as an override,
wins."""
NEEDS = ("dit", "vae", "text")

DIT_CLASSES: dict[str, tuple[str, str]] = {
    "PyramidFluxTransformer": ("pfctl.models.dit_flux", "pyramid_flux"),
    "PyramidDiffusionMMDiT": ("pfctl.models.dit_mmdit", "pyramid_mmdit"),
}
"""``_class_name`` -> (pfctl module, model name)."""
MODEL_NAME_TO_CLASS = {name: cls for cls, (_, name) in DIT_CLASSES.items()}


# --------------------------------------------------------------------------------------------
# Small helpers: digests, JSON, DiT classes
# --------------------------------------------------------------------------------------------



def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing (expected the {what})", hint="is the folder complete?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", hint=f"{path.name} must be valid JSON") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object", hint=f"{path.name} must hold the {what}")
    return data


def dit_class(class_name: str) -> type[torch.nn.Module]:
    """The pfctl DiT class for a config's ``_class_name`` (clear error if unknown / not built)."""
    entry = DIT_CLASSES.get(class_name)
    if entry is None:
        raise ModelLoadError(
            f"unknown DiT class {class_name!r}",
            hint=f"supported _class_name values: {', '.join(DIT_CLASSES)}",
        )
    module_name, _ = entry
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"DiT class {class_name} is not available in this pfctl build ({module_name}: {exc})",
            hint="use a miniFLUX (PyramidFluxTransformer) checkpoint",
        ) from exc
    return getattr(module, class_name)


def model_name_of(class_name: str) -> str:
    if class_name not in DIT_CLASSES:
        dit_class(class_name)  # raises the listing error
    return DIT_CLASSES[class_name][1]


def _module_to(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """``nn.Module.to`` directly: diffusers' ModelMixin.to warns about fp32 modules on every cast."""
    return torch.nn.Module.to(model, **kwargs)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model under torch.compile / DDP wrappers (their keys carry prefixes)."""
    seen = 0
    while seen < 4:
        seen += 1
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            break
    return model


def _config_dict(model: torch.nn.Module) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise CheckpointError(
            f"{type(model).__name__} has no diffusers config; cannot export it",
            hint="export the pfctl DiT (a ModelMixin/ConfigMixin), not a wrapper",
        )
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(cfg).items() if not k.startswith("_")}
    out["_class_name"] = type(model).__name__
    return out


# --------------------------------------------------------------------------------------------
# Reading weights: pfctl.models.weights does it (safe unpickling, shards, strict key/shape checks)
# --------------------------------------------------------------------------------------------


def read_weight_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """One weight file: safetensors, or a pickle read with ``weights_only=True`` (never more)."""
    from pfctl.models.weights import load_weight_file

    return load_weight_file(path)


# --------------------------------------------------------------------------------------------
# DiT
# --------------------------------------------------------------------------------------------


def _dit_config(folder: Path) -> dict[str, Any]:
    config = _read_json(folder / "config.json", "DiT config (with _class_name)")
    if "_class_name" not in config:
        raise ModelLoadError(
            f"{folder / 'config.json'} has no _class_name",
            hint=f"expected one of {', '.join(DIT_CLASSES)}",
        )
    return config


def build_dit_from_config(
    config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None, *, source: Any = "config"
) -> torch.nn.Module:
    """Instantiate the DiT class named by ``config['_class_name']`` with random weights."""
    import inspect

    class_name = str(config["_class_name"])
    cls = dit_class(class_name)
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    for k, v in LOADER_DEFAULTS.get(class_name, {}).items():
        if kwargs.get(k) is None:
            kwargs[k] = copy.deepcopy(v)
    for k, v in (overrides or {}).items():
        if not accepts_any and k not in params:
            raise ConfigError(
                f"DiT override {k!r} is not a {class_name} argument",
                hint=f"allowed: {', '.join(sorted(p for p in params if p != 'self'))}",
            )
        kwargs[k] = v
    if not accepts_any:
        dropped = sorted(k for k in kwargs if k not in params)
        for k in dropped:  # keys of another diffusers version / variant; the reference ignores them too
            kwargs.pop(k)
    try:
        return cls(**kwargs)
    except PfctlError as exc:
        raise ModelLoadError(f"{source}: {exc.message}", hint=exc.hint) from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot build {class_name} from {source}: {exc}", hint="check config.json"
        ) from exc


def load_dit_folder(
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    overrides: Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """A DiT from ``config.json`` + weights, checked strictly (file and key named on mismatch)."""
    from pfctl.models.weights import load_folder_weights, load_into_module

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"DiT folder {folder} does not exist")
    config = _dit_config(folder)
    weights = load_folder_weights(folder, WEIGHTS_NAME)
    model = _build_empty(config, overrides, source=folder / "config.json")
    load_into_module(model, weights, strict=True, assign=True)
    del weights
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftovers:  # cannot happen after the strict check; be safe rather than sample garbage
        raise ModelLoadError(f"{folder}: tensors left uninitialised after loading: {leftovers[:5]}")
    return _module_to(model, device=device, dtype=dtype).eval()


def _build_empty(config: Mapping[str, Any], overrides: Mapping[str, Any] | None, *, source: Any):
    """Build with parameters on the meta device (no 8 GB random init), buffers real.

    The weights then arrive by ``load_state_dict(assign=True)``, so peak memory is one copy.
    """
    try:
        from accelerate import init_empty_weights
    except ImportError:  # pragma: no cover - accelerate is a dependency
        return build_dit_from_config(config, overrides, source=source)
    with init_empty_weights(include_buffers=False):
        return build_dit_from_config(config, overrides, source=source)


def _strip_reference_checkpoint(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Reference ``load_checkpoint`` key rules: skip vae./text_encoder., strip a dit. prefix."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith(("vae.", "text_encoder.")):
            continue
        if not isinstance(value, torch.Tensor):
            continue
        out[key[len("dit.") :] if key.startswith("dit.") else key] = value
    return out


def load_dit_checkpoint(dit: torch.nn.Module, path: str | os.PathLike[str]) -> torch.nn.Module:
    """Load fine-tuned DiT weights (reference trainer file or safetensors) into ``dit``, strictly."""
    path = Path(path)
    raw = read_weight_file(path)
    state = _strip_reference_checkpoint(raw)
    if not state:
        raise ModelLoadError(
            f"{path} holds no DiT tensors (keys: {list(raw)[:5]})",
            hint="expected a state dict whose keys are the DiT's (optionally prefixed 'dit.')",
        )
    from pfctl.models.weights import LoadedWeights, load_into_module

    target = _unwrap(dit)
    load_into_module(target, LoadedWeights(state, description=str(path)), strict=True)
    return dit


# --------------------------------------------------------------------------------------------
# Layout detection and load_components
# --------------------------------------------------------------------------------------------


@dataclass
class Components:
    """What :func:`load_components` returns; parts not in ``need`` are None."""

    dit: torch.nn.Module | None
    vae: Any | None  # pfctl.models.vae.VideoVAE
    text_encoder: Any | None  # pfctl.models.text_encoder.FluxTextEncoder | SD3TextEncoder
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str | None:
        return self.info.get("model_name")


@dataclass
class _Layout:
    kind: str  # "official" | "export" | "dit-folder"
    root: Path
    dit_folder: Path | None
    aux_roots: list[Path]  # where VAE / text folders are searched, in order
    marker: dict[str, Any] | None = None


def read_export_marker(root: str | os.PathLike[str]) -> dict[str, Any]:
    root = Path(root)
    marker = _read_json(root / EXPORT_MARKER, "pfctl export marker")
    if marker.get("format") != EXPORT_FORMAT:
        raise ModelLoadError(
            f"{root / EXPORT_MARKER} is not a pfctl export marker (format={marker.get('format')!r})"
        )
    version = marker.get("format_version")
    if version != EXPORT_FORMAT_VERSION:
        raise ModelLoadError(
            f"{root / EXPORT_MARKER}: export format_version {version} is not supported "
            f"(this pfctl reads {EXPORT_FORMAT_VERSION})",
            hint="re-export with this pfctl version, or use the pfctl that wrote it",
        )
    return marker


def _detect_layout(root: Path, variant: str, use_ema: bool) -> _Layout:
    if not root.exists():
        raise ModelLoadError(f"model folder {root} does not exist", hint="check model.path")
    if not root.is_dir():
        raise ModelLoadError(
            f"{root} is a file, not a model folder",
            hint="pass the checkpoint folder as model.path; load a fine-tuned DiT file with dit_checkpoint=",
        )
    if (root / EXPORT_MARKER).is_file():
        marker = read_export_marker(root)
        sub = marker.get("transformer_ema") if use_ema else marker.get("transformer")
        if use_ema and not sub:
            raise ModelLoadError(
                f"export {root} has no EMA weights (transformer_ema is null in {EXPORT_MARKER})",
                hint="load without use_ema, or export with EMA enabled",
            )
        aux = [root]
        base = marker.get("base_model_path")
        if base:
            aux.append(Path(base))
        return _Layout("export", root, root / str(sub or "transformer"), aux, marker)
    config = root / "config.json"
    if config.is_file():
        try:
            class_name = json.loads(config.read_text(encoding="utf-8")).get("_class_name")
        except (OSError, json.JSONDecodeError):
            class_name = None
        if class_name in DIT_CLASSES:
            return _Layout("dit-folder", root, root, [])
    if use_ema:
        raise ModelLoadError(
            f"{root} is an official checkpoint folder; it has no EMA weights", hint="drop use_ema"
        )
    return _Layout("official", root, root / variant, [root])


def _missing_dit_error(layout: _Layout, variant: str) -> ModelLoadError:
    root = layout.root
    if layout.kind == "export":
        return ModelLoadError(
            f"export {root} lacks {layout.dit_folder.name}/ named in {EXPORT_MARKER}",
            hint="the export is incomplete; re-export it",
        )
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "config.json").is_file())
    return ModelLoadError(
        f"{root} has no DiT subfolder {variant}/ (expected {variant}/config.json + "
        f"{WEIGHTS_NAME}.safetensors); subfolders with a config.json: {found or 'none'}",
        hint=f"set model.variant to one of {', '.join(v for v in found if v.startswith('diffusion_transformer')) or ', '.join(DIT_VARIANTS)}",
    )


def _find_aux(layout: _Layout, names: Sequence[str]) -> Path | None:
    for base in layout.aux_roots:
        if all((base / n).is_dir() for n in names):
            return base
    return None


def _aux_missing_error(layout: _Layout, names: Sequence[str], what: str) -> ModelLoadError:
    where = " or ".join(str(b) for b in layout.aux_roots) or str(layout.root)
    if layout.kind == "dit-folder":
        return ModelLoadError(
            f"{layout.root} is a bare DiT folder; it has no {what}",
            hint="pass the whole checkpoint folder (the parent of the DiT folder), or need=('dit',)",
        )
    return ModelLoadError(
        f"no {what} found: {where} lacks {', '.join(n + '/' for n in names)}",
        hint="download the full Pyramid Flow folder (or set base_model_path of the export / model.vae)",
    )


def load_components(
    path: str | os.PathLike[str] | None,
    *,
    variant: str = "diffusion_transformer_384p",
    need: Iterable[str] = NEEDS,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    model_name: str | None = None,
    dit_dtype: torch.dtype | None = None,
    dit_overrides: Mapping[str, Any] | None = None,
    dit_checkpoint: str | os.PathLike[str] | None = None,
    use_ema: bool = False,
    vae: str | None = None,
    vae_dtype: torch.dtype | None = None,
) -> Components:
    """Load the parts in ``need`` from an official folder, a pfctl export, or a bare DiT folder.

    ``path=None`` loads the embedded default model (:mod:`pfctl.models.embedded`; ``variant`` is
    then the one its manifest names, and ``info["embedded"]`` carries its generation settings).

    ``dtype`` is used for every part unless ``dit_dtype`` / ``vae_dtype`` say otherwise (training
    keeps the DiT in fp32). ``dit_overrides`` are constructor arguments applied over the config
    (the reference passes use_flash_attn, use_temporal_causal, interp_condition_pos and the
    checkpointing flags this way). ``model_name`` (``pyramid_flux``/``pyramid_mmdit``) must agree
    with the DiT's ``_class_name`` when both are known; it picks the text encoder when no DiT is
    loaded. ``vae`` overrides the VAE spec (a folder or built-in name for ``load_vae``).
    ``info`` records layout, root, base_model_path (official root, or the export's base),
    paths, DiT class, model name and fingerprints (dit, vae, text) of what was loaded.
    """
    need = tuple(dict.fromkeys(need))
    bad = [n for n in need if n not in NEEDS]
    if bad:
        raise ConfigError(f"unknown component(s) {bad} in need=", hint=f"choose from {', '.join(NEEDS)}")
    if model_name is not None and model_name not in MODEL_NAME_TO_CLASS:
        raise ConfigError(
            f"unknown model name {model_name!r}", hint=f"choose from {', '.join(MODEL_NAME_TO_CLASS)}"
        )
    embedded = None
    if path is None:  # the embedded default model (official layout; its files' sha256 checked)
        from pfctl.models.embedded import resolve_embedded

        path, variant, embedded = resolve_embedded(n for n in need if not (n == "vae" and vae is not None))
    root = Path(path)
    layout = _detect_layout(root, variant, use_ema)
    info: dict[str, Any] = {"layout": layout.kind, "root": str(root.resolve()), "need": list(need)}
    if embedded is not None:
        info["embedded"] = embedded
    if layout.marker is not None:
        info["export"] = {k: layout.marker.get(k) for k in ("base_model_path", "pfctl_version", "extra")}
    # the official folder a fine-tune starts from / an export points at (VAE + text encoders)
    info["base_model_path"] = (
        layout.marker.get("base_model_path") if layout.marker is not None
        else info["root"] if layout.kind == "official" else None
    )  # fmt: skip

    model_name, class_name = _resolve_model_name(layout, model_name)
    info["model_name"] = model_name
    info["dit_class"] = class_name or MODEL_NAME_TO_CLASS[model_name]
    fps: dict[str, str] = {}
    info["fingerprints"] = fps
    dit = None
    if "dit" in need:
        dit = _load_dit_part(layout, variant, dit_dtype or dtype, device, dit_overrides, dit_checkpoint, info)
    elif dit_checkpoint is not None:
        raise ConfigError("dit_checkpoint was given but 'dit' is not in need=")
    vae_obj = _load_vae_part(layout, vae, vae_dtype or dtype, device, model_name, info) if "vae" in need else None
    text = None
    if "text" in need:
        text = _load_text_part(layout, model_name, dtype, device, info)
        if dit is not None:
            _check_text_dims(dit, text, Path(info["text_path"]))
    return Components(dit=dit, vae=vae_obj, text_encoder=text, info=info)


def _resolve_model_name(layout: Any, model_name: str | None) -> tuple[str, str | None]:
    """The model name (``pyramid_flux``/``pyramid_mmdit``) and the DiT class of ``layout``: from the DiT's
    ``config.json``, else the export marker, else the text encoders found; ``model_name`` must agree."""
    dit_folder = layout.dit_folder
    class_name: str | None = None
    if dit_folder is not None and (dit_folder / "config.json").is_file():
        class_name = str(_dit_config(dit_folder)["_class_name"])
        detected = model_name_of(class_name)
        if model_name is not None and model_name != detected:
            raise ConfigError(
                f"model.name is {model_name!r} but {dit_folder / 'config.json'} holds a {class_name} "
                f"({detected})",
                hint=f"set model.name to {detected!r}",
            )
        model_name = detected
    elif layout.marker is not None and layout.marker.get("model_name"):
        model_name = model_name or str(layout.marker["model_name"])
    if model_name is None:
        from pfctl.models.text_encoder import detect_text_encoder_kind

        base = _find_aux(layout, ("text_encoder",))
        model_name = (detect_text_encoder_kind(base) if base else None) or "pyramid_flux"
    return model_name, class_name


def _load_dit_part(
    layout: Any,
    variant: str | None,
    dtype: torch.dtype,
    device: str | torch.device,
    overrides: dict[str, Any] | None,
    dit_checkpoint: str | os.PathLike[str] | None,
    info: dict[str, Any],
) -> torch.nn.Module:
    """The DiT of ``layout`` (with ``dit_checkpoint``'s weights if given), its path and fingerprint in ``info``."""
    dit_folder = layout.dit_folder
    if dit_folder is None or not dit_folder.is_dir() or not (dit_folder / "config.json").is_file():
        raise _missing_dit_error(layout, variant)
    dit = load_dit_folder(dit_folder, dtype=dtype, device="cpu", overrides=overrides)
    info["dit_path"] = str(dit_folder)
    fps = info["fingerprints"]
    fps["dit"] = folder_digest(dit_folder)
    if dit_checkpoint is not None:
        load_dit_checkpoint(dit, dit_checkpoint)
        info["dit_checkpoint"] = str(dit_checkpoint)
        fps["dit"] = fingerprint_of({"folder": fps["dit"], "checkpoint": file_digest(dit_checkpoint)})
    return _module_to(dit, device=device)


def _load_vae_part(
    layout: Any, spec: str | None, dtype: torch.dtype, device: str | torch.device, model_name: str,
    info: dict[str, Any],
) -> Any:  # fmt: skip
    """The VAE (``spec``, else the layout's ``causal_video_vae/``), its path and fingerprint in ``info``."""
    from pfctl.models.vae import load_vae

    if spec is None:
        base = _find_aux(layout, (VAE_SUBFOLDER,))
        if base is None:
            raise _aux_missing_error(layout, (VAE_SUBFOLDER,), "causal video VAE")
        spec = str(base / VAE_SUBFOLDER)
    vae_obj = load_vae(spec, dtype=dtype, device=device)
    if model_name == "pyramid_mmdit":
        vae_obj = _with_sd3_latent_norm(vae_obj)
    info["vae_path"] = spec
    info["fingerprints"]["vae"] = vae_obj.fingerprint()
    return vae_obj


def _load_text_part(
    layout: Any, model_name: str, dtype: torch.dtype, device: str | torch.device, info: dict[str, Any]
) -> Any:
    """The text encoders of ``model_name`` found with ``layout``, their path and fingerprint in ``info``."""
    from pfctl.models.text_encoder import FLUX_SUBFOLDERS, SD3_SUBFOLDERS, load_text_encoder

    names = SD3_SUBFOLDERS if model_name == "pyramid_mmdit" else FLUX_SUBFOLDERS
    base = _find_aux(layout, names)
    if base is None:
        raise _aux_missing_error(layout, names, f"text encoder for {model_name}")
    text = load_text_encoder(base, model_name=model_name, dtype=dtype, device=device)
    info["text_path"] = str(base)
    info["fingerprints"]["text"] = text.fingerprint()
    return text


def _with_sd3_latent_norm(vae_obj: Any) -> Any:
    """The SD3 MMDiT was trained with other image-frame latent factors than miniFLUX."""
    from pfctl.models.vae import SD3_LATENT_NORM, PyramidCausalVAE

    if isinstance(vae_obj, PyramidCausalVAE):
        return PyramidCausalVAE(vae_obj.module, SD3_LATENT_NORM)
    return vae_obj


def fingerprint_of(obj: Any) -> str:
    from pfctl.utils.io import fingerprint

    return fingerprint(obj)


def _check_text_dims(dit: torch.nn.Module, text: Any, text_root: Path) -> None:
    """The DiT's text input sizes must equal the encoders' output sizes (clear error, not a matmul)."""
    cfg = getattr(dit, "config", {})
    joint = cfg.get("joint_attention_dim") if hasattr(cfg, "get") else None
    pooled = cfg.get("pooled_projection_dim") if hasattr(cfg, "get") else None
    problems = []
    if joint is not None and int(joint) != text.joint_attention_dim:
        problems.append(f"joint_attention_dim {joint} vs T5 width {text.joint_attention_dim}")
    if pooled is not None and int(pooled) != text.pooled_dim:
        problems.append(f"pooled_projection_dim {pooled} vs CLIP pooled width {text.pooled_dim}")
    if problems:
        raise ModelLoadError(
            f"the DiT and the text encoders in {text_root} do not fit: {'; '.join(problems)}",
            hint="use the text encoders of the same checkpoint family",
        )


# --------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------


def _state_for_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state dict safetensors accepts: contiguous, CPU, no storage shared between keys."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in _unwrap(model).state_dict().items():
        t = v.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    return out


def save_dit_folder(model: torch.nn.Module, folder: str | os.PathLike[str]) -> Path:
    """``config.json`` (with ``_class_name``) + ``diffusion_pytorch_model.safetensors``, atomically."""
    from pfctl.utils.io import atomic_save_safetensors, atomic_write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = _unwrap(model)
    atomic_save_safetensors(
        _state_for_save(model), folder / f"{WEIGHTS_NAME}.safetensors", metadata={"format": "pt"}
    )
    atomic_write_json(folder / "config.json", _config_dict(model))
    return folder


def save_export(
    out_dir: str | os.PathLike[str],
    dit: torch.nn.Module,
    *,
    base_model_path: str | os.PathLike[str] | None,
    ema_dit: torch.nn.Module | None = None,
    config_yaml: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a pfctl export (layout in the module docstring) and return its folder.

    Written into a hidden sibling folder and renamed into place, marker last, so a crash never
    leaves a folder that looks complete. An existing export at ``out_dir`` is replaced; any other
    non-empty folder there is refused. ``base_model_path`` (the official folder the DiT was
    trained from) supplies the VAE and text encoders when the export is loaded.
    """
    from pfctl.utils.io import atomic_write_json, atomic_write_text, replace_dir

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / EXPORT_MARKER).is_file())):
        raise CheckpointError(
            f"{out} exists and is not a pfctl export; refusing to overwrite it",
            hint="choose an empty or new folder for the export",
        )
    base = None
    if base_model_path is not None:
        base_path = Path(base_model_path)
        if not base_path.is_dir():
            raise CheckpointError(
                f"base_model_path {base_path} is not a folder",
                hint="pass the official checkpoint folder the DiT was trained from (or None)",
            )
        base = str(base_path.resolve())
    from pfctl import __version__ as pfctl_version

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        save_dit_folder(dit, staging / "transformer")
        if ema_dit is not None:
            save_dit_folder(ema_dit, staging / "transformer_ema")
        if config_yaml is not None:
            atomic_write_text(staging / "config.yaml", config_yaml)
        class_name = type(_unwrap(dit)).__name__
        marker = {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_FORMAT_VERSION,
            "model_name": DIT_CLASSES.get(class_name, ("", None))[1],
            "dit_class": class_name,
            "base_model_path": base,
            "transformer": "transformer",
            "transformer_ema": "transformer_ema" if ema_dit is not None else None,
            "dit_fingerprint": folder_digest(staging / "transformer"),
            "ema_fingerprint": folder_digest(staging / "transformer_ema") if ema_dit is not None else None,
            "pfctl_version": pfctl_version,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "extra": dict(extra or {}),
        }
        atomic_write_json(staging / EXPORT_MARKER, marker)
        replace_dir(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def convert_to_safetensors(folder: str | os.PathLike[str]) -> list[Path]:
    """Convert every pickled weight file under a checkpoint folder to safetensors (once).

    Delegates to :func:`pfctl.models.weights.convert_folder_to_safetensors` so the VAE and DiT
    share one conversion rule. Returns the safetensors files written.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder", hint="pass the checkpoint folder to convert")
    try:
        from pfctl.models.weights import convert_folder_to_safetensors
    except ImportError as exc:  # pragma: no cover - the module ships with pfctl
        raise ModelLoadError(f"weight conversion is unavailable: {exc}") from exc
    written = convert_folder_to_safetensors(folder)
    return [Path(p) for p in (written or [])]
