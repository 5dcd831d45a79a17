"""What a run trains: every DiT weight (:class:`FullWeights`) or LoRA adapters on a frozen base
(:class:`LoraWeights`). The two differ in a few operations only, and the trainer calls them without
asking which one it has: prepare the model, load resume weights, the state that trains (checkpointed,
averaged by the EMA), what a resume must match, and the export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pfctl.config.train import TrainConfig
from pfctl.data.dataset import group_rng
from pfctl.runtime import logging as pflog
from pfctl.training.build import check_lora_runtime


class FullWeights:
    """Full fine-tuning (or training from scratch): fp32 master weights, every parameter trains."""

    is_lora = False

    def __init__(
        self, config: Any, *, model_name: str, base_model_path: str | None, model_info: dict
    ) -> None:
        self.config, self.cfg = config, config.train
        self.model_name, self.base_model_path, self.model_info = model_name, base_model_path, model_info

    def prepare(self, model: torch.nn.Module, *, seed: int, mixed_precision: str) -> None:
        """Nothing to add: every parameter trains."""

    def load(self, model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
        model.load_state_dict(state, strict=True)

    def trained_state(self, model: torch.nn.Module, unwrapped: torch.nn.Module, accelerator: Any) -> dict:
        """The DiT's weights (under FSDP this rank's shards, DTensors: what the EMA averages)."""
        return unwrapped.state_dict()

    def checkpoint_state(self, model: torch.nn.Module, unwrapped: torch.nn.Module, accelerator: Any) -> dict:
        """The whole state dict a checkpoint and an export hold (FSDP: gathered onto the main process, {}
        elsewhere; a collective)."""
        if self.cfg.fsdp != "none":
            from pfctl.runtime.sharding import full_state_dict

            return full_state_dict(model)
        return accelerator.get_state_dict(model)

    def signature(self) -> dict[str, Any]:
        """Entries of ``train_state.json`` a resume must match (beyond the layout)."""
        return {}

    def adapter_config(self) -> dict[str, Any] | None:
        return None

    def export(
        self,
        out: Path,
        unwrapped: torch.nn.Module,
        state: dict,
        ema_state: dict | None,
        *,
        steps: int,
        extra: dict,
    ) -> None:
        """A model folder ``pfctl generate --model`` loads (main process)."""
        from pfctl.config import dump_config
        from pfctl.models.checkpoint import save_export

        save_export(
            out,
            plain_dit(unwrapped, state),
            base_model_path=self.base_model_path,
            ema_dit=plain_dit(unwrapped, ema_state) if ema_state is not None else None,
            config_yaml=dump_config(self.config),
            extra={"steps": steps, **extra},
        )
        pflog.log(f"exported the model to {out}")


class LoraWeights(FullWeights):
    """LoRA: adapters (A from a generator seeded by the run's seed, B = 0) train in fp32 on a frozen
    base stored in ``train.base_dtype``; checkpoints and exports hold the adapters only."""

    is_lora = True

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.targets: list[str] = []  # adapted module names, known after prepare()

    def prepare(self, model: torch.nn.Module, *, seed: int, mixed_precision: str) -> None:
        """Add the adapters, freeze the base, and store it in ``train.base_dtype``."""
        from pfctl.models.lora import add_lora, cast_frozen

        cfg, lora = self.cfg, self.cfg.lora
        check_lora_runtime(cfg, mixed_precision)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(group_rng(seed, 501).integers(2**62)))
            self.targets = add_lora(
                model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets
            )
        if cfg.base_dtype == "bf16":
            cast_frozen(model, torch.bfloat16)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        pflog.log(
            f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {len(self.targets)} layers: {trainable:,} "
            f"trainable of {total:,} parameters; frozen base in {cfg.base_dtype}"
        )

    def load(self, model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
        from pfctl.models.lora import load_lora_state

        load_lora_state(model, state, source=source)

    def trained_state(self, model: torch.nn.Module, unwrapped: torch.nn.Module, accelerator: Any) -> dict:
        from pfctl.models.lora import lora_state_dict

        return lora_state_dict(unwrapped)

    def checkpoint_state(self, model: torch.nn.Module, unwrapped: torch.nn.Module, accelerator: Any) -> dict:
        return self.trained_state(model, unwrapped, accelerator)

    def signature(self) -> dict[str, Any]:
        """The adapter's shape-defining options and the base weights (an adapter continues bit-exactly
        only on the same base)."""
        from pfctl.utils.io import fingerprint

        cfg, lora = self.cfg, self.cfg.lora
        return {
            "lora": {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "modules": len(self.targets),
                     "targets_fingerprint": fingerprint(self.targets), "base_dtype": cfg.base_dtype,
                     "optimizer": cfg.optimizer},
            "base_fingerprint": self.model_info.get("base_fingerprint"),
        }  # fmt: skip

    def adapter_config(self) -> dict[str, Any]:
        from pfctl.models.lora import adapter_config_dict

        lora = self.cfg.lora
        return adapter_config_dict(lora.rank, lora.alpha, lora.dropout, self.targets, self.base())

    def base(self) -> str | None:
        """The model folder the run adapted (what ``generate --lora`` loads under it)."""
        path = self.config.model.path
        return str(Path(path).expanduser().resolve()) if path is not None else None

    def export(
        self,
        out: Path,
        unwrapped: torch.nn.Module,
        state: dict,
        ema_state: dict | None,
        *,
        steps: int,
        extra: dict,
    ) -> None:
        """The adapter folder ``pfctl generate --lora`` loads (+ a marker naming the base model)."""
        from pfctl.config import dump_config
        from pfctl.models.checkpoint import _config_dict
        from pfctl.models.lora import save_lora_folder

        m, lora = self.config.model, self.cfg.lora
        marker = {
            "base_model_path": self.base(),
            "variant": m.variant if m.path is not None else None,
            "dit_preset": m.dit_preset,
            "model_name": self.model_name,
            "dit_class": type(unwrapped).__name__,
            "dit_config": {k: v for k, v in _config_dict(unwrapped).items() if k != "_class_name"},
            "base_dit_fingerprint": self.model_info.get("dit_fingerprint"),
            "base_fingerprint": self.model_info.get("base_fingerprint"),
            "rank": lora.rank,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "targets": lora.targets,
            "target_modules": list(self.targets),
            "base_dtype": self.cfg.base_dtype,
            "steps": steps,
            "extra": extra,
        }
        save_lora_folder(
            out,
            state,
            self.adapter_config(),
            marker=marker,
            config_yaml=dump_config(self.config),
            ema_state=ema_state,
        )
        pflog.log(f"exported the LoRA adapter to {out}")


def trained_weights(config: Any, **kwargs: Any) -> FullWeights:
    """The run's kind of trained weights: :class:`LoraWeights` with ``train.lora.enabled``."""
    cfg: TrainConfig = config.train
    return (LoraWeights if cfg.lora.enabled else FullWeights)(config, **kwargs)


def plain_dit(unwrapped: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain single-device DiT of the trained architecture holding ``state``.

    Exports are built from a state dict rather than from the training module, which under
    FSDP is sharded and cannot be copied or saved directly.
    """
    model = type(unwrapped).from_config(unwrapped.config)
    model.load_state_dict(state, strict=True)
    return model
