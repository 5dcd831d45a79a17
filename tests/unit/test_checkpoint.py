"""Checkpoint folders (official layout, pfctl exports, fine-tuned DiT files) and the DiT registry."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.tiny_models import make_official_folder, tiny_dit
from pfctl.errors import CheckpointError, ConfigError, ModelLoadError
from pfctl.models.checkpoint import (
    EXPORT_MARKER,
    build_dit_from_config,
    convert_to_safetensors,
    load_components,
    load_dit_checkpoint,
    save_export,
)
from pfctl.models.registry import PRESETS, build_dit, get_preset, preset_config
from pfctl.models.text_encoder import FluxTextEncoder

VARIANT = "diffusion_transformer_384p"
DIT_FILE = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return make_official_folder(tmp_path_factory.mktemp("ckpt"), seed=0)


@pytest.fixture
def official_copy(official, tmp_path):
    return shutil.copytree(official, tmp_path / "copy")


class _Payload:
    """Stands for any pickled object that is not a tensor/container: weights_only must refuse it."""


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- official layout ---------------------------------------------------------------------------


def test_official_folder_loads_everything(official):
    comps = load_components(official, dtype=torch.float32)
    expected = tiny_dit("tiny", seed=0)
    assert _state_equal(comps.dit, expected)
    assert not comps.dit.training
    assert comps.vae.name == "pyramid-causal-vae" and comps.vae.latent_channels == 16
    assert isinstance(comps.text_encoder, FluxTextEncoder)
    assert comps.model_name == "pyramid_flux"
    info = comps.info
    assert info["layout"] == "official" and info["dit_class"] == "PyramidFluxTransformer"
    assert set(info["fingerprints"]) == {"dit", "vae", "text"}
    # the text encoder feeds the DiT: widths agree
    emb = comps.text_encoder.encode(["a red circle"])
    assert emb.dim == comps.dit.config.joint_attention_dim
    assert emb.pooled_dim == comps.dit.config.pooled_projection_dim


def test_need_subset_and_dtype(official):
    comps = load_components(official, need=("dit",), dtype=torch.bfloat16)
    assert comps.vae is None and comps.text_encoder is None
    assert next(comps.dit.parameters()).dtype == torch.bfloat16
    comps = load_components(official, need=("text",), dtype=torch.float32)
    assert comps.dit is None and comps.text_encoder is not None
    with pytest.raises(ConfigError, match="need="):
        load_components(official, need=("dit", "unet"))


def test_pickles_are_read_only_with_weights_only(official, monkeypatch):
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    load_components(official, need=("vae",), dtype=torch.float32)  # the official .bin VAE
    assert calls and all(w is True for w in calls)


def test_malicious_pickle_is_refused(tmp_path):
    dit = tiny_dit("tiny")
    bad = tmp_path / "ft.bin"
    torch.save({"obj": _Payload(), **dit.state_dict()}, bad)
    with pytest.raises(ModelLoadError, match=r"ft\.bin"):
        load_dit_checkpoint(dit, bad)
    with pytest.raises(pickle.UnpicklingError):  # sanity: the file really needs full unpickling
        torch.load(bad, weights_only=True)


def test_missing_vae_subfolder(official_copy):
    shutil.rmtree(official_copy / "causal_video_vae")
    with pytest.raises(ModelLoadError, match="causal_video_vae/") as err:
        load_components(official_copy, dtype=torch.float32)
    assert err.value.hint
    load_components(official_copy, need=("dit", "text"), dtype=torch.float32)  # the rest still loads


def test_missing_text_subfolder(official_copy):
    shutil.rmtree(official_copy / "text_encoder_2")
    with pytest.raises(ModelLoadError, match="text_encoder_2/"):
        load_components(official_copy, need=("text",), dtype=torch.float32)


def test_missing_variant_lists_available(official):
    with pytest.raises(ModelLoadError, match="diffusion_transformer_768p/") as err:
        load_components(official, variant="diffusion_transformer_768p", need=("dit",))
    assert VARIANT in str(err.value)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_components(tmp_path / "nope")


def test_shape_mismatch_names_file_and_key(official_copy):
    cfg_path = official_copy / VARIANT / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pooled_projection_dim"] = cfg["pooled_projection_dim"] + 8
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"shape mismatch.*time_text_embed\.text_embedder") as err:
        load_components(official_copy, need=("dit",))
    assert DIT_FILE in str(err.value)


def test_missing_and_unexpected_keys_named(official_copy):
    path = official_copy / VARIANT / DIT_FILE
    state = load_file(str(path))
    victim = sorted(state)[0]
    missing = {k: v for k, v in state.items() if k != victim}
    save_file(missing, str(path))
    with pytest.raises(ModelLoadError, match=victim.replace(".", r"\.")) as err:
        load_components(official_copy, need=("dit",))
    assert "missing" in str(err.value) and DIT_FILE in str(err.value)
    save_file({**state, "extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ModelLoadError, match=r"unexpected.*extra\.weight") as err:
        load_components(official_copy, need=("dit",))
    assert DIT_FILE in str(err.value)


def test_unknown_class_name_lists_supported(official_copy):
    cfg_path = official_copy / VARIANT / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["_class_name"] = "UNet3DConditionModel"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="UNet3DConditionModel") as err:
        load_components(official_copy, need=("dit",))
    assert "PyramidFluxTransformer" in str(err.value) and "PyramidDiffusionMMDiT" in str(err.value)


def test_model_name_must_agree(official):
    with pytest.raises(ConfigError, match="pyramid_flux"):
        load_components(official, need=("dit",), model_name="pyramid_mmdit")


def test_flux_axes_default_only_when_absent(official_copy):
    cfg_path = official_copy / VARIANT / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["axes_dims_rope"] == [4, 6, 6]
    dit = load_components(official_copy, need=("dit",)).dit
    assert list(dit.config.axes_dims_rope) == [4, 6, 6]  # the config wins over the reference's forcing
    del cfg["axes_dims_rope"]
    with torch.device("meta"):
        built = build_dit_from_config({**cfg, "attention_head_dim": 64})
    assert list(built.config.axes_dims_rope) == [16, 24, 24]


def test_dit_overrides(official):
    dit = load_components(official, need=("dit",), dit_overrides={"use_temporal_causal": False}).dit
    assert dit.config.use_temporal_causal is False
    with pytest.raises(ConfigError, match="not_a_flag"):
        load_components(official, need=("dit",), dit_overrides={"not_a_flag": 1})


def test_pickled_dit_and_conversion(official_copy, monkeypatch):
    folder = official_copy / VARIANT
    state = load_file(str(folder / DIT_FILE))
    (folder / DIT_FILE).unlink()
    torch.save(state, folder / "diffusion_pytorch_model.bin")
    dit = load_components(official_copy, need=("dit",), dtype=torch.float32).dit
    assert _state_equal(dit, tiny_dit("tiny", seed=0))
    written = convert_to_safetensors(folder)
    assert [p.name for p in written] == [DIT_FILE]

    def refuse(*args, **kwargs):
        raise AssertionError("a converted folder must not unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    assert _state_equal(load_components(official_copy, need=("dit",), dtype=torch.float32).dit, dit)


def test_bare_dit_folder(official):
    comps = load_components(official / VARIANT, need=("dit",))
    assert comps.info["layout"] == "dit-folder"
    with pytest.raises(ModelLoadError, match="bare DiT folder"):
        load_components(official / VARIANT, need=("dit", "vae"))


def test_text_dims_mismatch_is_explained(tmp_path, official):
    root = make_official_folder(tmp_path, dit_overrides={"pooled_projection_dim": 40}, with_vae=False)
    with pytest.raises(ModelLoadError, match="pooled_projection_dim 40"):
        load_components(root, need=("dit", "text"))


# -- fine-tuned reference checkpoints ----------------------------------------------------------


def test_reference_finetuned_checkpoint(tmp_path):
    source = tiny_dit("tiny", seed=3)
    target = tiny_dit("tiny", seed=4)
    ckpt = {f"dit.{k}": v for k, v in source.state_dict().items()}
    ckpt["vae.encoder.conv_in.weight"] = torch.zeros(1)
    ckpt["text_encoder.x"] = torch.zeros(1)
    path = tmp_path / "checkpoint.pth"
    torch.save(ckpt, path)
    load_dit_checkpoint(target, path)
    assert _state_equal(source, target)
    bad = tmp_path / "bad.pth"
    torch.save({**ckpt, "dit.extra.bias": torch.zeros(1)}, bad)
    with pytest.raises(ModelLoadError, match=r"extra\.bias"):
        load_dit_checkpoint(target, bad)


def test_dit_checkpoint_through_load_components(tmp_path, official):
    source = tiny_dit("tiny", seed=5)
    path = tmp_path / "ft.pth"
    torch.save(source.state_dict(), path)
    comps = load_components(official, need=("dit",), dit_checkpoint=path, dtype=torch.float32)
    assert _state_equal(comps.dit, source)
    plain = load_components(official, need=("dit",))
    assert comps.info["fingerprints"]["dit"] != plain.info["fingerprints"]["dit"]


# -- exports -----------------------------------------------------------------------------------


def test_export_round_trip(tmp_path, official):
    dit = tiny_dit("tiny", seed=7)
    ema = tiny_dit("tiny", seed=8)
    out = save_export(
        tmp_path / "export",
        dit,
        base_model_path=official,
        ema_dit=ema,
        config_yaml="train:\n  steps: 3\n",
        extra={"step": 3},
    )
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["format"] == "pfctl-export" and marker["format_version"] == 1
    assert marker["transformer_ema"] == "transformer_ema" and marker["extra"] == {"step": 3}
    assert (out / "config.yaml").read_text() == "train:\n  steps: 3\n"
    assert (out / "transformer" / DIT_FILE).is_file()
    assert not list(out.rglob("*.bin"))  # we write safetensors only

    comps = load_components(out, dtype=torch.float32)
    assert comps.info["layout"] == "export"
    assert _state_equal(comps.dit, dit)
    assert comps.vae is not None and comps.text_encoder is not None  # from base_model_path
    assert comps.info["text_path"] == str(official.resolve())
    ema_loaded = load_components(out, need=("dit",), use_ema=True, dtype=torch.float32).dit
    assert _state_equal(ema_loaded, ema)

    # a second export to the same folder replaces it
    save_export(out, ema, base_model_path=None)
    again = load_components(out, need=("dit",), dtype=torch.float32)
    assert _state_equal(again.dit, ema)
    with pytest.raises(ModelLoadError, match="EMA"):
        load_components(out, need=("dit",), use_ema=True)
    with pytest.raises(ModelLoadError, match="causal_video_vae/"):
        load_components(out, need=("vae",))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_export_refuses_foreign_folder(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a pfctl export"):
        save_export(tmp_path / "busy", tiny_dit("tiny"), base_model_path=None)
    with pytest.raises(CheckpointError, match="base_model_path"):
        save_export(tmp_path / "new", tiny_dit("tiny"), base_model_path=tmp_path / "missing")


def test_export_with_newer_format_is_refused(tmp_path):
    out = save_export(tmp_path / "e", tiny_dit("tiny"), base_model_path=None)
    marker = json.loads((out / EXPORT_MARKER).read_text())
    marker["format_version"] = 99
    (out / EXPORT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(ModelLoadError, match="format_version 99"):
        load_components(out, need=("dit",))


# -- MMDiT -------------------------------------------------------------------------------------


def test_mmdit_folder(tmp_path):
    pytest.importorskip("pfctl.models.dit_mmdit")
    root = make_official_folder(tmp_path, dit_preset="mmdit-tiny", with_vae=False)
    comps = load_components(root, need=("dit", "text"), dtype=torch.float32)
    assert comps.model_name == "pyramid_mmdit"
    assert comps.text_encoder.pooled_dim == comps.dit.config.pooled_projection_dim


# -- registry ----------------------------------------------------------------------------------


def test_registry_errors():
    with pytest.raises(ConfigError, match="unknown DiT preset 'huge'") as err:
        build_dit("huge")
    assert "miniflux" in err.value.hint and "tiny" in err.value.hint
    with pytest.raises(ConfigError, match="num_layerz"):
        build_dit("tiny", {"num_layerz": 3})


def test_registry_builds_with_overrides():
    model = build_dit("tiny", {"num_single_layers": 2}, seed=0)
    assert model.config.num_single_layers == 2
    again = build_dit("tiny", {"num_single_layers": 2}, seed=0)
    assert _state_equal(model, again)
    assert preset_config("tiny") == get_preset("tiny").config  # overrides never leak into presets
    for name in ("tiny", "shapes-tiny"):
        with torch.device("meta"):
            build_dit(name)


@pytest.mark.parametrize("preset", ["miniflux", "sd3-mmdit"])
def test_real_size_presets_match_published_shapes(refdir, preset):
    """The preset equals the published config (+ the reference's load-time arguments) and builds
    exactly the published key -> shape list."""
    real = json.loads((refdir / "real_size_state_dict_shapes.json").read_text())
    class_name = PRESETS[preset].class_name
    entry = next(v for v in real.values() if v["config_json"]["_class_name"] == class_name)
    published = {**entry["config_json"], **entry.get("constructor_overrides", {})}
    config = PRESETS[preset].config
    for key, value in published.items():
        if key in config:
            assert config[key] == value, key
    with torch.device("meta"):
        model = build_dit(preset)
        loaded = build_dit_from_config(entry["config_json"])  # the loader's defaults fill the rest
    expected = {k: list(s) for k, s in entry["keys"]}
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == expected
    assert {k: list(v.shape) for k, v in loaded.state_dict().items()} == expected
    for key, value in entry.get("constructor_overrides", {}).items():
        assert loaded.config[key] == value, key
