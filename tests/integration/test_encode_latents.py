"""encode-latents end to end on real H.264 files with the tiny causal VAE (and tiny text encoders)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.caches import BUCKETS, assert_same_cache, encode_config
from helpers.tolerance import rounding_rtol
from pfctl.config.load import load_config
from pfctl.data import latent_cache as lc
from pfctl.data.encode import run_encode
from pfctl.data.synthetic import index_frames, moving_frames, write_bad_media, write_video
from pfctl.errors import CacheError, CheckFailed, ConfigError, InputError, ModelLoadError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four good inputs (2 s landscape at 24 fps, 2 s at 30 fps, a portrait clip, an image) + annotations."""
    from PIL import Image

    root = tmp_path_factory.mktemp("encode-corpus")
    write_video(root / "videos" / "a.mp4", moving_frames(48, 64, 64), fps=24)
    write_video(root / "videos" / "b.mp4", index_frames(60, 48, 64), fps=30)
    write_video(root / "videos" / "p.mp4", moving_frames(40, 64, 48, seed=1), fps=24)
    Image.fromarray(np.full((40, 60, 3), 90, dtype=np.uint8)).save(root / "videos" / "c.png")
    rows = [
        {"video": "videos/a.mp4", "text": "a red square moves to the right"},
        {"video": "videos/b.mp4", "text": "a gray ramp", "id": "../../escape"},
        {"video": "videos/p.mp4", "text": "a portrait clip"},
        {"image": "videos/c.png", "text": "a gray image"},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _stamps(root: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.glob("clips/*/*.safetensors")}


def test_tiny_vae_declares_the_8k_plus_1_contract() -> None:
    from pfctl.data.video import FrameContract
    from pfctl.models.vae import load_vae

    assert FrameContract.from_vae(load_vae("causal-vae-tiny"), 130) == FrameContract.one_plus_multiple(8, 130)


def test_round_trip_with_text(corpus: Path, text_folder: Path, tmp_path: Path, runtime) -> None:
    config = encode_config(
        corpus / "train.jsonl", tmp_path / "cache", text=True, text_encoder=str(text_folder), num_frames=17
    )
    report = run_encode(config, runtime=runtime)
    assert (report.encoded, report.skipped, report.failed, report.manifest_clips) == (4, 0, 0, 4)
    cache = lc.LatentCache.open(tmp_path / "cache")
    assert cache.ids() == sorted(["videos/a", "../../escape", "videos/p", "videos/c"])
    assert not (tmp_path / "escape").exists() and not list(tmp_path.glob("*.safetensors"))
    header = cache.header
    assert header["format_version"] == lc.FORMAT_VERSION and header["fingerprint"] == report.fingerprint
    assert header["vae"]["name"] == "pyramid-causal-vae" and header["vae"]["normalization"]["rule"]
    assert header["text_encoder"]["dim"] == 32 and header["provenance"]["preprocessing"]["num_frames"] == 17
    rows = {r["id"]: r for r in cache.items()}
    assert rows["videos/a"]["bucket"] == "32x24" and rows["videos/p"]["bucket"] == "24x32"
    assert (rows["videos/a"]["num_latent_frames"], rows["videos/a"]["height"], rows["videos/a"]["width"]) == (
        3,
        3,
        4,
    )
    assert rows["videos/c"]["num_latent_frames"] == 1 and rows["videos/c"]["kind"] == "image"
    tensors = cache.load("../../escape")
    assert tensors["latent_mean"].shape == (16, 3, 3, 4) and tensors["latent_mean"].dtype == torch.bfloat16
    assert bool((tensors["latent_std"] > 0).all())
    assert (
        tensors["prompt_embeds"].shape == (128, 32) and tensors["prompt_attention_mask"].dtype == torch.int64
    )
    meta = cache.metadata("../../escape")
    assert json.loads(meta["frame_indices"]) == [int(j * 30 / 24) for j in range(17)]
    assert meta["fps"] == "24" and meta["source_fps"] == "30" and meta["chunking"] == "none"
    assert meta["vae_class"] == "CausalVideoVAE" and meta["text"] == "a gray ramp"
    null = cache.null_text()
    assert null["prompt_embeds"].shape == (128, 32) and int(null["prompt_attention_mask"].sum()) >= 1
    # same latents as encoding the decoded clip directly with the adapter
    from pfctl.data.annotations import load_annotations
    from pfctl.data.encode_setup import frame_settings
    from pfctl.data.video import FrameContract, decode_item, to_model_input
    from pfctl.models.vae import load_vae

    vae = load_vae("causal-vae-tiny")
    item = next(i for i in load_annotations(corpus / "train.jsonl") if i.id == "videos/a")
    settings = frame_settings(config.encode, FrameContract.from_vae(vae, 241), decode_threads=0)
    direct = vae.encode(to_model_input(decode_item(item, settings).frames[0]).unsqueeze(0)).mean[0]
    # the pipeline's call (its own process, threads, batch) may sum in another order (helpers.tolerance: the
    # tiny VAE's 3x3x3 convolutions over 16 channels, about 20 chained); then both round to bf16 (2^-8 relative)
    fp32 = rounding_rtol(16 * 27, 20) * float(direct.abs().max())
    torch.testing.assert_close(cache.load("videos/a")["latent_mean"].float(), direct, rtol=2**-8, atol=fp32)


def test_dry_run_encodes_nothing(corpus: Path, tmp_path: Path, runtime) -> None:
    out = tmp_path / "never"
    report = run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime, dry_run=True)
    assert not out.exists()
    plan = {(r.bucket, r.num_frames): r for r in report.plan}
    assert plan[("32x24", 9)].clips == 2 and plan[("24x32", 9)].clips == 1 and plan[("32x24", 1)].clips == 1
    assert plan[("32x24", 9)].latent_shape == (16, 2, 3, 4) and plan[("32x24", 1)].latent_shape == (
        16,
        1,
        3,
        4,
    )
    assert report.estimated_bytes == sum(r.bytes_per_clip * r.clips for r in report.plan) > 0
    assert report.encoded == 0 and report.failed == 0
    # after a real run the dry run counts the cached clips
    run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime)
    again = run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime, dry_run=True)
    assert sum(r.cached for r in again.plan) == 4 and again.estimated_bytes == 0


