"""Row-group attention for compiled blocks: operators the compiler does not look into.

A compiled block must trace neither the row groups nor their calls: it would guard on the group layout,
which changes every sampler stage and training step. :class:`CompiledRowGroups` (swapped into the attention
modules with ``compile``) sends every column of a model with row groups on to an operator that takes the
groups as a host table (:func:`pfctl.models.attention_layout.group_table`), so a block stays one graph:

* without gradients (the sampler), :func:`row_group_attention`: :func:`masked_attention` group by group;
* with gradients (training), :func:`row_group_attention_train`, whose backward is
  :func:`row_group_attention_backward`. Both call the fused kernels directly, call by call
  (:func:`pfctl.models.attention_layout.row_group_calls`): the CPU's flash kernel; on CUDA, under the
  ``efficient`` backend, the flash kernel for the calls without a mask and the memory-efficient one for
  those with a mask (what SDPA picks with cuDNN left out); under ``cudnn`` cuDNN's kernel, much faster, for
  those with a mask and for the image keys of those without. cuDNN plans for every new shape, and a
  mask-free call's keys start at its items' valid text, so its shape follows every caption's length: its
  image rows are attended in two parts merged by their log-sum-exps, the image keys of every item in one
  cuDNN call (a shape the captions never change) and each item's valid text on the flash kernel.
  The forward also returns each row's log-sum-exp, which its backward takes instead of attending again, and
  a selectively checkpointed block keeps (``.checkpointing``).

Each operator's results are those of :meth:`pfctl.models.attention_layout.PyramidLayout.attend` up to the
float rounding of the kernels.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pfctl.models.attention_layout import (
    PyramidLayout,
    RowGroup,
    RowGroupCall,
    by_call,
    from_calls,
    key_start_runs,
    masked_attention,
    row_group_calls,
    table_text_len,
    whole_item_rows,
)

__all__ = [
    "CompiledRowGroups",
    "row_group_attention",
    "row_group_attention_backward",
    "row_group_attention_train",
    "table_groups",
]

aten = torch.ops.aten
#: the operators read their group table on the host: a CUDA graph recorded around one would replay its first
#: table's calls for every later one, so Inductor runs them between its recorded parts (or records nothing)
_NOT_IN_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
#: the memory-efficient kernel reads each row block's log-sum-exp up to the next multiple of this many rows
_LSE_ALIGN = 32


def table_groups(table: torch.Tensor) -> list[RowGroup]:
    """The row groups of a :func:`group_table` (without its empty ones)."""
    return [RowGroup(a, b, None if ks[0] < 0 else tuple(ks)) for a, b, *ks in table.tolist() if a < b]


@torch.library.custom_op("pfctl::row_group_attention", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def row_group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> torch.Tensor:
    """:func:`masked_attention` in the row groups of ``groups`` (a :func:`group_table`), as one operator:
    ``q, k, v [B, S, H, hd]`` -> ``[B, S, H*hd]``. No gradient (the sampler's path)."""
    return masked_attention(q, k, v, mask, backend, table_groups(groups))


@row_group_attention.register_fake
def _row_group_attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])


class _Split(NamedTuple):
    """A mask-free call's image rows attended in two parts, merged by their log-sum-exps: the keys from the end
    of the text on (the image tokens, the same for every item) in one call of the ``frames`` kernel (cuDNN's,
    whose shape then never follows a caption), and each run of items' valid text ``(items, keys)`` in a call
    of the mask-free kernel."""

    text: tuple[tuple[slice, slice], ...]


class _Plan(NamedTuple):
    """The calls of one column's row groups (:func:`row_group_calls`, or :func:`_split_calls`), their
    :func:`whole_item_rows`, and per call its :class:`_Split` (None: one call)."""

    calls: list[RowGroupCall]
    rows: list[int] | None
    splits: list[_Split | None]


def _split_calls(
    groups: list[RowGroup], first: int, text_len: int
) -> tuple[list[RowGroupCall], list[_Split | None]]:
    """:func:`row_group_calls` with every mask-free group's image rows as one call of all items against the
    keys ``[text_len, end)``, split off its items' valid text (:class:`_Split`); its text rows (the first
    group's) stay as :func:`row_group_calls` attends them."""
    calls: list[RowGroupCall] = []
    splits: list[_Split | None] = []
    for group in groups:
        a, b, starts = group
        if starts is None or b <= max(first, text_len):
            plain = row_group_calls([group], first)
            calls, splits = calls + plain, splits + [None] * len(plain)
            continue
        for call in row_group_calls([group], first):  # the text rows' calls, cut where the text ends
            end = min(call.rows.stop, text_len - first)
            if call.rows.start < end:
                calls.append(call._replace(rows=slice(call.rows.start, end)))
                splits.append(None)
        # an item without valid text sees the image keys only
        text = tuple((items, slice(start, text_len)) for items, start in key_start_runs(starts) if start < text_len)
        lo = max(a, first, text_len)
        calls.append(RowGroupCall(slice(None), slice(lo - first, b - first), slice(text_len, b), None))
        splits.append(_Split(text))
    return calls, splits


