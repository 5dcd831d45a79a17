"""``generate:`` section — options of ``pfctl generate``.

Defaults follow the reference's README (``num_inference_steps=[20,20,20]``,
``video_num_inference_steps=[10,10,10]``, guidance 7 / video guidance 5, 24 fps). Length is
``temp`` latent frames (units): ``(temp - 1) * 8 + 1`` video frames, 16 → 121 frames ≈ 5 s at
24 fps. The output size comes from the model unless given: an official 384p folder generates
640x384, a 768p folder 1280x768, a pfctl export or the demo model declares its own.

Where pfctl's behaviour differs from the reference, the reference's choice is one setting away
(parity tests set them explicitly): image-to-video uses ``video_num_inference_steps`` for units
after the image (the reference reuses ``num_inference_steps``).
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pfctl.config.base import Section
from pfctl.errors import ConfigError, InputError

DEFAULT_PROMPT_SUFFIX = ", hyper quality, Ultra HD, 8K"
"""Appended to every prompt by the reference 'to improve aesthetics'."""
DEFAULT_NEGATIVE_PROMPT = (
    "cartoon style, worst quality, low quality, blurry, absolute black, absolute white, low res, "
    "extra limbs, extra digits, misplaced objects, mutated anatomy, monochrome, horror"
)
"""The reference's fixed negative prompt (the unconditional branch of CFG)."""

RESOLUTIONS: dict[str, tuple[int, int]] = {"384p": (640, 384), "768p": (1280, 768)}
"""Named resolutions as (width, height), the sizes the official checkpoints were trained at."""

StepList = list[int]


class LoraRef(Section):
    """One LoRA adapter to apply while generating."""

    path: str
    """An adapter folder (a LoRA run's ``export/``, or a peft adapter folder)."""
    scale: float = 1.0
    """Multiplies the adapter's contribution (1 = as trained, 0 = off, between = weaker)."""


