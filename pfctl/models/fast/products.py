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
weights each way (``fused_projections``, :class:`FusedProjections`: training in half precision); the
parameters and their state-dict keys stay the three layers'. Each output element is the same dot product,
summed in the product's own order.
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


def stacked_linear(linears: Sequence[nn.Module], x: Tensor, keep_stack: bool = True) -> list[Tensor] | None:
    """``[linear(x) for linear in linears]`` as one product of ``x`` with the linears' weights (and biases)
    stacked, split after: one product forward; backward, one for ``x``'s gradient (summed over the three in
    the product) and one for the stacked weights'. With ``keep_stack=False`` the backward keeps the weights
    themselves and stacks them again (:class:`StackedLinear`), where autograd would keep the stack. None where
    it does not apply: fewer than two layers, or one that is not a plain ``nn.Linear`` (a LoRA layer), or
    biases on some and not others."""
    has_bias = {linear.bias is not None for linear in linears if type(linear) is nn.Linear}
    if len(linears) < 2 or not all(type(linear) is nn.Linear for linear in linears) or len(has_bias) != 1:
        return None
    sizes = [linear.out_features for linear in linears]
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears] if has_bias == {True} else []
    if keep_stack:
        out = F.linear(x, torch.cat(weights), torch.cat(biases) if biases else None)
    else:
        out = StackedLinear.apply(x, len(weights), *weights, *biases)
    return list(out.split(sizes, dim=-1))


class StackedLinear(torch.autograd.Function):
    """``linear(x, cat(weights), cat(biases))`` whose backward keeps the weights, not their stack: for weights
    kept anyway (FSDP2's gathered ones, a half-precision model's own), so no stacked copy lives from the forward
    to the backward. All tensors in one dtype."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, count: int, *params: Tensor) -> Tensor:
        weights, biases = params[:count], params[count:]
        ctx.count, ctx.biased = count, len(biases) > 0
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights), torch.cat(biases) if ctx.biased else None)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        sizes = [w.shape[0] for w in weights]
        grad_x = grad @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        wanted = ctx.needs_input_grad[2:]
        grad_weights: list[Tensor | None] = [None] * ctx.count
        if any(wanted[: ctx.count]):
            grad_weights = list((rows.t() @ x.reshape(-1, x.shape[-1])).split(sizes))
        grad_biases: list[Tensor | None] = [None] * (ctx.count if ctx.biased else 0)
        if ctx.biased and any(wanted[ctx.count :]):
            grad_biases = list(rows.sum(0).split(sizes))
        params = [g if need else None for g, need in zip([*grad_weights, *grad_biases], wanted, strict=True)]
        return grad_x, None, *params


class FusedProjections:
    """Mixin of the attention modules: the projections of one input as one product (:func:`stacked_linear`)
    when training in half precision: fp32 weights under autocast (the trainer on one GPU), whose stacked cast
    the backward keeps as it keeps the three casts otherwise, or weights already in autocast's dtype (FSDP2's
    bf16 gathers, a bf16 model), through :class:`StackedLinear`, which keeps the weights themselves. fp32
    training without autocast keeps the three products, and so does inference: its outputs are contiguous, as
    the fused q/k norm + RoPE kernel (:mod:`.qk_norm_rope`) needs, where the stacked product's split gives
    strided views."""

    def project(self, x: Tensor, linears: Sequence[nn.Module]) -> list[Tensor]:
        how = _stacking(x, linears)
        if how is not None:
            keep_stack, dtype = how
            if (outs := stacked_linear(linears, x.to(dtype), keep_stack)) is not None:  # the cast autocast makes
                return outs
        return super().project(x, linears)


def _stacking(x: Tensor, linears: Sequence[nn.Module]) -> tuple[bool, torch.dtype] | None:
    """How :class:`FusedProjections` stacks: ``(keep_stack, dtype of x)``. ``keep_stack`` where autocast
    casts the weights (the backward keeps the stacked cast); otherwise, weights in half precision, through
    :class:`StackedLinear`, ``x`` in their dtype. None: no gradients, or fp32 weights without autocast."""
    weight = getattr(linears[0], "weight", None)
    if not (torch.is_grad_enabled() and isinstance(weight, Tensor)):
        return None
    device = x.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    if autocast is not None and weight.dtype != autocast:
        return True, x.dtype
    if weight.dtype in (torch.bfloat16, torch.float16) and weight.dtype in (x.dtype, autocast):
        return False, weight.dtype
    return None
