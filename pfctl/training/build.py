"""Building what the trainer trains: the DiT (from a preset or a model folder), its sharding (FSDP2) and
the sharding-aware optimizer state.

The trainer's setup goes model build (:func:`build_model`) → trained weights (full or LoRA:
:mod:`pfctl.training.weights`) → resume weights → speed layer (activation checkpointing, compile,
sharding) → optimizer; this module holds the first step, the model's part of the speed layer and the sharding.
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


def shard_dit(model: torch.nn.Module, cfg: TrainConfig, runtime: Any) -> torch.nn.Module:
    """``train.fsdp`` (``shard_grad_op`` = ZeRO-2, ``full_shard`` = ZeRO-3): FSDP2 over every process, each
    transformer block a unit, the root the rest (:func:`pfctl.runtime.sharding.shard_model`). Under bf16
    mixed precision (the CUDA default) the blocks compute from bf16 gathers and reduce gradients in fp32;
    otherwise in fp32."""
    from pfctl.runtime import logging as pflog
    from pfctl.runtime.sharding import shard_model

    cuda = runtime.device.type == "cuda"
    if cfg.fsdp_cpu_offload and not cuda:
        pflog.log("train.fsdp_cpu_offload is ignored on the CPU (the shards are in host memory already)")
    return shard_model(
        model, [block for _, block in model.blocks_in_order()], strategy=cfg.fsdp,
        param_dtype=torch.bfloat16 if runtime.mixed_precision == "bf16" else None,
        cpu_offload=cfg.fsdp_cpu_offload and cuda, device=runtime.device,
    )  # fmt: skip


def optimizer_state(model: torch.nn.Module, optimizer: Any, *, sharded: bool) -> dict[str, Any]:
    """The whole optimizer state a checkpoint holds (``sharded``: keyed by parameter name, gathered on the
    main process; a collective)."""
    if sharded:
        from pfctl.runtime.sharding import full_optimizer_state

        return full_optimizer_state(model, optimizer.optimizer)
    return optimizer.state_dict()


def load_optimizer_state(
    model: torch.nn.Module, optimizer: Any, state: dict[str, Any], *, sharded: bool
) -> None:
    """Load a checkpoint's whole optimizer state (``sharded``: the name-keyed state → this rank's shards).

    A checkpoint of the other kind (keyed by index vs by name) is converted by the optimizer's parameter
    order, so a run may be resumed with another ``train.fsdp``."""
    names = _parameter_names(model, optimizer)
    keyed_by_name = any(isinstance(k, str) for k in state["state"]) or any(
        isinstance(p, str) for g in state["param_groups"] for p in g["params"]
    )
    if sharded:
        from pfctl.runtime.sharding import load_full_optimizer_state

        if not keyed_by_name:
            state = _rekey(state, lambda i: names[i])
        load_full_optimizer_state(model, optimizer.optimizer, state)
        return
    if keyed_by_name:
        index = {name: i for i, name in enumerate(names)}
        state = _rekey(state, index.__getitem__)
    optimizer.load_state_dict(state)


def _parameter_names(model: torch.nn.Module, optimizer: Any) -> list[str]:
    """The names of the optimizer's parameters, in its order (the indices of ``state_dict()``)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _rekey(state: dict[str, Any], key: Any) -> dict[str, Any]:
    return {
        "state": {key(k): v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [key(p) for p in g["params"]]} for g in state["param_groups"]],
    }


def check_lora_runtime(cfg: TrainConfig, mixed_precision: str) -> None:
    """bf16 base weights compute only under bf16 autocast (fp32 activations x bf16 weights fail)."""
    if cfg.base_dtype == "bf16" and mixed_precision != "bf16":
        raise ConfigError(
            f"train.base_dtype=bf16 needs bf16 autocast, but the run's mixed precision is {mixed_precision!r}",
            hint="--set runtime.mixed_precision=bf16 (the CUDA default), or train.base_dtype=fp32",
        )


def apply_fast_paths(model: torch.nn.Module, config: Any, device: torch.device) -> None:
    """The model's part of the speed layer (:func:`pfctl.models.fast.apply_fast_paths`): the ``fast:``
    kernels, activation checkpointing (``train.gradient_checkpointing``), then compiled blocks
    (``train.compile`` + ``train.cuda_graphs`` as the trainer settled them: CUDA only). Applied after LoRA,
    so the compiled graphs include the adapters."""
    cfg = config.train
    compiled = cfg.compile is True and device.type == "cuda"
    if not (config.fast.any_on or cfg.gradient_checkpointing or compiled):
        return
    from pfctl.models import fast
    from pfctl.runtime import logging as pflog

    ratio = cfg.gradient_checkpointing_ratio if cfg.gradient_checkpointing else 0.0
    # column sizes change independently every step
    graphs = compiled and cfg.cuda_graphs is True
    paths = fast.FastPaths(
        config.fast,
        checkpointing_ratio=ratio,
        checkpointing_policy=cfg.gradient_checkpointing_policy,
        compile=compiled,
        independent_sizes=True,
        cuda_graphs=graphs,
    )
    applied = fast.apply_fast_paths(model, paths)
    if applied:
        pflog.log("fast paths: " + ", ".join(applied))
