"""FSDP2: shard a built model's blocks and root over every process (the speed layer's last step).

torchtitan's order: activation checkpointing, then ``torch.compile``, then ``fully_shard``. Each
block becomes its own FSDP unit (its parameters all-gathered just before it runs, its gradients
reduce-scattered as soon as backward leaves it), and the root takes the parameters left over
(embedders, final layer). Parameters stay fp32 (the master weights and the optimizer's); with a
``param_dtype`` each unit computes in that dtype from a gathered copy and reduces gradients in
``reduce_dtype`` (fp32 by default), which replaces autocast's per-layer weight casts.

Strategies, in the field's words:

* ``full_shard`` (ZeRO-3): a block's gathered weights are freed after its forward and gathered again
  for its backward. Least memory. The last block keeps its weights, which backward needs at once.
* ``shard_grad_op`` (ZeRO-2): gathered weights stay from forward to backward; one gather per step.

Works on CUDA (NCCL) and on the CPU (gloo), so multi-process behaviour is testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

Strategy = Literal["full_shard", "shard_grad_op"]
STRATEGIES: tuple[str, ...] = ("full_shard", "shard_grad_op")


def shard_model(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    strategy: Strategy = "full_shard",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
) -> nn.Module:
    """Apply ``fully_shard`` to each of ``blocks`` (modules inside ``model``) and then to ``model``.

    Needs an initialised default process group; the mesh spans every process. Returns ``model``
    (sharded in place: its parameters become DTensors).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    world = torch.distributed.get_world_size()
    device_type = "cuda" if next(model.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(device_type, (world,))
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=strategy == "full_shard" and not last, **options)
    fully_shard(model, reshard_after_forward=False, **options)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole unsharded state dict on the CPU, on every process (a collective: all must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict into a sharded ``model`` (every process passes the same ``state``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name, unsharded, on the CPU (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a name-keyed unsharded optimizer state into the sharded optimizer (every process)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def clip_grad_norm(parameters: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over sharded gradients: the total norm of the whole model, on every process."""
    total = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return total.full_tensor() if hasattr(total, "full_tensor") else total