@functools.lru_cache(maxsize=256)
def _cached_plan(table: bytes, width: int, first: int, split: bool) -> _Plan:
    rows = torch.frombuffer(bytearray(table), dtype=torch.int64).view(-1, width)
    groups = table_groups(rows)
    if split:
        calls, splits = _split_calls(groups, first, table_text_len(rows))
    else:
        calls = row_group_calls(groups, first)
        splits = [None] * len(calls)
    return _Plan(calls, whole_item_rows(calls), splits)


def _table_plan(groups: torch.Tensor, first: int, split: bool) -> _Plan:
    """The :class:`_Plan` of a group table, worked out once per table, first query and kind (every block of a
    forward attends a column with the same ones); ``split``: with :func:`_split_calls`."""
    table = groups.contiguous()
    return _cached_plan(table.numpy().tobytes(), table.shape[1], first, split)


@functools.cache
def _flash_takes(device: torch.device, dtype: torch.dtype, head: int) -> bool:
    """Whether SDPA's flash kernel (and cuDNN's, where PyTorch has it) takes CUDA queries of ``dtype`` and
    head size ``head`` on ``device``."""
    capable = torch.cuda.get_device_capability(device) >= (8, 0)
    return dtype in (torch.float16, torch.bfloat16) and head % 8 == 0 and head <= 256 and capable


@functools.cache
def _cudnn_takes_masks() -> bool:
    """Whether this PyTorch runs cuDNN's fused attention with an additive mask: built with cuDNN 9 or newer,
    its operator taking ``attn_bias`` (PyTorch 2.5 and newer)."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    schema = aten._scaled_dot_product_cudnn_attention.default._schema
    return version is not None and version >= 90000 and "attn_bias" in [a.name for a in schema.arguments]


class _Kernels(NamedTuple):
    """The kernels of a column's calls: without a mask, with one, and for the image keys of a :class:`_Split`
    call (None: mask-free calls are not split)."""

    plain: str
    masked: str
    frames: str | None = None


def _kernels(q: torch.Tensor, backend: str) -> _Kernels:
    """The kernels of a column's calls: ``cpu`` on the CPU; on CUDA ``flash`` for the calls without a mask, and
    for those with one the memory-efficient kernel (``efficient``); under the ``cudnn`` backend (where this
    PyTorch has cuDNN's masked attention) cuDNN's for those with a mask and for the image keys of the
    mask-free ones (:func:`_split_calls`); ``efficient`` for all where flash cannot take the queries."""
    if q.device.type == "cpu":
        return _Kernels("cpu", "cpu")
    if not _flash_takes(q.device, q.dtype, q.shape[-1]):
        return _Kernels("efficient", "efficient")
    if backend == "cudnn" and _cudnn_takes_masks():
        return _Kernels("flash", "cudnn", "cudnn")
    return _Kernels("flash", "efficient")


@functools.cache
def _kernel_state(kind: str, device: torch.device) -> tuple:
    """The tensors a fused CUDA kernel's backward takes besides the attention's own (sequence offsets, the
    dropout generator's state), as one tiny call of its forward returns them: without dropout the backward
    reads none of their values. cuDNN's: also how many dimensions its log-sum-exp has."""
    x = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16, device=device)
    if kind == "flash":
        _, _, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(x, x, x)
        return cum_q, cum_k, seed, offset
    if kind == "cudnn":
        _, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(x, x, x, None, True)
        return seed, offset, lse.dim()
    _, _, seed, offset = aten._scaled_dot_product_efficient_attention(x, x, x, None, True)
    return seed, offset


def _runnable(kernel: str, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> str:
    """``kernel``, or for a call cuDNN refuses (one query against one key: a one-token frame) the kernel the
    other backend runs it on."""
    if kernel == "cudnn" and q.shape[2] == 1 and k.shape[2] == 1:
        return "flash" if mask is None else "efficient"
    return kernel


def _call_forward(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's output ``[b, H, rows, hd]`` and log-sum-exp ``[b, H, rows]`` (float32); ``q [b, H, rows,
    hd]``, ``k, v [b, H, keys, hd]``, ``mask [b, 1, rows, keys]`` additive or None."""
    kernel = _runnable(kernel, q, k, mask)
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
    if kernel == "flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v)
        return out, lse
    if kernel == "cudnn":
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True)
        return out, lse.reshape(q.shape[:3])
    bias = None if mask is None else mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
    return out, lse[..., : q.shape[2]]


def _call_backward(
    kernel: str, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of one call of :func:`_call_forward` with respect to ``q, k, v``, from its output and
    log-sum-exp (each ``[b, H, rows, ...]``, views of the whole column's)."""
    kernel = _runnable(kernel, q, k, mask)
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False, attn_mask=mask
        )
    rows = q.shape[2]
    if kernel == "flash":
        cum_q, cum_k, seed, offset = _kernel_state("flash", q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse.contiguous(), cum_q, cum_k, rows, k.shape[2], 0.0, False, seed, offset
        )
    if kernel == "cudnn":
        seed, offset, lse_dims = _kernel_state("cudnn", q.device)
        stats = (lse if lse_dims == 3 else lse.unsqueeze(-1)).contiguous()
        if q.shape[0] > 1:
            # PyTorch keys cuDNN's plans on the q/k/v and mask layouts only: the output and its gradient get
            # one layout per shape (with one item a call their item stride is never read)
            grad, out = grad.contiguous(), out.contiguous()
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, stats, seed, offset, mask, None, None, rows, k.shape[2], 0.0, False
        )
    # the kernel reads the log-sum-exp of whole blocks of rows: padded as its forward left it
    padded = F.pad(lse, (0, -rows % _LSE_ALIGN))
    bias = None if mask is None else mask.expand(q.shape[0], q.shape[1], rows, k.shape[2])
    seed, offset = _kernel_state("efficient", q.device)
    grads = aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, bias, out, padded, seed, offset, 0.0, [True, True, True, False]
    )
    return grads[0], grads[1], grads[2]


