"""Peak-memory estimate of one training step, per process (``pfctl train --dry-run`` prints it).

peak ≈ weights + gradients + optimizer state + EMA + autocast weight copies + activations + masks

* **weights**: every parameter at its storage dtype (LoRA: the frozen base in ``train.base_dtype``,
  the adapters fp32; full fine-tuning: fp32 master weights).
* **gradients**: fp32, one per trainable parameter (accumulated over ``grad_accum`` in place).
* **optimizer**: fp32 state per trainable parameter (:func:`pfctl.training.optim.optimizer_state_bytes`:
  AdamW 8 B, SGD-momentum 4 B, Adafactor 4·(m+n) B per m x n matrix).
* **EMA**: an fp32 copy of what trains (LoRA: the adapters only).
* **autocast weight copies**: under bf16 autocast an fp32 Linear weight is cast to bf16 for every use and
  the copy is kept for backward (2 B per parameter of the layers whose activations are kept); a bf16 base
  needs no copy.
* **activations** (what autograd keeps for backward), from the block structure. With ``D`` the width,
  ``a`` the compute bytes (2 under bf16 autocast, else 4) and ``f = 4`` bytes for the fp32 tensors of
  the norms (layer norm and RMS-norm statistics run in fp32 under autocast), per token:

  - double-stream block, per stream (image tokens; text tokens likewise):
    attention: ``f·D`` (layer-norm input) + ``f·D``\\* (its output, for the modulation's grad)
    + ``a·D``° (q input) + ``2c·D``° (k and v inputs) + ``2a·D`` (RMS-norm inputs q, k; the norm keeps
    only them and a per-row rstd) + ``3a·D`` (SDPA q, k, v) + ``a·D`` (SDPA output)
    + ``a·D``° (to_out input) + ``a·D``\\* (gated branch); MLP: ``f·D`` + ``f·D``\\* + ``a·D``°
    + ``4a·D`` (GELU input) + ``4a·D``° (fc2 input) + ``a·D``\\*;
  - single-stream block (``L + n`` joint tokens per column): ``f·D`` + ``f·D``\\* + ``a·D``°
    + ``3c·D``° (k, v and MLP inputs) + ``4a·D`` (GELU input) + ``2a·D`` (RMS-norm inputs) + ``3a·D``
    + ``a·D`` + ``5a·D``° (proj_out input) + ``a·D``\\*;
  - ``c`` = ``a`` under autocast, else 0: autocast casts a Linear's fp32 input for that call alone, so
    the q, k, v (and single-stream MLP) projections of one normalised input each keep their own bf16
    copy; without autocast they share one tensor. (The rotary tables are built once per forward and
    shared by every block: not counted.)
  - ``*`` = kept only when the modulation weights train (full fine-tuning), ``°`` = kept only
    when that Linear trains (full) or carries an adapter (LoRA: + ``a·r`` for the adapter's inner
    activation).
  - the rest (embedders, final norm, output projection, loss): ``(3f + 2a)·D`` per image token.

  Gradient checkpointing on the first ``floor(blocks · ratio)`` blocks keeps only their input (the
  residual stream, ``a·D`` per token and stream) plus, during backward, one block's full recompute.
* **backward overlap**: gradients (set to None after every optimizer step) appear during backward while
  the saved tensors are released block by block, so the peak holds the larger of the two, not their
  sum; with ``grad_accum > 1`` the gradients already exist when the next forward starts.
* **masks**: SDPA materialises each column's boolean mask as an additive bias ``[Bc, 1, S, S]`` in the
  compute dtype, kept per attention call of every non-checkpointed block.

Not counted: the CUDA context and allocator fragmentation (typically 0.5-2 GB on a GPU), the data
batch, temporary workspaces. ``benchmarks/bench_lora.py`` compares this estimate with measured peaks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pfctl.training.optim import optimizer_state_bytes

FP32 = 4
#: Elements (x D) per token kept by a double-stream block stream: (elements, kind, condition)
#: kind: "f" = always fp32, "a" = compute dtype; condition: "always" | "modulation" (full fine-tuning
#: only) | the Linear whose input it is (kept when that Linear trains or carries an adapter).
#: "c": the bf16 copy autocast makes of a Linear's fp32 input for that call alone (not shared between the
#: q/k/v projections reading the same tensor; absent without autocast). The q/k RMS norms keep only their
#: input (in the compute dtype) and a per-row rstd.
DOUBLE_STREAM: tuple[tuple[float, str, str], ...] = (
    (1, "f", "always"), (1, "f", "modulation"), (1, "a", "attn.to_q"), (1, "c", "attn.to_k"),
    (1, "c", "attn.to_v"), (2, "a", "always"), (3, "a", "always"),
    (1, "a", "always"), (1, "a", "attn.to_out.0"), (1, "a", "modulation"),
    (1, "f", "always"), (1, "f", "modulation"), (1, "a", "ff.net.0.proj"), (4, "a", "always"),
    (4, "a", "ff.net.2"), (1, "a", "modulation"),
)  # fmt: skip
SINGLE_STREAM: tuple[tuple[float, str, str], ...] = (
    (1, "f", "always"), (1, "f", "modulation"), (1, "a", "attn.to_q"), (1, "c", "attn.to_k"),
    (1, "c", "attn.to_v"), (1, "c", "proj_mlp"), (4, "a", "always"), (2, "a", "always"),
    (3, "a", "always"), (1, "a", "always"), (5, "a", "proj_out"), (1, "a", "modulation"),
)  # fmt: skip
HEAD = ((3, "f"), (2, "a"))
#: adapted Linears an image/text token passes through per block (for the adapter's r-sized activation)
DOUBLE_ADAPTED = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
DOUBLE_ADAPTED_TEXT = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                       "ff_context.net.0.proj", "ff_context.net.2")  # fmt: skip
SINGLE_ADAPTED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")
TEXT_TWIN = {"attn.to_q": "attn.add_q_proj", "attn.to_k": "attn.add_k_proj", "attn.to_v": "attn.add_v_proj",
             "attn.to_out.0": "attn.to_add_out",
             "ff.net.0.proj": "ff_context.net.0.proj", "ff.net.2": "ff_context.net.2"}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """Tokens of one forward (one micro-batch of one process).

    ``columns``: per column ``(Bc, image tokens per item)`` (history included); ``text_len``: L.
    """

    columns: tuple[tuple[int, int], ...]
    text_len: int

    @property
    def image_tokens(self) -> int:
        return sum(b * n for b, n in self.columns)

    @property
    def text_tokens(self) -> int:
        return sum(b for b, _ in self.columns) * self.text_len


@dataclass
class MemoryEstimate:
    """Rows ``(name, bytes, detail)``; :meth:`render` prints the table."""

    rows: list[tuple[str, int, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.rows)

    def get(self, name: str) -> int:
        return sum(b for n, b, _ in self.rows if n == name)

    def render(self) -> str:
        width = max([len(n) for n, _, _ in self.rows] + [len("estimated peak")])
        head = f"{'memory (per process)':<{width}}  {'size':>10}  detail"
        lines = [head, "-" * len(head)]
        for name, nbytes, detail in self.rows:
            lines.append(f"{name:<{width}}  {format_bytes(nbytes):>10}  {detail}")
        lines.append("-" * len(head))
        lines.append(
            f"{'estimated peak':<{width}}  {format_bytes(self.total):>10}  (+ CUDA context, fragmentation)"
        )
        lines.extend(self.notes)
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """1536 → '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def estimate_memory(
    model: nn.Module,
    workload: Workload,
    *,
    lora_targets: Sequence[str] | None = None,
    lora_rank: int = 0,
    base_dtype: str = "fp32",
    compute_dtype: str = "bf16",
    optimizer: str = "adamw",
    ema: bool = False,
    gradient_checkpointing: bool = False,
    checkpointing_ratio: float = 0.75,
    checkpointing_policy: str = "full",
    grad_accum: int = 1,
    cuda_graphs: bool | str = False,
) -> MemoryEstimate:
    """The estimate for ``model`` (real or on the meta device; without adapters injected) training on
    ``workload``. ``lora_targets``: full names of the adapted Linears (None = full fine-tuning);
    ``checkpointing_policy`` ``selective``: the checkpointed blocks keep their attention results;
    ``selective_narrow``: also the outputs of their narrowing products. ``cuda_graphs`` (``True``: the
    blocks', ``"step"``: the whole step's): the gradients exist from the start; the step's graphs also hold
    a recorded step's saved tensors in their pool while the warm-up runs new inputs eagerly."""
    from pfctl.models.dit_layers import num_checkpointed

    a = 2 if compute_dtype in ("bf16", "fp16") else FP32
    lora = lora_targets is not None
    targets = set(lora_targets or ())
    est = MemoryEstimate()
    _add_state_rows(est, model, targets if lora else None, lora_rank, base_dtype, optimizer, ema)
    blocks = _blocks(model)
    n_ckpt = num_checkpointed(len(blocks), checkpointing_ratio) if gradient_checkpointing else 0
    _add_activation_rows(est, model, workload, blocks, n_ckpt, a, targets if lora else None, lora_rank)
    joint = workload.image_tokens + workload.text_tokens
    if n_ckpt and checkpointing_policy in ("selective", "selective_narrow"):
        heads = int(model.config["num_attention_heads"])
        kept = n_ckpt * (a * _width(model) + FP32 * heads) * joint
        est.rows.append(("activations: kept attention", int(kept), f"output + log-sum-exp of {n_ckpt} checkpointed blocks"))  # fmt: skip
    if n_ckpt and checkpointing_policy == "selective_narrow":
        # double blocks: the image and text feed-forwards' down projections; single blocks: proj_out
        kept = n_ckpt * a * _width(model) * joint
        est.rows.append(("activations: kept products", int(kept), f"narrowing products of {n_ckpt} checkpointed blocks"))  # fmt: skip

    # -- bf16 copies of fp32 weights made by autocast and kept for backward ------------------------
    if a == 2 and not (lora and base_dtype == "bf16"):
        kept_blocks = {name for name, _ in blocks[n_ckpt:]}
        copied = sum(
            m.weight.numel()
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear)
            and any(n.startswith(b + ".") for b in kept_blocks) and not n.endswith("norm.linear")
            and not n.endswith(("norm1.linear", "norm1_context.linear"))
        )  # fmt: skip
        est.rows.append(
            ("autocast weight copies", copied * 2, "bf16 casts of fp32 block weights kept for backward")
        )

    # -- backward: gradients are allocated as the saved tensors are released -----------------------
    saved = sum(b for n, b, _ in est.rows if n.startswith(("activations", "attention", "autocast")))
    # (with accumulation, or under CUDA graphs, the gradients are already there)
    if grad_accum == 1 and cuda_graphs is False:
        overlap = min(saved, est.get("gradients"))
        est.rows.append(("backward overlap", -overlap, "gradients fill memory the saved tensors free"))
    if cuda_graphs == "step":
        est.rows.append(("step graphs' pool", saved, "a recorded step's saved tensors, beside an eager one"))
    return est


