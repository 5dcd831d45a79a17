"""LoRA on the pyramid DiT: target selection, freezing, files, apply/merge at a scale, optimizers,
and the memory estimate against what autograd really keeps (tiny models, CPU, fp32)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from helpers.tolerance import assert_rounding_close
from pfctl.config import load_config
from pfctl.config.train import DEFAULT_LORA_TARGETS
from pfctl.errors import CheckpointError, ConfigError
from pfctl.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    LoadedLora,
    adapter_config_dict,
    add_lora,
    apply_lora,
    cast_frozen,
    load_lora_state,
    lora_state_dict,
    merge_and_unload,
    read_adapter_files,
    resolve_targets,
    write_adapter_files,
)
from pfctl.training.memory import Workload, estimate_memory, saved_activation_bytes

TEXT_LEN = 8


SUMS = {"reduction": 128, "depth": 16}
"""The tiny DiT's sums: at most 128 terms (its MLP), about 16 chained (helpers.tolerance); the models compared
are copies (other addresses) or compute the adapter's product another way (merged weights)."""


def dit(**overrides):
    from helpers.tiny_models import tiny_dit

    return tiny_dit("tiny", seed=0, overrides=overrides or None)


def inputs(frames: int = 2, size: int = 8, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "sample": [[torch.randn(1, 16, frames, size, size, generator=gen)]],
        "encoder_hidden_states": torch.randn(1, TEXT_LEN, 32, generator=gen),
        "encoder_attention_mask": torch.ones(1, TEXT_LEN, dtype=torch.long),
        "pooled_projections": torch.randn(1, 24, generator=gen),
        "timestep_ratio": torch.tensor([400.0]),
    }


