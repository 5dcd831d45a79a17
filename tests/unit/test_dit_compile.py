"""The tiny pyramid DiTs' blocks under ``torch.compile`` (CPU with Dynamo's ``eager`` / ``aot_eager`` backends,
and one CUDA test with Inductor): gradients as in eager mode, what Dynamo traces and recompiles, and the
compiled blocks composed with activation checkpointing and FSDP2."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from helpers.tiny_dit import (
    LATENT_C,
    PLAIN,
    SUMS,
    AttentionKernelRuns,
    build,
    clone_args,
    inputs,
    narrowing_block_products,
    run,
)
from helpers.tolerance import assert_rounding_close


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_blocks() -> None:
    """``train.compile``: compiled blocks (traced with ``aot_eager``: dynamo capture and AOT autograd's
    backward without code generation) give the eager forward and gradients, checkpointed blocks included,
    with LoRA adapters injected before compiling (as the trainer does). One ~50 s trace covers both kinds
    of fine-tuning: base weights and adapters all train here. Flux only: it has both block types (the
    MMDiT's share Flux's dual-stream block)."""
    from pfctl.models.lora import add_lora

    args, models = inputs(), []
    for _ in range(2):
        model = build("flux").train()
        torch.manual_seed(0)  # the same adapter init in both models
        add_lora(model, rank=2, alpha=2, targets=["attn.to_q", "attn.to_out.0", "ff.net.2"])
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.requires_grad_(True)  # the base trains too
                if "lora_B" in name:  # B starts at 0: make the adapters matter
                    p.copy_(torch.linspace(-0.1, 0.1, p.numel()).view_as(p))
        models.append(model)
    from pfctl.models.fast import FastPaths, apply_fast_paths

    eager, compiled = models
    torch._dynamo.reset()
    apply_fast_paths(eager, FastPaths(checkpointing_ratio=0.5))
    apply_fast_paths(compiled, FastPaths(checkpointing_ratio=0.5, compile=True, compile_backend="aot_eager"))
    results = []
    for model in (eager, compiled):
        outs = model(**clone_args(args))
        sum(o.square().mean() for o in outs).backward()
        results.append((outs, {n: p.grad for n, p in model.named_parameters()}))
    torch._dynamo.reset()
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert_rounding_close(b, a, **SUMS)
    assert results[1][1].keys() == results[0][1].keys()
    assert any(".lora_B" in name for name in results[0][1])
    for name, grad in results[0][1].items():
        assert_rounding_close(results[1][1][name], grad, **SUMS, msg=name)


@dataclass
class _TrainingTrace:
    """What Dynamo handed its backend over one training forward and backward of compiled blocks."""

    graphs: list[torch.fx.GraphModule]
    kinds: set[str]  # the model's block classes
    fake_cache_lookups: tuple[int, int]  # FakeTensorMode cache hits and misses while it was traced


def _trace_training_step(kind: str, stack: str) -> _TrainingTrace:
    """One training step of compiled blocks (``stack``: ``compile``, or torchtitan's checkpointing, compile and
    FSDP2 on a one-process group), traced with a backend that keeps the graphs and runs them as they are. The
    fake-tensor cache is on when the blocks are compiled (PyTorch's default, back after)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.runtime.sharding import shard_model

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    model = build(kind, num_layers=2, **({"num_single_layers": 2} if kind == "flux" else {})).train()
    torch._dynamo.reset()
    ratio = 0.5 if stack == "torchtitan" else 0.0
    paths = FastPaths(
        PLAIN, checkpointing_ratio=ratio, compile=True, compile_backend=keep, independent_sizes=True
    )
    lone_group = stack == "torchtitan" and not torch.distributed.is_initialized()
    before = FakeTensorMode.cache_info()
    try:
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=True):
            apply_fast_paths(model, paths)
            if stack == "torchtitan":  # the 768p recipe's sharding, on a process group of this process alone
                blocks = [b for _, b in model.blocks_in_order()]
                shard_model(model, blocks, strategy="shard_grad_op", device=torch.device("cpu"))
            sum(o.square().mean() for o in model(**inputs())).backward()
    finally:
        torch._dynamo.reset()
        if lone_group:  # ranks forked by later tests must not inherit it
            torch.distributed.destroy_process_group()
    after = FakeTensorMode.cache_info()
    kinds = {type(block).__name__ for _, block in model.blocks_in_order()}
    return _TrainingTrace(graphs, kinds, (after.hits - before.hits, after.misses - before.misses))


