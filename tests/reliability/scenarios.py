"""The fault scenarios beyond kill and resume, shared by ``tests/reliability`` (few iterations) and
``scripts/reliability.py`` (many): a raising, hanging or corrupted rank under torchrun, a full disk and read-only
folders, NaN latents and losses, bad videos and bad command lines, and the safety checks (no unsafe loading, no
writes outside the output folders). The processes, caches and recipes they use are :mod:`reliability.harness`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reliability.harness import (
    REPO,
    TRACEBACK,
    Outcome,
    check_cache_complete,
    check_cache_state,
    checkpoint_steps,
    child_env,
    clip_files,
    compare_checkpoint,
    encode_args,
    kill_group,
    make_encode_corpus,
    make_train_cache,
    pfctl,
    run,
    torchrun,
    train_recipe,
    train_reference,
)

# ------------------------------------------------------------------------------------ distributed


def dist_fault_scenario(
    work: Path, name: str, fault: str, *, expect_rc0: bool = False, timeout_s: float = 300, **opts: Any
) -> tuple[Outcome, subprocess.CompletedProcess, Path, float]:
    """4 CPU processes under ``torchrun --standalone`` with ``PFCTL_FAULT=fault``."""
    outcome = Outcome(name)
    cache = make_train_cache(work / "cache4", [8] * 12 + [5] * 12 + [3] * 12 + [1] * 4, seed=5)
    out = work / name.replace(" ", "_").replace(":", "")
    shutil.rmtree(out, ignore_errors=True)
    runtime = {"collective_timeout_s": opts.pop("collective_timeout_s", 60)}
    train = {
        "max_steps": 3,
        "max_units": 8,
        "video_sync_group": 2,
        "export": False,
        "ema_decay": None,
        **opts,
    }
    recipe = train_recipe(out.with_suffix(".yaml"), cache, out, runtime=runtime, **train)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        torchrun(4, "train", "--recipe", str(recipe)), env=child_env(PFCTL_FAULT=fault),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        text, _ = proc.communicate()
        outcome.fail(f"hang: still running after {timeout_s:.0f} s")
    seconds = time.monotonic() - t0
    kill_group(proc)  # and check that no worker outlived torchrun
    outcome.injected = 1
    outcome.seconds = seconds
    done = subprocess.CompletedProcess(proc.args, proc.returncode, text, "")
    if (proc.returncode == 0) != expect_rc0:
        outcome.fail(f"exit code {proc.returncode} (expected {'0' if expect_rc0 else 'non-zero'})")
    if TRACEBACK in text and "PFCTL_DEBUG" not in fault:
        outcome.notes.append("torchrun printed a traceback (its own ChildFailedError summary)")
    return outcome, done, out, seconds


def pfctl_tracebacks(text: str) -> int:
    """Tracebacks from pfctl workers (torchrun's own ChildFailedError report excluded)."""
    blocks = text.split(TRACEBACK)[1:]
    return sum(
        1 for b in blocks if "torch/distributed/elastic" not in b and "torch.distributed" not in b[:4000]
    )


def dist_raise_scenario(work: Path) -> Outcome:
    """Rank 2 raises in step 2: every rank ends non-zero quickly, the message names rank 2 and why,
    and the checkpoint of step 1 stays the latest complete one (no half-written step 2)."""
    fault = "train_step:rank=2:step=2"
    outcome, done, out, seconds = dist_fault_scenario(work, "dist: rank 2 raises in step 2", fault)
    text = done.stdout
    if "rank 2" not in text or "injected fault 'train_step'" not in text:
        outcome.fail("the output does not name rank 2 and the reason")
    if checkpoint_steps(out) != [1]:
        outcome.fail(f"complete checkpoints {checkpoint_steps(out)} (expected [1])")
    if (out / "checkpoints" / "step-000002").exists():
        outcome.fail("a step-000002 folder exists")
    outcome.survived = int(not outcome.failures)
    outcome.notes.append(f"all 4 processes gone {seconds:.1f} s after launch")
    return outcome


def dist_hang_scenario(work: Path, timeout_s: int = 20) -> Outcome:
    """Rank 1 stops answering in step 2: the others give up after ``runtime.collective_timeout_s``
    (no endless hang), exit non-zero with a message, and torchrun ends the silent rank."""
    fault = "train_step:rank=1:step=2:action=hang"
    outcome, done, out, seconds = dist_fault_scenario(
        work, "dist: rank 1 hangs in step 2", fault, collective_timeout_s=timeout_s, timeout_s=timeout_s + 240
    )
    if checkpoint_steps(out) != [1]:
        outcome.fail(f"complete checkpoints {checkpoint_steps(out)} (expected [1])")
    if "collective operation failed" not in done.stdout and "timed out" not in done.stdout.lower():
        outcome.fail("no collective-timeout message")
    outcome.survived = int(not outcome.failures)
    outcome.notes.append(f"collective_timeout_s={timeout_s}; all processes gone {seconds:.1f} s after launch")
    return outcome


def dist_checkpoint_enospc_scenario(work: Path) -> Outcome:
    """Rank 2's file of the step-2 checkpoint hits a full disk: every rank stops, no step-2
    checkpoint is committed, and a rerun without the fault resumes from step 1 and completes."""
    fault = "write:rank=2:path=.tmp-step-000002/ranks/rank-00002:error=enospc"
    outcome, done, out, seconds = dist_fault_scenario(
        work, "dist: disk full in rank 2's checkpoint file", fault
    )
    text = done.stdout
    if "No space left on device" not in text or "rank 2" not in text:
        outcome.fail("the output does not say 'No space left on device' on rank 2")
    if checkpoint_steps(out) != [1]:
        outcome.fail(f"complete checkpoints {checkpoint_steps(out)} after the fault (expected [1])")
    recipe = out.with_suffix(".yaml")
    again = run(torchrun(4, "train", "--recipe", str(recipe)), timeout=600)
    if again.returncode != 0:
        outcome.fail(f"the rerun failed: {again.stderr[-800:]}")
    elif "resumed at step 1" not in again.stdout:
        outcome.fail("the rerun did not resume from step 1")
    elif checkpoint_steps(out)[-1] != 3 or list((out / "checkpoints").glob(".tmp-*")):
        outcome.fail(f"after the rerun: checkpoints {checkpoint_steps(out)}, temp folders left")
    outcome.survived = int(not outcome.failures)
    outcome.notes.append(f"faulted run ended {seconds:.1f} s after launch")
    return outcome


def dist_corrupt_one_rank_scenario(work: Path) -> Outcome:
    """A clip that fails to load on rank 2 only: its sync group (ranks 2, 3) agrees to replace it,
    nobody hangs, the run completes."""
    from pfctl.api import train as api_train
    from pfctl.config import load_config

    cache = make_train_cache(work / "cache4", [8] * 12 + [5] * 12 + [3] * 12 + [1] * 4, seed=5)
    probe = train_recipe(
        work / "probe.yaml", cache, work / "probe", max_steps=3, max_units=8, video_sync_group=2,
        export=False, ema_decay=None,
    )  # fmt: skip
    rows = api_train(load_config(str(probe)), dry_run=True, world_size=4).rows
    victim = next(r for r in rows if r["rank"] == 2 and r["micro_step"] == 0)["ids"][0]
    fault = f"cache_load:rank=2:clip={victim}"
    outcome, done, out, seconds = dist_fault_scenario(
        work, "dist: a clip unreadable on rank 2 only", fault, expect_rc0=True
    )
    if done.returncode == 0:
        rows = [
            json.loads(line)
            for r in range(4)
            for line in (out / "assignments" / f"rank-{r:05d}.jsonl").read_text().splitlines()
        ]
        first = {r["rank"]: r for r in rows if r["micro_step"] == 0}
        if not (first[2]["replaced"] == first[3]["replaced"] == {"0": [victim]}):
            outcome.fail(
                f"ranks 2 and 3 did not agree on replacing {victim}: {first[2]['replaced']}, {first[3]['replaced']}"
            )
        if first[2]["ids"] != first[3]["ids"]:
            outcome.fail("ranks 2 and 3 trained different clips")
    else:
        outcome.fail(done.stdout[-800:])
    outcome.survived = int(not outcome.failures)
    outcome.notes.append(f"completed in {seconds:.1f} s")
    return outcome


# ------------------------------------------------------------------------------------ disk full


@contextlib.contextmanager
def small_disk(path: Path, size_kb: int) -> Iterator[str]:
    """A tmpfs of ``size_kb`` at ``path`` (yields "tmpfs"), or a plain folder (yields "hook")
    when mounting is not allowed here — callers then arm ``PFCTL_FAULT=write:...:error=enospc``."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], capture_output=True
            ).returncode
            == 0
        )
    try:
        yield "tmpfs" if mounted else "hook"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, mode: str) -> bool:
    return subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True).returncode == 0


def ballast(folder: Path, leave_kb: int) -> Path:
    """Fill a tmpfs until about ``leave_kb`` KiB are free."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    path = folder / "ballast.bin"
    path.write_bytes(b"\0" * max(0, free - leave_kb * 1024))
    return path


def encode_disk_full_scenario(work: Path) -> Outcome:
    """encode-latents into a nearly full disk: exit 1 with 'No space left on device' naming the
    file, every clip on disk whole, no temp files; after space is freed the rerun completes
    without re-encoding what was kept."""
    outcome = Outcome("encode: disk full")
    t0 = time.monotonic()
    ann, ids = make_encode_corpus(work / "corpus", copies=4)
    disk = work / "disk-encode"
    with small_disk(disk, 1024) as how:
        out = disk / "cache"
        if how == "tmpfs":
            weight = ballast(disk, leave_kb=40)
            env = {}
        else:
            weight, env = None, {"PFCTL_FAULT": "write:path=clips/:error=enospc:after=4"}
        outcome.notes.append(f"full disk by {'a small tmpfs' if how == 'tmpfs' else 'the write fault hook'}")
        outcome.injected = 1
        first = run(pfctl(*encode_args(ann, out)), **env)
        text = first.stdout + first.stderr
        if first.returncode != 1:
            outcome.fail(f"exit {first.returncode} on a full disk (expected 1): {text[-600:]}")
        if "No space left on device" not in text or TRACEBACK in text:
            outcome.fail(f"unclear message: {first.stderr[-400:]}")
        kept = clip_files(out)
        problems = check_cache_state(out)
        if list(out.rglob(".*.tmp")):
            problems.append("temp files left behind")
        if weight is not None:
            weight.unlink()
        second = run(pfctl(*encode_args(ann, out)))
        if second.returncode != 0:
            problems.append(f"rerun after freeing space: exit {second.returncode} {second.stderr[-400:]}")
        problems += check_cache_complete(out, ids)
        now = clip_files(out)
        lost = [k for k, v in kept.items() if now.get(k) != v]
        outcome.data_lost += len(lost)
        if problems or lost:
            outcome.fail(f"{problems[:3]} rewritten={len(lost)}")
        outcome.survived = int(not outcome.failures)
        outcome.notes.append(f"{len(kept)} of {len(ids)} clips written before the disk was full, all kept")
    outcome.seconds = time.monotonic() - t0
    return outcome


def train_disk_full_scenario(work: Path, max_steps: int = 4) -> Outcome:
    """train with checkpoints onto a disk with room for ~1.5 checkpoints: exit 1 with a clear
    message, the previous checkpoint intact; after space is freed --resume latest finishes with
    weights bit-identical to an uninterrupted run."""
    outcome = Outcome("train: disk full during a checkpoint")
    t0 = time.monotonic()
    cache = make_train_cache(work / "cache")
    ref = train_reference(work, cache, 6)
    size = sum(p.stat().st_size for p in (ref / "checkpoints" / "step-000001").rglob("*") if p.is_file())
    disk = work / "disk-train"
    with small_disk(disk, 64 * 1024) as how:
        out = disk / "run"
        recipe = train_recipe(work / "disk-train.yaml", cache, out, max_steps=6, keep_last=None)
        if how == "tmpfs":
            weight, env = ballast(disk, leave_kb=int(size * 1.6) // 1024 + 64), {}
        else:
            weight, env = None, {"PFCTL_FAULT": "write:path=.tmp-step-000002/:error=enospc"}
        outcome.injected = 1
        first = run(pfctl("train", "--recipe", str(recipe)), **env)
        text = first.stdout + first.stderr
        if first.returncode != 1 or "No space left on device" not in text or TRACEBACK in text:
            outcome.fail(f"exit {first.returncode}; {first.stderr[-500:]}")
        steps = checkpoint_steps(out)
        problems = []
        for step in steps:
            problems += compare_checkpoint(
                out / "checkpoints" / f"step-{step:06d}", ref / "checkpoints" / f"step-{step:06d}"
            )
        outcome.notes.append(f"complete checkpoints after the failure: {steps} ({size // 1024} KiB each)")
        if weight is not None:
            weight.unlink()
        second = run(pfctl("train", "--recipe", str(recipe)))
        if second.returncode != 0:
            problems.append(f"rerun after freeing space: exit {second.returncode} {second.stderr[-500:]}")
        else:
            problems += compare_checkpoint(
                out / "checkpoints" / "step-000006", ref / "checkpoints" / "step-000006"
            )
        if problems:
            outcome.data_lost += 1
            outcome.fail(str(problems[:3]))
        outcome.survived = int(not outcome.failures)
    outcome.seconds = time.monotonic() - t0
    return outcome


def read_only_scenario(work: Path) -> Outcome:
    """Output folders that cannot be written (a read-only mount, or the EROFS/EACCES fault hook
    when mounting is not possible): exit 2, one clear line, the existing cache untouched."""
    outcome = Outcome("read-only / permission denied output")
    t0 = time.monotonic()
    ann, _ids = make_encode_corpus(work / "corpus", copies=1)
    cache = make_train_cache(work / "cache")
    disk = work / "disk-ro"
    with small_disk(disk, 8 * 1024) as how:
        out = disk / "cache"
        ok = run(pfctl(*encode_args(ann, out)))
        if ok.returncode != 0:
            outcome.fail(f"setup encode failed: {ok.stderr[-300:]}")
        before = clip_files(out)
        cases: list[tuple[str, list[str], dict[str, str]]] = []
        if how == "tmpfs" and remount(disk, "ro"):
            outcome.notes.append("read-only tmpfs (mount -o remount,ro)")
            cases.append(("encode resume into a read-only cache", pfctl(*encode_args(ann, out)), {}))
            recipe = train_recipe(work / "ro-train.yaml", cache, disk / "train", max_steps=1)
            cases.append(("train into a read-only folder", pfctl("train", "--recipe", str(recipe)), {}))
        else:
            outcome.notes.append("EROFS via the write fault hook (no mount here)")
            cases.append(
                ("encode, EROFS", pfctl(*encode_args(ann, work / "c2")), {"PFCTL_FAULT": "write:error=erofs"})
            )
        cases.append(
            (
                "encode, EACCES (hook: root ignores chmod)",
                pfctl(*encode_args(ann, work / "c3")),
                {"PFCTL_FAULT": "write:error=eacces"},
            )
        )
        for label, cmd, env in cases:
            outcome.injected += 1
            got = run(cmd, **env)
            text = got.stdout + got.stderr
            if (
                got.returncode != 2
                or TRACEBACK in text
                or not any(s in text for s in ("Read-only file system", "Permission denied"))
            ):
                outcome.fail(f"{label}: exit {got.returncode}: {got.stderr[-400:]}")
            else:
                outcome.survived += 1
        if how == "tmpfs":
            remount(disk, "rw")
        if clip_files(out) != before or check_cache_state(out):
            outcome.data_lost += 1
            outcome.fail("the existing cache changed")
    outcome.seconds = time.monotonic() - t0
    return outcome


# ------------------------------------------------------------------------------------ NaN


def encode_nan_scenario(work: Path) -> Outcome:
    """NaN latents for one clip: that clip is rejected with reason non_finite (named in
    failures.jsonl), not written; the others are encoded; exit 0."""
    outcome = Outcome("encode: NaN latents rejected")
    t0 = time.monotonic()
    ann, ids = make_encode_corpus(work / "corpus", copies=1)
    out = work / "nan-cache"
    shutil.rmtree(out, ignore_errors=True)
    outcome.injected = 1
    got = run(pfctl(*encode_args(ann, out)), PFCTL_FAULT="encode_nan:clip=b-0")
    failures = (
        [json.loads(x) for x in (out / "failures.jsonl").read_text().splitlines()]
        if got.returncode == 0
        else []
    )
    if [(f["id"], f["reason"]) for f in failures] != [("b-0", "non_finite")]:
        outcome.fail(f"exit {got.returncode}; failures {failures}; {got.stderr[-300:]}")
    elif "non_finite" not in got.stdout:
        outcome.fail("the summary does not show the non_finite reason")
    from pfctl.data.latent_cache import LatentCache

    if got.returncode == 0 and sorted(LatentCache.open(out).ids()) != sorted(set(ids) - {"b-0"}):
        outcome.fail("the NaN clip reached the manifest or another clip is missing")
    outcome.survived = int(not outcome.failures)
    outcome.seconds = time.monotonic() - t0
    return outcome


def train_nan_scenario(work: Path) -> Outcome:
    """NaN latents at step 2: nan_policy=stop exits 1 naming the step and the clip ids, the step-1
    checkpoint intact; nan_policy=skip skips that update and completes."""
    outcome = Outcome("train: NaN loss (nan_policy stop / skip)")
    t0 = time.monotonic()
    cache = make_train_cache(work / "cache")
    for policy in ("stop", "skip"):
        outcome.injected += 1
        out = work / f"nan-{policy}"
        shutil.rmtree(out, ignore_errors=True)
        recipe = train_recipe(
            work / f"nan-{policy}.yaml", cache, out, max_steps=3, nan_policy=policy, export=False
        )
        got = run(pfctl("train", "--recipe", str(recipe)), PFCTL_FAULT="train_nan:step=2")
        text = got.stdout + got.stderr
        if TRACEBACK in text:
            outcome.fail(f"{policy}: traceback")
        elif policy == "stop":
            if got.returncode != 1 or "at step 2" not in got.stderr or "clips of this step" not in got.stderr:
                outcome.fail(f"stop: exit {got.returncode}: {got.stderr[-400:]}")
            elif checkpoint_steps(out) != [1]:
                outcome.fail(f"stop: checkpoints {checkpoint_steps(out)}")
            else:
                outcome.survived += 1
        else:
            rows = (
                [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                if got.returncode == 0
                else []
            )
            skipped = [r["step"] for r in rows if r.get("skipped")]
            if got.returncode != 0 or skipped != [2] or "clips" not in got.stdout:
                outcome.fail(f"skip: exit {got.returncode}, skipped steps {skipped}: {got.stderr[-300:]}")
            else:
                outcome.survived += 1
    outcome.seconds = time.monotonic() - t0
    return outcome


# ------------------------------------------------------------------------------------ bad inputs


def write_bad_video_corpus(root: Path) -> dict[str, str | None]:
    """Broken and odd media next to good ones → {file: expected failure reason, or None = encodes}."""
    import av
    import numpy as np
    from PIL import Image

    from pfctl.data.synthetic import moving_frames, write_bad_media, write_video

    good = write_video(root / "good.mp4", moving_frames(12, 48, 64), fps=24)
    expected: dict[str, str | None] = {"good.mp4": None}
    expected.update(write_bad_media(root, good))  # zero-byte, text named .mp4, cut, audio-only, folder
    (root / "video.png").write_bytes(good.read_bytes())  # wrong extension: an mp4 named .png (as video)
    expected["video.png"] = None
    Image.fromarray(np.full((20, 20, 3), 50, np.uint8)).save(root / "image.mp4", format="PNG")
    expected["image.mp4"] = "too_short"  # a PNG named .mp4: FFmpeg reads it as a 1-frame video
    write_video(root / "one-frame.mp4", moving_frames(1, 48, 64), fps=24)
    expected["one-frame.mp4"] = "too_short"
    # 1x1 pixels: H.264 needs even sizes, so FFV1 in Matroska
    with av.open(str(root / "tiny.mkv"), "w") as c:
        s = c.add_stream("ffv1", rate=24)
        s.width, s.height, s.pix_fmt = 1, 1, "yuv444p"
        for i in range(12):
            frame = av.VideoFrame.from_ndarray(np.full((1, 1, 3), 20 * i, np.uint8), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    expected["tiny.mkv"] = None
    write_video(root / "huge.mp4", np.zeros((1, 4096, 4096, 3), np.uint8), fps=24)
    expected["huge.mp4"] = "resolution_too_large"
    # variable frame rate: irregular timestamps
    with av.open(str(root / "vfr.mp4"), "w") as c:
        from fractions import Fraction

        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.codec_context.time_base = Fraction(1, 1000)
        t = 0
        for i, frame_np in enumerate(moving_frames(20, 48, 64)):
            frame = av.VideoFrame.from_ndarray(frame_np, format="rgb24")
            frame.pts, frame.time_base = t, Fraction(1, 1000)
            t += 20 if i % 2 else 60
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    expected["vfr.mp4"] = None
    (root / "dir with spaces é").mkdir(exist_ok=True)
    shutil.copy(good, root / "dir with spaces é" / "clip ü 1.mp4")
    expected["dir with spaces é/clip ü 1.mp4"] = None
    return expected


def bad_video_scenario(work: Path) -> Outcome:
    """One encode run over every bad/odd video: each bad one is a failure row with its reason,
    the good ones are encoded, exit 0, no traceback."""
    outcome = Outcome("bad videos (one run)")
    t0 = time.monotonic()
    root = work / "bad-videos"
    expected = write_bad_video_corpus(root)
    rows = [{"video": name, "text": f"case {name}", "id": name} for name in expected]
    ann = root / "ann.jsonl"
    ann.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = work / "bad-videos-cache"
    shutil.rmtree(out, ignore_errors=True)
    got = run(pfctl(*encode_args(ann, out)))
    outcome.injected = sum(1 for v in expected.values() if v is not None)
    text = got.stdout + got.stderr
    if got.returncode != 0 or TRACEBACK in text:
        outcome.fail(f"exit {got.returncode}: {text[-800:]}")
        return outcome
    failures = {
        f["id"]: f["reason"] for f in map(json.loads, (out / "failures.jsonl").read_text().splitlines())
    }
    from pfctl.data.latent_cache import LatentCache

    encoded = set(LatentCache.open(out).ids())
    for name, reason in expected.items():
        if reason is None and name not in encoded:
            outcome.fail(f"{name}: expected to encode, got {failures.get(name)}")
        elif reason is not None and failures.get(name) != reason:
            outcome.fail(f"{name}: expected reason {reason}, got {failures.get(name)}")
        elif reason is not None:
            outcome.survived += 1
    outcome.notes.append(f"{len(encoded)} good/odd inputs encoded: {sorted(encoded)}")
    outcome.seconds = time.monotonic() - t0
    return outcome


def cli_cases(work: Path) -> list[tuple[str, list[str], int, str]]:
    """(label, pfctl args, expected exit code, text the message must contain) for bad annotations
    and recipes. Run in-process through Typer's runner (or as subprocesses by the caller)."""
    from pfctl.data.synthetic import moving_frames, write_video

    root = work / "bad-annotations"
    root.mkdir(parents=True, exist_ok=True)
    good = write_video(root / "v.mp4", moving_frames(12, 48, 64), fps=24)
    out = str(work / "never-written")

    def ann(name: str, text: str) -> str:
        (root / name).write_text(text, encoding="utf-8")
        return str(root / name)

    def enc(path: str, target: str = out) -> list[str]:
        return encode_args(Path(path), Path(target))

    cases = [
        ("csv missing 'text' column", enc(ann("nocol.csv", "video,caption\nv.mp4,hi\n")), 2, "missing column"),
        ("jsonl missing 'video'", enc(ann("novideo.jsonl", '{"text": "x"}\n')), 2, "missing 'video'"),
        ("jsonl text is a number", enc(ann("type.jsonl", '{"video": "v.mp4", "text": 5}\n')), 2, "'text' must be"),
        ("jsonl video is a list", enc(ann("type2.jsonl", '{"video": ["v.mp4"], "text": "x"}\n')), 2, "path string"),
        ("jsonl frames wrong type", enc(ann("frames.jsonl", '{"video": "v.mp4", "text": "x", "frames": "a b"}\n')), 2, "frames"),
        ("jsonl fps negative", enc(ann("fps.jsonl", '{"video": "v.mp4", "text": "x", "fps": -3}\n')), 2, "fps"),
        ("duplicate ids", enc(ann("dup.jsonl", '{"video": "v.mp4", "text": "a", "id": "x"}\n{"video": "v.mp4", "text": "b", "id": "x"}\n')), 2, "duplicated id"),
        ("not JSON", enc(ann("broken.jsonl", '{"video": "v.mp4", "text": \n')), 2, "not valid JSON"),
        ("JSON array row", enc(ann("array.jsonl", '["v.mp4", "x"]\n')), 2, "expected a JSON object"),
        ("empty annotation file", enc(ann("empty.jsonl", "")), 2, "no rows"),
        ("binary annotation file", enc(_binary(root / "bin.jsonl")), 2, "not valid UTF-8"),
        ("unknown annotation type", enc(ann("a.yaml", "x: 1\n")), 2, "unknown type"),
        ("annotation file missing", enc(str(root / "nope.jsonl")), 2, "does not exist"),
        ("lone surrogate in caption", enc(ann("surrogate.jsonl", '{"video": "v.mp4", "text": "bad \\ud800 text"}\n')), 2, "UTF-8"),
        ("all inputs missing", enc(ann("missing.jsonl", '{"video": "gone.mp4", "text": "x"}\n')), 1, "nothing was encoded"),
        ("unicode + spaces in paths", enc(ann("ünï cödé.jsonl", json.dumps({"video": str(good), "text": "ok ✓"}) + "\n"), str(work / "uni out é")), 0, ""),
        ("path escaping the dataset folder", enc(ann("escape.jsonl", json.dumps({"video": "../escape/v.mp4", "text": "x", "id": "../../../up"}) + "\n"), str(work / "escape-out")), 0, ""),
        ("recipe unknown key", ["train", "--recipe", _recipe(root, "runtime:\n  devcie: cpu\n"), "--dry-run"], 2, "unknown key"),
        ("recipe wrong type", ["train", "--recipe", _recipe(root, "train:\n  max_steps: lots\n"), "--dry-run"], 2, "train.max_steps"),
        ("recipe not a mapping", ["train", "--recipe", _recipe(root, "- a\n- b\n"), "--dry-run"], 2, "mapping"),
        ("recipe invalid YAML", ["train", "--recipe", _recipe(root, "train: [\n"), "--dry-run"], 2, "not valid YAML"),
        ("recipe python tag (safe loader)", ["train", "--recipe", _recipe(root, "train: !!python/object/apply:os.system ['echo pwned']\n"), "--dry-run"], 2, "not valid YAML"),
        ("recipe binary", ["train", "--recipe", _binary(root / "bin.yaml"), "--dry-run"], 2, "recipe"),
        ("--set bad override", ["train", "--set", "train.max_steps", "--dry-run"], 2, "bad override"),
        ("--set unknown section", ["train", "--set", "trian.lr=1", "--dry-run"], 2, "unknown key"),
    ]  # fmt: skip
    (work / "escape").mkdir(exist_ok=True)
    shutil.copy(good, work / "escape" / "v.mp4")
    return cases


def _binary(path: Path) -> str:
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


def _recipe(root: Path, text: str) -> str:
    import hashlib

    path = root / f"recipe-{hashlib.sha1(text.encode()).hexdigest()[:8]}.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def run_cli_case(args: list[str]) -> tuple[int, str, bool]:
    """In-process CLI run: (exit code, output, whether an exception escaped = a traceback)."""
    from typer.testing import CliRunner

    from pfctl.cli.app import app

    old = os.environ.pop("PFCTL_DEBUG", None)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        if old is not None:
            os.environ["PFCTL_DEBUG"] = old
    escaped = result.exception is not None and not isinstance(result.exception, SystemExit)
    return result.exit_code, result.output, escaped


def bad_input_cli_scenario(work: Path) -> Outcome:
    """Every bad annotation/recipe case: the documented exit code, one clear line, no traceback."""
    outcome = Outcome("bad annotations / recipes (CLI exit codes)")
    t0 = time.monotonic()
    for label, args, code, needle in cli_cases(work):
        got, text, escaped = run_cli_case(args)
        good = got == code and not escaped and (not needle or needle in text)
        outcome.injected += 1
        if not good:
            outcome.fail(f"{label}: exit {got} (expected {code}), escaped={escaped}: {text[-300:]!r}")
        else:
            outcome.survived += 1
    leaked = [p for p in (work.parent, work) if (p / "up").exists()]
    if leaked:
        outcome.fail(f"a file was written outside the output folder: {leaked}")
    outcome.seconds = time.monotonic() - t0
    return outcome


# ------------------------------------------------------------------------------------ safety


def static_safety_scan() -> Outcome:
    """Weights and caches only through safetensors, YAML only through the safe loader."""
    import re

    outcome = Outcome("safety: no pickle, no unsafe YAML")
    rules = [
        (re.compile(r"torch\.load\((?![^)]*weights_only=True)"), "torch.load without weights_only=True"),
        (re.compile(r"\bpickle\.loads?\(|\bimport (?:dill|cloudpickle)\b"), "unpickling"),
        (
            re.compile(r"yaml\.(?:load|load_all|unsafe_load|full_load)\((?![^)]*SafeLoader)"),
            "unsafe YAML loader",
        ),
        (re.compile(r"torch\.save\("), "torch.save (pickle) for an output"),
        (re.compile(r"(?<![\w.])(?:eval|exec)\("), "eval/exec"),
    ]
    modules = sorted((REPO / "pfctl").rglob("*.py"))
    for path in modules:
        text = path.read_text(encoding="utf-8")
        outcome.injected += 1
        clean = True
        for pattern, what in rules:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                clean = False
                outcome.fail(f"{path.relative_to(REPO)}:{line}: {what}")
        outcome.survived += int(clean)
    outcome.notes.append(f"{len(modules)} modules scanned for {len(rules)} patterns (counted as checks)")
    return outcome


def outside_writes_scenario(work: Path) -> Outcome:
    """encode + train + generate-free pipeline in a sandbox (HOME and cwd inside it): only the
    chosen output folders gain files."""
    outcome = Outcome("safety: nothing written outside the output folders")
    t0 = time.monotonic()
    box = work / "sandbox"
    shutil.rmtree(box, ignore_errors=True)
    (box / "home").mkdir(parents=True)
    ann, _ = make_encode_corpus(box / "inputs", copies=1)
    cache = box / "outputs" / "cache"
    train_cache = make_train_cache(box / "inputs" / "cache")
    train_out = box / "outputs" / "train"
    env = {
        "HOME": str(box / "home"),
        "XDG_CACHE_HOME": str(box / "home" / ".cache"),
        "TMPDIR": str(box / "home"),
    }
    steps = [
        pfctl(*encode_args(ann, cache)),
        pfctl(
            "train",
            "--recipe",
            str(train_recipe(box / "inputs" / "r.yaml", train_cache, train_out, max_steps=2)),
        ),
    ]
    before = {p for p in box.rglob("*")}
    for cmd in steps:
        outcome.injected += 1
        got = subprocess.run(
            cmd, env=child_env(**env), capture_output=True, text=True, cwd=box / "inputs", timeout=600
        )
        if got.returncode != 0:
            outcome.fail(f"{cmd[3]}: exit {got.returncode}: {got.stderr[-400:]}")
        else:
            outcome.survived += 1
    new = [p for p in box.rglob("*") if p not in before and not p.is_relative_to(box / "outputs")]
    new = [p for p in new if not p.is_relative_to(box / "home")]  # third-party caches, if any, go to HOME
    if new:
        outcome.fail(f"files outside the output folders: {[str(p.relative_to(box)) for p in new[:5]]}")
    home = [str(p.relative_to(box)) for p in (box / "home").rglob("*") if p.is_file()]
    if home:
        outcome.notes.append(f"third-party files under HOME/TMPDIR: {home[:5]}")
    outcome.seconds = time.monotonic() - t0
    return outcome
