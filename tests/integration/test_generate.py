"""`generate` end to end with a tiny official folder, plus parity of the decode path.

Model tests build one tiny checkpoint folder per module (tests/helpers/tiny_models.py) and load it
once; each run samples a 64x64 video with 1-2 steps per stage. Parity tests read the reference
vectors (``refdir``) and discover their cases from the files present.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.parity import vae_rtol
from helpers.tiny_models import FAST_GENERATE
from helpers.tolerance import assert_rounding_close, rounding_rtol
from pfctl.config import load_config
from pfctl.config.generate import PromptSpec
from pfctl.errors import ConfigError, InputError, ModelLoadError
from pfctl.sampling.decode import decode_latents, encode_image_latent, prepare_image
from pfctl.sampling.generate import run_generate
from pfctl.sampling.sidecar import load_sidecar, sidecar_to_run

FAST = FAST_GENERATE


@pytest.fixture(scope="module")
def components(model_dir):
    from pfctl.models.checkpoint import load_components

    return load_components(model_dir, dtype=torch.float32, device="cpu")


def make_config(model_dir: Path, out: Path, *overrides: str):
    return load_config(None, [f"model.path={model_dir}", f"generate.output_dir={out}", *FAST, *overrides])


def read_video(path: Path) -> tuple[np.ndarray, float]:
    import decord

    reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
    return reader.get_batch(list(range(len(reader)))).asnumpy(), reader.get_avg_fps()


# -- text-to-video ---------------------------------------------------------------------------------


def test_t2v_writes_mp4_and_sidecar_and_reproduces_from_it(model_dir, components, runtime, tmp_path):
    out = tmp_path / "out"
    config = make_config(model_dir, out, "generate.temp=3", "generate.seed=11")
    # Loaded from model.path (the real loading path), not from the fixture's components.
    report = run_generate(config, ["a red circle moving left"], runtime=runtime)
    (video,) = report.videos
    frames, fps = read_video(video.path)
    assert frames.shape == (17, 64, 64, 3) and fps == pytest.approx(24.0)
    assert (video.num_frames, video.width, video.height, video.seed) == (17, 64, 64, 11)
    assert video.path.name == "a-red-circle-moving-left_seed11.mp4"

    sidecar = load_sidecar(video.path)
    assert sidecar == json.loads(video.sidecar.read_text())
    assert sidecar["prompt"] == "a red circle moving left"
    assert sidecar["prompt_used"] == "a red circle moving left" + config.generate.prompt_suffix
    assert sidecar["negative_prompt"] == config.generate.negative_prompt
    assert (sidecar["seed"], sidecar["temp"], sidecar["num_frames"]) == (11, 3, 17)
    # decode_tile "auto" is recorded as the size used: a 64x64 decode fits untiled
    assert config.generate.decode_tile == "auto"
    assert sidecar["settings"]["generate"] == {**config.generate.model_dump(mode="json"), "decode_tile": None}
    assert sidecar["model"]["layout"] == "official" and sidecar["model"]["fingerprints"]["dit"]
    assert sidecar["model"]["variant"] == "diffusion_transformer_384p"  # make_official_folder's folder
    assert sidecar["pfctl_version"] and sidecar["mode"] == "t2v"
    # the run's one-off costs beside the video's own: loading (from model.path here) and the prompts
    assert set(sidecar["runtime"]["timing_s"]) == {"load", "prompts"}
    assert 0 < sidecar["runtime"]["timing_s"]["load"] <= report.seconds

    # The sidecar round-trips: it regenerates the same video, under a new name (never overwritten).
    again_config, spec = sidecar_to_run(sidecar)
    assert again_config.generate.seed == 11 and again_config.model.path == str(model_dir)
    again = run_generate(again_config, [spec], components=components, runtime=runtime).videos[0]
    assert again.path.name == "a-red-circle-moving-left_seed11-1.mp4"
    assert again.path.read_bytes() == video.path.read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [
        "a-red-circle-moving-left_seed11-1.json",
        "a-red-circle-moving-left_seed11-1.mp4",
        "a-red-circle-moving-left_seed11.json",
        "a-red-circle-moving-left_seed11.mp4",
    ]


def test_seeds_overrides_and_saved_latents(model_dir, components, runtime, tmp_path):
    config = make_config(
        model_dir, tmp_path, "generate.temp=2", "generate.num_videos=2", "generate.save_latents=true"
    )
    specs = [
        PromptSpec(prompt="a blue square moving up", seed=5),
        PromptSpec(prompt="", temp=1, num_videos=1),
    ]
    report = run_generate(config, specs, components=components, runtime=runtime, keep_latents=True)
    a, b, c = report.videos
    assert (a.seed, b.seed, a.temp, a.num_frames) == (5, 6, 2, 9)
    assert (c.temp, c.num_frames, c.seed) == (1, 1, config.runtime.seed)
    assert c.path.name.startswith("unconditional_seed")
    assert json.loads(c.sidecar.read_text())["prompt_used"] == ""  # no suffix on the empty prompt
    assert not torch.equal(a.latents, b.latents)  # another seed, another video
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(a.latents_path))["latents"], a.latents.float())
    frames, _ = read_video(a.path)
    assert frames.shape == (9, 64, 64, 3)


def test_attention_setting_reaches_the_dit(model_dir, components, runtime, tmp_path):
    """generate.attention is handed to the DiT; on the CPU every choice runs the kernel SDPA uses anyway
    (no cuDNN there), so the video is the default one, bit for bit."""
    latents = {}
    for backend in ("auto", "efficient", "cudnn"):
        config = make_config(
            model_dir, tmp_path / backend, "generate.temp=2", f"generate.attention={backend}"
        )
        (video,) = run_generate(
            config, ["a red circle"], components=components, runtime=runtime, keep_latents=True
        ).videos
        latents[backend] = video.latents
        assert components.dit.attention_backend == backend
        assert components.dit.row_group_min_tokens == 0  # generate groups every column by default
    assert torch.equal(latents["efficient"], latents["auto"])
    assert torch.equal(latents["cudnn"], latents["auto"])
    config = make_config(
        model_dir, tmp_path / "groups", "generate.temp=2", "generate.row_group_min_tokens=null"
    )
    (video,) = run_generate(
        config, ["a red circle"], components=components, runtime=runtime, keep_latents=True
    ).videos
    # the model's own threshold: the tiny columns take one masked call, the same video up to rounding
    assert components.dit.row_group_min_tokens is None
    torch.testing.assert_close(video.latents, latents["auto"], rtol=1e-4, atol=1e-5)


def test_pfctl_export_uses_ema_and_its_declared_resolution(model_dir, runtime, tmp_path):
    from helpers.tiny_models import tiny_dit
    from pfctl.models.checkpoint import save_export

    export = save_export(
        tmp_path / "export",
        tiny_dit(seed=1),
        base_model_path=model_dir,
        ema_dit=tiny_dit(seed=2),
        extra={"resolution": [64, 64]},
    )
    config = load_config(
        None,
        [f"model.path={export}", f"generate.output_dir={tmp_path / 'out'}", "generate.temp=1", "runtime.device=cpu",
         "generate.num_inference_steps=[1,1,1]"],
    )  # fmt: skip
    (video,) = run_generate(config, ["a red circle moving left"], runtime=runtime).videos
    sidecar = load_sidecar(video.path)
    assert (sidecar["width"], sidecar["height"]) == (64, 64)  # declared by the export, no size given
    assert sidecar["model"]["layout"] == "export" and sidecar["model"]["use_ema"] is True


def test_embedded_model_sidecar_names_its_own_variant(tmp_path, runtime):
    from pfctl.models.embedded import has_embedded_model, read_manifest

    if not has_embedded_model():
        pytest.skip("no embedded default model in this installation")
    config = load_config(None, [f"generate.output_dir={tmp_path}", "runtime.device=cpu", "generate.temp=1",
                                "generate.num_inference_steps=[1,1,1]"])  # fmt: skip
    (video,) = run_generate(config, ["a red circle moving right"], runtime=runtime).videos
    sidecar = load_sidecar(video.path)
    assert config.model.variant != read_manifest()["variant"]  # the config's default names another folder
    assert sidecar["model"]["variant"] == read_manifest()["variant"]
    # the sidecar regenerates from the folder it names
    again_config, _ = sidecar_to_run(sidecar)
    assert again_config.model.variant == read_manifest()["variant"]


def test_export_of_the_embedded_model_generates_at_the_size_it_was_trained(tmp_path, runtime):
    """An export fine-tuned from the embedded model on 128x64 clips declares 128x64 (its marker's
    ``resolutions``, as the trainer writes them): the embedded model's own 64x64 does not override it."""
    from pfctl.models.checkpoint import load_components, save_export
    from pfctl.models.embedded import embedded_model_path, has_embedded_model, read_manifest

    if not has_embedded_model():
        pytest.skip("no embedded default model in this installation")
    assert read_manifest()["resolution"] != [128, 64]
    dit = load_components(None, need=("dit",), dtype=torch.float32).dit
    export = save_export(
        tmp_path / "export", dit, base_model_path=embedded_model_path(), extra={"resolutions": [[128, 64]]}
    )
    config = load_config(None, [f"model.path={export}", f"generate.output_dir={tmp_path / 'out'}",
                                "runtime.device=cpu", "generate.temp=1", "generate.num_inference_steps=[1,1,1]"])  # fmt: skip
    (video,) = run_generate(config, ["a red circle moving right"], runtime=runtime).videos
    sidecar = load_sidecar(video.path)
    assert (sidecar["width"], sidecar["height"]) == (128, 64)
    assert sidecar["model"]["layout"] == "export" and sidecar["model"]["variant"] is None
    assert read_video(video.path)[0].shape == (1, 64, 128, 3)


