"""Rebuild the embedded default model (``pfctl/assets/shapes-tiny``) from scratch.

``python -m pfctl.demo.build_default [--work DIR] [--install]`` runs, in order:

1. ``make_shapes`` — the training clips (576 clips, 64x64, 17 frames at 24 fps, seed 0;
   4 colours x 3 shapes x 4 directions, 12 clips per class);
2. ``train_vae`` — the tiny causal VAE (:mod:`pfctl.demo.train_vae`, fixed seed), then its
   decoder phase (encoder frozen, shape edges weighted), and its round trip scored;
3. ``build_tiny_text_encoder_folder`` — tiny CLIP + T5 with tokenizers built offline whose
   vocabulary holds every caption word as one token (random frozen weights: the DiT learns to
   read them);
4. ``pfctl encode-latents --recipe shapes-tiny`` — latents + text features of every clip;
5. ``torchrun --nproc_per_node 2 -m pfctl train --recipe shapes-tiny`` — the DiT (preset
   ``shapes-tiny``) from scratch, 2 CPU processes in one sync group of 2; then a fine-tune of it
   (:data:`FINE_TUNE`, one process) on a view of the cache that lists the clips of the colours in
   :data:`COLOUR_WEIGHTS` more often (green was drawn blue without it);
6. assemble the official folder layout + ``manifest.json`` (sha256 of every file, the
   generation settings of the recipe's ``generate:`` section, how it was trained);
7. (``--evaluate``) generate the acceptance prompt set and score it.

Measured times are recorded in the manifest's ``training`` section (and printed). The stages
skip work already done in ``--work`` (dataset, VAE, cache) and the DiT run resumes from its last
checkpoint (``--fresh`` discards it), so an interrupted build continues where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pfctl.errors import CheckFailed

RECIPE = "shapes-tiny"
NUM_CLIPS = 576
TEXT_SEED = 0
AUX_FOLDERS = ("causal_video_vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
COLOUR_WEIGHTS = {"green": 3, "blue": 2}
"""How many times the fine-tune's cache view lists each clip of a colour (the others once). Green and blue
stand out least from the background in the latents and their captions' features are the closest of the
colour pairs; the DiT trained on the plain cache drew green shapes blue (benchmarks/RESULTS.md)."""
FINE_TUNE = {
    "runtime.seed": 1,
    "train.video_sync_group": 1,
    "train.max_steps": 2000,
    "train.lr": 2e-4,
    "train.min_lr": 1e-5,
    "train.warmup_steps": 50,
    "train.checkpoint_every": 1000,
    "train.keep_last": 2,
}
"""The fine-tune's settings over the recipe's (one process, from the DiT of the from-scratch run)."""


def _log(message: str) -> None:
    print(message, flush=True)


def caption_corpus() -> tuple[str, ...]:
    """The tokenizers' vocabulary source: the default tiny corpus + every shapes caption."""
    from pfctl.demo.shapes import COLORS, DIRECTIONS, SHAPES, caption_for
    from pfctl.models.text_encoder import DEFAULT_TINY_CORPUS

    captions = [caption_for(c, s, d) for c, s, d in itertools.product(COLORS, SHAPES, DIRECTIONS)]
    return (*DEFAULT_TINY_CORPUS, *captions)


def _run(cmd: list[str], env: Mapping[str, str] | None = None) -> None:
    _log("$ " + " ".join(cmd))
    code = subprocess.call(cmd, env=dict(env) if env is not None else None)
    if code != 0:
        raise CheckFailed(f"{cmd[2:5]} exited with code {code}", hint="see its output above")


def _files_with_hashes(root: Path) -> dict[str, dict[str, Any]]:
    from pfctl.utils.io import sha256_file

    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel != "manifest.json" and not any(p.startswith(".") for p in rel.split("/")):
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return files


