"""AdamW parameter groups, gradient clipping, the LR schedule, and the EMA rule."""

from __future__ import annotations

import math

import pytest
import torch

from pfctl.config.train import TrainConfig
from pfctl.training.ema import EMA
from pfctl.training.optim import (
    build_lr_scheduler,
    build_optimizer,
    clip_gradients,
    gradient_norm,
    lr_at,
    param_groups,
    restore_lr_scheduler,
)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))


def test_no_decay_for_biases_and_1d_parameters() -> None:
    net = Net()
    groups = {g["name"]: g for g in param_groups(net, 0.1)}
    assert [p.shape for p in groups["decay"]["params"]] == [torch.Size([4, 4])]
    assert groups["decay"]["weight_decay"] == 0.1
    assert len(groups["no_decay"]["params"]) == 4 and groups["no_decay"]["weight_decay"] == 0.0
    opt = build_optimizer(net, TrainConfig(lr=3e-4, betas=(0.8, 0.9), weight_decay=0.1))
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_warmup_then_constant() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=5, warmup_start_lr=1e-6, max_steps=100)
    assert lr_at(0, cfg) == pytest.approx(1e-6)
    assert lr_at(4, cfg) == pytest.approx(1e-3)
    assert lr_at(2, cfg) == pytest.approx(1e-6 + (1e-3 - 1e-6) / 2)
    assert {lr_at(s, cfg) for s in range(5, 100)} == {1e-3}


def test_warmup_then_cosine_and_scheduler_agrees() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=110, lr_schedule="cosine", min_lr=1e-5)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert lr_at(110, cfg) == pytest.approx(1e-5)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 120))
    net = Net()
    opt = build_optimizer(net, cfg)
    sched = build_lr_scheduler(opt, cfg)
    for step in range(30):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, cfg))
        opt.step()
        sched.step()


def test_ema_matches_a_direct_computation() -> None:
    torch.manual_seed(0)
    net = Net()
    ema = EMA(net.state_dict(), decay=0.9, every=2)
    expected = {k: v.detach().clone().double() for k, v in net.state_dict().items() if v.is_floating_point()}
    for step in range(1, 7):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        net.steps += 1
        if ema.should_update(step):
            ema.update(net.state_dict())
            for k in expected:
                expected[k] = 0.9 * expected[k] + 0.1 * net.state_dict()[k].double()
    for k, v in expected.items():
        assert torch.allclose(ema.state_dict()[k].double(), v, atol=1e-6), k
    assert int(ema.state_dict()["steps"]) == 6  # integer buffers are copied, not averaged
    assert not math.isclose(
        float(ema.state_dict()["proj.weight"].sum()), float(net.proj.weight.detach().sum())
    )


def _scheduler_after(cfg: TrainConfig, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg)
    sched = build_lr_scheduler(opt, cfg)
    for _ in range(steps):
        opt.step()
        sched.step()
    return sched


@pytest.mark.parametrize(
    "changes", [{}, {"max_steps": 9}, {"max_steps": 4}, {"lr": 5e-4, "min_lr": 1e-5}, {"warmup_steps": 5}]
)
def test_a_restored_schedule_follows_this_runs_settings(changes: dict) -> None:
    """The next step's LR is this run's schedule at the checkpoint's step; unchanged settings give the
    very value the uninterrupted run computes."""
    old = TrainConfig(lr=1e-3, min_lr=5e-5, warmup_steps=2, lr_schedule="cosine", max_steps=6)
    new = old.model_copy(update=changes)
    saved = _scheduler_after(old, 4).state_dict()
    sched = build_lr_scheduler(build_optimizer(torch.nn.Linear(2, 2), new), new)
    lr = restore_lr_scheduler(sched, saved, new)
    assert [g["lr"] for g in sched.optimizer.param_groups] == [lr] * len(sched.optimizer.param_groups)
    assert lr == pytest.approx(lr_at(4, new), rel=1e-12)
    if not changes:
        assert lr == _scheduler_after(old, 4).optimizer.param_groups[0]["lr"]  # same computation, same value
    sched.optimizer.step()
    sched.step()
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(5, new), rel=1e-12)


def _with_gradients(seed: int) -> Net:
    net = Net()
    gen = torch.Generator().manual_seed(seed)
    for param in net.parameters():
        param.grad = torch.randn(param.shape, generator=gen)
    return net


@pytest.mark.parametrize("limit", [4.0, 1.0 + 2.0**-20, 1.0 - 2.0**-20, 0.25])  # x the norm
def test_gradients_are_clipped_as_clip_grad_norm_does_and_left_alone_where_it_would_not_scale(limit: float) -> None:
    """``clip_gradients`` leaves the gradients as ``clip_grad_norm_`` would: untouched (no pass over them) where
    the norm is clearly under the limit, where ``clip_grad_norm_``'s factor is exactly 1; scaled by the same
    factor where the norm is at the limit or over it. The norm is the whole model's."""
    net, twin = _with_gradients(0), _with_gradients(0)
    clip_norm, norm = gradient_norm(net.parameters())
    assert clip_norm is norm
    every = torch.cat([p.grad.flatten() for p in net.parameters()])
    torch.testing.assert_close(norm, torch.linalg.vector_norm(every), rtol=1e-6, atol=0)
    max_norm = limit * float(norm)
    before = [p.grad.clone() for p in net.parameters()]
    scaled = clip_gradients(net.parameters(), max_norm, clip_norm, float(norm))
    assert scaled is (limit < 2)  # within the margin of the limit it scales, as the factor may round under 1
    expected_norm = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), max_norm)
    torch.testing.assert_close(expected_norm, norm, rtol=1e-6, atol=0)
    for param, ref, old in zip(net.parameters(), twin.parameters(), before, strict=True):
        if not scaled:  # the factor is exactly 1 there, so clip_grad_norm_'s product is exact
            assert torch.equal(param.grad, old) and torch.equal(ref.grad, old)
        # the same two operations on the same values; fp32 rounds the factor and the product once each
        torch.testing.assert_close(param.grad, ref.grad, rtol=2 * 2.0**-24, atol=0)
    if limit < 1:
        clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in net.parameters()]))
        assert float(clipped) == pytest.approx(max_norm, rel=1e-5)
