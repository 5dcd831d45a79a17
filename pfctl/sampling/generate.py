"""``pfctl generate``: prompts (and an optional first frame) → mp4 files with JSON sidecars.

:func:`run_generate` runs these steps, each a function of this module:

1. :func:`_check_inputs`: every input that can be checked cheaply (prompts, images, output folder),
   *before* loading a model, so bad input fails in a second and leaves nothing behind;
2. :func:`_load_model`: DiT + VAE + text encoders (:mod:`pfctl.sampling.loading`), LoRA adapters, and the
   output size the model was trained for; :func:`_fast_paths` applies the speed layer (``fast:``, compiled
   blocks) and sets up the CUDA graphs;
3. :func:`_encode_prompts`: every prompt once (with the reference's aesthetic suffix; the negative
   prompt for CFG);
4. :func:`_sample`: per video, the noise from a seeded CPU generator (the same video on any device),
   the i2v image as unit 0, :func:`pfctl.sampling.sampler.generate_latents`;
5. :func:`_decode`: de-normalise and decode with temporal chunking / spatial tiling
   (:func:`pfctl.sampling.decode.decode_latents`), uint8 like the reference;
6. :func:`_write_outputs`: the mp4 (PyAV, H.264 yuv420p) under a name that is never taken twice, then
   its JSON sidecar (:mod:`pfctl.sampling.sidecar`), both atomically.

With ``generate.low_memory`` ``offload`` (or ``generate.offload``) the text encoders and the VAE live on the
CPU and visit the GPU only for their phase (and the DiT leaves the GPU while the VAE decodes), as the
reference's ``cpu_offloading`` does; :class:`Offload` is the one place parts move. Level ``stream`` also
streams the DiT's blocks (:mod:`pfctl.sampling.memory`). Under ``torchrun`` / ``accelerate launch`` the
ranks share the videos and each video's forwards (:mod:`pfctl.sampling.parallel`); the first rank of a
video's group writes it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfctl.config.generate import GenerateConfig, PromptSpec, frames_for_temp
from pfctl.errors import ConfigError, InputError, ModelLoadError
from pfctl.runtime import logging as pflog
from pfctl.sampling import loading
from pfctl.sampling.decode import (
    decode_latents,
    encode_image_latent,
    free_memory,
    host_frames,
    prepare_image,
    resolve_decode_tile,
)
from pfctl.sampling.memory import MemoryLevel, measure_parts
from pfctl.sampling.parallel import ParallelRun, check_layout, setup_parallel
from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents

__all__ = ["GenerateReport", "Offload", "PromptSpec", "VideoResult", "run_generate"]


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoResult:
    """One written video."""

    path: Path
    sidecar: Path
    prompt: str
    seed: int
    num_frames: int
    width: int
    height: int
    fps: float
    temp: int
    image: str | None = None
    latents_path: Path | None = None
    seconds: float = 0.0
    latents: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Final normalised latents (B, C, temp, h, w), only with ``keep_latents=True``."""
    image_latent: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """The normalised i2v image latent (unit 0), only with ``keep_latents=True``."""


@dataclass(frozen=True)
class GenerateReport:
    """What :func:`run_generate` did."""

    videos: list[VideoResult]
    output_dir: Path
    model: dict[str, Any]
    width: int
    height: int
    seconds: float
    peak_memory_bytes: int | None = None
    """The whole run's peak CUDA memory (text encoders, DiT and VAE; None off CUDA)."""


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _as_specs(prompts: Sequence[str | PromptSpec] | str | PromptSpec | None) -> list[PromptSpec]:
    if prompts is None:
        raise InputError("nothing to generate: no prompt given", hint='pass a prompt ("" = unconditional)')
    if isinstance(prompts, (str, PromptSpec)):
        prompts = [prompts]
    specs = []
    for item in prompts:
        if isinstance(item, PromptSpec):
            specs.append(item)
        elif isinstance(item, str):
            specs.append(PromptSpec(prompt=item))
        else:
            raise InputError(f"a prompt must be a string or PromptSpec, got {type(item).__name__}")
    if not specs:
        raise InputError("nothing to generate: the prompt list is empty")
    for spec in specs:
        where = f" ({spec.source})" if spec.source else ""
        if spec.temp is not None and (isinstance(spec.temp, bool) or spec.temp < 1):
            raise ConfigError(
                f"temp {spec.temp}{where} is not valid: temp counts latent frames and must be >= 1",
                hint="temp 16 gives 121 frames (≈5 s at 24 fps)",
            )
        if spec.num_videos is not None and spec.num_videos < 1:
            raise ConfigError(f"num_videos {spec.num_videos}{where} must be >= 1")
    return specs