# -- image-to-video --------------------------------------------------------------------------------


def test_i2v_keeps_unit_0_equal_to_the_encoded_image_latent(model_dir, components, runtime, tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    image_path = tmp_path / "first.png"
    Image.fromarray((rng.random((80, 96, 3)) * 255).astype(np.uint8)).save(image_path)  # not 64x64: resized
    config = make_config(model_dir, tmp_path / "out", "generate.temp=2", "generate.seed=3")
    report = run_generate(
        config, ["a green triangle moving right"], image=image_path, components=components, runtime=runtime,
        keep_latents=True,
    )  # fmt: skip
    (video,) = report.videos
    assert torch.equal(video.latents[:, :, :1], video.image_latent)
    assert json.loads(video.sidecar.read_text())["mode"] == "i2v"
    assert read_video(video.path)[0].shape == (9, 64, 64, 3)

    # The image latent is the reference's: noise drawn first, then a posterior *sample*, normalised.
    vae = components.vae
    _, tensor = prepare_image(image_path, 64, 64)
    posterior = vae.encode(tensor)
    gen = torch.Generator().manual_seed(3)
    torch.randn((1, vae.latent_channels, 2, 8, 8), generator=gen)  # the initial noise
    eps = torch.randn(posterior.mean.shape, generator=gen)
    assert torch.allclose(video.image_latent, vae.normalize(posterior.mean + posterior.std * eps), atol=1e-6)


def test_encode_image_latent_samples_the_posterior(components):
    vae = components.vae
    image = torch.rand(1, 3, 1, 64, 64) * 2 - 1
    a, posterior = encode_image_latent(vae, image, torch.Generator().manual_seed(0))
    b, _ = encode_image_latent(vae, image, torch.Generator().manual_seed(0))
    c, _ = encode_image_latent(vae, image, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (1, vae.latent_channels, 1, 8, 8)
    assert not torch.equal(a, vae.normalize(posterior.mean))


# -- CFG -----------------------------------------------------------------------------------------


class SplitCFG(torch.nn.Module):
    """The same DiT, but the CFG batch [negative, positive] goes through two separate forwards."""

    def __init__(self, dit):
        super().__init__()
        self.dit = dit

    def forward(
        self, sample, encoder_hidden_states, encoder_attention_mask, pooled_projections, timestep_ratio
    ):
        halves = []
        for part in (slice(0, 1), slice(1, 2)):
            halves.append(
                self.dit(
                    sample=[[clip[part] for clip in column] for column in sample],
                    encoder_hidden_states=encoder_hidden_states[part],
                    encoder_attention_mask=encoder_attention_mask[part],
                    pooled_projections=pooled_projections[part],
                    timestep_ratio=timestep_ratio[part],
                )
            )
        return [torch.cat([u, c], dim=0) for u, c in zip(*halves, strict=True)]


def test_batched_cfg_equals_two_separate_forwards(components):
    from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents

    text = components.text_encoder
    cond = TextConditioning.from_pair(text.encode(["a red circle moving left"]), text.encode(["low quality"]))
    settings = SamplingSettings(
        num_inference_steps=(1, 1, 1),
        video_num_inference_steps=(1, 1, 1),
        guidance_scale=7.0,
        video_guidance_scale=5.0,
    )
    kwargs = dict(settings=settings, temp=2, height=8, width=8)
    batched = generate_latents(components.dit, cond, generator=torch.Generator().manual_seed(0), **kwargs)
    split = generate_latents(
        SplitCFG(components.dit), cond, generator=torch.Generator().manual_seed(0), **kwargs
    )
    # another batch composition sums in another order (helpers.tolerance): 6 forwards of at most 128-term sums,
    # about 16 chained each; guidance 7 turns a difference d of the two predictions into up to (1 + 2 * 7) d
    assert_rounding_close(split, batched, reduction=128, depth=6 * 16, ulps=8 * 15)


# -- bad input -----------------------------------------------------------------------------------


def test_strict_resolution_and_size_errors(model_dir, components, runtime, tmp_path):
    strict = make_config(model_dir, tmp_path, "generate.strict_resolution=true", "generate.temp=1")
    with pytest.raises(ConfigError, match=r"generates 640x384, not 64x64"):
        run_generate(strict, ["p"], components=components, runtime=runtime)
    odd = make_config(model_dir, tmp_path, "generate.width=96", "generate.temp=1")
    with pytest.raises(ConfigError, match="multiple of 64"):
        run_generate(odd, ["p"], components=components, runtime=runtime)
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_fail_before_loading_and_write_nothing(model_dir, tmp_path):
    config = make_config(model_dir, tmp_path / "out")
    with pytest.raises(ConfigError, match="temp 0"):
        run_generate(config, [PromptSpec(prompt="p", temp=0)])
    with pytest.raises(InputError, match="does not exist"):
        run_generate(config, ["p"], image=tmp_path / "missing.png")
    with pytest.raises(InputError, match="empty"):
        run_generate(config, [])
    assert not (tmp_path / "out").exists()


def test_unknown_model_folder_and_default_model(tmp_path, runtime):
    config = load_config(None, [f"model.path={tmp_path / 'nope'}", f"generate.output_dir={tmp_path}"])
    with pytest.raises(ModelLoadError, match="does not exist"):
        run_generate(config, ["p"], runtime=runtime)
    from pfctl.models.embedded import has_embedded_model

    if has_embedded_model():
        pytest.skip("the embedded default model is installed (its own tests cover model.path=None)")
    no_model = load_config(None, [f"generate.output_dir={tmp_path}", *FAST])
    with pytest.raises(ModelLoadError) as info:
        run_generate(no_model, ["p"], runtime=runtime)
    assert "--model" in f"{info.value.message} {info.value.hint}"


# -- parity of the decode path with the reference vectors ---------------------------------------------

ELEMENTWISE = rounding_rtol(reduction=1, depth=2)
"""Latent (de)normalisation and the posterior sample: a couple of roundings per element."""


def _cases(refdir: Path) -> list[Path]:
    return sorted(
        p
        for p in refdir.iterdir()
        if p.is_dir() and p.name.startswith("generate") and (p / "meta.json").is_file()
    )


def _vectors(case: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (file,) = sorted(case.glob("*.safetensors"))
    return load_file(str(file))


@pytest.fixture(scope="module")
def reference_vae(refdir):
    from pfctl.models.causal_vae import CausalVideoVAE
    from pfctl.models.vae import PyramidCausalVAE
    from pfctl.models.weights import load_into_module, load_weight_file

    folder = refdir / "causal_vae"
    kwargs = json.loads((folder / "constructor_kwargs.json").read_text())
    module = load_into_module(
        CausalVideoVAE(**kwargs).eval(), load_weight_file(folder / "state_dict.safetensors"), strict=True
    )
    return PyramidCausalVAE(module)


def _decode_settings(meta: dict) -> dict:
    kw = meta["vae_decode_kwargs"]
    return {
        "chunking": "framewise" if kw.get("temporal_chunk") else "none",
        "window": kw.get("window_size", 2),
        "tile": kw.get("tile_sample_min_size"),
    }


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    """|ours - ref| <= rtol * max |ref| everywhere (rtol: the computation's float32 rounding)."""
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs().max().item()
    atol = rtol * ref.double().abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} (tolerance {atol:.3g})"


@pytest.mark.parity
def test_decode_path_parity(refdir, reference_vae):
    cases = [c for c in _cases(refdir) if "decode.vae_input" in _vectors(c)]
    if not cases:
        pytest.skip("no generate case with decode vectors")
    for case in cases:
        vectors = _vectors(case)
        meta = json.loads((case / "meta.json").read_text())
        final = vectors["final_latents"]
        before = final.clone()
        # de-normalisation of the sampler output = what the reference hands to the VAE; input untouched
        assert_close(
            reference_vae.denormalize(final), vectors["decode.vae_input"], ELEMENTWISE, f"{case.name} denorm"
        )
        assert torch.equal(final, before)
        video, frames = decode_latents(
            reference_vae, vectors["decode.vae_input"], normalized=False, **_decode_settings(meta)
        )
        if "decode.vae_output" in vectors:
            rtol = vae_rtol(reference_vae.module)
            assert_close(video, vectors["decode.vae_output"], rtol, f"{case.name} vae_output")
        ref_frames = vectors["decode.frames_uint8"]
        assert frames.shape[0] == 1
        diff = (frames[0].int() - ref_frames.int()).abs().max().item()
        assert diff <= 1, f"{case.name}: uint8 frames differ by {diff}"


@pytest.mark.parity
def test_i2v_image_preprocessing_parity(refdir, reference_vae, tmp_path):
    cases = [c for c in _cases(refdir) if "input_image_uint8" in _vectors(c)]
    if not cases:
        pytest.skip("no image-to-video case")
    from PIL import Image

    for case in cases:
        vectors = _vectors(case)
        pixels = vectors["input_image_uint8"].numpy()
        path = tmp_path / f"{case.name}.png"
        Image.fromarray(pixels).save(path)
        height, width = pixels.shape[:2]
        got_pixels, tensor = prepare_image(path, width, height)
        assert np.array_equal(got_pixels, pixels)
        assert torch.equal(tensor, vectors["image_tensor"])
        posterior = reference_vae.encode(tensor)
        rtol = vae_rtol(reference_vae.module)
        assert_close(posterior.mean, vectors["image_posterior.mean"], rtol, "posterior mean")
        assert_close(posterior.std, vectors["image_posterior.std"], rtol, "posterior std")
        sample = (
            vectors["image_posterior.mean"]
            + vectors["image_posterior.std"] * vectors["image_posterior_noise"]
        )
        assert_close(sample, vectors["image_latent_sample"], ELEMENTWISE, "posterior sample")
        assert_close(reference_vae.normalize(sample), vectors["image_latent"], ELEMENTWISE, "image latent")
        assert_close(
            reference_vae.denormalize(vectors["final_latents"]),
            vectors["decode.vae_input"],
            ELEMENTWISE,
            "denorm",
        )


def test_decode_tile_auto_tiles_only_when_the_untiled_decode_would_not_fit() -> None:
    from pfctl.sampling.decode import AUTO_TILE, UNTILED_DECODE_BYTES_PER_PIXEL, resolve_decode_tile

    fixed, per_frame = UNTILED_DECODE_BYTES_PER_PIXEL
    need_w1 = (fixed + per_frame) * 384 * 640  # bf16, window 1

    def resolve(tile, window=1, dtype=torch.bfloat16, available=10 * need_w1):
        return resolve_decode_tile(
            tile, height=384, width=640, window=window, dtype=dtype, available=available
        )

    assert resolve(512, available=0) == 512 and resolve(None, available=0) is None  # explicit: as given
    assert resolve("auto") is None
    assert resolve("auto", available=need_w1) == AUTO_TILE  # 80% of the free memory is the limit
    assert resolve("auto", available=int(need_w1 / 0.8) + 1) is None
    assert resolve("auto", window=16, available=3 * need_w1) == AUTO_TILE  # wider windows need more
    assert resolve("auto", dtype=torch.float32, available=int(1.5 * need_w1 / 0.8)) == AUTO_TILE


def test_offload_brings_each_phase_its_parts_and_takes_them_back():
    """``generate.offload``: the DiT is on the device for the run, a phase's parts visit it and leave, and
    the decode phase sends the DiT away while the VAE is there; disabled, nothing moves."""
    from pfctl.sampling.generate import Offload

    moves: list[tuple[str, str]] = []

    class Part:
        def __init__(self, name: str) -> None:
            self.name = name

        def to(self, device: object) -> None:
            moves.append((self.name, str(device)))

    device = torch.device("meta")
    parts = {"dit": Part("dit"), "vae": Part("vae"), "text": Part("text")}
    with Offload(device, False, **parts) as off, off.using("vae", evict=["dit"]):
        pass
    assert moves == []
    with Offload(device, True, **parts) as off:
        assert moves == [("dit", "meta")]
        with off.using("text"):
            assert moves[-1] == ("text", "meta")
        assert moves[-1] == ("text", "cpu")
        moves.clear()
        with off.using("vae", evict=["dit"]):
            assert moves == [("dit", "cpu"), ("vae", "meta")]
        assert moves[2:] == [("vae", "cpu"), ("dit", "meta")]
    assert moves[-1] == ("dit", "cpu")
