"""The step's CUDA graphs (:class:`pfctl.training.step_graphs.StepGraphs`) on the CPU, which has no CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pfctl.config.train import TrainConfig, TrainSpeed
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


class Unrecorded:
    """What :func:`pfctl.models.fast.cuda_graph.record_graph` needs of a CUDA graph, on the CPU: a recording
    that notes nothing, so the work runs as it is."""

    def capture_begin(self, *args: Any, **kwargs: Any) -> None: ...
    def capture_end(self) -> None: ...


def eager_speed(graphs: bool | str, merged: bool) -> Callable[..., TrainSpeed]:
    """A stand-in for the trainer's ``resolve_train_speed``: eager blocks, efficient attention, the config's
    FSDP, ``graphs`` as ``train.cuda_graphs`` (``"step"`` on the CPU, by hand) and ``merged`` micro-batches."""

    def speed(train: TrainConfig, *_: Any) -> TrainSpeed:
        return TrainSpeed(False, graphs, "efficient", train.fsdp, merge_micro_batches=merged)

    return speed