def _check_output_dir(path: Path) -> None:
    """Create ``path`` and prove it is writable (before any model is loaded)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InputError(
            f"output folder {path} is not writable: {reason}",
            hint="choose another folder with --output-dir / generate.output_dir",
        ) from None


def _file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------


@dataclass
class _Job:
    spec: PromptSpec
    index: int  # video index within the prompt
    seed: int
    temp: int
    guidance_scale: float
    video_guidance_scale: float
    negative_prompt: str
    image_path: str | None


def _plan_jobs(
    specs: list[PromptSpec], gen: GenerateConfig, default_seed: int, image: str | None
) -> list[_Job]:
    jobs = []
    for spec in specs:
        base_seed = (
            spec.seed if spec.seed is not None else (gen.seed if gen.seed is not None else default_seed)
        )
        for k in range(spec.num_videos or gen.num_videos):
            jobs.append(
                _Job(
                    spec=spec,
                    index=k,
                    seed=int(base_seed) + k,
                    temp=int(spec.temp or gen.temp),
                    guidance_scale=float(
                        spec.guidance_scale if spec.guidance_scale is not None else gen.guidance_scale
                    ),
                    video_guidance_scale=float(
                        spec.video_guidance_scale
                        if spec.video_guidance_scale is not None
                        else gen.video_guidance_scale
                    ),
                    negative_prompt=spec.negative_prompt
                    if spec.negative_prompt is not None
                    else gen.negative_prompt,
                    image_path=spec.image or image,
                )
            )
    return jobs


def _prompt_used(prompt: str, suffix: str) -> str:
    """The reference appends its aesthetic suffix; an empty prompt stays empty (unconditional)."""
    return prompt + suffix if prompt.strip() else ""


def _dit_calls(job: _Job, gen: GenerateConfig) -> int:
    video = sum(gen.video_num_inference_steps) * (job.temp - 1)
    return video if job.image_path else sum(gen.num_inference_steps) + video


# --------------------------------------------------------------------------------------------
# Devices: the one place the parts move
# --------------------------------------------------------------------------------------------


class Offload:
    """Where the text encoders, the DiT and the VAE live during a run.

    Disabled (the default, and always on the CPU), every part stays where it was loaded. Enabled, the
    parts wait on the CPU; the DiT is on the device between :meth:`__enter__` and :meth:`__exit__`, and
    :meth:`using` brings the parts a phase needs (optionally sending others away) and takes them back
    afterwards, releasing the freed memory.
    """

    def __init__(self, device: torch.device, enabled: bool, **parts: Any) -> None:
        self.device, self.enabled, self.parts = device, enabled, parts

    def _move(self, names: Sequence[str], device: torch.device | str) -> None:
        for name in names:
            if self.parts.get(name) is not None:
                self.parts[name].to(device)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Offload:
        if self.enabled:
            self._move(["dit"], self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._move(["dit"], "cpu")
            self._empty_cache()

    @contextmanager
    def using(self, *names: str, evict: Sequence[str] = ()) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._move(evict, "cpu")
        self._move(names, self.device)
        try:
            yield
        finally:
            self._move(names, "cpu")
            self._move(evict, self.device)
            self._empty_cache()


def _finished(device: torch.device) -> float:
    """The time once the GPU's queued work is done: the sidecar's timings are of the work, not of its launch
    (without it, the sampling's last kernels counted as decode and the decode's last as neither)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --------------------------------------------------------------------------------------------
# The steps
# --------------------------------------------------------------------------------------------


