"""``train.cuda_graphs=step``: each distinct input's forward and backward recorded once and replayed
(:mod:`pfctl.training.step_graphs`). On the CPU a recording is played by ``helpers.step_graphs.
replaying_capture``, which does what a CUDA graph does to the tensors: the recording changes nothing, and a
replay runs the same work again on the recording's input buffers, writing its outputs where the recording's
are. The real recording runs in the CUDA test at the end; two processes in test_train_multiprocess."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from helpers.step_graphs import Unrecorded, eager_speed, replaying_capture
from helpers.tiny_models import tiny_train_config
from helpers.tolerance import assert_rounding_close
from pfctl import api
from pfctl.config.train import check_train_constraints, resolve_train_speed
from pfctl.data.dataset import write_synthetic_cache
from pfctl.errors import ConfigError
from pfctl.training.step_graphs import StepGraphs


def _model_and_work() -> tuple[torch.nn.Module, Callable[..., Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def work(batch: dict[str, torch.Tensor], scale: float) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        (loss * scale).backward()
        return loss.detach(), {0: loss.detach() * 2}

    return model, work


def test_each_signature_runs_eagerly_once_is_recorded_then_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call of a signature runs the work eagerly (its gradients added once); later calls of that
    signature replay the recording over their own inputs, as many times as called; a new shape or a new
    non-tensor argument is another signature. The outputs and the gradients match the plain calls'."""
    monkeypatch.setattr(StepGraphs, "capture", replaying_capture)
    model, work = _model_and_work()
    plain, plain_work = _model_and_work()
    graphs = StepGraphs(torch.device("cpu"), list(model.parameters()))
    gen = torch.Generator().manual_seed(1)
    calls = [(4, 0.5), (4, 0.5), (3, 0.5), (4, 0.5), (4, 1.0), (3, 0.5)]
    for rows, scale in calls:
        batch = {"x": torch.randn(rows, 6, generator=gen), "y": torch.randn(rows, 1, generator=gen)}
        loss, per_stage = graphs(work, batch, scale)
        expected, expected_stage = plain_work(batch, scale)
        assert_rounding_close(loss, expected, reduction=6 * 5)
        assert_rounding_close(per_stage[0], expected_stage[0], reduction=6 * 5)
    assert (graphs.recorded, graphs.replays, graphs.failure) == (3, 3, None)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert_rounding_close(p.grad, q.grad, reduction=6 * 5, depth=len(calls))
    assert graphs.summary().startswith("CUDA graphs of the step: 3 recorded in ")