def _heads_first(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.transpose(1, 2) for t in tensors)  # [B, S, H, hd] <-> [B, H, S, hd] views


def _column_mask(mask: torch.Tensor, q: torch.Tensor, keys: int) -> torch.Tensor:
    """A column's mask storage (:func:`padded_attention_bias`) cut to its ``keys`` key columns, in q's dtype."""
    mask = mask[..., :keys]
    return mask if mask.dtype == q.dtype else mask.to(q.dtype)


def _mask_part(mask: torch.Tensor, call: RowGroupCall) -> torch.Tensor | None:
    return None if call.mask_rows is None else mask[call.items, :, call.mask_rows, call.keys]


def _merge(
    out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over two disjoint key sets from each one's output and log-sum-exp: the outputs weighted
    by their shares of the softmax mass (in float32), and the log-sum-exp of both."""
    share = torch.sigmoid(lse - other_lse).unsqueeze(-1)
    merged = torch.lerp(other.float(), out.float(), share).to(out.dtype)
    return merged, torch.logaddexp(lse, other_lse)


def _split_forward(
    kernels: _Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: slice, split: _Split
) -> tuple[torch.Tensor, torch.Tensor]:
    """A :class:`_Split` call's output and log-sum-exp: its image ``keys`` of every item on the ``frames``
    kernel, merged (:func:`_merge`) with each run of items' valid text on the mask-free one. Its backward
    takes each part's kernel backward with the merged output and log-sum-exp (which give every part its
    rows' true softmax) and adds up the query gradients."""
    out, lse = _call_forward(kernels.frames, q, k[:, :, keys], v[:, :, keys], None)
    for items, text in split.text:
        part = _call_forward(kernels.plain, q[items], k[items, :, text], v[items, :, text], None)
        if items == slice(None):
            out, lse = _merge(out, lse, *part)
        else:
            out[items], lse[items] = _merge(out[items], lse[items], *part)
    return out, lse


@torch.library.custom_op("pfctl::row_group_attention_train", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def row_group_attention_train(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of one column in the row groups of ``groups`` with gradients: ``q [B, Sq, H, hd]`` (the
    column's last ``Sq`` positions), ``k, v [B, S, H, hd]``, ``mask`` its :func:`padded_attention_bias`, on
    the kernels of ``backend`` (:func:`_kernels`) -> ``[B, Sq, H*hd]`` and the log-sum-exp of every query
    row, ``[B, H, Sq]`` float32."""
    mask, kernels = _column_mask(mask, q, k.shape[1]), _kernels(q, backend)
    plan = _table_plan(groups, k.shape[1] - q.shape[1], kernels.frames is not None)
    qt, kt, vt = _heads_first(q, k, v)
    results = []
    for query, call, split in zip(by_call(qt, plan.calls, plan.rows, 2), plan.calls, plan.splits, strict=True):
        if split is not None:
            results.append(_split_forward(kernels, query, kt, vt, call.keys, split))
            continue
        part = _mask_part(mask, call)
        keys, values = kt[call.items, :, call.keys], vt[call.items, :, call.keys]
        results.append(_call_forward(kernels[part is not None], query, keys, values, part))
    out = from_calls([o.transpose(1, 2) for o, _ in results], plan.calls, plan.rows, 1, q.shape)
    lse = from_calls(
        [stats for _, stats in results], plan.calls, plan.rows, 2, (q.shape[0], q.shape[2], q.shape[1])
    )
    return out.flatten(2), lse


@row_group_attention_train.register_fake
def _row_group_attention_train_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    lse = q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3]), lse


@torch.library.custom_op("pfctl::row_group_attention_backward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def row_group_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    groups: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of :func:`row_group_attention_train` with respect to ``q, k, v``, given the gradient of
    its output, ``grad [B, Sq, H*hd]``, and its results ``out``, ``lse``: call by call, each from its
    rows' output and log-sum-exp, the key and value gradients of calls that share keys added up."""
    mask, kernels = _column_mask(mask, q, k.shape[1]), _kernels(q, backend)
    plan = _table_plan(groups, k.shape[1] - q.shape[1], kernels.frames is not None)
    heads = q.shape[2:]
    qt, kt, vt, gt, ot = _heads_first(q, k, v, grad.unflatten(2, heads), out.unflatten(2, heads))
    dk, dv, dqs = k.new_zeros(k.shape), v.new_zeros(v.shape), []
    parts = zip(*(by_call(x, plan.calls, plan.rows, 2) for x in (gt, qt, ot, lse)), strict=True)
    for call, split, (g, query, o, stats) in zip(plan.calls, plan.splits, parts, strict=True):
        items, keys, part = call.items, call.keys, _mask_part(mask, call)
        kernel = kernels.frames if split is not None else kernels[part is not None]
        gq, gk, gv = _call_backward(kernel, g, query, kt[items, :, keys], vt[items, :, keys], part, o, stats)
        for run, text in split.text if split is not None else ():
            tq, tk, tv = _call_backward(
                kernels.plain, g[run], query[run], kt[run, :, text], vt[run, :, text], None, o[run], stats[run]
            )
            gq[run].add_(tq)
            dk[run, text].add_(tk.transpose(1, 2))
            dv[run, text].add_(tv.transpose(1, 2))
        dqs.append(gq.transpose(1, 2))
        dk[items, keys].add_(gk.transpose(1, 2))
        dv[items, keys].add_(gv.transpose(1, 2))
    return from_calls(dqs, plan.calls, plan.rows, 1, q.shape), dk, dv


@row_group_attention_backward.register_fake
def _row_group_attention_backward_shape(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    groups: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, mask, groups, ctx.backend = inputs
    ctx.save_for_backward(q, k, v, mask, groups, *output)


def _gradients(ctx: Any, grad: torch.Tensor, _grad_lse: torch.Tensor | None) -> tuple:
    q, k, v, mask, groups, out, lse = ctx.saved_tensors
    backward = torch.ops.pfctl.row_group_attention_backward
    dq, dk, dv = backward(grad, q, k, v, mask, groups, out, lse, ctx.backend)
    return dq, dk, dv, None, None, None


row_group_attention_train.register_autograd(_gradients, setup_context=_save_for_backward)


class CompiledRowGroups:
    """Mixin of the attention modules of compiled blocks: every column of a model with row groups on goes to
    one of this module's operators, grouped in this call or not (a column too short to be grouped is one
    masked group), on the CPU and CUDA; elsewhere the attention is traced as it is."""

    def attend(
        self, layout: PyramidLayout, column: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if not layout.grouping or q.device.type not in ("cpu", "cuda"):
            return super().attend(layout, column, q, k, v)
        mask, table = layout.attn_masks[column], layout.group_tables[column]
        if torch.is_grad_enabled():
            return torch.ops.pfctl.row_group_attention_train(q, k, v, mask, table, layout.attention_backend)[0]
        return torch.ops.pfctl.row_group_attention(q, k, v, mask, table, layout.attention_backend)
