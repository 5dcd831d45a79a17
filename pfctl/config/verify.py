"""``verify:`` section — options of ``pfctl verify-groupnorm``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pfctl.config.base import Section


class ToleranceConfig(Section):
    """Pass/warn limits (SPEC-verify-groupnorm §5). Override any with ``--tol KEY=VALUE``."""

    exact_rel_l2: float = Field(default=1e-5, gt=0)
    """EXACT-CHUNKABLE VAEs and the exact chunked encode: fp32 latent relL2 must be at most this."""
    exact_max_abs: float = Field(default=1e-4, gt=0)
    """… and the fp32 latent max abs error at most this."""
    bf16_floor_factor: float = Field(default=2.0, gt=0)
    """In bf16 an exact path must stay within this multiple of the noise floor F (bf16 full vs fp32 full)."""
    approx_rel_l2_pass: float = Field(default=1e-2, gt=0)
    """STATS/ATTN-COUPLED approximate paths: latent relL2 pass limit."""
    approx_rel_l2_warn: float = Field(default=5e-2, gt=0)
    """… warn limit (worse fails)."""
    psnr_pass_db: float = 40.0
    """Decoded chunked-vs-full PSNR pass limit (dB, range 2 for [-1, 1])."""
    psnr_warn_db: float = 35.0
    delta_psnr_pass_db: float = Field(default=0.1, ge=0)
    """Loss of PSNR against the input, chunked vs full, pass limit (dB)."""
    delta_psnr_warn_db: float = Field(default=0.5, ge=0)
    drift_warn: float = Field(default=0.05, gt=0)
    """Warn when d_mu or d_sigma exceed this in an early time-coupled GroupNorm."""
    early_layers: int = Field(default=4, ge=1)
    """How many of the first time-coupled GroupNorms count as 'early'."""


class VerifyConfig(Section):
    """Options of verify-groupnorm: which VAE, which clip, which chunkings, where to write."""

    vae: str | None = None
    """VAE folder (config.json ``_class_name``) or built-in: causal-vae-tiny, cogvideox-tiny, wan-tiny,
    ltx-tiny, hunyuan-tiny, mochi-tiny. None: pfctl's embedded demo VAE if present, else causal-vae-tiny."""
    video: str | None = None
    """A video file (decord); None: a built-in synthetic clip with a fade and a hard cut."""
    num_frames: int = Field(default=49, ge=1)
    """Frames taken from the clip (lowered to the VAE's frame contract, e.g. 1+8k, with a note)."""
    height: int = Field(default=64, ge=8)
    width: int = Field(default=64, ge=8)
    fps: float | None = Field(default=None, gt=0)
    """Sampling rate for --video (None: the file's own rate)."""
    chunk_sizes: list[int] = Field(default_factory=lambda: [4, 8, 16])
    """Chunk sizes swept (frames; rounded up to the VAE's temporal stride)."""
    exact_chunk_frames: int | None = Field(default=None, ge=1)
    """Chunk size of the exact chunked encode (None: the library's own chunk size)."""
    exact_schedule: Literal["recompute", "parked"] = "recompute"
    """How the exact encode gets whole-clip GroupNorm statistics: ``recompute`` (default) runs the chunks in
    passes from a checkpoint, one pass per time-coupled norm, keeping no chunk's activations between
    passes — at most the framewise path's memory with its default 4-frame chunks, ~1.5x the convolutions;
    ``parked`` keeps every chunk's activation at each norm (less compute, about twice the framewise
    memory; CogVideoX only). Same latents to float rounding. Trade-off: benchmarks/RESULTS.md."""
    exact_checkpoint_gib: float | None = Field(default=None, ge=0)
    """``recompute`` only: memory (GiB) for the checkpoint the passes restart from (None: no limit, at
    most one whole-clip activation; less: the first chunks recompute from earlier, down to 0 — every
    pass from the input clip, least memory, ~15-20x the compute)."""
    exact_offload_above_gib: float | None = Field(default=None, ge=0)
    """``parked`` only: GPU memory (GiB) for the exact encode's parked norm inputs before the rest wait in
    host memory (None: all stay on the GPU). Lowers the parked encode's peak at some cost in time
    (copies back and forth; measured figures: benchmarks/RESULTS.md)."""
    dtypes: list[Literal["fp32", "bf16"]] = Field(default_factory=lambda: ["fp32", "bf16"])
    """fp32 is the reference; bf16 adds the noise floor F and the bf16 check of the library path."""
    decode: bool = True
    """Decode both latents with the same decoder to report PSNR and flicker."""
    memory: bool = True
    """Measure peak memory of the one-call and exact encodes: CUDA allocator statistics on a GPU,
    glibc malloc's bytes in use on the CPU (method stated in the report)."""
    memory_frames: int | None = Field(default=None, ge=1)
    """Clip length for the memory comparison (None: the measured clip)."""
    tolerances: ToleranceConfig = Field(default_factory=ToleranceConfig)
    json_path: str | None = None
    """Write the full report as JSON here (``--json``)."""
    plot_path: str | None = None
    """Write a PNG of per-latent-frame error here (``--plot``; drawn with Pillow, no matplotlib)."""
    device: Literal["auto", "cpu", "cuda"] | None = None
    """None: runtime.device."""
    seed: int = 0
    """Seed of the synthetic clip and of built-in tiny VAEs' weights."""

    @field_validator("chunk_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v):
            raise ValueError("chunk sizes must be >= 1")
        return v
