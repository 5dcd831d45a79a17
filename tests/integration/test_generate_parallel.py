"""``torchrun -m pfctl generate`` on 2 and 4 CPU processes (gloo): CFG parallel, Ulysses sequence parallel and
data parallel give the single-process latents, for both DiTs; rank 0 of each video writes it (with its
layout in the sidecar), the other ranks write nothing; a bad layout fails on every rank before loading.

Each run samples a 64x64, 2-latent-frame video with one step per stage from a tiny official folder whose
DiT has 4 heads (so 2 and 4 ranks can split them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.tiny_models import FAST_GENERATE
from helpers.tolerance import assert_rounding_close
from pfctl.config import load_config
from pfctl.sampling.generate import run_generate

SETTINGS = [
    *FAST_GENERATE,
    "generate.temp=2",
    "generate.seed=7",
    "generate.save_latents=true",
    "generate.encoder_threads=1",
]
PROMPT = "a red circle moving right"
DITS = {
    "flux": ("tiny", {"num_attention_heads": 4}),
    "mmdit": ("mmdit-tiny", {"num_attention_heads": 4, "caption_projection_dim": 64}),
}
DIT_CALLS = 6  # 2 units x 3 stages x 1 step
REDUCTION = (
    512  # the longest sum of one forward: the attention's keys (text + pyramid tokens), the MLP's 4 x 64
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from helpers.tiny_models import make_official_folder

    root = tmp_path_factory.mktemp("models")
    return {
        name: make_official_folder(root, name=name, dit_preset=preset, dit_overrides=overrides)
        for name, (preset, overrides) in DITS.items()
    }


@pytest.fixture(scope="module")
def single(folders, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The one-process latents of each DiT (both prompts of the data-parallel test)."""
    from pfctl.config.schema import RuntimeConfig
    from pfctl.runtime.accelerator import build_runtime

    runtime = build_runtime(RuntimeConfig(device="cpu"))
    out = {}
    for name, folder in folders.items():
        config = load_config(
            None, [f"model.path={folder}", f"generate.output_dir={tmp_path_factory.mktemp(name)}", *SETTINGS]
        )
        report = run_generate(config, [PROMPT, "a blue square"], runtime=runtime, keep_latents=True)
        for video in report.videos:
            out[name, video.prompt] = video.latents.float()
    return out


def _torchrun(nproc: int, args: list[str], cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "pfctl", "generate", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _sets(*overrides: str) -> list[str]:
    return [arg for value in (*SETTINGS, *overrides) for arg in ("--set", value)]


def _assert_matches(latents_file: Path, expected: torch.Tensor) -> None:
    assert_rounding_close(
        load_file(str(latents_file))["latents"], expected, reduction=REDUCTION, depth=DIT_CALLS * 8
    )


CASES = [  # (DiT, processes, settings, the layout the sidecar records)
    ("flux", 2, [], {"world_size": 2, "data": 1, "cfg": 2, "sequence": 1}),
    ("flux", 4, [], {"world_size": 4, "data": 1, "cfg": 2, "sequence": 2}),
    ("flux", 2, ["generate.parallel.cfg=off"], {"world_size": 2, "data": 1, "cfg": 1, "sequence": 2}),
    ("mmdit", 2, ["generate.parallel.cfg=off"], {"world_size": 2, "data": 1, "cfg": 1, "sequence": 2}),
    ("mmdit", 4, ["generate.parallel.sequence=4"], {"world_size": 4, "data": 1, "cfg": 1, "sequence": 4}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dit", "nproc", "overrides", "layout"),
    CASES,
    ids=[f"{d}-{n}proc-cfg{lay['cfg']}-seq{lay['sequence']}" for d, n, _, lay in CASES],
)
def test_one_video_on_several_processes_equals_one_process(
    folders, single, tmp_path, dit, nproc, overrides, layout
):
    out = tmp_path / "out"
    proc = _torchrun(
        nproc, [PROMPT, "--model", str(folders[dit]), "-o", str(out), *_sets(*overrides)], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stem = "a-red-circle-moving-right_seed7"
    # rank 0 wrote the video, its sidecar and latents; no other rank wrote anything
    assert sorted(p.name for p in out.iterdir()) == [
        f"{stem}.json",
        f"{stem}.latents.safetensors",
        f"{stem}.mp4",
    ]
    sidecar = json.loads((out / f"{stem}.json").read_text())
    assert sidecar["runtime"]["parallel"] == layout
    _assert_matches(out / f"{stem}.latents.safetensors", single[dit, PROMPT])


@pytest.mark.slow
def test_two_prompts_on_two_processes_are_shared_out(folders, single, tmp_path):
    """More videos than groups need: each rank makes and writes one of them (data parallel)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\na blue square\n")
    out = tmp_path / "out"
    proc = _torchrun(
        2, ["--prompts", str(prompts), "--model", str(folders["flux"]), "-o", str(out), *_sets()], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for stem, prompt in (
        ("a-red-circle-moving-right_seed7", PROMPT),
        ("a-blue-square_seed7", "a blue square"),
    ):
        sidecar = json.loads((out / f"{stem}.json").read_text())
        assert sidecar["runtime"]["parallel"] == {"world_size": 2, "data": 2, "cfg": 1, "sequence": 1}
        _assert_matches(out / f"{stem}.latents.safetensors", single["flux", prompt])


@pytest.mark.slow
def test_a_bad_layout_fails_on_every_rank_before_loading(folders, tmp_path):
    out = tmp_path / "out"
    args = [PROMPT, "--model", str(folders["flux"]), "-o", str(out), *_sets("generate.parallel.sequence=3")]
    proc = _torchrun(2, args, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert (
        proc.stdout.count("generate.parallel.sequence = 3 does not divide the world size 2")
        + proc.stderr.count("generate.parallel.sequence = 3 does not divide the world size 2")
        >= 2
    )
    assert not list(out.glob("*.mp4"))
