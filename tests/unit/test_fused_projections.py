"""``fast.fused_projections``: each attention module's q/k/v projections of one input as one product
(:func:`pfctl.models.fast.products.stacked_linear`) when training under autocast with fp32 weights: the
separate products' results, three matrix products fewer per fused layer (forward, input gradient, weight
gradient), the parameters unchanged; LoRA layers, weights autocast does not cast, and inference keep their
own products."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.tiny_dit import MODELS, PLAIN, build, clone_args, inputs
from helpers.tolerance import assert_rounding_close
from pfctl.models.fast import FastPaths, apply_fast_paths
from pfctl.models.fast.products import stacked_linear

FUSED = PLAIN.model_copy(update={"fused_projections": True})
#: linear layers each fused product replaces, per model: (plain layers, fused products). Flux: the double block's
#: image and text q/k/v; each single block's q/k/v, the last one's k/v only (its q reads the tails' rows).
#: MMDiT: two double blocks' image and text q/k/v.
LAYERS = {"flux": (6 + 3 + 3, 2 + 1 + 2), "mmdit": (12, 4)}
PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


class _Products(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # compiled blocks compile under it; their calls are counted
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in PRODUCTS
        return func(*args, **(kwargs or {}))


def test_stacked_linear_is_the_separate_products() -> None:
    """Outputs and the input's, weights' and biases' gradients of the stacked product equal the three
    products' within fp32 rounding (sums of 32 terms; the input's gradient sums three such products)."""
    gen = torch.Generator().manual_seed(0)
    layers = [nn.Linear(32, n) for n in (16, 16, 24)]
    x = torch.randn(2, 5, 32, generator=gen, requires_grad=True)
    grads = [torch.randn(2, 5, layer.out_features, generator=gen) for layer in layers]
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    results = []
    for outs in ([layer(x) for layer in layers], stacked_linear(layers, x)):
        results.append((outs, torch.autograd.grad(outs, [x, *params], grads)))
    (outs, grad), (stacked_outs, stacked_grad) = results
    for got, want in zip([*stacked_outs, *stacked_grad], [*outs, *grad], strict=True):
        assert_rounding_close(got, want, reduction=32, depth=2)
    assert stacked_linear([layers[0]], x) is None  # one layer: nothing to stack


@pytest.mark.parametrize("keep_stack", [True, False])
def test_the_stacked_product_backward_keeps_the_weights_or_their_stack(keep_stack: bool) -> None:
    """Autograd keeps the stacked weights for the input's gradient; :class:`StackedLinear` keeps the weights
    themselves (for weights kept anyway: FSDP2's gathered ones) and gives the same gradients, none for a frozen
    weight."""
    gen = torch.Generator().manual_seed(0)
    layers = [nn.Linear(32, 16) for _ in range(3)]
    layers[1].weight.requires_grad_(False)
    x = torch.randn(2, 5, 32, generator=gen, requires_grad=True)
    grads = [torch.randn(2, 5, 16, generator=gen) for _ in layers]
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        outs = stacked_linear(layers, x, keep_stack)
    params = [layers[0].weight, layers[2].weight, *(layer.bias for layer in layers)]
    got = torch.autograd.grad(outs, [x, *params], grads)
    want = torch.autograd.grad([layer(x) for layer in layers], [x, *params], grads)
    for a, b in zip(got, want, strict=True):
        assert_rounding_close(a, b, reduction=32, depth=2)
    weights = {layer.weight.data_ptr() for layer in layers}
    stacked = [t for t in kept if t.numel() == 3 * 16 * 32]  # the stack or its transposed view
    assert bool(stacked) == keep_stack
    assert {t.data_ptr() for t in kept if t.numel() == 16 * 32} == (set() if keep_stack else weights)


def _step(model: nn.Module, args: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    with _Products() as products, BF16:
        outs = model(**clone_args(args))
        sum(o.float().square().mean() for o in outs).backward()
    return outs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, products.count


def _close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """bf16 autocast: the fused and separate paths round the products' sums at other points (the input's
    gradient once instead of three times and a sum); relative L2 within a few bf16 steps (2^-8)."""
    got, want = got.detach().float(), want.detach().float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    assert err < 2e-2, (msg, err)


@pytest.mark.parametrize("kind", MODELS)
def test_fused_projections_under_autocast_train_like_the_separate_products(kind: str) -> None:
    args, results = inputs(), []
    for kernels in (PLAIN, FUSED):
        model = build(kind).train()
        apply_fast_paths(model, FastPaths(kernels))
        results.append(_step(model, args))
    (outs, grads, plain), (fused_outs, fused_grads, fused) = results
    layers, products = LAYERS[kind]
    assert plain - fused == 3 * (layers - products)  # forward, input gradient, weight gradient
    assert set(fused_grads) == set(grads) == {n for n, _ in build(kind).named_parameters()}
    for i, (a, b) in enumerate(zip(outs, fused_outs, strict=True)):
        _close(b, a, f"output {i}")
    for name, grad in grads.items():
        _close(fused_grads[name], grad, name)


def test_lora_layers_uncast_weights_and_inference_keep_their_own_products() -> None:
    """A projection with a LoRA adapter (peft's layer) leaves its group to the separate products; without
    autocast (weights used as they are: a stacked copy would be kept besides them) and without gradients
    (contiguous q and k for the fused norm + RoPE kernel) every group does."""
    from pfctl.models.lora import add_lora

    args, counts = inputs(), {}
    for kernels in (PLAIN, FUSED):
        model = build("flux").train()
        add_lora(model, rank=2, alpha=2, targets=["attn.to_q"])
        apply_fast_paths(model, FastPaths(kernels))
        lora = _step(model, args)[2]
        with _Products() as fp32:
            sum(o.square().mean() for o in model(**clone_args(args))).backward()
        with _Products() as inference, torch.no_grad(), BF16:
            model(**clone_args(args))
        counts[kernels.fused_projections] = (lora, fp32.count, inference.count)
    # every to_q has an adapter, so two groups fuse, and the frozen base has no weight gradients: the double
    # block's text q/k/v (3 products forward -> 1; its input, below the frozen base, wants no gradient) and the
    # last single block's k/v (2 -> 1, forward and input gradient)
    assert counts[False][0] - counts[True][0] == (3 - 1) + 2 * (2 - 1)
    assert counts[False][1:] == counts[True][1:]


@pytest.mark.slow
def test_half_precision_weights_stack_without_a_kept_copy_compiled_too() -> None:
    """A bf16 model (as FSDP2's bf16 gathers give the blocks): its projections stack through
    :class:`StackedLinear` with three products fewer per fused layer, the separate products' results within
    bf16 rounding, and compiled blocks (``aot_eager``) give the eager ones' gradients with one graph per block
    kind."""
    from torch._dynamo.utils import counters

    args, results = inputs(), {}
    args = {k: v if k == "sample" or not v.is_floating_point() else v.bfloat16() for k, v in args.items()}
    args["sample"] = [[clip.bfloat16() for clip in column] for column in args["sample"]]
    for name, kernels, compiled in (("plain", PLAIN, False), ("fused", FUSED, False), ("compiled", FUSED, True)):
        model = build("flux").bfloat16().train()
        torch._dynamo.reset()
        counters.clear()
        paths = FastPaths(kernels, compile=compiled, compile_backend="aot_eager", independent_sizes=True)
        apply_fast_paths(model, paths)
        with _Products() as products:
            outs = model(**clone_args(args))
            sum(o.float().square().mean() for o in outs).backward()
        results[name] = (outs, {n: p.grad for n, p in model.named_parameters()}, products.count)
    assert counters["stats"]["unique_graphs"] == 3
    torch._dynamo.reset()
    layers, products = LAYERS["flux"]
    assert results["plain"][2] - results["fused"][2] == 3 * (layers - products)
    for name in ("fused", "compiled"):
        for i, (a, b) in enumerate(zip(results["plain"][0], results[name][0], strict=True)):
            _close(b, a, f"{name} output {i}")
        for param, grad in results["plain"][1].items():
            _close(results[name][1][param], grad, f"{name} {param}")