@pytest.fixture(scope="module")
def training_traces() -> Callable[[str, str], _TrainingTrace]:
    """:func:`_trace_training_step` once per ``(kind, stack)`` in this module: the tests below assert different
    things about the same traced step (how many graphs, what they take, how they were traced)."""
    return functools.cache(_trace_training_step)


@pytest.mark.parametrize(
    ("kind", "stack"), [("flux", "compile"), ("mmdit", "compile"), ("flux", "torchtitan")]
)
def test_compiled_blocks_trace_each_block_kind_once(
    kind: str, stack: str, training_traces: Callable[[str, str], _TrainingTrace]
) -> None:
    """Over a training forward and backward Dynamo traces each kind of block once, and the last block once
    more (Flux's computes only the clips' rows, the MMDiT's has no text output): the first block, whose text
    input is a view of the embedder's product, no longer traces its kind a second time (a second Inductor
    compilation of its forward and backward on a GPU). The same with torchtitan's stack (checkpointing,
    compile, FSDP2 on a one-process group): FSDP2's gradient hook hands the blocks views in the forward but
    not in the checkpointed recomputation, and blocks compiled around the module call were traced again in
    the middle of the backward."""
    trace = training_traces(kind, stack)
    assert len(trace.graphs) == len(trace.kinds) + 1


def test_compiled_training_with_row_groups_recompiles_nothing_per_column(monkeypatch) -> None:
    """With row groups on (``skip_future_keys``), training steps whose columns are grouped in some steps and too
    short in others must not recompile per column: with gradients every attention call of a compiled block
    goes to the eager row-group function, which the compiled code hands the layout and column whole. (When a
    step without grouped columns traced the one-call path in the attention frame that a grouped step's graph
    break had made, that frame was compiled again for every column index, up to dynamo's recompile limit:
    benchmarks/RESULTS.md, session 20.)"""
    import pfctl.models.attention_layout as dc
    from pfctl.models.fast import FastPaths, apply_fast_paths

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)
    model = build("flux").train()
    # columns of 5 text and 4 + 4t image tokens: grouped from t = 4
    model.set_attention_backend("auto", skip_future_keys=True, min_tokens=25)
    torch._dynamo.reset()
    apply_fast_paths(model, FastPaths(PLAIN, compile=True, compile_backend="eager", independent_sizes=True))
    gen = torch.Generator().manual_seed(0)
    try:
        for frames in [(1, 2), (5, 1), (1, 1), (2, 6), (1, 5), (2, 2), (6, 4), (4, 1)]:
            args = inputs()
            args["sample"] = [
                [
                    torch.randn(2, LATENT_C, 1, 4, 4, generator=gen),
                    torch.randn(2, LATENT_C, t, 4, 4, generator=gen),
                ]
                for t in frames
            ]
            sum(o.square().mean() for o in model(**args)).backward()
        # why dynamo compiled each frame again, per code object
        reasons = {code.co_name: list(why) for code, why in torch._dynamo.guard_failures.items()}
    finally:
        torch._dynamo.reset()
    assert not [r for why in reasons.values() for r in why if "column" in r], reasons
    assert len(reasons.get("attend", [])) <= 1, reasons  # (the column index turning dynamic)


