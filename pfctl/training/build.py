"""Building what the trainer trains: the DiT (from a preset or a model folder), the FSDP plugin and the
sharding-aware optimizer state.

The trainer's setup goes model build (:func:`build_model`) → trained weights (full or LoRA:
:mod:`pfctl.training.weights`) → resume weights → speed layer (activation checkpointing, compile,
sharding) → optimizer; this module holds the first step and the sharding plugin.
"""

from __future__ import annotations

from typing import Any

import torch

from pfctl.config.train import TrainConfig
from pfctl.errors import ConfigError


def dit_overrides(config: Any) -> dict[str, Any]:
    """Constructor arguments the train options control (so booleans really turn things off).

    Activation checkpointing is a constructor option of the DiTs (the first
    ``gradient_checkpointing_ratio`` of the blocks recompute in backward)."""
    cfg = config.train
    return {
        "use_temporal_causal": cfg.use_temporal_causal,
        "interp_condition_pos": cfg.interp_condition_pos,
        "use_gradient_checkpointing": cfg.gradient_checkpointing,
        "gradient_checkpointing_ratio": cfg.gradient_checkpointing_ratio,
    }


def build_model(config: Any) -> tuple[str, torch.nn.Module, str | None, dict[str, Any]]:
    """(model name, fp32 DiT, base model path, info). ``model.dit_preset`` = from scratch with a
    registered architecture; ``model.path`` = fine-tune an official folder or a pfctl export.

    ``info["base_fingerprint"]`` identifies the starting weights (a LoRA resume checks it: an
    adapter continues bit-exactly only on the same base)."""
    m = config.model
    if m.dit_preset is not None:
        from pfctl.models.registry import build_dit
        from pfctl.utils.io import tensor_fingerprint

        dit = build_dit(m.dit_preset, {**m.dit_config, **dit_overrides(config)})
        info = {"dit_fingerprint": None}
        if config.train.lora.enabled:  # hashing is cheap next to training; only LoRA resumes need it
            info["base_fingerprint"] = tensor_fingerprint(dit.state_dict())
        return m.name, dit, None, info
    if m.path is None:
        raise ConfigError(
            "train needs a model: set model.path (an official folder or a pfctl export to fine-tune) "
            "or model.dit_preset (train from scratch)",
            hint="e.g. --set model.dit_preset=tiny",
        )
    from pfctl.models.checkpoint import load_components

    parts = load_components(
        m.path,
        variant=m.variant,
        need=("dit",),
        dtype=torch.float32,
        dit_dtype=torch.float32,
        dit_overrides=dit_overrides(config),
        model_name=m.name,
    )
    base = parts.info.get("base_model_path") or (m.path if parts.info.get("layout") == "official" else None)
    fps = parts.info.get("fingerprints") or {}
    info = {
        "dit_fingerprint": fps.get("dit"),
        "base_fingerprint": fps.get("dit"),
        "layout": parts.info.get("layout"),
    }
    return parts.model_name or m.name, parts.dit, base, info


def build_fsdp_plugin(cfg: TrainConfig, model_name: str) -> Any:
    """accelerate's FSDP plugin for ``train.fsdp`` (None for ``none``).

    Blocks of the DiT are the wrap units (the model class lists them in ``_no_split_modules``),
    prefetching BACKWARD_PRE, full state dict for checkpoints — the reference's setup.
    """
    if cfg.fsdp == "none":
        return None
    if not torch.cuda.is_available():
        raise ConfigError(
            f"train.fsdp={cfg.fsdp} needs CUDA devices (accelerate's FSDP does not run on the CPU)",
            hint="use train.fsdp=none on the CPU",
        )
    from accelerate import FullyShardedDataParallelPlugin

    from pfctl.models.checkpoint import MODEL_NAME_TO_CLASS, dit_class

    blocks = list(getattr(dit_class(MODEL_NAME_TO_CLASS[model_name]), "_no_split_modules", None) or [])
    if not blocks:
        raise ConfigError(f"the {model_name} DiT declares no block classes to wrap with FSDP")
    return FullyShardedDataParallelPlugin(
        fsdp_version=1,
        sharding_strategy="SHARD_GRAD_OP" if cfg.fsdp == "shard_grad_op" else "FULL_SHARD",
        backward_prefetch="BACKWARD_PRE",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=blocks,
        state_dict_type="FULL_STATE_DICT",
        cpu_offload=cfg.fsdp_cpu_offload,
        use_orig_params=True,
        sync_module_states=True,
    )


def optimizer_state(model: torch.nn.Module, optimizer: Any, *, sharded: bool) -> dict[str, Any]:
    """The full optimizer state a checkpoint holds (``sharded``, under FSDP: gathered by name on the
    main process; collective)."""
    if sharded:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.optim_state_dict(model, optimizer.optimizer)
    return optimizer.state_dict()


def load_optimizer_state(
    model: torch.nn.Module, optimizer: Any, state: dict[str, Any], *, sharded: bool
) -> None:
    """Load a checkpoint's full optimizer state (``sharded``: the name-keyed state → this rank's shards)."""
    if sharded:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        state = FSDP.optim_state_dict_to_load(model, optimizer.optimizer, state)
    optimizer.load_state_dict(state)


def check_lora_runtime(cfg: TrainConfig, mixed_precision: str) -> None:
    """bf16 base weights compute only under bf16 autocast (fp32 activations x bf16 weights fail)."""
    if cfg.base_dtype == "bf16" and mixed_precision != "bf16":
        raise ConfigError(
            f"train.base_dtype=bf16 needs bf16 autocast, but the run's mixed precision is {mixed_precision!r}",
            hint="--set runtime.mixed_precision=bf16 (the CUDA default), or train.base_dtype=fp32",
        )
