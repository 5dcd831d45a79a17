"""Train the tiny causal VAE of the embedded shapes model, reproducibly, on the CPU.

``python -m pfctl.demo.train_vae OUT_DIR`` writes ``OUT_DIR/causal_video_vae/`` (config.json +
diffusion_pytorch_model.safetensors) and ``OUT_DIR/vae_train_log.jsonl``.

Why it looks like this:

* **Same class as the real VAE.** :class:`~pfctl.models.causal_vae.CausalVideoVAE` with the real
  block structure (8x space, 8x time, 16 latent channels) and few channels, so every command
  exercises the code path of the published model.
* **Data is rendered, not decoded.** Clips come from :func:`pfctl.demo.shapes.render_clip` (the
  generator ``pfctl demo`` and the DiT recipe use), with random flips/transposes as cheap
  augmentation; no video files are needed, so a run is a pure function of the seed.
* **Loss = MSE + tiny KL + latent moments.** Reconstruction is a pixel MSE in which shape pixels
  weigh ``fg_weight`` times more than background ones (a shape covers a few percent of a frame;
  unweighted, a young VAE first learns to paint the background and little else). The KL term
  (weight ``kl_weight``) keeps the posterior a real distribution, so the decoder tolerates the
  small errors of the DiT's samples. The DiT does not see raw latents: it sees them after the
  Pyramid Flow normalisation (``(z - shift) * scale``, image factors for latent frame 0, video
  factors later; :mod:`pfctl.models.vae`). A VAE trained from scratch has no reason to land on
  the published VAE's statistics, so a moment term pulls the *normalised* latents of each
  channel and frame type towards mean 0 and std 1 — what flow matching expects of its data.
* **Then the decoder alone.** A second phase (``decoder_steps``) freezes the encoder and trains
  the decoder with the shapes' edges weighted ``decoder_edge_weight`` times more: after the
  first phase the latents already tell a square from a circle, but the decoder rounds corners
  off (the silhouette is what :mod:`pfctl.demo.score` reads the shape from). The encoder, and so
  the latents a DiT is trained on, stay as they are, so the phase can be run on an existing VAE
  (:func:`train_vae_decoder`) without invalidating a latent cache.
* **Deterministic.** One seed drives model init, the clip pool and batch order (own
  generators; the global RNG is left alone), one thread by default, so a rerun on the same
  machine and torch build reproduces the weights bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pfctl.demo.shapes import BACKGROUND, DEFAULT_COLORS, DIRECTIONS, SHAPES, plan_clips, render_clip
from pfctl.errors import ConfigError

SHAPES_VAE_CONFIG: dict[str, Any] = {
    "encoder_in_channels": 3,
    "encoder_out_channels": 16,
    "encoder_layers_per_block": [1, 1, 1, 1],
    "encoder_block_out_channels": [8, 16, 32, 32],
    "encoder_norm_num_groups": 4,
    "decoder_in_channels": 16,
    "decoder_out_channels": 3,
    "decoder_layers_per_block": [1, 1, 1, 1],
    "decoder_block_out_channels": [8, 16, 32, 32],
    "decoder_norm_num_groups": 4,
    "scaling_factor": 1.0,
    "interpolate": False,
}
"""The shapes VAE: the published block layout (4 blocks, 8x/8x, 16 channels) at 8-32 channels."""
DECODER_PREFIXES = ("decoder.", "post_quant_conv.")
"""Parameter names of the part the decoder phase trains."""


@dataclass
class VAETrainConfig:
    """Everything that determines the trained weights (recorded next to them)."""

    steps: int = 1300
    batch_size: int = 4
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    kl_weight: float = 1e-6
    fg_weight: float = 5.0
    """Weight of shape pixels (those far from the plain background) in the reconstruction loss:
    shapes cover under a tenth of a frame, and their colour is what the demo is about."""
    moment_weight: float = 1e-2
    grad_clip: float = 1.0
    init: str = "torch"
    """``torch``: PyTorch's default (Kaiming-uniform) initialisation of every conv; ``reference``:
    the reference's truncated normal with std 0.02, made for 128-512 channels — at 8-32 channels it
    shrinks every signal path, and colour is learned several times slower (measured: 59 % vs 23 %
    correct hues after 300 image steps)."""
    decoder_steps: int = 1600
    """Steps of the second phase (encoder frozen, decoder only, edge-weighted loss); 0 skips it."""
    decoder_lr: float = 1e-3
    decoder_min_lr: float = 1e-5
    decoder_warmup_steps: int = 20
    decoder_edge_weight: float = 20.0
    """Extra weight of the pixels on a shape's edge (a 2-pixel band: the 3x3 dilation of the
    shape mask minus its 3x3 erosion) in the decoder phase, on top of ``fg_weight``."""
    image_steps: int = 500
    """First train on single frames (frame 0 of each clip): ~17x cheaper per sample, so the
    spatial path (shapes, colours) is learned fast; the remaining steps use whole clips."""
    logvar_init: float | None = -4.0
    """Initial posterior log-variance (bias of ``quant_conv``'s log-variance half). Starting near
    deterministic (std 0.14 against latents of std 2-3) lets reconstruction learn first; with
    the default init (std 1) the decoder spends hundreds of steps fighting sampling noise."""
    num_clips: int = 512
    """Size of the rendered clip pool (classes cycle, so every class is equally frequent)."""
    size: int = 64
    num_frames: int = 17
    seed: int = 0
    threads: int = 1
    device: str = "cpu"
    max_seconds: float | None = None
    """Stop early (and save) after this many seconds; the steps done are recorded."""
    colors: list[str] = field(default_factory=lambda: list(DEFAULT_COLORS))
    shapes: list[str] = field(default_factory=lambda: list(SHAPES))
    directions: list[str] = field(default_factory=lambda: list(DIRECTIONS))
    vae_config: dict[str, Any] = field(default_factory=lambda: dict(SHAPES_VAE_CONFIG))


@dataclass
class VAETrainResult:
    folder: Path
    steps: int
    seconds: float
    final: dict[str, float]


def render_pool(cfg: VAETrainConfig) -> torch.Tensor:
    """(N, 3, T, H, W) float in [-1, 1]: the rendered training clips (uint8 kept small in memory)."""
    clips = plan_clips(
        cfg.num_clips,
        (cfg.size, cfg.size),
        cfg.num_frames,
        cfg.seed,
        colors=cfg.colors,
        shapes=cfg.shapes,
        directions=cfg.directions,
    )
    frames = np.stack([render_clip(c, (cfg.size, cfg.size), cfg.num_frames) for c in clips])
    return torch.from_numpy(frames).permute(0, 4, 1, 2, 3).contiguous()  # uint8 (N, 3, T, H, W)


def _augment(batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random horizontal / vertical flips and a transpose per clip (motion stays straight)."""
    out = []
    for clip in batch:
        flips = torch.randint(0, 2, (3,), generator=gen).tolist()
        if flips[0]:
            clip = clip.flip(-1)
        if flips[1]:
            clip = clip.flip(-2)
        if flips[2]:
            clip = clip.transpose(-1, -2)
        out.append(clip)
    return torch.stack(out)


def _to_unit(clips: torch.Tensor) -> torch.Tensor:
    return clips.float() / 127.5 - 1.0


def kl_to_prior(mean: torch.Tensor, logvar: torch.Tensor, norm: Any) -> torch.Tensor:
    """Mean KL(N(mean, exp(logvar)) || prior) per element, the prior being the distribution the
    latent normalisation maps to N(0, 1): N(shift, 1/scale^2) per frame type."""
    shifts = torch.full_like(mean[:, :1, :, :1, :1], norm.video_shift)
    scales = torch.full_like(shifts, norm.video_scale)
    shifts[:, :, :1] = norm.image_shift
    scales[:, :, :1] = norm.image_scale
    # prior log-variance = -2 log(scale)
    prior_logvar = -2.0 * torch.log(scales)
    kl = 0.5 * (prior_logvar - logvar + (logvar.exp() + (mean - shifts) ** 2) * scales**2 - 1.0)
    return kl.mean()


def moment_penalty(z_norm: torch.Tensor) -> torch.Tensor:
    """Per channel and frame type (image frame / later frames): mean^2 + log(std)^2 of the
    normalised latents over batch and space — zero when they are standardised."""
    terms = []
    groups = [z_norm[:, :, :1]] + ([z_norm[:, :, 1:]] if z_norm.shape[2] > 1 else [])
    for part in groups:
        flat = part.transpose(0, 1).reshape(part.shape[1], -1)
        mean = flat.mean(dim=1)
        std = flat.std(dim=1) + 1e-6
        terms.append((mean**2 + torch.log(std) ** 2).mean())
    return torch.stack(terms).mean()


def _lr_at(step: int, cfg: VAETrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def _decoder_lr_at(step: int, cfg: VAETrainConfig) -> float:
    if step < cfg.decoder_warmup_steps:
        return cfg.decoder_lr * (step + 1) / cfg.decoder_warmup_steps
    cosine = 1 + math.cos(math.pi * step / cfg.decoder_steps)
    return cfg.decoder_min_lr + 0.5 * (cfg.decoder_lr - cfg.decoder_min_lr) * cosine


def edge_weights(x: torch.Tensor, background: torch.Tensor, cfg: VAETrainConfig) -> torch.Tensor:
    """(B, 1, T, H, W) loss weights of the decoder phase: 1 on the background, ``fg_weight`` on
    the shape, plus ``decoder_edge_weight`` on the band around its outline."""
    shape = ((x - background).abs().amax(dim=1, keepdim=True) > 0.1).float()
    dilated = F.max_pool3d(shape, (1, 3, 3), 1, (0, 1, 1))
    eroded = -F.max_pool3d(-shape, (1, 3, 3), 1, (0, 1, 1))
    return 1 + (cfg.fg_weight - 1) * shape + cfg.decoder_edge_weight * (dilated - eroded)


def _init_model(cfg: VAETrainConfig) -> torch.nn.Module:
    """The VAE of ``cfg.vae_config``, initialised from ``cfg.seed`` (global RNG left untouched)."""
    from pfctl.models.causal_vae import CausalVideoVAE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = CausalVideoVAE(**cfg.vae_config)
        if cfg.init == "torch":
            for module in model.modules():
                if isinstance(module, torch.nn.Conv3d | torch.nn.Linear | torch.nn.GroupNorm):
                    module.reset_parameters()
        elif cfg.init != "reference":
            raise ConfigError(f"unknown init {cfg.init!r}", hint="use torch or reference")
        if cfg.logvar_init is not None:
            with torch.no_grad():
                half = model.quant_conv.conv.bias.shape[0] // 2
                model.quant_conv.conv.bias[half:] = cfg.logvar_init
    return model


def _optimizer(model: torch.nn.Module, cfg: VAETrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices / kernels only."""
    params_decay = [p for p in model.parameters() if p.ndim > 1]
    params_rest = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW(
        [{"params": params_decay, "weight_decay": 1e-4}, {"params": params_rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.99),
    )


def _optimize_step(
    model: Any,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    background: torch.Tensor,
    noise_gen: torch.Generator,
    cfg: VAETrainConfig,
) -> tuple[dict[str, float], Any]:
    """One optimiser step on the batch ``x``; returns the step's loss terms and its posterior."""
    from pfctl.models.vae import FLUX_LATENT_NORM, normalize_latents

    posterior = model.encode(x)
    eps = torch.randn(posterior.mean.shape, generator=noise_gen, device=x.device)
    z = posterior.mean + posterior.std * eps
    recon = model.decode(z)
    err = (recon - x) ** 2
    mse = err.mean()
    weight = 1.0 + (cfg.fg_weight - 1.0) * ((x - background).abs().amax(dim=1, keepdim=True) > 0.1)
    recon_loss = (weight * err).mean()
    kl = kl_to_prior(posterior.mean, posterior.logvar, FLUX_LATENT_NORM)
    moments = moment_penalty(normalize_latents(posterior.mean, FLUX_LATENT_NORM))
    loss = recon_loss + cfg.kl_weight * kl + cfg.moment_weight * moments
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    opt.step()
    terms = {
        key: value.item() for key, value in (("loss", loss), ("mse", mse), ("kl", kl), ("moments", moments))
    }
    return {**terms, "grad_norm": grad_norm}, posterior


def _background(device: torch.device) -> torch.Tensor:
    """The plain background colour as a (1, 3, 1, 1, 1) tensor in [-1, 1]."""
    return torch.tensor(BACKGROUND, dtype=torch.float32, device=device).view(1, 3, 1, 1, 1) / 127.5 - 1


def _draw_batch(
    pool: torch.Tensor, batch_size: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``batch_size`` clips of ``pool`` drawn and augmented with ``gen``, in [-1, 1] on ``device``."""
    idx = torch.randint(0, pool.shape[0], (batch_size,), generator=gen)
    return _to_unit(_augment(pool[idx], gen)).to(device)


def _psnr(mse: float) -> float:
    """PSNR in dB of a mean squared error over pixels in [-1, 1] (peak-to-peak 2; errors below 1e-12 count as 1e-12)."""
    return 10 * math.log10(4.0 / max(mse, 1e-12))


def _emit(
    record: dict[str, Any], log_lines: list[str], on_log: Callable[[dict[str, Any]], None] | None
) -> None:
    """One log record: a JSON line of the log, and to ``on_log``."""
    log_lines.append(json.dumps(record, sort_keys=True))
    if on_log is not None:
        on_log(record)


def _train_loop(
    model: Any,
    pool: torch.Tensor,
    cfg: VAETrainConfig,
    start: float,
    on_log: Callable[[dict[str, Any]], None] | None,
    log_every: int,
) -> tuple[list[str], int]:
    """Run the training steps (until ``cfg.steps`` or ``cfg.max_seconds``); returns the log
    lines (JSON, one per ``log_every`` steps, also passed to ``on_log``) and the steps done."""
    device = torch.device(cfg.device)
    opt = _optimizer(model, cfg)
    background = _background(device)
    data_gen = torch.Generator().manual_seed(cfg.seed + 1)
    noise_gen = torch.Generator(device=device).manual_seed(cfg.seed + 2)
    log_lines: list[str] = []
    running: dict[str, float] = {}
    steps_done = 0
    for step in range(cfg.steps):
        if cfg.max_seconds is not None and time.perf_counter() - start > cfg.max_seconds:
            break
        steps_done = step + 1
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        x = _draw_batch(pool, cfg.batch_size, data_gen, device)
        if step < cfg.image_steps:
            x = x[:, :, :1]
        terms, posterior = _optimize_step(model, opt, x, background, noise_gen, cfg)
        for key, value in terms.items():
            running[key] = running.get(key, 0.0) + value
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            n = (step % log_every) + 1
            record = {"step": step + 1, **{k: v / n for k, v in running.items()}}
            record["psnr"] = _psnr(record["mse"])
            record["lr"] = _lr_at(step, cfg)
            record["posterior_std"] = posterior.std.detach().mean().item()
            record["elapsed_s"] = round(time.perf_counter() - start, 1)
            _emit(record, log_lines, on_log)
            running = {}
    return log_lines, steps_done


def _decoder_loop(
    model: Any,
    pool: torch.Tensor,
    cfg: VAETrainConfig,
    on_log: Callable[[dict[str, Any]], None] | None,
    log_every: int,
) -> tuple[list[str], int]:
    """The decoder phase: ``cfg.decoder_steps`` steps on the decoder (and ``post_quant_conv``)
    with the encoder frozen, loss weighted by :func:`edge_weights`; returns the log lines and
    the steps done (``cfg.max_seconds`` counts from the phase's start)."""
    device = torch.device(cfg.device)
    params = [p for name, p in model.named_parameters() if name.startswith(DECODER_PREFIXES)]
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(DECODER_PREFIXES))
    opt = torch.optim.AdamW(params, lr=cfg.decoder_lr, betas=(0.9, 0.99), weight_decay=1e-4)
    background = _background(device)
    # own generators: the phase draws the same batches whether it follows the first phase in
    # the same call or runs later on the saved VAE (train_vae_decoder)
    data_gen = torch.Generator().manual_seed(cfg.seed + 11)
    noise_gen = torch.Generator(device=device).manual_seed(cfg.seed + 12)
    start = time.perf_counter()
    log_lines: list[str] = []
    running, steps_done = 0.0, 0
    for step in range(cfg.decoder_steps):
        if cfg.max_seconds is not None and time.perf_counter() - start > cfg.max_seconds:
            break
        steps_done = step + 1
        for group in opt.param_groups:
            group["lr"] = _decoder_lr_at(step, cfg)
        x = _draw_batch(pool, cfg.batch_size, data_gen, device)
        with torch.no_grad():
            posterior = model.encode(x)
            eps = torch.randn(posterior.mean.shape, generator=noise_gen, device=device)
            z = posterior.mean + posterior.std * eps
        err = (model.decode(z) - x) ** 2
        loss = (edge_weights(x, background, cfg) * err).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        running += err.mean().item()
        if (step + 1) % log_every == 0 or step + 1 == cfg.decoder_steps:
            mse = running / ((step % log_every) + 1)
            record = {
                "phase": "decoder",
                "step": cfg.steps + step + 1,
                "mse": mse,
                "psnr": _psnr(mse),
                "lr": _decoder_lr_at(step, cfg),
                "elapsed_s": round(time.perf_counter() - start, 1),
            }
            _emit(record, log_lines, on_log)
            running = 0.0
    for param in model.parameters():
        param.requires_grad_(True)
    return log_lines, steps_done


@contextlib.contextmanager
def _torch_settings(cfg: VAETrainConfig) -> Iterator[None]:
    """``cfg.threads`` intra-op threads (restored afterwards); deterministic cuDNN kernels on a
    GPU, so a rerun on the same GPU gives the same weights."""
    old_threads = torch.get_num_threads()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if torch.device(cfg.device).type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)


def train_vae(
    out_dir: str | os.PathLike[str],
    cfg: VAETrainConfig | None = None,
    *,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    log_every: int = 25,
) -> VAETrainResult:
    """Train the shapes VAE (both phases) and save it as ``out_dir/causal_video_vae`` (safetensors),
    with ``vae_train_log.jsonl`` and ``vae_train_config.json`` beside it."""
    from pfctl.utils.io import atomic_write_json, atomic_write_text

    cfg = cfg or VAETrainConfig()
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.decoder_steps < 0:
        raise ConfigError(
            f"steps ({cfg.steps}) and batch_size ({cfg.batch_size}) must be >= 1, "
            f"decoder_steps ({cfg.decoder_steps}) >= 0"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _torch_settings(cfg):
        pool = render_pool(cfg)
        model = torch.nn.Module.to(_init_model(cfg), torch.device(cfg.device)).train()
        log_lines, steps_done = _train_loop(model, pool, cfg, start, on_log, log_every)
        decoder_lines, decoder_done = _decoder_loop(model, pool, cfg, on_log, log_every)
        model.eval()
        folder = out / "causal_video_vae"
        _save(model, folder)
    log_lines += decoder_lines
    final = json.loads(log_lines[-1]) if log_lines else {}
    atomic_write_text(out / "vae_train_log.jsonl", "".join(line + "\n" for line in log_lines))
    atomic_write_json(
        out / "vae_train_config.json",
        {
            **asdict(cfg),
            "steps_done": steps_done,
            "decoder_steps_done": decoder_done,
            "seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__,
        },
    )
    return VAETrainResult(folder=folder, steps=steps_done, seconds=time.perf_counter() - start, final=final)


def train_vae_decoder(
    out_dir: str | os.PathLike[str],
    cfg: VAETrainConfig | None = None,
    *,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    log_every: int = 25,
) -> VAETrainResult:
    """Run only the decoder phase on the VAE saved in ``out_dir/causal_video_vae`` (e.g. one
    trained before the phase existed) and save it back; its encoder, and so every latent it
    made, is unchanged. The log and ``vae_train_config.json`` gain the phase's records."""
    from pfctl.models.vae import load_causal_vae_folder
    from pfctl.utils.io import atomic_write_json, atomic_write_text

    cfg = cfg or VAETrainConfig()
    if cfg.decoder_steps < 1 or cfg.batch_size < 1:
        raise ConfigError(
            f"decoder_steps ({cfg.decoder_steps}) and batch_size ({cfg.batch_size}) must be >= 1"
        )
    out = Path(out_dir)
    folder = out / "causal_video_vae"
    start = time.perf_counter()
    with _torch_settings(cfg):
        pool = render_pool(cfg)
        model = load_causal_vae_folder(folder, device=cfg.device).train()
        log_lines, decoder_done = _decoder_loop(model, pool, cfg, on_log, log_every)
        _save(model.eval(), folder)
    log_path = out / "vae_train_log.jsonl"
    earlier = log_path.read_text(encoding="utf-8") if log_path.is_file() else ""
    atomic_write_text(log_path, earlier + "".join(line + "\n" for line in log_lines))
    record_path = out / "vae_train_config.json"
    record = json.loads(record_path.read_text(encoding="utf-8")) if record_path.is_file() else {}
    record.update({k: v for k, v in asdict(cfg).items() if k.startswith("decoder_")})
    record["decoder_steps_done"] = decoder_done
    record["decoder_seconds"] = round(time.perf_counter() - start, 1)
    atomic_write_json(record_path, record)
    final = json.loads(log_lines[-1]) if log_lines else {}
    return VAETrainResult(folder=folder, steps=decoder_done, seconds=time.perf_counter() - start, final=final)


def _save(model: torch.nn.Module, folder: Path) -> None:
    """config.json (``_class_name`` CausalVideoVAE) + safetensors weights, atomically."""
    from pfctl.utils.io import atomic_save_safetensors, atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().float() for k, v in model.state_dict().items()}
    atomic_save_safetensors(state, folder / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(model.config).items()}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    atomic_write_json(folder / "config.json", {"_class_name": "CausalVideoVAE", **config})


@torch.no_grad()
def evaluate_vae(
    vae: Any, clips: Sequence[Any] | None = None, *, size: int = 64, num_frames: int = 17, seed: int = 1234
) -> dict[str, float]:
    """Reconstruction PSNR (dB), normalised-latent statistics and the round trip's colour /
    direction / shape accuracy (:func:`pfctl.demo.score.score_clips` on the decoded clips) on
    fresh clips: a quick check of what a DiT trained on these latents can at best draw."""
    from pfctl.demo.score import score_clips

    planned = list(clips) if clips is not None else plan_clips(24, (size, size), num_frames, seed)
    x = torch.stack(
        [torch.from_numpy(render_clip(c, (size, size), num_frames)).permute(3, 0, 1, 2) for c in planned]
    )
    x = _to_unit(x)
    posterior = vae.encode(x)
    zn = vae.normalize(posterior.mean)
    recon = vae.decode(posterior.mean).clamp(-1, 1)
    mse = float(torch.mean((recon - x) ** 2))
    frames = ((recon.permute(0, 2, 3, 4, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
    report = score_clips([(c.caption, f) for c, f in zip(planned, frames, strict=True)])
    return {
        "psnr": _psnr(mse),
        "latent_mean": float(zn.mean()),
        "latent_std": float(zn.std()),
        "posterior_std": float(posterior.std.mean()),
        "color_accuracy": report.color_accuracy,
        "direction_accuracy": report.direction_accuracy,
        "shape_accuracy": report.shape_accuracy,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pfctl.demo.train_vae",
        description="Train the tiny causal VAE of the shapes demo model.",
    )
    parser.add_argument("out_dir")
    defaults = VAETrainConfig()
    ints = ("steps", "batch_size", "num_clips", "seed", "threads", "size", "num_frames", "image_steps")
    for name in (*ints, "decoder_steps", "decoder_warmup_steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    floats = ("lr", "min_lr", "kl_weight", "moment_weight", "fg_weight", "grad_clip", "logvar_init")
    for name in (*floats, "decoder_lr", "decoder_min_lr", "decoder_edge_weight"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--init", default=defaults.init, choices=["torch", "reference"])
    parser.add_argument("--max-seconds", type=float, default=None)
    parser.add_argument(
        "--decoder-only",
        action="store_true",
        help="run only the decoder phase on the VAE already in OUT_DIR (its latents stay the same)",
    )
    args = parser.parse_args(argv)
    cfg = VAETrainConfig(**{k: v for k, v in vars(args).items() if k not in ("out_dir", "decoder_only")})

    def show(record: dict[str, Any]) -> None:
        if record.get("phase") == "decoder":
            print(
                f"vae decoder step {record['step']}/{cfg.steps + cfg.decoder_steps}  mse {record['mse']:.5f} "
                f"({record['psnr']:.1f} dB)  lr {record['lr']:.2e}  {record['elapsed_s']:.0f} s",
                flush=True,
            )
            return
        print(
            f"vae step {record['step']}/{cfg.steps}  mse {record['mse']:.5f} ({record['psnr']:.1f} dB)  "
            f"kl {record['kl']:.3f}  moments {record['moments']:.3f}  grad {record['grad_norm']:.2f}  "
            f"std {record['posterior_std']:.3f}  lr {record['lr']:.2e}  "
            f"{record['elapsed_s']:.0f} s",
            flush=True,
        )

    result = (train_vae_decoder if args.decoder_only else train_vae)(args.out_dir, cfg, on_log=show)
    print(f"saved {result.folder} after {result.steps} steps in {result.seconds:.0f} s", flush=True)
    from pfctl.models.vae import load_vae

    stats = evaluate_vae(load_vae(result.folder), size=cfg.size, num_frames=cfg.num_frames)
    print("held-out clips: " + "  ".join(f"{k} {v:.3f}" for k, v in stats.items()), flush=True)


if __name__ == "__main__":
    main()
