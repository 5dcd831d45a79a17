"""Activation checkpointing of the DiT blocks, applied per block.

The blocks with execution index ``< floor(L * ratio)`` (``L`` blocks in the order of the model's
``blocks_in_order()``: Flux double-stream then single-stream) recompute their forward in the backward
instead of keeping its activations, in training mode with gradients on. The swap keeps each block where it
is (same module tree, same state-dict keys). An eager block is checkpointed around its call; a compiled one
inside its compiled graph (:func:`recomputing`, compiled by :mod:`.compile` as torchtitan compiles a
checkpointed block), so its recomputation is part of its compiled backward.

Three policies (torchtitan's ``full`` and two op-level ``selective`` ones):

* ``full``: everything a checkpointed block computed is computed again (the reference's checkpointing);
* ``selective``: the results of the fused attention kernels (output and log-sum-exp, a few bytes per token
  and head next to the block's activations; the row groups' operator, :mod:`.row_groups`, counts as one) are
  kept from the forward, so the recomputation runs the block's products and elementwise work but not its
  attention, the block's costliest part at long token counts;
* ``selective_narrow``: ``selective``, and the outputs of the matrix products that narrow their input (the
  feed-forward's down projection, the single blocks' ``proj_out``: the backward needs them only for their
  gate's gradient) are kept too. Each is one activation of the block's width per token and saves the
  recomputation a product of 4 or 5 times that width (a third of a double block's product work, 5/12 of a
  single block's).

The kept results are the ones the recomputation would produce (the same kernel on the same inputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch.utils.checkpoint
from torch import nn

from pfctl.models.dit_layers import check_ratio, num_checkpointed

__all__ = [
    "Checkpointed",
    "checkpointed_blocks",
    "kept_operators",
    "narrowing_linears",
    "narrows",
    "recomputing",
]

#: what a checkpointed block keeps from its forward (see the module docstring)
Policy = Literal["full", "selective", "selective_narrow"]

#: the fused SDPA kernels whose results ``selective`` keeps (those this PyTorch has); the math fallback is a
#: composition of ordinary operators and is recomputed
_ATTENTION_KERNELS = (
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


@functools.cache
def kept_operators() -> frozenset:
    """The operators whose results a ``selective`` checkpointed block keeps: the attention's, through SDPA,
    the row groups' operator or FlexAttention (the ``flex`` backend's operator, as torchtitan keeps it)."""
    import pfctl.models.fast.row_groups  # noqa: F401  (registers the row groups' training operator)

    ops = (getattr(torch.ops.aten, name, None) for name in _ATTENTION_KERNELS)
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return frozenset(
        [
            *(op.default for op in ops if op is not None),
            torch.ops.pfctl.row_group_attention_train.default,
            *([flex] if flex is not None else []),
        ]
    )


def narrows(op: Any, args: tuple) -> bool:
    """Whether ``op`` on ``args`` is a matrix product whose output is narrower than its input (``mm`` or
    ``addmm`` by a ``[in, out]`` matrix with ``in > out``: how a down projection's linear layer runs)."""
    if op is torch.ops.aten.mm.default:
        matrix = args[1]
    elif op is torch.ops.aten.addmm.default:
        matrix = args[2]
    else:
        return False
    return matrix.shape[0] > matrix.shape[1]


def narrowing_linears(module: nn.Module) -> list[nn.Linear]:
    """The linear layers in ``module`` that narrow their input: whose products :func:`narrows` tells apart,
    and whose outputs a ``selective_narrow`` checkpointed block keeps."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and m.in_features > m.out_features]


def _keep(narrow: bool, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = torch.utils.checkpoint.CheckpointPolicy
    kept = op in kept_operators() or (narrow and narrows(op, args))
    return policy.MUST_SAVE if kept else policy.PREFER_RECOMPUTE


@functools.cache
def _selective_contexts(policy: Policy) -> functools.partial:
    """The ``context_fn`` of a selective ``policy``: a partial (the form Dynamo traces) with the
    ``cache_hash`` by which AOTAutograd's cache tells policies apart (it skips graphs with a context function
    lacking one)."""
    keep = functools.partial(_keep, policy == "selective_narrow")
    contexts = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, keep)
    kept = " ".join(sorted(str(op) for op in kept_operators()))
    contexts.cache_hash = f"pfctl {policy}: {kept}"
    return contexts


def recomputing(forward: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """``forward`` checkpointed with ``policy``: what an eager block's call runs, and what :mod:`.compile`
    compiles for a checkpointed block."""
    options: dict[str, Any] = {"use_reentrant": False}
    if policy != "full":
        options["context_fn"] = _selective_contexts(policy)

    def run(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, **options, **kwargs)

    return run


class Checkpointed:
    """Mixin of a block: its call runs under ``torch.utils.checkpoint`` (non-reentrant) when training, if
    ``activation_checkpointing`` is set on it, with ``checkpointing_policy`` (the module docstring's three);
    a compiled block (``recomputes_in_graph``) checkpoints inside its compiled forward instead. Every block of
    a model gets the mixin (so blocks of one kind keep one class, which FSDP's wrap policy matches by class)
    and the flag says which ones recompute."""

    activation_checkpointing: bool = False
    checkpointing_policy: Policy = "full"
    #: set by :func:`.compile.compile_blocks`: the compiled forward checkpoints itself
    recomputes_in_graph: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            self.activation_checkpointing
            and not self.recomputes_in_graph
            and self.training
            and torch.is_grad_enabled()
        ):
            run = recomputing(super().__call__, self.checkpointing_policy)
            return run(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def checkpointed_blocks(blocks: list[tuple[str, nn.Module]], ratio: float) -> list[tuple[str, nn.Module]]:
    """The ``(name, block)`` pairs checkpointed at ``ratio``: the first ``floor(len(blocks) * ratio)``."""
    check_ratio(ratio)
    return blocks[: num_checkpointed(len(blocks), ratio)]