def test_checkpointed_compiled_blocks_do_not_specialise_on_group_counts(monkeypatch) -> None:
    """Training steps whose columns are one row group in some steps and several in others (a short column, a
    column whose groups all attend without a mask) reuse the compiled blocks: a compiled block takes each
    column's group table and mask, and a size of 1 (or 0) would have compiled it again (it did, every few
    768p steps, until group tables had two rows at least and masks two rows at least). Only the two block
    kinds of the checkpointed function tell their graphs apart."""
    import pfctl.models.attention_layout as dc
    from pfctl.models.fast import FastPaths, apply_fast_paths

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)
    model = build("flux").train()
    model.set_attention_backend("efficient", skip_future_keys=True, min_tokens=0)
    torch._dynamo.reset()
    paths = FastPaths(PLAIN, checkpointing_ratio=0.75, checkpointing_policy="selective", compile=True)
    apply_fast_paths(model, replace(paths, compile_backend="eager", independent_sizes=True))
    gen = torch.Generator().manual_seed(0)

    def clips(*frames: int) -> list[torch.Tensor]:
        return [torch.randn(2, LATENT_C, t, 4, 4, generator=gen) for t in frames]

    try:
        for sample in (
            [clips(1), clips(1, 2)],
            [clips(3), clips(1)],
            [clips(1, 1), clips(1)],
            [clips(2), clips(4)],
        ):
            args = inputs()
            args["sample"] = sample
            sum(o.square().mean() for o in model(**args)).backward()
        reasons = [r for why in torch._dynamo.guard_failures.values() for r in why]
    finally:
        torch._dynamo.reset()
    assert not [r for r in reasons if "group_tables" in r or "attn_masks" in r], reasons
    assert len(reasons) <= 1, reasons


def test_selective_checkpointing_of_compiled_blocks_with_row_groups_attends_once(monkeypatch) -> None:
    """The 768p recipe's stack: compiled blocks attending in row groups through the training operator
    (``skip_future_keys``), every block checkpointed inside its compiled graph with ``selective`` or
    ``selective_narrow``. The backward recomputes the blocks without running the operator (or any attention
    kernel) again, ``selective_narrow`` without their narrowing products either, with the outputs and
    gradients of the eager model checkpointed with ``full``."""
    import pfctl.models.attention_layout as dc
    from pfctl.models.fast import FastPaths, apply_fast_paths

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)
    args, results, backward_runs = inputs(), [], []
    args["sample"][1] = [torch.randn(2, LATENT_C, 1, 4, 4), torch.randn(2, LATENT_C, 5, 4, 4)]  # grouped
    torch._dynamo.reset()
    try:
        for policy, compiled in (("full", False), ("selective", True), ("selective_narrow", True)):
            model = build("flux", num_layers=1, num_single_layers=1).train()
            model.set_attention_backend("auto", skip_future_keys=True, min_tokens=25)
            paths = FastPaths(PLAIN, checkpointing_ratio=1.0, checkpointing_policy=policy, compile=compiled)
            apply_fast_paths(model, replace(paths, compile_backend="aot_eager", independent_sizes=True))
            with AttentionKernelRuns() as counter:
                outs = model(**clone_args(args))
                forward, narrow_forward = counter.runs, counter.narrow_runs
                sum(o.square().mean() for o in outs).backward()
            backward_runs.append((counter.runs - forward, counter.narrow_runs - narrow_forward))
            assert forward > 0
            results.append((outs, {n: p.grad for n, p in model.named_parameters()}))
    finally:
        torch._dynamo.reset()
    (full, _), (selective, selective_narrowing), (narrow, narrow_narrowing) = backward_runs
    assert full > 0 and selective == narrow == 0
    assert selective_narrowing - narrow_narrowing == len(narrowing_block_products(model)) > 0
    for outs, grads in results[1:]:
        for a, b in zip(results[0][0], outs, strict=True):
            assert_rounding_close(b, a, **SUMS)
        for name, grad in results[0][1].items():
            assert_rounding_close(grads[name], grad, **SUMS, msg=name)


