"""Tiny pyramid DiTs (both architectures) with random non-zero weights, and the inputs the DiT tests feed them."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pfctl.config.fast import FastPathsConfig
from pfctl.models.dit_flux import PyramidFluxTransformer
from pfctl.models.dit_mmdit import PyramidDiffusionMMDiT

LATENT_C = 4

FLUX_TINY = dict(
    patch_size=1,
    in_channels=4 * LATENT_C,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=12,
    pooled_projection_dim=10,
    axes_dims_rope=[2, 2, 4],
    use_flash_attn=False,
    use_temporal_causal=True,
    interp_condition_pos=True,
)
MMDIT_TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=LATENT_C,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    caption_projection_dim=16,
    pooled_projection_dim=10,
    pos_embed_max_size=8,
    joint_attention_dim=12,
    qk_norm="rms_norm",
    pos_embed_type="sincos",
    temp_pos_embed_type="rope",
    add_temp_pos_embed=True,
    use_t5_mask=True,
    use_temporal_causal=True,
    interp_condition_pos=True,
    use_flash_attn=False,
)
SUMS = {"reduction": 128, "depth": 32}
"""The tiny DiTs' sums: at most 128 terms (a 64-input MLP layer, an attention over at most ~100 keys), about 16
chained per forward and as many again backward (helpers.tolerance derives the tolerance from these)."""

MODELS = {"flux": (PyramidFluxTransformer, FLUX_TINY), "mmdit": (PyramidDiffusionMMDiT, MMDIT_TINY)}


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Tiny model with random (non-zero) weights: the reference init zeroes the output layers."""
    cls, cfg = MODELS[kind]
    model = cls(**{**cfg, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


PLAIN = FastPathsConfig(
    fused_qk_rope=False, fused_products=False, lean_autograd=False, fused_projections=False, fused_vae_norm=False
)


def checkpointed(
    model: torch.nn.Module, ratio: float, kernels: FastPathsConfig = PLAIN, policy: str = "full"
) -> torch.nn.Module:
    """``model`` with activation checkpointing of its first ``floor(L * ratio)`` blocks (the speed layer)."""
    from pfctl.models.fast import FastPaths, apply_fast_paths

    apply_fast_paths(model, FastPaths(kernels, checkpointing_ratio=ratio, checkpointing_policy=policy))
    return model


def inputs(seed: int = 1, text_len: int = 5) -> dict:
    """K=2 columns, Bc=2. Column 0: history (1 frame) + current clip (2 frames). Column 1: low-res history,
    history, current clip (2 frames). Text rows interleaved (r = b*K + k) with right padding."""
    gen = torch.Generator().manual_seed(seed)

    def clip(t: int, h: int, w: int) -> torch.Tensor:
        return torch.randn(2, LATENT_C, t, h, w, generator=gen)

    sample = [[clip(1, 4, 4), clip(2, 4, 4)], [clip(1, 2, 2), clip(1, 4, 4), clip(2, 4, 4)]]
    rows = 4
    valid = torch.tensor([3, 5, 1, 4])
    mask = (torch.arange(text_len)[None] < valid[:, None]).long()
    return dict(
        sample=sample,
        encoder_hidden_states=torch.randn(rows, text_len, 12, generator=gen),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(rows, 10, generator=gen),
        timestep_ratio=torch.tensor([999.0, 500.0, 250.0, 10.0]),
    )


def run(model: torch.nn.Module, args: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return model(**args)


def clone_args(args: dict) -> dict:
    out = {k: v.clone() for k, v in args.items() if k != "sample"}
    out["sample"] = [[c.clone() for c in col] for col in args["sample"]]
    return out


class AttentionKernelRuns(TorchDispatchMode):
    """Counts the runs of the fused attention kernels a selective checkpoint keeps
    (:func:`pfctl.models.fast.checkpointing.kept_operators`). Entered outside the checkpoint, it sits below the
    checkpoint's own mode, so a recomputed call the checkpoint answers from what it kept never reaches it;
    compiled blocks still compile under it, and their calls of the kernels are counted too. ``narrow_runs``
    counts the matrix products that narrow their input (what ``selective_narrow`` also keeps; in a backward
    some gradient products take that form too)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0
        self.output_bytes = 0  # of the counted runs' tensor outputs
        self.narrow_runs = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from pfctl.models.fast.checkpointing import kept_operators, narrows

        out = func(*args, **(kwargs or {}))
        self.narrow_runs += narrows(func, args)
        if func in kept_operators():
            self.runs += 1
            outputs = out if isinstance(out, tuple) else (out,)
            self.output_bytes += sum(t.nbytes for t in outputs if isinstance(t, torch.Tensor))
        return out


def narrowing_block_products(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers of ``model``'s blocks that narrow their input (each runs once per forward)."""
    from pfctl.models.fast.checkpointing import narrowing_linears

    return [linear for _, block in model.blocks_in_order() for linear in narrowing_linears(block)]
