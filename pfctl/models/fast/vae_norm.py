"""Per-frame GroupNorm (+ SiLU) as two Triton kernels, and a conv-bias (+ residual) kernel (CUDA, inference).

In the channels-last causal VAE every frame of an activation is one dense (H*W, C) block, so a
per-frame group norm is: per-channel sums and sums of squares over the block's rows (kernel 1,
one read), a few tiny ops on (frames, C) factors, then ``y = x * scale + shift`` (kernel 2, one
read and one write) with the activation applied before the single rounding to the output dtype.
PyTorch needs two reductions, a broadcast multiply-add that does not vectorise and a separate
SiLU pass for the same work: about twice the memory traffic, and the VAE is bound by it outside
its convolutions (the profiles in benchmarks/RESULTS.md).

The norm kernels can also normalise ``x + b`` for the bias ``b`` of the conv that produced ``x``
without it (folded into the sums and the shift), and :func:`add_bias` adds a conv's left-out bias,
with a residual if given, in one vectorised pass: PyTorch adds a 3-D conv's bias as a broadcast pass
of its own, which does not vectorise (see ``ResnetBlock`` for where each bias goes).

Swapped into the VAE's modules by :func:`pfctl.models.fast.apply_fast_paths` (``fused_vae_norm``, after
:func:`kernels_work` said yes once): :class:`FusedFrameGroupNorm`, :class:`FusedCausalConv3d` and
:class:`FusedResnetBlock` take the kernels where :func:`applies` (CUDA, channels-last, no autograd);
everything else takes the PyTorch path of :class:`~pfctl.models.causal_vae.conv.FrameGroupNorm` and the
convs' own bias.
Results equal that path's up to float32 summation order and bf16 rounding: SiLU sees the float32
value instead of a bf16-rounded one, and a bias and residual are added before one rounding instead of
one rounding each (more accurate, within bf16 rounding of the unfused result).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pfctl.models.causal_vae.conv import FrameCache, folded_affine, is_channels_last

__all__ = [
    "FusedCausalConv3d",
    "FusedFrameGroupNorm",
    "FusedResnetBlock",
    "add_bias",
    "applies",
    "group_norm_act",
    "kernels_work",
]

_MAX_CHANNELS = 1024
_TILE = 8192  # elements of x per program of the normalise kernel
_BIAS_BLOCK = 4096  # elements per program of the bias kernel
_STATS_PROGRAMS = 1024  # target number of programs of the statistics kernel


@functools.cache
def _triton() -> Any | None:
    try:
        import triton
    except ImportError:
        return None
    return triton


def applies(x: Tensor) -> bool:
    """True when :func:`group_norm_act` can take ``x``: a CUDA (B, C, T, H, W) float tensor stored
    channels-last (each frame one dense block), outside autograd."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and is_channels_last(x)
        and x.shape[1] <= _MAX_CHANNELS
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def channel_sums(
        x_ptr, part_ptr, P, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ITERS: tl.constexpr
    ):
        # part[frame, block] = (sum over the block's ITERS * BLOCK_P rows, sum of squares) per channel
        frame = tl.program_id(0)
        block = tl.program_id(1)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        base = x_ptr + frame.to(tl.int64) * P * C
        acc1 = tl.zeros([BLOCK_C], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_C], dtype=tl.float32)
        for i in range(ITERS):
            rows = (block * ITERS + i) * BLOCK_P + tl.arange(0, BLOCK_P)
            mask = (rows[:, None] < P) & cmask[None, :]
            v = tl.load(base + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc1 += tl.sum(v, axis=0)
            acc2 += tl.sum(v * v, axis=0)
        out = part_ptr + (frame * tl.num_programs(1) + block) * 2 * C
        tl.store(out + cols, acc1, mask=cmask)
        tl.store(out + C + cols, acc2, mask=cmask)

    @triton.jit
    def normalize(
        x_ptr, y_ptr, scale_ptr, shift_ptr, P, C, T, FRONT,
        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr,
    ):  # fmt: skip
        # input frame (b, t) -> output frame (b, FRONT + t) of a clip with FRONT + T frames
        frame = tl.program_id(0)
        out_frame = (frame // T) * (T + FRONT) + FRONT + frame % T
        rows = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        scale = tl.load(scale_ptr + frame * C + cols, mask=cmask, other=0.0)
        shift = tl.load(shift_ptr + frame * C + cols, mask=cmask, other=0.0)
        inside = rows[:, None] * C + cols[None, :]
        mask = (rows[:, None] < P) & cmask[None, :]
        x = tl.load(x_ptr + frame.to(tl.int64) * P * C + inside, mask=mask, other=0.0)
        y = x.to(tl.float32) * scale[None, :] + shift[None, :]
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + out_frame.to(tl.int64) * P * C + inside, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def add_bias(y_ptr, r_ptr, b_ptr, N, C, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        # y[i] += bias[i % C] (+ r[i]) over a channels-last tensor's N elements, channel innermost
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y += tl.load(b_ptr + offs % C, mask=mask, other=0.0)
        if RESIDUAL:
            y += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    return channel_sums, normalize, add_bias


def group_norm_act(
    x: Tensor,
    groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    silu: bool,
    front: Tensor | None = None,
    x_bias: Tensor | None = None,
) -> Tensor:
    """GroupNorm with statistics per frame (over H, W and the group's channels), affine, then SiLU
    if ``silu``; ``x`` is (B, C, T, H, W) stored channels-last. Returns a tensor like ``x``, or, with
    ``front`` (B, C, F, H, W), ``torch.cat([front, result], dim=2)`` without a separate copy of the
    result (the normalised frames are written behind the front frames).

    ``x_bias`` (C,): normalise ``x + x_bias`` instead, the bias of the convolution that produced ``x``
    and left it out. It is folded into the per-channel sums (Σ(x+b) = Σx + n·b, Σ(x+b)² = Σx² + 2b·Σx
    + n·b²) and the shift, so the biased tensor is never written."""
    triton = _triton()
    channel_sums, normalize, _ = _kernels()
    b, c, t, h, w = x.shape
    frames, pixels, cg = b * t, h * w, c // groups
    block_c = triton.next_power_of_2(c)
    block_p = max(1, _TILE // block_c)
    chunks = triton.cdiv(pixels, block_p)  # row chunks per frame
    # chunks per statistics program: a power of two (few kernel variants), enough for ~_STATS_PROGRAMS programs
    iters = min(triton.next_power_of_2(triton.cdiv(chunks, triton.cdiv(_STATS_PROGRAMS, frames))), 64)
    blocks = triton.cdiv(chunks, iters)
    part = torch.empty((frames, blocks, 2, c), device=x.device, dtype=torch.float32)
    channel_sums[(frames, blocks)](x, part, pixels, c, BLOCK_P=block_p, BLOCK_C=block_c, ITERS=iters)
    s1, s2 = part.sum(1).unbind(1)  # per channel: (frames, C) each
    if x_bias is not None:
        xb = x_bias.float()
        s2 = s2 + (2.0 * xb) * s1 + pixels * xb * xb
        s1 = s1 + pixels * xb
    s1, s2 = (s.view(frames, groups, cg).sum(-1) for s in (s1, s2))  # (frames, groups)
    scale, shift = folded_affine(s1, s2, pixels * cg, c, weight, bias, eps)  # (frames, C)
    if x_bias is not None:
        shift = torch.addcmul(shift, scale, xb)
    scale, shift = scale.contiguous(), shift.contiguous()
    extra = 0 if front is None else front.shape[2]
    y = torch.empty(
        (b, c, extra + t, h, w), device=x.device, dtype=x.dtype, memory_format=torch.channels_last_3d
    )
    if front is not None:
        y[:, :, :extra].copy_(front)
    normalize[(frames, triton.cdiv(pixels, block_p))](
        x, y, scale, shift, pixels, c, t, extra, BLOCK_P=block_p, BLOCK_C=block_c, SILU=silu, num_warps=8
    )
    return y


def add_bias(y: Tensor, bias: Tensor, residual: Tensor | None = None) -> Tensor:
    """``y + bias`` (per channel) ``+ residual``, computed in float32 and written into ``y`` in one pass.

    For a convolution run without its bias (see ``CausalConv3d.forward(bias=False)``): PyTorch adds
    a convolution's bias as a separate broadcast pass that does not vectorise, and a residual sum is
    one more pass. ``y`` must be a tensor :func:`applies` to and ``residual`` one of the same shape.
    """
    _, _, add_bias_kernel = _kernels()
    b = bias.detach().float().contiguous()
    r = residual
    if r is not None and r.shape != y.shape:
        raise ValueError(f"residual shape {tuple(r.shape)} differs from {tuple(y.shape)}")
    if r is not None and r.stride() != y.stride():  # read element by element in y's order
        r = r.contiguous(memory_format=torch.channels_last_3d)
    n = y.numel()
    triton = _triton()
    add_bias_kernel[(triton.cdiv(n, _BIAS_BLOCK),)](
        y, y if r is None else r, b, n, y.shape[1], RESIDUAL=r is not None, BLOCK=_BIAS_BLOCK
    )
    return y


def kernels_work() -> str | None:
    """Compile and run the kernels once on a tiny CUDA input: None when they work, else why not (no CUDA, no
    Triton, or the error compiling them; decided once, when the fast paths are applied)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if _triton() is None:
        return "Triton is not installed"
    try:
        x = torch.randn(1, 4, 2, 4, 4, device="cuda").contiguous(memory_format=torch.channels_last_3d)
        y = group_norm_act(x, 2, None, None, 1e-6, silu=True)
        add_bias(y, torch.zeros(4, device="cuda"), residual=x)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a Triton that cannot compile for this GPU
        return f"{type(exc).__name__}: {exc}"
    return None


def _add_bias(y: Tensor, bias: Tensor, residual: Tensor | None = None) -> Tensor:
    """``y + bias (+ residual)`` in place: the kernel where :func:`applies`, else PyTorch's ops."""
    if applies(y):
        return add_bias(y, bias, residual)
    y.add_(bias.view(-1, *([1] * (y.ndim - 2))))
    return y if residual is None else y.add_(residual)


class FusedFrameGroupNorm:
    """Mixin of ``FrameGroupNorm``: per-frame statistics and the affine (+ SiLU) in the Triton kernels."""

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim == 5 and applies(x):
            return self._fused(x, silu=False)
        return super().forward(x)

    def forward_act(
        self, x: Tensor, act: nn.Module, front: Tensor | None = None, x_bias: Tensor | None = None
    ) -> Tensor:
        """With SiLU on a tensor :func:`applies` to: one pass that writes straight behind the context frames
        (no separate bias, activation or concatenation pass)."""
        if isinstance(act, nn.SiLU) and x.ndim == 5 and applies(x):
            return self._fused(x, silu=True, front=front, x_bias=x_bias)
        return super().forward_act(x, act, front, x_bias)

    def _fused(
        self, x: Tensor, silu: bool, front: Tensor | None = None, x_bias: Tensor | None = None
    ) -> Tensor:
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        return group_norm_act(x, self.num_groups, weight, bias, self.eps, silu, front, x_bias)


class FusedCausalConv3d:
    """Mixin of ``CausalConv3d``: the bias added by one vectorised kernel instead of PyTorch's broadcast add
    (the VAE's largest non-convolution cost on CUDA)."""

    def _conv(self, x: Tensor, bias: bool) -> Tensor:
        conv = self.conv
        if conv.bias is None or not bias or not applies(x):
            return super()._conv(x, bias)
        y = F.conv3d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
        return _add_bias(y, conv.bias)


class FusedResnetBlock:
    """Mixin of ``ResnetBlock``: the convs leave their biases out, conv1's folded into norm2's statistics,
    conv2's (and the shortcut's) into the residual sum, saving a pass over each output."""

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        if (self.training and self.dropout.p > 0) or not applies(x):
            return super().forward(x, cache)
        h = self.norm1.forward_act(x, self.nonlinearity, self.conv1.front(cache, x))
        h = self.conv1(h, cache, padded=True, bias=False)
        x_bias = self.conv1.conv.bias
        h = self.norm2.forward_act(h, self.nonlinearity, self.conv2.front(cache, h), x_bias=x_bias)
        h = self.conv2(h, cache, padded=True, bias=False)
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x, cache, bias=False)
        biases = [
            c.conv.bias for c in (self.conv2, self.conv_shortcut) if c is not None and c.conv.bias is not None
        ]
        return _add_bias(h, sum(b.float() for b in biases), residual=skip) if biases else h.add_(skip)