def _check_inputs(
    gen: GenerateConfig, prompts: Sequence[str | PromptSpec] | str | PromptSpec | None, image: Any
) -> tuple[list[PromptSpec], str | None, Path]:
    """Step 1: prompts, images and the output folder, before anything heavy."""
    from pfctl.sampling.video_io import load_image

    specs = _as_specs(prompts)
    image = os.fspath(image) if image is not None else None
    for path in {s.image or image for s in specs} - {None}:
        load_image(path)  # unreadable / missing image → InputError now, not after loading a model
    if any(not s.prompt.strip() for s in specs):
        pflog.warn("empty prompt: generating without text conditioning (the null text); no suffix is added")
    output_dir = Path(gen.output_dir).expanduser()
    _check_output_dir(output_dir)
    return specs, image, output_dir


@dataclass
class _Model:
    """What step 2 loaded and decided: the parts, the config with the model's own defaults, the size."""

    config: Any
    dit: Any
    vae: Any
    text_encoder: Any
    record: dict[str, Any]
    """What the sidecar records of the model (:func:`_model_record`)."""
    dtype: torch.dtype
    width: int
    height: int


def _load_model(config: Any, components: Any, device: torch.device, offload: bool) -> _Model:
    """Step 2: the parts (loaded here unless given), LoRA adapters, the model's generation defaults and
    the output size."""
    from pfctl.models.embedded import apply_generate_defaults

    dtype = loading.resolve_dtype(config.generate, config.model.dtype, device.type)
    adapters = loading.read_adapters(config.generate)
    if adapters and config.model.path is None and components is None:
        config = loading.with_lora_base(config, adapters[0])
    loaded_here = components is None
    if components is None:
        components = loading.load_model(config, dtype, "cpu" if offload else device)
    dit, vae, text_encoder = components.dit, components.vae, components.text_encoder
    if adapters and dit is not None:
        dit = loading.apply_adapters(dit, adapters, components, owned=loaded_here)
    missing = [n for n, c in (("DiT", dit), ("VAE", vae), ("text encoder", text_encoder)) if c is None]
    if missing:
        raise ModelLoadError(f"generate needs a DiT, a VAE and text encoders; missing: {', '.join(missing)}")
    info = dict(getattr(components, "info", {}) or {})
    # the embedded demo model (and exports fine-tuned from it) brings its own size/steps/guidance
    config = apply_generate_defaults(config, info)
    model_desc = f"model {info.get('root') or config.model.path or '(given components)'}"
    # An export's size comes from its marker; model.variant names a subfolder of official folders only.
    variant = config.model.variant if info.get("layout") in ("official", "dit-folder", None) else None
    if isinstance(info.get("embedded"), dict):
        variant = info["embedded"].get("variant") or variant
    width, height = loading.resolve_size(config.generate, loading.declared_sizes(info, variant), model_desc)
    record = _model_record(config, info, dit, adapters)
    return _Model(config, dit, vae, text_encoder, record, dtype, width, height)


def _model_record(config: Any, info: dict[str, Any], dit: Any, adapters: list[Any]) -> dict[str, Any]:
    """The sidecar's ``model``: what was loaded (the variant folder that really ran, fingerprints, LoRAs)."""
    return {
        "path": str(config.model.path) if config.model.path is not None else None,
        "root": info.get("root"),
        "layout": info.get("layout"),
        "variant": loading.loaded_variant(info),
        "vae": config.model.vae,
        "model_name": info.get("model_name"),
        "dit_class": info.get("dit_class") or type(dit).__name__,
        "use_ema": bool(info.get("use_ema", loading.is_ema_load(config))),
        "fingerprints": info.get("fingerprints") or {},
        "lora": [
            {"path": str(a.path.resolve()), "scale": a.scale, "rank": a.config.get("r"),
             "fingerprint": loading.adapter_fingerprint(a)}
            for a in adapters
        ],
    }  # fmt: skip


CUDNN_MIN_VIDEOS = 6
"""``generate.attention: auto`` takes cuDNN's attention kernel in runs of this many videos or more (one size,
graphs kept); fewer take the memory-efficient kernel."""


