"""`pfctl export`: pfctl exports, checkpoints and LoRA exports → the official Pyramid Flow layout.

Tiny models built in the test (tests/helpers/tiny_models.py); the real-size key list and config fields
come from the reference vectors' ``real_size_state_dict_shapes.json`` (read, never copied).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pfctl.cli.app import app
from pfctl.errors import CheckpointError, ConfigError
from pfctl.models.checkpoint import load_components, save_dit_folder, save_export
from pfctl.models.official import PROVENANCE, check_variant
from pfctl.training.export import export_official

VARIANT = "diffusion_transformer_384p"
AUX = ("causal_video_vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from helpers.tiny_models import make_official_folder

    return make_official_folder(tmp_path_factory.mktemp("base"), variant=VARIANT)


@pytest.fixture(scope="module")
def export(base, tmp_path_factory) -> Path:
    from helpers.tiny_models import tiny_dit

    out = tmp_path_factory.mktemp("run") / "export"
    return save_export(
        out,
        tiny_dit(seed=1),
        base_model_path=base,
        ema_dit=tiny_dit(seed=2),
        config_yaml=f"model:\n  path: {base}\n  variant: {VARIANT}\n",
        extra={"steps": 7},
    )


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:  # the same numbers read back from disk: no arithmetic, so bit for bit
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_export_writes_the_official_tree_with_the_ema_weights(export, base, tmp_path):
    report = export_official(export, tmp_path / "official")
    out = report.output_dir
    assert (report.kind, report.weights, report.variant) == ("export", "ema", VARIANT)
    assert sorted(p.name for p in out.iterdir()) == sorted([VARIANT, *AUX, PROVENANCE])
    _assert_same_state(_state(out / VARIANT), _state(export / "transformer_ema"))
    config = json.loads((out / VARIANT / "config.json").read_text())
    assert config == json.loads((export / "transformer_ema" / "config.json").read_text())
    for name in AUX:  # the base's files, linked or copied, unchanged
        for f in (base / name).rglob("*"):
            if f.is_file():
                assert (out / name / f.relative_to(base / name)).read_bytes() == f.read_bytes()
    provenance = json.loads((out / PROVENANCE).read_text())
    assert provenance["weights"] == "ema" and provenance["steps"] == 7
    assert provenance["base_model_path"] == str(base.resolve())


def test_the_folder_honours_the_umask(export, tmp_path):
    old = os.umask(0o027)
    try:
        out = export_official(export, tmp_path / "o").output_dir
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / PROVENANCE).stat().st_mode) == 0o640


def test_no_ema_and_dtype_and_variant(export, tmp_path):
    report = export_official(
        export, tmp_path / "o", ema=False, dtype="bf16", variant="diffusion_transformer_768p"
    )
    state = _state(report.output_dir / "diffusion_transformer_768p")
    raw = _state(export / "transformer")
    assert report.weights == "raw" and all(t.dtype == torch.bfloat16 for t in state.values())
    for key, t in raw.items():
        assert torch.equal(state[key], t.to(torch.bfloat16)), key


def test_loading_the_official_folder_gives_the_weights_back(export, tmp_path):
    out = export_official(export, tmp_path / "o").output_dir
    a = load_components(out, variant=VARIANT, need=("dit",), dtype=torch.float32).dit
    b = load_components(export, need=("dit",), dtype=torch.float32, use_ema=True).dit
    _assert_same_state(a.state_dict(), b.state_dict())


def test_checkpoint_step_folder_reads_its_run_config(base, tmp_path):
    from helpers.tiny_models import tiny_dit

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-000003"
    save_dit_folder(tiny_dit(seed=3), step / "model")
    (step / "train_state.json").write_text(json.dumps({"step": 3}))
    (run / "config.yaml").write_text(f"model:\n  path: {base}\n  variant: {VARIANT}\n")
    report = export_official(step, tmp_path / "o")
    assert (report.kind, report.weights, report.variant) == ("checkpoint", "raw", VARIANT)
    assert report.provenance["steps"] == 3
    _assert_same_state(_state(report.output_dir / VARIANT), _state(step / "model"))


def test_lora_export_equals_merge_lora_then_export(base, tmp_path):
    from pfctl.models.lora import (
        adapter_config_dict,
        add_lora,
        lora_state_dict,
        merge_lora_into_export,
        save_lora_folder,
    )

    dit = load_components(base, variant=VARIANT, need=("dit",), dtype=torch.float32).dit
    targets = add_lora(dit, rank=2, alpha=2.0, targets=["attn.to_q", "attn.to_v"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    lora = save_lora_folder(
        tmp_path / "lora",
        lora_state_dict(dit),
        adapter_config_dict(2, 2.0, 0.0, targets, str(base)),
        marker={"base_model_path": str(base), "variant": VARIANT, "dit_class": type(dit).__name__},
    )
    direct = export_official(lora, tmp_path / "direct")
    merged = merge_lora_into_export(base, [(lora, 1.0)], tmp_path / "merged", variant=VARIANT).output_dir
    via_merge = export_official(merged, tmp_path / "via-merge")
    assert direct.kind == "lora" and direct.provenance["merged_loras"][0]["path"] == str(lora.resolve())
    # the same merge of the same files on both paths
    _assert_same_state(_state(direct.output_dir / VARIANT), _state(via_merge.output_dir / VARIANT))
    base_state = _state(base / VARIANT)
    assert not torch.equal(_state(direct.output_dir / VARIANT)["transformer_blocks.0.attn.to_q.weight"],
                           base_state["transformer_blocks.0.attn.to_q.weight"])  # fmt: skip


def test_refusals_name_the_problem(export, base, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        export_official(export, tmp_path / "taken")
    with pytest.raises(ConfigError, match="not something pfctl trained"):
        export_official(base, tmp_path / "o")
    with pytest.raises(ConfigError, match="not an official DiT folder name"):
        export_official(export, tmp_path / "o", variant="transformer")
    with pytest.raises(ConfigError, match="dtype"):
        export_official(export, tmp_path / "o", dtype="int8")
    assert not (tmp_path / "o").exists()
    assert check_variant("diffusion_transformer_64p") == "diffusion_transformer_64p"


def test_cli_exit_codes(export, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["export", str(export), "-o", str(tmp_path / "o")])
    assert ok.exit_code == 0, ok.output
    again = runner.invoke(app, ["export", str(export), "-o", str(tmp_path / "o")])
    assert again.exit_code == 2 and "refusing to overwrite" in again.output


def test_real_size_keys_and_config_fields_are_the_references(refdir):
    """A real-size DiT built on the meta device exports exactly the reference's keys, shapes and config fields."""
    from pfctl.models.checkpoint import _config_dict, build_dit_from_config

    table = json.loads((refdir / "real_size_state_dict_shapes.json").read_text())
    dits = {k: v for k, v in table.items() if v["config_json"].get("_class_name", "").startswith("Pyramid")}
    assert dits, "the vector set names no DiT"
    for name, entry in dits.items():
        config = {**entry["config_json"], **(entry.get("constructor_overrides") or {})}
        with torch.device("meta"):
            dit = build_dit_from_config(config)
        shapes = {k: list(v.shape) for k, v in dit.state_dict().items()}
        assert shapes == {k: list(s) for k, s in entry["keys"]}, name
        written = _config_dict(dit)
        reference_fields = {k for k in entry["config_json"] if not k.startswith("_")}
        assert reference_fields <= set(written), (name, reference_fields - set(written))
        assert written["_class_name"] == entry["config_json"]["_class_name"]


