"""``fast:`` section — which speed paths :func:`pfctl.models.fast.apply_fast_paths` puts on the models.

One section for every command: ``encode-latents`` and ``generate`` (the VAE's fused norms), ``generate`` and
``train`` (the DiT's kernels and autograd Functions). ``generate.compile`` / ``generate.cuda_graphs`` and
``train.compile`` / ``train.cuda_graphs`` / ``train.gradient_checkpointing`` stay with their commands. Every
path here gives the plain model's results within rounding; a path whose kernel cannot compile on this machine
is left off once, with one warning, when the paths are applied.
"""

from __future__ import annotations

from pfctl.config.base import Section


class FastPathsConfig(Section):
    """``fast:`` — speed paths applied to a built model (all on by default; off = the plain reference path)."""

    fused_qk_rope: bool = True
    """The DiT's per-head q/k RMS norm and rotary embedding in one Triton kernel (CUDA, bf16/fp16 inference;
    training takes the PyTorch ops)."""
    fused_products: bool = True
    """The DiT's GELU in the epilogue of its product, and the single-stream output product part by part
    without the concatenated buffer (CUDA, half-precision inference)."""
    lean_autograd: bool = True
    """Hand-written backward for the DiT's RMS norm, RoPE and per-column modulation: the same products and
    sums in fewer kernels, keeping less for backward (training; the forward is unchanged)."""
    fused_projections: bool = True
    """The DiT's q/k/v projections of one input as one product, the three weights stacked at each call: one
    matrix product instead of three (and under autocast one weight cast), and in the backward one product for
    the input's gradient and one for the weights' (training in half precision: the trainer's fp32 weights
    under bf16 autocast, or weights already in bf16 such as FSDP2's gathers, whose backward stacks them again
    rather than keep a copy; fp32 training and inference keep three products, and a LoRA layer its own)."""
    fused_vae_norm: bool = True
    """The causal VAE's per-frame GroupNorm (+ SiLU) and conv biases in Triton kernels (CUDA, channels-last
    inference)."""

    @property
    def any_on(self) -> bool:
        """Whether any path is on (when none is, the fast package is never imported)."""
        return (
            self.fused_qk_rope
            or self.fused_products
            or self.lean_autograd
            or self.fused_projections
            or self.fused_vae_norm
        )
