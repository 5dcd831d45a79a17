"""The per-head RMS norm of queries and keys and their rotary embedding in one Triton kernel (CUDA, inference).

Both DiTs norm each head of q and k (``RMSNorm`` over the head width) and then rotate its channel pairs
(:func:`pfctl.models.rope.apply_rope`). Compiled with the blocks, Inductor fuses the two into one kernel per
block, but one that reads each channel pair with gathers that do not vectorise. This kernel reads each row of
``hd`` channels once, contiguously, splits it into its pairs in registers and writes the rotated row back
contiguously (timings in benchmarks/RESULTS.md, session 11).

The arithmetic is the eager path's, step by step: ``rstd = rsqrt(mean(float(x)^2) + eps)``, ``x * rstd``
rounded to the weight's dtype, times the weight rounded again, then ``(c*x0 - s*x1, s*x0 + c*x1)`` with each
product and the sum in float32 (no fused multiply-add, as PyTorch's separate kernels) rounded once to ``x``'s
dtype. Only the order of the 64-term sum of squares differs, so results agree to within a bf16 rounding step.

:class:`FusedQKRope` is swapped into the attention modules by :func:`pfctl.models.fast.apply_fast_paths`
(``fused_qk_rope``, after :func:`kernel_works` said yes once); per call it takes the kernel where
:func:`applies` (CUDA, half-precision q/k and weight, no autograd) and the norm is an RMS norm followed by a
rotation; everything else, training included, takes the module's own path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from pfctl.models.dit_layers import RMSNorm
from pfctl.models.rope import RotaryTable, rope_tables, rotary_table

__all__ = ["FusedQKRope", "applies", "cuda_half_inference", "kernel_works", "rms_norm_rope"]

_ROWS_PER_PROGRAM = 32


def cuda_half_inference(x: Tensor, weight: Tensor) -> bool:
    """True when ``x`` and ``weight`` are a CUDA inference step in half precision: ``x`` on CUDA in
    ``weight``'s dtype, bf16 or fp16, and no gradient wanted for either. The first check of both fused paths
    (this module's and :mod:`pfctl.models.fast.products`'): training leaves here, before any check on sizes
    a compiled block would have to guard on."""
    return (
        x.is_cuda
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
    )


def applies(x: Tensor, weight: Tensor) -> bool:
    """True when :func:`rms_norm_rope` can take ``x [B, S, H, hd]`` with the norm weight ``weight [hd]``:
    contiguous on CUDA, under 2**31 elements, in the weight's half-precision dtype, ``hd`` a power of two, no
    gradient wanted (the caller, :meth:`FusedQKRope.norm_rope`, checks that the norm is an RMS norm and that
    a rotary table is given)."""
    hd = x.shape[-1]
    return (
        cuda_half_inference(x, weight)
        and x.dim() == 4
        and hd >= 2
        and hd & (hd - 1) == 0
        and x.is_contiguous()
        and x.numel() < 2**31  # the kernel's offsets are 32-bit
    )


@torch.library.custom_op("pfctl::rms_norm_rope", mutates_args=())
def rms_norm_rope(x: Tensor, weight: Tensor, a: Tensor, b: Tensor, eps: float) -> Tensor:
    """The kernel behind :meth:`FusedQKRope.norm_rope`: ``x [B, S, H, hd]``, ``weight [hd]``,
    the forward tables ``a, b`` of a :class:`RotaryTable` (``[S, 1, hd/2, 2]`` float32) -> ``[B, S, H, hd]``
    like ``x``."""
    import triton

    batch, seq, heads, hd = x.shape
    out = torch.empty_like(x)
    rows = batch * seq * heads
    _kernel()[(triton.cdiv(rows, _ROWS_PER_PROGRAM),)](
        x,
        weight.contiguous(),
        a.contiguous(),
        b.contiguous(),
        out,
        rows,
        heads,
        seq,
        eps,
        HD=hd,
        ROWS=_ROWS_PER_PROGRAM,
        enable_fp_fusion=False,  # products and sums rounded one by one, as PyTorch's kernels do
    )
    return out


@rms_norm_rope.register_fake
def _rms_norm_rope_shape(x: Tensor, weight: Tensor, a: Tensor, b: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # one compiled variant for every shape: Triton would otherwise compile another one for each new
    # combination of the sizes' divisibility by 16 (the pyramid's token counts change every stage)
    @triton.jit(do_not_specialize=["rows", "heads", "seq"])
    def rms_norm_rope_kernel(x_ptr, w_ptr, a_ptr, b_ptr, out_ptr, rows, heads, seq, eps, HD: tl.constexpr,
                             ROWS: tl.constexpr):  # fmt: skip
        # rows are (item, token, head) in x's order; each holds HD channels, HD/2 pairs (x0, x1)
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        keep = (row < rows)[:, None]
        col = tl.arange(0, HD)[None, :]
        x = tl.load(x_ptr + row[:, None] * HD + col, mask=keep, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HD + eps)[:, None]
        dtype = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + col).to(tl.float32)
        y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        token = (row // heads) % seq  # the table row of each x row
        at = token[:, None] * HD + col
        a = tl.load(a_ptr + at, mask=keep, other=0.0)
        b = tl.load(b_ptr + at, mask=keep, other=0.0)
        y0, y1 = tl.split(tl.reshape(y, (ROWS, HD // 2, 2)))
        # out[..., i, j] = x0[i] * a[i, j] + x1[i] * b[i, j]: with both pair members broadcast over j
        pair0 = tl.reshape(tl.join(y0, y0), (ROWS, HD))
        pair1 = tl.reshape(tl.join(y1, y1), (ROWS, HD))
        out = pair0 * a + pair1 * b
        tl.store(out_ptr + row[:, None] * HD + col, out.to(dtype), mask=keep)

    return rms_norm_rope_kernel


class FusedQKRope:
    """Mixin of the attention modules: ``norm_rope`` in one kernel where :func:`applies`."""

    def norm_rope(self, x: Tensor, norm: nn.Module | None, table: RotaryTable | None) -> Tensor:
        if table is not None and isinstance(norm, RMSNorm) and applies(x, norm.weight):
            return torch.ops.pfctl.rms_norm_rope(x, norm.weight, table.a, table.b, norm.eps)
        return super().norm_rope(x, norm, table)


def kernel_works() -> str | None:
    """Compile and run the kernel once on a tiny CUDA input: None when it works, else why not (no CUDA, no
    Triton, or the error compiling it; decided once, when the fast paths are applied). The input has the
    Pyramid Flow DiTs' head size (64) in bf16, so the variant compiled here is the one sampling uses."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        x = torch.randn(1, 2, 2, 64, device="cuda", dtype=torch.bfloat16)
        table = rotary_table(*rope_tables(torch.zeros(2, 1, device="cuda"), [64]))
        rms_norm_rope(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), table.a, table.b, 1e-6)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # ImportError (no Triton) or a kernel that does not compile for this GPU
        return f"{type(exc).__name__}: {exc}"
    return None
