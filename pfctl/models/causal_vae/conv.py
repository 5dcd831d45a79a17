"""Causal 3-D convolution, per-frame GroupNorm and the per-call frame cache.

The causal video VAE never lets a frame see the future: every temporal kernel is padded with
zeros in front only (``kernel - 1`` frames), so output frame ``t`` depends on input frames
``<= t``. Together with norms whose statistics are taken per frame, this makes temporal chunking
exact: a long clip can be processed a few frames at a time if each convolution gets the last
input frames of the previous chunk as context.

That context lives in a :class:`FrameCache` that is created for *one* encode/decode call and
passed down explicitly. Nothing is stored on the modules, so two calls (or two threads, or a
tiled call running its tiles one after another) can never see each other's frames.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CausalConv3d",
    "FrameCache",
    "FrameGroupNorm",
    "folded_affine",
    "from_frames",
    "is_channels_last",
    "to_frames",
]


def to_frames(x: Tensor) -> Tensor:
    """(B, C, T, H, W) -> (B*T, C, H, W): every frame becomes an independent image."""
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)


def from_frames(x: Tensor, t: int) -> Tensor:
    """Inverse of :func:`to_frames`."""
    bt, c, h, w = x.shape
    return x.reshape(bt // t, t, c, h, w).permute(0, 2, 1, 3, 4)


def is_channels_last(x: Tensor) -> bool:
    """True for a 5-D tensor stored as (B, T, H, W, C), channels innermost.

    That is the layout cuDNN's 3-D convolutions compute in; a VAE whose conv weights are
    ``channels_last_3d`` (see ``CausalVideoVAE.use_channels_last``) keeps every activation in it, so
    no layer transposes its input or output.
    """
    return (
        x.ndim == 5
        and x.shape[1] > 1
        and x.stride(1) == 1
        and x.is_contiguous(memory_format=torch.channels_last_3d)
    )


def folded_affine(
    s1: Tensor, s2: Tensor, count: int, channels: int, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """GroupNorm as ``y = x * scale + shift``: from per-group sums of x and x² over ``count`` values
    (``s1``, ``s2``: (..., G), float32) to per-channel float32 ``scale`` and ``shift`` (..., ``channels``)
    that fold in the mean, 1/std and the affine weight and bias (float32 by type promotion, whatever
    their dtype). Shared by :class:`FrameGroupNorm`'s channels-last path and the fused kernels
    (:mod:`pfctl.models.fast.vae_norm`)."""
    g = s1.shape[-1]
    cg = channels // g
    mean = s1 * (1.0 / count)
    var = torch.addcmul(s2 * (1.0 / count), mean, mean, value=-1.0)
    rstd = (var.clamp_min(0.0) + eps).rsqrt().unsqueeze(-1)  # (..., G, 1)
    mean = mean.unsqueeze(-1)
    if weight is not None:
        scale = rstd * weight.view(g, cg)
        shift = torch.addcmul(bias.view(g, cg), mean, scale, value=-1.0)
    else:
        scale = rstd.expand(*rstd.shape[:-1], cg)
        shift = (-mean * rstd).expand_as(scale)
    return scale.reshape(*s1.shape[:-1], channels), shift.reshape(*s1.shape[:-1], channels)


class FrameCache:
    """Temporal context carried from one chunk to the next during *one* chunked call.

    ``first_chunk`` is true while the first chunk runs: convolutions then pad with zeros in
    front (as the unchunked model does) and the temporal upsamplers drop their first output
    frame. After :meth:`next_chunk`, every causal conv prepends the input frames it kept from
    the previous chunk instead of zeros. The cache is keyed by module identity and dies with
    the call that created it.
    """

    def __init__(self) -> None:
        self.first_chunk = True
        self._tails: dict[int, Tensor] = {}

    def next_chunk(self) -> None:
        self.first_chunk = False

    def get(self, module: nn.Module) -> Tensor:
        try:
            return self._tails[id(module)]
        except KeyError:  # programming error, not a user error
            raise RuntimeError("frame cache has no context for this layer: chunks out of order") from None

    def put(self, module: nn.Module, frames: Tensor) -> None:
        self._tails[id(module)] = frames


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics are taken over each frame separately.

    A 5-D input is folded to (B*T, C, H, W) first. This is what makes the VAE's temporal
    chunking exact (a norm over (C, T, H, W) would couple all frames of a clip).
    """

    #: read by verify-groupnorm's audit: the channels-last path never calls F.group_norm
    statistics_per_frame = True

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 5:
            return super().forward(x)
        if is_channels_last(x):
            return self._channels_last(x)
        return from_frames(super().forward(to_frames(x)), x.shape[2])

    def forward_act(
        self, x: Tensor, act: nn.Module, front: Tensor | None = None, x_bias: Tensor | None = None
    ) -> Tensor:
        """``act(self(x + x_bias))``, preceded along time by ``front`` if given (a causal conv's context,
        see :meth:`CausalConv3d.front`). ``x_bias``: the bias of the conv that produced ``x`` without it."""
        if x_bias is not None:
            x = x + x_bias.view(-1, *([1] * (x.ndim - 2)))
        y = act(self(x))
        return y if front is None else torch.cat([front, y], dim=2)

    def _channels_last(self, x: Tensor) -> Tensor:
        """The same norm on a (B, T, H, W, C)-stored tensor, without leaving that layout.

        ``nn.GroupNorm`` on CUDA copies its input to (N, C, H, W) order and returns that order, which
        costs two transposes per norm in a channels-last network. Here the statistics are float32
        reductions over each frame's pixels (on CUDA they read bf16 directly: no float32 copy), and
        the normalisation is one ``x * scale + shift`` with per-(frame, channel) float32 factors
        that fold in the mean, 1/std, weight and bias.
        """
        b, c, t, h, w = x.shape
        g, cg = self.num_groups, c // self.num_groups
        pixels = x.permute(0, 2, 3, 4, 1).reshape(b, t, h * w, c)  # a view of the storage
        # per-channel float32 sums, then per group: few kernel launches, as a tiled decode runs
        # thousands of these norms on small tiles (launches, not bytes, set the pace there)
        s1 = pixels.sum(dim=2, dtype=torch.float32).view(b, t, g, cg).sum(-1)
        s2 = torch.linalg.vector_norm(pixels, dim=2, dtype=torch.float32).square().view(b, t, g, cg).sum(-1)
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        scale, shift = folded_affine(s1, s2, h * w * cg, c, weight, bias, self.eps)  # (B, T, C)
        scale = scale.permute(0, 2, 1)[..., None, None]  # (B, C, T, 1, 1)
        shift = shift.permute(0, 2, 1)[..., None, None]
        if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad):
            return torch.addcmul(shift, x, scale).to(x.dtype)
        # computed in float32, written straight into x's dtype and layout
        return torch.addcmul(shift, x, scale, out=torch.empty_like(x))