def assemble(
    stage: Path,
    dit_folder: Path,
    out: Path,
    *,
    variant: str,
    resolution: tuple[int, int],
    generate: Mapping[str, Any],
    training: Mapping[str, Any],
) -> Path:
    """Write the official layout + manifest into ``out`` (replaced atomically as a folder)."""
    from pfctl.models.embedded import EMBEDDED_NAME, MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION
    from pfctl.utils.io import atomic_write_json, replace_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for name in AUX_FOLDERS:
            shutil.copytree(stage / name, tmp / name)
        (tmp / variant).mkdir()
        for name in ("config.json", "diffusion_pytorch_model.safetensors"):
            shutil.copy2(dit_folder / name, tmp / variant / name)
        bad = [p for p in tmp.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
        if bad:
            raise CheckFailed(f"pickled weight files would ship: {bad}", hint="convert them to safetensors")
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "name": EMBEDDED_NAME,
            "description": "tiny Pyramid Flow (miniFLUX-style DiT + causal VAE + CLIP/T5) trained on synthetic shapes",
            "model_name": "pyramid_flux",
            "variant": variant,
            "resolution": list(resolution),
            "fps": 24,
            "generate": dict(generate),
            "prompt_set": {
                "template": "a {color} {shape} moving {direction}",
                "colors": ["red", "green", "blue", "yellow"],
                "shapes": ["circle", "square", "triangle"],
                "directions": ["left", "right", "up", "down"],
            },
            "training": dict(training),
            "files": _files_with_hashes(tmp),
        }
        atomic_write_json(tmp / MANIFEST_NAME, manifest)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _make_data(folder: Path, num_clips: int) -> Path:
    """Stage 1: render the shapes clips into ``folder`` unless already there; the annotation file."""
    from pfctl.demo.shapes import make_shapes

    annotations = folder / "annotations.jsonl"
    if not annotations.is_file():
        _log(f"[1/6] rendering {num_clips} shapes clips into {folder}")
        make_shapes(folder, num_clips=num_clips, size=(64, 64), num_frames=17, fps=24, seed=0)
    return annotations


def _vae_stage(
    stage: Path, vae_from: str | os.PathLike[str] | None, vae_steps: int | None, vae_device: str
) -> dict[str, Any]:
    """Stage 2: ``stage/causal_video_vae`` copied from ``vae_from``, kept from an earlier run or
    trained; a VAE from before the decoder phase gets that phase (its latents stay the same).
    Returns how it was trained (its ``vae_train_config.json``) and its round-trip scores."""
    from pfctl.demo.train_vae import VAETrainConfig, evaluate_vae, train_vae, train_vae_decoder
    from pfctl.models.vae import load_vae

    vae_cfg = VAETrainConfig(device=vae_device, **({"steps": vae_steps} if vae_steps else {}))
    record = stage / "vae_train_config.json"

    def show(r: dict[str, Any]) -> None:
        _log(f"      vae {r.get('phase', 'step')} {r['step']}: {r['psnr']:.1f} dB")

    if vae_from is not None:
        _log(f"[2/6] using the VAE trained in {vae_from}")
        shutil.rmtree(stage / "causal_video_vae", ignore_errors=True)
        shutil.copytree(Path(vae_from) / "causal_video_vae", stage / "causal_video_vae")
        record.unlink(missing_ok=True)
        if (Path(vae_from) / record.name).is_file():
            shutil.copy2(Path(vae_from) / record.name, record)
    if not (stage / "causal_video_vae" / "config.json").is_file():
        _log(
            f"[2/6] training the VAE ({vae_cfg.steps} + {vae_cfg.decoder_steps} decoder steps on {vae_device})"
        )
        train_vae(stage, vae_cfg, on_log=show)
    done = json.loads(record.read_text()) if record.is_file() else {"source": str(vae_from)}
    if "decoder_steps_done" not in done and vae_cfg.decoder_steps:
        _log(f"[2/6] the VAE's decoder phase ({vae_cfg.decoder_steps} steps on {vae_device})")
        train_vae_decoder(stage, vae_cfg, on_log=show)
        done = json.loads(record.read_text())
    roundtrip = evaluate_vae(load_vae(stage / "causal_video_vae"))
    _log("      VAE round trip: " + "  ".join(f"{k} {v:.3f}" for k, v in roundtrip.items()))
    return {**done, "roundtrip": {k: round(v, 4) for k, v in roundtrip.items()}}


def _encode_stage(recipe_path: Path, stage: Path, annotations: Path, cache: Path) -> None:
    """Stage 4: ``pfctl encode-latents`` of every clip into ``cache``."""
    sets = [f"model.path={stage}", f"encode.annotations={annotations}", f"encode.output_dir={cache}"]
    cli = [sys.executable, "-m", "pfctl"]
    _log("[4/6] encode-latents")
    _run([*cli, "encode-latents", "--recipe", str(recipe_path), *(a for s in sets for a in ("--set", s))])


def _train_dit_stage(
    recipe_path: Path,
    stage: Path,
    cache: Path,
    train_dir: Path,
    dit_steps: int | None,
    nproc: int,
    fresh: bool,
) -> None:
    """Stage 5: ``torchrun ... pfctl train`` into ``train_dir`` (resumed unless ``fresh``)."""
    if fresh:
        shutil.rmtree(train_dir, ignore_errors=True)
    # resume=latest: a run that was interrupted continues bit-exactly from its last checkpoint
    tsets = [
        f"train.cache={cache}",
        f"train.output_dir={train_dir}",
        f"model.path={stage}",
        "train.resume=latest",
    ]
    if dit_steps:
        tsets.append(f"train.max_steps={dit_steps}")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    _log(f"[5/6] training the DiT on {nproc} CPU processes")
    _run(
        [
            *launcher,
            "-m",
            "pfctl",
            "train",
            "--recipe",
            str(recipe_path),
            *(a for s in tsets for a in ("--set", s)),
        ],
        env,
    )