def test_rerun_encodes_only_missing_clips(corpus: Path, tmp_path: Path, runtime) -> None:
    out = tmp_path / "cache"
    first = run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime)
    assert first.encoded == 4
    victim = out / lc.clip_relpath("videos/p")
    victim.unlink()
    (out / lc.MANIFEST_FILE).unlink()  # as after a killed run
    before = _stamps(out)
    second = run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime)
    assert (second.encoded, second.skipped, second.manifest_clips) == (1, 3, 4)
    after = _stamps(out)
    assert {k: after[k] for k in before} == before and victim.is_file()


def test_fingerprint_mismatch_is_refused_and_nothing_rewritten(corpus: Path, tmp_path: Path, runtime) -> None:
    out = tmp_path / "cache"
    run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime)
    before, header = _stamps(out), (out / lc.HEADER_FILE).read_text()
    with pytest.raises(CacheError) as info:
        run_encode(encode_config(corpus / "train.jsonl", out, fps=12), runtime=runtime)
    assert "preprocessing.fps" in info.value.message and "--overwrite" in info.value.hint
    with pytest.raises(CacheError, match="chunking"):
        run_encode(
            encode_config(corpus / "train.jsonl", out, chunking="framewise"), runtime=runtime, dry_run=True
        )
    assert _stamps(out) == before and (out / lc.HEADER_FILE).read_text() == header
    redo = run_encode(encode_config(corpus / "train.jsonl", out, fps=12), runtime=runtime, overwrite=True)
    assert redo.encoded == 4 and redo.failed == 0
    assert lc.LatentCache.open(out).header["provenance"]["preprocessing"]["fps"] == 12


