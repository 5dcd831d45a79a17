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
from pathlib import Path

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
def side_by_side_generate(args: argparse.Namespace, Reference: type, device: torch.device) -> dict:
    """Sampling + decode of one video by both implementations; returns the result record."""
    from pfctl.config.fast import FastPathsConfig
    from pfctl.config.generate import RESOLUTIONS, GenerateConfig
    from pfctl.models.checkpoint import load_dit_folder
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.models.vae import TINY_CAUSAL_VAE_CONFIG, load_vae, with_fast_paths
    from pfctl.sampling.decode import decode_latents, free_memory, resolve_decode_tile
    from pfctl.sampling.generate import attention_kernel
    from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents

    cuda = device.type == "cuda"
    temp = args.temp or (16 if cuda else 3)
    resolution = args.resolution or ("384p" if cuda else "64x64")
    width, height = RESOLUTIONS[resolution] if resolution in RESOLUTIONS else map(int, resolution.split("x"))
    steps = ([20, 20, 20], [10, 10, 10]) if cuda else ([1, 1, 1], [1, 1, 1])
    cfg = (7.0, 5.0)
    dtype = torch.bfloat16 if cuda else torch.float32
    folder, dit_params, text = prepare_checkpoint(device, dtype, REAL_VAE if cuda else TINY_CAUSAL_VAE_CONFIG)
    positive, negative = text.encode([PROMPT]), text.encode([""])  # the same features on both sides

    def reference_text(prompt, device_):
        e = negative if prompt == "" else positive
        return e.prompt_embeds, e.prompt_attention_mask, e.pooled_prompt_embeds

    # --- the reference (loading timed as its demo loads: the folder, then the DiT and VAE to the device)
    start = time.perf_counter()
    ref = open_reference(
        Reference,
        folder,
        device,
        load_vae=True,
    )
    ref.dit.to(device).eval()
    ref.vae.to(device).eval()
    synchronize(device)
    ref_load_s = time.perf_counter() - start
    ref.text_encoder = reference_text

    def run_reference():
        with torch.no_grad(), autocast(device), reference_noise_recorder(ref) as record:
            latents = ref.generate(
                prompt=PROMPT,
                negative_prompt="",
                height=height,
                width=width,
                temp=temp,
                num_inference_steps=steps[0],
                video_num_inference_steps=steps[1],
                guidance_scale=cfg[0],
                video_guidance_scale=cfg[1],
                generator=torch.Generator(device).manual_seed(0),
                output_type="latent",
            )
        return latents, record

    def decode_reference(latents):
        with torch.no_grad(), autocast(device):
            return ref.decode_latent(latents.clone(), save_memory=True)

    ref_runs = [time_call(run_reference, device) for _ in range(args.reference_repeats or args.repeats)]
    (ref_latents, record), ref_sample_s, ref_sample_peak = ref_runs[-1]
    ref_frames, ref_decode_s, ref_decode_peak = [
        time_call(lambda: decode_reference(ref_latents), device) for _ in range(args.repeats)
    ][-1]
    print(f"reference: sampling {ref_sample_s:.2f} s, decode {ref_decode_s:.2f} s")
    ref.dit = ref.vae = None  # free the reference's weights before pfctl loads its own
    if cuda:
        torch.cuda.empty_cache()

    # --- pfctl, loading the same folder with its own code
    start = time.perf_counter()
    dit = load_dit_folder(folder / VARIANT, dtype=dtype, device=device).eval()
    vae = load_vae(str(folder / "causal_video_vae"), dtype=dtype, device=device)
    synchronize(device)
    pf_load_s = time.perf_counter() - start
    start = time.perf_counter()  # the speed layer: attention settings, kernel checks, compiled blocks
    defaults = GenerateConfig()  # attention as pfctl generate sets it unless told otherwise
    skip = defaults.skip_future_keys if args.skip_future_keys is None else args.skip_future_keys
    # settled as pfctl generate settles it for a run of this many videos
    attention = attention_kernel(
        args.attention or defaults.attention, device, videos=args.repeats, keep_graphs=not args.no_cuda_graphs
    )
    dit.set_attention_backend(attention, skip, defaults.row_group_min_tokens)
    # as pfctl generate applies its fast paths and compiles (automatic dynamic shapes); the first timed run
    # pays the compilation
    apply_fast_paths(dit, FastPaths(compile=args.compile and cuda, dynamic=None))
    vae = with_fast_paths(vae, FastPathsConfig())
    synchronize(device)
    pf_setup_s = time.perf_counter() - start
    conditioning = TextConditioning.from_pair(positive, negative)
    settings = SamplingSettings(
        num_inference_steps=tuple(steps[0]),
        video_num_inference_steps=tuple(steps[1]),
        guidance_scale=cfg[0],
        video_guidance_scale=cfg[1],
        cuda_graphs=not args.no_cuda_graphs,
    )
    common = dict(
        settings=settings, temp=temp, height=height // 8, width=width // 8, dtype=dtype, device=device
    )
    capture_s: list[float] = []  # the host time of each graph capture, for the first video's cost
    if cuda and not args.no_cuda_graphs:
        from pfctl.models.fast.cuda_graph import StageGraph

        # as pfctl generate runs several videos of one size: the graphs captured by the first run replay
        # in the later ones (the timed run is the last)
        common["graphs"] = StageGraph(dit, keep=True)
        capture = StageGraph._capture

        def timed_capture(self, *a, **kw):
            start = time.perf_counter()
            try:
                return capture(self, *a, **kw)
            finally:
                capture_s.append(time.perf_counter() - start)

        StageGraph._capture = timed_capture

    def run_pfctl(**noise):
        with torch.no_grad():
            return generate_latents(dit, conditioning, **common, **noise)

    pf_runs, captures = [], []
    for _ in range(args.repeats):
        pf_runs.append(time_call(lambda: run_pfctl(generator=torch.Generator(device).manual_seed(0)), device))
        captures.append((len(capture_s), sum(capture_s)))
        capture_s.clear()
    _, pf_sample_s, pf_sample_peak = pf_runs[-1]
    print(f"pfctl: sampling {', '.join(f'{r[1]:.2f}' for r in pf_runs)} s; graph captures (count, host s) "
          + ", ".join(f"{n} / {t:.2f}" for n, t in captures))  # fmt: skip
    replayed = run_pfctl(initial_noise=record["initial"], block_noises=record["blocks"])
    pf_tile = resolve_decode_tile(
        args.decode_tile, height=height, width=width, window=1, dtype=dtype, available=free_memory(device)
    )
    with torch.no_grad():
        (_, pf_frames), pf_decode_s, pf_decode_peak = [
            time_call(
                lambda: decode_latents(vae, ref_latents, chunking="framewise", window=1, tile=pf_tile), device
            )
            for _ in range(args.repeats)
        ][-1]

    # --- agreement: same noise → same latents; same latents → same frames
    import numpy as np

    latent_err = relative_l2(replayed, ref_latents)
    control_err = relative_l2(pf_runs[-1][0], ref_latents)  # other noise: what "different" looks like
    ref_uint8 = torch.from_numpy(np.stack([np.asarray(im) for im in ref_frames]))
    pf_uint8 = pf_frames[0].cpu()
    frame_diff = (pf_uint8.int() - ref_uint8.int()).abs()
    tolerance = TOLERANCE[device.type]
    result = {
        "dit_params": dit_params,
        "dtype": str(dtype).replace("torch.", ""),
        "size": f"{width}x{height}",
        "temp": temp,
        "steps": steps,
        "cfg": cfg,
        "covariance_jitter": COVARIANCE_JITTER,
        "pfctl_options": {
            "cuda_graphs": cuda and not args.no_cuda_graphs,
            "compile": cuda and args.compile,
            "attention": attention,
            "skip_future_keys": skip,
        },
        "reference": {
            "load_s": ref_load_s,
            "sample_s": ref_sample_s,
            "decode_s": ref_decode_s,
            "sample_peak_gib": ref_sample_peak,
            "decode_peak_gib": ref_decode_peak,
            "all_sample_s": [r[1] for r in ref_runs],
        },
        "pfctl": {
            "load_s": pf_load_s,
            "fast_paths_s": pf_setup_s,
            "sample_s": pf_sample_s,
            "decode_s": pf_decode_s,
            "sample_peak_gib": pf_sample_peak,
            "decode_peak_gib": pf_decode_peak,
            "decode_tile": pf_tile,
            "all_sample_s": [r[1] for r in pf_runs],
            "captures_per_run": [n for n, _ in captures],
            "capture_host_s_per_run": [t for _, t in captures],
        },
        "latents_relative_l2": latent_err,
        "latents_tolerance": tolerance,
        "latents_relative_l2_other_noise": control_err,
        "frames_max_abs_diff": int(frame_diff.max()),
        "frames_mean_abs_diff": float(frame_diff.float().mean()),
    }
    result["speedup_sample"] = ref_sample_s / pf_sample_s
    result["speedup_total"] = (ref_sample_s + ref_decode_s) / (pf_sample_s + pf_decode_s)
    result["agrees"] = latent_err <= tolerance

    print()
    print(f"generate side by side — miniFLUX-architecture DiT ({dit_params / 1e6:,.0f}M params), "
          f"{result['dtype']}, {width}x{height}, temp {temp}, steps {steps[0]}/{steps[1]}, CFG {cfg[0]}/{cfg[1]}; "
          f"pfctl {result['pfctl_options']}")  # fmt: skip
    print(f"{'':>10} {'sample s':>9} {'decode s':>9} {'total s':>8} {'peak GiB (sample/decode)':>25}")
    for name, r in (("reference", result["reference"]), ("pfctl", result["pfctl"])):
        peaks = f"{gib(r['sample_peak_gib'])} / {gib(r['decode_peak_gib'])}"
        print(
            f"{name:>10} {r['sample_s']:>9.2f} {r['decode_s']:>9.2f} {r['sample_s'] + r['decode_s']:>8.2f} {peaks:>25}"
        )
    print(f"{'ratio':>10} {result['speedup_sample']:>8.2f}x {ref_decode_s / pf_decode_s:>8.2f}x "
          f"{result['speedup_total']:>7.2f}x   (reference / pfctl)")  # fmt: skip
    same = "yes" if latent_err <= tolerance else "NO"
    print(f"same noise → latents rel. L2 {latent_err:.2e} (tolerance {tolerance:.0e}): {same}; "
          f"(other noise: {control_err:.2f}); decoded frames max |diff| {result['frames_max_abs_diff']}, "
          f"mean {result['frames_mean_abs_diff']:.3f}")  # fmt: skip
    print(f"decode: reference window 1, 256-px tiles (its save_memory); pfctl window 1, tile {pf_tile} "
          f"(decode_tile={args.decode_tile})")  # fmt: skip
    for name, r in (("reference", result["reference"]), ("pfctl", result["pfctl"])):
        runs = ", ".join(f"{t:.2f}" for t in r["all_sample_s"])
        setup = f" + fast paths {r['fast_paths_s']:.2f} s" if "fast_paths_s" in r else ""
        print(f"{name}: load (DiT + VAE from the folder to the device) {r['load_s']:.2f} s{setup}; "
              f"sampling, run by run: {runs} s")  # fmt: skip
    return result


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
    its loss and its optimizer on exactly those inputs. Both: fp32 master weights, bf16 autocast
    on CUDA, AdamW, gradient clipping at 1.0, no gradient checkpointing; the reference's rank 0
    of a sync group of ``G`` decides the units each step trains (it alternates between turns).
    """
    import statistics

    from pfctl.config.train import TrainConfig
    from pfctl.flow.loss import flow_matching_loss
    from pfctl.models.attention_layout import right_padded_lengths
    from pfctl.models.checkpoint import load_dit_folder
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.training.optim import build_optimizer

    cuda = device.type == "cuda"
    if cuda:  # the reference with pfctl's training default (train.attention=efficient): no cuDNN attention
        torch.backends.cuda.enable_cudnn_sdp(False)  # pfctl's variants choose their kernel per call
    frames = args.temp or (16 if cuda else 4)
    group = 8 if cuda else 2
    latent_h, latent_w = (48, 80) if cuda else (8, 8)
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
    print(f"reference: {steps} steps, median step {statistics.median(r[1] for r in ref_runs[warmup:]):.3f} s")
    ref_peak = max((r[2] or 0.0) for r in ref_runs) if cuda else None
    ref.close()
    optimizer_args = REFERENCE_ADAMW

    # --- pfctl on the recorded inputs, once per variant (attention backend, compiled blocks or not)
    tokens = [image_tokens(r["sample"]) for r in inputs]
    tolerance = TOLERANCE[device.type]
    timed = slice(warmup, None)
    ref_s = statistics.median(r[1] for r in ref_runs[timed])
    mean_tokens = statistics.mean(tokens[timed])
    # what the trainer reads on the host before the copy (train.skip_future_keys): the text rows' lengths
    text_lengths = [{"text_lengths": right_padded_lengths(r["encoder_attention_mask"])} for r in inputs]
    variants = {}
    for variant in args.train_variants:
        attention, *options = variant.split("+")
        compiled = "compile" in options and cuda
        dit = load_dit_folder(folder / VARIANT, dtype=torch.float32, device=device).train()
        dit.set_attention_backend(attention, skip_future_keys="skip" in options)
        torch._dynamo.reset()
        apply_fast_paths(  # as the trainer does
            dit, FastPaths(compile=compiled, independent_sizes=True, cuda_graphs="graphs" in options)
        )
        opt = build_optimizer(dit, TrainConfig(**optimizer_args))

        host: list[tuple[float, float, float]] = []  # per step: seconds the host spent launching each phase

        def pfctl_step(
            i: int, dit=dit, opt=opt, skip="skip" in options, graphs="graphs" in options, host=host
        ) -> float:
            t0 = time.perf_counter()
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with autocast(device):
                preds = dit(**inputs[i], **(text_lengths[i] if skip else {}))
                loss = flow_matching_loss(preds, targets[i]).loss
            t1 = time.perf_counter()
            loss.backward()  # returns once every backward kernel is queued, not when they have run
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            host.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            return float(loss.detach())

        runs = [time_call(lambda i=i: pfctl_step(i), device) for i in range(len(inputs))]
        host_ms = [statistics.median(1e3 * h[j] for h in host[timed]) for j in range(3)]
        profiled = (
            kernel_breakdown(lambda: pfctl_step(len(inputs) - 1), top=8) if cuda and args.profile else None
        )
        diff = [abs(a[0] - b[0]) / max(abs(a[0]), 1e-12) for a, b in zip(ref_runs, runs, strict=True)]
        step_s = statistics.median(r[1] for r in runs[timed])
        variants[variant] = {
            "step_s": step_s,
            "losses": [r[0] for r in runs],
            "peak_gib": max((r[2] or 0.0) for r in runs) if cuda else None,
            "attention": attention,
            "compile": compiled,
            "skip_future_keys": "skip" in options,
            "first_step_s": runs[0][1],
            "loss_relative_diff": diff,
            "speedup_step": ref_s / step_s,
            "agrees": diff[0] <= tolerance,
            "profile": profiled,
            "host_ms": dict(zip(("forward", "backward", "optimizer"), host_ms, strict=True)),
        }
        print(
            f"pfctl {variant}: step {step_s:.3f} s (first {runs[0][1]:.1f} s), loss rel. diff {diff[0]:.1e}"
        )
        dit = opt = None
        if cuda:
            torch.cuda.empty_cache()
    result = {
        "dit_params": dit_params,
        "latents": [4, 16, frames, latent_h, latent_w],
        "video_sync_group": group,
        "steps": steps,
        "warmup_steps": warmup,
        "image_tokens_per_step": tokens,
        "reference": {"step_s": ref_s, "losses": [r[0] for r in ref_runs], "peak_gib": ref_peak},
        "pfctl": variants,
        "loss_tolerance": tolerance,
        "agrees": all(v["agrees"] for v in variants.values()),
    }
    print()
    print(
        f"train side by side — miniFLUX-architecture DiT ({dit_params / 1e6:,.0f}M params), latents "
        f"{result['latents']}, G = {group} (rank 0), fp32 master + {'bf16 autocast' if cuda else 'fp32'}, "
        f"AdamW, median of {steps - warmup} steps after {warmup} warm-up"
    )
    print(
        f"{'':>28} {'step s':>8} {'img tok/s':>10} {'peak GiB':>9} {'first loss':>11} {'ratio':>7} {'rel. diff':>9}"
    )
    rows = [("reference", result["reference"])] + [(f"pfctl {k}", v) for k, v in variants.items()]
    for name, r in rows:
        extra = (
            f" {r['speedup_step']:>6.2f}x {r['loss_relative_diff'][0]:>9.1e}" if "speedup_step" in r else ""
        )
        print(
            f"{name:>28} {r['step_s']:>8.3f} {mean_tokens / r['step_s']:>10.0f} {gib(r['peak_gib']):>9} "
            f"{r['losses'][0]:>11.5f}{extra}"
        )
    for variant, r in variants.items():
        launch = sum(r["host_ms"].values())
        print(
            f"pfctl {variant} host: "
            + ", ".join(f"{k} {ms:.1f}" for k, ms in r["host_ms"].items())
            + f" ms to queue (on the CPU: to run); the step ends {1e3 * r['step_s'] - launch:.1f} ms later"
        )
        if r["profile"]:
            print_breakdown(f"pfctl {variant} profile, per step", r["profile"])
    same = "yes" if result["agrees"] else "NO"
    print(f"ratio = reference / pfctl step; first-step loss rel. diff tolerance {tolerance:.0e}: {same}")
    return result


def main() -> None:
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
        "--reference-repeats", type=int, default=None, help="generate: the reference's runs (default: --repeats)"
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
