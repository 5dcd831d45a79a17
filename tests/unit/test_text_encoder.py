"""Text conditioning on the tiny offline CLIP+T5 folder (official layout, no downloads)."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import make_text_encoder_folder
from helpers.tolerance import assert_rounding_close
from pfctl.errors import InputError, ModelLoadError
from pfctl.models.text_encoder import (
    CLIP_MAX_LENGTH,
    T5_MAX_LENGTH,
    TINY_CLIP_DIM,
    TINY_T5_DIM,
    FluxTextEncoder,
    SD3TextEncoder,
    TextEmbeddings,
    build_tiny_text_encoder_folder,
    load_text_encoder,
)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    return make_text_encoder_folder(tmp_path_factory.mktemp("flux-text"), seed=0)


@pytest.fixture(scope="module")
def encoder(flux_folder):
    return FluxTextEncoder.from_folder(flux_folder)


def test_folder_has_official_layout(flux_folder):
    for name in ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"):
        assert (flux_folder / name).is_dir()
    t5 = flux_folder / "text_encoder_2"
    assert (t5 / "model.safetensors.index.json").is_file()  # sharded like the real T5-XXL
    assert len(list(t5.glob("model-*-of-*.safetensors"))) > 1


def test_encode_shapes_mask_and_padding(encoder):
    prompts = ["a red circle moves to the right", "", "Zebra? 42 wobbling ünïcode!"]
    emb = encoder.encode(prompts)
    assert emb.prompt_embeds.shape == (3, T5_MAX_LENGTH, TINY_T5_DIM)
    assert emb.prompt_attention_mask.shape == (3, T5_MAX_LENGTH)
    assert emb.prompt_attention_mask.dtype == torch.int64
    assert emb.pooled_prompt_embeds.shape == (3, TINY_CLIP_DIM)
    mask = emb.prompt_attention_mask
    # the mask is a prefix of ones (real tokens + </s>), then padding zeros
    lengths = mask.sum(1)
    for row, n in zip(mask, lengths.tolist(), strict=True):
        assert row[:n].eq(1).all() and row[n:].eq(0).all()
    assert lengths[1] == 1  # the empty prompt is just </s>
    assert lengths[0] > 1 and lengths[2] > lengths[0] - 4
    assert encoder.clip_max_length == CLIP_MAX_LENGTH
    assert not any(p.requires_grad for p in encoder.parameters())


def test_reference_tokenisation_settings(encoder):
    """T5 pads to 128 with truncation; CLIP is cut at 77 tokens (an over-long prompt still encodes)."""
    long_prompt = " ".join(["circle"] * 300)
    emb = encoder.encode([long_prompt])
    assert emb.prompt_attention_mask.sum() == T5_MAX_LENGTH
    clip_ids = encoder.tokenizer(
        [long_prompt], padding="max_length", max_length=encoder.clip_max_length, truncation=True
    ).input_ids
    assert len(clip_ids[0]) == CLIP_MAX_LENGTH


def _assert_same_embeddings(got: TextEmbeddings, want: TextEmbeddings) -> None:
    """Up to rounding (helpers.tolerance): another batch composition or weights loaded from disk may run other
    kernels. The tiny encoders' sums: at most 128 terms (T5's 128 tokens), about 16 chained."""
    assert torch.equal(got.prompt_attention_mask, want.prompt_attention_mask)
    assert_rounding_close(got.prompt_embeds, want.prompt_embeds, reduction=128, depth=16)
    assert_rounding_close(got.pooled_prompt_embeds, want.pooled_prompt_embeds, reduction=128, depth=16)


def test_batch_independent_and_chunked(encoder):
    prompts = ["a blue square", "two white dots", "camera pans"]
    full = encoder.encode(prompts)
    chunked = encoder.encode(prompts, batch_size=2)
    one = encoder.encode(prompts[1])
    _assert_same_embeddings(chunked, full)
    _assert_same_embeddings(one, full[1])


def test_empty_embedding_cached_and_equal_to_encode(encoder):
    null = encoder.empty_embedding()
    assert null is encoder.empty_embedding()
    assert len(null) == 1
    assert null.allclose(encoder.encode([""]), atol=0)


def test_bad_prompts(encoder):
    with pytest.raises(InputError, match="item 1"):
        encoder.encode(["ok", None])  # type: ignore[list-item]
    with pytest.raises(InputError, match="no prompts"):
        encoder.encode([])


def test_same_seed_same_weights_and_fingerprint(tmp_path, encoder):
    again = FluxTextEncoder.from_folder(build_tiny_text_encoder_folder(tmp_path / "a", seed=0))
    other = FluxTextEncoder.from_folder(build_tiny_text_encoder_folder(tmp_path / "b", seed=1))
    prompt = ["a yellow ball rolls"]
    _assert_same_embeddings(again.encode(prompt), encoder.encode(prompt))
    assert not other.encode(prompt).allclose(encoder.encode(prompt))
    assert again.fingerprint() == encoder.fingerprint()
    assert other.fingerprint() != encoder.fingerprint()


def test_dtype_and_to(flux_folder):
    enc = FluxTextEncoder.from_folder(flux_folder, dtype=torch.bfloat16)
    emb = enc.encode(["a red circle"])
    assert emb.prompt_embeds.dtype == torch.bfloat16 and emb.pooled_prompt_embeds.dtype == torch.bfloat16
    assert emb.prompt_attention_mask.dtype == torch.int64
    enc.empty_embedding()
    enc.to(dtype=torch.float32)
    assert enc.empty_embedding().prompt_embeds.dtype == torch.float32


def test_missing_subfolder_is_named(tmp_path, flux_folder):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(flux_folder, broken)
    shutil.rmtree(broken / "tokenizer_2")
    with pytest.raises(ModelLoadError, match="tokenizer_2/"):
        FluxTextEncoder.from_folder(broken)


def test_mismatched_weights_are_an_error(tmp_path, flux_folder):
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(flux_folder, broken)
    cfg_path = broken / "text_encoder" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="text_encoder"):
        FluxTextEncoder.from_folder(broken)


def test_text_embeddings_helpers():
    a = TextEmbeddings(torch.randn(2, 5, 3), torch.ones(2, 5, dtype=torch.int32), torch.randn(2, 4))
    assert a.prompt_attention_mask.dtype == torch.int64
    b = a[1]
    assert len(b) == 1 and torch.equal(b.prompt_embeds[0], a.prompt_embeds[1])
    c = TextEmbeddings.cat([a, b])
    assert len(c) == 3
    assert len(a[[0, 0, 1]]) == 3
    d = a.to(dtype=torch.float64)
    assert d.prompt_embeds.dtype == torch.float64 and d.prompt_attention_mask.dtype == torch.int64
    r = b.expand(4)
    assert len(r) == 4 and torch.equal(r.pooled_prompt_embeds[3], b.pooled_prompt_embeds[0])
    back = TextEmbeddings.from_dict({k: v[0] for k, v in a.as_dict().items()}, batched=False)
    assert back.allclose(a[0], atol=0)
    with pytest.raises(InputError, match="disagree"):
        TextEmbeddings(torch.randn(2, 5, 3), torch.ones(3, 5), torch.randn(2, 4))
    with pytest.raises(InputError, match="token lengths"):
        TextEmbeddings.cat([a, TextEmbeddings(torch.randn(1, 6, 3), torch.ones(1, 6), torch.randn(1, 4))])
    with pytest.raises(InputError, match="missing"):
        TextEmbeddings.from_dict({"prompt_embeds": a.prompt_embeds})
    with pytest.raises(IndexError):
        a[2]


def test_sd3_text_encoder(tmp_path):
    root = make_text_encoder_folder(tmp_path, kind="pyramid_mmdit")
    enc = load_text_encoder(root, model_name="pyramid_mmdit")
    assert isinstance(enc, SD3TextEncoder)
    emb = enc.encode(["a green triangle", ""])
    assert emb.prompt_embeds.shape == (2, T5_MAX_LENGTH, TINY_T5_DIM)
    assert emb.pooled_prompt_embeds.shape == (2, 2 * TINY_CLIP_DIM)
    assert enc.pooled_dim == 2 * TINY_CLIP_DIM
    _assert_same_embeddings(enc.empty_embedding(), emb[1])


def test_unknown_model_name(flux_folder):
    with pytest.raises(ModelLoadError, match="pyramid_flux"):
        load_text_encoder(flux_folder, model_name="sdxl")
