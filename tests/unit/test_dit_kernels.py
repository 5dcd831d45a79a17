"""The DiTs' elementwise pieces against the reference formulas: the plain layers and the hand-written autograd
Functions the speed layer swaps in (:mod:`pfctl.models.fast.autograd`) give bit-identical outputs and
gradients (CPU, several dtype mixes), and the Functions keep no more for backward than autograd kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers.tolerance import assert_rounding_close
from pfctl.models.attention_layout import MASKED, build_attention_bias, masked_attention
from pfctl.models.dit_layers import ColumnModulation, RMSNorm
from pfctl.models.fast import swap_class
from pfctl.models.fast.autograd import LeanColumnModulation, LeanRMSNorm, Rotary
from pfctl.models.rope import apply_rope, rotary_table

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LENGTHS = [5, 12, 7]  # three columns of a pyramid batch
PATHS = ["plain", "lean"]  # the model's own layers; the speed layer's autograd Functions


class _Lean(LeanColumnModulation, ColumnModulation):
    pass


def columns(path: str) -> ColumnModulation:
    return ColumnModulation() if path == "plain" else _Lean()


def rms_norm(path: str, dim: int) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-6)
    if path == "lean":
        swap_class(norm, LeanRMSNorm)
    return norm


def rope(path: str, x: torch.Tensor, table) -> torch.Tensor:
    return apply_rope(x, table) if path == "plain" else Rotary.apply(x, table.a, table.b, table.a_t, table.b_t)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference RMS norm (with pfctl's cast back to the input dtype)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight.dtype in (FP16, BF16):
        y = y.to(weight.dtype)
    return (y * weight).to(x.dtype)


def plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([c * x0 - s * x1, s * x0 + c * x1], dim=-1).flatten(-2).type_as(x)


def plain_modulate(x, lengths, shift, scale):
    parts = x.split(lengths, dim=1)
    return torch.cat([p * (1 + scale[:, k, None]) + shift[:, k, None] for k, p in enumerate(parts)], dim=1)


def plain_gated_residual(residual, x, lengths, gate):
    parts = x.split(lengths, dim=1)
    return residual + torch.cat([gate[:, k, None] * p for k, p in enumerate(parts)], dim=1)


def outputs_and_grads(fn, inputs: list[torch.Tensor], seed: int = 5) -> list[torch.Tensor]:
    """``fn(*leaves)`` and the gradients of every leaf that requires one, for a fixed random cotangent."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    out.backward(cotangent)
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y), f"tensor {i}: max |diff| {(x.float() - y.float()).abs().max().item()}"


def randn(
    *shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0, grad: bool = True
) -> torch.Tensor:
    t = (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)
    return t.requires_grad_(grad)


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [(FP32, FP32), (BF16, FP32), (BF16, BF16), (FP16, FP16), (FP16, FP32), (FP32, BF16)],
)
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
@pytest.mark.parametrize("weight_trains", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_rms_norm_matches_the_reference_bit_for_bit(x_dtype, w_dtype, scale, weight_trains, path) -> None:
    norm = rms_norm(path, 64)
    weight = (1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(1))).to(w_dtype)
    inputs = [randn(2, 9, 3, 64, dtype=x_dtype, scale=scale), weight.requires_grad_(weight_trains)]
    assert_bitwise(
        outputs_and_grads(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), inputs),
        outputs_and_grads(lambda x, w: plain_rms_norm(x, w, 1e-6), inputs),
    )


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("path", PATHS)
def test_rope_matches_the_reference_bit_for_bit(dtype: torch.dtype, path: str) -> None:
    seq = 11
    angles = torch.rand(seq, 16, generator=torch.Generator().manual_seed(2)) * 50
    angles[:3] = 0  # identity rows, as the text tokens of the single-stream layout
    cos, sin = angles.cos(), angles.sin()
    table = rotary_table(cos, sin)
    inputs = [randn(2, seq, 3, 32, dtype=dtype)]
    assert_bitwise(
        outputs_and_grads(lambda x: rope(path, x, table), inputs),
        outputs_and_grads(lambda x: plain_rope(x, cos, sin), inputs),
    )