def weighted_cache_view(
    cache: Path, annotations: Path, view: Path, weights: Mapping[str, int] = COLOUR_WEIGHTS
) -> int:
    """``view``: the latent cache ``cache`` with each clip's manifest row repeated ``weights[colour]`` times
    (the colour from the clip's annotation; others once; copy ``n`` gets the id ``<id>-x<n>``) and its files hard-linked (copied where the file
    system cannot link; a symbolic link would point outside the view, which the cache refuses). A sampler
    then draws those clips that much more often. Returns the number of rows."""
    colour = {row["id"]: row["color"] for row in map(json.loads, annotations.read_text().splitlines())}
    shutil.rmtree(view, ignore_errors=True)
    for item in cache.rglob("*"):
        if item.is_file() and item.relative_to(cache) != Path("manifest.jsonl"):
            target = view / item.relative_to(cache)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(item, target)
            except OSError:
                shutil.copy2(item, target)
    rows = []
    for line in (cache / "manifest.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        rows.append(line)
        for n in range(2, weights.get(colour[row["id"]], 1) + 1):  # each copy an entry of its own
            rows.append(json.dumps(row | {"id": f"{row['id']}-x{n}", "item_id": f"{row['item_id']}-x{n}"}))
    (view / "manifest.jsonl").write_text("\n".join(rows) + "\n")
    return len(rows)


def _fine_tune_stage(
    recipe_path: Path, stage: Path, dit: Path, cache: Path, annotations: Path, work: Path, fresh: bool
) -> Path:
    """Stage 5, second part: :data:`FINE_TUNE` from the DiT ``dit`` on :func:`weighted_cache_view`; returns the
    fine-tuned DiT folder (resumed like the first part unless ``fresh``)."""
    from pfctl.models.embedded import DEFAULT_VARIANT

    start, view, out = work / "pretrained", work / "cache_weighted", work / "fine_tune"
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    assemble(stage, dit, start, variant=DEFAULT_VARIANT, resolution=(64, 64), generate={}, training={})
    rows = weighted_cache_view(cache, annotations, view)
    sets = {
        **FINE_TUNE,
        "model.path": start,
        "model.variant": DEFAULT_VARIANT,
        "model.dit_preset": "null",
        "model.dit_config": "{}",
        "train.cache": view,
        "train.output_dir": out,
        "train.resume": "latest",
    }
    _log(f"[5/6] fine-tuning the DiT on {rows} rows ({COLOUR_WEIGHTS} times the clips of those colours)")
    cli = [sys.executable, "-m", "pfctl", "train", "--recipe", str(recipe_path)]
    cli += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    _run(cli, {**os.environ, "OMP_NUM_THREADS": "1"})
    return out / "export" / "transformer"


def _training_record(
    recipe: Mapping[str, Any],
    num_clips: int,
    vae_record: Mapping[str, Any],
    dit_steps: int | None,
    nproc: int,
    seconds: Mapping[str, float],
) -> dict[str, Any]:
    """The manifest's ``training`` section: how every part was made, stage times, machine."""
    train_section = dict(recipe.get("train") or {})
    if dit_steps:
        train_section["max_steps"] = dit_steps
    training = {
        "recipe": f"recipes/{RECIPE}.yaml",
        "command": "python -m pfctl.demo.build_default --install",
        "data": {"generator": "pfctl.demo.shapes.make_shapes", "num_clips": num_clips, "seed": 0},
        "vae": vae_record,
        "text_encoder": {"builder": "build_tiny_text_encoder_folder", "seed": TEXT_SEED},
        "dit": {
            "preset": (recipe.get("model") or {}).get("dit_preset"),
            "config": dict((recipe.get("model") or {}).get("dit_config") or {}),
            "train": train_section,
            "nproc": nproc,
            "fine_tune": {
                "settings": dict(FINE_TUNE),
                "colour_weights": dict(COLOUR_WEIGHTS),
                "nproc": 1,
            },
        },
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    try:
        import torch

        training["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    return training


def build_default(
    work: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    vae_from: str | os.PathLike[str] | None = None,
    vae_steps: int | None = None,
    vae_device: str = "cpu",
    dit_steps: int | None = None,
    nproc: int = 2,
    num_clips: int = NUM_CLIPS,
    evaluate: bool = False,
    fresh: bool = False,
) -> Path:
    """Run the stages of the module docstring; returns the assembled model folder."""
    from pfctl.config.load import read_recipe, resolve_recipe_path
    from pfctl.models.embedded import ASSETS_DIR, DEFAULT_VARIANT, EMBEDDED_NAME
    from pfctl.models.text_encoder import build_tiny_text_encoder_folder

    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    target = Path(out) if out is not None else ASSETS_DIR / EMBEDDED_NAME
    recipe_path = resolve_recipe_path(RECIPE)
    recipe = read_recipe(RECIPE)
    seconds: dict[str, float] = {}
    stage = work / "stage"

    t0 = time.perf_counter()
    annotations = _make_data(work / "shapes", num_clips)
    seconds["data"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    vae_record = _vae_stage(stage, vae_from, vae_steps, vae_device)
    seconds["vae"] = time.perf_counter() - t0
    _log("[3/6] building the tiny text encoders")
    build_tiny_text_encoder_folder(stage, seed=TEXT_SEED, vocab_corpus=caption_corpus(), shard_t5=False)
    t0 = time.perf_counter()
    cache = work / "cache"
    _encode_stage(recipe_path, stage, annotations, cache)
    seconds["encode"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    train_dir = work / "train"
    _train_dit_stage(recipe_path, stage, cache, train_dir, dit_steps, nproc, fresh)
    seconds["dit"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dit = _fine_tune_stage(recipe_path, stage, train_dir / "export" / "transformer", cache, annotations, work, fresh)
    seconds["dit_fine_tune"] = time.perf_counter() - t0

    _log(f"[6/6] assembling {target}")
    training = _training_record(recipe, num_clips, vae_record, dit_steps, nproc, seconds)
    folder = assemble(
        stage,
        dit,
        target,
        variant=DEFAULT_VARIANT,
        resolution=(64, 64),
        generate=dict(recipe.get("generate") or {}),
        training=training,
    )
    total = sum(os.path.getsize(p) for p in folder.rglob("*") if p.is_file())
    _log(f"wrote {folder} ({total / 1e6:.2f} MB); stage times: {training['seconds']}")
    if evaluate:
        _evaluate(work / "eval", folder, custom=out is not None, generate=dict(recipe.get("generate") or {}))
    return folder


def _evaluate(eval_dir: Path, folder: Path, *, custom: bool, generate: dict[str, Any]) -> None:
    """Stage 7: score the prompt set on the new model (the embedded one, unless written elsewhere)."""
    from pfctl.demo.run import evaluate_model
    from pfctl.models.embedded import DEFAULT_VARIANT

    shutil.rmtree(eval_dir, ignore_errors=True)
    score, _ = evaluate_model(
        eval_dir,
        model_path=folder if custom else None,
        variant=DEFAULT_VARIANT,
        generate=generate if custom else None,
    )
    _log(
        f"colour accuracy {score.color_accuracy:.1%}, direction accuracy {score.direction_accuracy:.1%}, "
        f"shape accuracy {score.shape_accuracy:.1%}"
    )
    # which colour / shape was drawn instead: where the model (or the VAE) loses the caption
    for key in ("color", "shape"):
        wrong = Counter((r[f"expected_{key}"], r[key]) for r in score.rows if not r[f"{key}_ok"])
        _log(f"{key} drawn instead (asked, drawn): {dict(wrong.most_common())}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pfctl.demo.build_default", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--work", default="build/shapes-tiny", help="working folder (data, VAE, cache, training)"
    )
    parser.add_argument(
        "--out", default=None, help="write the model here instead of pfctl/assets/shapes-tiny"
    )
    parser.add_argument("--install", action="store_true", help="write into pfctl/assets/shapes-tiny")
    parser.add_argument(
        "--vae-from", default=None, help="reuse a VAE trained by python -m pfctl.demo.train_vae"
    )
    parser.add_argument("--vae-steps", type=int, default=None)
    parser.add_argument("--vae-device", default="cpu")
    parser.add_argument("--dit-steps", type=int, default=None, help="override train.max_steps of the recipe")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--clips", type=int, default=NUM_CLIPS, help="shapes clips to train on")
    parser.add_argument("--evaluate", action="store_true", help="score the prompt set afterwards")
    parser.add_argument("--fresh", action="store_true", help="discard an earlier DiT run in --work/train")
    args = parser.parse_args(argv)
    if args.out is None and not args.install:
        parser.error("give --install (replace pfctl/assets/shapes-tiny) or --out DIR")
    build_default(
        args.work,
        out=args.out,
        vae_from=args.vae_from,
        vae_steps=args.vae_steps,
        vae_device=args.vae_device,
        dit_steps=args.dit_steps,
        nproc=args.nproc,
        num_clips=args.clips,
        evaluate=args.evaluate,
        fresh=args.fresh,
    )


if __name__ == "__main__":
    main()
