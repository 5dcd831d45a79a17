"""Hand-written autograd Functions of the DiT layers: the same products and sums as the plain layers
(:mod:`pfctl.models.dit_layers`, :mod:`pfctl.models.rope`) in fewer kernels, keeping less for backward.

Each comes with a mixin that :func:`pfctl.models.fast.apply_fast_paths` swaps into the modules' classes
(``lean_autograd``): :class:`LeanRMSNorm` for ``RMSNorm``, :class:`LeanColumnModulation` for the blocks and
the output norm, :class:`LeanRotation` for the attention modules. Under torch.compile the column products
take the plain form (Inductor fuses it anyway; dynamo cannot trace ``out=`` into strided column slices).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pfctl.models.rope import RotaryTable

__all__ = ["ColumnAffine", "LeanColumnModulation", "LeanRMSNorm", "LeanRotation", "RMSNormFunction", "Rotary"]


def _normalized(x: torch.Tensor, rstd: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """``x * rstd`` in float32, rounded to a half-precision weight's dtype (the reference multiplies in it)."""
    if weight_dtype in (torch.float16, torch.bfloat16):
        return torch.mul(x, rstd, out=torch.empty_like(x, dtype=weight_dtype))
    return x * rstd


class RMSNormFunction(torch.autograd.Function):
    """The reference's RMS norm, ``(x * rsqrt(mean(float(x)^2) + eps) [-> weight dtype] * weight) -> x dtype``,
    with the same ops and rounding steps, in fewer kernels and with less kept for backward.

    Forward: the last product is returned as it is, cast only where the dtypes differ. Torch 2.11's Dynamo
    traced this Function wrongly when its output was not a fresh result (a product written with ``out=`` into
    an empty tensor, as the cast used to be folded, or a ``.to`` with nothing to cast): the forward stayed
    exact and every gradient through the norm came out zero, with any backend (torch 2.13 traced it right).

    Backward forms the same products and sums autograd forms for that graph (``2 * g_mean * x`` as
    ``(2 * g_mean) * x``: scaling by 2 is exact), but keeps only ``x`` and ``rstd`` -- autograd also kept the
    float32 upcast of a half-precision ``x`` and, when the weight trains, the float32 normalised values -- and
    skips autograd's casts, its ``pow(x, 1)`` copy and its full-size division.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        rstd = x.float().pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1] float32
        ctx.save_for_backward(x, weight, rstd)
        out = _normalized(x, rstd, weight.dtype) * weight
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        if weight.dtype in (torch.float16, torch.bfloat16):
            grad = grad.to(weight.dtype)  # the product with the weight ran in its dtype (a no-op for bf16 x)
        grad_weight = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * _normalized(x, rstd, weight.dtype)).sum_to_size(weight.shape)
        if ctx.needs_input_grad[0]:
            # gradient of the float32 normalised values (rounded in the weight dtype first when it is half)
            grad_y = torch.mul(grad, weight, out=torch.empty_like(x, dtype=torch.float32))
            grad_var = (grad_y * x).sum(-1, keepdim=True).mul(-0.5) * rstd.pow(3)  # through rsqrt
            grad_x = torch.mul(grad_y, rstd, out=torch.empty_like(x))
            grad_x += torch.mul(grad_var.div(x.shape[-1]).mul(2.0), x, out=torch.empty_like(x))  # mean(x^2)
        return grad_x, grad_weight, None


def _column_rows(m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[Bc, K, D]`` -> K views ``[Bc, 1, D]`` (one per column, broadcast over its tokens)."""
    return m[:, :, None].unbind(1)