def test_corrupt_corpus_reasons_and_max_failures(corpus: Path, tmp_path: Path, runtime) -> None:
    bad = write_bad_media(tmp_path / "bad", corpus / "videos" / "a.mp4")
    write_video(tmp_path / "bad" / "short.mp4", moving_frames(8, 64, 64), fps=24)
    write_video(tmp_path / "bad" / "huge.mp4", moving_frames(20, 96, 128), fps=24)
    expected = {**bad, "short.mp4": "too_short", "huge.mp4": "resolution_too_large", "gone.mp4": "missing"}
    rows = [{"video": str(corpus / "videos" / "a.mp4"), "text": "good"}]
    rows += [{"video": f"bad/{name}", "text": "bad"} for name in expected]
    ann = tmp_path / "mixed.jsonl"
    ann.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = encode_config(ann, tmp_path / "cache", max_source_pixels=100 * 100)
    report = run_encode(config, runtime=runtime)
    assert report.encoded == 1 and report.failed == len(expected)
    assert sorted(report.failures_by_reason.items()) == sorted(
        {r: list(expected.values()).count(r) for r in set(expected.values())}.items()
    )
    failures = [json.loads(line) for line in (tmp_path / "cache" / lc.FAILURES_FILE).read_text().splitlines()]
    assert {Path(f["source"]).name: f["reason"] for f in failures} == expected
    assert all(f["detail"] and f["line"] >= 2 for f in failures)
    with pytest.raises(CheckFailed) as info:  # rerun: the good clip is cached, the bad ones fail again
        run_encode(config, runtime=runtime, max_failures=3)
    assert info.value.exit_code == 1 and info.value.report.skipped == 1
    assert "max_failures=3" in info.value.message and len(lc.LatentCache.open(tmp_path / "cache")) == 1


def test_uniform_clips_full_mode_and_sample_store(corpus: Path, tmp_path: Path, runtime) -> None:
    uniform = run_encode(
        encode_config(corpus / "train.jsonl", tmp_path / "u", clip_mode="uniform", clips_per_video=3),
        runtime=runtime,
    )
    ids = lc.LatentCache.open(tmp_path / "u").ids()
    assert (
        "videos/a#0" in ids
        and "videos/a#2" in ids
        and "videos/c" in ids
        and uniform.encoded == len(ids) == 10
    )
    config = encode_config(
        corpus / "train.jsonl", tmp_path / "f", clip_mode="full", max_frames=20, store="sample"
    )
    full = run_encode(config, runtime=runtime)
    cache = lc.LatentCache.open(tmp_path / "f")
    assert full.encoded == 4 and cache.latent_keys == ("latent_sample",)
    assert cache.row("videos/a")["num_frames"] == 17 and cache.row("videos/c")["num_frames"] == 1
    assert set(cache.load("videos/a")) == {"latent_sample"}


def test_clips_are_written_behind_the_encoder(
    corpus: Path, tmp_path: Path, runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clip files are written by a background thread while the encoding thread goes on: the VAE call of
    the second batch starts before the (slow) write of the first clip ends, and every clip is written
    before the run returns."""
    import threading

    from pfctl.models.vae import PyramidCausalVAE

    events: list[tuple[str, str, float]] = []
    encode, write = PyramidCausalVAE.encode, lc.LatentCacheWriter.write

    def encoding(self, video, **kwargs):
        events.append(("encode", threading.current_thread().name, time.monotonic()))
        return encode(self, video, **kwargs)

    def writing(self, clip_id, tensors, metadata):
        if not any(e[0] == "written" for e in events):
            time.sleep(1.0)
        row = write(self, clip_id, tensors, metadata)
        events.append(("written", threading.current_thread().name, time.monotonic()))
        return row

    monkeypatch.setattr(PyramidCausalVAE, "encode", encoding)
    monkeypatch.setattr(lc.LatentCacheWriter, "write", writing)
    report = run_encode(
        encode_config(
            corpus / "train.jsonl", tmp_path / "c", clip_mode="uniform", clips_per_video=2, batch_size=1
        ),
        runtime=runtime,
    )
    n = report.encoded
    assert n == 7 and len(lc.LatentCache.open(tmp_path / "c").ids()) == n
    encodes = [t for kind, _, t in events if kind == "encode"]
    writes = [t for kind, _, t in events if kind == "written"]
    assert len(encodes) == len(writes) == n and encodes[1] < writes[0]
    assert {name for kind, name, _ in events if kind == "written"} == {"pfctl-write"}
    assert "pfctl-write" not in {t.name for t in threading.enumerate()}  # joined


def test_decode_thread_is_joined_however_the_consumer_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encode that stops early (a full disk, say) leaves no decode thread behind, even one blocked on the
    full prefetch queue: a decoder still in native code when the interpreter exits can abort the process
    ("terminate called without an active exception", exit -6 instead of 1)."""
    import threading

    import pfctl.data.decoding as encode

    decoded: list[int] = []

    def decode_item(item, settings, skip):
        time.sleep(0.01)
        decoded.append(item)
        return item

    monkeypatch.setattr(encode, "decode_item", decode_item)

    def decoders() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "pfctl-decode"]

    work = [(i, frozenset()) for i in range(50)]
    items = encode.decoded_items(work, settings=None, num_workers=0, prefetch=1)
    assert next(items) == 0
    time.sleep(0.1)  # the thread has filled the queue and waits to put the next clip
    assert decoders()
    with pytest.raises(OSError, match="No space"):
        for _ in items:
            raise OSError(28, "No space left on device")
    items.close()
    assert not decoders()
    assert len(decoded) < len(work)  # it stopped instead of decoding the rest
    assert list(encode.decoded_items(work[:3], settings=None, num_workers=0, prefetch=1)) == [0, 1, 2]
    assert not decoders()


