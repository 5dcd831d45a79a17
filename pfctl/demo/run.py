"""``pfctl demo``: the whole pipeline on synthetic shapes, on a laptop CPU, in a few minutes.

1. **data** — a small shapes dataset (:func:`pfctl.demo.shapes.make_shapes`): mp4 clips + captions;
2. **encode-latents** — with the embedded model's VAE and text encoders → a latent cache;
3. **train** — fine-tune the embedded DiT on that cache with ``torchrun`` on 2 CPU processes
   forming one video sync group of 2 (the two ranks read the same clips and train different
   temporal units of them), ending in a pfctl export; two clips are held out: their loss is
   measured along the way and their captions are sampled at step 0 and at the end (contact
   sheets), and the run's summary draws the loss curve;
4. **generate** — a few videos from the fine-tuned export, scored by
   :mod:`pfctl.demo.score` (colour and direction read back from the frames);
5. **verify-groupnorm** — the audit of the embedded causal VAE;
6. a summary of where everything is: the contact sheets and the loss curve first.

Every stage is the same library call (or, for training, the same ``pfctl train`` command) a user
would run; the demo only chooses small settings and writes the recipe it used to
``<out>/recipe.yaml`` so each step can be rerun by hand.

:func:`evaluate_model` is the acceptance check of the embedded model: generate every colour x
direction of the prompt set with several seeds and score the videos.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfctl.demo.shapes import DEFAULT_COLORS, DIRECTIONS, SHAPES, caption_for
from pfctl.errors import CheckFailed, ConfigError

__all__ = ["DemoReport", "evaluate_model", "prompt_set", "run_demo"]

PROMPT_SEED = 1000
"""Seed of the first video of each prompt in the acceptance prompt set (then +1, +2, ...)."""


# --------------------------------------------------------------------------------------------
# The prompt set and the acceptance check
# --------------------------------------------------------------------------------------------


def prompt_set(
    seeds_per_prompt: int = 3,
    *,
    colors: Sequence[str] = DEFAULT_COLORS,
    directions: Sequence[str] = tuple(DIRECTIONS),
    shapes: Sequence[str] = SHAPES,
) -> list[Any]:
    """Every colour x direction, ``seeds_per_prompt`` videos each; the shape rotates with the
    video so all shapes appear. Returns :class:`~pfctl.config.generate.PromptSpec` objects."""
    from pfctl.config.generate import PromptSpec

    specs = []
    for i, (color, direction) in enumerate(itertools.product(colors, directions)):
        for k in range(seeds_per_prompt):
            shape = shapes[(i + k) % len(shapes)]
            specs.append(
                PromptSpec(
                    prompt=caption_for(color, shape, direction),
                    seed=PROMPT_SEED + k,
                    num_videos=1,
                    name=f"{color}-{shape}-{direction}",
                )
            )
    return specs


def _config(data: dict[str, Any]) -> Any:
    from pfctl.config.schema import RecipeConfig

    return RecipeConfig.model_validate(data)


def evaluate_model(
    out_dir: str | os.PathLike[str],
    *,
    model_path: str | os.PathLike[str] | None = None,
    variant: str | None = None,
    seeds_per_prompt: int = 3,
    prompts: Sequence[Any] | None = None,
    colors: Sequence[str] = DEFAULT_COLORS,
    components: Any = None,
    generate: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Generate the prompt set with a model (default: the embedded one) and score the videos.

    Returns (:class:`~pfctl.demo.score.ScoreReport`, :class:`~pfctl.sampling.generate.GenerateReport`).
    ``generate`` overrides ``generate:`` settings (the model's own settings fill the rest).
    """
    from pfctl import api
    from pfctl.demo.score import score_clips

    config = _config(
        {
            "runtime": {"device": "cpu", "log_format": "plain"},
            "model": {
                "path": None if model_path is None else str(model_path),
                "dtype": "fp32",
                **({"variant": variant} if variant else {}),
            },
            "generate": {"output_dir": str(out_dir), **(generate or {})},
        }
    )
    specs = list(prompts) if prompts is not None else prompt_set(seeds_per_prompt)
    report = api.generate(config, prompts=specs, components=components)
    score = score_clips([(v.prompt, v.path) for v in report.videos], colors=colors)
    return score, report


# --------------------------------------------------------------------------------------------
# The demo
# --------------------------------------------------------------------------------------------


@dataclass
class DemoReport:
    """Where the demo put things, and how it went."""

    out_dir: Path
    dataset: Path
    cache: Path
    train_dir: Path
    export: Path
    recipe: Path
    videos: list[Path]
    color_accuracy: float
    direction_accuracy: float
    verify_status: str
    verify_json: Path
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    sheets: list[Path] = field(default_factory=list)
    """The validation contact sheets of the run, at step 0 and at the end."""
    loss_plot: Path | None = None
    summary: Path | None = None


