"""Parity of pfctl's CausalVideoVAE with the reference vectors (causal_vae/ and the VAE steps of generate/).

Cases are discovered from the files: every ``chunk_w{N}`` / ``decode.chunk_w{N}`` key, every entry
of ``tiled_meta.json`` (its call string gives tile size and chunking).

Tolerance: |ours - ref| <= rtol * max |ref|, with rtol the float32 rounding of the model's own sums
(helpers.tolerance: its widest convolution's ``channels * kernel volume`` terms, one sum per convolution
chained), so a vector set with a larger VAE gets the tolerance its sizes give. The differences are the
rounding noise of another float32 kernel order: an fp64 run of our model is as far from the reference
as from our fp32 output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.parity import vae_rtol
from helpers.tolerance import rounding_rtol
from pfctl.models.causal_vae import CausalVideoVAE
from pfctl.models.vae import FLUX_LATENT_NORM, denormalize_latents, normalize_latents
from pfctl.models.weights import load_into_module, load_weight_file

pytestmark = pytest.mark.parity

ELEMENTWISE = rounding_rtol(reduction=1, depth=2)
"""Latent (de)normalisation: a shift and a scale per element."""


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    """|ours - ref| <= rtol * max |ref| everywhere."""
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs().max().item()
    atol = rtol * ref.double().abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} (tolerance {atol:.3g} = {rtol:.3g} x max |ref|)"


def _require(vectors: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in vectors]
    if missing:
        pytest.skip(f"no {', '.join(missing)} in this vector set")


@pytest.fixture(scope="module")
def vae_dir(refdir: Path) -> Path:
    path = refdir / "causal_vae"
    if not (path / "vectors.safetensors").is_file():
        pytest.skip("causal_vae vectors missing")
    return path


@pytest.fixture(scope="module")
def vae(vae_dir: Path) -> CausalVideoVAE:
    kwargs = json.loads((vae_dir / "constructor_kwargs.json").read_text())
    model = CausalVideoVAE(**kwargs).eval()
    return load_into_module(model, load_weight_file(vae_dir / "state_dict.safetensors"), strict=True)


@pytest.fixture(scope="module")
def rtol(vae: CausalVideoVAE) -> float:
    return vae_rtol(vae)


@pytest.fixture(scope="module")
def vectors(vae_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(vae_dir / "vectors.safetensors"))


def _windows(keys, pattern: str) -> list[int]:
    found = sorted({int(m.group(1)) for k in keys if (m := re.fullmatch(pattern, k))})
    return found


def test_config_json_builds_same_model(vae_dir: Path, vae: CausalVideoVAE) -> None:
    config = json.loads((vae_dir / "config.json").read_text())
    model = CausalVideoVAE.from_config(config)
    ref_keys = {k: tuple(v.shape) for k, v in load_file(str(vae_dir / "state_dict.safetensors")).items()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == ref_keys


def test_full_encode(vae: CausalVideoVAE, vectors, rtol: float) -> None:
    _require(vectors, "video", "full.mean", "full.std")
    with torch.no_grad():
        post = vae.encode(vectors["video"])
    assert_close(post.mean, vectors["full.mean"], rtol, "full.mean")
    assert_close(post.std, vectors["full.std"], rtol, "full.std")
    if "full.logvar" in vectors:
        assert_close(post.logvar, vectors["full.logvar"], rtol, "full.logvar")
    if "full.moments" in vectors:
        assert_close(post.moments, vectors["full.moments"], rtol, "full.moments")


def test_chunked_encodes(vae: CausalVideoVAE, vectors, rtol: float) -> None:
    windows = _windows(vectors, r"chunk_w(\d+)\.mean")
    if not windows:
        pytest.skip("no chunk_w{N} encode vectors in this set")
    for w in windows:
        with torch.no_grad():
            post = vae.encode(vectors["video"], temporal_chunk=True, window_size=w)
        assert_close(post.mean, vectors[f"chunk_w{w}.mean"], rtol, f"chunk_w{w}.mean")
        assert_close(post.std, vectors[f"chunk_w{w}.std"], rtol, f"chunk_w{w}.std")


def test_full_decode(vae: CausalVideoVAE, vectors, rtol: float) -> None:
    _require(vectors, "decode_input_latent", "decode.full")
    with torch.no_grad():
        video = vae.decode(vectors["decode_input_latent"])
    assert_close(video, vectors["decode.full"], rtol, "decode.full")


def test_chunked_decodes(vae: CausalVideoVAE, vectors, rtol: float) -> None:
    windows = _windows(vectors, r"decode\.chunk_w(\d+)")
    if not windows:
        pytest.skip("no decode.chunk_w{N} vectors in this set")
    for w in windows:
        with torch.no_grad():
            video = vae.decode(vectors["decode_input_latent"], temporal_chunk=True, window_size=w)
        assert_close(video, vectors[f"decode.chunk_w{w}"], rtol, f"decode.chunk_w{w}")


def test_image_encode_decode(vae: CausalVideoVAE, vectors, rtol: float) -> None:
    _require(vectors, "image.video", "image.mean", "image.std", "image.decode")
    with torch.no_grad():
        post = vae.encode(vectors["image.video"])
        image = vae.decode(vectors["image.mean"])
    assert_close(post.mean, vectors["image.mean"], rtol, "image.mean")
    assert_close(post.std, vectors["image.std"], rtol, "image.std")
    assert_close(image, vectors["image.decode"], rtol, "image.decode")


def _tiled_cases(vae_dir: Path) -> list[tuple[str, str, dict]]:
    meta_path = vae_dir / "tiled_meta.json"
    if not meta_path.is_file():
        return []
    meta = json.loads(meta_path.read_text())
    return [(kind, key, entry) for kind in ("encode", "decode") for key, entry in meta.get(kind, {}).items()]


def _parse_call(call: str) -> dict:
    """Tile size and chunking from the recorded call string, e.g. ``vae.encode(video, temporal_chunk=True,
    window_size=8, tile_sample_min_size=32)``."""
    tile = re.search(r"tile_sample_min_size=(\d+)", call)
    window = re.search(r"window_size=(\d+)", call)
    return {
        "tile_sample_min_size": int(tile.group(1)) if tile else None,
        "temporal_chunk": "temporal_chunk=True" in call,
        "window_size": int(window.group(1)) if window else None,
    }


@pytest.mark.slow
def test_tiled(vae_dir: Path, vae: CausalVideoVAE, vectors, rtol: float) -> None:
    cases = _tiled_cases(vae_dir)
    if not cases:
        pytest.skip("no tiled vectors")
    meta = json.loads((vae_dir / "tiled_meta.json").read_text())
    tiled = load_file(str(vae_dir / "tiled.safetensors"))
    inputs = {kind: vectors[src.split(":", 1)[1]] for kind, src in meta["inputs"].items()}
    for kind, key, entry in cases:
        call = _parse_call(entry["call"])
        assert call["tile_sample_min_size"] == entry["geometry"]["tile_pixels"], key
        kwargs = {
            "tile_sample_min_size": call["tile_sample_min_size"],
            "temporal_chunk": call["temporal_chunk"],
        }
        if call["window_size"] is not None:
            kwargs["window_size"] = call["window_size"]
        with torch.no_grad():
            if kind == "encode":
                post = vae.encode(inputs["encode"], **kwargs)
                assert_close(post.mean, tiled[f"{key}.mean"], rtol, f"{key}.mean")
                assert_close(post.std, tiled[f"{key}.std"], rtol, f"{key}.std")
            else:
                video = vae.decode(inputs["decode"], **kwargs)
                assert_close(video, tiled[key], rtol, key)


def test_unusable_tile_sizes_are_refused(vae_dir: Path, vae: CausalVideoVAE, vectors) -> None:
    """The reference returns wrong shapes for these sizes (``probe`` in tiled_meta.json); we raise."""
    from pfctl.errors import ConfigError

    meta_path = vae_dir / "tiled_meta.json"
    if not meta_path.is_file():
        pytest.skip("no tiled meta")
    probe = json.loads(meta_path.read_text()).get("probe", {})
    for name, result in probe.items():
        size = int(name.lstrip("S"))
        wrong = result["encode"]["shape"] != result["encode"]["expected_shape"]
        if wrong:
            with pytest.raises(ConfigError, match=str(size)):
                vae.encode(vectors["video"][:, :, :1], tile_sample_min_size=size)


# ---- the VAE steps of the generate/ vectors: de-normalisation + low-memory decode ------------------


def _generate_dirs(refdir: Path) -> list[Path]:
    return [p for p in sorted(refdir.glob("generate*")) if (p / "generate.safetensors").is_file()]


@pytest.mark.slow
def test_generate_denormalize_and_decode(refdir: Path, vae: CausalVideoVAE, rtol: float) -> None:
    dirs = _generate_dirs(refdir)
    if not dirs:
        pytest.skip("no generate vectors")
    for path in dirs:
        data = load_file(str(path / "generate.safetensors"))
        z = denormalize_latents(data["final_latents"], FLUX_LATENT_NORM)
        assert_close(z, data["decode.vae_input"], ELEMENTWISE, f"{path.name} decode.vae_input")
        meta_path = path / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if "decode.vae_output" in data and "vae_decode_kwargs" in meta:
            # the decode call the run recorded (chunking, window, tile size)
            recorded = meta["vae_decode_kwargs"]
            names = ("temporal_chunk", "window_size", "tile_sample_min_size")
            kwargs = {k: recorded[k] for k in names if k in recorded}
            with torch.no_grad():
                video = vae.decode(z, **kwargs)
            assert_close(video, data["decode.vae_output"], rtol, f"{path.name} decode.vae_output")


def test_normalize_matches_training_and_i2v(refdir: Path) -> None:
    checked = 0
    no_ar = refdir / "train_noise_no_ar" / "forward.safetensors"
    if no_ar.is_file():
        data = load_file(str(no_ar))
        assert_close(
            normalize_latents(data["vae_latent_raw"], FLUX_LATENT_NORM), data["clean_latent"], ELEMENTWISE, "no_ar"
        )
        checked += 1
    i2v = refdir / "generate_i2v" / "generate_i2v.safetensors"
    if i2v.is_file():
        data = load_file(str(i2v))
        ours = normalize_latents(data["image_latent_sample"], FLUX_LATENT_NORM)
        assert_close(ours, data["image_latent"], ELEMENTWISE, "i2v image_latent")
        checked += 1
    if not checked:
        pytest.skip("no normalisation vectors")


def test_real_size_keys_and_shapes(refdir: Path) -> None:
    """The released VAE's config builds a model with exactly the released key/shape list (meta device)."""
    path = refdir / "real_size_state_dict_shapes.json"
    if not path.is_file():
        pytest.skip("no real-size shape list")
    entry = json.loads(path.read_text()).get("causal_video_vae")
    if entry is None:
        pytest.skip("no causal_video_vae entry")
    config = {**entry["config_json"], **entry.get("constructor_overrides", {})}
    with torch.device("meta"):
        model = CausalVideoVAE.from_config(config)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == {k: list(s) for k, s in entry["keys"]}
    assert sum(v.numel() for v in model.state_dict().values()) == entry["num_elements"]


def test_i2v_image_posterior(refdir: Path, vae: CausalVideoVAE, rtol: float) -> None:
    """generate_i2v encodes its image with default arguments and samples mean + std * eps."""
    path = refdir / "generate_i2v" / "generate_i2v.safetensors"
    if not path.is_file():
        pytest.skip("no i2v vectors")
    data = load_file(str(path))
    with torch.no_grad():
        post = vae.encode(data["image_tensor"])
    assert_close(post.mean, data["image_posterior.mean"], rtol, "i2v image_posterior.mean")
    assert_close(post.std, data["image_posterior.std"], rtol, "i2v image_posterior.std")
    assert_close(post.logvar, data["image_posterior.logvar"], rtol, "i2v image_posterior.logvar")
    sample = post.mean + post.std * data["image_posterior_noise"]
    assert_close(sample, data["image_latent_sample"], rtol, "i2v image_latent_sample")
