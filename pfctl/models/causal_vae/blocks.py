"""Building blocks of the causal video VAE: resnets, resamplers, frame attention, encoder, decoder.

Module and attribute names follow the released checkpoint's state-dict keys
(``down_blocks.{i}.resnets.{j}.norm1``, ``temporal_downsamplers.0.conv.conv``, ...), so the official
weights load without any renaming.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pfctl.errors import ConfigError
from pfctl.models.causal_vae.conv import (
    CausalConv3d,
    FrameCache,
    FrameGroupNorm,
    from_frames,
    is_channels_last,
    to_frames,
)

_EPS = 1e-6

_ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU, "gelu": nn.GELU, "relu": nn.ReLU, "mish": nn.Mish}


def activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name.lower()]()
    except KeyError:
        raise ConfigError(
            f"unknown VAE activation {name!r}", hint=f"use one of {sorted(_ACTIVATIONS)}"
        ) from None


class ResnetBlock(nn.Module):
    """norm -> act -> conv -> norm -> act -> dropout -> conv, plus a (1x1x1 conv) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, act_fn: str, dropout: float) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(groups, in_channels, eps=_EPS, affine=True)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3)
        self.norm2 = FrameGroupNorm(groups, out_channels, eps=_EPS, affine=True)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3)
        self.nonlinearity = activation(act_fn)
        self.conv_shortcut = (
            CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None
        )

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        # each norm + activation writes its output behind the next conv's context frames
        h = self.norm1.forward_act(x, self.nonlinearity, self.conv1.front(cache, x))
        h = self.conv1(h, cache, padded=True)
        if self.training and self.dropout.p > 0:  # dropout must not see the context frames
            h = self.conv2(self.dropout(self.norm2.forward_act(h, self.nonlinearity)), cache)
        else:
            h = self.norm2.forward_act(h, self.nonlinearity, self.conv2.front(cache, h))
            h = self.conv2(h, cache, padded=True)
        return (x if self.conv_shortcut is None else self.conv_shortcut(x, cache)) + h


class _Downsample(nn.Module):
    """A stride-2 causal conv along the axes of ``stride`` (key ``conv.conv``)."""

    stride: tuple[int, int, int]

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, channels, 3, stride=self.stride)

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        return self.conv(x, cache)


class SpatialDownsample(_Downsample):
    """Stride (1, 2, 2) causal conv: halves H and W."""

    stride = (1, 2, 2)


class TemporalDownsample(_Downsample):
    """Stride (2, 1, 1) causal conv: T -> (T + 1) // 2 (17 -> 9 -> 5 -> 3)."""

    stride = (2, 1, 1)


def _conv_before_rearrange(
    conv: CausalConv3d, x: Tensor, cache: FrameCache | None
) -> tuple[Tensor, Tensor | None]:
    """An upsampler's conv output and the bias still to add to it. A channels-last input leaves the bias
    to the rearranging copy (:func:`_copy_with_bias`); if the conv did not keep that layout (the CPU's do
    not), the bias is added here and None returned, as for any other input."""
    if not is_channels_last(x):
        return conv(x, cache), None
    y = conv(x, cache, bias=False)
    bias = conv.conv.bias
    if bias is not None and not is_channels_last(y):
        return y + bias.view(-1, 1, 1, 1), None
    return y, bias


def _copy_with_bias(src: Tensor, bias: Tensor | None) -> Tensor:
    """A contiguous copy of the (permuted) view ``src`` with ``bias`` broadcast-added on the way: the
    bias add a conv would make as a pass of its own happens in the copy the upsamplers need anyway."""
    if bias is None:
        return src.contiguous()
    if torch.is_grad_enabled() and (src.requires_grad or bias.requires_grad):  # no out= under autograd
        return src.contiguous() + bias
    return torch.add(src, bias, out=torch.empty(src.shape, dtype=src.dtype, device=src.device))