def attention_kernel(setting: str, device: torch.device, *, videos: int, keep_graphs: bool) -> str:
    """The attention kernel a run uses (``generate.attention``): ``auto`` settles on CUDA by the run's length.
    cuDNN's kernel is the faster one once warm, but it builds a plan for every new attention shape on first
    use, and a video's row groups have many: that costs the first video more than cuDNN saves
    on each later one (break-even after several videos; benchmarks/RESULTS.md, session 16). So ``auto`` is
    cuDNN's kernel only where :data:`CUDNN_MIN_VIDEOS` or more videos replay kept graphs, else the
    memory-efficient one. Elsewhere (the CPU, an explicit setting) the setting stays as it is."""
    if setting != "auto" or device.type != "cuda":
        return setting
    return "cudnn" if keep_graphs and videos >= CUDNN_MIN_VIDEOS else "efficient"


def _fast_paths(m: _Model, device: torch.device, *, keep_graphs: bool) -> Any:
    """Step 2b, the speed layer on the loaded DiT and VAE (the ``fast:`` section and ``generate.compile``,
    through :func:`pfctl.models.fast.apply_fast_paths`), and (``keep_graphs``: several videos on one
    device that holds the DiT throughout) the CUDA graphs every video replays. Returns those graphs or None."""
    gen, fast = m.config.generate, m.config.fast
    compiled = gen.compile and device.type == "cuda"
    if gen.compile and not compiled:
        pflog.log("generate.compile is ignored on the CPU")
    if fast.any_on or compiled:
        from pfctl.models.fast import FastPaths, apply_fast_paths
        from pfctl.models.vae import with_fast_paths

        # automatic dynamic shapes: the token counts become dynamic once they change, the head sizes stay
        # static (with every size dynamic, the graphs around row-grouped attention ran generic kernels)
        applied = apply_fast_paths(m.dit, FastPaths(fast, compile=compiled, dynamic=None))
        with_fast_paths(m.vae, fast)
        if applied:
            pflog.log("fast paths: " + ", ".join(applied))
    if not (gen.cuda_graphs and device.type == "cuda" and keep_graphs):
        return None
    from pfctl.models.fast.cuda_graph import StageGraph

    # videos of one size repeat every stage's shapes: keep the graphs, later videos only replay them
    return StageGraph(m.dit, keep=True)


def _encode_prompts(
    jobs: list[_Job], text_encoder: Any, gen: GenerateConfig, offload: Offload
) -> dict[int, tuple[str, TextConditioning]]:
    """Step 3: every distinct prompt (with its suffix) and negative prompt once → per job (prompt used,
    conditioning), on the device."""
    cache: dict[str, Any] = {}

    def embed(text: str) -> Any:
        if text not in cache:
            cache[text] = text_encoder.empty_embedding() if text == "" else text_encoder.encode([text])
        return cache[text]

    conditioning = {}
    with offload.using("text"):
        for job in jobs:
            used = _prompt_used(job.spec.prompt, gen.prompt_suffix)
            text = TextConditioning.from_pair(embed(used), embed(job.negative_prompt))
            conditioning[id(job)] = (used, text.to(offload.device) if offload.enabled else text)
    return conditioning


@dataclass
class _Run:
    """Everything the per-video steps share."""

    model: _Model
    gen: GenerateConfig
    device: torch.device
    offload: Offload
    graphs: Any
    output_dir: Path
    runtime_info: dict[str, Any]
    keep_latents: bool
    parallel: ParallelRun
    images: dict[str, tuple[torch.Tensor, dict[str, Any]]] = field(default_factory=dict)


def _image_latent(run: _Run, path: str, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, Any]]:
    """The i2v unit 0 of the image at ``path`` (read and resized once per run) and its sidecar record."""
    m = run.model
    if path not in run.images:
        _, tensor = prepare_image(path, m.width, m.height)
        record = {
            "path": str(Path(path).resolve()),
            "sha256": _file_sha256(path),
            "preprocess": f"resize to cover {m.width}x{m.height} (LANCZOS), center crop",
        }
        run.images[path] = (tensor, record)
    tensor, record = run.images[path]
    with run.offload.using("vae"):
        latent, _ = encode_image_latent(m.vae, tensor, generator)
    return latent, record