def test_a_recording_that_fails_leaves_every_call_eager(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An operation that cannot be recorded: a warning at once naming the last of pfctl's own lines the error
    passed through, the failure kept for the log, the graphs dropped, and every call runs the work itself from
    then on (its gradients added once per call)."""
    from pfctl.models.fast.cuda_graph import record_graph

    def refuse() -> None:
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    def failing(self: StepGraphs, work: Callable[[], Any]) -> Any:
        return record_graph(Unrecorded(), None, None, refuse)

    monkeypatch.setattr(StepGraphs, "capture", failing)
    model, work = _model_and_work()
    graphs = StepGraphs(torch.device("cpu"), list(model.parameters()))
    batch = {"x": torch.ones(2, 6), "y": torch.zeros(2, 1)}
    for _ in range(3):
        graphs(work, batch, 1.0)
    assert (graphs.recorded, graphs.replays) == (0, 0)
    warned = capsys.readouterr()
    assert (warned.out + warned.err).count("CUDA graphs of the step: recording failed at pfctl/models/fast/") == 1
    assert graphs.summary() == (
        "CUDA graphs of the step: recording failed (RuntimeError: operation not permitted when stream is "
        "capturing); eager steps"
    )
    three = model[0].weight.grad.clone()
    graphs(work, batch, 1.0)  # a fourth eager call adds the same gradient once more
    assert_rounding_close(model[0].weight.grad, three * 4 / 3, reduction=4)


def test_a_replay_refuses_gradients_made_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recordings add into the gradient tensors the parameters held when recorded: gradients set to None
    (and made anew by an eager backward) stop the next replay with an error naming the remedy."""
    monkeypatch.setattr(StepGraphs, "capture", replaying_capture)
    model, work = _model_and_work()
    graphs = StepGraphs(torch.device("cpu"), list(model.parameters()))
    batch = {"x": torch.ones(2, 6), "y": torch.zeros(2, 1)}
    graphs(work, batch, 1.0)
    graphs(work, batch, 1.0)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        graphs(work, batch, 1.0)


@pytest.mark.parametrize("first_apart", [True, False])
def test_a_steps_first_call_replaces_the_gradients_in_their_own_tensors(
    monkeypatch: pytest.MonkeyPatch, first_apart: bool
) -> None:
    """A step's first micro-batch (``fresh``) replaces whatever the kept gradients hold (here NaN: the trainer
    does not zero them after an update), in the same tensors; a parameter the loss does not reach gets zeros;
    the later micro-batch adds. Recorded apart, the fresh and the adding call of one signature are two
    recordings, and each new gradient is in its kept tensor as soon as it is made (so it is freed at once);
    otherwise the kept gradients are zeroed first and one recording adds. Either way the gradients follow plain
    accumulation from None step after step."""
    monkeypatch.setattr(StepGraphs, "capture", replaying_capture)
    model, work = _model_and_work()
    plain, plain_work = _model_and_work()
    unreached = torch.nn.Parameter(torch.ones(3))
    unreached.grad = torch.ones(3)
    params = [*model.parameters(), unreached]
    kept = [p.grad for p in params]
    graphs = StepGraphs(torch.device("cpu"), params, first_apart)
    in_place = []  # a hook after StepGraphs' own, on the first layer's weight: its gradient already the kept one
    model[0].weight.register_post_accumulate_grad_hook(lambda w: in_place.append(w.grad is kept[0]))
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for grad in kept:
            grad.fill_(float("nan"))
        plain.zero_grad(set_to_none=True)
        for micro in range(2):
            batch = {"x": torch.randn(4, 6, generator=gen), "y": torch.randn(4, 1, generator=gen)}
            graphs(work, batch, 0.5, fresh=micro == 0)
            plain_work(batch, 0.5)
        assert all(p.grad is grad for p, grad in zip(params, kept, strict=True))
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert_rounding_close(p.grad, q.grad, reduction=6 * 5, depth=2)
        assert torch.equal(unreached.grad, torch.zeros(3))
    assert (graphs.recorded, graphs.replays, graphs.failure) == ((2, 4, None) if first_apart else (1, 5, None))
    assert in_place and all(in_place)  # (without recording apart, every call adds into the kept tensors)


def test_step_graphs_settle_on_cuda_only_and_refuse_sharding() -> None:
    """``step`` on CUDA settles to the step's graphs, with cuDNN attention for compiled blocks (its host
    cost is recorded away) and merged micro-batches; on the CPU it is ignored with a note; sharding over
    several processes or host offload are refused before any work, naming the key; data parallel is kept."""
    from pfctl.config.train import TrainConfig

    train = TrainConfig(cuda_graphs="step", grad_accum=2, video_sync_group=1)
    speed = resolve_train_speed(train, "cuda", 1)
    assert (speed.cuda_graphs, speed.attention, speed.merge_micro_batches) == ("step", "cudnn", True)
    assert "CUDA graphs of the whole step" in speed.describe()
    eager = resolve_train_speed(train.model_copy(update={"compile": False}), "cuda", 1)
    assert (eager.cuda_graphs, eager.attention) == ("step", "efficient")
    cpu = resolve_train_speed(train, "cpu", 1)
    assert cpu.cuda_graphs is False and "train.cuda_graphs=step needs CUDA" in cpu.describe()
    pair = train.model_copy(update={"video_sync_group": 2})
    check_train_constraints(pair, 2)  # data parallel
    hint = "the step's CUDA graphs with several processes: --set train.cuda_graphs=step"
    assert hint in resolve_train_speed(pair.model_copy(update={"cuda_graphs": "auto"}), "cuda", 2).describe()
    assert hint not in resolve_train_speed(pair, "cuda", 2).describe()
    with pytest.raises(ConfigError, match=r"does not work with train\.fsdp=full_shard over 2 processes"):
        check_train_constraints(pair.model_copy(update={"fsdp": "full_shard"}), 2)
    offload = train.model_copy(update={"fsdp": "full_shard", "fsdp_cpu_offload": True})
    with pytest.raises(ConfigError, match=r"train\.fsdp_cpu_offload=true"):
        check_train_constraints(offload, 1)


def test_the_first_micro_batch_is_recorded_apart_where_each_input_keeps_its_position() -> None:
    """One forward a step, or the pyramid's unit positions cycling in whole steps: a step's first micro-batch is
    recorded apart. Three micro-batches over 16 / 8 = 2 unit positions, or no pyramid (an input is a bucket,
    at any position): an input would come first in one step and later in another."""
    from pfctl.config.train import TrainConfig
    from pfctl.training.step_graphs import records_first_apart

    pyramid = TrainConfig(grad_accum=2, video_sync_group=8, max_units=16, merge_micro_batches=False)
    assert records_first_apart(pyramid)
    assert records_first_apart(pyramid.model_copy(update={"grad_accum": 1, "video_sync_group": 1}))
    assert not records_first_apart(pyramid.model_copy(update={"grad_accum": 3}))
    assert records_first_apart(pyramid.model_copy(update={"grad_accum": 3, "merge_micro_batches": True}))
    assert not records_first_apart(pyramid.model_copy(update={"use_temporal_pyramid": False}))


def _one_bucket_cache(tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    write_synthetic_cache(str(cache), [4] * 8, seed=0)
    return cache


def test_gradients_are_views_of_one_buffer_per_dtype() -> None:
    """Each trained parameter's gradient is a zeroed view into its dtype's buffer (in the parameters' order), so
    what the graphs add and what a collective reduces is the same memory."""
    from pfctl.training.step_graphs import gradient_buffers

    params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]
    params.append(torch.nn.Parameter(torch.ones(5)))
    buffers = gradient_buffers(params)
    assert [(b.dtype, b.numel()) for b in buffers] == [(torch.float32, 11), (torch.bfloat16, 4)]
    assert all(p.grad.shape == p.shape and not p.grad.any() for p in params)
    params[0].sum().backward()
    params[2].sum().backward()
    assert torch.equal(buffers[0], torch.ones(11)) and not buffers[1].any()


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize(
    ("merged", "lora", "accum"), [(False, False, 2), (True, False, 2), (False, True, 2), (False, False, 3)]
)
def test_the_trainer_with_step_graphs_trains_like_without(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    merged: bool,
    lora: bool,
    accum: int,
) -> None:
    """The trainer settled to ``cuda_graphs=step`` (on the CPU, by hand), two micro-batches a step, one by one
    or merged, full fine-tuning or LoRA (the graphs write into the adapters' gradients only), and three one by
    one (the four unit positions then come at every position of a step: the first micro-batch is not recorded
    apart): its four unit positions each run eagerly once, then replay; the losses and the weights follow the
    run without graphs within fp32 rounding, and the log names the recordings at the warm-up's end."""
    from pfctl.training import trainer

    monkeypatch.setattr(StepGraphs, "capture", replaying_capture)
    cache = _one_bucket_cache(tmp_path)
    runs = {}
    for name in ("plain", "graphs"):
        graphs = "step" if name == "graphs" else False
        monkeypatch.setattr(trainer, "resolve_train_speed", eager_speed(graphs, merged))
        adapters = {"lora.enabled": True, "lora.rank": 4} if lora else {}
        cfg = tiny_train_config(
            cache, tmp_path / name, lr=2e-3, max_steps=6, grad_accum=accum, export=False, **adapters
        )
        api.train(cfg)
        runs[name] = _losses(tmp_path / name)
        settled = yaml.safe_load((tmp_path / name / "config.yaml").read_text())["train"]
        assert settled["cuda_graphs"] == graphs
    out = capsys.readouterr().out
    assert len(runs["graphs"]) == 6
    # tiny DiT: widths of 32, a few blocks deep; six optimizer steps compound the rounding
    assert_rounding_close(runs["graphs"], runs["plain"], reduction=64, depth=6 * 8)
    assert "recorded in the step's CUDA graphs" in out
    recorded = 2 if merged else 4  # merged: the positions pair up, two micro-steps a step
    assert f"CUDA graphs of the step: {recorded} recorded in " in out
    from safetensors.torch import load_file

    final = {name: tmp_path / name / "checkpoints" / "step-000006" / "model" for name in runs}
    (weights,) = {f.name for f in final["plain"].glob("*.safetensors")}
    plain = load_file(str(final["plain"] / weights))
    graphed = load_file(str(final["graphs"] / weights))
    assert plain.keys() == graphed.keys() and (lora == all("lora" in key for key in plain))
    for key, value in plain.items():
        assert_rounding_close(graphed[key], value, reduction=64, depth=6 * 8)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_graphs_on_cuda_train_like_the_eager_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Recorded for real: eager blocks, compiled blocks (cuDNN attention) and compiled blocks that recompute
    in backward (activation checkpointing), each with the step's CUDA graphs, two micro-batches merged (and,
    eager, one by one: the first replacing the kept gradients, the second adding), bf16 autocast; every unit
    position recorded once and replayed, and the losses follow the eager path without graphs within the
    rounding of bf16 autocast."""
    cache = _one_bucket_cache(tmp_path)
    common = {"lr": 2e-3, "max_steps": 6, "grad_accum": 2, "merge_micro_batches": True, "export": False}
    settings = {
        "eager": {"compile": False, "cuda_graphs": False},
        "eager-step": {"compile": False, "cuda_graphs": "step"},
        "eager-step-one-by-one": {"compile": False, "cuda_graphs": "step", "merge_micro_batches": False},
        "compiled-step": {"compile": True, "cuda_graphs": "step"},
        "checkpointed-step": {"compile": True, "cuda_graphs": "step", "gradient_checkpointing": True},
    }
    runs = {}
    for name, switch in settings.items():
        cfg = tiny_train_config(cache, tmp_path / name, **{**common, **switch})
        cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"device": "cuda"})})
        api.train(cfg)
        runs[name] = _losses(tmp_path / name)
        out = capsys.readouterr().out
        if name != "eager":  # four unit positions, two merged micro-steps a step: two graphs (one by one: four)
            recorded = 4 if name.endswith("one-by-one") else 2
            assert f"CUDA graphs of the step: {recorded} recorded" in out, out[-2000:]
    for name in ("eager-step", "eager-step-one-by-one", "compiled-step", "checkpointed-step"):
        assert len(runs[name]) == 6
        # bf16 rounds each product's inputs to 8 bits (2^-8 relative); the paths fuse differently
        assert runs[name] == pytest.approx(runs["eager"], rel=2e-2), name


def test_the_memory_estimate_keeps_the_gradients_and_the_graphs_pool(tmp_path: Path) -> None:
    """On a GPU, CUDA graphs keep the gradients from the first step (no credit for gradients filling the
    memory saved tensors free), and the step's graphs hold a recorded step's saved tensors in their pool
    while the warm-up runs new inputs eagerly: the estimate counts them once more."""
    from pfctl.training.data import cache_clips, open_cache
    from pfctl.training.plan import estimate_for_run

    cache_dir = _one_bucket_cache(tmp_path)
    cache = open_cache(str(cache_dir))

    def estimate(graphs: object) -> Any:
        config = tiny_train_config(cache_dir, tmp_path / "run", cuda_graphs=graphs)
        config = config.model_copy(update={"runtime": config.runtime.model_copy(update={"device": "cuda"})})
        return estimate_for_run(config, cache, cache_clips(cache))

    plain, blocks, step = estimate(False), estimate(True), estimate("step")
    saved = sum(b for name, b, _ in plain.rows if name.startswith(("activations", "attention", "autocast")))
    assert plain.get("backward overlap") < 0 and saved > 0
    assert blocks.total == plain.total - plain.get("backward overlap")
    assert step.get("step graphs' pool") == saved
    assert step.total == blocks.total + saved