# autocast training: fp32 layer-norm output, bf16 modulation; bf16 generation; fp32 parity
@pytest.mark.parametrize(("x_dtype", "mod_dtype"), [(FP32, BF16), (BF16, BF16), (FP32, FP32)])
@pytest.mark.parametrize("lengths", [LENGTHS, [17]])
@pytest.mark.parametrize("path", PATHS)
def test_modulate_columns_matches_per_column_formula(x_dtype, mod_dtype, lengths, path) -> None:
    k = len(lengths)
    inputs = [
        randn(2, sum(lengths), 16, dtype=x_dtype, seed=0),
        randn(2, k, 16, dtype=mod_dtype, scale=0.3, seed=1),
        randn(2, k, 16, dtype=mod_dtype, scale=0.3, seed=2),
    ]
    assert_bitwise(
        outputs_and_grads(lambda x, b, s: columns(path).modulate_columns(x, lengths, b, s), inputs),
        outputs_and_grads(lambda x, b, s: plain_modulate(x, lengths, b, s), inputs),
    )


# bf16 residual stream (Flux under autocast), fp32 residual with a bf16 branch (MMDiT), all fp32
@pytest.mark.parametrize(("res_dtype", "x_dtype"), [(BF16, BF16), (FP32, BF16), (FP32, FP32)])
@pytest.mark.parametrize("lengths", [LENGTHS, [17]])
@pytest.mark.parametrize("path", PATHS)
def test_gated_residual_matches_per_column_formula(res_dtype, x_dtype, lengths, path) -> None:
    inputs = [
        randn(2, sum(lengths), 16, dtype=res_dtype, seed=0),
        randn(2, sum(lengths), 16, dtype=x_dtype, seed=1),
        randn(2, len(lengths), 16, dtype=x_dtype, scale=0.3, seed=2),
    ]
    assert_bitwise(
        outputs_and_grads(lambda r, x, g: columns(path).gated_residual(r, x, lengths, g), inputs),
        outputs_and_grads(lambda r, x, g: plain_gated_residual(r, x, lengths, g), inputs),
    )


def saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("modulation_trains", [True, False])
def test_modulation_keeps_no_more_than_autograd(modulation_trains: bool) -> None:
    """A frozen modulation (LoRA) must not keep the full-size input that only its gradient needs."""
    x = randn(2, sum(LENGTHS), 64, dtype=FP32)
    shift = randn(2, 3, 64, dtype=BF16, grad=modulation_trains, seed=1)
    scale = randn(2, 3, 64, dtype=BF16, grad=modulation_trains, seed=2)
    assert saved_bytes(lambda: _Lean().modulate_columns(x, LENGTHS, shift, scale)) <= saved_bytes(
        lambda: plain_modulate(x, LENGTHS, shift, scale)
    )


