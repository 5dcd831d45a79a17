"""`pfctl generate`."""

from __future__ import annotations

from typing import Annotated

import typer

from pfctl.cli._common import command_errors, print_config, resolve_config
from pfctl.cli.options import LORA_SCALE_HELP, ModelOpt, OutputDirOpt, PrintConfigOpt, RecipeOpt, SetOpt

HELP = "Text-to-video and image-to-video with the pyramid sampler; writes mp4 + a JSON sidecar."
EXAMPLES = (
    'pfctl generate "a red circle moving right"',
    "pfctl generate --prompts prompts.jsonl -o outputs/prompts",
    'pfctl generate "a red circle moving right" --image first_frame.png --seed 3',
)
NOTE = (
    "Several processes: torchrun --standalone --nproc_per_node N -m pfctl generate ... (or accelerate launch "
    "--multi_gpu --num_processes N -m pfctl generate ...; CPU gloo or CUDA nccl). generate.parallel.cfg (auto|on|off): "
    "the unconditional and conditional halves of classifier-free guidance on two ranks; "
    "generate.parallel.sequence (auto|N): N ranks split each forward's tokens (Ulysses, all-to-all over "
    "attention heads; the DiT's heads must divide by N, else the run is refused). auto: one group of ranks "
    "per video while there are videos to share, CFG halves when guidance is on and the group is even, the "
    "rest splitting the sequence. The first rank of each video's group writes the mp4 and its sidecar "
    "(which records the layout).\n\n"
    "Low memory (--low-memory / generate.low_memory): none = everything on the GPU; offload = text encoders "
    "on the GPU only while encoding (T5 layers streamed), the VAE only while decoding; stream = offload plus "
    "the DiT's blocks streamed to the GPU one at a time (block swap). The sidecar records the level's "
    "expected peak; generate.offload=true is level offload."
)

PromptArg = Annotated[
    str | None,
    typer.Argument(help='The prompt ("" = unconditional). Omit when using --prompts.', show_default=False),
]
PromptsFileOpt = Annotated[
    str | None,
    typer.Option(
        "--prompts",
        help="File of prompts: one per line, or JSONL with per-prompt seed/temp/guidance_scale/image.",
        show_default=False,
    ),
]
ImageOpt = Annotated[
    str | None,
    typer.Option(
        "--image",
        help="Image-to-video: the first frame (resized to cover, center-cropped).",
        show_default=False,
    ),
]
TempOpt = Annotated[
    int | None,
    typer.Option("--temp", help="Latent frames (units): frames = (temp-1)*8+1.", show_default=False),
]
FramesOpt = Annotated[
    int | None,
    typer.Option(
        "--frames", help="Video frames; rounded to the nearest (temp-1)*8+1 (said).", show_default=False
    ),
]
DurationOpt = Annotated[
    float | None,
    typer.Option("--duration", help="Seconds at generate.fps; converted to temp (said).", show_default=False),
]
SeedOpt = Annotated[
    int | None,
    typer.Option(
        "--seed", help="Seed of the first video (generate.seed; default runtime.seed).", show_default=False
    ),
]
LoraOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        help="A LoRA adapter folder (a LoRA run's export/); repeatable. Without --model its base model is used.",
        show_default=False,
    ),
]
LoraScaleOpt = Annotated[
    list[float] | None,
    typer.Option(
        "--lora-scale",
        help=LORA_SCALE_HELP,
        show_default=False,
    ),
]
NumVideosOpt = Annotated[
    int | None,
    typer.Option("--num-videos", help="Videos per prompt (seeds seed, seed+1, ...).", show_default=False),
]
LowMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--low-memory",
        help="GPU memory level: none, offload (text encoders / VAE on the GPU only for their phase, tiled "
        "decode) or stream (offload + DiT blocks streamed one at a time). generate.low_memory.",
        show_default=False,
    ),
]


def generate(
    prompt: PromptArg = None,
    prompts_file: PromptsFileOpt = None,
    image: ImageOpt = None,
    temp: TempOpt = None,
    frames: FramesOpt = None,
    duration: DurationOpt = None,
    seed: SeedOpt = None,
    num_videos: NumVideosOpt = None,
    low_memory: LowMemoryOpt = None,
    model: ModelOpt = None,
    lora: LoraOpt = None,
    lora_scale: LoraScaleOpt = None,
    output_dir: OutputDirOpt = None,
    recipe: RecipeOpt = None,
    overrides: SetOpt = None,
    show_config: PrintConfigOpt = False,
) -> None:
    with command_errors():
        from pfctl.config.generate import PromptSpec, choose_length, read_prompts
        from pfctl.errors import InputError
        from pfctl.runtime.logging import log

        flags = {
            "model.path": model,
            "generate.output_dir": output_dir,
            "generate.seed": seed,
            "generate.num_videos": num_videos,
            "generate.low_memory": low_memory,
            "generate.lora": lora_refs(lora, lora_scale),
        }
        config = resolve_config(recipe, overrides, flags)
        length = choose_length(temp=temp, frames=frames, duration=duration, fps=config.generate.fps)
        if length is not None:
            config = resolve_config(recipe, overrides, {**flags, "generate.temp": length.temp})
        if show_config:
            print_config(config)
            return
        if prompt is not None and prompts_file is not None:
            raise InputError("give a PROMPT or --prompts FILE, not both")
        if prompt is None and prompts_file is None:
            raise InputError(
                "nothing to generate: give a PROMPT or --prompts FILE",
                hint='e.g. pfctl generate "a red circle moving right" (use "" for an unconditional video)',
            )
        prompts = read_prompts(prompts_file) if prompts_file else [PromptSpec(prompt=prompt or "")]
        if length is not None and length.message:
            log(length.message)
        from pfctl import api

        report = api.generate(config, prompts=prompts, image=image)
        for video in report.videos:
            log(
                f"wrote {video.path}  ({video.num_frames} frames, {video.width}x{video.height}, seed {video.seed})"
            )


def lora_refs(
    paths: list[str] | None, scales: list[float] | None, scale_flag: str = "--lora-scale"
) -> list[dict] | None:
    """``--lora`` / ``--lora-scale`` pairs → ``generate.lora`` entries (None: not given)."""
    from pfctl.errors import ConfigError

    paths, scales = list(paths or []), list(scales or [])
    if not paths:
        if scales:
            raise ConfigError(f"{scale_flag} given without --lora", hint="add --lora PATH for each scale")
        return None
    if len(scales) not in (0, 1, len(paths)):
        raise ConfigError(
            f"{len(scales)} {scale_flag} values for {len(paths)} --lora adapters",
            hint="give one scale per adapter (in order), a single scale for all, or none (1.0)",
        )
    if len(scales) <= 1:
        scales = scales * len(paths) if scales else [1.0] * len(paths)
    return [{"path": p, "scale": s} for p, s in zip(paths, scales, strict=True)]