@dataclass(frozen=True)
class DemoSettings:
    """The sizes of one demo run (``quick`` shrinks everything for tests)."""

    num_clips: int
    steps: int
    videos_per_prompt: int
    prompts: tuple[tuple[str, str], ...]
    verify_frames: int

    @classmethod
    def make(cls, quick: bool, num_clips: int | None = None, steps: int | None = None) -> DemoSettings:
        if quick:
            prompts = (("red", "right"), ("blue", "down"))
            return cls(num_clips or 16, steps or 4, 1, prompts, 17)
        prompts = tuple((c, d) for c in DEFAULT_COLORS for d in ("right", "down"))
        return cls(num_clips or 64, steps or 60, 1, prompts, 33)


def demo_recipe(
    out: Path, settings: DemoSettings, *, nproc: int, sync_group: int, seed: int
) -> dict[str, Any]:
    """The recipe the demo runs (written to ``<out>/recipe.yaml``)."""
    from pfctl.models.embedded import embedded_model_path, read_manifest

    root = embedded_model_path()
    manifest = read_manifest(root)
    width, height = manifest.get("resolution") or [64, 64]
    return {
        "description": "pfctl demo: fine-tune the embedded shapes model on a fresh shapes set",
        "runtime": {"device": "cpu", "mixed_precision": "no", "seed": seed, "log_format": "plain"},
        "model": {"path": str(root), "variant": manifest["variant"], "dtype": "fp32"},
        "encode": {
            "annotations": str(out / "shapes" / "annotations.jsonl"),
            "output_dir": str(out / "cache"),
            "fps": 24,
            "num_frames": 17,
            "buckets": [[int(width), int(height)]],
            "dtype": "fp32",
            "num_workers": 0,
            "max_sequence_length": 16,  # masked padding: same DiT output as 128 tokens, faster
        },
        "train": {
            "cache": str(out / "cache"),
            "output_dir": str(out / "train"),
            "max_steps": settings.steps,
            "batch_size": 4,
            "video_sync_group": sync_group,
            "max_units": 4,
            "lr": 1.0e-4,
            "warmup_steps": max(1, settings.steps // 10),
            "checkpoint_every": settings.steps,
            "keep_last": 1,
            "log_every": max(1, settings.steps // 10),
            "export": True,
            "heldout_clips": 2,
            "eval_every": max(1, settings.steps // 6),
            "validation_every": settings.steps,  # and at step 0: the sheets show what training changed
            "validation_units": 3,  # all 17 frames of the clips
        },
        "generate": {"output_dir": str(out / "videos")},
        "verify": {
            "num_frames": settings.verify_frames,
            "json_path": str(out / "verify-groupnorm.json"),
            "dtypes": ["fp32"],
            "memory": False,
        },
    }


def _train_command(recipe: Path, nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "pfctl", "train", "--recipe", str(recipe)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "pfctl", "train", "--recipe", str(recipe),
    ]  # fmt: skip


def _run_streaming(cmd: list[str], env: dict[str, str], log: Callable[[str], None], prefix: str) -> int:
    """Run a command, echoing its output line by line (progress the whole way)."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                log(f"{prefix}{line}")
        return proc.wait()


@dataclass
class _Demo:
    """One demo run: where it writes, how it reports, and what each step took."""

    out: Path
    settings: DemoSettings
    log: Callable[[str], None]
    start: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)

    def stage(self, number: int, title: str) -> float:
        self.log(f"[{number}/6] {title}  (+{time.perf_counter() - self.start:.0f} s)")
        return time.perf_counter()


def run_demo(
    out_dir: str | os.PathLike[str] = "pfctl-demo",
    *,
    quick: bool = False,
    num_clips: int | None = None,
    steps: int | None = None,
    nproc: int = 2,
    sync_group: int = 2,
    seed: int = 0,
    overwrite: bool = True,
    log: Callable[[str], None] | None = None,
) -> DemoReport:
    """Run the demo end to end into ``out_dir`` (see the module docstring)."""
    import yaml

    from pfctl import api
    from pfctl.demo.shapes import make_shapes
    from pfctl.utils.io import atomic_write_text

    if nproc < 1 or sync_group < 1 or nproc % sync_group:
        raise ConfigError(
            f"--nproc {nproc} must be a positive multiple of --sync-group {sync_group}",
            hint="the demo's default is 2 processes in one sync group of 2",
        )
    demo = _Demo(_fresh_folder(out_dir, overwrite), DemoSettings.make(quick, num_clips, steps), log or _default_log())
    out, settings = demo.out, demo.settings
    recipe_data = demo_recipe(out, settings, nproc=nproc, sync_group=sync_group, seed=seed)
    recipe = out / "recipe.yaml"
    atomic_write_text(recipe, yaml.safe_dump(recipe_data, sort_keys=False))
    config = _config(recipe_data)

    t0 = demo.stage(1, f"making {settings.num_clips} shapes clips (64x64, 17 frames) in {out / 'shapes'}")
    dataset = make_shapes(out / "shapes", num_clips=settings.num_clips, seed=seed)
    demo.timings["data"] = time.perf_counter() - t0

    t0 = demo.stage(2, f"encode-latents with the embedded model's VAE and text encoders → {out / 'cache'}")
    encoded = api.encode_latents(config, overwrite=True)
    demo.log(f"      encoded {encoded.encoded} clips ({encoded.failed} failed) in {encoded.seconds:.1f} s")
    demo.timings["encode"] = time.perf_counter() - t0

    export, sheets = _train(demo, recipe, nproc, sync_group)
    videos, score = _generate(demo, config, export)

    t0 = demo.stage(5, "verify-groupnorm on the embedded causal VAE")
    verify = api.verify_groupnorm(config)
    demo.log(f"      verdict: {verify.status} (details in {out / 'verify-groupnorm.json'})")
    demo.timings["verify"] = time.perf_counter() - t0

    seconds = time.perf_counter() - demo.start
    _print_summary(demo, dataset.annotation_file, recipe, export, sheets, seconds)
    return DemoReport(
        out_dir=out,
        dataset=dataset.annotation_file,
        cache=out / "cache",
        train_dir=out / "train",
        export=export,
        recipe=recipe,
        videos=videos,
        color_accuracy=score.color_accuracy,
        direction_accuracy=score.direction_accuracy,
        verify_status=str(verify.status),
        verify_json=out / "verify-groupnorm.json",
        seconds=seconds,
        timings=demo.timings,
        sheets=sheets,
        loss_plot=out / "train" / "loss.png",
        summary=out / "train" / "summary.md",
    )


def _default_log() -> Callable[[str], None]:
    from pfctl.runtime.logging import log

    return log


def _fresh_folder(out_dir: str | os.PathLike[str], overwrite: bool) -> Path:
    """The demo's folder, its earlier results removed (``overwrite``)."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and overwrite:
        for name in ("shapes", "cache", "train", "videos"):
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _train(demo: _Demo, recipe: Path, nproc: int, sync_group: int) -> tuple[Path, list[Path]]:
    """Step 3: ``pfctl train`` in ``nproc`` real processes; returns the export and the contact sheets."""
    out = demo.out
    t0 = demo.stage(
        3,
        f"fine-tuning the embedded DiT for {demo.settings.steps} steps on {nproc} CPU process(es), "
        f"sync group {sync_group} (pfctl train --recipe {recipe})",
    )
    threads = max(1, (os.cpu_count() or 2) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    code = _run_streaming(_train_command(recipe, nproc), env, demo.log, "      ")
    if code != 0:
        raise CheckFailed(
            f"pfctl train exited with code {code} (see the lines above)",
            hint=f"rerun it alone: {' '.join(_train_command(recipe, nproc))}",
        )
    sheets = sorted((out / "train" / "validation").glob("step-*.png"))
    demo.log(f"      validation contact sheets: {', '.join(str(p) for p in sheets)}")
    demo.log(f"      loss curve: {out / 'train' / 'loss.png'}  (run summary: {out / 'train' / 'summary.md'})")
    demo.timings["train"] = time.perf_counter() - t0
    return out / "train" / "export", sheets


def _generate(demo: _Demo, config: Any, export: Path) -> tuple[list[Path], Any]:
    """Step 4: videos of the demo's prompts from the fine-tuned model, scored for colour and direction."""
    from pfctl import api
    from pfctl.config.generate import PromptSpec
    from pfctl.demo.score import score_clips

    specs = [
        PromptSpec(prompt=caption_for(color, SHAPES[i % len(SHAPES)], direction), seed=PROMPT_SEED + i)
        for i, (color, direction) in enumerate(demo.settings.prompts)
    ]
    t0 = demo.stage(4, f"generating {len(specs)} videos from the fine-tuned model → {demo.out / 'videos'}")
    gen_config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(export)})})
    report = api.generate(gen_config, prompts=specs)
    score = score_clips([(v.prompt, v.path) for v in report.videos], colors=DEFAULT_COLORS)
    for row in score.rows:
        demo.log(
            f"      {Path(row['source']).name}: read back {row['color']} / {row['direction']}"
            f"{'' if row['color_ok'] and row['direction_ok'] else '  (differs from the prompt)'}"
        )
    demo.log(
        f"      colour right in {score.color_accuracy:.0%}, direction right in {score.direction_accuracy:.0%} "
        f"of {score.num_clips} videos"
    )
    demo.timings["generate"] = time.perf_counter() - t0
    return [v.path for v in report.videos], score


def _print_summary(
    demo: _Demo, dataset: Path, recipe: Path, export: Path, sheets: list[Path], seconds: float
) -> None:
    """Step 6: where everything is."""
    out, log = demo.out, demo.log
    demo.stage(6, "done")
    log(f"      dataset   {dataset}")
    log(f"      cache     {out / 'cache'}")
    log(f"      training  {out / 'train'}  (summary.md, metrics.jsonl, checkpoints/)")
    log(f"      loss      {out / 'train' / 'loss.png'}")
    for sheet in sheets:
        log(f"      samples   {sheet}")
    log(f'      model     {export}  (pfctl generate --model {export} "a green square moving up")')
    log(f"      videos    {out / 'videos'}")
    log(f"      verify    {out / 'verify-groupnorm.json'}")
    log(f"      recipe    {recipe}")
    log(f"      total     {seconds:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in demo.timings.items()) + ")")
