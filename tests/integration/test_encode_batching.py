"""encode-latents' throughput parts on real H.264 files with the tiny causal VAE: clips batched by shape
per VAE call, each caption encoded once, clip files written by a background thread."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers.caches import assert_same_cache, encode_config
from helpers.tolerance import rounding_rtol
from pfctl.data import latent_cache as lc
from pfctl.data.encode import run_encode
from pfctl.data.synthetic import index_frames, moving_frames, write_video
from pfctl.errors import CheckFailed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five landscape clips (32x24), two portrait (24x32) and an image, in mixed order; three captions."""
    from PIL import Image

    root = tmp_path_factory.mktemp("batch-corpus")
    write_video(root / "a.mp4", moving_frames(30, 64, 64), fps=24)
    write_video(root / "b.mp4", index_frames(30, 48, 64), fps=24)
    write_video(root / "p.mp4", moving_frames(30, 64, 48, seed=1), fps=24)
    Image.fromarray(torch.full((40, 60, 3), 90, dtype=torch.uint8).numpy()).save(root / "c.png")
    sources = ["a.mp4", "p.mp4", "b.mp4", "a.mp4", "c.png", "b.mp4", "p.mp4", "a.mp4"]
    captions = ["a red square", "a portrait", "a gray ramp", "a red square", "a gray ramp", "a gray ramp"]
    captions += ["a portrait", "a red square"]
    rows = [
        {("image" if s.endswith(".png") else "video"): s, "text": t, "id": f"{Path(s).stem}-{k}"}
        for k, (s, t) in enumerate(zip(sources, captions, strict=True))
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _config(corpus: Path, out: Path, **encode):
    return encode_config(corpus / "train.jsonl", out, **encode)


def _spy_vae(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(batch size, thread name) of every VAE encode call."""
    from pfctl.models.vae import PyramidCausalVAE

    calls: list[tuple[int, str]] = []
    encode = PyramidCausalVAE.encode

    def spy(self, video, **kwargs):
        calls.append((video.shape[0], threading.current_thread().name))
        return encode(self, video, **kwargs)

    monkeypatch.setattr(PyramidCausalVAE, "encode", spy)
    return calls


def test_batched_encode_equals_one_clip_per_call(
    corpus: Path, tmp_path: Path, runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 2 and 3 (the last batch of each shape ragged) give the cache of one clip per call; the
    VAE gets whole batches of one shape, on the encoding thread, the writer writes on its own thread."""
    calls = _spy_vae(monkeypatch)
    one = run_encode(_config(corpus, tmp_path / "b1", batch_size=1), runtime=runtime)
    assert one.encoded == 8 and one.batch_size == 1
    assert sorted(n for n, _ in calls) == [1] * 8
    for size, expected in [(2, [1, 1, 2, 2, 2]), (3, [1, 2, 2, 3])]:
        calls.clear()
        report = run_encode(_config(corpus, tmp_path / f"b{size}", batch_size=size), runtime=runtime)
        # 5 landscape clips, 2 portrait, 1 image: batches of `size` per shape, the rest at the end
        assert report.encoded == 8 and sorted(n for n, _ in calls) == expected, calls
        assert {name for _, name in calls} == {threading.current_thread().name}
        assert_same_cache(tmp_path / f"b{size}", tmp_path / "b1")


def test_sample_store_is_seeded_per_clip_whatever_the_batch(corpus: Path, tmp_path: Path, runtime) -> None:
    """``store: sample`` draws each clip's noise from a generator seeded by its id, so a batched encode
    stores the samples of one clip per call."""
    run_encode(_config(corpus, tmp_path / "s1", batch_size=1, store="sample"), runtime=runtime)
    run_encode(_config(corpus, tmp_path / "s3", batch_size=3, store="sample"), runtime=runtime)
    assert_same_cache(tmp_path / "s3", tmp_path / "s1")


def test_each_caption_is_encoded_once(
    corpus: Path, text_folder: Path, tmp_path: Path, runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight clips, three captions: the text encoder sees each caption once (and the empty prompt once);
    clips of one caption store the same features, equal to the caption encoded alone."""
    from pfctl.models import text_encoder as te

    prompts: list[list[str]] = []
    encode = te._EncoderBase.encode

    def spy(self, batch, **kwargs):
        prompts.append(list(batch))
        return encode(self, batch, **kwargs)

    monkeypatch.setattr(te._EncoderBase, "encode", spy)
    config = _config(corpus, tmp_path / "c", batch_size=2, text=True, text_encoder=str(text_folder))
    report = run_encode(config, runtime=runtime)
    assert report.encoded == 8
    seen = [p for batch in prompts for p in batch]
    assert sorted(seen) == ["", "a gray ramp", "a portrait", "a red square"], prompts
    cache = lc.LatentCache.open(tmp_path / "c")
    alone = te.load_text_encoder(text_folder, model_name="pyramid_flux", dtype=torch.float32, device="cpu")
    by_caption: dict[str, dict[str, torch.Tensor]] = {}
    for clip_id in cache.ids():
        tensors = cache.load(clip_id)
        text = cache.metadata(clip_id)["text"]
        first = by_caption.setdefault(text, tensors)
        for key in lc.TEXT_KEYS:
            assert torch.equal(tensors[key], first[key]), (clip_id, key)
    for text, tensors in by_caption.items():
        want = alone.encode([text])
        assert torch.equal(tensors["prompt_attention_mask"], want.prompt_attention_mask[0])
        for key in ("prompt_embeds", "pooled_prompt_embeds"):  # another batch: rounding, then bf16
            expected = getattr(want, key)[0]
            torch.testing.assert_close(
                tensors[key].float(),
                expected,
                rtol=2**-8,
                atol=rounding_rtol(32, 8) * float(expected.abs().max()),
            )


def test_a_batch_that_fails_is_split(
    corpus: Path, tmp_path: Path, runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched call out of memory is split in halves and the smaller size kept; every clip is still
    encoded, and the run says so. A batch that fails otherwise is encoded clip by clip (the batch size
    kept); a clip that fails alone is a failure row."""
    from pfctl.models.vae import PyramidCausalVAE

    encode = PyramidCausalVAE.encode

    def small_device(self, video, **kwargs):
        if video.shape[0] > 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return encode(self, video, **kwargs)

    monkeypatch.setattr(PyramidCausalVAE, "encode", small_device)
    report = run_encode(_config(corpus, tmp_path / "c", batch_size=4), runtime=runtime)
    assert report.encoded == 8 and report.failed == 0 and report.batch_size == 1
    assert any("batch size 2" in n for n in report.notes) and any("batch size 1" in n for n in report.notes)
    assert_same_cache(tmp_path / "c", _reference(corpus, tmp_path, runtime))

    def broken(self, video, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(PyramidCausalVAE, "encode", broken)
    config = _config(corpus, tmp_path / "f", batch_size=2)
    with pytest.raises(CheckFailed, match="nothing was encoded") as info:
        run_encode(config, runtime=runtime)
    assert {f["reason"] for f in info.value.report.failures} == {"encode_error"}
    assert len(info.value.report.failures) == 8 and info.value.report.batch_size == 2


def _reference(corpus: Path, tmp_path: Path, runtime) -> Path:
    out = tmp_path / "reference"
    if not out.is_dir():
        run_encode(_config(corpus, out, batch_size=1), runtime=runtime)
    return out


def test_queued_clips_are_written_when_the_run_stops(
    corpus: Path, tmp_path: Path, runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error in the encoding thread while the writer is behind: every clip already encoded is still
    written (the queue drains) and listed in the rank's part, nothing is half written, and the rerun
    encodes only the rest and gives the cache of an undisturbed run."""
    from pfctl.data.encode_batch import BatchEncoder

    write, add = lc.LatentCacheWriter.write, BatchEncoder.add
    encoded_before_error: list[int] = []

    def slow_write(self, clip_id, tensors, metadata):
        time.sleep(0.3)
        return write(self, clip_id, tensors, metadata)

    def failing_add(self, decoded, key):
        if key == 6:
            encoded_before_error.append(sum(len(b) for b in self.groups.values()))
            raise KeyboardInterrupt
        return add(self, decoded, key)

    monkeypatch.setattr(lc.LatentCacheWriter, "write", slow_write)
    monkeypatch.setattr(BatchEncoder, "add", failing_add)
    out = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        run_encode(_config(corpus, out, batch_size=2), runtime=runtime)
    # inputs 0..5: two batches of two landscape clips went to the VAE; a portrait clip and the image
    # still waited for a partner of their shape (never encoded)
    files = list(out.glob("clips/*/*.safetensors"))
    assert len(files) == 6 - encoded_before_error[0] == 4 and not list(out.rglob(".*.tmp"))
    part = json.loads((out / lc.PARTS_DIR / "stats.rank00000.json").read_text())
    assert part["encoded"] == 4 and part["aborted"] == "KeyboardInterrupt: "
    monkeypatch.setattr(BatchEncoder, "add", add)
    stamps = {p: p.stat().st_mtime_ns for p in files}
    report = run_encode(_config(corpus, out, batch_size=2), runtime=runtime)
    assert (report.encoded, report.skipped, report.manifest_clips) == (4, 4, 8)
    assert {p: p.stat().st_mtime_ns for p in files} == stamps
    assert_same_cache(out, _reference(corpus, tmp_path, runtime))
