"""Python's cyclic garbage collector during training, collected at known points (as torchtitan does).

Compiling the blocks leaves millions of Python objects alive (graphs, guards, symbolic sizes), and recording
CUDA graphs allocates many more. Python's automatic collection then runs full passes over all of them at
moments its allocation counters pick: inside the compilation, inside a recording, or in the middle of a
steady step, where one pass stalls the launch of the step's kernels. :class:`Collector` turns the
automatic collection off for the run and collects at step boundaries instead: everything once when the
warm-up ends (the compilation's garbage), then the young objects every ``every`` steps. Reference counting
still frees every object that is not part of a cycle the moment it is dropped, tensors included.
"""

from __future__ import annotations

import gc

__all__ = ["Collector"]


class Collector:
    """``every`` > 0: automatic collection off until :meth:`close` (which restores it); :meth:`after_step`
    collects at step boundaries. ``every`` = 0: Python's own automatic collection, untouched."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.settled = False  # the full collection after the warm-up is done
        self.restore = every > 0 and gc.isenabled()
        if every > 0:
            gc.disable()

    def after_step(self, step: int, warm: bool) -> int:
        """After optimizer step ``step``; ``warm``: the warm-up is over (nothing left to compile or record).
        The first warm step collects every generation, later ones the young generations every ``every``
        steps. Returns the number of unreachable objects found (0 where nothing was collected)."""
        if self.every <= 0:
            return 0
        if warm and not self.settled:
            self.settled = True
            return gc.collect()
        if step % self.every == 0:
            return gc.collect(1)
        return 0

    def close(self) -> None:
        """Automatic collection back as it was; idempotent."""
        if self.restore:
            gc.enable()
        self.restore, self.every = False, 0
