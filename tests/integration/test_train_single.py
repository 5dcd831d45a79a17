"""`pfctl train` in one CPU process: learning, bit-exact resume, EMA, per-stage logs, export, switches."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.tiny_models import tiny_train_config
from helpers.tolerance import assert_rounding_close
from pfctl import api
from pfctl.data.dataset import write_synthetic_cache

LENGTHS = [4] * 8 + [3] * 8 + [1] * 8


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache") / "cache"
    write_synthetic_cache(str(root), LENGTHS, seed=0)
    return root


def config(cache: Path, out: Path, **train):
    return tiny_train_config(cache, out, **{"lr": 2e-3, "checkpoint_every": 1000, **train})


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


@pytest.mark.slow
def test_loss_goes_down_and_everything_is_logged(tmp_path: Path) -> None:
    """Two repeating patterns (a learnable distribution); the held-out loss uses fixed noise."""
    cache = tmp_path / "patterns"
    write_synthetic_cache(str(cache), LENGTHS, seed=0, patterns=2)
    out = tmp_path / "run"
    cfg = config(cache, out, max_steps=20, lr=6e-3, caption_dropout=0.0, heldout_clips=4, eval_every=10)
    report = api.train(cfg)
    assert report.steps == 20 and report.export_dir == str(out / "export")
    rows = metrics(out)
    heldout = [r["heldout_loss"] for r in rows if "heldout_loss" in r]
    assert len(heldout) == 3 and heldout[-1] < 0.9 * heldout[0], heldout
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    for key in (
        "loss",
        "loss_stage0",
        "loss_stage1",
        "loss_stage2",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "samples_per_s",
    ):
        assert all(key in r for r in train_rows), key
    # the final export is what `pfctl generate --model OUT/export` loads
    from pfctl.models.checkpoint import load_components

    parts = load_components(out / "export", need=("dit",), dtype=torch.float32)
    assert parts.info["export"]["extra"]["resolutions"] == [[64, 64]]  # 8x8 latents
    final = weights(out / "checkpoints" / "step-000020" / "model")
    assert all(torch.equal(v, final[k]) for k, v in parts.dit.state_dict().items())


def test_export_records_the_pixel_sizes_it_was_trained_on(tmp_path: Path) -> None:
    """The export marker's ``resolutions`` (what ``generate`` takes as the model's size) are the clips'
    pixel sizes: latent size x the VAE's spatial factor, here 16x8 latents → 128x64."""
    from pfctl.training.data import cache_vae_info, open_cache

    root = tmp_path / "wide"
    write_synthetic_cache(str(root), [2, 3], height=8, width=16, seed=0)
    info = cache_vae_info(open_cache(str(root)))
    assert info["resolutions"] == [[128, 64]]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("background", "merged"),
    [(False, False), (True, False), (False, True)],
    ids=["blocking-saves", "background-saves", "merged-micro-batches"],
)
def test_resume_is_bit_exact(cache: Path, tmp_path: Path, background: bool, merged: bool) -> None:
    """Also with checkpoints written in the background (``train.checkpoint_async``, the CUDA default): the
    run's state after the save call does not leak into the checkpoint; and with a step's micro-batches in one
    forward (``train.merge_micro_batches``)."""
    opts = dict(max_steps=6, checkpoint_every=3, grad_accum=2, ema_decay=0.8, ema_every=1, keep_last=None,
                checkpoint_async=background, merge_micro_batches=merged)  # fmt: skip
    full = api.train(config(cache, tmp_path / "full", **opts))
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-000003", part / "checkpoints" / "step-000003")
    resumed = api.train(config(cache, part, resume="latest", **opts))
    assert resumed.resumed_from and resumed.resumed_from.endswith("step-000003")
    assert resumed.losses == full.losses[3:]  # exactly, not approximately
    for sub in ("model", "ema"):
        a = weights(tmp_path / "full" / "checkpoints" / "step-000006" / sub)
        b = weights(part / "checkpoints" / "step-000006" / sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub
    opt_a = load_file(str(tmp_path / "full" / "checkpoints" / "step-000006" / "optimizer.safetensors"))
    opt_b = load_file(str(part / "checkpoints" / "step-000006" / "optimizer.safetensors"))
    assert all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)
    lines = lambda p: (p / "assignments" / "rank-00000.jsonl").read_text().splitlines()  # noqa: E731
    assert lines(part) == lines(tmp_path / "full")[3 * 2 :]


