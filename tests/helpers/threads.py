"""One CPU thread for the embedded model's runs in the tests.

Its tensors are small (a 64x64 video is 64 tokens a frame), so a second OpenMP thread has little work to
share; where the cores are busy with other processes the threads wait on each other and a video takes many
times as long. On an idle machine one thread is as fast as two; the outputs differ only by float rounding.
A child process gets the same with ``OMP_NUM_THREADS=1`` in its environment, as the other tests' children do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
