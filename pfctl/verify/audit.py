"""Audit a VAE encoder by watching one real forward pass: which norms reduce over time, which
attention spans several frames, which chunking flags are wired wrong.

Classification is from what each layer actually receives, not from its class name alone:

- ``time-coupled`` (TC): the reduction of one statistic spans more than one frame — nn.GroupNorm or
  InstanceNorm on a 5D (B, C, T>1, H, W) tensor, or on (N, C, L) whose L covers T·H·W or T;
- ``per-frame`` (PF): time folded into the batch first (4D input, e.g. Mochi's chunked GroupNorm), or T=1;
- ``channel-only`` (CH): LayerNorm/RMSNorm over the channel axis alone (Wan, LTX), BatchNorm in eval.

Attention is observed at ``F.scaled_dot_product_attention``: a query length equal to H·W is per-frame,
T or a multiple of H·W spans frames (with ``is_causal``/a mask noted).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TC, PF, CH, UNKNOWN = "time-coupled", "per-frame", "channel-only", "unknown"
EXACT, STATS, ATTN = "EXACT-CHUNKABLE", "STATS-COUPLED", "ATTN-COUPLED"


@dataclass
class NormRecord:
    name: str
    type: str
    kind: str
    input_shape: list[int]
    groups: int | None
    reduction: str
    calls: int = 1


@dataclass
class AttentionRecord:
    name: str
    query_shape: list[int]
    frames_spanned: int | None
    causal: bool
    masked: bool
    cross_frame: bool


@dataclass
class FlagFinding:
    flag: str
    severity: str  # "bug", "warning", "info"
    message: str


@dataclass
class AuditResult:
    verdict: str
    coupled_by: list[str]
    norms: list[NormRecord]
    attention: list[AttentionRecord]
    first_offending: list[str]
    flags: list[FlagFinding] = field(default_factory=list)
    temporal_convs: int = 0

    def counts(self) -> dict[str, int]:
        out = {TC: 0, PF: 0, CH: 0, UNKNOWN: 0}
        for n in self.norms:
            out[n.kind] += 1
        return {
            "time_coupled": out[TC],
            "per_frame": out[PF],
            "channel_only": out[CH],
            "unknown": out[UNKNOWN],
            "attention_cross_frame": sum(a.cross_frame for a in self.attention),
            "attention_per_frame": sum(not a.cross_frame for a in self.attention),
            "temporal_convs": self.temporal_convs,
        }

    def time_coupled_names(self) -> list[str]:
        return [n.name for n in self.norms if n.kind == TC]


_NORM_TYPES = (nn.GroupNorm, nn.LayerNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def _is_norm(mod: nn.Module) -> bool:
    if isinstance(mod, (*_NORM_TYPES, nn.modules.batchnorm._BatchNorm)):
        return True
    rms = getattr(nn, "RMSNorm", None)
    if rms is not None and isinstance(mod, rms):
        return True
    name = type(mod).__name__
    has_children = any(True for _ in mod.children())
    return ("Norm" in name or "RMS" in name) and not has_children


def classify_norm(mod: nn.Module, shape: tuple[int, ...], ctx: tuple[int, ...] | None) -> tuple[str, str]:
    """(kind, reduction) for one norm call with input ``shape`` and the current video context
    ``ctx`` = (B, C, T, H, W) of the most recent 5D activation."""
    T, H, W = (ctx[2], ctx[3], ctx[4]) if ctx is not None else (None, None, None)
    rank = len(shape)
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        return CH, "running statistics per channel (eval)"
    if getattr(mod, "statistics_per_frame", False):
        # pfctl's FrameGroupNorm: on channels-last inputs it computes its per-frame statistics itself
        # instead of calling F.group_norm on frames folded into the batch, which is what the hook sees
        return PF, "(C/G, H, W) per frame (FrameGroupNorm)"
    if isinstance(mod, nn.GroupNorm | nn.InstanceNorm1d | nn.InstanceNorm2d | nn.InstanceNorm3d):
        what = "(C/G, T, H, W)" if isinstance(mod, nn.GroupNorm) else "(T, H, W) per channel"
        if rank == 5:
            return (TC, what) if shape[2] > 1 else (PF, what + " with T=1")
        if rank == 4:
            return PF, "(C/G, H, W) — time folded into the batch"
        if rank == 3 and T is not None and T > 1:
            L = shape[2]
            if L == T or (H and W and L % (H * W) == 0 and L // (H * W) > 1):
                return TC, "(C/G, L) with L spanning frames"
        return PF, f"(C/G, {'×'.join(map(str, shape[2:]))})"
    if isinstance(mod, nn.LayerNorm):
        dims = len(mod.normalized_shape)
        return (CH, "last axis (channels)") if dims == 1 else (UNKNOWN, f"last {dims} axes")
    if "LpNorm" in type(mod).__name__:
        return CH, "last axis (features)"
    if "RMS" in type(mod).__name__ or "LayerNorm" in type(mod).__name__:
        if getattr(mod, "channel_first", None) is True or not hasattr(mod, "normalized_shape"):
            return CH, "channel axis"
        ns = mod.normalized_shape
        return (CH, "last axis (channels)") if len(ns) == 1 else (UNKNOWN, f"last {len(ns)} axes")
    return UNKNOWN, "not recognised"


@contextmanager
def _patch_sdpa(callback: Callable[..., None]) -> Iterator[None]:
    original = F.scaled_dot_product_attention

    def wrapped(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        callback(query, attn_mask, is_causal)
        return original(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

    F.scaled_dot_product_attention = wrapped
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def audit_module(root: nn.Module, run: Callable[[], Any], *, prefix: str = "") -> AuditResult:
    """Hook every module under ``root``, call ``run()`` once, classify what was seen."""
    ctx: list[tuple[int, ...] | None] = [None]
    stack: list[str] = []
    norms: dict[str, NormRecord] = {}
    attention: dict[str, AttentionRecord] = {}
    handles = []
    names = {mod: (prefix + name) or type(root).__name__ for name, mod in root.named_modules()}
    containers = {m for m in root.modules() if any(True for _ in m.children())}
    temporal_convs = sum(1 for m in root.modules() if isinstance(m, nn.Conv3d) and m.kernel_size[0] > 1)

    def pre(mod: nn.Module, args: tuple) -> None:
        stack.append(names[mod])
        if mod in containers:  # leaf convs see time/space-padded inputs: not the activation's T, H, W
            for a in args:
                if isinstance(a, torch.Tensor) and a.ndim == 5:
                    ctx[0] = tuple(a.shape)
                    break
        if _is_norm(mod) and args and isinstance(args[0], torch.Tensor):
            shape = tuple(args[0].shape)
            kind, reduction = classify_norm(mod, shape, ctx[0])
            name = names[mod]
            if name in norms:
                norms[name].calls += 1
                if kind == TC:
                    norms[name].kind = TC
            else:
                norms[name] = NormRecord(
                    name=name,
                    type=type(mod).__name__,
                    kind=kind,
                    input_shape=list(shape),
                    groups=getattr(mod, "num_groups", None),
                    reduction=reduction,
                )

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        if stack:
            stack.pop()

    def on_sdpa(q: torch.Tensor, mask: Any, is_causal: bool) -> None:
        owner = next((s for s in reversed(stack) if "attn" in s.lower() or "attention" in s.lower()), None)
        owner = owner or (stack[-1] if stack else "<functional>")
        rec = _attention_record(owner, q, mask, is_causal, ctx[0])
        if owner not in attention or rec.cross_frame:
            attention[owner] = rec

    modules_by_name = {v: k for k, v in names.items()}
    original_gn = F.group_norm

    def group_norm(x: torch.Tensor, num_groups: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        # what the reduction really receives (a GroupNorm subclass may fold T into the batch first)
        owner = stack[-1] if stack else None
        mod = modules_by_name.get(owner) if owner else None
        if isinstance(mod, nn.GroupNorm) and owner in norms:
            kind, reduction = classify_norm(mod, tuple(x.shape), ctx[0])
            rec = norms[owner]
            if rec.calls == 1 or kind == TC:
                rec.kind, rec.reduction = kind, reduction
        return original_gn(x, num_groups, *args, **kwargs)

    for mod in root.modules():
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    F.group_norm = group_norm
    try:
        with _patch_sdpa(on_sdpa), torch.no_grad():
            run()
    finally:
        F.group_norm = original_gn
        for h in handles:
            h.remove()

    return _result(list(norms.values()), list(attention.values()), temporal_convs)


def _attention_record(
    owner: str, q: torch.Tensor, mask: Any, is_causal: bool, ctx: tuple[int, ...] | None
) -> AttentionRecord:
    """How many frames one attention call's sequence spans, from the enclosing activation's (T, H, W)."""
    L = q.shape[-2]
    spanned: int | None = None
    if ctx is not None:
        T, H, W = ctx[2], ctx[3], ctx[4]
        if H * W and L % (H * W) == 0:
            spanned = L // (H * W)
        elif L == T:
            spanned = T
    return AttentionRecord(
        name=owner,
        query_shape=list(q.shape),
        frames_spanned=spanned,
        causal=bool(is_causal),
        masked=mask is not None,
        cross_frame=spanned is not None and spanned > 1,
    )


def _result(
    norm_list: list[NormRecord], attn_list: list[AttentionRecord], temporal_convs: int
) -> AuditResult:
    """The verdict from what was seen: cross-frame attention first, then time-coupled norms."""
    coupled_by = []
    if any(n.kind == TC for n in norm_list):
        coupled_by.append("stats")
    if any(a.cross_frame for a in attn_list):
        coupled_by.append("attention")
    verdict = ATTN if "attention" in coupled_by else STATS if "stats" in coupled_by else EXACT
    offending = [a.name for a in attn_list if a.cross_frame] + [n.name for n in norm_list if n.kind == TC]
    return AuditResult(
        verdict=verdict,
        coupled_by=coupled_by,
        norms=norm_list,
        attention=attn_list,
        first_offending=offending[:5],
        temporal_convs=temporal_convs,
    )


# ---------------------------------------------------------------------------------------- flags
def _static_flag_notes(module: nn.Module) -> list[FlagFinding]:
    """Notes read from the source of a VAE without a temporal-tiled encode: a framewise flag that raises,
    or frame batching that no flag turns off."""
    findings: list[FlagFinding] = []
    cls = type(module).__name__
    try:
        encode_src = inspect.getsource(type(module)._encode)
    except (OSError, TypeError, AttributeError):
        encode_src = ""
    if hasattr(module, "use_framewise_encoding") and "NotImplementedError" in encode_src:
        findings.append(
            FlagFinding(
                "use_framewise_encoding",
                "info",
                f"{cls}: use_framewise_encoding exists but raises NotImplementedError when set",
            )
        )
    if "num_sample_frames_batch_size" in encode_src:
        findings.append(
            FlagFinding(
                "num_sample_frames_batch_size",
                "info",
                f"{cls}: frame batching is always on (num_sample_frames_batch_size="
                f"{module.num_sample_frames_batch_size}); there is no flag to turn it off",
            )
        )
    return findings


def check_framewise_flags(module: nn.Module, probe: torch.Tensor) -> list[FlagFinding]:
    """Which chunking flag actually switches the library's temporal-tiled encode on.

    Behavioural, not textual: count calls of ``_temporal_tiled_encode`` under each flag setting on a
    clip longer than the tile. Catches the diffusers LTX bug where ``_encode`` tests
    ``use_framewise_decoding``.
    """
    cls = type(module).__name__
    if not (hasattr(module, "use_framewise_encoding") and hasattr(module, "_temporal_tiled_encode")):
        return _static_flag_notes(module)
    findings: list[FlagFinding] = []
    calls = [0]
    original = module._temporal_tiled_encode

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return original(x)

    t_needed = int(getattr(module, "tile_sample_min_num_frames", 16)) + 1
    x = probe
    if x.shape[2] < t_needed:
        x = torch.zeros(*x.shape[:2], t_needed, *x.shape[3:], dtype=x.dtype)
    saved = (module.use_framewise_encoding, module.use_framewise_decoding, module.use_tiling)
    outcome = {}
    module.__dict__["_temporal_tiled_encode"] = counting
    try:
        for enc, dec in ((True, False), (False, True)):
            module.use_framewise_encoding, module.use_framewise_decoding = enc, dec
            module.use_tiling = False
            calls[0] = 0
            with torch.no_grad():
                module._encode(x.to(next(module.parameters())))
            outcome[(enc, dec)] = calls[0] > 0
    finally:
        module.__dict__.pop("_temporal_tiled_encode", None)
        module.use_framewise_encoding, module.use_framewise_decoding, module.use_tiling = saved
    if not outcome[(True, False)] and outcome[(False, True)]:
        findings.append(
            FlagFinding(
                "use_framewise_encoding",
                "bug",
                f"{cls}._encode tests use_framewise_decoding: setting use_framewise_encoding has no effect and "
                "use_framewise_decoding=True silently chunks the encoder",
            )
        )
    elif not outcome[(True, False)]:
        findings.append(
            FlagFinding("use_framewise_encoding", "bug", f"{cls}: use_framewise_encoding has no effect")
        )
    if saved[0]:
        findings.append(
            FlagFinding(
                "use_framewise_encoding",
                "warning",
                f"{cls}: framewise encoding is ON by default for clips over "
                f"{module.tile_sample_min_num_frames} frames (temporal tiles, no conv cache)",
            )
        )
    return findings