def _add_state_rows(
    est: MemoryEstimate,
    model: nn.Module,
    targets: set[str] | None,
    lora_rank: int,
    base_dtype: str,
    optimizer: str,
    ema: bool,
) -> None:
    """Weights, gradients, optimizer state and EMA (``targets`` None: full fine-tuning)."""
    lora = targets is not None
    frozen_bytes, frozen_n, trainable_n, opt_bytes = 0, 0, 0, 0
    base_size = 2 if (lora and base_dtype == "bf16") else FP32
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for param in model.parameters():
        if lora:
            frozen_n += param.numel()
            frozen_bytes += param.numel() * (base_size if param.is_floating_point() else param.element_size())
        else:
            trainable_n += param.numel()
            opt_bytes += optimizer_state_bytes(tuple(param.shape), optimizer)
    adapter_shapes = []
    for name in targets or ():
        lin = linears[name]
        adapter_shapes += [(lora_rank, lin.in_features), (lin.out_features, lora_rank)]
    for shape in adapter_shapes:
        trainable_n += shape[0] * shape[1]
        opt_bytes += optimizer_state_bytes(shape, optimizer)
    if lora:
        est.rows.append(("weights: frozen base", frozen_bytes, f"{frozen_n:,} params in {base_dtype}"))
        est.rows.append(("weights: adapters", trainable_n * FP32, f"{trainable_n:,} params in fp32 (rank {lora_rank}, {len(targets)} layers)"))  # fmt: skip
    else:
        est.rows.append(("weights", trainable_n * FP32, f"{trainable_n:,} params in fp32 (all trainable)"))
    est.rows.append(("gradients", trainable_n * FP32, "fp32, trainable params only"))
    est.rows.append(("optimizer state", opt_bytes, optimizer))
    if ema:
        est.rows.append(("EMA", trainable_n * FP32, "fp32 copy of the trained params"))