@pytest.mark.slow
def test_merged_micro_batches_train_like_one_forward_each(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.merge_micro_batches``: a step's two micro-batches (clips of other lengths, other unit positions)
    as one DiT call trains like a forward and backward each: the same clips and units (assignment log), the
    same losses per step and stage, gradient norms and weights, up to the rounding of another summation
    order. Both of a merged step's batches were loaded ahead during the step before (both wait for its one
    forward); one by one, the next micro-step's."""
    from pfctl.training.data import BatchFeed
    from pfctl.training.trainer import Trainer

    calls: list[int] = []  # columns of each DiT call
    waiting: list[list[int]] = []  # the micro-steps loaded ahead when each batch is taken
    loss, next_batch = Trainer.loss, BatchFeed.next_batch

    def counted_loss(self: Trainer, inputs: Any, text: Any) -> Any:
        calls.append(len(inputs.sample))
        return loss(self, inputs, text)

    def watched_next_batch(self: BatchFeed, micro_step: int) -> Any:
        waiting.append([a.micro_step for a in self.ahead])
        return next_batch(self, micro_step)

    monkeypatch.setattr(Trainer, "loss", counted_loss)
    monkeypatch.setattr(BatchFeed, "next_batch", watched_next_batch)
    for merged in (False, True):
        out = tmp_path / str(merged)
        calls.clear()
        waiting.clear()
        # two samples per column: the merged text rows interleave the micro-batches' rows
        opts = dict(max_steps=3, batch_size=8, grad_accum=2, export=False, merge_micro_batches=merged)
        api.train(config(cache, out, **opts))
        assert calls == ([8] * 3 if merged else [4] * 6)
        # merged: from the second step on, both its batches wait when it starts
        ahead = [[1, 2, 3], [2, 3], [3, 4, 5], [4, 5], [5]] if merged else [[1], [2], [3], [4], [5]]
        assert waiting == [[], *ahead]
        assert yaml.safe_load((out / "config.yaml").read_text())["train"]["merge_micro_batches"] is merged
        assert f"micro-batches {'merged' if merged else 'one by one'}" in capsys.readouterr().out
    one, merged = (tmp_path / str(m) for m in (False, True))
    lines = lambda p: (p / "assignments" / "rank-00000.jsonl").read_text().splitlines()  # noqa: E731
    assert lines(merged) == lines(one)
    assert len({tuple(json.loads(x)["units"]) for x in lines(one)}) > 1
    # 3 steps of a forward, a backward and an update (helpers.tolerance)
    sums = {"reduction": 128, "depth": 3 * 3 * 32}
    for key in ("loss", "loss_stage0", "loss_stage1", "loss_stage2", "grad_norm"):
        column = lambda p: [r[key] for r in metrics(p) if key in r]  # noqa: E731, B023
        assert_rounding_close(column(merged), column(one), **sums, msg=key)
    a, b = (weights(p / "checkpoints" / "step-000003" / "model") for p in (merged, one))
    for key, value in b.items():
        assert_rounding_close(a[key], value, **sums, msg=key)


