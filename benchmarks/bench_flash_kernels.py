"""The mask-free attention calls of ``skip_future_keys`` on each kernel: which one should they run on?

With row groups, a group of one frame attends the frame's rows against its causal key prefix (the item's
valid text, then every frame up to its own) with no mask: a plain attention call. Those calls carry most of a
768p training step's attention work. This times them (miniFLUX: 30 heads x 64, bf16, ``[B, S, H, D]``
tensors as the DiT holds them), forward and forward+backward, on:

* ``fa2``: SDPA's flash kernel (what pfctl's training runs them on);
* ``cudnn``: SDPA's cuDNN kernel;
* ``efficient``: SDPA's memory-efficient kernel (what the masked calls run on);
* ``fa4``: FlashAttention 4 (the ``flash-attn-4`` package, CuTe DSL kernels for Hopper and Blackwell), when it
  is importable; not a pfctl dependency.

Before the table: each kernel's largest error against fp32 attention (output and gradients), the FA4 kernels'
first-call (compilation) times, and the host's cost of one small call.

    python benchmarks/bench_flash_kernels.py --json flash_kernels.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 30, 64
#: (items, query rows: one frame, keys: 128 text tokens and the frames up to the query's) of the 768p
#: recipe's columns: full-resolution frames (3,840 tokens) and the lower stages' (960 and 240)
SHAPES = [(2, 3840, 3840 + 128), (2, 3840, 4 * 3840 + 128), (2, 3840, 8 * 3840 + 128), (2, 960, 8 * 960 + 128),
          (4, 240, 13 * 240 + 128), (4, 960, 13 * 240 + 2 * 960 + 128)]  # fmt: skip
#: the errors' shape: fp32 attention on the math kernel holds its scores whole (7 GiB here)
ERROR_SHAPE = (2, 3840, 2 * 3840 + 128)

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(backend: SDPBackend) -> Attention:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

    return attend


def kernels() -> dict[str, Attention]:
    found = {
        "fa2": sdpa(SDPBackend.FLASH_ATTENTION),
        "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        print("fa4: flash-attn-4 is not importable here; left out")
        return found
    found["fa4"] = lambda q, k, v: flash_attn_func(q, k, v)[0]
    return found


def tensors(items: int, rows: int, keys: int, gen: torch.Generator) -> list[torch.Tensor]:
    shape = [(items, n, HEADS, HEAD_DIM) for n in (rows, keys, keys)]
    return [
        torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for s in shape
    ]


def run(attend: Attention, qkv: list[torch.Tensor], grad: torch.Tensor, backward: bool) -> None:
    out = attend(*qkv)
    if backward:
        torch.autograd.grad(out, qkv, grad)


def first_call_seconds(attend: Attention, qkv: list[torch.Tensor], backward: bool) -> float:
    torch.cuda.synchronize()
    tic = time.perf_counter()
    run(attend, qkv, torch.randn_like(qkv[0]), backward)
    torch.cuda.synchronize()
    return time.perf_counter() - tic


def milliseconds(attend: Attention, qkv: list[torch.Tensor], backward: bool, repeats: int) -> float:
    grad = torch.randn_like(qkv[0])
    run(attend, qkv, grad, backward)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run(attend, qkv, grad, backward)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def errors(found: dict[str, Attention], gen: torch.Generator) -> dict[str, list[float]]:
    """Per kernel: the largest absolute error of the output and of dq, dk, dv against fp32 attention."""
    qkv = tensors(*ERROR_SHAPE, gen)
    grad = torch.randn_like(qkv[0])
    exact = [t.detach().float().requires_grad_() for t in qkv]
    ref = sdpa(SDPBackend.MATH)(*exact)
    ref_grads = torch.autograd.grad(ref, exact, grad.float())
    result = {}
    for name, attend in found.items():
        out = attend(*qkv)
        grads = torch.autograd.grad(out, qkv, grad)
        pairs = [(out, ref), *zip(grads, ref_grads, strict=True)]
        result[name] = [float((a.float() - b).abs().max()) for a, b in pairs]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    found = kernels()
    if "fa4" in found:  # its kernels compile at their first call
        for backward in (False, True):
            seconds = first_call_seconds(found["fa4"], tensors(*SHAPES[0], gen), backward)
            print(f"fa4 first call ({'forward+backward' if backward else 'forward'}): {seconds:.1f} s")
    errs = errors(found, gen)
    for name, e in errs.items():
        print(f"error against fp32, {name}: out {e[0]:.2e}  dq {e[1]:.2e}  dk {e[2]:.2e}  dv {e[3]:.2e}")
    small = tensors(1, 256, 512, gen)
    host = {}
    with torch.no_grad():
        for name, attend in found.items():
            attend(*small)
            torch.cuda.synchronize()
            tic = time.perf_counter()
            for _ in range(50):
                attend(*small)
            host[name] = (time.perf_counter() - tic) / 50 * 1e3
            torch.cuda.synchronize()
    print("host per small forward call (ms): " + "  ".join(f"{n} {t:.3f}" for n, t in host.items()))
    rows, total = [], dict.fromkeys(found, 0.0)
    print(f"{'items':>5} {'rows':>5} {'keys':>6} | " + " | ".join(f"{n:>9} fwd / f+b ms" for n in found))
    for shape in SHAPES:
        qkv = tensors(*shape, gen)
        times = {n: (milliseconds(a, qkv, False, args.repeats), milliseconds(a, qkv, True, args.repeats))
                 for n, a in found.items()}  # fmt: skip
        for n, (_, both) in times.items():
            total[n] += both
        rows.append({"shape": shape, **{n: list(t) for n, t in times.items()}})
        print(f"{shape[0]:5d} {shape[1]:5d} {shape[2]:6d} | "
              + " | ".join(f"{f:9.2f} / {b:6.2f}   " for f, b in times.values()))  # fmt: skip
    print("sum of forward+backward (ms): " + "  ".join(f"{n} {t:.2f}" for n, t in total.items()))
    if args.json:
        args.json.write_text(
            json.dumps({"errors": errs, "host_ms": host, "rows": rows, "total_ms": total}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