class SpatialUpsample(nn.Module):
    """Depth-to-space: conv to 4C channels, then each channel quadruple becomes a 2x2 pixel block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, channels * 4, 3)

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        y, bias = _conv_before_rearrange(self.conv, x, cache)
        b, c4, t, h, w = y.shape
        c = c4 // 4
        # channel index = c*4 + p1*2 + p2  ->  pixel (2h + p1, 2w + p2)
        if is_channels_last(y):  # one pass from (b, t, h, w, c, p1, p2) to (b, t, h, p1, w, p2, c) storage
            src = y.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, c, 2, 2).permute(0, 1, 2, 5, 3, 6, 4)
            if bias is not None:
                bias = bias.view(c, 2, 2).permute(1, 2, 0).unsqueeze(1)  # (p1, 1, p2, c)
            m = _copy_with_bias(src, bias)
            return m.view(b, t, h * 2, w * 2, c).permute(0, 4, 1, 2, 3)
        y = y.reshape(b, c, 2, 2, t, h, w).permute(0, 1, 4, 5, 2, 6, 3)
        return y.reshape(b, c, t, h * 2, w * 2)


class TemporalUpsample(nn.Module):
    """Depth-to-time: conv to 2C channels, each channel pair becomes two consecutive frames.

    A causal clip starts with a single frame (the image frame), so when the clip's first frame
    is in this call (unchunked, or the first chunk) the first of the two frames it produces is
    dropped: T -> 2T - 1 (3 -> 5 -> 9 -> 17). Later chunks keep both: T -> 2T.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, channels * 2, 3)

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        y, bias = _conv_before_rearrange(self.conv, x, cache)
        b, c2, t, h, w = y.shape
        c = c2 // 2
        # channel index = c*2 + p  ->  frame 2t + p
        if is_channels_last(y):  # one pass from (b, t, h, w, c, p) to (b, t, p, h, w, c) storage
            src = y.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, c, 2).permute(0, 1, 5, 2, 3, 4)
            bias = None if bias is None else bias.view(c, 2).t()[:, None, None, :]  # (p, 1, 1, c)
            y = _copy_with_bias(src, bias).view(b, t * 2, h, w, c).permute(0, 4, 1, 2, 3)
        else:
            y = y.reshape(b, c, 2, t, h, w).permute(0, 1, 3, 2, 4, 5).reshape(b, c, t * 2, h, w)
        if cache is None or cache.first_chunk:
            y = y[:, :, 1:]
        return y


class FrameAttention(nn.Module):
    """Single-head spatial self-attention applied to every frame on its own, with a residual.

    Width = channels; its own GroupNorm (eps 1e-6); q/k/v/out linear layers with bias. Key names
    (``group_norm``, ``to_q``, ``to_k``, ``to_v``, ``to_out.0``) are those of the diffusers
    attention block the released weights were trained with.
    """

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=_EPS, affine=True)
        self.to_q = nn.Linear(channels, channels, bias=True)
        self.to_k = nn.Linear(channels, channels, bias=True)
        self.to_v = nn.Linear(channels, channels, bias=True)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels, bias=True), nn.Dropout(0.0)])

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[2]
        frames = to_frames(x)  # (N, C, H, W)
        n, c, h, w = frames.shape
        seq = self.group_norm(frames.reshape(n, c, h * w)).transpose(1, 2)  # (N, HW, C)
        q = self.to_q(seq).unsqueeze(1)
        k = self.to_k(seq).unsqueeze(1)
        v = self.to_v(seq).unsqueeze(1)
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1).to(q.dtype)
        out = self.to_out[1](self.to_out[0](out))
        out = out.transpose(1, 2).reshape(n, c, h, w) + frames
        return from_frames(out, t)


class MidBlock(nn.Module):
    """resnet -> per-frame attention -> resnet, at the lowest resolution."""

    def __init__(self, channels: int, groups: int, act_fn: str, dropout: float) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock(channels, channels, groups, act_fn, dropout) for _ in range(2)]
        )
        self.attentions = nn.ModuleList([FrameAttention(channels, groups)])

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x)
        return self.resnets[1](x, cache)


class _ResampleBlock(nn.Module):
    """Resnets, then optional spatial and temporal resampling (in that order).

    Subclasses name the two resampler lists (the official state-dict keys differ between the
    encoder's ``downsamplers`` and the decoder's ``upsamplers``) and give their classes.
    """

    spatial_attr: str
    temporal_attr: str
    spatial_cls: type[nn.Module]
    temporal_cls: type[nn.Module]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        num_layers: int,
        spatial: bool,
        temporal: bool,
        groups: int,
        act_fn: str,
        dropout: float,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [
                ResnetBlock(in_channels if i == 0 else out_channels, out_channels, groups, act_fn, dropout)
                for i in range(num_layers)
            ]
        )
        setattr(self, self.spatial_attr, nn.ModuleList([self.spatial_cls(out_channels)]) if spatial else None)
        setattr(
            self, self.temporal_attr, nn.ModuleList([self.temporal_cls(out_channels)]) if temporal else None
        )

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        for name in (self.spatial_attr, self.temporal_attr):
            group = getattr(self, name)
            if group is not None:
                x = group[0](x, cache)
        return x


