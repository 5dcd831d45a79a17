"""An official folder written by ``pfctl export`` runs in the reference's own code, with the same result.

1. A base model in the official layout: a random small miniFLUX-architecture DiT and the tiny causal VAE,
   with the embedded model's text encoders beside them (the DiT's text widths are theirs).
2. A "fine-tuned" pfctl export of it (the base DiT with perturbed weights, an EMA copy beside it), as
   ``pfctl train`` writes one, and ``pfctl export`` of that into a new official folder.
3. The reference's ``PyramidDiTForVideoGeneration`` loads that folder (DiT and VAE, its own code) and
   generates one t2v video's latents; pfctl generates from the same folder with the same text features
   and the noise the reference drew. The latents must agree within fp32 rounding (exit 1 otherwise).

CPU, fp32, a few seconds. The reference is a clone of jy0205/Pyramid-Flow in the git-ignored
``third_party/Pyramid-Flow`` (plus ``einops``), as for ``bench_reference.py``::

    python benchmarks/check_official_export.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from reference_setup import (  # noqa: E402
    CPU_DIT,
    PROMPT,
    TOLERANCE,
    VARIANT,
    import_reference,
    reference_noise_recorder,
    relative_l2,
    write_checkpoint,
)

TEXT_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
SIZE, TEMP, STEPS, CFG = 64, 2, [2, 2, 2], (7.0, 5.0)


def make_base(folder: Path) -> None:
    """A small official-layout model whose DiT takes the embedded text encoders' features."""
    from pfctl.models.embedded import embedded_model_path
    from pfctl.models.vae import TINY_CAUSAL_VAE_CONFIG

    embedded = embedded_model_path()
    dit_config = json.loads(next(embedded.glob("diffusion_transformer_*/config.json")).read_text())
    widths = {k: dit_config[k] for k in ("joint_attention_dim", "pooled_projection_dim")}
    write_checkpoint(folder, VARIANT, {**CPU_DIT, **widths}, TINY_CAUSAL_VAE_CONFIG, 0, torch.float32)
    for name in TEXT_FOLDERS:
        shutil.copytree(embedded / name, folder / name)


def make_pfctl_export(base: Path, out: Path) -> Path:
    """What ``pfctl train`` leaves in OUTPUT/export: the trained DiT, its EMA, the run's config."""
    from pfctl.models.checkpoint import load_dit_folder, save_export

    gen = torch.Generator().manual_seed(1)
    dits = []
    for scale in (0.05, 0.02):  # trained weights, EMA weights
        dit = load_dit_folder(base / VARIANT)
        with torch.no_grad():
            for p in dit.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())
        dits.append(dit)
    return save_export(
        out, dits[0], base_model_path=base, ema_dit=dits[1],
        config_yaml=f"model:\n  path: {base}\n  variant: {VARIANT}\n", extra={"steps": 1},
    )  # fmt: skip


def reference_latents(Reference: type, folder: Path, text) -> tuple[torch.Tensor, dict]:
    positive, negative = text.encode([PROMPT]), text.encode([""])

    def features(prompt, device):
        e = negative if prompt == "" else positive
        return e.prompt_embeds, e.prompt_attention_mask, e.pooled_prompt_embeds

    ref = Reference(str(folder), model_dtype="fp32", model_name="pyramid_flux", model_variant=VARIANT,
                    load_text_encoder=False, load_vae=True)  # fmt: skip
    ref.text_encoder = features
    with torch.no_grad(), reference_noise_recorder(ref) as record:
        latents = ref.generate(
            prompt=PROMPT, negative_prompt="", height=SIZE, width=SIZE, temp=TEMP,
            num_inference_steps=STEPS, video_num_inference_steps=STEPS, guidance_scale=CFG[0],
            video_guidance_scale=CFG[1], generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
        )  # fmt: skip
    return latents, record


def pfctl_latents(folder: Path, text, noise: dict) -> torch.Tensor:
    from pfctl.models.checkpoint import load_components
    from pfctl.sampling.sampler import SamplingSettings, TextConditioning, generate_latents

    dit = load_components(folder, variant=VARIANT, need=("dit",), dtype=torch.float32).dit
    conditioning = TextConditioning.from_pair(text.encode([PROMPT]), text.encode([""]))
    with torch.no_grad():
        settings = SamplingSettings(
            num_inference_steps=tuple(STEPS), video_num_inference_steps=tuple(STEPS), guidance_scale=CFG[0],
            video_guidance_scale=CFG[1],
        )  # fmt: skip
        return generate_latents(
            dit, conditioning, settings, temp=TEMP, height=SIZE // 8, width=SIZE // 8, dtype=torch.float32,
            device="cpu", initial_noise=noise["initial"], block_noises=noise["blocks"],
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, default=Path("third_party/Pyramid-Flow"))
    args = parser.parse_args()
    Reference, _ = import_reference(args.reference.resolve())
    from pfctl.models.checkpoint import load_components
    from pfctl.training.export import export_official

    with tempfile.TemporaryDirectory(prefix="pfctl-official-export-") as tmp:
        work = Path(tmp)
        make_base(work / "base")
        export = make_pfctl_export(work / "base", work / "run" / "export")
        report = export_official(export, work / "official")
        print(f"pfctl export {export} → {report.output_dir} ({report.variant}, {report.weights} weights)")
        text = load_components(report.output_dir, variant=VARIANT, need=("text",), dtype=torch.float32).text_encoder
        ref, noise = reference_latents(Reference, report.output_dir, text)
        ours = pfctl_latents(report.output_dir, text, noise)
    error = relative_l2(ours, ref)
    ok = error <= TOLERANCE["cpu"]
    print(f"reference vs pfctl on the exported folder, same noise: latents {tuple(ref.shape)}, "
          f"rel. L2 {error:.2e} (tolerance {TOLERANCE['cpu']:.0e}): {'agree' if ok else 'DISAGREE'}")  # fmt: skip
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
