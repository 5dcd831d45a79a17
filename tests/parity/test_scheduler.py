"""Scheduler tables, inference grids, Euler step and renoise coefficients vs ``scheduler.json``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.tolerance import assert_rounding_close, rounding_rtol
from pfctl.flow.scheduler import PyramidFlowScheduler

pytestmark = pytest.mark.parity


def _tensor(entry: dict) -> torch.Tensor:
    return torch.tensor(entry["values"], dtype=getattr(torch, entry["dtype"]))


def _configs(refdir):
    data = json.loads((refdir / "scheduler.json").read_text())
    return data["configs"]


def _scheduler(cfg: dict) -> PyramidFlowScheduler:
    c = cfg["config"]
    return PyramidFlowScheduler(
        num_train_timesteps=c["num_train_timesteps"],
        shift=c["shift"],
        stages=c["stages"],
        stage_range=c["stage_range"],
        gamma=c["gamma"],
    )


def test_global_grid(refdir):
    for cfg in _configs(refdir):
        sch = _scheduler(cfg)
        ref = cfg["global_init"]
        assert torch.equal(sch.sigmas, _tensor(ref["sigmas"]))
        assert torch.equal(sch.timesteps, _tensor(ref["timesteps"]))
        assert sch.sigma_min == ref["sigma_min"]
        assert sch.sigma_max == ref["sigma_max"]


def test_stage_tables(refdir):
    for cfg in _configs(refdir):
        sch = _scheduler(cfg)
        for ref in cfg["stages"]:
            table = sch.stages[ref["stage"]]
            assert table.start_sigma == pytest.approx(ref["start_sigma"], abs=1e-15)
            assert table.end_sigma == ref["end_sigma"]
            assert table.ori_start_sigma == ref["ori_start_sigma"]
            assert table.timestep_ratio == pytest.approx(tuple(ref["timestep_ratio"]), abs=1e-15)
            expected_t = _tensor(ref["timesteps_per_stage"])
            expected_s = _tensor(ref["sigmas_per_stage"])
            assert table.timesteps.dtype == expected_t.dtype and torch.equal(table.timesteps, expected_t)
            assert table.sigmas.dtype == expected_s.dtype and torch.equal(table.sigmas, expected_s)


def test_set_timesteps_reference_grid(refdir):
    for cfg in _configs(refdir):
        sch = _scheduler(cfg)
        for ref in cfg["set_timesteps"].values():
            sched = sch.set_timesteps(ref["n"], ref["stage"])
            expected_t, expected_s = _tensor(ref["timesteps"]), _tensor(ref["sigmas"])
            assert sched.timesteps.dtype == torch.float64 and sched.sigmas.dtype == torch.float64
            torch.testing.assert_close(sched.timesteps, expected_t, rtol=0, atol=1e-9)
            torch.testing.assert_close(sched.sigmas, expected_s, rtol=0, atol=1e-15)


def test_euler_step_example(refdir):
    for cfg in _configs(refdir):
        sch = _scheduler(cfg)
        ex = cfg["step_example"]
        sched = sch.set_timesteps(ex["n"], ex["stage"])
        sample, v = _tensor(ex["sample"]), _tensor(ex["model_output"])
        for step, ((_, _t, sigma, sigma_next), expected) in enumerate(
            zip(sched.steps(), ex["outputs_after_each_step"], strict=True)
        ):
            sample = sch.step(v, sample, sigma, sigma_next)
            # x + (sigma_next - sigma) * v: a couple of roundings per step, chained over the steps
            assert_rounding_close(sample, _tensor(expected), reduction=2, depth=step + 1)


def test_renoise_coefficients(refdir):
    for cfg in _configs(refdir):
        sch = _scheduler(cfg)
        for ref in cfg["renoise"]:
            alpha, beta = sch.renoise_coefficients(ref["stage"])
            assert 1 - sch.stages[ref["stage"]].ori_start_sigma == pytest.approx(
                ref["ori_sigma_signal_coeff"]
            )
            assert alpha == pytest.approx(ref["alpha"], abs=1e-12)
            assert beta == pytest.approx(ref["beta"], abs=1e-12)


def test_block_noise_covariance_matches_reference_matrix(refdir):
    for cfg in _configs(refdir):
        sch = _scheduler(cfg)
        expected = torch.tensor(cfg["block_noise_covariance"], dtype=torch.float64)
        gen = torch.Generator().manual_seed(0)
        noise = sch.block_noise((1, 4, 1, 200, 200), gen).double()
        blocks = noise.reshape(1, 4, 1, 100, 2, 100, 2).permute(0, 1, 2, 3, 5, 4, 6).reshape(-1, 4)
        cov = blocks.T @ blocks / blocks.shape[0]
        # 40,000 blocks: standard error of each entry ~ sqrt(2)/200 ~ 0.007.
        torch.testing.assert_close(cov, expected, rtol=0, atol=0.04)


def test_exact_stage_end_option_covers_the_stage(refdir):
    for cfg in _configs(refdir):
        sch = _scheduler(cfg)
        for stage in range(sch.num_stages):
            sched = sch.set_timesteps(4, stage, exact_stage_end=True)
            torch.testing.assert_close(
                sched.sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
            )
            table = sch.stages[stage]
            assert sched.timesteps[0].item() == pytest.approx(table.timesteps[0].item())
            # the training table has the same ratio -> timestep map: its timestep at sigma 0.75, read off the
            # table (linear in the index, like its sigmas, so interpolation is exact up to rounding)
            sigmas, timesteps = table.sigmas.double().numpy(), table.timesteps.double().numpy()
            order = np.argsort(sigmas)
            at = float(np.interp(0.75, sigmas[order], timesteps[order]))
            scale = float(np.abs(timesteps).max())
            assert sched.timesteps[1].item() == pytest.approx(at, abs=rounding_rtol(reduction=2) * scale)