def _triple(v: int | tuple[int, int, int]) -> tuple[int, int, int]:
    return (v, v, v) if isinstance(v, int) else tuple(v)  # type: ignore[return-value]


class CausalConv3d(nn.Module):
    """3-D convolution, zero-padded ``kernel_t - 1`` frames in front and symmetric in space.

    An integer ``stride`` applies to time only (spatial stride 1). The wrapped ``nn.Conv3d`` is
    stored as ``.conv`` so state-dict keys read ``<name>.conv.weight``.

    With a :class:`FrameCache` in a non-first chunk, the zero frames are replaced by the input
    frames of the previous chunk that the next output window still needs: ``kernel_t - 1``
    frames for stride 1 and, for stride 2, the frames from the start of the next window on
    (one frame for the odd padded lengths that valid chunk sizes produce). That is exactly what
    the unchunked convolution would have seen. Those frames are *copied* into the cache: a view
    would keep the whole chunk's input alive until the next chunk (at full resolution, hundreds
    of MB per layer).

    Spatial zero padding is the convolution's own (cuDNN pads on the fly); only the temporal
    context is concatenated, so the input is copied at most once, and not at all when the layer
    before writes it in place: ``conv(norm.forward_act(x, act, conv.front(cache, x)), cache,
    padded=True)`` (the fused norm writes its output behind the context frames).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        dilation: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        kt, kh, kw = _triple(kernel_size)
        if kh % 2 == 0 or kw % 2 == 0:
            raise ValueError(f"spatial kernel must be odd, got {(kh, kw)}")
        stride3 = (stride, 1, 1) if isinstance(stride, int) else tuple(stride)
        self.temporal_stride = stride3[0]
        self.time_pad = dilation * (kt - 1)
        self._span = self.time_pad + 1  # frames covered by one temporal window
        self.conv = nn.Conv3d(
            in_channels,
            out_channels,
            (kt, kh, kw),
            stride=stride3,
            padding=(0, kh // 2, kw // 2),
            dilation=dilation,
            bias=bias,
        )

    def front(self, cache: FrameCache | None, like: Tensor) -> Tensor | None:
        """The frames this conv puts before an input shaped like ``like``: ``time_pad`` zero frames
        (no cache, or the first chunk), the previous chunk's kept frames, or None (1-frame kernel)."""
        if self.time_pad == 0:
            return None
        if cache is not None and not cache.first_chunk:
            return cache.get(self)
        b, c, _, h, w = like.shape
        layout = torch.channels_last_3d if is_channels_last(like) else torch.contiguous_format
        shape = (b, c, self.time_pad, h, w)
        return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=layout).zero_()

    def forward(
        self, x: Tensor, cache: FrameCache | None = None, padded: bool = False, bias: bool = True
    ) -> Tensor:
        """``padded``: ``x`` already starts with :meth:`front`'s frames. ``bias=False``: leave the bias
        out, for a caller that folds it into its next pass (``self.conv.bias``, see ``ResnetBlock``)."""
        if self.time_pad == 0:
            return self._conv(x, bias)
        if not padded:
            x = torch.cat([self.front(cache, x), x], dim=2)
        if cache is not None:
            # where the next output window starts, in this padded input's frame index
            n = x.shape[2]
            s = self.temporal_stride
            next_start = s * ((n - self._span) // s + 1)
            cache.put(self, x[:, :, next_start:].detach().clone())
        return self._conv(x, bias)

    def _conv(self, x: Tensor, bias: bool) -> Tensor:
        """The convolution, with its bias unless ``bias`` is False."""
        conv = self.conv
        if conv.bias is None or bias:
            return conv(x)
        return F.conv3d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
