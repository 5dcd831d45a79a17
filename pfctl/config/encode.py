"""``encode:`` section — options of ``pfctl encode-latents``.

Every option and its default lives here (one place). Frame counts are *pixel* frames; the
VAE adapter snaps them to its frame contract (``1 + 8k`` for Pyramid Flow's causal VAE), so
``num_frames: 121`` gives 16 latent frames and ``num_frames: 120`` is snapped down to 113.

Priority, lowest first: these defaults < the model's own encode settings < the recipe < ``--set`` <
flags. Only the embedded model has settings of its own (its trained size as the one bucket, its
frame rate and clip length); it is the model when neither ``model.path`` nor ``model.vae`` is set,
or when ``model.path`` is its folder.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pfctl.config.base import Section

MAX_BATCH = 64
"""Upper bound of ``encode.batch_size``."""
MAX_WORKERS = 256
"""Upper bound of ``encode.num_workers``."""

DEFAULT_BUCKETS: tuple[tuple[int, int], ...] = ((640, 384), (384, 640))
"""Pyramid Flow's 384p training resolutions as (width, height): landscape and portrait."""


class EncodeConfig(Section):
    """Options of encode-latents. Fields that change the latents are part of the cache fingerprint."""

    # -- inputs / outputs ------------------------------------------------------------------------
    annotations: str | None = None
    """A JSONL or CSV annotation file (``video``/``image`` + ``text``; optional ``frames``, ``fps``,
    ``id``) or a folder of videos/images with same-name ``.txt`` captions."""
    output_dir: str = "cache"
    """The latent cache folder (created; re-running resumes it)."""

    # -- frames ----------------------------------------------------------------------------------
    fps: float | None = Field(default=24.0, gt=0)
    """Target frame rate: source frames are resampled to it. None keeps every source frame."""
    clip_mode: Literal["head", "uniform", "full"] = "head"
    """``head``: one clip from the start; ``uniform``: ``clips_per_video`` clips spread evenly over
    the video; ``full``: the whole video, up to ``max_frames``."""
    clips_per_video: int = Field(default=1, ge=1)
    """Clips per video in ``uniform`` mode (fewer when the video has no room for distinct clips)."""
    num_frames: int = Field(default=121, ge=1)
    """Pixel frames per clip (head/uniform), snapped down to the VAE's frame contract."""
    max_frames: int = Field(default=241, ge=1)
    """Upper bound of a ``full`` clip (pixel frames, snapped)."""
    min_frames: int = Field(default=9, ge=1)
    """A ``full`` clip shorter than this (after snapping) is skipped as ``too_short``."""
    max_source_pixels: int = Field(default=4096 * 2304, ge=1)
    """Sources with more pixels per frame are skipped as ``resolution_too_large`` (decoding them
    would need gigabytes per clip)."""

    # -- spatial ---------------------------------------------------------------------------------
    buckets: list[tuple[int, int]] = Field(default_factory=lambda: [list(b) for b in DEFAULT_BUCKETS])
    """Resolution buckets as [width, height]; each source goes to the bucket of nearest aspect ratio
    (resize to cover, then center crop). Sides must be multiples of VAE factor x DiT patch x
    2^(stages - 1) (64 px for Pyramid Flow's 8x VAE, 2x2 patches and 3 stages) when the model folder
    has a DiT, else of the VAE factor; other sizes are refused before any work."""

    # -- VAE ---------------------------------------------------------------------------------------
    chunking: Literal["none", "framewise", "exact"] = "none"
    """``none``: one encode call per clip; ``framewise``: the VAE's temporal chunks (less memory;
    differs from one call for VAEs with GroupNorm over time); ``exact``: chunked but equal to one call."""
    chunk_frames: int | None = Field(default=None, ge=1)
    """Frames per temporal chunk (None = the adapter's default)."""
    exact_schedule: Literal["recompute", "parked"] = "recompute"
    """``chunking: exact`` on VAEs with GroupNorm over time (CogVideoX, HunyuanVideo): ``recompute``
    (default) keeps no chunk's activations between its passes — at most the framewise path's memory
    with its default 4-frame chunks, ~1.5x the convolutions; ``parked`` keeps them all at each norm —
    less compute, about twice the framewise memory (CogVideoX only). Same latents either way (to float
    rounding); trade-off in benchmarks/RESULTS.md."""
    exact_checkpoint_gib: float | None = Field(default=None, ge=0)
    """``recompute`` only: memory (GiB) for the checkpoint its passes restart from (None: no limit, at
    most one whole-clip activation; 0: every pass from the clip — least memory, ~15-20x the compute)."""
    tile: int | None = Field(default=None, ge=32)
    """Spatial tile size in pixels for tiled encoding (None = no tiling)."""
    dtype: Literal["bf16", "fp32"] | None = None
    """Compute dtype of the VAE and text encoders (None = ``model.dtype``). fp16 is refused: it gives
    NaN latents with Pyramid Flow's VAE. Cached tensors are always stored in bf16."""
    store: Literal["mean_std", "sample"] = "mean_std"
    """Store the posterior's mean and std (the trainer samples each epoch) or one sample."""

    # -- text --------------------------------------------------------------------------------------
    text: bool = True
    """Encode captions with the model's text encoders (and the empty prompt, for caption dropout)."""
    text_encoder: str | None = None
    """Folder with ``tokenizer/``, ``text_encoder/``, ``tokenizer_2/``, ``text_encoder_2/``;
    default: ``model.path``."""
    max_sequence_length: int = Field(default=128, ge=1)
    """T5 tokens per prompt (Pyramid Flow uses 128)."""

    # -- run control -------------------------------------------------------------------------------
    max_failures: int | None = Field(default=None, ge=0)
    """Exit 1 when more inputs than this fail (None = never; failures are always reported)."""
    num_workers: int | Literal["auto"] = "auto"
    """DataLoader worker processes that decode, resize and crop while the VAE encodes (0 = one prefetch
    thread); ``auto``: min(8, CPU cores / processes on this host), at least 1."""
    prefetch: int = Field(default=2, ge=1)
    """Decoded videos queued ahead of the encoder (per worker)."""
    batch_size: int = Field(default=1, ge=1, le=MAX_BATCH)
    """Clips of one shape (frames x height x width) per VAE call; clips of other shapes wait for their
    own batch, the last batch of each shape may be smaller. Same latents as one clip per call (to float
    rounding). On a device that runs out of memory the batch is split in halves (and the smaller size
    kept for the rest of the run). Default 1: a 121-frame 384p clip already fills a large GPU, so larger
    batches ran no faster there and took their multiple of the memory (benchmarks/RESULTS.md, session
    16); they help clips too short or small to fill the device."""

    @field_validator("buckets")
    @classmethod
    def _check_buckets(cls, value: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if not value:
            raise ValueError("at least one bucket [width, height] is needed")
        seen = set()
        for width, height in value:
            if width < 8 or height < 8:
                raise ValueError(f"bucket [{width}, {height}] is too small")
            if (width, height) in seen:
                raise ValueError(f"bucket [{width}, {height}] is listed twice")
            seen.add((width, height))
        return value

    @field_validator("num_workers", mode="before")
    @classmethod
    def _check_workers(cls, value: object) -> object:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WORKERS:
            raise ValueError(f"must be 'auto' or a whole number 0..{MAX_WORKERS}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_frames(self) -> EncodeConfig:
        if self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) must be <= max_frames ({self.max_frames})")
        return self