@pytest.mark.slow
def test_compiled_blocks_keep_one_graph_per_block_type_across_training_layouts() -> None:
    """Columns whose token counts change independently (as a training run's do every step) must not
    recompile the blocks: the layout hands them contiguous padded masks (no stride pattern to specialise
    on) and ``independent_sizes`` turns duck shaping off (no equality between sizes that happen to match)."""
    import torch.fx.experimental._config as shape_config
    from torch._dynamo.utils import counters

    duck_shape = shape_config.use_duck_shape  # process-wide: restored for the other tests
    try:
        model = build("flux")
        torch._dynamo.reset()
        counters.clear()
        from pfctl.models.fast import FastPaths, apply_fast_paths

        # guards and graphs as with inductor
        apply_fast_paths(model, FastPaths(compile=True, compile_backend="eager", independent_sizes=True))
        gen = torch.Generator().manual_seed(0)
        for frames in [
            (1, 2),
            (3, 2),
            (2, 2),
            (4, 1),
            (1, 3),
        ]:  # S = 4 + 4t: multiples of 8 or not, equal or not
            args = inputs(text_len=4)
            args["sample"] = [
                [
                    torch.randn(2, LATENT_C, 1, 4, 4, generator=gen),
                    torch.randn(2, LATENT_C, t, 4, 4, generator=gen),
                ]
                for t in frames
            ]
            run(model, args)
        assert counters["stats"]["unique_graphs"] == 3  # double, single, and the last single block
    finally:
        shape_config.use_duck_shape = duck_shape
        torch._dynamo.reset()


def test_compiled_blocks_take_their_float_attributes_as_constants(
    training_traces: Callable[[str, str], _TrainingTrace],
) -> None:
    """With every size dynamic, Dynamo passed each float attribute of a block (norm eps, dropout p) to its graph
    as a 0-dim CPU tensor; on CUDA under FSDP2 and checkpointing, Inductor then generated CPU code for a block
    (the compose test below). The compiled blocks' graphs take no such input, forward or recomputed: checked on
    the traced training step of torchtitan's stack (checkpointed and plain blocks of both kinds, FSDP2)."""
    graphs = training_traces("flux", "torchtitan").graphs
    scalars = [
        node.name
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "placeholder"
        and isinstance(value := node.meta.get("example_value"), torch.Tensor)
        and value.dim() == 0
    ]
    assert graphs and not scalars, scalars


def test_compiled_training_blocks_trace_without_the_fake_tensor_cache(
    training_traces: Callable[[str, str], _TrainingTrace],
) -> None:
    """Blocks compiled with every size dynamic (training) trace without the fake-tensor cache, whose hits
    rebuilt symbolic sizes more slowly than a fresh computation: none is looked up while a step is traced
    (Flux's training step of the trace test above, compiled with the cache on, as PyTorch's default has it)."""
    trace = training_traces("flux", "compile")
    assert trace.graphs and trace.fake_cache_lookups == (0, 0)


