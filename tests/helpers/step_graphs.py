"""The step's CUDA graphs (:class:`pfctl.training.step_graphs.StepGraphs`) on the CPU, which has no CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pfctl.models.fast.cuda_graph import flatten_tensors
from pfctl.training.step_graphs import StepGraphs


def replaying_capture(self: StepGraphs, work: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """:meth:`StepGraphs.capture` on the CPU, doing what a CUDA graph does to the tensors: the work runs once to
    make its outputs, and the gradients it added are taken back (a recording runs nothing); a replay runs it
    again on the recording's input buffers and copies its outputs into those."""
    saved = [p.grad.clone() for p in self.parameters]
    out = work()
    for p, grad in zip(self.parameters, saved, strict=True):
        p.grad.copy_(grad)
    outputs, _ = flatten_tensors(out)

    def replay() -> None:
        fresh, _ = flatten_tensors(work())
        for static, value in zip(outputs, fresh, strict=True):
            static.copy_(value)

    return replay, out
