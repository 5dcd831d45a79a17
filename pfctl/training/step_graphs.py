"""A training step's forward and backward replayed as one CUDA graph per distinct input (``train.cuda_graphs:
step``).

A forward of the pyramid DiT meets a small, known set of inputs per rank (the trainer's log lists them: one
per clip bucket and unit position). For each, the whole of what a micro-step (or a step of merged
micro-batches) launches, the embedders, every block forward and backward (compiled or not, checkpointed or
not) and the loss, is recorded once as a CUDA graph; from then on that input costs the host a copy of the
batch into the graph's input buffers and one launch, and the step takes what the GPU needs.

How an input is met:

1. the first time it runs eagerly, as without graphs: compiled blocks compile for it, the libraries plan
   their kernels, and the step gets its loss and gradients;
2. right after, its forward and backward are recorded on a side stream (nothing runs: the recording only
   notes the launches), over input buffers of its own, into one memory pool every graph shares (the graphs
   never run at the same time, and their intermediates are dead when each ends);
3. every later time, the batch is copied into those buffers and the graph replayed.

What a recording relies on: the gradients exist before it, as tensors the trainer keeps (every replay writes
into the same ones); the work depends on nothing but the tensors it is given and the weights (no host
synchronisation, no randomness, no collective); and its outputs are read before the next replay overwrites
them (the trainer adds them to the step's totals at once, on the same stream). A recording that fails (an
operation that cannot be recorded) is reported once, and every input runs eagerly from then on.

The first micro-batch of a step replaces the gradients rather than adding to them (``fresh``): the trainer
does not zero them after an update. Where each input always comes at the same position in a step
(:func:`records_first_apart`), the first micro-batch is recorded replacing them: each parameter's gradient is
made anew, as without graphs, and copied into its tensor as soon as it is made (a hook after its
accumulation), which frees it at once; a parameter the loss does not reach is zeroed. That is one pass over
the gradients instead of two (zeroing them, then adding into the zeros). Elsewhere an input could come first
in one step and later in another, and would be recorded twice: there the gradients are zeroed before the
first micro-batch, outside the graphs, and every micro-batch adds.

With several processes (data parallel) each records its own inputs, and no collective is recorded: the
DiT runs without its DDP wrapper, the gradients live in one buffer per dtype (:func:`gradient_buffers`),
and after a step's last micro-batch the processes average them in one collective per buffer
(:func:`average_gradients`), as DDP would have (each divided by the world size, then summed), only not
overlapped with the backward.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pfctl.models.fast.cuda_graph import flatten_tensors, record_graph, signature, unflatten_tensors
from pfctl.runtime import logging as pflog

if TYPE_CHECKING:
    from pfctl.config.train import TrainConfig

__all__ = ["StepGraphs", "average_gradients", "gradient_buffers", "records_first_apart"]


@dataclass
class _Recorded:
    """One input's graph: the buffers it reads and the outputs it writes."""

    replay: Callable[[], None]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    out_spec: Any