def test_rms_norm_keeps_less_than_autograd() -> None:
    x, weight = randn(2, 9, 3, 64, dtype=BF16), torch.ones(64, requires_grad=True)
    norm = rms_norm("lean", 64)
    fused = saved_bytes(lambda: norm(x))
    assert fused < saved_bytes(lambda: plain_rms_norm(x, weight, 1e-6))
    assert fused <= x.nbytes + x[..., :1].float().nbytes + weight.nbytes  # x, rstd and the weight only


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_lean_norm_and_rotation_traced_by_dynamo_give_the_eager_gradients(dtype: torch.dtype) -> None:
    """The lean RMS norm and rotation as the compiled blocks run them (traced by Dynamo with dynamic sizes and
    ``specialize_float``; ``aot_eager``: AOTAutograd's graphs run as they are) give the eager outputs and the
    gradients of both norms' weights and of what feeds them. Torch 2.11 lost every gradient through the norm
    while its output came from ``out=`` (benchmarks/RESULTS.md, session 36); this checks the torch at hand."""
    torch.manual_seed(0)
    angles = torch.rand(9, 8) * 20
    table = rotary_table(angles.cos(), angles.sin())
    norms = [rms_norm("lean", 16).to(dtype) for _ in range(2)]
    proj = torch.nn.Linear(32, 32).to(dtype)

    def qk(x: torch.Tensor) -> torch.Tensor:  # a block's queries and keys: norm, then rotate
        h = proj(x).unflatten(-1, (2, 16))
        return sum(rope("lean", n(h * (k + 1)), table) for k, n in enumerate(norms)).float().square().sum()

    params = [proj.weight, proj.bias, *(n.weight for n in norms)]
    x = randn(2, 9, 32, dtype=dtype)
    results = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        for fn in (qk, torch.compile(qk, backend="aot_eager", dynamic=True)):
            loss = fn(x)
            results.append([loss.detach(), *torch.autograd.grad(loss, params)])
    torch._dynamo.reset()
    for name, eager, compiled in zip(["loss", "proj.weight", "proj.bias", "norm0", "norm1"], *results, strict=True):
        assert compiled.abs().max() > 0, name
        assert_rounding_close(compiled.float(), eager.float(), reduction=32 * 18, depth=2, msg=name)


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize(("text_len", "image_len"), [(3, 5), (300, 500)])
def test_attention_bias_matches_the_boolean_mask_bit_for_bit(dtype, text_len, image_len) -> None:
    """Long case: text-padding queries see only the last few text keys, so whole leading key blocks of the
    fused kernel are masked for them (where a -inf bias needs care and a finite one must rescale to 0)."""
    valid = torch.tensor([text_len, text_len - 1, 2, text_len - 3])  # K=2 columns, Bc=2, interleaved rows
    text_valid = torch.arange(text_len)[None] < valid[:, None]
    frames = [torch.arange(image_len) // 4, torch.arange(image_len) // 7]
    biases = build_attention_bias(text_valid, frames, 2, temporal_causal=True, dtype=dtype)
    for k, bias in enumerate(biases):
        size = text_len + image_len
        assert bias.shape == (2, 1, size, size) and bias.dtype == dtype
        assert all(stride % 8 == 0 for stride in bias.stride()[:-1])  # memory-efficient kernel alignment
        allowed = bias == 0
        assert torch.equal(bias, torch.where(allowed, 0.0, MASKED).to(dtype))
        assert allowed.diagonal(dim1=-2, dim2=-1).all()
        assert torch.equal(
            allowed[:, 0, text_len:, text_len:], (frames[k][:, None] >= frames[k][None]).expand(2, -1, -1)
        )

        q, kk, v = (randn(2, size, 2, 8, dtype=dtype, scale=3.0, seed=s) for s in range(3))
        fused = outputs_and_grads(lambda a, b, c, bias=bias: masked_attention(a, b, c, bias), [q, kk, v])
        plain = outputs_and_grads(
            lambda a, b, c, mask=allowed: (
                F.scaled_dot_product_attention(
                    a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), attn_mask=mask
                )
                .transpose(1, 2)
                .flatten(2)
            ),
            [q, kk, v],
        )
        assert_bitwise(fused, plain)


_FUSED_QK_CHECK = """
import torch
import pfctl.models.fast.qk_norm_rope  # registers pfctl::rms_norm_rope
from pfctl.models.dit_layers import RMSNorm
from pfctl.models.rope import apply_rope, rope_tables, rotary_table
torch.manual_seed(0)
worst = 0.0
for b, s, h, hd in [(2, 37, 3, 64), (1, 5, 2, 16), (3, 11, 30, 64)]:  # rows that do not fill a program too
    norm = RMSNorm(hd, eps=1e-6).half()
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    pos = torch.stack([torch.randint(0, 9, (s,)), torch.randint(0, 20, (s,)), torch.randint(0, 30, (s,))], 1)
    table = rotary_table(*rope_tables(pos.float(), [hd // 4, hd // 8 * 3, hd // 8 * 3]))
    x = (torch.randn(b, s, h, hd) * 3 + 0.5).half()
    with torch.no_grad():
        want = apply_rope(norm(x), table).float()
        got = torch.ops.pfctl.rms_norm_rope(x, norm.weight, table.a, table.b, norm.eps).float()
    assert got.shape == want.shape
    # the same rounding steps: equal but where the sum of squares' order moves a rounding by one step
    assert (got == want).float().mean() > 0.999
    worst = max(worst, ((got - want).abs() / want.abs().clamp_min(1.0)).max().item())
print(worst)
"""


