"""`pfctl merge-lora`, `pfctl generate --lora` and the LoRA parts of `pfctl train` on the command line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers.tolerance import assert_rounding_close
from pfctl.cli.app import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), prog_name="pfctl")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.tiny_models import make_official_folder

    return make_official_folder(tmp_path_factory.mktemp("merge"), with_text=False)


@pytest.fixture(scope="module")
def adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA folder as a LoRA run exports it (non-zero B), on the base's DiT."""
    from pfctl.models.checkpoint import load_components
    from pfctl.models.lora import adapter_config_dict, add_lora, lora_state_dict, save_lora_folder

    dit = load_components(base, need=("dit",), dtype=torch.float32).dit
    names = add_lora(dit, rank=4, alpha=8, targets=["attn.to_q", "attn.to_v", "proj_mlp", "ff.net.2"])
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in dit.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    out = tmp_path_factory.mktemp("adapter") / "lora"
    marker = {"base_model_path": str(base.resolve()), "dit_class": type(dit).__name__, "rank": 4}
    return save_lora_folder(
        out, lora_state_dict(dit), adapter_config_dict(4, 8, 0.0, names, base), marker=marker
    )


def outputs(dit) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return dit(
            sample=[[torch.randn(1, 16, 2, 8, 8, generator=gen)]],
            encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
            encoder_attention_mask=torch.ones(1, 8, dtype=torch.long),
            pooled_projections=torch.randn(1, 24, generator=gen),
            timestep_ratio=torch.tensor([300.0]),
        )[0]


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_merged_export_equals_the_unmerged_adapter(base, adapter, tmp_path, scale) -> None:
    from pfctl.models.checkpoint import EXPORT_MARKER, load_components
    from pfctl.models.lora import apply_lora, read_lora

    out = tmp_path / "merged"
    result = invoke(
        "merge-lora", "--model", str(base), "--lora", str(adapter), "--scale", str(scale), "-o", str(out)
    )
    assert result.exit_code == 0, result.output
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["base_model_path"] == str(base.resolve())
    assert marker["extra"]["merged_loras"][0]["scale"] == scale
    merged = load_components(out, need=("dit", "vae"), dtype=torch.float32)  # VAE found through the base
    plain = load_components(base, need=("dit",), dtype=torch.float32).dit
    unmerged = copy.deepcopy(plain)
    apply_lora(unmerged, [read_lora(adapter, scale)])
    y_merged, y_unmerged, y_plain = outputs(merged.dit), outputs(unmerged), outputs(plain)
    # merged weights vs the adapter's product, read from disk (helpers.tolerance; at most 128 terms, 16 chained)
    assert_rounding_close(y_merged, y_unmerged, reduction=128, depth=16)
    assert not torch.allclose(y_merged, y_plain, atol=1e-4)


def test_merge_errors_exit_2(base, adapter, tmp_path) -> None:
    result = invoke(
        "merge-lora", "-m", str(base), "--lora", str(tmp_path / "nope"), "-o", str(tmp_path / "o")
    )
    assert result.exit_code == 2 and "does not exist" in result.output
    result = invoke("merge-lora", "-m", str(base), "--lora", str(adapter), "--lora", str(adapter),
                    "--scale", "1", "--scale", "2", "--scale", "3", "-o", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 2 and "3 --scale values for 2 --lora adapters" in result.output
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file.txt").write_text("mine")
    result = invoke("merge-lora", "-m", str(base), "--lora", str(adapter), "-o", str(busy))
    assert result.exit_code == 2 and "refusing to overwrite" in result.output


def test_generate_lora_flags_reach_the_config(monkeypatch) -> None:
    seen = {}

    def fake_generate(config, **kwargs):
        seen["config"] = config

        class Report:
            videos: list = []  # noqa: RUF012

        return Report()

    monkeypatch.setattr("pfctl.api.generate", fake_generate)
    result = invoke(
        "generate", "a cat", "--lora", "a/", "--lora", "b/", "--lora-scale", "0.5", "--lora-scale", "2"
    )
    assert result.exit_code == 0, result.output
    assert [(r.path, r.scale) for r in seen["config"].generate.lora] == [("a/", 0.5), ("b/", 2.0)]
    result = invoke("generate", "a cat", "--lora", "a/", "--lora", "b/", "--lora-scale", "0.7")
    assert [r.scale for r in seen["config"].generate.lora] == [0.7, 0.7]
    result = invoke("generate", "a cat", "--lora", "a/", "--lora-scale", "1", "--lora-scale", "2")
    assert result.exit_code == 2 and "2 --lora-scale values for 1 --lora adapters" in result.output


def test_train_dry_run_prints_the_memory_table_and_rejects_bad_lora(tmp_path) -> None:
    from pfctl.data.dataset import write_synthetic_cache

    cache = tmp_path / "cache"
    write_synthetic_cache(str(cache), [4] * 4, seed=1)
    common = ["train", "--dry-run", "--plan-steps", "1", "--set", "runtime.device=cpu", "--set",
              "model.dit_preset=tiny", "--set", f"train.cache={cache}", "--set", "train.max_units=4"]  # fmt: skip
    result = invoke(*common, "--set", "train.lora.enabled=true", "--set", "train.lora.rank=8")
    assert result.exit_code == 0, result.output
    for row in ("weights: frozen base", "weights: adapters", "gradients", "optimizer state",
                "activations: blocks", "estimated peak"):  # fmt: skip
        assert row in result.output, row
    result = invoke(*common, "--set", "train.lora.enabled=true", "--set", "train.lora.targets=[to_q, nope]")
    assert result.exit_code == 2 and "train.lora.targets: entry 'nope'" in result.output
    result = invoke(*common, "--set", "train.lora.rank=0")
    assert result.exit_code == 2 and "train.lora.rank" in result.output
