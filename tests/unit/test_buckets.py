"""Buckets the pyramid DiT can train: one validator (encode time, train --dry-run, before a real run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pfctl.data.buckets import check_buckets, grid_multiple, nearest_valid
from pfctl.data.dataset import write_synthetic_cache
from pfctl.errors import ConfigError


@pytest.mark.parametrize(
    ("patch", "stages", "vae_factor", "multiple"),
    [(2, 3, 8, 64), (2, 3, 1, 8), (1, 3, 8, 32), (2, 1, 8, 16), (2, 4, 1, 16)],
)
def test_grid_multiple(patch: int, stages: int, vae_factor: int, multiple: int) -> None:
    assert grid_multiple(patch=patch, stages=stages, vae_factor=vae_factor) == multiple


@pytest.mark.parametrize(
    ("size", "multiple", "near"), [(720, 64, [704, 768]), (768, 64, [768]), (40, 64, [64]), (12, 8, [8, 16])]
)
def test_nearest_valid(size: int, multiple: int, near: list[int]) -> None:
    assert nearest_valid(size, multiple) == near


def test_check_buckets_names_the_bucket_and_the_nearest_valid_sizes() -> None:
    check_buckets([(640, 384), (384, 640), (64, 64)], 64, what="encode.buckets", unit="px", why="w")
    with pytest.raises(
        ConfigError, match=r"encode\.buckets: bucket 96x64 px .* multiples of 64 px \(w\)"
    ) as info:
        check_buckets([(640, 384), (96, 64), (640, 352)], 64, what="encode.buckets", unit="px", why="w")
    assert (
        "(and 1 more: 640x352)" in str(info.value) and info.value.hint == "nearest valid sizes: 64x64, 128x64"
    )


def _train_config(cache: Path, out: Path):
    from pfctl.config import load_config

    overrides = {
        "runtime.device": "cpu", "model.dit_preset": "tiny", "train.cache": str(cache), "train.output_dir": str(out),
        "train.batch_size": 4, "train.max_units": 4, "train.max_steps": 2, "train.checkpoint_every": 1,
    }  # fmt: skip
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def test_train_refuses_a_cache_bucket_the_dit_cannot_train(tmp_path: Path) -> None:
    """A 12x8-latent cache (e.g. 96x64 px through an 8x VAE): the tiny DiT (patch 2, 3 stages) needs
    multiples of 8 latent px. The dry-run and the real run both refuse it before the first step."""
    from pfctl import api

    write_synthetic_cache(str(tmp_path / "cache"), [4] * 8, height=8, width=12, seed=0)
    config = _train_config(tmp_path / "cache", tmp_path / "run")
    with pytest.raises(ConfigError, match="the cache: bucket 12x8 latent px") as info:
        api.train(config, dry_run=True, world_size=1)
    assert info.value.hint == "nearest valid sizes: 8x8, 16x8"
    with pytest.raises(ConfigError, match="bucket 12x8 latent px"):
        api.train(config)
    assert not list((tmp_path / "run").glob("checkpoints/*"))
