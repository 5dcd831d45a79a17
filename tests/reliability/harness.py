"""Fault-injection scenarios shared by ``tests/reliability`` (few iterations) and
``scripts/reliability.py`` (many): real subprocesses, SIGKILL at seeded random moments, faults armed
through ``PFCTL_FAULT`` (:mod:`pfctl.runtime.faults`). Here: the processes, caches and recipes every
scenario uses, and kill and resume; the other faults are in :mod:`reliability.scenarios`.

Every scenario returns an :class:`Outcome`: how many faults were injected, after how many every
invariant held, and how much finished work was lost (the goal: zero).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TRACEBACK = "Traceback (most recent call last)"
BUCKETS = [[32, 24], [24, 32]]
TRAIN_LENGTHS = [4] * 8 + [3] * 8 + [1] * 8


@dataclass
class Outcome:
    """One scenario's numbers (what RELIABILITY.md tabulates)."""

    scenario: str
    injected: int = 0
    survived: int = 0
    data_lost: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Known failures whose fix is outside this suite's files (listed in RELIABILITY.md, not hidden)."""

    @property
    def ok(self) -> bool:
        return not self.failures and self.survived == self.injected and self.data_lost == 0

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# ------------------------------------------------------------------------------------ processes


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PFCTL_TEST_THREADS": "1"}
    for key in (
        "PFCTL_DEBUG",
        "PFCTL_FAULT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ):
        env.pop(key, None)
    env.update(extra)
    return env


def pfctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "pfctl", *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "pfctl", *args,
    ]  # fmt: skip