@pytest.mark.slow
def test_resume_with_other_max_steps_rescales_the_schedule(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume with a longer ``max_steps`` follows the new schedule from its first step (no step of the
    old one), and says so."""
    from pfctl.training.optim import lr_at

    opts = dict(lr_schedule="cosine", lr=1e-3, min_lr=5e-5, warmup_steps=1, checkpoint_every=3)
    api.train(config(cache, tmp_path, max_steps=3, **opts))
    capsys.readouterr()
    longer = config(cache, tmp_path, max_steps=6, resume="latest", **opts)
    api.train(longer)
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    for row in rows[3:]:  # the log's LR is the one the step used
        assert row["lr"] == pytest.approx(lr_at(row["step"] - 1, longer.train), rel=1e-12), row["step"]
    assert "LR schedule rescaled to max_steps 6 (the checkpoint was written for 3)" in capsys.readouterr().out


@pytest.mark.slow
def test_ema_follows_the_direct_computation(cache: Path, tmp_path: Path) -> None:
    from pfctl.training.trainer import Trainer

    trainer = Trainer(config(cache, tmp_path / "ema", max_steps=4, ema_decay=0.7, ema_every=2))
    trainer.setup()
    expected = {k: v.detach().clone().double() for k, v in trainer.unwrapped.state_dict().items()}
    for step in range(1, 5):
        trainer.train_step()
        if step % 2 == 0:
            current = trainer.unwrapped.state_dict()
            expected = {k: 0.7 * v + 0.3 * current[k].double() for k, v in expected.items()}
    for k, v in expected.items():
        assert torch.allclose(trainer.ema.state_dict()[k].double(), v, rtol=0, atol=1e-6), k
    trainer.close()


@pytest.mark.slow
def test_every_switch_turns_off(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "off"
    report = api.train(
        config(
            cache, out, max_steps=2, use_temporal_pyramid=False, use_temporal_causal=False,
            interp_condition_pos=False, caption_dropout=0.0, gradient_checkpointing=True,
            gradient_checkpointing_ratio=1.0, grad_clip=None,
        )
    )  # fmt: skip
    assert report.steps == 2
    dit_config = json.loads((out / "export" / "transformer" / "config.json").read_text())
    assert dit_config["use_temporal_causal"] is False and dit_config["interp_condition_pos"] is False
    rows = [json.loads(x) for x in (out / "assignments" / "rank-00000.jsonl").read_text().splitlines()]
    assert all(r["units"] is None for r in rows)  # non-AR: whole clips, no unit schedule


@pytest.mark.slow
def test_gradients_are_clipped_only_in_steps_whose_norm_reaches_the_limit(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.grad_clip``: a step whose gradient norm is over the limit scales the gradients; one clearly under
    it skips the pass over them (the factor would be 1)."""
    clipped: list[float] = []
    clip = torch.nn.utils.clip_grads_with_norm_

    def counted(parameters: Any, max_norm: float, norm: torch.Tensor, *args: Any) -> None:
        clipped.append(max_norm)
        clip(parameters, max_norm, norm, *args)

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", counted)
    for name, limit in (("over", 1e-6), ("under", 1e6)):
        api.train(config(cache, tmp_path / name, max_steps=2, grad_clip=limit))
        norms = [r["grad_norm"] for r in metrics(tmp_path / name) if "grad_norm" in r]
        assert len(norms) == 2 and all(limit * 10 < n for n in norms) == (name == "over")
    assert clipped == [1e-6, 1e-6]


@pytest.mark.slow
def test_skip_loss_above_keeps_the_weights(cache: Path, tmp_path: Path) -> None:
    from pfctl.training.trainer import Trainer

    trainer = Trainer(config(cache, tmp_path / "skip", max_steps=2, skip_loss_above=1e-9))
    trainer.setup()
    before = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    result = trainer.train_step()
    assert result["skipped"] is True
    assert all(torch.equal(v, before[k]) for k, v in trainer.unwrapped.state_dict().items())
    trainer.close()


@pytest.mark.slow
def test_validation_samples_are_written(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "val"
    api.train(config(cache, out, max_steps=1, validation_every=1, validation_units=2, export=False))
    latents = load_file(str(out / "validation" / "step-000001.safetensors"))["latents"]
    assert latents.shape == (2, 16, 2, 8, 8) and torch.isfinite(latents).all()


def test_held_out_loss_and_validation_leave_the_training_graphs(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CUDA graphs the occasional calls (held-out loss, validation samples) run the compiled
    blocks eagerly, so their shapes are never recorded as CUDA graphs; without it nothing changes stance."""
    stances: list[str] = []
    set_stance = torch.compiler.set_stance

    def recording(stance: str, *args: object, **kwargs: object):
        stances.append(stance)
        return set_stance(stance, *args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", recording)
    common = {
        "max_steps": 2,
        "heldout_clips": 2,
        "eval_every": 1,
        "validation_every": 2,
        "validation_units": 2,
    }
    api.train(config(cache, tmp_path / "eager", export=False, **common))
    assert stances == []
    # the CPU settles on eager blocks: settle as on CUDA (the blocks still run eagerly: nothing compiles here)
    from pfctl.config.train import TrainSpeed
    from pfctl.training import trainer

    monkeypatch.setattr(
        trainer, "resolve_train_speed", lambda train, *_: TrainSpeed(True, True, "efficient", train.fsdp)
    )
    api.train(config(cache, tmp_path / "graphs", export=False, **common))
    # step 0: the held-out and validation baselines (one switch); steps 1, 2: held-out; step 2: validation
    assert stances == ["force_eager"] * 4
    assert (tmp_path / "graphs" / "validation" / "step-000002.safetensors").is_file()


@pytest.mark.slow
def test_a_step_waits_for_the_device_once(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer reads device values on the host once per step (the skip decision's numbers, in one
    transfer): every read waits for all queued GPU work, so another one would leave the GPU idle while
    the host works. Counted on the CPU from the reads the trainer's own code makes."""
    from pfctl.training.trainer import Trainer

    trainer = Trainer(
        config(cache, tmp_path / "reads", max_steps=3, grad_accum=2, ema_decay=0.9, ema_every=1)
    )
    trainer.setup()
    trainer.train_step()
    reads: list[str] = []

    def spy(name: str):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") == Trainer.__module__:
                reads.append(name)
            return real(self, *args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    trainer.train_step()
    assert reads == ["tolist"]
    trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("merged", [False, True], ids=["one-micro-batch", "merged-micro-batches"])
def test_a_data_error_fails_the_step_that_uses_the_batch(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, merged: bool
) -> None:
    """Every clip load after the 8th fails, so the batch of the third micro-step cannot be built. It is loaded
    ahead, during the step before, yet that step still completes and checkpoints the data position before that
    batch: a resume (loads working again) trains the failed step exactly as an uninterrupted run. Merged: two
    micro-batches a step, both of the second step loaded ahead during the first."""
    from pfctl.errors import CacheError
    from pfctl.runtime import faults

    monkeypatch.setattr(faults, "_CACHE", {})  # the fault's count of loads starts at 0 in this test
    opts = dict(max_steps=3, checkpoint_every=1, export=False)
    if merged:
        opts |= dict(grad_accum=2, merge_micro_batches=True)
    done = 1 if merged else 2  # the steps before the one whose batch fails
    full = api.train(config(cache, tmp_path / "full", **opts))
    monkeypatch.setenv("PFCTL_FAULT", "cache_load:after=8")  # 2 batches of 4 clips load
    with pytest.raises(CacheError, match="replacement clips in a row failed"):
        api.train(config(cache, tmp_path / "broken", **opts))
    assert [r["step"] for r in metrics(tmp_path / "broken")] == list(range(1, done + 1))
    monkeypatch.delenv("PFCTL_FAULT")
    resumed = api.train(config(cache, tmp_path / "broken", resume="latest", **opts))
    assert resumed.resumed_from and resumed.resumed_from.endswith(f"step-{done:06d}")
    assert resumed.losses == full.losses[done:]


def test_skip_future_keys_trains_like_one_call_attention(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.skip_future_keys``: the trainer hands the DiT each batch's text lengths (read before the copy
    to the device), so single-frame row groups attend with no mask; the losses are the one-call ones. With
    ``train.row_group_min_tokens=0`` the tiny preset's short columns are grouped too; with
    ``train.row_group_min_rows=1`` every group is one frame's, none attended under the mask."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 4)  # several groups on the tiny preset's columns
    grouped, key_starts, masked = dc._attention_by_row_groups, set(), []

    def recording(*args: object) -> torch.Tensor:
        key_starts.update(g.key_starts for g in args[5] if g.key_starts is not None)  # the row groups
        masked.extend(g.key_starts is None for g in args[5])
        return grouped(*args)

    monkeypatch.setattr(dc, "_attention_by_row_groups", recording)
    one_call = api.train(config(cache, tmp_path / "one", max_steps=3))
    # grouped however short the columns
    grouped_run = api.train(
        config(cache, tmp_path / "grouped", max_steps=3, skip_future_keys=True, row_group_min_tokens=0)
    )
    assert len({start for starts in key_starts for start in starts}) > 1  # captions of different lengths
    assert any(masked)  # groups of several frames
    # another attention path sums in another order: 3 steps of a forward and a backward (helpers.tolerance)
    assert_rounding_close(grouped_run.losses, one_call.losses, reduction=128, depth=3 * 32)
    masked.clear()
    per_frame = api.train(
        config(cache, tmp_path / "frames", max_steps=3, skip_future_keys=True, row_group_min_tokens=0,
               row_group_min_rows=1)
    )  # fmt: skip
    assert masked and not any(masked)
    assert_rounding_close(per_frame.losses, one_call.losses, reduction=128, depth=3 * 32)


def test_compiled_runs_log_their_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With compiled blocks the log names the distinct inputs this rank will build (each compiled once) and
    the step in which the last of them had its first forward: the end of the warm-up. One bucket, so the
    unit positions cycle with the micro-steps."""
    from pfctl.config.train import TrainSpeed
    from pfctl.data.dataset import ClipInfo
    from pfctl.training import trainer
    from pfctl.training.plan import token_count_sets

    one_bucket = tmp_path / "cache"
    write_synthetic_cache(str(one_bucket), [4] * 8, seed=0)
    # settle as on CUDA (the CPU keeps its eager blocks: the watch works the same)
    monkeypatch.setattr(
        trainer, "resolve_train_speed", lambda train, *_: TrainSpeed(True, False, "efficient", train.fsdp)
    )
    cfg = config(one_bucket, tmp_path / "run", max_steps=6, grad_accum=1, export=False)
    api.train(cfg)
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "assignments" / "rank-00000.jsonl").open()]
    height, width = records[0]["bucket"][1:]
    expected = token_count_sets(cfg.train, 0, [ClipInfo("any", 4, height, width)])
    assert len(expected) == cfg.train.max_units  # one process: every unit position
    assert f"warm-up: {len(expected)} distinct inputs per rank, each compiled once" in out
    seen: set = set()
    last_new = next(
        r["step"]
        for r in records
        if not seen.add((tuple(r["bucket"]), tuple(r["units"]))) and set(expected) <= seen
    )
    assert f"warm-up over at step {last_new}:" in out


CUDA_SETTINGS = {  # name: (train switches, settled cuda_graphs, settled attention, merged micro-batches)
    "eager": ({"compile": False}, False, "efficient", False),
    "default": ({}, "step", "cudnn", True),
    "blocks": ({"cuda_graphs": False}, False, "efficient", True),
    "flex": ({"attention": "flex", "cuda_graphs": False}, False, "flex", True),
    "graphs": ({"cuda_graphs": True}, True, "cudnn", False),
}


def _cuda_run(cache: Path, out: Path, name: str) -> list[float]:
    """Three steps of two micro-batches on CUDA (bf16 autocast) under ``CUDA_SETTINGS[name]``: its losses,
    after checking what the run settled on."""
    switch, graphs, attention, merged = CUDA_SETTINGS[name]
    cfg = config(cache, out, max_steps=3, grad_accum=2, export=False, **switch)
    api.train(cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"device": "cuda"})}))
    settled = yaml.safe_load((out / "config.yaml").read_text())["train"]
    assert settled["cuda_graphs"] == graphs and settled["compile"] is (name != "eager")
    assert settled["attention"] == attention and settled["merge_micro_batches"] is merged
    return [r["loss"] for r in metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def cuda_eager_losses(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _cuda_run(cache, tmp_path_factory.mktemp("eager"), "eager")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [name for name in CUDA_SETTINGS if name != "eager"])
def test_cuda_defaults_and_cuda_graphs_train_like_the_eager_path_with_accumulation(
    name: str, cache: Path, tmp_path: Path, cuda_eager_losses: list[float]
) -> None:
    """Two micro-batches per step on CUDA, bf16 autocast, one case per setting (each compiles on its own):
    the defaults (compiled blocks, the whole step's CUDA graphs, cuDNN's attention, the micro-batches merged
    into one forward), compiled blocks without graphs (the memory-efficient kernel, merged), the same with
    every column in one FlexAttention call (``attention=flex``), and compiled blocks as CUDA graphs (cuDNN's
    kernel), where the first micro-batch's gradients survive the second one's forward (which reuses the graphs'
    memory): the losses follow the eager path's within the rounding of bf16 autocast."""
    losses = _cuda_run(cache, tmp_path / name, name)
    # (the defect the graphs' case guards against stopped the second micro-batch's backward with an error);
    # bf16 rounds each product's inputs to 8 bits (2^-8 relative) and the paths fuse differently
    assert len(losses) == 3
    assert losses == pytest.approx(cuda_eager_losses, rel=2e-2)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_row_groups_on_cudnn_train_like_the_eager_path(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 768p recipe's speed settings in miniature: compiled blocks, three quarters of them checkpointed
    (``selective_narrow``), every column in row groups (``skip_future_keys``, ``row_group_min_tokens=0``) on
    cuDNN's kernel (the masked calls, and the mask-free calls' image keys apart from each caption's valid text,
    which differ in length here): the losses follow the eager path's one-call attention within the rounding
    of bf16 autocast."""
    import pfctl.models.attention_layout as dc

    monkeypatch.setattr(dc, "ROW_GROUP_MIN_ROWS", 4)  # masked and mask-free groups on the tiny preset
    fast = {
        "compile": True,
        "cuda_graphs": False,
        "attention": "cudnn",
        "skip_future_keys": True,
        "row_group_min_tokens": 0,
        "gradient_checkpointing": True,
        "gradient_checkpointing_ratio": 0.75,
        "gradient_checkpointing_policy": "selective_narrow",
    }
    runs = {}
    for name, switch in (("eager", {"compile": False, "attention": "efficient"}), ("fast", fast)):
        cfg = config(cache, tmp_path / name, max_steps=3, export=False, **switch)
        cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"device": "cuda"})})
        api.train(cfg)
        runs[name] = [r["loss"] for r in metrics(tmp_path / name) if "loss" in r]
        settled = yaml.safe_load((tmp_path / name / "config.yaml").read_text())["train"]
        assert settled["compile"] is (name == "fast") and settled["attention"] == switch["attention"]
    assert len(runs["fast"]) == 3
    # bf16 rounds each product's inputs to 8 bits (2^-8 relative); the paths fuse and split differently
    assert runs["fast"] == pytest.approx(runs["eager"], rel=2e-2)


@pytest.mark.parametrize("every", [2, 0])
def test_garbage_is_collected_at_step_boundaries_during_training(cache: Path, tmp_path: Path, every: int) -> None:
    """``train.gc_every``: Python's automatic collection is off from the first step until the trainer closes
    (0: left on), and the state it had comes back."""
    import gc

    from pfctl.training.trainer import Trainer

    trainer = Trainer(config(cache, tmp_path, max_steps=3, gc_every=every, export=False))
    trainer.setup()
    try:
        assert gc.isenabled()
        for _ in range(3):
            trainer.train_step()
            assert gc.isenabled() == (every == 0)
    finally:
        trainer.close()
    assert gc.isenabled()