def test_input_errors_exit_2(corpus: Path, tmp_path: Path, runtime) -> None:
    with pytest.raises(InputError, match="does not exist"):
        run_encode(encode_config(tmp_path / "none.jsonl", tmp_path / "c"), runtime=runtime)
    with pytest.raises(ConfigError, match="no text encoder folder"):
        run_encode(encode_config(corpus / "train.jsonl", tmp_path / "c", text=True), runtime=runtime)
    config = encode_config(corpus / "train.jsonl", tmp_path / "c")
    with pytest.raises(ModelLoadError, match="neither a folder nor a built-in"):
        run_encode(
            config.model_copy(update={"model": config.model.model_copy(update={"vae": "nope-vae"})}),
            runtime=runtime,
        )
    with pytest.raises(ConfigError, match="spatial factor"):
        run_encode(encode_config(corpus / "train.jsonl", tmp_path / "c", buckets=[[60, 48]]), runtime=runtime)
    assert not (tmp_path / "c").exists()


def test_missing_decord_is_one_clear_error(
    corpus: Path, tmp_path: Path, runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without decord every video would fail on its own in the workers; say it once, up front."""
    monkeypatch.setitem(sys.modules, "decord", None)  # makes `import decord` raise ImportError
    with pytest.raises(ConfigError, match="decord") as err:
        run_encode(encode_config(corpus / "train.jsonl", tmp_path / "c"), runtime=runtime)
    assert err.value.exit_code == 2 and "pip install decord" in str(err.value)
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------- real processes


def _cli(*args: str, env: dict | None = None) -> list[str]:
    return [sys.executable, "-m", "pfctl", "encode-latents", *args]


def _cli_args(ann: Path, out: Path, workers: int = 0) -> list[str]:
    return [
        "-a", str(ann), "-o", str(out), "--vae", "causal-vae-tiny",
        "--set", "encode.text=false", "--set", f"encode.buckets={json.dumps(BUCKETS)}",
        "--set", "encode.num_frames=9", "--set", f"encode.num_workers={workers}", "--set", "runtime.device=cpu",
        "--set", "encode.dtype=fp32", "--set", "encode.batch_size=2",
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PFCTL_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}
    env.pop("PFCTL_DEBUG", None)
    return env


def _many_clips(corpus: Path, tmp_path: Path, copies: int) -> Path:
    rows = [
        {"video": str(corpus / "videos" / name), "text": f"clip {k}", "id": f"{Path(name).stem}-{k}"}
        for k in range(copies)
        for name in ("a.mp4", "b.mp4", "p.mp4")
    ]
    ann = tmp_path / "many.jsonl"
    ann.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ann


@pytest.mark.slow
def test_killed_run_resumes_without_reencoding(corpus: Path, tmp_path: Path) -> None:
    ann, out = _many_clips(corpus, tmp_path, 3), tmp_path / "cache"
    proc = subprocess.Popen(
        _cli(*_cli_args(ann, out)), env=_env(PFCTL_FAULT="encode_written:action=sleep:seconds=1.0"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(_stamps(out)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = _stamps(out)
    assert 2 <= len(before) < 9 and not (out / lc.MANIFEST_FILE).exists()
    done = subprocess.run(_cli(*_cli_args(ann, out)), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    after = _stamps(out)
    assert len(after) == 9 and {k: after[k] for k in before} == before  # finished clips untouched
    assert re.search(rf"skipped \(already cached\)\s*│\s*{len(before)}\s*│", done.stdout), done.stdout
    assert len(lc.LatentCache.open(out)) == 9 and not list(out.rglob(".*.tmp"))


@pytest.mark.slow
def test_two_processes_write_every_clip_exactly_once(corpus: Path, tmp_path: Path) -> None:
    ann, out = _many_clips(corpus, tmp_path, 2), tmp_path / "cache"
    with ann.open("a") as fh:
        fh.write(json.dumps({"video": "missing.mp4", "text": "x"}) + "\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "pfctl", "encode-latents", *_cli_args(ann, out, workers=1),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [json.loads(line)["id"] for line in (out / lc.MANIFEST_FILE).read_text().splitlines()]
    expected = sorted(f"{s}-{k}" for k in range(2) for s in ("a", "b", "p"))
    assert ids == expected  # every clip exactly once
    failures = [json.loads(line) for line in (out / lc.FAILURES_FILE).read_text().splitlines()]
    assert [(f["id"], f["reason"]) for f in failures] == [("missing", "missing")]
    assert len(_stamps(out)) == 6 and not (out / lc.PARTS_DIR).exists()
    assert done.stdout.count("encode-latents →") == 1  # one summary, from the main process
    # the same cache as one process (each rank batched its own share: other batches, same latents)
    one = subprocess.run(
        _cli(*_cli_args(ann, tmp_path / "one", workers=1)),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert_same_cache(out, tmp_path / "one")


def _embedded_config(ann: Path, out: Path, **flags):
    return load_config(
        None,
        [],
        {"encode.annotations": str(ann), "encode.output_dir": str(out), "encode.num_workers": 0, **flags},
    )


def test_no_model_option_uses_the_embedded_model_and_its_settings(tmp_path: Path, runtime) -> None:
    """No --model and no --vae: the embedded model's VAE and text encoders, and the size, frame rate
    and clip length it was trained with; -m <its folder> is the same model; a user's setting wins."""
    from pfctl.models.embedded import embedded_model_path

    write_video(tmp_path / "v.mp4", moving_frames(30, 72, 96), fps=30)
    ann = tmp_path / "a.jsonl"
    ann.write_text(json.dumps({"video": "v.mp4", "text": "a red circle moving right"}) + "\n")
    report = run_encode(_embedded_config(ann, tmp_path / "c"), runtime=runtime)
    assert report.encoded == 1 and report.failed == 0
    cache = lc.LatentCache.open(tmp_path / "c")
    assert (
        cache.header["vae"]["spec"] == str(embedded_model_path()) and cache.header["text_encoder"] is not None
    )
    preprocessing = cache.header["provenance"]["preprocessing"]
    assert (preprocessing["buckets"], preprocessing["fps"], preprocessing["num_frames"]) == (
        ["64x64"],
        24.0,
        17,
    )
    assert cache.metadata("v")["bucket"] == "64x64" and cache.metadata("v")["num_frames"] == "17"

    flags = {"model.path": str(embedded_model_path()), "encode.num_frames": 9, "encode.text": False}
    report = run_encode(_embedded_config(ann, tmp_path / "c2", **flags), runtime=runtime)
    preprocessing = lc.LatentCache.open(tmp_path / "c2").header["provenance"]["preprocessing"]
    assert report.encoded == 1 and (preprocessing["buckets"], preprocessing["num_frames"]) == (["64x64"], 9)


def test_buckets_the_dit_cannot_train_are_refused_before_any_work(tmp_path: Path, runtime) -> None:
    """Bucket sides must be multiples of VAE factor x DiT patch x 2^(stages-1) = 8 x 2 x 4 px for the
    embedded model; the error names the bucket and the nearest valid sizes, and nothing is written."""
    write_video(tmp_path / "v.mp4", moving_frames(30, 72, 96), fps=30)
    ann = tmp_path / "a.jsonl"
    ann.write_text(json.dumps({"video": "v.mp4", "text": "x"}) + "\n")
    for buckets, named, nearest in [
        ([[64, 64], [96, 64]], "96x64", "64x64, 128x64"),
        ([[1280, 720]], "1280x720", "1280x704, 1280x768"),
        ([[640, 352]], "640x352", "640x320, 640x384"),
    ]:
        config = _embedded_config(ann, tmp_path / "c", **{"encode.buckets": buckets})
        with pytest.raises(ConfigError, match=f"bucket {named} px") as info:
            run_encode(config, runtime=runtime, dry_run=True)
        assert info.value.hint == f"nearest valid sizes: {nearest}" and not (tmp_path / "c").exists()
        with pytest.raises(ConfigError, match=named):
            run_encode(config, runtime=runtime)
        assert not (tmp_path / "c").exists()


def test_torn_manifest_is_rebuilt_by_the_rerun(corpus: Path, tmp_path: Path, runtime) -> None:
    """A manifest cut mid-line (a crash or a full disk while it was written): the rerun rebuilds it from
    the clip files, re-encodes nothing, and the cache opens again."""
    out = tmp_path / "c"
    run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime)
    manifest = out / lc.MANIFEST_FILE
    whole, before = manifest.read_text(), _stamps(out)
    manifest.write_text(whole[: len(whole) - len(whole.splitlines()[-1]) // 2 - 1])
    with pytest.raises(CacheError, match="not valid JSON"):
        lc.LatentCache.open(out)
    report = run_encode(encode_config(corpus / "train.jsonl", out), runtime=runtime)
    assert report.encoded == 0 and report.skipped == len(before) == report.manifest_clips
    assert _stamps(out) == before  # no clip re-encoded or rewritten
    assert manifest.read_text() == whole and len(lc.LatentCache.open(out)) == len(before)
    assert any("rebuilt" in note for note in report.notes)


def test_progress_ends_with_every_clip_counted(
    corpus: Path, tmp_path: Path, runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bar's last line counts every input and every clip: the clip still in flight when the last
    input was handed over is written (and counted) before the bar reaches its total."""
    report = run_encode(encode_config(corpus / "train.jsonl", tmp_path / "c"), runtime=runtime)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("encoding:")]
    assert report.encoded == 4 and lines, lines
    assert re.match(r"encoding: 4/4 \(.*\) clips=4 ", lines[-1]) and len(lines) == 1, lines


_ORPHAN_SCRIPT = """
import sys, time
import pfctl.data.decoding as decoding

def slow_decode(item, settings, skip):
    time.sleep(120)  # a worker busy in a long decode never looks at its parent
    return item

decoding.decode_item = slow_decode
for _ in decoding.decoded_items([(i, frozenset()) for i in range(4)], None, num_workers=2, prefetch=1):
    pass
"""


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_and_expect_gone(proc: subprocess.Popen, workers: list[int], within: float) -> None:
    """SIGKILL the parent ``proc``; each of its decode ``workers`` must be gone within ``within`` seconds."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + within
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if _alive(w)]


def _reap(proc: subprocess.Popen, workers: list[int]) -> None:
    """Whatever the test's outcome, leave no process of it behind."""
    proc.kill()
    for w in workers:
        if _alive(w):
            os.kill(w, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux")
def test_decode_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    """kill -9 of the process that started the decode workers: the workers (here busy in a long decode)
    are gone within seconds instead of holding their memory for good."""
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], env=_env(), start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers := _children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(workers) == 2, "the decode workers did not start"
        time.sleep(1.0)  # both are inside their decode now
        _kill_and_expect_gone(proc, workers, within=5)
    finally:
        _reap(proc, workers)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux")
def test_kill_9_of_encode_latents_leaves_no_decode_worker(corpus: Path, tmp_path: Path) -> None:
    """The whole command: kill -9 of encode-latents while its 2 decode workers run; they are gone
    within seconds."""
    ann, out = _many_clips(corpus, tmp_path, 4), tmp_path / "cache"
    proc = subprocess.Popen(
        _cli(*_cli_args(ann, out, workers=2)), env=_env(PFCTL_FAULT="encode_written:action=sleep:seconds=1.0"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers := _children(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert len(workers) == 2, "the decode workers did not start"
        _kill_and_expect_gone(proc, workers, within=3)
    finally:
        _reap(proc, workers)
