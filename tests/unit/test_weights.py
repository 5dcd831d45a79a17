"""Safe weight loading: safetensors, shards, pickles only via weights_only=True, strict checks, conversion."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pfctl.errors import ModelLoadError
from pfctl.models import weights as W
from pfctl.models.causal_vae import CausalVideoVAE
from pfctl.models.vae import PyramidCausalVAE, build_tiny_causal_vae, load_vae


class _Touch:
    """A pickle payload that creates a file when unpickled (stands in for arbitrary code)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _sd(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_safetensors_and_pickle_load(tmp_path: Path) -> None:
    model = _model()
    save_file(_sd(model), tmp_path / "a.safetensors")
    torch.save(_sd(model), tmp_path / "b.bin")
    torch.save({"state_dict": _sd(model), "step": 3}, tmp_path / "c.pt")
    for name in ("a.safetensors", "b.bin", "c.pt"):
        loaded = W.load_weight_file(tmp_path / name)
        assert loaded.keys() == model.state_dict().keys()
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_malicious_pickle_is_refused(tmp_path: Path) -> None:
    # the payload is live: plain unpickling would create the file ...
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Touch(probe))).close()
    assert probe.exists()
    # ... but pfctl never runs it
    marker = tmp_path / "pwned"
    path = tmp_path / "diffusion_pytorch_model.bin"
    torch.save({"weight": torch.zeros(2), "payload": _Touch(marker)}, path)
    with pytest.raises(ModelLoadError) as info:
        W.load_weight_file(path)
    assert str(path) in info.value.message and info.value.hint
    assert not marker.exists()
    with pytest.raises(ModelLoadError):
        W.convert_folder_to_safetensors(tmp_path)
    assert not marker.exists()


def test_pickles_read_with_weights_only(tmp_path: Path, monkeypatch) -> None:
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    folder = tmp_path / "vae"
    build_tiny_causal_vae().save_pretrained(folder)
    sd = W.load_weight_file(folder / "diffusion_pytorch_model.safetensors")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    torch.save(sd, folder / "diffusion_pytorch_model.bin")  # the official VAE ships a pickle
    vae = load_vae(folder)
    assert isinstance(vae, PyramidCausalVAE)
    assert seen == [True]


def _folder_with(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")
    return folder


def test_missing_key_names_key_and_file(tmp_path: Path) -> None:
    model = _model()
    sd = _sd(model)
    del sd["2.bias"]
    folder = _folder_with(tmp_path, sd)
    with pytest.raises(ModelLoadError) as info:
        W.load_into_module(_model(), W.load_folder_weights(folder))
    assert "'2.bias'" in info.value.message
    assert "diffusion_pytorch_model.safetensors" in info.value.message


def test_unexpected_key_names_key_and_file(tmp_path: Path) -> None:
    sd = _sd(_model())
    sd["extra.weight"] = torch.zeros(1)
    folder = _folder_with(tmp_path, sd)
    with pytest.raises(ModelLoadError) as info:
        W.load_into_module(_model(), W.load_folder_weights(folder))
    assert "'extra.weight'" in info.value.message
    assert "diffusion_pytorch_model.safetensors" in info.value.message
    # non-strict ignores extras but still needs every model key
    W.load_into_module(_model(), W.load_folder_weights(folder), strict=False)


def test_shape_mismatch_names_key_and_file(tmp_path: Path) -> None:
    sd = _sd(_model())
    sd["0.weight"] = torch.zeros(5, 3)
    folder = _folder_with(tmp_path, sd)
    with pytest.raises(ModelLoadError) as info:
        W.load_into_module(_model(), W.load_folder_weights(folder))
    msg = info.value.message
    assert "'0.weight'" in msg and "diffusion_pytorch_model.safetensors" in msg and "(5, 3)" in msg


def test_sharded_safetensors(tmp_path: Path) -> None:
    model = _model()
    sd = _sd(model)
    folder = tmp_path / "sharded"
    folder.mkdir()
    names = {"0.weight": "m-1.safetensors", "0.bias": "m-1.safetensors"}
    names.update({k: "m-2.safetensors" for k in sd if k not in names})
    for shard in set(names.values()):
        save_file({k: v for k, v in sd.items() if names[k] == shard}, folder / shard)
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    loaded = W.load_folder_weights(folder)
    assert loaded.sources["2.weight"].name == "m-2.safetensors"
    W.load_into_module(_model(), loaded)
    # a key the index promises but its shard lacks
    names["ghost"] = "m-2.safetensors"
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    with pytest.raises(ModelLoadError, match="ghost"):
        W.load_folder_weights(folder)
    (folder / "m-2.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=re.escape("m-2.safetensors")):
        W.load_folder_weights(folder)


def test_convert_folder_then_load_without_pickle(tmp_path: Path, monkeypatch) -> None:
    model = build_tiny_causal_vae()
    folder = tmp_path / "vae"
    model.save_pretrained(folder)
    sd = W.load_weight_file(folder / "diffusion_pytorch_model.safetensors")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    torch.save(sd, folder / "diffusion_pytorch_model.bin")
    written = W.convert_folder_to_safetensors(folder)
    assert [p.name for p in written] == ["diffusion_pytorch_model.safetensors"]
    assert (folder / "diffusion_pytorch_model.bin").exists()  # originals kept by default

    def no_pickles(*args, **kwargs):
        raise AssertionError("torch.load called after conversion")

    monkeypatch.setattr(torch, "load", no_pickles)
    vae = load_vae(folder)
    assert vae.fingerprint() == PyramidCausalVAE(model).fingerprint()
    loaded = CausalVideoVAE.from_pretrained(folder)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_convert_sharded_pickles(tmp_path: Path) -> None:
    sd = _sd(_model())
    folder = tmp_path / "bins"
    folder.mkdir()
    names = {k: ("p-1.bin" if k.startswith("0.") else "p-2.bin") for k in sd}
    for shard in set(names.values()):
        torch.save({k: v for k, v in sd.items() if names[k] == shard}, folder / shard)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": names}))
    W.convert_folder_to_safetensors(folder, remove_pickles=True)
    assert sorted(p.name for p in folder.iterdir()) == [
        "p-1.safetensors",
        "p-2.safetensors",
        "pytorch_model.safetensors.index.json",
    ]
    loaded = W.load_folder_weights(folder, stem="pytorch_model")
    W.load_into_module(_model(), loaded)


def test_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        W.load_folder_weights(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no weight file"):
        W.load_folder_weights(empty)
    truncated = tmp_path / "trunc"
    truncated.mkdir()
    (truncated / "diffusion_pytorch_model.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(ModelLoadError, match=re.escape("diffusion_pytorch_model.safetensors")):
        W.load_folder_weights(truncated)
    notdict = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], notdict)
    with pytest.raises(ModelLoadError, match=re.escape("list.pt")):
        W.load_weight_file(notdict)
