"""What cuDNN's attention costs the host the first time it meets a shape, and whether threads share it.

Usage on a GPU: ``python benchmarks/probe_cudnn_plans.py``. SDPA with cuDNN's kernel, bf16, 30 heads x 64
(miniFLUX), an additive mask as in training; for each call, the first forward and backward of a shape, on the
main thread or on a thread of its own (the backward runs on the autograd thread either way). PyTorch keeps
cuDNN's plans per thread; the table shows which part of the cost a thread's earlier call saves another.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (tokens, where it runs, what the call shows)
CALLS = [
    (4000, "main", "first shape"),
    (4000, "main", "same shape again"),
    (4100, "main", "new shape"),
    (4200, "thread", "new shape"),
    (4200, "main", "the shape that thread built"),
    (4300, "thread", "new shape"),
    (4300, "thread", "another thread, same shape"),
    (4400, "main", "new shape"),
    (4400, "thread", "the shape main built"),
    (4480, "main", "new shape, a multiple of 64"),
]


def first_call(n: int) -> tuple[float, float]:
    """Seconds of the forward and of the backward of one masked cuDNN attention over ``n`` tokens."""
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (
        torch.randn(1, 30, n, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    )
    mask = torch.zeros(1, 1, n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out.sum().backward()
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    print(f"{'tokens':>6}  {'thread':6}  {'forward ms':>10}  {'backward ms':>11}  call")
    for n, where, what in CALLS:
        result: list[tuple[float, float]] = []
        if where == "main":
            result.append(first_call(n))
        else:
            worker = threading.Thread(target=lambda n=n, into=result: into.append(first_call(n)))
            worker.start()
            worker.join()
        fwd, bwd = result[0]
        print(f"{n:>6}  {where:6}  {fwd * 1e3:>10.1f}  {bwd * 1e3:>11.1f}  {what}")


if __name__ == "__main__":
    main()