def trained_adapter(model, seed: int = 1) -> dict[str, torch.Tensor]:
    """Give the adapters non-zero B (a fresh adapter is the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return {k: v.clone() for k, v in lora_state_dict(model).items()}


# -- targets -------------------------------------------------------------------------------------


def test_default_targets_cover_attention_and_mlp_of_both_block_kinds() -> None:
    names = resolve_targets(dit(), DEFAULT_LORA_TARGETS)
    double = {n.removeprefix("transformer_blocks.0.") for n in names if n.startswith("transformer_blocks.0.")}
    single = {n.removeprefix("single_transformer_blocks.0.") for n in names if n.startswith("single_")}
    assert double == {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                      "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                      "ff_context.net.0.proj", "ff_context.net.2"}  # fmt: skip
    assert single == {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out"}
    assert "proj_out" not in names  # the model's final layer is outside the blocks
    assert not any("norm" in n for n in names)


def test_regex_targets_and_errors_name_the_key() -> None:
    model = dit()
    assert resolve_targets(model, r".*\.attn\.to_[qk]") == [
        "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
        "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"train\.lora\.targets: entry 'to_qq' matches no Linear"):
        resolve_targets(model, ["to_q", "to_qq"])
    with pytest.raises(ConfigError, match=r"train\.lora\.targets = 'nothing.*' matches no Linear"):
        resolve_targets(model, "nothing.*")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.lora.rank=0", "train.lora.rank"),
        ("train.lora.targets=[]", "train.lora.targets"),
        ("train.lora.targets='(unclosed'", "train.lora.targets"),
        ("train.lora.dropout=1.5", "train.lora.dropout"),
    ],
)
def test_bad_lora_config_names_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_bf16_base_needs_lora() -> None:
    from pfctl.config.train import check_train_constraints

    cfg = load_config(None, ["train.base_dtype=bf16"])
    with pytest.raises(ConfigError, match=r"train\.base_dtype=bf16 needs train\.lora\.enabled"):
        check_train_constraints(cfg.train, 1)


# -- adapters --------------------------------------------------------------------------------------


def test_only_adapters_train_and_a_fresh_adapter_changes_nothing() -> None:
    base = dit()
    model = copy.deepcopy(base)
    names = add_lora(model, rank=4, alpha=8, targets=DEFAULT_LORA_TARGETS)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 2 * len(names)
    with torch.no_grad():
        assert_rounding_close(model(**inputs())[0], base(**inputs())[0], **SUMS)  # B = 0 at start
    assert cast_frozen(model, torch.bfloat16) == sum(p.numel() for p in base.parameters())
    assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {torch.float32}


def test_adapter_files_are_peft_layout_and_load_strictly(tmp_path: Path) -> None:
    model = dit()
    names = add_lora(model, rank=4, alpha=8, targets=["attn.to_q"])
    state = trained_adapter(model)
    write_adapter_files(tmp_path, state, adapter_config_dict(4, 8, 0.0, names, "/some/base"))
    from safetensors.torch import load_file

    assert all(k.startswith(PEFT_PREFIX) for k in load_file(str(tmp_path / ADAPTER_WEIGHTS)))
    cfg = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"], cfg["target_modules"]) == (4, 8, "LORA", names)
    import peft

    assert peft.LoraConfig.from_pretrained(str(tmp_path)).r == 4  # peft itself reads it
    loaded, _ = read_adapter_files(tmp_path)
    other = dit()
    add_lora(other, rank=4, alpha=8, targets=["attn.to_q"])
    load_lora_state(other, loaded)
    assert all(torch.equal(v, lora_state_dict(other)[k]) for k, v in state.items())
    wrong_rank = dit()
    add_lora(wrong_rank, rank=2, alpha=8, targets=["attn.to_q"])
    with pytest.raises(CheckpointError, match="has shape"):
        load_lora_state(wrong_rank, loaded)


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.0])
def test_apply_at_scale_and_merge_agree(tmp_path: Path, scale: float) -> None:
    base = dit()
    trained = copy.deepcopy(base)
    names = add_lora(trained, rank=4, alpha=8, targets=DEFAULT_LORA_TARGETS)
    state = trained_adapter(trained)
    cfg = adapter_config_dict(4, 8, 0.0, names, None)
    applied = copy.deepcopy(base)
    apply_lora(applied, [LoadedLora(tmp_path, state, cfg, None, scale)])
    x = inputs()
    with torch.no_grad():
        y_base, y_trained, y_applied = (m(**x)[0] for m in (base, trained, applied))
        merged = merge_and_unload(copy.deepcopy(applied))
        y_merged = merged(**x)[0]
    assert list(merged.state_dict()) == list(base.state_dict())  # a plain DiT again
    if scale == 1.0:
        assert_rounding_close(y_applied, y_trained, **SUMS)  # the very layers the trainer used
    if scale == 0.0:
        assert_rounding_close(y_applied, y_base, **SUMS)
    assert_rounding_close(y_merged, y_applied, **SUMS)
    # the LoRA delta is linear in the scale on every weight
    for key, w in merged.state_dict().items():
        b = base.state_dict()[key]
        if not torch.equal(w, b):
            assert key.endswith(".weight") and key.removesuffix(".weight") in names


def test_two_adapters_add_up(tmp_path: Path) -> None:
    base = dit()
    adapters = []
    for seed, targets in ((1, ["attn.to_q", "proj_mlp"]), (2, ["attn.to_q", "ff.net.2"])):
        model = copy.deepcopy(base)
        names = add_lora(model, rank=2, alpha=2, targets=targets)
        adapters.append((trained_adapter(model, seed), adapter_config_dict(2, 2, 0.0, names, None)))
    both = copy.deepcopy(base)
    apply_lora(
        both, [LoadedLora(tmp_path, s, c, None, k) for (s, c), k in zip(adapters, (1.0, 0.5), strict=True)]
    )
    merged = merge_and_unload(copy.deepcopy(both))
    one_by_one = copy.deepcopy(base)
    for (s, c), k in zip(adapters, (1.0, 0.5), strict=True):
        apply_lora(one_by_one, [LoadedLora(tmp_path, s, c, None, k)])
        one_by_one = merge_and_unload(one_by_one)
    x = inputs()
    with torch.no_grad():
        assert_rounding_close(merged(**x)[0], one_by_one(**x)[0], **SUMS)
        assert_rounding_close(both(**x)[0], merged(**x)[0], **SUMS)


# -- optimizers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "adafactor"])
def test_optimizer_state_matches_its_formula(name: str) -> None:
    from pfctl.training.optim import build_optimizer, optimizer_state_bytes

    cfg = load_config(None, [f"train.optimizer={name}"]).train
    model = dit()
    add_lora(model, rank=4, alpha=4, targets=["attn.to_q", "proj_mlp"])
    opt = build_optimizer(model, cfg)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }
    model(**inputs())[0].square().mean().backward()
    opt.step()
    real = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    expected = sum(optimizer_state_bytes(tuple(p.shape), name) for p in model.parameters() if p.requires_grad)
    assert real == expected


# -- memory estimate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True])
def test_activation_formula_matches_what_autograd_keeps(lora: bool) -> None:
    """fp32 on the CPU: the analytic per-token constants against the saved tensors, counted exactly."""
    from pfctl.models.fast import FastPaths, apply_fast_paths

    model = dit(num_layers=2, num_single_layers=2, num_attention_heads=4)
    targets = resolve_targets(model, DEFAULT_LORA_TARGETS) if lora else None
    frames, size = 4, 16
    tokens = frames * (size // 2) ** 2
    est = estimate_memory(
        model, Workload(((1, tokens),), TEXT_LEN), lora_targets=targets, lora_rank=4, compute_dtype="fp32"
    )
    if lora:
        add_lora(model, rank=4, alpha=4, targets=DEFAULT_LORA_TARGETS)
    apply_fast_paths(model, FastPaths())  # as the trainer runs it: the estimate counts the lean autograd path
    model.train()
    x = inputs(frames, size)
    measured = saved_activation_bytes(lambda: model(**x), model.parameters(), quadratic=TEXT_LEN + tokens)
    predicted = est.get("activations: blocks") + est.get("activations: head")
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_estimate_counts_what_selective_checkpointing_keeps() -> None:
    """The estimate's rows for what selective checkpointing keeps match the bytes a training forward makes:
    the attention kernels' results (``selective``) and the blocks' narrowing products' outputs
    (``selective_narrow``, which keeps both)."""
    from helpers.tiny_dit import AttentionKernelRuns, narrowing_block_products
    from pfctl.models.fast import FastPaths, apply_fast_paths

    model = dit(num_layers=2, num_single_layers=2, num_attention_heads=4)
    frames, size = 4, 16
    tokens = frames * (size // 2) ** 2
    est = estimate_memory(
        model, Workload(((1, tokens),), TEXT_LEN), compute_dtype="fp32", gradient_checkpointing=True,
        checkpointing_ratio=1.0, checkpointing_policy="selective_narrow",
    )  # fmt: skip
    apply_fast_paths(model, FastPaths(checkpointing_ratio=1.0, checkpointing_policy="selective_narrow"))
    model.train()
    products = []
    for layer in narrowing_block_products(model):
        layer.register_forward_hook(lambda _m, _i, out: products.append(out.nbytes))
    with AttentionKernelRuns() as kept:
        model(**inputs(frames, size))
    predicted = est.get("activations: kept attention")
    assert kept.runs == 4 and abs(predicted - kept.output_bytes) / kept.output_bytes < 0.05, (predicted, kept)
    predicted, measured = est.get("activations: kept products"), sum(products)
    assert products and abs(predicted - measured) / measured < 0.05, (predicted, measured)
    selective = estimate_memory(
        model, Workload(((1, tokens),), TEXT_LEN), compute_dtype="fp32", gradient_checkpointing=True,
        checkpointing_ratio=1.0, checkpointing_policy="selective",
    )  # fmt: skip
    assert selective.get("activations: kept attention") > 0 == selective.get("activations: kept products")
    assert estimate_memory(model, Workload(((1, tokens),), TEXT_LEN)).get("activations: kept attention") == 0


def test_estimate_responds_to_each_option() -> None:
    model = dit(num_layers=2, num_single_layers=2)
    work = Workload(((2, 256), (2, 512)), TEXT_LEN)
    targets = resolve_targets(model, DEFAULT_LORA_TARGETS)

    def est(**kw):
        return estimate_memory(model, work, **kw)

    full, lora = est(), est(lora_targets=targets, lora_rank=4)
    assert lora.get("optimizer state") < full.get("optimizer state") and lora.get("gradients") < full.get(
        "gradients"
    )
    fp32_base = lora.get("weights: frozen base")
    assert (
        est(lora_targets=targets, lora_rank=4, base_dtype="bf16").get("weights: frozen base") * 2 == fp32_base
    )
    assert est(optimizer="adafactor").get("optimizer state") < est(optimizer="sgd_momentum").get(
        "optimizer state"
    )
    assert est(optimizer="sgd_momentum").get("optimizer state") * 2 == full.get("optimizer state")
    ckpt = est(gradient_checkpointing=True, checkpointing_ratio=1.0)
    assert ckpt.total < full.total and ckpt.get("activations: blocks") == 0
    assert est(ema=True).total == full.total + full.get("gradients")
    assert "estimated peak" in full.render() and "optimizer state" in full.render()