class ParallelConfig(Section):
    """``generate.parallel``: how several processes (``torchrun`` / ``accelerate launch``) share the work."""

    cfg: Literal["auto", "on", "off"] = "auto"
    """Classifier-free guidance parallel: the unconditional and conditional halves of each forward on two
    ranks, combined by an all-gather. ``auto``: on when guidance is used and a video's ranks are even."""
    sequence: int | Literal["auto"] = "auto"
    """Ulysses sequence parallel: ranks that split each forward's tokens (all-to-all over heads around
    attention; the DiT's heads must divide by it). ``auto``: one group per video while there are videos to
    share (data parallel), each group's ranks left after CFG split the sequence."""

    @field_validator("cfg", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: object) -> object:
        """YAML reads a bare ``on`` / ``off`` as a boolean."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("sequence")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"generate.parallel.sequence must be auto or an integer >= 1, got {value}")
        return value


LOW_MEMORY_LEVELS = ("none", "offload", "stream")
"""``generate.low_memory`` levels, least to most memory saved."""


class GenerateConfig(Section):
    """Options of generate. Every field is recorded in each video's JSON sidecar."""

    # -- adapters ---------------------------------------------------------------------------------
    lora: list[LoraRef] = Field(default_factory=list)
    """LoRA adapters applied (unmerged, all at once, each at its scale) on the DiT. Without
    ``model.path`` the base model named in the first adapter's ``pfctl_lora.json`` is loaded."""

    # -- outputs ----------------------------------------------------------------------------------
    output_dir: str = "outputs/generate"
    """Folder for the mp4 files and their ``.json`` sidecars (created). Existing files are never
    overwritten: a new name gets a ``-1``, ``-2`` ... suffix."""
    fps: float = Field(default=24.0, gt=0)
    """Frame rate written into the mp4 (the reference's models are trained at 24 fps)."""
    crf: int = Field(default=18, ge=0, le=51)
    """x264 constant rate factor (18 ≈ visually lossless; higher = smaller files)."""
    encoder_threads: int = Field(default=1, ge=0)
    """x264 threads. 1 makes the mp4 byte-identical for the same frames; 0 lets x264 choose."""
    save_latents: bool = False
    """Also write the final (normalised) latents as ``<name>.latents.safetensors``."""

    # -- length and size --------------------------------------------------------------------------
    temp: int = Field(default=16, ge=1)
    """Latent frames (units) to generate; video frames = (temp - 1) * 8 + 1 (16 → 121 ≈ 5 s)."""
    resolution: Literal["auto", "384p", "768p"] = "auto"
    """``auto``: the model's own size (384p folder → 640x384, 768p → 1280x768, exports declare it)."""
    height: int | None = Field(default=None, ge=64)
    """Explicit height in pixels (with ``width``); overrides ``resolution``."""
    width: int | None = Field(default=None, ge=64)
    """Explicit width in pixels (with ``height``); overrides ``resolution``."""
    strict_resolution: bool = True
    """Refuse sizes the model does not declare (the pyramid DiT has no dynamic resolution)."""

    # -- sampler ----------------------------------------------------------------------------------
    num_inference_steps: StepList = Field(default_factory=lambda: [20, 20, 20])
    """Euler steps per stage for the first unit (low, mid, full resolution)."""
    video_num_inference_steps: StepList = Field(default_factory=lambda: [10, 10, 10])
    """Euler steps per stage for every later unit (also for the units after an i2v image)."""
    guidance_scale: float = Field(default=7.0, ge=0)
    """CFG scale of the first unit (7-9 at 768p). 0 disables CFG (one forward per step)."""
    video_guidance_scale: float = Field(default=5.0, ge=0)
    """CFG scale of later units."""
    use_linear_guidance: bool = False
    """Decay guidance per unit: unit 0 keeps ``guidance_scale``, later units use
    max(video_guidance_scale - alpha * (u - 1), min_guidance_scale). With ``reference_compat`` the
    reference's rule: max(guidance_scale - alpha * u, min_guidance_scale) for every unit."""
    alpha: float = Field(default=0.5, ge=0)
    """Per-unit decrease of the linear guidance."""
    min_guidance_scale: float = Field(default=2.0, ge=0)
    """Floor of the linear guidance."""
    exact_stage_end: bool = False
    """Use n full Euler steps per stage. Default (the reference's grid): each stage's sigmas end at
    0.001 before the appended 0, so its last step moves sigma by only 0.001."""
    reference_compat: bool = False
    """Reproduce reference quirks that pfctl fixes: i2v unit u starts from noise frame u-1, and
    linear guidance overwrites both guidance scales."""
    prompt_suffix: str = DEFAULT_PROMPT_SUFFIX
    """Appended to every non-empty prompt (the reference's aesthetic suffix); "" to disable."""
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    """The unconditional prompt of CFG; "" = the empty prompt."""
    seed: int | None = None
    """Seed of the first video (video i of a prompt uses seed + i); None = ``runtime.seed``."""
    num_videos: int = Field(default=1, ge=1)
    """Videos per prompt (different seeds)."""

    # -- decode -----------------------------------------------------------------------------------
    decode_chunking: Literal["framewise", "none"] = "framewise"
    """``framewise``: decode ``decode_window`` latent frames at a time (exact for the causal VAE,
    far less memory); ``none``: one decoder call."""
    decode_window: int = Field(default=1, ge=1)
    """Latent frames per decoder chunk (the reference: 1 with save_memory, else 2)."""
    decode_tile: int | Literal["auto"] | None = "auto"
    """Spatial tile size in pixels (a multiple of 32; tiles overlap by 1/4 and are blended).
    Only frames larger than the tile are tiled. None = never tile. ``auto`` = no tiling when the
    untiled decode's estimated peak fits in the free memory of the device, else 256-px tiles; the
    sidecar records the size used."""

    # -- memory / speed ---------------------------------------------------------------------------
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: ``auto`` = ``model.dtype`` on CUDA, fp32 on the CPU. fp16 is not offered: the
    reference's VAE gives NaN in fp16."""
    offload: bool = False
    """Keep text encoders and VAE on the CPU and move each to the GPU only for its phase
    (encode prompts → sample → decode); saves several GB of GPU memory. The same as ``low_memory: offload``
    (kept for existing recipes)."""
    low_memory: Literal["none", "offload", "stream"] = "none"
    """GPU memory level. ``none``: every part on the device throughout. ``offload``: text encoders on the
    device only while encoding (their T5 layers two at a time), the VAE only while decoding (the DiT leaves
    meanwhile); parts wait in pinned host memory. ``stream``: as ``offload``, and the DiT's blocks wait on the
    CPU and visit the device one at a time during each forward (block swap; the next block is copied on a
    side CUDA stream while one computes). The decode tiles as ``decode_tile`` says (``auto``: where the
    untiled decode would not fit in the free memory). Same video at every level; the sidecar records the
    level and its expected peak."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Several processes on one run (:class:`ParallelConfig`)."""
    compile: bool = False
    """``torch.compile`` each DiT block (automatic dynamic shapes: the token counts become dynamic once they
    change; CUDA only). The first video pays the compilation, later ones sample faster: worth it for several
    videos in one run (timings in benchmarks/RESULTS.md)."""
    cuda_graphs: bool = True
    """Replay each stage's DiT forward as a CUDA graph after its first step: the same kernels
    without the launch overhead that dominates the small low-resolution calls (CUDA only). With several
    videos in a run the graphs are kept (one shared memory pool), and a later video of the same size replays
    every stage from its first step (no warm-up, no capture)."""
    attention: Literal["auto", "efficient", "cudnn"] = "auto"
    """The kernel of the DiT's masked attention (SDPA with an additive mask in every case): ``auto`` settles
    per run on CUDA: cuDNN's kernel for runs of many videos of one size (it plans every new shape on first
    use, then runs faster), the memory-efficient kernel otherwise (a fast first video;
    ``pfctl.sampling.generate.attention_kernel``); ``efficient`` the memory-efficient kernel; ``cudnn``
    cuDNN's first.
    Same results within bf16 rounding; no effect on the CPU."""
    skip_future_keys: bool = True
    """Cut the text padding and attend the query rows of each column in groups of whole frames (closing at
    512 rows; a frame that large alone), each against the keys up to its last frame only: the keys temporal
    causality hides are not computed, and a single frame's rows attend with no mask at all. Same results up
    to float rounding, less than half the attention time of one masked call per column (benchmarks/RESULTS.md)."""
    row_group_min_tokens: int | None = Field(default=0, ge=0)
    """With ``skip_future_keys``: the shortest column (text + image tokens) attended in row groups; shorter
    ones take one masked call. ``0`` (default) groups every column, the fastest choice with CUDA graphs
    (benchmarks/bench_video_attention.py, RESULTS.md). None = the model's own threshold (6,144, what training
    uses)."""

    @field_validator("num_inference_steps", "video_num_inference_steps")
    @classmethod
    def _three_positive(cls, value: list[int]) -> list[int]:
        if len(value) != 3 or any(int(v) < 1 for v in value):
            raise ValueError(f"needs 3 positive step counts (one per stage), got {value}")
        return [int(v) for v in value]

    @field_validator("decode_tile")
    @classmethod
    def _tile_multiple_of_32(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and (value < 32 or value % 32):
            raise ValueError(
                f"decode_tile must be a multiple of 32 (other sizes give wrongly sized frames), got {value}"
            )
        return value

    @model_validator(mode="after")
    def _size_pair(self) -> GenerateConfig:
        if (self.height is None) != (self.width is None):
            raise ValueError("give both generate.height and generate.width, or neither")
        return self

    @property
    def memory_level(self) -> str:
        """The low-memory level in effect (``offload: true`` is level ``offload`` at least)."""
        return "offload" if self.offload and self.low_memory == "none" else self.low_memory

    @property
    def num_frames(self) -> int:
        """Video frames produced by ``temp`` latent frames."""
        return frames_for_temp(self.temp)


def frames_for_temp(temp: int) -> int:
    """(temp - 1) * 8 + 1: the causal VAE's first latent frame is one video frame, others eight."""
    return (temp - 1) * 8 + 1


def temp_for_frames(frames: int) -> tuple[int, int]:
    """The ``temp`` whose frame count is nearest to ``frames`` (ties go up), and that frame count."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    temp = max(1, int((frames - 1) / 8 + 0.5) + 1)
    return temp, frames_for_temp(temp)


def temp_for_duration(seconds: float, fps: float) -> tuple[int, int]:
    """The ``temp`` whose video is nearest to ``seconds`` long at ``fps`` (5 s at 24 fps → 16)."""
    if not seconds > 0:
        raise ValueError(f"duration must be positive, got {seconds}")
    return temp_for_frames(round(seconds * fps) + 1)


@dataclass(frozen=True)
class LengthChoice:
    """The ``temp`` picked from ``--temp`` / ``--frames`` / ``--duration``, and a sentence saying so."""

    temp: int
    num_frames: int
    message: str | None


def choose_length(
    *, temp: int | None = None, frames: int | None = None, duration: float | None = None, fps: float = 24.0
) -> LengthChoice | None:
    """Turn one of the three ways of asking for a length into ``temp`` (None when none was given).

    Frames that are not ``(temp - 1) * 8 + 1`` are rounded to the nearest such count, and the
    message says which one was used, so nobody is surprised by the length of their video.
    """
    given = [
        name
        for name, value in (("--temp", temp), ("--frames", frames), ("--duration", duration))
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} both set the video length",
            hint="give only one of --temp, --frames, --duration",
        )
    if temp is not None:
        if temp < 1:
            raise ConfigError(
                f"--temp {temp} is not valid: temp counts latent frames and must be >= 1",
                hint="temp 16 gives 121 frames (≈5 s at 24 fps), temp 31 gives 241 (≈10 s)",
            )
        n = frames_for_temp(temp)
        return LengthChoice(temp, n, f"temp {temp} → {n} frames ({n / fps:.2f} s at {fps:g} fps)")
    if frames is not None:
        if frames < 1:
            raise ConfigError(f"--frames {frames} is not valid: it must be >= 1")
        t, n = temp_for_frames(frames)
        if n == frames:
            message = f"{frames} frames → temp {t} ({n / fps:.2f} s at {fps:g} fps)"
        else:
            message = (
                f"{frames} frames is not of the form (temp-1)*8+1; using {n} frames (temp {t}, "
                f"{n / fps:.2f} s at {fps:g} fps)"
            )
        return LengthChoice(t, n, message)
    if duration is not None:
        if not duration > 0:
            raise ConfigError(f"--duration {duration} is not valid: it must be a positive number of seconds")
        t, n = temp_for_duration(duration, fps)
        return LengthChoice(t, n, f"{duration:g} s at {fps:g} fps → {n} frames (temp {t}, {n / fps:.2f} s)")
    return None


# --------------------------------------------------------------------------------------------
# Prompts: what to generate (inputs of a run, not settings; read without heavy imports)
# --------------------------------------------------------------------------------------------

PROMPT_KEYS = {
    "prompt": "prompt",
    "text": "prompt",
    "seed": "seed",
    "temp": "temp",
    "guidance": "guidance_scale",
    "guidance_scale": "guidance_scale",
    "video_guidance": "video_guidance_scale",
    "video_guidance_scale": "video_guidance_scale",
    "negative_prompt": "negative_prompt",
    "image": "image",
    "num_videos": "num_videos",
    "name": "name",
}
"""Keys a JSONL prompt line may carry (aliases → field)."""


@dataclass(frozen=True)
class PromptSpec:
    """One prompt to generate, with optional per-prompt overrides of the ``generate:`` settings."""

    prompt: str
    seed: int | None = None
    temp: int | None = None
    guidance_scale: float | None = None
    video_guidance_scale: float | None = None
    negative_prompt: str | None = None
    image: str | None = None
    """Image-to-video: this prompt's first frame (overrides the run's ``--image``)."""
    num_videos: int | None = None
    name: str | None = None
    """Output file stem (default: derived from the prompt)."""
    source: str | None = None
    """Where it came from ("prompts.jsonl:3"), for error messages."""


def _prompt_from_mapping(data: dict[str, Any], where: str) -> PromptSpec:
    fields: dict[str, Any] = {}
    for key, value in data.items():
        if key not in PROMPT_KEYS:
            close = difflib.get_close_matches(key, list(PROMPT_KEYS), n=1)
            raise InputError(
                f"{where}: unknown key '{key}'",
                hint=f"did you mean '{close[0]}'?"
                if close
                else f"allowed keys: {', '.join(sorted(PROMPT_KEYS))}",
            )
        fields[PROMPT_KEYS[key]] = value
    if "prompt" not in fields or not isinstance(fields["prompt"], str):
        raise InputError(f"{where}: needs a string 'prompt' (or 'text')")
    checks = {
        "seed": (int, lambda v: True, "an integer"),
        "temp": (int, lambda v: v >= 1, "an integer >= 1"),
        "num_videos": (int, lambda v: v >= 1, "an integer >= 1"),
        "guidance_scale": ((int, float), lambda v: v >= 0, "a number >= 0"),
        "video_guidance_scale": ((int, float), lambda v: v >= 0, "a number >= 0"),
        "negative_prompt": (str, lambda v: True, "a string"),
        "image": (str, lambda v: True, "a path string"),
        "name": (str, lambda v: bool(v.strip()), "a non-empty string"),
    }
    for key, (types, ok, what) in checks.items():
        value = fields.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types) or not ok(value):
            raise InputError(f"{where}: {key} = {value!r} is not valid; it must be {what}")
    return PromptSpec(**fields, source=where)


def read_prompts(path: str | os.PathLike[str]) -> list[PromptSpec]:
    """Prompts from a file: plain text (one prompt per line) or JSONL (one object per line).

    A file is JSONL when its first non-blank line starts with ``{``. Blank lines are skipped in
    both; in plain text, lines starting with ``#`` are comments. Relative image paths in JSONL
    are resolved against the file's folder.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"prompts file {source} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read prompts file {source}: {exc}") from None
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise InputError(
            f"prompts file {source} has no prompts", hint="one prompt per line, or JSONL objects"
        )
    specs: list[PromptSpec] = []
    if lines[0][1].lstrip().startswith("{"):
        for number, line in lines:
            where = f"{source}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(data, dict):
                raise InputError(f"{where}: each JSONL line must be an object with a 'prompt'")
            spec = _prompt_from_mapping(data, where)
            if spec.image is not None and not Path(spec.image).is_absolute():
                spec = replace(spec, image=str(source.parent / spec.image))
            specs.append(spec)
    else:
        for number, line in lines:
            if line.lstrip().startswith("#"):
                continue
            specs.append(PromptSpec(prompt=line.strip(), source=f"{source}:{number}"))
    if not specs:
        raise InputError(f"prompts file {source} has no prompts (only comments)")
    return specs