def _add_activation_rows(
    est: MemoryEstimate,
    model: nn.Module,
    workload: Workload,
    blocks: list[tuple[str, str]],
    n_ckpt: int,
    a: int,
    targets: set[str] | None,
    lora_rank: int,
) -> None:
    """What autograd keeps per block (the first ``n_ckpt`` checkpointed), the head, the attention masks."""
    lora = targets is not None
    targets = targets or set()
    dim = _width(model)
    img, txt = workload.image_tokens, workload.text_tokens
    joint = img + txt

    def keeps(cond: str, block: str, text: bool = False) -> bool:
        if cond == "always":
            return True
        if cond == "modulation":
            return not lora
        suffix = TEXT_TWIN.get(cond, cond) if text else cond
        return not lora or f"{block}.{suffix}" in targets

    size = {"f": FP32, "a": a, "c": a if a != FP32 else 0}

    def stream_bytes(table: Iterable[tuple[float, str, str]], block: str, text: bool = False) -> float:
        return sum(e * size[kind] for e, kind, cond in table if keeps(cond, block, text)) * dim

    per_block, boundary = [], []
    for name, kind in blocks:
        if kind == "double":
            act = stream_bytes(DOUBLE_STREAM, name) * img + stream_bytes(DOUBLE_STREAM, name, True) * txt
            r_img = sum(f"{name}.{s}" in targets for s in DOUBLE_ADAPTED)
            r_txt = sum(f"{name}.{s}" in targets for s in DOUBLE_ADAPTED_TEXT)
            act += a * lora_rank * (r_img * img + r_txt * txt)
        else:
            act = stream_bytes(SINGLE_STREAM, name) * joint
            act += a * lora_rank * sum(f"{name}.{s}" in targets for s in SINGLE_ADAPTED) * joint
        mask = sum(b * (workload.text_len + n) ** 2 for b, n in workload.columns) * a  # one attention call
        per_block.append((act, mask))
        boundary.append(a * dim * joint)
    kept = sum(act for act, _ in per_block[n_ckpt:])
    masks = sum(mask for _, mask in per_block[n_ckpt:])
    ckpt_inputs = sum(boundary[:n_ckpt])
    recompute = max((act + mask for act, mask in per_block[:n_ckpt]), default=0)
    head = sum(e * (FP32 if k == "f" else a) for e, k in HEAD) * dim * img
    est.rows.append(("activations: blocks", int(kept), f"{len(blocks) - n_ckpt} blocks kept whole; {img:,} image + {txt:,} text tokens"))  # fmt: skip
    if n_ckpt:
        est.rows.append(("activations: checkpointed", int(ckpt_inputs + recompute), f"{n_ckpt} block inputs + one block recomputed"))  # fmt: skip
    est.rows.append(("activations: head", int(head), "embedders, final norm, output projection"))
    est.rows.append(("attention masks", int(masks), "additive SDPA bias per column and kept block"))


