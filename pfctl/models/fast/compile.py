"""``torch.compile`` of the DiT blocks, each compiled in place (state-dict keys unchanged)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CompiledForward", "compile_blocks", "compiler_missing"]


class CompiledForward:
    """Mixin of a compiled block: ``forward`` runs the block's own forward compiled (``_compiled_forward``),
    so the module call around it (its hooks: FSDP2's gathers and gradient hooks) stays eager, as torchtitan
    compiles inside ``fully_shard``. A checkpointed block's forward when training is compiled with its
    checkpoint (``_compiled_recomputing``), so the recomputation is part of its compiled backward. A tensor
    argument that is a view is copied into a tensor of its own first: Dynamo guards a view on its base, and
    the blocks get views in some calls and not in others (the first block's text stream, a slice of the
    embedder's product; FSDP2's gradient hook makes every input a view in the forward but not in the
    checkpointed recomputation), which compiled each block again, forward and backward, the recompilation in
    the middle of the backward."""

    _compiled_forward: Any
    _compiled_recomputing: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_own(a) for a in args)
        kwargs = {k: _own(v) for k, v in kwargs.items()}
        if self._compiled_recomputing is not None and self.training and torch.is_grad_enabled():
            return self._compiled_recomputing(*args, **kwargs)
        return self._compiled_forward(*args, **kwargs)


def _own(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) and value._base is not None else value


def compile_blocks(
    blocks: list[nn.Module],
    backend: str = "inductor",
    *,
    dynamic: bool | None = True,
    independent_sizes: bool = False,
    cuda_graphs: bool = False,
) -> None:
    """``torch.compile`` every block in place, with dynamic shapes: one compiled graph per block type serves
    every token count (the pyramid changes it every call). Fuses the elementwise work around the matmuls
    (norms, RoPE, modulation).

    ``dynamic``: ``True`` makes every size of a block's inputs dynamic from the first trace; ``None``
    (automatic, what generate uses) traces static sizes first and makes dynamic only those that change, so
    head counts and widths stay constants. That matters wherever a block has a graph break: the frames around
    it take all their sizes from their inputs, and with every size dynamic Inductor generated generic, much
    slower kernels (benchmarks/RESULTS.md, when row groups with gradients still ran between compiled frames).

    ``independent_sizes`` (training): sizes that happen to be equal when a block is traced are not assumed
    to stay equal (PyTorch's "duck shaping" off, for the whole process), so columns whose token counts
    change independently every step do not recompile the blocks (fewer graphs, slower tracing; counts in
    benchmarks/RESULTS.md).

    ``cuda_graphs`` (training): each compiled block forward and backward is also recorded as a CUDA graph
    per token count and replayed (``mode="reduce-overhead"``), so a step costs the host a few launches per
    block instead of hundreds. The caller marks each forward as a new step
    (``torch.compiler.cudagraph_mark_step_begin``): what the last one left may then be overwritten. The
    recording then asks its alias question from an index (:func:`.graph_trees.index_recorded_outputs`)."""
    import torch._inductor.config as inductor_config

    # inductor's coalescing analysis (a tiling heuristic: speed, not results) asserted on dynamic-shape
    # kernels of these blocks with torch 2.11 on CUDA; the benchmarked generate runs have it off
    inductor_config.triton.coalesce_tiling_analysis = False
    # the blocks' float attributes (norm eps, dropout p) as constants: with dynamic sizes Dynamo otherwise
    # passes each as a 0-dim CPU tensor, and on CUDA under FSDP2 and checkpointing Inductor then generated
    # CPU code for a block
    torch._dynamo.config.specialize_float = True
    _cache_block_graphs()
    if dynamic is True:
        # with every size symbolic, a hit of the fake-tensor cache rebuilds its output's sizes from their
        # symbolic expressions, which takes longer than computing them again (benchmarks/RESULTS.md)
        _set_known(torch._dynamo.config, "fake_tensor_cache_enabled", False)
    if independent_sizes:
        import torch.fx.experimental._config as shape_config

        shape_config.use_duck_shape = False
    from pfctl.models.fast import swap_class

    if cuda_graphs:
        from pfctl.models.fast.graph_trees import index_recorded_outputs

        # one recording per token count is the design (the trainer's log lists the counts a rank builds):
        # PyTorch's warning past 8 sizes, once per compiled graph and with advice that does not apply, stays off
        _set_known(inductor_config.triton, "cudagraph_dynamic_shape_warn_limit", None)

        if not index_recorded_outputs():
            from pfctl.runtime import logging as pflog

            pflog.warn(
                "CUDA-graph recording: this PyTorch's graph trees lack what pfctl's index of their outputs "
                "relies on; recording uses their own alias scan (a longer warm-up)"
            )

    from pfctl.models.fast.checkpointing import recomputing

    def compiled(forward: Any) -> Any:
        return torch.compile(
            forward, dynamic=dynamic, backend=backend, mode="reduce-overhead" if cuda_graphs else None
        )

    for block in blocks:
        if isinstance(block, CompiledForward):
            continue
        own_forward = block.forward  # the model's forward, bound to this block
        swap_class(block, CompiledForward)
        block._compiled_forward = compiled(own_forward)
        if getattr(block, "activation_checkpointing", False):
            block._compiled_recomputing = compiled(recomputing(own_forward, block.checkpointing_policy))
            block.recomputes_in_graph = True


def _cache_block_graphs() -> None:
    """Let AOTAutograd's on-disk cache take the blocks' graphs, so a later run skips tracing their joint graphs.

    Two things in them made it skip every block graph: the lean autograd Functions (``fast.lean_autograd``),
    which PyTorch leaves out by default until it has tried more models (their forward and backward are traced
    into the graph that keys the cache), and the blocks' choice of attention kernel (``sdpa_kernel``, entered
    around each call), traced as calls of two helpers of torch.nn.attention the cache does not know. Both
    helpers only name and set the SDPA backends, which the trace resolves: the compiled graph holds the chosen
    kernel's operator, and the helpers' arguments are part of the graph that keys the cache."""
    import torch._inductor.config as inductor_config

    _set_known(torch._functorch.config, "autograd_cache_allow_custom_autograd_functions", True)
    if hasattr(inductor_config, "unsafe_marked_cacheable_functions"):
        marked = dict(inductor_config.unsafe_marked_cacheable_functions)
        for name in ("_backend_from_string", "_sdpa_kernel"):
            marked[f"torch.nn.attention.{name}"] = torch.__version__
        inductor_config.unsafe_marked_cacheable_functions = marked


def _set_known(config: Any, name: str, value: object) -> None:
    """Set a compiler option this PyTorch has (an older one lacks some: their default stays)."""
    if hasattr(config, name):
        setattr(config, name, value)


def compiler_missing() -> str | None:
    """Why Inductor cannot generate GPU code on this machine (its kernels are Triton's), or None."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None
