"""The parts of encode-latents' pipeline on their own: the writer thread, the caption cache, the number
of decode workers and the settings that size them."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pfctl.config.load import load_config
from pfctl.data.decoding import AUTO_WORKERS_MAX, resolve_workers
from pfctl.data.encode_batch import CaptionCache
from pfctl.data.encode_writer import AsyncWriter
from pfctl.errors import ConfigError


def test_writer_handles_jobs_in_order_and_drains_on_close() -> None:
    done: list[int] = []

    def handle(job: int) -> None:
        time.sleep(0.01)
        done.append(job)

    writer = AsyncWriter(handle, depth=2)
    for job in range(6):
        writer.put(job)  # waits while two jobs are queued
    writer.close()
    assert done == list(range(6)) and writer.busy_seconds > 0
    assert "pfctl-write" not in {t.name for t in threading.enumerate()}


def test_writer_error_stops_the_writing_and_is_raised_once() -> None:
    done: list[int] = []
    release = threading.Event()

    def handle(job: int) -> None:
        release.wait(5)
        if job == 1:
            raise OSError(28, "No space left on device")
        done.append(job)

    writer = AsyncWriter(handle, depth=4)
    for job in range(4):
        writer.put(job)
    release.set()
    with pytest.raises(OSError, match="No space"):
        writer.close()
    assert done == [0]  # nothing is written after the error
    writer.close()  # raised once: a second close (a caller's finally) does not raise it again

    writer = AsyncWriter(handle, depth=1)
    writer.put(1)
    deadline = time.monotonic() + 5
    while writer._thread.is_alive() and writer._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError):
        writer.put(2)  # the next put raises it
    writer.close()


class _FakeTextEncoder:
    """Counts calls; a caption containing "bad" fails (alone or in a batch)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def encode(self, prompts: list[str]) -> SimpleNamespace:
        self.calls.append(list(prompts))
        if any("bad" in p for p in prompts):
            raise ValueError("cannot tokenize")
        codes = torch.tensor([[float(len(p)), float(ord(p[0]) if p else 0)] for p in prompts])
        return SimpleNamespace(
            prompt_embeds=codes[:, None, :].repeat(1, 3, 1),
            prompt_attention_mask=torch.ones(len(prompts), 3, dtype=torch.int64),
            pooled_prompt_embeds=codes,
        )


def test_caption_cache_encodes_each_caption_once_in_one_call() -> None:
    encoder = _FakeTextEncoder()
    cache = CaptionCache(encoder, size=2)
    got = cache.lookup(["a cat", "a dog", "a cat"])
    assert encoder.calls == [["a cat", "a dog"]]
    assert torch.equal(got["a cat"]["pooled_prompt_embeds"], torch.tensor([5.0, 97.0]).to(torch.bfloat16))
    cache.lookup(["a dog", "a cat"])
    assert len(encoder.calls) == 1  # both held
    cache.lookup(["an owl"])  # the least recently used ("a dog") leaves
    assert list(cache.rows) == ["a cat", "an owl"]
    cache.lookup(["a dog"])
    assert encoder.calls[-1] == ["a dog"]


def test_caption_cache_isolates_a_failing_caption() -> None:
    encoder = _FakeTextEncoder()
    cache = CaptionCache(encoder)
    got = cache.lookup(["a cat", "a bad one", "a dog"])
    assert got["a bad one"] == "text: cannot tokenize" and "a bad one" not in cache.rows
    assert isinstance(got["a cat"], dict) and isinstance(got["a dog"], dict)
    assert encoder.calls == [["a cat", "a bad one", "a dog"], ["a cat"], ["a bad one"], ["a dog"]]


def test_auto_workers_follow_the_cores_and_the_processes_per_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert resolve_workers("auto") == AUTO_WORKERS_MAX == 8
    assert resolve_workers("auto", processes_here=8) == 4
    assert resolve_workers(3) == 3 and resolve_workers(0) == 0
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert resolve_workers("auto", processes_here=4) == 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("encode.num_workers", -1, "must be 'auto' or a whole number 0..256"),
        ("encode.num_workers", "many", "must be 'auto' or a whole number"),
        ("encode.num_workers", 2.5, "must be 'auto' or a whole number"),
        ("encode.batch_size", 0, "greater than or equal to 1"),
        ("encode.batch_size", 65, "less than or equal to 64"),
    ],
)
def test_bad_pipeline_settings_name_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [], {key: value})
    assert key in str(info.value) and info.value.exit_code == 2


def test_pipeline_defaults() -> None:
    encode = load_config(None, [], {}).encode
    assert encode.num_workers == "auto" and encode.batch_size == 1
    assert load_config(None, ["encode.num_workers=3", "encode.batch_size=2"], {}).encode.num_workers == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused Triton norms run on CUDA only")
@pytest.mark.parametrize("chunking", ["none", "framewise"])
def test_batched_causal_vae_encode_on_cuda_equals_one_clip_per_call(chunking: str) -> None:
    """The encode-latents path on CUDA (fused per-frame norms, channels-last, chunk cache): a batch of 3
    different clips gives each clip's one-call latents (fp32, TF32 off: only the summation order of
    another batch composition differs)."""
    from pfctl.models.fast import FastPaths, apply_fast_paths
    from pfctl.models.vae import PyramidCausalVAE, build_tiny_causal_vae

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        model = build_tiny_causal_vae().cuda()
        apply_fast_paths(model, FastPaths())
        with torch.no_grad():  # non-zero biases: a bias folded into the wrong sample shows
            for p in model.parameters():
                if p.ndim == 1:
                    p.normal_(0.0, 0.1)
        vae = PyramidCausalVAE(model)
        video = torch.rand(3, 3, 17, 32, 48, generator=torch.Generator().manual_seed(0)).cuda() * 2 - 1
        video[1] *= 0.3  # other statistics per sample
        batched = vae.encode(video, chunking=chunking, chunk_frames=8)
        for i in range(3):
            one = vae.encode(video[i : i + 1], chunking=chunking, chunk_frames=8)
            torch.testing.assert_close(batched.mean[i : i + 1], one.mean, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(batched.std[i : i + 1], one.std, rtol=1e-4, atol=1e-4)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
