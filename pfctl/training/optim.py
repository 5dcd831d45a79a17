"""The optimizer (AdamW | SGD with momentum | Adafactor; decay on matrices only), the gradients' norm and
clipping, and the LR schedule (linear warmup → constant | cosine).

Optimizer state per trainable parameter, fp32 (what ``train.optimizer`` buys):

* ``adamw`` — exp_avg + exp_avg_sq: 8 bytes per parameter;
* ``sgd_momentum`` — one momentum buffer: 4 bytes;
* ``adafactor`` — transformers' Adafactor without first moment (``beta1=None``) and with a factored
  second moment: a matrix m x n keeps a row and a column vector (4·(m + n) bytes instead of 8·m·n),
  vectors keep a full second moment (4 bytes per entry). ``relative_step`` and ``scale_parameter``
  are off, so ``train.lr`` and the schedule mean what they mean for AdamW.

The schedule is a pure function of the optimizer step (:func:`lr_at`), so a resumed run
needs nothing but the step to continue on the same curve; the ``LambdaLR`` wrapper exists
so accelerate and checkpoints see a standard scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from pfctl.config.train import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices, and biases / 1-D parameters (norm scales) without decay.

    Decaying a norm scale or a bias pulls it towards 0, which changes what the layer computes
    rather than regularising it; the reference (and most transformer recipes) exempt them.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``train.optimizer`` over :func:`param_groups` (trainable parameters only: with LoRA, the adapters).

    The trainable parameters are fp32 (master weights), so every state is fp32 too.
    """
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd_momentum":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            groups, lr=cfg.lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
            scale_parameter=False, relative_step=False, warmup_init=False,
        )  # fmt: skip
    # one fused kernel per step on the GPU (foreach on the CPU); same update, fewer passes over memory
    fused = all(p.is_cuda for group in groups for p in group["params"]) or None
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """The total 2-norm of the parameters' gradients, as ``clip_grad_norm_`` computes it: (the norm to clip
    with, the whole model's norm as a plain tensor). With sharded gradients (FSDP2's DTensors) the first is a
    DTensor and the second its full value, the same on every process (a collective); otherwise they are one."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    return norm, (norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


#: How far under ``max_norm`` a norm must be for :func:`clip_gradients` to leave the gradients alone: far more
#: than fp32 rounds ``clip_grad_norm_``'s factor by, so that factor is exactly 1 there.
CLIP_MARGIN = 2.0**-16


def clip_gradients(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, norm: torch.Tensor, norm_value: float
) -> bool:
    """Scale the gradients by ``clip_grad_norm_``'s factor ``min(1, max_norm / (norm + 1e-6))`` where it can be
    under 1, as the host's copy of the norm (``norm_value``, read with the step's other numbers) shows. Elsewhere
    the factor is exactly 1, and the pass over every gradient (a read and a write of each) is left out: the
    gradients are those ``clip_grad_norm_`` would leave. ``norm``: the norm to clip with
    (:func:`gradient_norm`). Returns whether it scaled."""
    if not norm_value + 1e-6 > max_norm * (1 - CLIP_MARGIN):
        return False
    torch.nn.utils.clip_grads_with_norm_(list(parameters), max_norm, norm)
    return True


def optimizer_state_bytes(shape: tuple[int, ...], optimizer: str) -> int:
    """Bytes of fp32 optimizer state one parameter of ``shape`` costs (see the module docstring)."""
    numel = 1
    for n in shape:
        numel *= n
    if optimizer == "sgd_momentum":
        return 4 * numel
    if optimizer == "adafactor":
        if len(shape) >= 2:
            return 4 * (numel // shape[-1] + numel // shape[-2])
        return 4 * numel
    return 8 * numel


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The LR of optimizer step ``step`` (0-based).

    Warmup goes linearly from ``warmup_start_lr`` (step 0) to ``lr`` (step ``warmup_steps - 1``),
    like the reference's ``np.linspace``; then constant, or cosine from ``lr`` down to ``min_lr``
    at ``max_steps``.
    """
    warmup = min(cfg.warmup_steps, cfg.max_steps)
    if step < warmup:
        if warmup == 1:
            return cfg.lr
        return cfg.warmup_start_lr + (cfg.lr - cfg.warmup_start_lr) * step / (warmup - 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = max(cfg.max_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` whose factor is ``lr_at(step) / lr`` (every group has base LR ``cfg.lr``)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)


def restore_lr_scheduler(
    scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict, cfg: TrainConfig
) -> float:
    """Continue a checkpoint's schedule on this run's configuration; returns the next step's LR.

    The checkpoint gives the step count; the curve is this run's (:func:`lr_at` with this ``cfg``): a
    resume with another ``max_steps`` (or LR settings) rescales the schedule from the next step on,
    instead of keeping the LR the old schedule left in the optimizer for one step. With the same
    settings every value is the one the uninterrupted run computes (same call, same numbers).
    """
    scheduler.load_state_dict(state)
    scheduler.base_lrs = [cfg.lr] * len(scheduler.optimizer.param_groups)
    lrs = [
        base * fn(scheduler.last_epoch)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    return lrs[0]
