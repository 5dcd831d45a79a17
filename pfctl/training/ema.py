"""Exponential moving average of the DiT weights.

``ema ← decay · ema + (1 - decay) · weights``, applied every ``every`` optimizer steps (the
reference: decay 0.9999 every 100 steps). The shadow copy is fp32 whatever the compute
dtype, so small updates are not lost to bf16 rounding, and it holds every entry of the model's
state dict (buffers are copied, not averaged) so it can be saved as a complete model folder.

Under sharding (FSDP2) the shadow is sharded like the weights: each process averages its own
shards (DTensors, no communication), and :meth:`EMA.state_dict` gathers the whole weights.
"""

from __future__ import annotations

import torch

from pfctl.runtime.sharding import gather_full, scatter_full


def _local(value: torch.Tensor) -> torch.Tensor:
    """This process's part of ``value`` (its shard for a DTensor; in-place updates reach the DTensor)."""
    return value.to_local() if hasattr(value, "to_local") else value


class EMA:
    """Shadow weights keyed like ``model.state_dict()`` (shards when the model is sharded)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], decay: float, every: int = 1) -> None:
        self.decay = decay
        self.every = every
        self.shadow = {
            k: v.detach().to(torch.float32 if torch.is_floating_point(v) else v.dtype).clone()
            for k, v in state_dict.items()
        }
        self.sharded = any(hasattr(v, "to_local") for v in self.shadow.values())

    def should_update(self, step: int) -> bool:
        """``step`` = optimizer steps done so far (1-based after the first update)."""
        return step % self.every == 0

    @torch.no_grad()
    def update(self, state_dict: dict[str, torch.Tensor]) -> None:
        for name, shadow in self.shadow.items():
            ema_value = _local(shadow)
            value = _local(state_dict[name].detach()).to(device=ema_value.device, dtype=ema_value.dtype)
            if torch.is_floating_point(ema_value):
                ema_value.mul_(self.decay).add_(value, alpha=1.0 - self.decay)
            else:
                ema_value.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole shadow. Sharded: a collective (every process calls it) whose result, on the CPU, is
        on the main process only ({} elsewhere)."""
        return gather_full(self.shadow) if self.sharded else self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Whole weights (every process passes the same) into the shadow (its shards when sharded)."""
        missing = sorted(set(self.shadow) - set(state))
        if missing:
            from pfctl.errors import CheckpointError

            raise CheckpointError(f"EMA weights miss {len(missing)} keys, e.g. {missing[:3]}")
        for name, value in self.shadow.items():
            scatter_full(value, state[name])