def _blocks(model: nn.Module) -> list[tuple[str, str]]:
    """(name, "double" | "single") of every transformer block in execution order."""
    names = [n for n, _ in model.blocks_in_order()] if hasattr(model, "blocks_in_order") else []
    return [(n, "single" if n.startswith("single_") else "double") for n in names]


def _width(model: nn.Module) -> int:
    dim = getattr(model, "inner_dim", None)
    if dim is None:
        cfg = model.config
        dim = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    return int(dim)


# ------------------------------------------------------------------------------------------------
# Building what the estimate needs without weights, and measuring what it predicts
# ------------------------------------------------------------------------------------------------


def meta_dit(config: Any) -> nn.Module:
    """The run's DiT on the meta device (no memory, no weights): from the preset, or from the
    ``config.json`` of ``model.path`` (official folder, pfctl export or bare DiT folder)."""
    import json
    from pathlib import Path

    from accelerate import init_empty_weights

    from pfctl.models.checkpoint import EXPORT_MARKER, build_dit_from_config, read_export_marker
    from pfctl.training.build import dit_overrides

    m = config.model
    with init_empty_weights(include_buffers=True):
        if m.dit_preset is not None:
            from pfctl.models.registry import get_preset, preset_config

            full = {
                "_class_name": get_preset(m.dit_preset).class_name,
                **preset_config(m.dit_preset, m.dit_config),
            }
            return build_dit_from_config({**full, **dit_overrides(config)}, source=f"preset {m.dit_preset!r}")
        root = Path(m.path).expanduser()
        if (root / EXPORT_MARKER).is_file():
            folder = root / str(read_export_marker(root).get("transformer") or "transformer")
        elif (root / "config.json").is_file():
            folder = root
        else:
            folder = root / m.variant
        from pfctl.errors import ModelLoadError

        try:
            dit_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read the DiT config {folder / 'config.json'}: {exc}") from None
        return build_dit_from_config(dit_config, dit_overrides(config), source=folder / "config.json")


def saved_activation_bytes(fn: Any, params: Iterable[torch.Tensor] = (), quadratic: int | None = None) -> int:
    """Bytes of the distinct tensors autograd keeps while ``fn()`` runs (parameters excluded, and
    attention masks/biases when ``quadratic``, the tokens of a column, is given: tensors of ``quadratic``
    key columns and at most as many query rows).

    The CPU check of the activation formula: it counts exactly what backward would read."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in skip or ptr in seen:
            return t
        if quadratic is not None and t.dim() >= 2 and t.shape[-1] == quadratic and t.shape[-2] <= quadratic:
            return t
        seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
