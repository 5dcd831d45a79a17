"""Products of the DiT blocks: two without their elementwise passes (CUDA, inference), and the q/k/v
projections of one input as one product (training).

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

In training, each attention module projects one input to q, k and v with three linear layers: three
products forward (each with its weight's cast under autocast) and, backward, three products for the input's
gradient, summed, and three for the weights'. :func:`stacked_linear` makes them one product of the stacked
weights each way (``fused_projections``, :class:`FusedProjections`, where autocast casts the weights at each
call); the parameters and their state-dict keys stay the three layers'. Each output element is the same dot
product, summed in the product's own order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pfctl.models.fast.qk_norm_rope import cuda_half_inference

__all__ = [
    "FusedGELUProj",
    "FusedProjections",
    "FusedSingleBlockProducts",
    "applies",
    "concat_linear",
    "linear_gelu",
    "stacked_linear",
]


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


def stacked_linear(linears: Sequence[nn.Module], x: Tensor) -> list[Tensor] | None:
    """``[linear(x) for linear in linears]`` as one product of ``x`` with the linears' weights (and biases)
    stacked, split after: one product forward; backward, one for ``x``'s gradient (summed over the three in
    the product) and one for the stacked weights'. None where it does not apply: fewer than two layers, or one
    that is not a plain ``nn.Linear`` (a LoRA layer), or biases on some and not others."""
    has_bias = {linear.bias is not None for linear in linears if type(linear) is nn.Linear}
    if len(linears) < 2 or not all(type(linear) is nn.Linear for linear in linears) or len(has_bias) != 1:
        return None
    weight = torch.cat([linear.weight for linear in linears])
    bias = torch.cat([linear.bias for linear in linears]) if has_bias == {True} else None
    return list(F.linear(x, weight, bias).split([linear.out_features for linear in linears], dim=-1))


class FusedProjections:
    """Mixin of the attention modules: the projections of one input as one product (:func:`stacked_linear`)
    when training under autocast with weights it casts at each call (the trainer's fp32 weights in bf16
    autocast). The stacked weights' cast is what the backward keeps, as it keeps the three casts otherwise;
    weights used as they are (fp32 training, a bf16 base, FSDP's bf16 gathers) would be kept a second time,
    stacked, so those keep the three products. So does inference: its outputs are contiguous, as the fused
    q/k norm + RoPE kernel (:mod:`.qk_norm_rope`) needs, where the stacked product's split gives strided
    views."""

    def project(self, x: Tensor, linears: Sequence[nn.Module]) -> list[Tensor]:
        if _cast_each_call(x, linears) and (outs := stacked_linear(linears, x)) is not None:
            return outs
        return super().project(x, linears)


def _cast_each_call(x: Tensor, linears: Sequence[nn.Module]) -> bool:
    """Training under autocast, the first layer's weight in another dtype than autocast's."""
    device = x.device.type
    if not (torch.is_grad_enabled() and torch.is_autocast_enabled(device)):
        return False
    weight = getattr(linears[0], "weight", None)
    return isinstance(weight, Tensor) and weight.dtype != torch.get_autocast_dtype(device)