class DownBlock(_ResampleBlock):
    """Resnets, then optional spatial and temporal stride-2 convs (in that order)."""

    spatial_attr, temporal_attr = "downsamplers", "temporal_downsamplers"
    spatial_cls, temporal_cls = SpatialDownsample, TemporalDownsample


class UpBlock(_ResampleBlock):
    """Resnets, then optional spatial and temporal depth-to-space upsampling (in that order)."""

    spatial_attr, temporal_attr = "upsamplers", "temporal_upsamplers"
    spatial_cls, temporal_cls = SpatialUpsample, TemporalUpsample


def _run(module: nn.Module, x: Tensor, cache: FrameCache | None, use_checkpoint: bool) -> Tensor:
    if use_checkpoint and cache is None and torch.is_grad_enabled():
        return checkpoint(module, x, use_reentrant=False)
    return module(x, cache)


class Encoder(nn.Module):
    """Pixels (B, 3, T, H, W) -> moments (B, 2*latent, 1 + (T-1)/8, H/8, W/8)."""

    def __init__(
        self,
        in_channels: int,
        latent_channels: int,
        block_out_channels: Sequence[int],
        layers_per_block: Sequence[int],
        spatial_down: Sequence[bool],
        temporal_down: Sequence[bool],
        dropout: Sequence[float],
        groups: int,
        act_fn: str,
    ) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self.conv_in = CausalConv3d(in_channels, block_out_channels[0], 3)
        blocks = []
        prev = block_out_channels[0]
        for i, out in enumerate(block_out_channels):
            blocks.append(
                DownBlock(
                    prev,
                    out,
                    layers_per_block[i],
                    spatial_down[i],
                    temporal_down[i],
                    groups,
                    act_fn,
                    dropout[i],
                )
            )
            prev = out
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(prev, groups, act_fn, dropout[-1])
        self.conv_norm_out = FrameGroupNorm(groups, prev, eps=_EPS)
        self.conv_act = activation(act_fn)
        self.conv_out = CausalConv3d(prev, 2 * latent_channels, 3)

    def forward(self, x: Tensor, cache: FrameCache | None = None) -> Tensor:
        ckpt = self.gradient_checkpointing and self.training
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = _run(block, x, cache, ckpt)
        x = _run(self.mid_block, x, cache, ckpt)
        x = self.conv_norm_out.forward_act(x, self.conv_act, self.conv_out.front(cache, x))
        return self.conv_out(x, cache, padded=True)


class Decoder(nn.Module):
    """Latents (B, latent, t, h, w) -> pixels (B, 3, 1 + 8(t-1), 8h, 8w) for a whole clip."""

    def __init__(
        self,
        latent_channels: int,
        out_channels: int,
        block_out_channels: Sequence[int],
        layers_per_block: Sequence[int],
        spatial_up: Sequence[bool],
        temporal_up: Sequence[bool],
        dropout: Sequence[float],
        groups: int,
        act_fn: str,
    ) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        widths = list(reversed(block_out_channels))
        self.conv_in = CausalConv3d(latent_channels, widths[0], 3)
        self.mid_block = MidBlock(widths[0], groups, act_fn, dropout[-1])
        blocks = []
        prev = widths[0]
        for i, out in enumerate(widths):
            blocks.append(
                UpBlock(
                    prev, out, layers_per_block[i], spatial_up[i], temporal_up[i], groups, act_fn, dropout[i]
                )
            )
            prev = out
        self.up_blocks = nn.ModuleList(blocks)
        self.conv_norm_out = FrameGroupNorm(groups, block_out_channels[0], eps=_EPS)
        self.conv_act = activation(act_fn)
        self.conv_out = CausalConv3d(block_out_channels[0], out_channels, 3)

    def forward(self, z: Tensor, cache: FrameCache | None = None) -> Tensor:
        ckpt = self.gradient_checkpointing and self.training
        x = self.conv_in(z, cache)
        x = _run(self.mid_block, x, cache, ckpt)
        for block in self.up_blocks:
            x = _run(block, x, cache, ckpt)
        x = self.conv_norm_out.forward_act(x, self.conv_act, self.conv_out.front(cache, x))
        return self.conv_out(x, cache, padded=True)