class StepGraphs:
    """Runs ``work(*args)`` (a forward and its backward, returning detached tensors) eagerly at each new input
    signature (tensor shapes, dtypes and devices, and every non-tensor argument), records it right after, and
    replays the recording at that signature from then on.

    ``parameters``: those the work computes gradients for, holding the gradient tensors the recordings write
    into (:func:`gradient_buffers`); a replay checks that they still hold those (a gradient set to None and
    made anew would leave the graphs writing into freed memory).

    ``first_apart``: a step's first micro-batch is recorded apart, replacing the gradients (else they are
    zeroed before it, and it adds).

    Counts for the log: ``calls``, ``recorded`` graphs, ``replays``, ``recording_s`` (host seconds spent recording);
    ``failure``: why recording stopped (every call eager since), or None."""

    def __init__(
        self, device: torch.device, parameters: list[torch.nn.Parameter], first_apart: bool = True
    ) -> None:
        self.device, self.first_apart = device, first_apart
        self.calls = self.replays = 0
        self.recording_s = 0.0
        self.failure: str | None = None
        self._graphs: dict[tuple, _Recorded] = {}
        self._into = {p: p.grad for p in parameters}  # the gradient tensors the recordings write into
        if any(grad is None for grad in self._into.values()):
            raise ValueError("the step's CUDA graphs need the gradients made first (gradient_buffers)")
        self._fresh = False  # inside a call whose gradients replace the kept ones
        if first_apart:
            for p in parameters:
                p.register_post_accumulate_grad_hook(self._keep)
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the work computes gradients for (those of the kept gradient tensors)."""
        return list(self._into)

    @property
    def recorded(self) -> int:
        return len(self._graphs)

    def __call__(self, work: Callable[..., Any], *args: Any, fresh: bool = False) -> Any:
        """``work(*args)``, eagerly at a new signature (then recorded), else replayed. ``fresh``: its
        gradients replace those the parameters hold (a step's first micro-batch) instead of adding to them."""
        self.calls += 1
        if fresh and not self.first_apart:  # (outside the graphs: every recording adds)
            torch._foreach_zero_(list(self._into.values()))
        fresh = fresh and self.first_apart
        leaves, spec = flatten_tensors(args)
        key = (signature(leaves, spec), fresh)
        if fresh:
            work = functools.partial(self._replacing, work)
        entry = self._graphs.get(key)
        if entry is not None:
            if any(p.grad is not grad for p, grad in self._into.items()):
                raise RuntimeError(
                    "the step's CUDA graphs write into gradient tensors that were replaced since they were "
                    "recorded: keep them (zero them in place: optimizer.zero_grad(set_to_none=False))"
                )
            torch._foreach_copy_(entry.inputs, leaves)
            entry.replay()
            self.replays += 1
            return unflatten_tensors(entry.out_spec, entry.outputs)
        out = work(*args)
        if self.failure is None:
            tic = time.perf_counter()
            self._record(key, work, leaves, spec)
            self.recording_s += time.perf_counter() - tic
        return out

    def summary(self) -> str:
        """One clause for the log: graphs recorded and the host time it took, or why recording stopped."""
        if self.failure is not None:
            return f"CUDA graphs of the step: recording failed ({self.failure}); eager steps"
        return f"CUDA graphs of the step: {self.recorded} recorded in {self.recording_s:.1f} s"

    def _record(self, key: tuple, work: Callable[..., Any], leaves: list[torch.Tensor], spec: Any) -> None:
        """Record ``work`` over copies of ``leaves`` (:meth:`capture`); a failure stops recording for good."""
        inputs = [t.detach().clone() for t in leaves]
        try:
            replay, out = self.capture(lambda: work(*unflatten_tensors(spec, inputs)))
        except RuntimeError as err:  # an operation that cannot be recorded: eager from now on
            first_line = str(err).splitlines()[0] if str(err) else ""
            self.failure = f"{type(err).__name__}: {first_line}"
            self._graphs.clear()
            pflog.warn(f"CUDA graphs of the step: recording failed{_where(err)} ({self.failure}); eager steps")
            return
        outputs, out_spec = flatten_tensors(out)
        self._graphs[key] = _Recorded(replay, inputs, outputs, out_spec)

    def _replacing(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` with every gradient made anew and copied into its kept tensor (:meth:`_keep`); the
        kept tensor of a parameter the loss does not reach is zeroed."""
        for p in self._into:
            p.grad = None
        self._fresh = True
        try:
            out = work(*args)
        except BaseException:  # (no kernel after a failed recording: only the tensors are put back)
            for p, grad in self._into.items():
                p.grad = grad
            raise
        finally:
            self._fresh = False
        for p, grad in self._into.items():
            if p.grad is None:
                grad.zero_()
                p.grad = grad
        return out

    def _keep(self, param: torch.nn.Parameter) -> None:
        """After ``param``'s gradient is accumulated: inside a fresh call, a gradient made anew is copied into
        the kept tensor, which takes its place (the new one is freed at once)."""
        grad = self._into[param]
        if self._fresh and param.grad is not grad:
            grad.copy_(param.grad)
            param.grad = grad

    def capture(self, work: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        """Record ``work()`` as a CUDA graph on the side stream, in the shared pool
        (:func:`pfctl.models.fast.cuda_graph.record_graph`): the graph's replay and the outputs it writes. The
        batch feed's thread may use the GPU meanwhile: the recording checks this thread's calls only."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        out = record_graph(graph, self._stream, self._pool, work, capture_error_mode="thread_local")
        return graph.replay, out


def _where(err: BaseException) -> str:
    """`` at FILE:LINE`` of the last of pfctl's own frames an error passed through (where the work did what
    cannot be recorded), or nothing."""
    line = pflog.own_line(traceback.extract_tb(err.__traceback__), skip=("step_graphs.py",))
    return f" at {line}" if line else ""


def records_first_apart(train: TrainConfig) -> bool:
    """Whether every distinct input a rank builds (:func:`pfctl.training.plan.token_count_sets`) always
    comes at the same position in a step, so that recording a step's first micro-batch apart records no input
    twice: one forward a step (one micro-batch, or all merged), or the temporal pyramid's unit positions
    cycling in whole steps (``grad_accum`` divides ``max_units / video_sync_group``: the position picks the
    units). Without the pyramid, an input is a clip bucket, at any position."""
    if train.grad_accum == 1 or train.merge_micro_batches is True:
        return True
    turns = train.max_units // train.video_sync_group
    return train.use_temporal_pyramid and turns % train.grad_accum == 0


def gradient_buffers(parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Zeroed gradients for ``parameters``, each a view of one buffer per dtype (the buffers returned, in the
    order of the parameters' first dtype): what the CUDA graphs write into, replay after replay, and what
    several processes average with one collective per buffer."""
    buffers = []
    for dtype in dict.fromkeys(p.dtype for p in parameters):
        group = [p for p in parameters if p.dtype == dtype]
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
        offset = 0
        for p in group:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        buffers.append(flat)
    return buffers


def average_gradients(buffers: list[torch.Tensor], world_size: int) -> None:
    """Every process's gradients replaced by their mean across the processes, in place: each divided by the
    world size, then summed (DDP's order of operations)."""
    import torch.distributed as dist

    for flat in buffers:
        flat.div_(world_size)
        dist.all_reduce(flat)