def _column_sums(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per column the sum over its tokens, ``K x [Bc, n_k, D] -> [Bc, K, D]``, then cast to ``dtype`` (how
    autograd reduces the gradient of a broadcast ``[Bc, 1, D]`` operand and casts it to the operand's dtype)."""
    sums = [p.sum(1, keepdim=True) for p in parts]
    return (sums[0] if len(sums) == 1 else torch.cat(sums, dim=1)).to(dtype)


class ColumnAffine(torch.autograd.Function):
    """``out_k = (x_k * scale_k [+ shift_k]) [+ residual_k]`` for the token segments ``x_k`` of the columns.

    The same products and sums, in the same order and dtypes, as ``cat([x_k * s_k + b_k]) + residual`` under
    autograd (each intermediate rounded to its own promoted dtype, each gradient cast back through that
    chain), but every column is written straight into one output and its gradient straight into one
    gradient tensor: no ``cat`` reassembling the segments in the forward, none for ``x``'s gradient in the
    backward, and one cast for all columns' modulation gradients instead of one per column.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        lengths: list[int],
        scale: torch.Tensor,
        shift: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        product_dtype = torch.promote_types(x.dtype, scale.dtype)
        sum_dtype = product_dtype if shift is None else torch.promote_types(product_dtype, shift.dtype)
        out_dtype = sum_dtype if residual is None else torch.promote_types(sum_dtype, residual.dtype)
        out = x.new_empty(x.shape, dtype=out_dtype)
        shifts = [None] * len(lengths) if shift is None else _column_rows(shift)
        for x_k, out_k, s_k, b_k in zip(
            x.split(lengths, 1), out.split(lengths, 1), _column_rows(scale), shifts, strict=True
        ):
            torch.mul(x_k, s_k, out=out_k)  # computed (and rounded) in the inputs' dtype, then stored
            if b_k is not None:
                out_k.add_(b_k)
        if residual is not None:
            out.add_(residual)
        ctx.lengths, ctx.x_dtype = lengths, x.dtype
        ctx.dtypes = (product_dtype, sum_dtype, None if shift is None else shift.dtype)
        # like autograd's product: keep each factor only for the other's gradient (a frozen modulation, e.g.
        # under LoRA, keeps no full-size x)
        ctx.save_for_backward(
            x if ctx.needs_input_grad[2] else None, scale if ctx.needs_input_grad[0] else None
        )
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, scale = ctx.saved_tensors
        product_dtype, sum_dtype, shift_dtype = ctx.dtypes
        grad_residual = grad if ctx.needs_input_grad[4] else None
        grad_sum = grad.to(sum_dtype)  # no-ops (no kernel) unless the residual stream is wider
        grads = grad_sum.to(product_dtype).split(ctx.lengths, 1)
        grad_x = grad_scale = grad_shift = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.new_empty(grad.shape, dtype=ctx.x_dtype)
            for g_k, s_k, out_k in zip(grads, _column_rows(scale), grad_x.split(ctx.lengths, 1), strict=True):
                torch.mul(g_k, s_k, out=out_k)
        if ctx.needs_input_grad[2]:
            products = [g_k * x_k for g_k, x_k in zip(grads, x.split(ctx.lengths, 1), strict=True)]
            grad_scale = _column_sums(products, scale.dtype)
        if ctx.needs_input_grad[3]:
            grad_shift = _column_sums(grad_sum.split(ctx.lengths, 1), shift_dtype)
        return grad_x, None, grad_scale, grad_shift, grad_residual


def _rotate_pairs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, hd]`` -> ``x0 * a + x1 * b`` per channel pair, in float32, rounded once to ``x``'s dtype.

    Three kernels: the mixed-dtype products read ``x`` in its own dtype and compute in float32 (no upcast
    copy), and ``add(out=)`` rounds the float32 sum straight into the output (no separate cast).
    """
    pairs = x.unflatten(-1, (-1, 2))  # [B, S, H, hd/2, 2]
    out = torch.empty_like(pairs)
    return torch.add(pairs[..., :1] * a, pairs[..., 1:] * b, out=out).flatten(-2)


class Rotary(torch.autograd.Function):
    """RoPE with a hand-written backward: the gradient of a rotation is the transposed rotation (3 kernels),
    where autograd would run the backward of every op of the forward (~14 kernels, with full-size zero-fills)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        a_t: torch.Tensor,
        b_t: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(a_t, b_t)
        return _rotate_pairs(x, a, b)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        a_t, b_t = ctx.saved_tensors
        return _rotate_pairs(grad, a_t, b_t), None, None, None, None


class LeanRMSNorm:
    """``RMSNorm`` through :class:`RMSNormFunction` (same forward, leaner backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class LeanColumnModulation:
    """``ColumnModulation.affine_columns`` through :class:`ColumnAffine` in eager mode."""

    def affine_columns(
        self,
        x: torch.Tensor,
        lengths: list[int],
        scale: torch.Tensor,
        shift: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().affine_columns(x, lengths, scale, shift, residual)
        return ColumnAffine.apply(x, lengths, scale, shift, residual)


class LeanRotation:
    """``AttentionOps.rotate`` through :class:`Rotary` (the backward is the transposed rotation)."""

    def rotate(self, x: torch.Tensor, table: RotaryTable) -> torch.Tensor:
        return Rotary.apply(x, table.a, table.b, table.a_t, table.b_t)