def test_fused_qk_norm_rope_kernel_in_the_triton_interpreter() -> None:
    """The Triton kernel that norms and rotates q/k on CUDA (``pfctl::rms_norm_rope``), run on CPU by
    Triton's interpreter against ``apply_rope(RMSNorm(x))``: float16, because the interpreter truncates
    float32 -> bfloat16 conversions where the GPU rounds (bfloat16 is checked on CUDA in test_fast_paths)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _FUSED_QK_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) < 2.5e-3  # two float16 rounding steps at most


@pytest.mark.parametrize("norm_kind", ["rms", "none"])
@pytest.mark.parametrize("with_table", [True, False])
def test_norm_rope_off_cuda_is_the_two_steps(norm_kind: str, with_table: bool) -> None:
    """Off CUDA (and with gradients) the fused ``norm_rope`` is the norm then the rotation, bit for bit."""
    from pfctl.models.dit_layers import AttentionOps
    from pfctl.models.fast.qk_norm_rope import FusedQKRope
    from pfctl.models.rope import rope_tables

    class Fused(FusedQKRope, AttentionOps):
        pass

    torch.manual_seed(0)
    x = torch.randn(2, 6, 3, 16, dtype=BF16, requires_grad=True)
    norm = RMSNorm(16, eps=1e-6).to(BF16) if norm_kind == "rms" else None
    table = rotary_table(*rope_tables(torch.arange(18.0).view(6, 3), [4, 6, 6])) if with_table else None
    want = x if norm is None else norm(x)
    want = want if table is None else apply_rope(want, table)
    got = Fused().norm_rope(x, norm, table)
    assert torch.equal(got, want)
    got.float().sum().backward()  # the gradient flows through the PyTorch path
    assert x.grad is not None


def _linear(d_in: int, d_out: int, dtype: torch.dtype, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(d_in, d_out).to(dtype)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def test_fused_concat_linear_is_the_product_of_the_concatenation(monkeypatch) -> None:
    """``linear(cat(parts))`` summed part by part over the weight's column slices (``fused_linear``, forced
    on for CPU float32) agrees with the PyTorch ops to float32 rounding: only the summation order differs.
    (The GELU epilogue is CUDA's own -- the CPU's ``_addmm_activation`` takes the exact GELU -- and is
    checked in test_fast_paths.)"""
    from pfctl.models.fast import products as fused_linear

    monkeypatch.setattr(fused_linear, "applies", lambda linear, x: True)
    x, act = torch.randn(2, 7, 24), torch.randn(2, 7, 96)
    out = _linear(24 + 96, 24, FP32, 2)
    with torch.no_grad():
        got = fused_linear.concat_linear(out, [x, act])
        assert_rounding_close(got, out(torch.cat([x, act], -1)), reduction=24 + 96)
        assert got.shape == (2, 7, 24)
        with pytest.raises(ValueError, match="do not make 120"):
            fused_linear.concat_linear(out, [x, act[..., :48]])


def test_fused_linear_off_cuda_is_the_pytorch_ops() -> None:
    """Off CUDA, and with gradients, the fused products' functions are the PyTorch ops, bit for bit (the
    CUDA side, LoRA layers left alone included, is checked in test_fast_paths)."""
    from pfctl.models.fast import products as fused_linear

    layer = _linear(16, 64, BF16, 0)
    x = torch.randn(3, 16, dtype=BF16, requires_grad=True)
    assert not fused_linear.applies(layer, x.detach())
    got = fused_linear.linear_gelu(layer, x)
    assert torch.equal(got, F.gelu(layer(x), approximate="tanh"))
    parts = [x, got]
    out = _linear(80, 16, BF16, 3)
    assert torch.equal(fused_linear.concat_linear(out, parts), out(torch.cat(parts, -1)))
    fused_linear.concat_linear(out, parts).float().sum().backward()
    assert x.grad is not None
