"""Text conditioning: prompts -> (T5 token features, T5 mask, CLIP pooled vector).

Pyramid Flow conditions its DiT on two frozen encoders that live in the checkpoint folder:

* miniFLUX (``pyramid_flux``): CLIP-L (``tokenizer/``, ``text_encoder/``; its ``pooler_output``
  is the pooled vector, 768-d) and T5-XXL (``tokenizer_2/``, ``text_encoder_2/``; last hidden
  state, 4096-d, padded to 128 tokens).
* SD3 MMDiT (``pyramid_mmdit``): CLIP-L and CLIP-G *with projection* (their projected
  ``text_embeds`` concatenated -> 2048-d pooled vector) and T5 in ``tokenizer_3/``,
  ``text_encoder_3/``.

Tokenisation follows the reference exactly (``padding="max_length"``, ``truncation=True``;
CLIP at the CLIP tokenizer's ``model_max_length`` (77), T5 at 128), because the DiT was trained
on those features: a different padding length changes the attention mask the DiT sees.

Everything loads from local folders only (``local_files_only=True``); nothing is downloaded.

The empty prompt's embedding ("null text", used for classifier-free guidance and caption
dropout) is computed once per encoder and cached: the reference never defines it for training
from cached features (its issues #181/#257), and computing it on the fly at every step wastes a
T5 forward.

``build_tiny_text_encoder_folder`` writes a few-kilobyte CLIP+T5 pair with tokenizers built
offline, in the official folder layout, so tests and the embedded demo exercise the same
``from_folder`` path as a real checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import string
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from pfctl.errors import InputError, ModelLoadError
from pfctl.models.text_embeddings import TextEmbeddings

T5_MAX_LENGTH = 128
"""T5 sequence length of Pyramid Flow (the DiT's text token count)."""
CLIP_MAX_LENGTH = 77
"""CLIP context length (CLIP tokenizers declare it as ``model_max_length``)."""

TINY_T5_DIM = 32
"""``d_model`` of the tiny T5: the ``joint_attention_dim`` of DiT presets meant to pair with it."""
TINY_CLIP_DIM = 24
"""Hidden size of the tiny CLIP: the ``pooled_projection_dim`` of DiT presets meant to pair with it."""

DEFAULT_TINY_CORPUS: tuple[str, ...] = (
    "a red circle moves to the right",
    "a blue square moves to the left",
    "a green triangle bounces up and down",
    "a yellow ball rolls across the floor",
    "an orange star spins slowly in the dark",
    "a purple ring grows and shrinks",
    "two white dots orbit each other on a black background",
    "a small cyan box falls from the top",
    "the big pink shape fades in and out",
    "a gray line sweeps over the scene",
    "camera pans over simple shapes",
    "empty scene with a plain background",
)
"""Words the tiny tokenizers know as whole tokens (the shapes demo's captions); others split to chars."""

FLUX_SUBFOLDERS = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
SD3_SUBFOLDERS = (
    "tokenizer",
    "text_encoder",
    "tokenizer_2",
    "text_encoder_2",
    "tokenizer_3",
    "text_encoder_3",
)


# --------------------------------------------------------------------------------------------
# Loading helpers
# --------------------------------------------------------------------------------------------


@contextmanager
def _quiet_transformers():
    """Silence transformers' progress bars and info logs while loading frozen parts."""
    from transformers.utils import logging as tlog

    was_enabled = tlog.is_progress_bar_enabled()
    old_level = tlog.get_verbosity()
    tlog.disable_progress_bar()
    tlog.set_verbosity_error()
    try:
        yield
    finally:
        tlog.set_verbosity(old_level)
        if was_enabled:
            tlog.enable_progress_bar()


def _require_subfolders(root: Path, names: Sequence[str], what: str) -> None:
    if not root.is_dir():
        raise ModelLoadError(
            f"text encoder folder {root} does not exist",
            hint="pass a Pyramid Flow checkpoint folder (it holds tokenizer/, text_encoder/, ...)",
        )
    missing = [n for n in names if not (root / n).is_dir()]
    if missing:
        raise ModelLoadError(
            f"{root} lacks {', '.join(m + '/' for m in missing)} needed by the {what} text encoder "
            f"(expected subfolders: {', '.join(n + '/' for n in names)})",
            hint="download the full checkpoint folder, or set model.path to a folder that has the text encoders",
        )


def _load_tokenizer(folder: Path, fallback_cls: type) -> Any:
    """AutoTokenizer first (honours the folder's declared class), else the reference's class."""
    from transformers import AutoTokenizer

    errors = []
    with _quiet_transformers():
        for loader in (AutoTokenizer, fallback_cls):
            try:
                return loader.from_pretrained(str(folder), local_files_only=True)
            except Exception as exc:
                errors.append(f"{getattr(loader, '__name__', loader)}: {exc}")
    raise ModelLoadError(
        f"cannot load the tokenizer in {folder}: " + " | ".join(errors),
        hint="the folder needs tokenizer.json (or vocab.json+merges.txt for CLIP, spiece.model for T5)",
    )


def _dtype_kwarg() -> str:
    """transformers renamed ``torch_dtype`` to ``dtype`` in 4.56; accept both generations."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _load_model(folder: Path, cls: type, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """``cls.from_pretrained`` from a local folder; missing or mis-shaped weights are errors."""
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"{folder} has no config.json (expected a transformers {cls.__name__} folder)",
            hint="the folder should hold config.json and model*.safetensors (sharded with an index is fine)",
        )
    try:
        with _quiet_transformers():
            model, info = cls.from_pretrained(
                str(folder), local_files_only=True, output_loading_info=True, **{_dtype_kwarg(): dtype}
            )
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load {cls.__name__} from {folder}: {exc}",
            hint="check that the weight files are complete (sizes match the index) and the config matches",
        ) from exc
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(m) for m in (info.get("mismatched_keys") or []))
    if missing or mismatched:
        raise ModelLoadError(
            f"{cls.__name__} weights in {folder} do not match its config.json: "
            f"missing keys {missing[:8]}{'...' if len(missing) > 8 else ''}, mismatched {mismatched[:8]}",
            hint="the weight files belong to another model size; re-download the folder",
        )
    model.requires_grad_(False)
    model.eval()
    return model.to(device)


def _module_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _check_prompts(prompts: str | Sequence[str]) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise InputError(
            f"prompts must be strings; item {bad[0]} is {type(prompts[bad[0]]).__name__}",
            hint="use '' for an empty prompt, never None",
        )
    return prompts


def _folder_fingerprint(root: Path, subfolders: Sequence[str], extra: dict[str, Any]) -> str:
    from pfctl.models.weights import folder_digest
    from pfctl.utils.io import fingerprint

    return fingerprint({**extra, "folders": {s: folder_digest(root / s) for s in subfolders}})


# --------------------------------------------------------------------------------------------
# Encoders
# --------------------------------------------------------------------------------------------


_Encoder = TypeVar("_Encoder", bound="_EncoderBase")


@dataclass(eq=False, repr=False)
class _EncoderBase:
    """Shared plumbing of the CLIP(s) + T5 encoders: loading from the official folder layout, CLIP and T5
    tokenisation, device/dtype moves, null-text cache, fingerprint, chunked encoding.

    A subclass names its parts once: ``subfolders`` (which are also its dataclass fields, tokenizers and
    models alternating) and ``part_classes`` (the transformers class of each, in the same order).
    """

    max_sequence_length: int = T5_MAX_LENGTH
    source: Path | None = None
    # keyword-only, so the subclasses' positional order (their parts) is unchanged
    clip_max_length: int | None = field(default=None, kw_only=True)
    _null: TextEmbeddings | None = field(default=None, init=False, repr=False)
    _fingerprint: str | None = field(default=None, init=False, repr=False)

    name = "text-encoder"
    description = "text encoder"
    subfolders: ClassVar[tuple[str, ...]] = ()
    part_classes: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if any(getattr(self, part) is None for part in self.subfolders):
            *rest, last = self.subfolders
            raise ModelLoadError(f"{type(self).__name__} needs {', '.join(rest)} and {last}")
        if self.clip_max_length is None:
            # the reference pads every CLIP to the first CLIP tokenizer's length
            self.clip_max_length = _clip_max_length(self.tokenizer, self.text_encoder)

    @classmethod
    def from_folder(
        cls: type[_Encoder],
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_sequence_length: int = T5_MAX_LENGTH,
    ) -> _Encoder:
        """Load from a checkpoint folder holding the class's ``subfolders`` (official layout)."""
        import transformers

        root = Path(path)
        _require_subfolders(root, cls.subfolders, cls.description)
        parts = {}
        for sub, class_name in zip(cls.subfolders, cls.part_classes, strict=True):
            part_cls = getattr(transformers, class_name)
            if sub.startswith("tokenizer"):
                parts[sub] = _load_tokenizer(root / sub, part_cls)
            else:
                parts[sub] = _load_model(root / sub, part_cls, dtype, device)
        return cls(max_sequence_length=max_sequence_length, source=root, **parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(source={str(self.source)!r}, max_sequence_length={self.max_sequence_length})"

    def _modules(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def _encode_batch(self, prompts: list[str]) -> TextEmbeddings:
        raise NotImplementedError

    @property
    def t5(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return _module_device(self.t5)

    @property
    def dtype(self) -> torch.dtype:
        return _module_dtype(self.t5)

    @property
    def joint_attention_dim(self) -> int:
        """Token feature size (the DiT's ``joint_attention_dim``)."""
        return int(self.t5.config.d_model)

    @property
    def pooled_dim(self) -> int:
        raise NotImplementedError

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> _EncoderBase:
        """Move the frozen encoders (in place, like ``nn.Module.to``); the null cache moves too."""
        for m in self._modules():
            m.to(device=device, dtype=dtype)
        if self._null is not None:
            self._null = self._null.to(device=device, dtype=dtype)
        return self

    def modules(self) -> list[torch.nn.Module]:
        """The encoder models (CLIP(s) and T5), e.g. to move them part by part."""
        return self._modules()

    def parameters(self):
        for m in self._modules():
            yield from m.parameters()

    @torch.no_grad()
    def encode(self, prompts: str | Sequence[str], *, batch_size: int | None = None) -> TextEmbeddings:
        """Encode prompts on the encoder's device; ``batch_size`` bounds memory for long lists."""
        prompts = _check_prompts(prompts)
        if not prompts:
            raise InputError("no prompts to encode", hint="pass at least one prompt ('' for the null text)")
        if batch_size is None or batch_size >= len(prompts):
            return self._encode_batch(prompts)
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        return TextEmbeddings.cat(
            [self._encode_batch(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]
        )

    def __call__(self, prompts: str | Sequence[str]) -> TextEmbeddings:
        return self.encode(prompts)

    def empty_embedding(self) -> TextEmbeddings:
        """The null text (``encode([""])``), computed once and cached; batch size 1."""
        if self._null is None:
            self._null = self.encode([""])
        return self._null

    def fingerprint(self) -> str:
        """Hash of class, token lengths and the folder's configs/tokenizers/weights (cheap digest)."""
        if self._fingerprint is None:
            extra = {
                "class": type(self).__name__,
                "max_sequence_length": self.max_sequence_length,
                "clip_max_length": self.clip_max_length,
            }
            if self.source is not None:
                self._fingerprint = _folder_fingerprint(self.source, self.subfolders, extra)
            else:
                from pfctl.utils.io import fingerprint, tensor_fingerprint

                states = {
                    f"{i}.{k}": v for i, m in enumerate(self._modules()) for k, v in m.state_dict().items()
                }
                self._fingerprint = fingerprint({**extra, "weights": tensor_fingerprint(states)})
        return self._fingerprint

    def _clip_input_ids(self, tokenizer: Any, model: torch.nn.Module, prompts: list[str]) -> torch.Tensor:
        """CLIP token ids padded/truncated to ``clip_max_length`` (as the reference), on ``model``'s device."""
        tok = tokenizer(
            prompts,
            padding="max_length",
            max_length=self.clip_max_length,
            truncation=True,
            return_tensors="pt",
        )
        return tok.input_ids.to(_module_device(model))

    def _t5_embeds(self, tokenizer: Any, model: torch.nn.Module, prompts: list[str]):
        device = _module_device(model)
        tok = tokenizer(
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        mask = tok.attention_mask.to(device=device, dtype=torch.int64)
        hidden = model(tok.input_ids.to(device), attention_mask=mask)[0]
        return hidden.to(dtype=_module_dtype(model)), mask


def _clip_max_length(tokenizer: Any, model: torch.nn.Module) -> int:
    """The tokenizer's ``model_max_length`` (77 for CLIP), capped by the model's positions.

    A tokenizer saved without the field reports a huge sentinel; the position table is then the
    real limit.
    """
    limit = int(model.config.max_position_embeddings)
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared <= limit:
        return declared
    return limit


@dataclass(eq=False, repr=False)
class FluxTextEncoder(_EncoderBase):
    """CLIP-L pooled + T5 features for the miniFLUX DiT (reference ``FluxTextEncoderWithMask``)."""

    tokenizer: Any = None
    text_encoder: torch.nn.Module | None = None
    tokenizer_2: Any = None
    text_encoder_2: torch.nn.Module | None = None

    name = "flux-clip-t5"
    description = "miniFLUX (CLIP-L + T5)"
    subfolders = FLUX_SUBFOLDERS
    part_classes = ("CLIPTokenizer", "CLIPTextModel", "T5TokenizerFast", "T5EncoderModel")

    def _modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder, self.text_encoder_2]

    @property
    def t5(self) -> torch.nn.Module:
        return self.text_encoder_2

    @property
    def pooled_dim(self) -> int:
        return int(self.text_encoder.config.hidden_size)

    def _encode_batch(self, prompts: list[str]) -> TextEmbeddings:
        clip = self.text_encoder
        ids = self._clip_input_ids(self.tokenizer, clip, prompts)
        pooled = clip(ids).pooler_output.to(dtype=_module_dtype(clip))
        embeds, mask = self._t5_embeds(self.tokenizer_2, self.text_encoder_2, prompts)
        return TextEmbeddings(embeds, mask, pooled.to(embeds.device))


@dataclass(eq=False, repr=False)
class SD3TextEncoder(_EncoderBase):
    """CLIP-L + CLIP-G projected pooled vectors + T5 features for the SD3 MMDiT variant."""

    tokenizer: Any = None
    text_encoder: torch.nn.Module | None = None
    tokenizer_2: Any = None
    text_encoder_2: torch.nn.Module | None = None
    tokenizer_3: Any = None
    text_encoder_3: torch.nn.Module | None = None

    name = "sd3-clip-l-g-t5"
    description = "SD3 (CLIP-L + CLIP-G + T5)"
    subfolders = SD3_SUBFOLDERS
    part_classes = (
        "CLIPTokenizer",
        "CLIPTextModelWithProjection",
        "CLIPTokenizer",
        "CLIPTextModelWithProjection",
        "T5TokenizerFast",
        "T5EncoderModel",
    )

    def _modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder, self.text_encoder_2, self.text_encoder_3]

    @property
    def t5(self) -> torch.nn.Module:
        return self.text_encoder_3

    @property
    def pooled_dim(self) -> int:
        return int(self.text_encoder.config.projection_dim + self.text_encoder_2.config.projection_dim)

    def _clip_pooled(self, tokenizer: Any, model: torch.nn.Module, prompts: list[str]) -> torch.Tensor:
        return model(self._clip_input_ids(tokenizer, model, prompts))[0]  # projected text_embeds [B, proj]

    def _encode_batch(self, prompts: list[str]) -> TextEmbeddings:
        pooled_l = self._clip_pooled(self.tokenizer, self.text_encoder, prompts)
        pooled_g = self._clip_pooled(self.tokenizer_2, self.text_encoder_2, prompts)
        embeds, mask = self._t5_embeds(self.tokenizer_3, self.text_encoder_3, prompts)
        pooled = torch.cat([pooled_l, pooled_g.to(pooled_l.device)], dim=-1)
        return TextEmbeddings(embeds, mask, pooled.to(embeds.device))


TextEncoder = FluxTextEncoder | SD3TextEncoder

TEXT_ENCODERS: dict[str, type[_EncoderBase]] = {
    "pyramid_flux": FluxTextEncoder,
    "pyramid_mmdit": SD3TextEncoder,
}


def load_text_encoder(
    path: str | os.PathLike[str],
    *,
    model_name: str = "pyramid_flux",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_sequence_length: int = T5_MAX_LENGTH,
) -> TextEncoder:
    """The text encoder that pairs with ``model_name``'s DiT, from a checkpoint folder."""
    cls = TEXT_ENCODERS.get(model_name)
    if cls is None:
        raise ModelLoadError(
            f"no text encoder for model name {model_name!r}",
            hint=f"supported: {', '.join(sorted(TEXT_ENCODERS))}",
        )
    return cls.from_folder(path, dtype=dtype, device=device, max_sequence_length=max_sequence_length)


def detect_text_encoder_kind(path: str | os.PathLike[str]) -> str | None:
    """``"pyramid_mmdit"`` if the folder has the SD3 triple, ``"pyramid_flux"`` for the pair, else None."""
    root = Path(path)
    if all((root / s).is_dir() for s in SD3_SUBFOLDERS):
        return "pyramid_mmdit"
    if all((root / s).is_dir() for s in FLUX_SUBFOLDERS):
        return "pyramid_flux"
    return None


# --------------------------------------------------------------------------------------------
# Tiny offline text encoders (tests, embedded demo)
# --------------------------------------------------------------------------------------------


def _corpus_words(corpus: Sequence[str]) -> list[str]:
    """Lower-case letter runs (how CLIP's pre-tokeniser splits words), sorted, unique."""
    return sorted({w for line in corpus for w in re.findall(r"[a-z]+", line.lower())})


def build_tiny_clip_tokenizer(corpus: Sequence[str] = DEFAULT_TINY_CORPUS) -> Any:
    """A CLIP byte-level BPE whose merges spell out each corpus word (deterministic, offline).

    Every byte symbol is in the vocabulary both plain and with the ``</w>`` end-of-word suffix,
    as in real CLIP, so any text tokenises without unknown tokens; each corpus word becomes one
    token through left-to-right merges. (The ``tokenizers`` BPE trainer breaks ties between
    equally frequent pairs differently from run to run, so it is not used.)
    """
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    vocab: dict[str, int] = {bos: 0, eos: 1}
    for sym in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(sym, len(vocab))
    for sym in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(sym + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for word in _corpus_words(corpus):
        if len(word) < 2:
            continue
        left = word[0]
        for i in range(1, len(word)):
            right = word[i] + ("</w>" if i == len(word) - 1 else "")
            pair = (left, right)
            left = left + right
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
                vocab.setdefault(left, len(vocab))
    return CLIPTokenizer(
        vocab=vocab, merges=merges, bos_token=bos, eos_token=eos, pad_token=eos, unk_token=eos,
        model_max_length=CLIP_MAX_LENGTH,
    )  # fmt: skip


def build_tiny_t5_tokenizer(corpus: Sequence[str] = DEFAULT_TINY_CORPUS) -> Any:
    """A T5 (Unigram, SentencePiece-style) tokenizer built from a hand-made vocabulary.

    Corpus words are single tokens; printable ASCII characters (with and without the word-start
    marker) cover everything else. Ids 0/1/2 are pad / eos / unk as in T5.
    """
    from transformers import T5TokenizerFast

    chars = [c for c in string.printable if not c.isspace()]
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -8.0) for c in chars] + [("▁" + c, -7.0) for c in chars]
    vocab += [("▁" + w, -3.0) for w in _corpus_words(corpus) if len(w) > 1]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def _tiny_clip(tokenizer: Any, hidden: int, *, with_projection: bool = False) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(cfg).eval()


def _tiny_t5(tokenizer: Any, d_model: int) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return T5EncoderModel(cfg).eval()


def build_tiny_text_encoder_folder(
    path: str | os.PathLike[str],
    seed: int = 0,
    vocab_corpus: Sequence[str] | None = None,
    *,
    kind: str = "pyramid_flux",
    t5_dim: int = TINY_T5_DIM,
    clip_dim: int = TINY_CLIP_DIM,
    shard_t5: bool = True,
) -> Path:
    """Write a tiny random-weight text encoder in the official layout under ``path``.

    ``kind="pyramid_flux"``: tokenizer/ text_encoder/ (CLIP, pooled dim ``clip_dim``)
    tokenizer_2/ text_encoder_2/ (T5, ``t5_dim``). ``kind="pyramid_mmdit"``: two projected CLIPs
    (pooled dim ``2*clip_dim``) and T5 in tokenizer_3/ text_encoder_3/. The T5 weights are
    sharded with an index like the official folder (``shard_t5``). Same seed -> same weights.
    Existing subfolders of the same names are replaced; other content of ``path`` is kept.
    The parts are written to a temporary sibling folder first and moved in at the end.
    """
    if kind not in TEXT_ENCODERS:
        raise InputError(f"unknown text encoder kind {kind!r}", hint=f"use one of {sorted(TEXT_ENCODERS)}")
    corpus = tuple(vocab_corpus) if vocab_corpus is not None else DEFAULT_TINY_CORPUS
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    clip_tok = build_tiny_clip_tokenizer(corpus)
    t5_tok = build_tiny_t5_tokenizer(corpus)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "pyramid_flux":
            parts = {
                "tokenizer": clip_tok,
                "text_encoder": _tiny_clip(clip_tok, clip_dim),
                "tokenizer_2": t5_tok,
                "text_encoder_2": _tiny_t5(t5_tok, t5_dim),
            }
            t5_name = "text_encoder_2"
        else:
            parts = {
                "tokenizer": clip_tok,
                "text_encoder": _tiny_clip(clip_tok, clip_dim, with_projection=True),
                "tokenizer_2": clip_tok,
                "text_encoder_2": _tiny_clip(clip_tok, clip_dim, with_projection=True),
                "tokenizer_3": t5_tok,
                "text_encoder_3": _tiny_t5(t5_tok, t5_dim),
            }
            t5_name = "text_encoder_3"

    staging = Path(tempfile.mkdtemp(prefix=".tiny-text-", dir=root))
    try:
        with _quiet_transformers():
            for name, obj in parts.items():
                kwargs: dict[str, Any] = {}
                if name == t5_name and shard_t5:
                    kwargs["max_shard_size"] = "40KB"  # several shards + index, like the real T5-XXL
                obj.save_pretrained(str(staging / name), **kwargs)
        for name in parts:
            target = root / name
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging / name, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root
