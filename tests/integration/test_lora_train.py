"""LoRA fine-tuning end to end on the CPU: only adapters change, no text encoder / VAE is built,
the exported adapter reproduces the in-memory model in generate, resume is bit-exact, bf16 base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.tolerance import assert_rounding_close
from pfctl import api
from pfctl.config import load_config
from pfctl.data.dataset import write_synthetic_cache

LENGTHS = [4] * 4 + [2] * 4


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.tiny_models import make_official_folder

    return make_official_folder(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-cache") / "cache"
    write_synthetic_cache(str(root), LENGTHS, seed=0)
    return root


def config(base: Path, cache: Path, out: Path, *extra: str, **train):
    overrides = {
        "runtime.device": "cpu",
        "runtime.seed": 3,
        "model.path": str(base),
        "train.cache": str(cache),
        "train.output_dir": str(out),
        "train.batch_size": 4,
        "train.max_units": 4,
        "train.lr": 1e-3,
        "train.warmup_steps": 1,
        "train.log_every": 1,
        "train.checkpoint_every": 1000,
        "train.lora.enabled": True,
        "train.lora.rank": 4,
        "train.lora.alpha": 4,
        **{f"train.{k}": v for k, v in train.items()},
    }
    return load_config(None, [*(f"{k}={json.dumps(v)}" for k, v in overrides.items()), *extra])


def forward_inputs(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "sample": [[torch.randn(1, 16, 2, 8, 8, generator=gen)]],
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "encoder_attention_mask": torch.ones(1, 8, dtype=torch.long),
        "pooled_projections": torch.randn(1, 24, generator=gen),
        "timestep_ratio": torch.tensor([600.0]),
    }


@pytest.mark.slow
def test_only_adapters_change_and_no_encoder_is_built(base, cache, tmp_path, monkeypatch) -> None:
    """The trainer reads cached embeddings and latents: building a text encoder or a VAE is a bug."""
    import pfctl.models.text_encoder as text_encoder
    import pfctl.models.vae as vae
    from pfctl.models.causal_vae import CausalVideoVAE
    from pfctl.training.trainer import Trainer

    def forbidden(*args, **kwargs):
        raise AssertionError("training must not construct a text encoder or a VAE")

    monkeypatch.setattr(text_encoder, "load_text_encoder", forbidden)
    monkeypatch.setattr(text_encoder.FluxTextEncoder, "__init__", forbidden)
    monkeypatch.setattr(vae, "load_vae", forbidden)
    monkeypatch.setattr(CausalVideoVAE, "__init__", forbidden)

    trainer = Trainer(config(base, cache, tmp_path / "run", max_steps=2, lr=1e-2))
    trainer.setup()
    before = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    for _ in range(2):
        trainer.train_step()
    after = trainer.unwrapped.state_dict()
    changed = {k for k, v in after.items() if not torch.equal(v, before[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert any(".lora_B." in k for k in changed)  # B starts at 0 and moved
    opt_params = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for n, p in trainer.unwrapped.named_parameters() if ".lora_" in n}
    trainer.close()


@pytest.mark.slow
def test_export_loads_in_generate_and_equals_the_in_memory_model(base, cache, tmp_path) -> None:
    from pfctl.models.checkpoint import load_components
    from pfctl.models.lora import LORA_MARKER, apply_lora, read_lora
    from pfctl.sampling.generate import run_generate
    from pfctl.training.trainer import Trainer

    out = tmp_path / "run"
    trainer = Trainer(config(base, cache, out, max_steps=2, lr=1e-2))
    report = trainer.train()
    export = Path(report.export_dir)
    marker = json.loads((export / LORA_MARKER).read_text())
    assert marker["base_model_path"] == str(base.resolve()) and marker["rank"] == 4
    assert (export / "adapter_model.safetensors").is_file() and (export / "config.yaml").is_file()
    ckpt = load_file(str(out / "checkpoints" / "step-000002" / "model" / "adapter_model.safetensors"))
    exported = load_file(str(export / "adapter_model.safetensors"))
    assert ckpt.keys() == exported.keys() and all(torch.equal(ckpt[k], exported[k]) for k in ckpt)

    # the DiT: base + reloaded adapter == the trainer's model, up to rounding: the weights read from disk sit
    # at other addresses, so the CPU may pick other kernels (helpers.tolerance; the tiny DiT's sums: at most
    # 128 terms, about 16 chained per forward)
    trained = trainer.unwrapped.eval()
    dit = load_components(base, need=("dit",), dtype=torch.float32).dit
    apply_lora(dit, [read_lora(export)])
    with torch.no_grad():
        x = forward_inputs()
        assert_rounding_close(dit(**x)[0], trained(**x)[0], reduction=128, depth=16)

    # generate: --lora PATH without --model loads the base named in the marker
    fast = ["generate.width=64", "generate.height=64", "generate.strict_resolution=false",
            "generate.num_inference_steps=[1,1,1]", "generate.video_num_inference_steps=[1,1,1]",
            "runtime.device=cpu", "generate.temp=2", "generate.seed=5"]  # fmt: skip
    cfg = load_config(None, [*fast, f"generate.output_dir={tmp_path / 'gen'}"])
    with_lora = load_config(None, [*fast, f"generate.output_dir={tmp_path / 'gen'}",
                                   f"generate.lora=[{{path: '{export}', scale: 1.0}}]"])  # fmt: skip
    a = run_generate(with_lora, ["a red circle"], keep_latents=True)
    assert a.model["path"] == str(base.resolve()) and a.model["lora"][0]["scale"] == 1.0
    parts = load_components(base, dtype=torch.float32)
    parts.dit = trained
    b = run_generate(cfg, ["a red circle"], components=parts, keep_latents=True)
    assert_rounding_close(a.videos[0].latents, b.videos[0].latents, reduction=128, depth=6 * 16)  # 6 forwards
    sidecar = json.loads(a.videos[0].sidecar.read_text())
    assert sidecar["model"]["lora"][0]["path"] == str(export.resolve())


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_resume_is_bit_exact_with_lora(base, cache, tmp_path, optimizer) -> None:
    opts = dict(
        max_steps=4, checkpoint_every=2, ema_decay=0.8, ema_every=1, keep_last=None, optimizer=optimizer
    )
    full = api.train(config(base, cache, tmp_path / "full", **opts))
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-000002", part / "checkpoints" / "step-000002")
    resumed = api.train(config(base, cache, part, resume="latest", **opts))
    assert resumed.losses == full.losses[2:]
    for sub in ("model", "ema"):
        a = load_file(
            str(tmp_path / "full" / "checkpoints" / "step-000004" / sub / "adapter_model.safetensors")
        )
        b = load_file(str(part / "checkpoints" / "step-000004" / sub / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub
    opt_a = load_file(str(tmp_path / "full" / "checkpoints" / "step-000004" / "optimizer.safetensors"))
    opt_b = load_file(str(part / "checkpoints" / "step-000004" / "optimizer.safetensors"))
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)


def test_resume_refuses_another_rank_or_full_training(base, cache, tmp_path) -> None:
    from pfctl.errors import CheckpointError

    out = tmp_path / "run"
    api.train(config(base, cache, out, max_steps=1, export=False))
    with pytest.raises(CheckpointError, match="lora"):
        api.train(config(base, cache, out, max_steps=2, resume="latest", **{"lora.rank": 2}))
    with pytest.raises(CheckpointError, match=r"train\.lora\.enabled is False"):
        api.train(config(base, cache, out, max_steps=2, resume="latest", **{"lora.enabled": False}))


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; a bf16 run in a process that ran fp32 needs a reset."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow
def test_bf16_base_with_checkpointing_trains(base, cache, tmp_path, fresh_accelerator_state) -> None:
    from pfctl.training.trainer import Trainer

    cfg = config(base, cache, tmp_path / "bf16", "runtime.mixed_precision=bf16", max_steps=1, base_dtype="bf16",
                 gradient_checkpointing=True, gradient_checkpointing_ratio=1.0, optimizer="sgd_momentum")  # fmt: skip
    trainer = Trainer(cfg)
    trainer.setup()
    dtypes = {(".lora_" in n, p.dtype) for n, p in trainer.unwrapped.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    metrics = trainer.train_step()
    assert metrics is not None and metrics["grad_norm"] > 0
    trainer.close()


def test_bf16_base_without_autocast_is_a_config_error(base, cache, tmp_path) -> None:
    from pfctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"runtime\.mixed_precision=bf16"):
        api.train(config(base, cache, tmp_path / "x", max_steps=1, base_dtype="bf16"))
