"""The library entry points. Each takes the validated recipe config (the summary: a run folder) and
returns a report.

The CLI is a thin shell around these; tests and notebooks call them directly. Imports are
lazy so ``import pfctl.api`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pfctl.config.generate import PromptSpec
    from pfctl.config.schema import RecipeConfig
    from pfctl.sampling.generate import GenerateReport


def encode_latents(
    config: RecipeConfig,
    *,
    dry_run: bool = False,
    overwrite: bool = False,
    max_failures: int | None = None,
    runtime: Any = None,
) -> Any:
    """Decode videos, encode them with the VAE and text encoders, write the latent cache
    → :class:`pfctl.data.encode.EncodeReport` (see :func:`pfctl.data.encode.run_encode`)."""
    from pfctl.data.encode import run_encode

    return run_encode(
        config, runtime=runtime, dry_run=dry_run, overwrite=overwrite, max_failures=max_failures
    )


def train(
    config: RecipeConfig,
    *,
    dry_run: bool = False,
    world_size: int | None = None,
    plan_steps: int | None = None,
) -> Any:
    """Train or fine-tune the pyramid DiT on a latent cache → :class:`pfctl.training.trainer.TrainReport`.

    ``dry_run``: validate config, model spec and cache and return the per-rank plan of the first
    ``plan_steps`` steps (:class:`pfctl.training.plan.PlanReport`) for a simulated ``world_size``.
    """
    if dry_run:
        from pfctl.training.plan import dry_run as plan

        return plan(config, world_size=world_size, steps=plan_steps)
    from pfctl.training.trainer import run_training

    return run_training(config)


def train_summary(output_dir: str) -> Any:
    """(Re-)render the summary of the training run in ``output_dir`` from its ``metrics.jsonl`` and
    ``config.yaml`` into ``summary.md`` and ``loss.png`` → :class:`pfctl.training.summary.RunSummary`."""
    from pfctl.training.summary import write_summary

    return write_summary(output_dir)


def generate(
    config: RecipeConfig,
    prompts: Sequence[str | PromptSpec] | str | None = None,
    *,
    image: str | None = None,
    components: Any = None,
    runtime: Any = None,
    keep_latents: bool = False,
) -> GenerateReport:
    """Text-to-video / image-to-video with the pyramid sampler, writing mp4 files + JSON sidecars.

    ``prompts``: strings or :class:`pfctl.config.generate.PromptSpec` (per-prompt overrides);
    ``image``: a first frame for image-to-video; ``components``: already loaded models
    (:class:`pfctl.models.checkpoint.Components`); ``runtime``: an existing runtime; ``keep_latents``:
    return each video's latents. See :func:`pfctl.sampling.generate.run_generate`.
    """
    from pfctl.sampling.generate import run_generate

    return run_generate(
        config, prompts, image=image, components=components, runtime=runtime, keep_latents=keep_latents
    )


def verify_groupnorm(config: RecipeConfig, **options: Any) -> Any:
    """Audit a VAE's norms and measure chunked-vs-full encoding error.

    Returns a :class:`pfctl.verify.report.GroupNormReport` (``.exit_code``: 0 pass/warn, 1 fail);
    writes ``verify.json_path`` / ``verify.plot_path`` when set.
    """
    from pfctl.verify import verify_groupnorm as _verify_groupnorm

    return _verify_groupnorm(config, **options)


def export(
    source: str,
    output_dir: str,
    *,
    variant: str | None = None,
    ema: bool = True,
    base: str | None = None,
    dtype: str | None = None,
) -> Any:
    """A pfctl export, checkpoint or LoRA export → an official Pyramid Flow folder
    (:class:`pfctl.training.export.OfficialExportReport`; see :func:`pfctl.training.export.export_official`)."""
    from pfctl.training.export import export_official

    return export_official(source, output_dir, variant=variant, ema=ema, base=base, dtype=dtype)