def _sample(run: _Run, job: _Job, text: TextConditioning, on_call: Any) -> tuple[torch.Tensor, Any, Any]:
    """Step 4: one video's latents → (latents, i2v image latent or None, image record or None)."""
    m = run.model
    spatial = int(getattr(m.vae, "spatial_factor", 8))
    latent_channels = int(getattr(m.vae, "latent_channels", 16))
    shape = (1, latent_channels, job.temp, m.height // spatial, m.width // spatial)
    generator = torch.Generator(device="cpu").manual_seed(job.seed)
    # Draw order as the reference: full-resolution noise first, then the image posterior sample, then the
    # block noises (drawn inside the sampler).
    initial_noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    image_latent, image_info = (
        _image_latent(run, job.image_path, generator) if job.image_path else (None, None)
    )
    settings = dataclasses.replace(
        SamplingSettings.from_config(run.gen),
        guidance_scale=job.guidance_scale,
        video_guidance_scale=job.video_guidance_scale,
    )
    latents = generate_latents(
        run.parallel.dit_for(m.dit, job.guidance_scale), text, settings,
        temp=job.temp, height=shape[3], width=shape[4], latent_channels=latent_channels,
        initial_noise=initial_noise, generator=generator, image_latent=image_latent,
        dtype=m.dtype, device=run.device, graphs=run.graphs, on_dit_call=on_call,
    )  # fmt: skip
    return latents, image_latent, image_info


def _decode(run: _Run, latents: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """Step 5: latents → uint8 frames (B, T, H, W, 3) on the device, and the decode tile used."""
    gen, m = run.gen, run.model
    with run.offload.using("vae", evict=["dit"]):
        tile = resolve_decode_tile(
            gen.decode_tile,
            height=m.height,
            width=m.width,
            window=gen.decode_window if gen.decode_chunking == "framewise" else latents.shape[2],
            dtype=m.dtype,
            available=free_memory(run.device),
        )
        _, frames = decode_latents(
            m.vae, latents, chunking=gen.decode_chunking, window=gen.decode_window, tile=tile
        )
    return frames, tile


def _generate_video(
    run: _Run, job: _Job, text: tuple[str, TextConditioning], label: str, bar: Any
) -> VideoResult | None:
    """Steps 4-6 for one video (4 only on a rank that shares the video but does not write it: None)."""
    t0 = time.perf_counter()
    prompt_used, conditioning = text
    m = run.model
    pflog.log(
        f"{label} {'i2v' if job.image_path else 't2v'} {prompt_used or '(unconditional)'!r} seed {job.seed}: "
        f"temp {job.temp} → {frames_for_temp(job.temp)} frames {m.width}x{m.height}"
    )

    def on_call(event: dict[str, Any]) -> None:
        bar.update(1, unit=event["unit"], stage=event["stage"])

    latents, image_latent, image_info = _sample(run, job, conditioning, on_call)
    t_sample = _finished(run.device) - t0
    if not run.parallel.writes:
        return None
    frames, tile = _decode(run, latents)
    t_decode = _finished(run.device) - t0 - t_sample
    result = _write_outputs(
        # the sidecar records the tile size used, so a re-run decodes the same way
        config=m.config.model_copy(update={"generate": run.gen.model_copy(update={"decode_tile": tile})}),
        job=job, frames=host_frames(frames[0]), latents=latents, prompt_used=prompt_used, width=m.width, height=m.height,
        output_dir=run.output_dir, image_info=image_info, model_info=m.record,
        runtime_info=run.runtime_info, timing={"sample": round(t_sample, 3), "decode": round(t_decode, 3)},
        keep_latents=run.keep_latents, image_latent=image_latent, seconds=time.perf_counter() - t0,
    )  # fmt: skip
    pflog.log(f"  → {result.path} ({result.seconds:.1f} s)")
    return result


def run_generate(
    config: Any,
    prompts: Sequence[str | PromptSpec] | str | PromptSpec | None,
    *,
    image: str | os.PathLike[str] | None = None,
    components: Any = None,
    runtime: Any = None,
    keep_latents: bool = False,
) -> GenerateReport:
    """Generate one mp4 (+ JSON sidecar) per prompt and seed; see the module docstring.

    Args:
        config: the validated :class:`~pfctl.config.schema.RecipeConfig` (``generate``, ``model``
            and ``runtime`` sections are used).
        prompts: strings or :class:`PromptSpec` (per-prompt seed/temp/guidance/image/...).
        image: image-to-video for every prompt without its own ``image``.
        components: already loaded :class:`pfctl.models.checkpoint.Components` (skips loading).
        runtime: an existing :class:`pfctl.runtime.accelerator.Runtime` (else one is built).
        keep_latents: return the final latents (and the i2v image latent) in each result.
    """
    start = time.perf_counter()
    specs, image, output_dir = _check_inputs(config.generate, prompts, image)
    run = functools.partial(_generate, config, specs, image, output_dir, components, keep_latents, start)
    if runtime is not None:
        return run(runtime)
    from pfctl.runtime.accelerator import build_runtime

    runtime = build_runtime(config.runtime)
    try:
        return run(runtime)
    finally:
        # the run's own process group ends with it: left to the interpreter's exit, gloo's threads at times
        # aborted a rank (SIGABRT) after its videos were written
        if runtime.world_size > 1:
            runtime.close()


def _generate(
    config: Any, specs: list[PromptSpec], image: str | None, output_dir: Path, components: Any, keep_latents: bool,
    start: float, runtime: Any,
) -> GenerateReport:  # fmt: skip
    """:func:`run_generate` after its inputs are checked, on ``runtime``."""
    jobs = _plan_jobs(specs, config.generate, runtime.seed, image)
    check_layout(config.generate, runtime.world_size, len(jobs))  # before loading: refused on every rank
    device = torch.device(runtime.device)
    if device.type == "cuda":  # the whole run's peak: text encoders, DiT and VAE
        torch.cuda.reset_peak_memory_stats(device)
    level = MemoryLevel.of(config.generate, device)
    m = _load_model(config, components, device, level.moves)
    loaded = _finished(device)
    m, jobs, parallel = _layout(m, runtime, level, specs, image)
    runtime_info = {
        "device": str(device),
        "dtype": str(m.dtype).replace("torch.", ""),
        "world_size": runtime.world_size,
        "parallel": parallel.record(),
        "memory": level.record(
            measure_parts(m.text_encoder, m.dit, m.vae, m.dtype), m.config.generate,
            [j.temp for j in jobs] or [m.config.generate.temp], m.width, m.height,
            int(getattr(m.vae, "spatial_factor", 8)),
        ),
    }  # fmt: skip
    gen = m.config.generate
    parts = Offload(device, level.moves, **level.parts(m.dit, m.vae.module, m.text_encoder))
    # prompts first: the text encoders visit the device before the DiT arrives
    encoding = time.perf_counter()
    conditioning = _encode_prompts(jobs, m.text_encoder, gen, parts)
    runtime_info["timing_s"] = _run_timing(start, loaded, encoding, _finished(device))
    with parts:
        keep_graphs = not level.moves and len(jobs) > 1
        attention = attention_kernel(gen.attention, device, videos=len(jobs), keep_graphs=keep_graphs)
        m.dit.set_attention_backend(attention, gen.skip_future_keys, gen.row_group_min_tokens)
        runtime_info["attention"] = attention
        graphs = _fast_paths(m, device, keep_graphs=keep_graphs)
        run = _Run(m, gen, device, parts, graphs, output_dir, runtime_info, keep_latents, parallel)
        with pflog.progress("generate", total=sum(_dit_calls(j, gen) for j in jobs)) as bar:
            results = [
                _generate_video(run, job, conditioning[id(job)], f"[{n}/{len(jobs)}]", bar)
                for n, job in enumerate(jobs, start=1)
            ]
    if graphs is not None:
        graphs.release()
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return GenerateReport(
        videos=[r for r in results if r is not None], output_dir=output_dir, model=m.record, width=m.width,
        height=m.height, seconds=time.perf_counter() - start, peak_memory_bytes=peak,
    )  # fmt: skip


def _run_timing(start: float, loaded: float, encoding: float, encoded: float) -> dict[str, float]:
    """The run's one-off seconds (the sidecar's ``runtime.timing_s``, also logged): checking the inputs and
    loading the model (``load``: nothing to load when the parts are given), encoding the prompts."""
    timing = {"load": round(loaded - start, 3), "prompts": round(encoded - encoding, 3)}
    pflog.log(f"model loaded in {timing['load']:.1f} s, prompts encoded in {timing['prompts']:.1f} s")
    return timing


def _layout(
    m: _Model, runtime: Any, level: MemoryLevel, specs: list[PromptSpec], image: str | None
) -> tuple[_Model, list[_Job], ParallelRun]:
    """The settings the memory level and the parallel layout imply, this rank's jobs and its layout.
    Several ranks on one video (collectives in every forward) run without CUDA graphs or compiled blocks."""
    gen = level.adjust(m.config.generate)
    jobs = _plan_jobs(specs, gen, runtime.seed, image)
    parallel = setup_parallel(gen, runtime, m.dit, len(jobs))
    if parallel.shares_videos and (gen.cuda_graphs or gen.compile):
        gen = gen.model_copy(update={"cuda_graphs": False, "compile": False})
    m = dataclasses.replace(m, config=m.config.model_copy(update={"generate": gen}))
    # each group of ranks takes every data-th video (names never collide: exclusive publish)
    return m, parallel.my_jobs(jobs), parallel


def _write_outputs(
    *,
    config: Any,
    job: _Job,
    frames: np.ndarray,
    latents: torch.Tensor,
    prompt_used: str,
    width: int,
    height: int,
    output_dir: Path,
    image_info: dict[str, Any] | None,
    model_info: dict[str, Any],
    runtime_info: dict[str, Any],
    timing: dict[str, float],
    keep_latents: bool,
    image_latent: torch.Tensor | None,
    seconds: float,
) -> VideoResult:
    from pfctl.sampling.sidecar import build_sidecar, sidecar_path, taken, video_stem
    from pfctl.sampling.video_io import write_video_unique
    from pfctl.utils.io import atomic_save_safetensors, atomic_write_json

    gen = config.generate
    stem = video_stem(job.spec, job.seed)
    video_path = write_video_unique(
        output_dir / f"{stem}.mp4",
        frames,
        gen.fps,
        crf=gen.crf,
        threads=gen.encoder_threads,
        taken=taken,
    )
    latents_path = None
    if gen.save_latents:
        latents_path = video_path.with_suffix(".latents.safetensors")
        atomic_save_safetensors(
            {"latents": latents.float().cpu()},
            latents_path,
            metadata={"normalized": "true", "seed": str(job.seed)},
        )
    sidecar = build_sidecar(
        config=config,
        spec=job.spec,
        prompt_used=prompt_used,
        negative_prompt=job.negative_prompt,
        seed=job.seed,
        temp=job.temp,
        guidance_scale=job.guidance_scale,
        video_guidance_scale=job.video_guidance_scale,
        width=width,
        height=height,
        video_path=video_path,
        image_info=image_info,
        model_info=model_info,
        runtime_info=runtime_info,
        timing=timing,
        latents_path=latents_path,
    )
    sidecar_file = sidecar_path(video_path)
    atomic_write_json(sidecar_file, sidecar)
    return VideoResult(
        path=video_path,
        sidecar=sidecar_file,
        prompt=job.spec.prompt,
        seed=job.seed,
        num_frames=int(frames.shape[0]),
        width=int(frames.shape[2]),
        height=int(frames.shape[1]),
        fps=float(gen.fps),
        temp=job.temp,
        image=image_info["path"] if image_info else None,
        latents_path=latents_path,
        seconds=seconds,
        latents=latents.detach().cpu() if keep_latents else None,
        image_latent=image_latent.detach().cpu() if (keep_latents and image_latent is not None) else None,
    )
