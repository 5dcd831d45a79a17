"""Every speed path of the models, applied to a built model by :func:`apply_fast_paths`.

The model classes (:mod:`pfctl.models.dit_flux`, :mod:`pfctl.models.dit_mmdit`, :mod:`pfctl.models.causal_vae`)
are the reference computation in plain PyTorch. This package makes them fast afterwards, in torchtitan's
order (``parallelize.py``):

1. kernels: module swaps that keep each module where it is (same tree, parameters and state-dict keys) and
   give it a class with the fast version of one step: the fused q/k norm + RoPE kernel
   (:mod:`.qk_norm_rope`), the GELU-epilogue and part-by-part products (:mod:`.products`), the hand-written
   autograd Functions (:mod:`.autograd`), the VAE's fused GroupNorm kernels (:mod:`.vae_norm`), and, for
   compiled blocks, row-group attention as operators the compiler does not look into (:mod:`.row_groups`);
2. activation checkpointing per block (:mod:`.checkpointing`);
3. ``torch.compile`` per block (:mod:`.compile`; a checkpointed block with its checkpoint inside the compiled
   graph; recorded as CUDA graphs, with the trees' alias check indexed, :mod:`.graph_trees`);
4. (sharding: the trainer's, through accelerate).

Whether a Triton kernel can run is decided once, here: a kernel that does not compile is left out with one
warning. CUDA-graph capture of a sampler stage is :class:`.cuda_graph.StageGraph`, used by the sampler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from pfctl.config.fast import FastPathsConfig
from pfctl.runtime import logging as pflog

__all__ = ["FastPaths", "apply_fast_paths", "checkpointed_block_names", "swap_class"]


@dataclass(frozen=True)
class FastPaths:
    """What :func:`apply_fast_paths` does to a model.

    ``kernels``: the ``fast:`` config section (module swaps). ``checkpointing_ratio``: activation
    checkpointing of the first ``floor(L * ratio)`` blocks (0: none), under ``checkpointing_policy``
    (``full``, ``selective`` or ``selective_narrow``: :mod:`.checkpointing`). ``compile``: ``torch.compile`` each
    block with ``dynamic`` / ``independent_sizes`` / ``cuda_graphs`` (:func:`.compile.compile_blocks`) and
    ``compile_backend``."""

    kernels: FastPathsConfig = field(default_factory=FastPathsConfig)
    checkpointing_ratio: float = 0.0
    checkpointing_policy: str = "full"
    compile: bool = False
    dynamic: bool | None = True
    independent_sizes: bool = False
    cuda_graphs: bool = False
    compile_backend: str = "inductor"


def apply_fast_paths(model: nn.Module, paths: FastPaths) -> list[str]:
    """Apply ``paths`` to ``model`` (a DiT or a causal VAE, built and loaded) in place: kernels, then
    activation checkpointing, then compile. Returns the names of the paths put on."""
    applied = _swap_kernels(model, paths)
    blocks_in_order = getattr(model, "blocks_in_order", None)
    if paths.checkpointing_ratio > 0 and blocks_in_order is not None:
        from pfctl.models.fast.checkpointing import Checkpointed, checkpointed_blocks

        blocks = blocks_in_order()
        chosen = {id(block) for _, block in checkpointed_blocks(blocks, paths.checkpointing_ratio)}
        for _, block in blocks:
            swap_class(block, Checkpointed)
            block.activation_checkpointing = id(block) in chosen
            block.checkpointing_policy = paths.checkpointing_policy
        ratio, policy = paths.checkpointing_ratio, paths.checkpointing_policy
        applied.append(f"activation checkpointing (ratio {ratio:g}, {policy})")
    if paths.compile and blocks_in_order is not None:
        from pfctl.models.fast.compile import compile_blocks

        compile_blocks(
            [block for _, block in blocks_in_order()],
            paths.compile_backend,
            dynamic=paths.dynamic,
            independent_sizes=paths.independent_sizes,
            cuda_graphs=paths.cuda_graphs,
        )
        applied.append("compiled blocks" + (" with CUDA graphs" if paths.cuda_graphs else ""))
    return applied


def checkpointed_block_names(model: nn.Module, ratio: float) -> list[str]:
    """Names (state-dict prefixes) of the blocks of ``model`` that checkpointing at ``ratio`` covers."""
    from pfctl.models.fast.checkpointing import checkpointed_blocks

    return [name for name, _ in checkpointed_blocks(model.blocks_in_order(), ratio)]


def _swap_kernels(model: nn.Module, paths: FastPaths) -> list[str]:
    """The module swaps of ``paths.kernels`` (and, for compiled blocks, row groups as one operator); a kernel
    that cannot run on this machine is left off with one warning (none where there is no CUDA device: the
    kernels only ever run on CUDA tensors)."""
    k = paths.kernels
    swaps: list[tuple[str, bool, Callable[[], list[tuple[type, type]]], Callable[[], str | None] | None]] = [
        ("lean autograd", k.lean_autograd, _lean_swaps, None),
        ("fused q/k norm + RoPE", k.fused_qk_rope, _qk_swaps, _qk_kernel_works),
        ("fused products", k.fused_products, _product_swaps, None),
        ("fused q/k/v projections", k.fused_projections, _projection_swaps, None),
        ("fused VAE norms", k.fused_vae_norm, _vae_swaps, _vae_kernels_work),
        ("row groups as one operator", paths.compile, _row_group_swaps, None),
    ]
    applied = []
    for name, wanted, table, works in swaps:
        if not wanted:
            continue
        pairs = table()
        targets = [m for m in model.modules() if any(isinstance(m, base) for base, _ in pairs)]
        if not targets:
            continue
        why_not = works() if works is not None else None
        if why_not is not None:
            if why_not != _NO_CUDA:
                pflog.warn(f"{name}: left off, the kernel cannot run here ({why_not}); using PyTorch ops")
            continue
        for module in targets:
            for base, mixin in pairs:
                if isinstance(module, base):
                    swap_class(module, mixin)
        applied.append(name)
    return applied


_NO_CUDA = "no CUDA device"


def _lean_swaps() -> list[tuple[type, type]]:
    from pfctl.models.dit_layers import AttentionOps, ColumnModulation, RMSNorm
    from pfctl.models.fast.autograd import LeanColumnModulation, LeanRMSNorm, LeanRotation

    return [(RMSNorm, LeanRMSNorm), (ColumnModulation, LeanColumnModulation), (AttentionOps, LeanRotation)]


def _qk_swaps() -> list[tuple[type, type]]:
    from pfctl.models.dit_layers import AttentionOps
    from pfctl.models.fast.qk_norm_rope import FusedQKRope

    return [(AttentionOps, FusedQKRope)]


def _product_swaps() -> list[tuple[type, type]]:
    from pfctl.models.dit_flux import FluxSingleTransformerBlock
    from pfctl.models.dit_layers import GELUProj
    from pfctl.models.fast.products import FusedGELUProj, FusedSingleBlockProducts

    return [(GELUProj, FusedGELUProj), (FluxSingleTransformerBlock, FusedSingleBlockProducts)]


def _projection_swaps() -> list[tuple[type, type]]:
    from pfctl.models.dit_layers import AttentionOps
    from pfctl.models.fast.products import FusedProjections

    return [(AttentionOps, FusedProjections)]


def _vae_swaps() -> list[tuple[type, type]]:
    from pfctl.models.causal_vae.blocks import ResnetBlock
    from pfctl.models.causal_vae.conv import CausalConv3d, FrameGroupNorm
    from pfctl.models.fast.vae_norm import FusedCausalConv3d, FusedFrameGroupNorm, FusedResnetBlock

    return [
        (FrameGroupNorm, FusedFrameGroupNorm),
        (CausalConv3d, FusedCausalConv3d),
        (ResnetBlock, FusedResnetBlock),
    ]


def _row_group_swaps() -> list[tuple[type, type]]:
    from pfctl.models.dit_layers import AttentionOps
    from pfctl.models.fast.row_groups import CompiledRowGroups

    return [(AttentionOps, CompiledRowGroups)]


@functools.cache
def _qk_kernel_works() -> str | None:
    from pfctl.models.fast.qk_norm_rope import kernel_works

    return kernel_works()


@functools.cache
def _vae_kernels_work() -> str | None:
    from pfctl.models.fast.vae_norm import kernels_work

    return kernels_work()


@functools.cache
def _swapped_class(mixin: type, base: type) -> type:
    """``base`` with ``mixin``'s methods first, under ``base``'s own name (class-name lookups such as
    FSDP's wrap policy by ``_no_split_modules`` still find it)."""
    return type(
        base.__name__, (mixin, base), {"__qualname__": base.__qualname__, "__module__": base.__module__}
    )


def swap_class(module: nn.Module, mixin: type) -> None:
    """Give ``module`` the class ``(mixin, type(module))`` in place (as FSDP2's ``fully_shard`` does): its
    parameters, buffers, hooks and place in the model stay; applying the same mixin twice is a no-op."""
    if not isinstance(module, mixin):
        module.__class__ = _swapped_class(mixin, type(module))
