"""pfctl vs the reference implementation, side by side in one process: generate and train.

Both load the same checkpoint folder — a random real-size miniFLUX DiT (and, for generate, the
released causal-VAE architecture), written once in the official layout — each with its own code,
and get the same text features: random features of the real widths (T5-XXL 4096 x 128 tokens,
CLIP-L 768) stand in for the text encoders on both sides.

* ``generate``: one t2v video. The reference draws its initial latents and stage-transition
  block noise; the harness records them and replays them into pfctl's sampler
  (``initial_noise`` / ``block_noises``), so the latents must agree; the timed pfctl run draws
  its own noise, as a user's run does. Then both decoders decode the reference's latents.
* ``train``: the reference runs its own training step (temporal-pyramid noising, DiT, loss,
  AdamW) and the harness records what its DiT and loss receive; pfctl runs its DiT, loss and
  optimizer on exactly those inputs from the same starting weights, so the losses must agree.
  pfctl's timed step is therefore DiT + loss + backward + optimizer; its own batch building and
  noising are timed with the whole trainer by ``bench_train.py``. Both optimizers are AdamW with
  norms and biases exempt from weight decay (the reference's ``create_optimizer``). The reference
  runs its masked attention with cuDNN's kernel off, as pfctl's trainer does by default (cuDNN plans
  for every new shape); pfctl on the kernel each variant names (``--train-variants``: ``efficient``
  or ``cudnn``; ``+compile``: compiled blocks; ``+graphs``: compiled blocks replayed as CUDA graphs),
  all timed against one reference run.

The reference is not part of pfctl: clone jy0205/Pyramid-Flow into a git-ignored folder (default
``third_party/Pyramid-Flow``) and install ``einops`` (its dependency). To run it on current
software the harness (a) stubs ``tensorboardX``, ``IPython``, ``timm`` and ``torchvision`` when
they are not installed (used only by its training utilities, LPIPS and weight initialisers that
the loaded weights replace), and (b) adds 1e-6 to the diagonal of its block-noise covariance
``(1+g)I - g`` (exactly singular for g = 1/3, which torch >= 2.4 refuses: its issues
#53/#121/#209).

* CUDA: generate a 5 s 384p video — 640x384, temp 16, steps [20,20,20] / [10,10,10], CFG 7 / 5,
  bf16 weights, the reference under bf16 autocast as in its demo scripts, decode window 1 (the
  reference with 256-px tiles, its ``save_memory``; pfctl with its ``--decode-tile``, by default
  untiled where it fits); pfctl keeps its CUDA graphs across the runs of its side, as ``pfctl
  generate`` does for several videos of one size; train miniFLUX at 384p, 16 latent
  frames, batch 4 (columns [1,2,1]), G = 8 (rank 0's units), fp32 master weights + bf16 autocast.
* CPU (a check of the harness itself): a 1+1-block DiT and the tiny VAE in fp32; outputs agree to
  fp32 rounding.

Exit code 1 when the outputs disagree beyond the tolerance.

    python benchmarks/bench_reference.py all                   # CPU check
    python benchmarks/bench_reference.py all --device cuda --json reference.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_generate import REAL_VAE, RandomTextEncoder  # noqa: E402
from kernel_profile import kernel_breakdown, print_breakdown  # noqa: E402
from reference_setup import (  # noqa: E402
    COVARIANCE_JITTER,
    PROMPT,
    TOLERANCE,
    VARIANT,
    autocast,
    gib,
    import_reference,
    open_reference,
    prepare_checkpoint,
    reference_noise_recorder,
    relative_l2,
    synchronize,
    time_call,
)


# ----------------------------------------------------------------------------- main
@dataclass(frozen=True)
class GenerateCase:
    """The one video both sides generate: size, steps, guidance, dtype, and the checkpoint folder and text
    features both load."""

    width: int
    height: int
    temp: int
    steps: tuple[list[int], list[int]]
    cfg: tuple[float, float]
    dtype: torch.dtype
    folder: Path
    dit_params: int
    positive: Any
    negative: Any


def generate_case(args: argparse.Namespace, device: torch.device) -> GenerateCase:
    """A 5 s 384p video of miniFLUX on CUDA; a few 64x64 frames of the small CPU DiT on the CPU."""
    from pfctl.config.generate import RESOLUTIONS
    from pfctl.models.vae import TINY_CAUSAL_VAE_CONFIG

    cuda = device.type == "cuda"
    resolution = args.resolution or ("384p" if cuda else "64x64")
    width, height = RESOLUTIONS[resolution] if resolution in RESOLUTIONS else map(int, resolution.split("x"))
    dtype = torch.bfloat16 if cuda else torch.float32
    folder, dit_params, text = prepare_checkpoint(device, dtype, REAL_VAE if cuda else TINY_CAUSAL_VAE_CONFIG)
    return GenerateCase(
        width=width, height=height, temp=args.temp or (16 if cuda else 3),
        steps=([20, 20, 20], [10, 10, 10]) if cuda else ([1, 1, 1], [1, 1, 1]), cfg=(7.0, 5.0),
        dtype=dtype, folder=folder, dit_params=dit_params,
        positive=text.encode([PROMPT]), negative=text.encode([""]),  # the same features on both sides
    )  # fmt: skip


def reference_generate(
    args: argparse.Namespace, Reference: type, device: torch.device, case: GenerateCase
) -> tuple[dict, torch.Tensor, dict, list]:
    """The reference's runs (loading timed as its demo loads: the folder, then the DiT and VAE to the device)
    and its decode of its last latents: its result record, those latents, the noise it drew for them, and the
    decoded frames."""
    start = time.perf_counter()
    ref = open_reference(Reference, case.folder, device, load_vae=True)
    ref.dit.to(device).eval()
    ref.vae.to(device).eval()
    synchronize(device)
    load_s = time.perf_counter() - start

    def text_features(prompt: str, _device: object) -> tuple:
        e = case.negative if prompt == "" else case.positive
        return e.prompt_embeds, e.prompt_attention_mask, e.pooled_prompt_embeds

    ref.text_encoder = text_features

    def run() -> tuple:
        with torch.no_grad(), autocast(device), reference_noise_recorder(ref) as record:
            latents = ref.generate(
                prompt=PROMPT, negative_prompt="", height=case.height, width=case.width, temp=case.temp,
                num_inference_steps=case.steps[0], video_num_inference_steps=case.steps[1],
                guidance_scale=case.cfg[0], video_guidance_scale=case.cfg[1],
                generator=torch.Generator(device).manual_seed(0), output_type="latent",
            )  # fmt: skip
        return latents, record

    def decode(latents: torch.Tensor) -> list:
        with torch.no_grad(), autocast(device):
            return ref.decode_latent(latents.clone(), save_memory=True)

    runs = [time_call(run, device) for _ in range(args.reference_repeats or args.repeats)]
    (latents, record), sample_s, sample_peak = runs[-1]
    frames, decode_s, decode_peak = [time_call(lambda: decode(latents), device) for _ in range(args.repeats)][
        -1
    ]
    print(f"reference: sampling {sample_s:.2f} s, decode {decode_s:.2f} s")
    ref.dit = ref.vae = None  # free the reference's weights before pfctl loads its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result = {
        "load_s": load_s, "sample_s": sample_s, "decode_s": decode_s, "sample_peak_gib": sample_peak,
        "decode_peak_gib": decode_peak, "all_sample_s": [r[1] for r in runs],
    }  # fmt: skip
    return result, latents, record, frames


def timed_graph_captures(into: list[float]) -> None:
    """Every CUDA-graph capture of the sampler's stages from here on adds its host seconds to ``into``."""
    from pfctl.models.fast.cuda_graph import StageGraph

    capture = StageGraph._capture

    def timed_capture(self: StageGraph, *a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return capture(self, *a, **kw)
        finally:
            into.append(time.perf_counter() - start)

    StageGraph._capture = timed_capture


def pfctl_generate_setup(
    args: argparse.Namespace, device: torch.device, case: GenerateCase
) -> SimpleNamespace:
    """pfctl loading the same folder with its own code, then its speed layer as ``pfctl generate`` applies it for
    a run of this many videos (attention settings, kernel checks, compiled blocks with automatic dynamic
    shapes: the first timed run pays the compilation)."""
    from pfctl.config.fast import FastPathsConfig
    from pfctl.config.generate import GenerateConfig
    from pfctl.models.checkpoint import load_dit_folder
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.models.vae import load_vae, with_fast_paths
    from pfctl.sampling.generate import attention_kernel

    start = time.perf_counter()
    dit = load_dit_folder(case.folder / VARIANT, dtype=case.dtype, device=device).eval()
    vae = load_vae(str(case.folder / "causal_video_vae"), dtype=case.dtype, device=device)
    synchronize(device)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    defaults = GenerateConfig()  # attention as pfctl generate sets it unless told otherwise
    skip = defaults.skip_future_keys if args.skip_future_keys is None else args.skip_future_keys
    attention = attention_kernel(
        args.attention or defaults.attention, device, videos=args.repeats, keep_graphs=not args.no_cuda_graphs
    )
    dit.set_attention_backend(attention, skip, defaults.row_group_min_tokens)
    apply_fast_paths(dit, FastPaths(compile=args.compile and device.type == "cuda", dynamic=None))
    vae = with_fast_paths(vae, FastPathsConfig())
    synchronize(device)
    return SimpleNamespace(
        dit=dit, vae=vae, load_s=load_s, setup_s=time.perf_counter() - start, attention=attention, skip=skip
    )


def pfctl_generate(
    args: argparse.Namespace, device: torch.device, case: GenerateCase, ref_latents: torch.Tensor, noise: dict
) -> tuple[dict, dict, torch.Tensor, torch.Tensor, list]:
    """pfctl's runs on its own noise, as a user's; one more on the reference's ``noise``; its decode of
    ``ref_latents``. Returns its result record, its options, the latents of its last run and of the one on the
    reference's noise, and the decoded frames."""
    from pfctl.sampling.decode import decode_latents, free_memory, resolve_decode_tile
    from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents

    pf = pfctl_generate_setup(args, device, case)
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    settings = SamplingSettings(
        num_inference_steps=tuple(case.steps[0]), video_num_inference_steps=tuple(case.steps[1]),
        guidance_scale=case.cfg[0], video_guidance_scale=case.cfg[1], cuda_graphs=not args.no_cuda_graphs,
    )  # fmt: skip
    common: dict[str, Any] = dict(
        settings=settings, temp=case.temp, height=case.height // 8, width=case.width // 8, dtype=case.dtype,
        device=device,
    )  # fmt: skip
    capture_s: list[float] = []  # the host time of each graph capture, for the first video's cost
    if graphs:
        from pfctl.models.fast.cuda_graph import StageGraph

        # as pfctl generate runs several videos of one size: the graphs captured by the first run replay
        # in the later ones (the timed run is the last)
        common["graphs"] = StageGraph(pf.dit, keep=True)
        timed_graph_captures(capture_s)
    conditioning = TextConditioning.from_pair(case.positive, case.negative)

    def run(**noise_: Any) -> torch.Tensor:
        with torch.no_grad():
            return generate_latents(pf.dit, conditioning, **common, **noise_)

    runs, captures = [], []
    for _ in range(args.repeats):
        runs.append(time_call(lambda: run(generator=torch.Generator(device).manual_seed(0)), device))
        captures.append((len(capture_s), sum(capture_s)))
        capture_s.clear()
    print(f"pfctl: sampling {', '.join(f'{r[1]:.2f}' for r in runs)} s; graph captures (count, host s) "
          + ", ".join(f"{n} / {t:.2f}" for n, t in captures))  # fmt: skip
    replayed = run(initial_noise=noise["initial"], block_noises=noise["blocks"])
    tile = resolve_decode_tile(
        args.decode_tile, height=case.height, width=case.width, window=1, dtype=case.dtype,
        available=free_memory(device),
    )  # fmt: skip
    with torch.no_grad():
        (_, frames), decode_s, decode_peak = [
            time_call(
                lambda: decode_latents(pf.vae, ref_latents, chunking="framewise", window=1, tile=tile), device
            )
            for _ in range(args.repeats)
        ][-1]
    result = {
        "load_s": pf.load_s, "fast_paths_s": pf.setup_s, "sample_s": runs[-1][1], "decode_s": decode_s,
        "sample_peak_gib": runs[-1][2], "decode_peak_gib": decode_peak, "decode_tile": tile,
        "all_sample_s": [r[1] for r in runs], "captures_per_run": [n for n, _ in captures],
        "capture_host_s_per_run": [t for _, t in captures],
    }  # fmt: skip
    options = {
        "cuda_graphs": graphs, "compile": device.type == "cuda" and args.compile, "attention": pf.attention,
        "skip_future_keys": pf.skip,
    }  # fmt: skip
    return result, options, runs[-1][0], replayed, frames


def side_by_side_generate(args: argparse.Namespace, Reference: type, device: torch.device) -> dict:
    """Sampling + decode of one video by both implementations; returns the result record."""
    import numpy as np

    case = generate_case(args, device)
    ref, ref_latents, noise, ref_frames = reference_generate(args, Reference, device, case)
    pf, options, own_latents, replayed, pf_frames = pfctl_generate(args, device, case, ref_latents, noise)
    # agreement: same noise -> same latents; same latents -> same frames
    ref_uint8 = torch.from_numpy(np.stack([np.asarray(im) for im in ref_frames]))
    frame_diff = (pf_frames[0].cpu().int() - ref_uint8.int()).abs()
    latent_err = relative_l2(replayed, ref_latents)
    result = {
        "dit_params": case.dit_params, "dtype": str(case.dtype).replace("torch.", ""),
        "size": f"{case.width}x{case.height}", "temp": case.temp, "steps": case.steps, "cfg": case.cfg,
        "covariance_jitter": COVARIANCE_JITTER, "pfctl_options": options, "reference": ref, "pfctl": pf,
        "latents_relative_l2": latent_err, "latents_tolerance": TOLERANCE[device.type],
        "latents_relative_l2_other_noise": relative_l2(own_latents, ref_latents),  # what "different" looks like
        "frames_max_abs_diff": int(frame_diff.max()), "frames_mean_abs_diff": float(frame_diff.float().mean()),
        "speedup_sample": ref["sample_s"] / pf["sample_s"],
        "speedup_total": (ref["sample_s"] + ref["decode_s"]) / (pf["sample_s"] + pf["decode_s"]),
        "agrees": latent_err <= TOLERANCE[device.type],
    }  # fmt: skip
    print_generate(result, args.decode_tile)
    return result


def print_generate(result: dict, decode_tile: object) -> None:
    """The generate comparison as a table, then its agreement and each side's loading and runs."""
    ref, pf, size = result["reference"], result["pfctl"], result["size"]
    steps, cfg = result["steps"], result["cfg"]
    print()
    print(f"generate side by side — miniFLUX-architecture DiT ({result['dit_params'] / 1e6:,.0f}M params), "
          f"{result['dtype']}, {size}, temp {result['temp']}, steps {steps[0]}/{steps[1]}, CFG {cfg[0]}/{cfg[1]}; "
          f"pfctl {result['pfctl_options']}")  # fmt: skip
    print(f"{'':>10} {'sample s':>9} {'decode s':>9} {'total s':>8} {'peak GiB (sample/decode)':>25}")
    for name, r in (("reference", ref), ("pfctl", pf)):
        peaks = f"{gib(r['sample_peak_gib'])} / {gib(r['decode_peak_gib'])}"
        print(
            f"{name:>10} {r['sample_s']:>9.2f} {r['decode_s']:>9.2f} {r['sample_s'] + r['decode_s']:>8.2f} {peaks:>25}"
        )
    print(f"{'ratio':>10} {result['speedup_sample']:>8.2f}x {ref['decode_s'] / pf['decode_s']:>8.2f}x "
          f"{result['speedup_total']:>7.2f}x   (reference / pfctl)")  # fmt: skip
    same = "yes" if result["agrees"] else "NO"
    print(f"same noise → latents rel. L2 {result['latents_relative_l2']:.2e} (tolerance "
          f"{result['latents_tolerance']:.0e}): {same}; (other noise: {result['latents_relative_l2_other_noise']:.2f}); "
          f"decoded frames max |diff| {result['frames_max_abs_diff']}, mean {result['frames_mean_abs_diff']:.3f}")  # fmt: skip
    print(f"decode: reference window 1, 256-px tiles (its save_memory); pfctl window 1, tile {pf['decode_tile']} "
          f"(decode_tile={decode_tile})")  # fmt: skip
    for name, r in (("reference", ref), ("pfctl", pf)):
        runs = ", ".join(f"{t:.2f}" for t in r["all_sample_s"])
        setup = f" + fast paths {r['fast_paths_s']:.2f} s" if "fast_paths_s" in r else ""
        print(f"{name}: load (DiT + VAE from the folder to the device) {r['load_s']:.2f} s{setup}; "
              f"sampling, run by run: {runs} s")  # fmt: skip


def image_tokens(sample: torch.Tensor | list) -> int:
    """Image tokens of a DiT input (a latent ``[B, C, T, H, W]`` or nested lists of them): patch 2, so
    ``(H/2)(W/2)`` per frame and item."""
    if isinstance(sample, list):
        return sum(image_tokens(x) for x in sample)
    return sample.shape[0] * sample.shape[2] * (sample.shape[3] // 2) * (sample.shape[4] // 2)


REFERENCE_ADAMW = {"lr": 1e-4, "weight_decay": 1e-4, "eps": 1e-8, "betas": (0.9, 0.999)}
"""The AdamW settings of both sides of the train comparison."""


class ReferenceTraining:
    """The reference's own training step (its temporal-pyramid noising of the latents, DiT, loss, AdamW from
    its ``trainer_misc``), fp32 master weights with bf16 autocast on CUDA, gradient clipping at 1.0, on random
    latents of ``batch`` clips x ``frames`` x ``latent_hw``; rank 0 of a sync group of ``group``. With a
    ``checkpointing_ratio`` its DiT recomputes that share of its blocks (the reference's own
    ``gradient_checkpointing_ratio``). A step is ``micro_batches`` forward and backward passes before the
    optimizer's (its training loop's gradient accumulation: the gradients of the first ones are held while the
    next ones run, and each micro-batch reads its loss on the host)."""

    def __init__(
        self,
        Reference: type,
        folder: Path,
        text: RandomTextEncoder,
        device: torch.device,
        *,
        frames: int,
        latent_hw: tuple[int, int],
        group: int,
        batch: int,
        checkpointing_ratio: float | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.device = device
        self.micro_batches = micro_batches
        positive, negative = text.encode([PROMPT] * batch), text.encode([""])
        self.positive = positive
        gen = torch.Generator().manual_seed(0)
        self.latents = torch.randn(batch, 16, frames, *latent_hw, generator=gen).to(device)
        ckpt = {} if checkpointing_ratio is None else {
            "use_gradient_checkpointing": True, "gradient_checkpointing_ratio": checkpointing_ratio,
        }  # fmt: skip
        self.ref = ref = open_reference(
            Reference, folder, device, load_vae=False, use_mixed_training=True, max_temporal_length=frames,
            frame_per_unit=1, sample_ratios=[1, 2, 1], stages=[1, 2, 4], video_sync_group=group, **ckpt,
        )  # fmt: skip
        ref.dit.to(device).train()
        ref.null_text_embeds = {
            "prompt_embed": negative.prompt_embeds[0],
            "prompt_attention_mask": negative.prompt_attention_mask[0],
            "pooled_prompt_embed": negative.pooled_prompt_embeds[0],
        }
        self.opt = importlib.import_module("trainer_misc").create_optimizer(  # the reference's own AdamW
            types.SimpleNamespace(
                opt="adamw", lr=REFERENCE_ADAMW["lr"], weight_decay=REFERENCE_ADAMW["weight_decay"],
                opt_eps=REFERENCE_ADAMW["eps"], opt_beta1=REFERENCE_ADAMW["betas"][0],
                opt_beta2=REFERENCE_ADAMW["betas"][1],
            ),
            ref.dit,
        )  # fmt: skip

    def record(self, inputs: list[dict], targets: list[list[torch.Tensor]]) -> None:
        """Append every DiT input and loss target the reference builds to ``inputs`` / ``targets``."""
        ref = self.ref
        ref.dit.register_forward_pre_hook(
            lambda _m, _a, kw: inputs.append(
                {k: v.copy() if isinstance(v, list) else v for k, v in kw.items()}
            ),
            with_kwargs=True,
        )
        calculate_loss = ref.calculate_loss

        def recording_loss(preds, targets_list):
            targets.append([t.detach() for t in targets_list])
            return calculate_loss(preds, targets_list)

        ref.calculate_loss = recording_loss

    def step(self) -> float:
        accelerator = types.SimpleNamespace(autocast=lambda: autocast(self.device))  # all its call uses
        losses = []
        for _ in range(self.micro_batches):
            batch_text = {
                "prompt_embeds": self.positive.prompt_embeds.clone(),
                "prompt_attention_mask": self.positive.prompt_attention_mask.clone(),
                "pooled_prompt_embeds": self.positive.pooled_prompt_embeds.clone(),
            }
            with autocast(self.device):
                loss, _ = self.ref(
                    self.latents.clone(), batch_text, identifier=["video"], accelerator=accelerator
                )
            losses.append(float(loss.detach()))
            (loss / self.micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(self.ref.dit.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    def run(self, steps: int) -> list[tuple]:
        """``steps`` timed steps: (loss, seconds, peak GiB) each."""
        return [time_call(self.step, self.device) for _ in range(steps)]

    def close(self) -> None:
        """Free the reference's model and optimizer (and the GPU memory they held)."""
        self.ref.dit = self.opt = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def side_by_side_train(args: argparse.Namespace, Reference: type, device: torch.device) -> dict:
    """Training steps on identical inputs, both starting from the same weights.

    The reference runs its own step (its temporal-pyramid noising of the latents, DiT, loss,
    AdamW); the harness records every DiT input and target it built. pfctl then runs its DiT,
    its loss and its optimizer on exactly those inputs, once per variant. Both: fp32 master weights, bf16
    autocast on CUDA, AdamW, gradient clipping at 1.0, no gradient checkpointing; the reference's rank 0
    of a sync group of ``G`` decides the units each step trains (it alternates between turns).
    """
    import statistics

    from pfctl.models.attention_layout import right_padded_lengths

    cuda = device.type == "cuda"
    if cuda:  # the reference with pfctl's training default (train.attention=efficient): no cuDNN attention
        torch.backends.cuda.enable_cudnn_sdp(False)  # pfctl's variants choose their kernel per call
    frames, group, (latent_h, latent_w) = (
        args.temp or (16 if cuda else 4),
        8 if cuda else 2,
        (48, 80) if cuda else (8, 8),
    )
    compiled = cuda and any("+compile" in v for v in args.train_variants)
    graphs = cuda and any("+graphs" in v for v in args.train_variants)
    steps = args.steps or (12 if graphs else 8 if compiled else 6 if cuda else 3)
    # compiled: the first steps compile; CUDA graphs: each input shape is recorded at its second step
    warmup = min(6 if graphs else 3 if compiled else 2, steps - 1) if cuda else 1
    folder, dit_params, text = prepare_checkpoint(device, torch.float32, None)
    inputs: list[dict] = []
    targets: list[list[torch.Tensor]] = []
    ref = ReferenceTraining(
        Reference, folder, text, device, frames=frames, latent_hw=(latent_h, latent_w), group=group, batch=4
    )
    ref.record(inputs, targets)
    ref_runs = ref.run(steps)
    ref.close()
    ref_s = statistics.median(r[1] for r in ref_runs[warmup:])
    print(f"reference: {steps} steps, median step {ref_s:.3f} s")
    recorded = SimpleNamespace(
        inputs=inputs, targets=targets, losses=[r[0] for r in ref_runs], step_s=ref_s, warmup=warmup,
        # what the trainer reads on the host before the copy (train.skip_future_keys): the text rows' lengths
        text_lengths=[{"text_lengths": right_padded_lengths(r["encoder_attention_mask"])} for r in inputs],
    )  # fmt: skip
    variants = {v: pfctl_train_variant(args, v, folder, recorded, device) for v in args.train_variants}
    result = {
        "dit_params": dit_params,
        "latents": [4, 16, frames, latent_h, latent_w],
        "video_sync_group": group,
        "steps": steps,
        "warmup_steps": warmup,
        "image_tokens_per_step": [image_tokens(r["sample"]) for r in inputs],
        "reference": {
            "step_s": ref_s, "losses": recorded.losses, "peak_gib": max((r[2] or 0.0) for r in ref_runs) if cuda else None
        },
        "pfctl": variants,
        "loss_tolerance": TOLERANCE[device.type],
        "agrees": all(v["agrees"] for v in variants.values()),
    }  # fmt: skip
    print_train(result, "bf16 autocast" if cuda else "fp32")
    return result


def pfctl_train_variant(
    args: argparse.Namespace, variant: str, folder: Path, recorded: SimpleNamespace, device: torch.device
) -> dict:
    """pfctl's DiT, loss and optimizer from the checkpoint in ``folder`` on the reference's ``recorded``
    inputs, as the trainer applies ``variant`` (an attention backend, then ``+compile`` / ``+graphs`` /
    ``+skip``): its step times, losses and host time per phase, compared with the reference's."""
    import statistics

    from pfctl.config.train import TrainConfig
    from pfctl.flow.loss import flow_matching_loss
    from pfctl.models.checkpoint import load_dit_folder
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.training.optim import build_optimizer

    cuda = device.type == "cuda"
    attention, *options = variant.split("+")
    compiled, skip, graphs = "compile" in options and cuda, "skip" in options, "graphs" in options
    dit = load_dit_folder(folder / VARIANT, dtype=torch.float32, device=device).train()
    dit.set_attention_backend(attention, skip_future_keys=skip)
    torch._dynamo.reset()
    apply_fast_paths(
        dit, FastPaths(compile=compiled, independent_sizes=True, cuda_graphs=graphs)
    )  # as the trainer
    opt = build_optimizer(dit, TrainConfig(**REFERENCE_ADAMW))
    host: list[tuple[float, float, float]] = []  # per step: seconds the host spent launching each phase

    def step(i: int) -> float:
        t0 = time.perf_counter()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device):
            preds = dit(**recorded.inputs[i], **(recorded.text_lengths[i] if skip else {}))
            loss = flow_matching_loss(preds, recorded.targets[i]).loss
        t1 = time.perf_counter()
        loss.backward()  # returns once every backward kernel is queued, not when they have run
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        host.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return float(loss.detach())

    runs = [time_call(lambda i=i: step(i), device) for i in range(len(recorded.inputs))]
    timed = slice(recorded.warmup, None)
    host_ms = [statistics.median(1e3 * h[j] for h in host[timed]) for j in range(3)]
    profiled = (
        kernel_breakdown(lambda: step(len(recorded.inputs) - 1), top=8) if cuda and args.profile else None
    )
    diff = [abs(a - b[0]) / max(abs(a), 1e-12) for a, b in zip(recorded.losses, runs, strict=True)]
    step_s = statistics.median(r[1] for r in runs[timed])
    print(f"pfctl {variant}: step {step_s:.3f} s (first {runs[0][1]:.1f} s), loss rel. diff {diff[0]:.1e}")
    dit = opt = None  # the next variant's weights in the memory of these
    if cuda:
        torch.cuda.empty_cache()
    return {
        "step_s": step_s,
        "losses": [r[0] for r in runs],
        "peak_gib": max((r[2] or 0.0) for r in runs) if cuda else None,
        "attention": attention,
        "compile": compiled,
        "skip_future_keys": skip,
        "first_step_s": runs[0][1],
        "loss_relative_diff": diff,
        "speedup_step": recorded.step_s / step_s,
        "agrees": diff[0] <= TOLERANCE[device.type],
        "profile": profiled,
        "host_ms": dict(zip(("forward", "backward", "optimizer"), host_ms, strict=True)),
    }


def print_train(result: dict, precision: str) -> None:
    """The train comparison as a table, then each variant's host time per phase (and kernel profile)."""
    import statistics

    warmup, steps = result["warmup_steps"], result["steps"]
    mean_tokens = statistics.mean(result["image_tokens_per_step"][warmup:])
    print()
    print(
        f"train side by side — miniFLUX-architecture DiT ({result['dit_params'] / 1e6:,.0f}M params), latents "
        f"{result['latents']}, G = {result['video_sync_group']} (rank 0), fp32 master + {precision}, "
        f"AdamW, median of {steps - warmup} steps after {warmup} warm-up"
    )
    print(
        f"{'':>28} {'step s':>8} {'img tok/s':>10} {'peak GiB':>9} {'first loss':>11} {'ratio':>7} {'rel. diff':>9}"
    )
    rows = [("reference", result["reference"])] + [(f"pfctl {k}", v) for k, v in result["pfctl"].items()]
    for name, r in rows:
        extra = (
            f" {r['speedup_step']:>6.2f}x {r['loss_relative_diff'][0]:>9.1e}" if "speedup_step" in r else ""
        )
        print(
            f"{name:>28} {r['step_s']:>8.3f} {mean_tokens / r['step_s']:>10.0f} {gib(r['peak_gib']):>9} "
            f"{r['losses'][0]:>11.5f}{extra}"
        )
    for variant, r in result["pfctl"].items():
        launch = sum(r["host_ms"].values())
        print(
            f"pfctl {variant} host: "
            + ", ".join(f"{k} {ms:.1f}" for k, ms in r["host_ms"].items())
            + f" ms to queue (on the CPU: to run); the step ends {1e3 * r['step_s'] - launch:.1f} ms later"
        )
        if r["profile"]:
            print_breakdown(f"pfctl {variant} profile, per step", r["profile"])
    same = "yes" if result["agrees"] else "NO"
    print(
        f"ratio = reference / pfctl step; first-step loss rel. diff tolerance {result['loss_tolerance']:.0e}: {same}"
    )


def parse_args() -> argparse.Namespace:
    """The command line; ``--train-variants`` checked (exit 2 on an unknown one)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("work", nargs="?", default="generate", choices=["generate", "train", "all"])
    parser.add_argument("--reference", type=Path, default=Path("third_party/Pyramid-Flow"))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--temp", type=int, default=None, help="latent frames (default 16 on CUDA, 3/4 on CPU)"
    )
    parser.add_argument(
        "--resolution", default=None, help="generate: 384p / 768p / WxH (default 384p on CUDA, 64x64 on CPU)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="generate: runs per side, the last one timed")
    parser.add_argument(
        "--reference-repeats",
        type=int,
        default=None,
        help="generate: the reference's runs (default: --repeats)",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="generate: pfctl without CUDA graphs")
    parser.add_argument("--compile", action="store_true", help="pfctl with compiled DiT blocks")
    parser.add_argument(
        "--decode-tile",
        type=lambda v: v if v == "auto" else None if v == "none" else int(v),
        default="auto",
        help="generate: pfctl's decode tile (auto = its default, none, or pixels); the reference uses 256",
    )
    parser.add_argument("--steps", type=int, default=None, help="train: steps per side (default 6 on CUDA)")
    parser.add_argument(
        "--attention",
        default=None,
        choices=["auto", "efficient", "cudnn"],
        help="pfctl's DiT attention (default: generate auto, train efficient: pfctl's defaults)",
    )
    parser.add_argument(
        "--train-variants",
        type=lambda v: v.split(","),
        default=None,
        help="train: pfctl variants timed against one reference run: efficient or cudnn (train.attention), each "
        "optionally +compile (train.compile), +graphs (train.cuda_graphs) and +skip (train.skip_future_keys), e.g. "
        "efficient,efficient+compile,efficient+compile+skip (default: from --attention, --compile, --skip-future-keys)",
    )
    parser.add_argument(
        "--skip-future-keys",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pfctl's DiT attention in row groups (default: as pfctl's generate and train defaults)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="train, CUDA: kernel time by kind of one more step per variant"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.train_variants is None:
        options = ["compile"] * args.compile + ["skip"] * bool(args.skip_future_keys)
        args.train_variants = ["+".join([args.attention or "efficient", *options])]
    unknown = {
        v
        for v in args.train_variants
        if v.split("+")[0] not in ("efficient", "cudnn")
        or not set(v.split("+")[1:]) <= {"compile", "graphs", "skip"}
        or ("graphs" in v.split("+") and "compile" not in v.split("+"))
    }
    if unknown:
        parser.error(
            f"--train-variants: unknown {sorted(unknown)} (efficient or cudnn, then +compile, +graphs "
            "(compiled blocks as CUDA graphs: needs +compile), +skip)"
        )
    return args


def main() -> None:
    args = parse_args()
    Reference, stubbed = import_reference(args.reference.resolve())
    device = torch.device(
        "cuda" if (args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())) else "cpu"
    )
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "stubbed_reference_imports": stubbed,
    }
    if args.work in ("generate", "all"):
        result["generate"] = side_by_side_generate(args, Reference, device)
    if args.work in ("train", "all"):
        result["train"] = side_by_side_train(args, Reference, device)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not all(part["agrees"] for key, part in result.items() if key in ("generate", "train")):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