@pytest.mark.parametrize("attention", ["auto", "cudnn", "efficient", "flex"])
def test_compiled_blocks_are_cacheable_by_aot_autograd(attention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AOTAutograd's on-disk cache takes the compiled blocks' graphs (so a later run does not trace their joint
    graphs again) although they hold the lean autograd Functions and, with a chosen SDPA kernel, the calls
    ``sdpa_kernel`` is traced into: the cache takes neither by default, and compiled blocks ask it to. With
    ``flex``, FlexAttention's operator and its mask (its backward lifted on the CPU, as in
    ``test_packed_attention.py``)."""
    from torch._functorch._aot_autograd.autograd_cache import check_cacheable
    from torch._inductor import config as inductor_config

    from pfctl.models.fast import FastPaths, apply_fast_paths

    checked: list[str] = []

    def checking(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        check_cacheable(gm)  # raises (BypassAOTAutogradCache) for a graph the cache would not take
        checked.append(gm.code)
        return gm.forward

    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None, raising=False)
    model = build("flux", num_layers=1, num_single_layers=1).train()
    model.set_attention_backend(attention, False)
    torch._dynamo.reset()
    try:  # PyTorch's defaults, back after
        with (
            torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=False),
            inductor_config.patch(unsafe_marked_cacheable_functions={}),
        ):
            apply_fast_paths(model, FastPaths(compile=True, compile_backend=checking, independent_sizes=True))
            sum(o.square().mean() for o in model(**inputs(seed=0))).backward()
    finally:
        torch._dynamo.reset()
    assert checked and any("autograd_function_apply" in code for code in checked)
    assert any("sdpa_kernel" in code for code in checked) == (attention in ("cudnn", "efficient"))
    assert any("flex_attention" in code for code in checked) == (attention == "flex")


def _to(args: dict, device: str) -> dict:
    def move(v):
        return [move(x) for x in v] if isinstance(v, list) else v.to(device)

    return {k: move(v) for k, v in args.items()}


def _inductor_on_cuda_only(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Inductor, after checking that a compiled block computes nothing on the CPU: a CPU value fails at once and
    names its node, where Inductor would otherwise generate CPU code for it (the blocks' float attributes did,
    until compiled as constants). The row groups' host tables (int64 inputs) are read by their operators only."""
    from torch._inductor.compile_fx import compile_fx

    on_cpu = [
        node.format_node()
        for node in gm.graph.nodes
        if isinstance(value := node.meta.get("example_value"), torch.Tensor)
        and value.device.type == "cpu"
        and not (node.op == "placeholder" and value.dtype == torch.int64)
    ]
    assert not on_cpu, "CPU values in a compiled block: " + "; ".join(on_cpu[:8])
    return compile_fx(gm, example_inputs)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("strategy", "row_groups"), [("shard_grad_op", True), ("full_shard", False)])
def test_checkpointing_compile_and_fsdp2_compose_on_cuda(
    strategy: str, row_groups: bool, monkeypatch
) -> None:
    """torchtitan's stack on one model, in its order: checkpointed blocks (the trainer's ``selective``
    policy), compiled by Inductor, then sharded by FSDP2 (a one-process group): the eager model's outputs and
    gradients within fp32 rounding, over two AdamW steps (the second one runs the compiled code with sharded,
    updated weights). With ``row_groups`` as the 768p recipe runs (``skip_future_keys``: the compiled blocks
    attend through the row groups' training operator, the eager ones group by group)."""
    import pfctl.models.attention_layout as dc
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.runtime.sharding import shard_model

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 8)
    eager, fast = build("flux").cuda().train(), build("flux").cuda().train()
    if row_groups:
        for model in (eager, fast):
            model.set_attention_backend("efficient", skip_future_keys=True, min_tokens=0)
    torch._dynamo.reset()
    paths = FastPaths(
        PLAIN,
        checkpointing_ratio=0.5,
        checkpointing_policy="selective",
        compile=True,
        compile_backend=_inductor_on_cuda_only,
    )
    apply_fast_paths(fast, paths)
    shard_model(fast, [b for _, b in fast.blocks_in_order()], strategy=strategy, device=torch.device("cuda"))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, fast)]
    for step in range(2):
        results = []
        for model, optimizer in zip((eager, fast), optimizers, strict=True):
            outs = model(**_to(inputs(seed=step), "cuda"))
            sum(o.square().mean() for o in outs).backward()
            grads = {
                n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in model.named_parameters()
            }
            results.append(([o.detach().cpu() for o in outs], {n: g.cpu() for n, g in grads.items()}))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for a, b in zip(results[0][0], results[1][0], strict=True):
            assert_rounding_close(b, a, **SUMS)
        assert results[0][1].keys() == results[1][1].keys()
        for name, grad in results[0][1].items():
            assert_rounding_close(results[1][1][name], grad, **SUMS, msg=f"step {step}: {name}")
    torch._dynamo.reset()
