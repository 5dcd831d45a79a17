"""Two products of the DiT blocks without their elementwise passes (CUDA, inference).

Both DiTs widen the hidden states fourfold with a linear layer followed by a tanh-approximated GELU (the
double blocks' feed-forward, the single blocks' ``proj_mlp``), and the single blocks project the
concatenation ``[attention; GELU(mlp)]`` back with ``proj_out``. Compiled with the blocks, Inductor runs the
GELU as a separate pass over the ``4D``-wide activations and writes it, together with the attention output,
into a concatenated buffer that ``proj_out`` then reads (timings in benchmarks/RESULTS.md, session 12).

- :func:`linear_gelu` computes ``gelu(linear(x))`` as one cuBLASLt product with the bias and the GELU in its
  epilogue (``torch._addmm_activation``): the GELU is applied to the float32 sum, before the rounding to the
  activations' dtype that the two separate ops apply in between.
- :func:`concat_linear` computes ``linear(cat(parts, -1))`` as one product per part over its slice of the
  weight's columns, each accumulated onto the last (the bias in the first): no concatenated buffer. The
  partial sums are rounded to the activations' dtype between the products.

So results agree with the PyTorch ops to within a rounding step of the activations' dtype, not bit for bit.
Swapped in by :func:`pfctl.models.fast.apply_fast_paths` (``fused_products``): :class:`FusedGELUProj` and
:class:`FusedSingleBlockProducts` take these where :func:`applies` (CUDA, half precision, plain
``nn.Linear`` layers with a bias -- a LoRA layer is not one --, no autograd); everything else, training
included, takes the PyTorch ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pfctl.models.fast.qk_norm_rope import cuda_half_inference

__all__ = ["FusedGELUProj", "FusedSingleBlockProducts", "applies", "concat_linear", "linear_gelu"]


def applies(linear: nn.Module, x: Tensor) -> bool:
    """True when ``linear`` applied to ``x`` can take the fused products: a plain ``nn.Linear`` with a bias,
    ``x`` on CUDA in the weight's half-precision dtype, no gradient wanted."""
    return type(linear) is nn.Linear and linear.bias is not None and cuda_half_inference(x, linear.weight)


def linear_gelu(linear: nn.Module, x: Tensor) -> Tensor:
    """``gelu(linear(x), approximate="tanh")``: the bias and the GELU in the product's epilogue where
    :func:`applies`, the PyTorch ops otherwise."""
    if not applies(linear, x):
        return F.gelu(linear(x), approximate="tanh")
    rows = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(linear.bias, rows, linear.weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], out.shape[-1])


def concat_linear(linear: nn.Module, parts: Sequence[Tensor]) -> Tensor:
    """``linear(torch.cat(parts, dim=-1))``: one product per part, accumulated, where :func:`applies` to
    every part (then the parts' leading sizes must agree, as ``cat`` requires), the PyTorch ops otherwise."""
    if not all(applies(linear, part) for part in parts):
        return linear(torch.cat(list(parts), dim=-1))
    out: Tensor | None = None
    start = 0
    for part in parts:
        width = part.shape[-1]
        rows = part.reshape(-1, width)
        weight = linear.weight[:, start : start + width].t()
        out = torch.addmm(linear.bias if out is None else out, rows, weight)
        start += width
    if out is None or start != linear.in_features:
        raise ValueError(f"parts of widths {[p.shape[-1] for p in parts]} do not make {linear.in_features}")
    return out.view(*parts[0].shape[:-1], out.shape[-1])


class FusedGELUProj:
    """Mixin of ``GELUProj``: the GELU in the product's epilogue."""

    def forward(self, x: Tensor) -> Tensor:
        return linear_gelu(self.proj, x)


class FusedSingleBlockProducts:
    """Mixin of the Flux single-stream block: its MLP with the GELU epilogue, its output product part by part."""

    def mlp(self, x: Tensor) -> Tensor:
        return linear_gelu(self.proj_mlp, x)

    def project_out(self, attn: Tensor, mlp: Tensor) -> Tensor:
        return concat_linear(self.proj_out, [attn, mlp])
