"""FSDP2: shard a built model's blocks and root over every process (the speed layer's last step).

torchtitan's order: activation checkpointing, then ``torch.compile``, then ``fully_shard``. Each
block becomes its own FSDP unit (its parameters all-gathered just before it runs, its gradients
reduce-scattered as soon as backward leaves it), and the root takes the parameters left over
(embedders, final layer). Parameters stay fp32 (the master weights and the optimizer's); with a
``param_dtype`` each block computes from a gathered copy in that dtype and reduces gradients in
``reduce_dtype`` (fp32 by default), which replaces autocast's per-layer weight casts inside the
blocks. The block inputs are not cast (the residual stream keeps the dtype autocast gives it) and
the root keeps fp32 parameters (its few layers run under autocast, as unsharded).

Strategies, in the field's words:

* ``full_shard`` (ZeRO-3): a block's gathered weights are freed after its forward and gathered again
  for its backward. Least memory. The last block keeps its weights, which backward needs at once.
* ``shard_grad_op`` (ZeRO-2): gathered weights stay from forward to backward; one gather per step.

Works on CUDA (NCCL) and on the CPU (gloo), so multi-process behaviour is testable without a GPU;
a single process gets a one-process group of its own.

State dicts: a sharded model's ``state_dict()`` holds this process's shards (DTensors); the
functions here gather whole tensors onto the CPU of the main process (rank 0) — collectives, which
every process must call at the same point — and load whole ones into the shards.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
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
    device: torch.device | None = None,
) -> nn.Module:
    """Apply ``fully_shard`` to each of ``blocks`` (modules inside ``model``) and then to ``model``.

    The mesh spans every process of the default process group (created for a lone process); the
    parameters move to ``device`` (default: CUDA when the model is there, else the CPU) shard by
    shard. Returns ``model`` (sharded in place: its parameters become DTensors).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    device_type = (device.type if device is not None else None) or (
        "cuda" if next(model.parameters()).is_cuda else "cpu"
    )
    ensure_process_group(device_type)
    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    block_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        reshard = strategy == "full_shard" and not last
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard, mp_policy=block_mp, offload_policy=offload
        )
    root_mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    # the DiT returns views (each column's last clip); what reads them (the loss) does so out of place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=root_mp, offload_policy=offload)
    return model


def ensure_process_group(device_type: str) -> None:
    """The default process group; a process started without a launcher gets one of its own (world 1)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward inside keeps its (unsharded, fp32) gradients local: no reduce-scatter until a backward
    outside (gradient accumulation's non-final micro-steps)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gather_full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole CPU tensors of a state dict whose entries may be shards (DTensors), on the main process
    ({} elsewhere). A collective: every process calls it with the same keys in the same order. One
    tensor is gathered at a time, so the device holds at most one whole tensor more."""
    from torch.distributed.tensor import DTensor

    main = torch.distributed.get_rank() == 0
    out = {}
    for name, value in state.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if main:
            out[name] = whole.detach().cpu()
    return out


def scatter_full(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a whole tensor (the same on every process) into ``target``: this process's shard of it when
    ``target`` is a DTensor, else all of it (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        local = distribute_tensor(
            whole.to(device=target.device, dtype=target.dtype), target.device_mesh, target.placements,
            src_data_rank=None,
        )  # fmt: skip
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(whole.to(dtype=target.dtype, device=target.device))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU of the main process ({} elsewhere; a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name, whole, on the CPU of the main process ({} elsewhere;
    a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a name-keyed whole optimizer state into the sharded optimizer (every process passes the same
    ``state``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