def run(cmd: list[str], timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    """A process in its own session (so SIGKILL reaches its DataLoader workers too)."""
    fh = log.open("ab")
    return subprocess.Popen(
        cmd, env=child_env(**env), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
    )


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    # nothing of the group may survive (a leftover worker could still write)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def wait_until(proc: subprocess.Popen, condition, timeout: float, poll: float = 0.01) -> bool:
    """Poll ``condition()`` until true (True) or the process ends / time runs out (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if condition():
            return True
        time.sleep(poll)
    return False


# ------------------------------------------------------------------------------------ encode


def make_encode_corpus(root: Path, copies: int = 4) -> tuple[Path, list[str]]:
    """Three small H.264 videos annotated ``copies`` times each (distinct ids): 3·copies clips."""
    from pfctl.data.synthetic import index_frames, moving_frames, write_video

    videos = root / "videos"
    if not (videos / "p.mp4").is_file():
        write_video(videos / "a.mp4", moving_frames(16, 48, 64), fps=24)
        write_video(videos / "b.mp4", index_frames(14, 48, 64), fps=24)
        write_video(videos / "p.mp4", moving_frames(12, 64, 48, seed=1), fps=24)
    rows = [
        {"video": f"videos/{name}.mp4", "text": f"clip {k} of {name}", "id": f"{name}-{k}"}
        for k in range(copies)
        for name in ("a", "b", "p")
    ]
    ann = root / "train.jsonl"
    ann.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ann, sorted(r["id"] for r in rows)


def encode_args(ann: Path, out: Path, *extra: str) -> list[str]:
    return [
        "encode-latents", "-a", str(ann), "-o", str(out), "--vae", "causal-vae-tiny",
        "--set", "encode.text=false", "--set", f"encode.buckets={json.dumps(BUCKETS)}",
        "--set", "encode.num_frames=9", "--set", "encode.num_workers=0", "--set", "runtime.device=cpu",
        "--set", "encode.dtype=fp32", *extra,
    ]  # fmt: skip


def clip_files(out: Path) -> dict[str, tuple[int, int]]:
    """Finished clip files → (inode, mtime): a re-encoded clip gets a new inode (atomic rename)."""
    return {
        str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in out.glob("clips/*/*.safetensors")
    }


def check_clip_file(path: Path, fingerprint: str | None) -> str | None:
    """None if ``path`` is a whole, attributable, finite clip file; else what is wrong."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    except Exception as exc:
        return f"{path.name}: unreadable ({exc})"
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        return f"{path.name}: fingerprint {meta.get('fingerprint')} != {fingerprint}"
    if not meta.get("id"):
        return f"{path.name}: no clip id in metadata"
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
            return f"{path.name}: {key} is not finite"
    return None


def check_cache_state(out: Path) -> list[str]:
    """Invariants of a cache folder at any moment (even right after a SIGKILL)."""
    from pfctl.data import latent_cache as lc

    problems = []
    if not out.exists():
        return problems
    try:
        header = lc.read_header(out)
    except Exception as exc:
        return [f"header unreadable: {exc}"]
    fingerprint = header["fingerprint"] if header else None
    if header is None and any(out.glob("clips/*/*.safetensors")):
        problems.append("clip files without a cache.json")
    for path in out.glob("clips/*/*.safetensors"):
        bad = check_clip_file(path, fingerprint)
        if bad:
            problems.append(bad)
    if (out / lc.MANIFEST_FILE).is_file():
        try:
            cache = lc.LatentCache.open(out)
            for clip_id in cache.ids():
                cache.load(clip_id)
        except Exception as exc:
            problems.append(f"manifest present but the cache does not open/load: {exc}")
    return problems


def check_cache_complete(out: Path, expected_ids: list[str]) -> list[str]:
    from pfctl.data import latent_cache as lc

    problems = check_cache_state(out)
    try:
        cache = lc.LatentCache.open(out)
    except Exception as exc:
        return [*problems, f"final cache does not open: {exc}"]
    if cache.ids() != sorted(expected_ids):
        missing = sorted(set(expected_ids) - set(cache.ids()))
        problems.append(f"manifest ids differ from the annotations (missing {missing[:5]})")
    if len(clip_files(out)) != len(expected_ids):
        problems.append(f"{len(clip_files(out))} clip files for {len(expected_ids)} clips")
    leftovers = [p.name for p in out.rglob(".*.tmp")] + (
        [lc.PARTS_DIR] if (out / lc.PARTS_DIR).exists() else []
    )
    if leftovers:
        problems.append(f"leftover temp files after a clean run: {leftovers[:5]}")
    return problems


def encode_kill_scenario(work: Path, kills: int, seed: int) -> Outcome:
    """SIGKILL ``encode-latents`` at random moments ``kills`` times; every rerun resumes.

    After every kill: every clip file on disk is whole (or a never-trusted ``.*.tmp``), no clip
    written before was rewritten, a manifest (if any) opens and loads. At the end of each chain
    a clean run completes the cache with each clip encoded exactly once.
    """
    outcome = Outcome("encode: SIGKILL + resume")
    rng = random.Random(seed)
    t0 = time.monotonic()
    ann, ids = make_encode_corpus(work / "corpus", copies=5)
    chain = 0
    out = work / f"cache-{chain}"
    seen: dict[str, tuple[int, int]] = {}
    log = work / "encode-kill.log"
    attempts = 0
    while outcome.injected < kills and attempts < 2 * kills:  # a run that finishes first is no kill
        attempts += 1
        sleep = rng.choice(["0", "0.05", "0.2"])
        target = rng.choice([0, 1, 1, 2, 3])
        proc = start(pfctl(*encode_args(ann, out)), log, PFCTL_FAULT=f"encode_written:action=sleep:seconds={sleep}")
        if target == 0:  # anywhere in start-up, model loading, header and folder preparation
            wait_until(proc, lambda: False, timeout=rng.uniform(0.5, 8.0))
        else:
            have = len(clip_files(out))
            wait_until(
                proc, lambda have=have, target=target, out=out: len(clip_files(out)) >= have + target, 120
            )
            wait_until(proc, lambda: False, timeout=rng.uniform(0.0, 0.25))
        finished = proc.poll() is not None
        kill_group(proc)
        if finished:  # the run completed before the kill: check it and start a new chain
            problems = check_cache_complete(out, ids) if proc.returncode == 0 else [f"rc {proc.returncode}"]
            outcome.notes.append(f"chain {chain} completed before a kill")
            if problems:
                outcome.fail(f"chain {chain}: {problems[:3]}")
            chain += 1
            out, seen = work / f"cache-{chain}", {}
            continue
        outcome.injected += 1
        now = clip_files(out)
        rewritten = [k for k, v in seen.items() if now.get(k) != v]
        problems = check_cache_state(out)
        if rewritten:
            outcome.data_lost += len(rewritten)
            problems.append(f"{len(rewritten)} finished clip(s) rewritten or removed")
        if problems:
            outcome.fail(f"after kill {outcome.injected}: {problems[:3]}")
        else:
            outcome.survived += 1
        seen.update(now)
    done = run(pfctl(*encode_args(ann, out)))
    problems = [] if done.returncode == 0 else [f"final run exit {done.returncode}: {done.stderr[-500:]}"]
    problems += check_cache_complete(out, ids)
    now = clip_files(out)
    rewritten = [k for k, v in seen.items() if now.get(k) != v]
    if rewritten:
        outcome.data_lost += len(rewritten)
        problems.append(f"final run re-encoded {len(rewritten)} finished clip(s)")
    if problems:
        outcome.fail(f"final run of chain {chain}: {problems[:3]}")
    outcome.notes.append(
        f"{chain + 1} chain(s) of {len(ids)} clips; {len(seen)} clips were kept across kills"
    )
    outcome.seconds = time.monotonic() - t0
    return outcome


# ------------------------------------------------------------------------------------ train


def make_train_cache(root: Path, lengths: list[int] | None = None, seed: int = 0) -> Path:
    from pfctl.data.dataset import write_synthetic_cache

    if not (root / "manifest.jsonl").is_file():
        write_synthetic_cache(str(root), lengths or TRAIN_LENGTHS, seed=seed)
    return root


def train_recipe(path: Path, cache: Path, out: Path, *, runtime: dict | None = None, **train: Any) -> Path:
    import yaml

    recipe = {
        "runtime": {"device": "cpu", "seed": 3, **(runtime or {})},
        "model": {"dit_preset": "tiny"},
        "train": {
            "cache": str(cache), "output_dir": str(out), "batch_size": 4, "max_units": 4, "lr": 2e-3,
            "warmup_steps": 1, "log_every": 1, "checkpoint_every": 1, "keep_last": 2, "max_steps": 6,
            "grad_accum": 2, "ema_decay": 0.9, "ema_every": 1, "resume": "latest", **train,
        },
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def checkpoint_steps(out: Path) -> list[int]:
    from pfctl.training.checkpoint import list_checkpoints

    return [step for step, _ in list_checkpoints(out / "checkpoints")]


def _tensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def same_tensors(a: Path, b: Path) -> bool:
    import torch

    x, y = _tensors(a), _tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def compare_checkpoint(run_ckpt: Path, ref_ckpt: Path) -> list[str]:
    """Bit-identical model, EMA and optimizer tensors, and the same rank state."""
    from pfctl.training.checkpoint import MODEL_WEIGHTS, load_checkpoint

    problems = []
    try:
        load_checkpoint(run_ckpt, rank=0)
    except Exception as exc:
        return [f"{run_ckpt.name} is listed complete but does not load: {exc}"]
    for rel in (f"model/{MODEL_WEIGHTS}", f"ema/{MODEL_WEIGHTS}", "optimizer.safetensors"):
        if (ref_ckpt / rel).is_file() and not same_tensors(run_ckpt / rel, ref_ckpt / rel):
            problems.append(f"{run_ckpt.name}/{rel} differs from the uninterrupted run")
    a = json.loads((run_ckpt / "ranks" / "rank-00000.json").read_text())
    b = json.loads((ref_ckpt / "ranks" / "rank-00000.json").read_text())
    if a != b:
        problems.append(f"{run_ckpt.name}: data position / RNG state differs")
    return problems


def metric_losses(out: Path) -> list[tuple[int, float]]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def train_reference(work: Path, cache: Path, max_steps: int, **train: Any) -> Path:
    ref = work / "reference"
    if not (ref / "checkpoints" / f"step-{max_steps:06d}").is_dir():
        shutil.rmtree(ref, ignore_errors=True)
        recipe = train_recipe(work / "ref.yaml", cache, ref, max_steps=max_steps, keep_last=None, **train)
        done = run(pfctl("train", "--recipe", str(recipe)))
        if done.returncode != 0:
            raise RuntimeError(f"reference training failed: {done.stderr[-2000:]}")
    return ref


def train_kill_scenario(work: Path, kills: int, seed: int, max_steps: int = 6) -> Outcome:
    """SIGKILL ``pfctl train --resume latest`` at random moments (start-up, steps, checkpoint saves,
    export); after each kill every complete checkpoint loads and equals the uninterrupted run's
    checkpoint of that step bit for bit; the finished run ends with identical weights, EMA and
    optimizer state, and one metrics row per step with the reference's losses."""
    outcome = Outcome("train: SIGKILL + resume (bit-identical)")
    rng = random.Random(seed)
    t0 = time.monotonic()
    cache = make_train_cache(work / "cache")
    ref = train_reference(work, cache, max_steps)
    ref_ckpt = lambda step: ref / "checkpoints" / f"step-{step:06d}"  # noqa: E731
    chain, log = 0, work / "train-kill.log"
    out = work / f"run-{chain}"

    def finish_chain(out: Path, problems: list[str]) -> None:
        final = out / "checkpoints" / f"step-{max_steps:06d}"
        if not final.is_dir():
            problems.append("no final checkpoint")
        else:
            problems += compare_checkpoint(final, ref_ckpt(max_steps))
        if metric_losses(out) != metric_losses(ref):
            problems.append(f"metrics {metric_losses(out)} != reference {metric_losses(ref)}")
        if not (out / "export" / "transformer").is_dir():
            problems.append("no export")
        if problems:
            outcome.fail(f"chain {chain} final: {problems[:3]}")

    attempts = 0
    while outcome.injected < kills and attempts < 2 * kills:  # a run that finishes first is no kill
        attempts += 1
        recipe = train_recipe(work / f"run-{chain}.yaml", cache, out, max_steps=max_steps)
        proc = start(pfctl("train", "--recipe", str(recipe)), log)
        target = rng.choice([0, 1, 1, 2])
        if target == 0:
            wait_until(proc, lambda: False, timeout=rng.uniform(1.0, 10.0))
        else:
            have = max(checkpoint_steps(out), default=0)
            wait_until(
                proc,
                lambda have=have, t=target, out=out: max(checkpoint_steps(out), default=0) >= have + t,
                180,
            )
            wait_until(proc, lambda: False, timeout=rng.uniform(0.0, 0.4))
        finished = proc.poll() is not None
        kill_group(proc)
        if finished:
            problems = [] if proc.returncode == 0 else [f"exit {proc.returncode}"]
            finish_chain(out, problems)
            outcome.notes.append(f"chain {chain} completed before a kill")
            chain += 1
            out = work / f"run-{chain}"
            continue
        outcome.injected += 1
        problems = []
        for step in checkpoint_steps(out):
            problems += compare_checkpoint(out / "checkpoints" / f"step-{step:06d}", ref_ckpt(step))
        if problems:
            outcome.data_lost += 1
            outcome.fail(f"after kill {outcome.injected}: {problems[:3]}")
        else:
            outcome.survived += 1
    recipe = train_recipe(work / f"run-{chain}.yaml", cache, out, max_steps=max_steps)
    done = run(pfctl("train", "--recipe", str(recipe)))
    problems = [] if done.returncode == 0 else [f"final run exit {done.returncode}: {done.stderr[-800:]}"]
    finish_chain(out, problems)
    outcome.notes.append(f"{chain + 1} chain(s) of {max_steps} steps, checkpoint every step, keep_last 2")
    outcome.seconds = time.monotonic() - t0
    return outcome