@pytest.mark.slow
def test_generate_from_the_official_folder_equals_the_pfctl_export(export, tmp_path):
    from pfctl.config import load_config
    from pfctl.config.schema import RuntimeConfig
    from pfctl.runtime.accelerator import build_runtime
    from pfctl.sampling.generate import run_generate

    official = export_official(export, tmp_path / "official").output_dir
    runtime = build_runtime(RuntimeConfig(device="cpu"))
    latents = []
    for path, extra in ((export, []), (official, [f"model.variant={VARIANT}"])):
        config = load_config(
            None,
            [f"model.path={path}", f"generate.output_dir={tmp_path / path.name}", "runtime.device=cpu",
             "generate.width=64", "generate.height=64", "generate.strict_resolution=false", "generate.temp=2",
             "generate.num_inference_steps=[1,1,1]", "generate.video_num_inference_steps=[1,1,1]", *extra],
        )  # fmt: skip
        (video,) = run_generate(
            config, ["a red circle moving left"], runtime=runtime, keep_latents=True
        ).videos
        latents.append(video.latents)
    # the same weights and text encoders, loaded from two folders: equal up to fp32 rounding of the
    # sampler (weights at other addresses may take other CPU kernels; see the README on portability)
    torch.testing.assert_close(latents[1], latents[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["both", "official"])
def test_train_writes_the_official_folder_at_its_end(base, tmp_path, fmt):
    from pfctl import api
    from pfctl.config import load_config
    from pfctl.data.dataset import write_synthetic_cache

    write_synthetic_cache(str(tmp_path / "cache"), [2] * 8, seed=0)
    overrides = {
        "runtime.device": "cpu", "model.path": str(base), "model.variant": VARIANT,
        "train.cache": str(tmp_path / "cache"), "train.output_dir": str(tmp_path / "out"), "train.batch_size": 4,
        "train.max_units": 2, "train.max_steps": 2, "train.warmup_steps": 1, "train.checkpoint_every": 1000,
        "train.ema_decay": 0.9, "train.export_format": fmt,
    }  # fmt: skip
    api.train(load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()]))
    official = tmp_path / "out" / "export-official"
    assert (official / VARIANT / "config.json").is_file() and (official / "causal_video_vae").is_dir()
    assert json.loads((official / PROVENANCE).read_text())["weights"] == "ema"
    assert (tmp_path / "out" / "export").is_dir() == (fmt == "both")
    # the run's final EMA weights, as its last checkpoint holds them
    _assert_same_state(
        _state(official / VARIANT), _state(tmp_path / "out" / "checkpoints" / "step-000002" / "ema")
    )
