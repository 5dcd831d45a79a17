"""The text conditioning the DiTs take: T5 token features, their mask and CLIP's pooled features, one batch.

Produced by the text encoders (:mod:`pfctl.models.text_encoder`), written to and read from the latent cache,
and fed to the DiTs' ``encoder_hidden_states`` / ``encoder_attention_mask`` / ``pooled_projections``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pfctl.errors import InputError


@dataclass(frozen=True, eq=False)
class TextEmbeddings:
    """One batch of text conditioning, as the DiT takes it.

    ``prompt_embeds`` [B, L, D] (T5 last hidden state), ``prompt_attention_mask`` [B, L] int64
    (1 = real token), ``pooled_prompt_embeds`` [B, Dp] (CLIP pooled). Immutable so a cached
    null embedding can be shared without a caller changing it behind the cache's back.
    """

    prompt_embeds: torch.Tensor
    prompt_attention_mask: torch.Tensor
    pooled_prompt_embeds: torch.Tensor

    KEYS = ("prompt_embeds", "prompt_attention_mask", "pooled_prompt_embeds")

    def __post_init__(self) -> None:
        pe, mask, pooled = self.prompt_embeds, self.prompt_attention_mask, self.pooled_prompt_embeds
        if pe.dim() != 3 or mask.dim() != 2 or pooled.dim() != 2:
            raise InputError(
                "text embeddings have the wrong rank: prompt_embeds "
                f"{tuple(pe.shape)} (want [B,L,D]), prompt_attention_mask {tuple(mask.shape)} (want [B,L]), "
                f"pooled_prompt_embeds {tuple(pooled.shape)} (want [B,Dp])",
                hint="text features must come from pfctl's text encoder or a latent cache it wrote",
            )
        if not (pe.shape[0] == mask.shape[0] == pooled.shape[0]) or pe.shape[1] != mask.shape[1]:
            raise InputError(
                f"text embeddings disagree in batch/length: prompt_embeds {tuple(pe.shape)}, "
                f"prompt_attention_mask {tuple(mask.shape)}, pooled_prompt_embeds {tuple(pooled.shape)}",
                hint="all three tensors must describe the same prompts",
            )
        if mask.dtype != torch.int64:
            object.__setattr__(self, "prompt_attention_mask", mask.to(torch.int64))

    # -- shape helpers -----------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.prompt_embeds.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self)

    @property
    def seq_len(self) -> int:
        return int(self.prompt_embeds.shape[1])

    @property
    def dim(self) -> int:
        return int(self.prompt_embeds.shape[2])

    @property
    def pooled_dim(self) -> int:
        return int(self.pooled_prompt_embeds.shape[1])

    @property
    def device(self) -> torch.device:
        return self.prompt_embeds.device

    @property
    def dtype(self) -> torch.dtype:
        return self.prompt_embeds.dtype

    # -- transforms (all return new objects) -------------------------------------------------
    def __getitem__(self, index: int | slice | Sequence[int] | torch.Tensor) -> TextEmbeddings:
        """Select rows; an int keeps the batch dimension (``emb[0]`` has batch size 1)."""
        if isinstance(index, int):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"text embedding index {index} out of range for batch size {n}")
            index = slice(index % n, index % n + 1)
        elif not isinstance(index, slice | torch.Tensor):
            index = torch.as_tensor(list(index), dtype=torch.long)
        if isinstance(index, torch.Tensor):
            index = index.to(self.prompt_embeds.device)
        return TextEmbeddings(
            self.prompt_embeds[index], self.prompt_attention_mask[index], self.pooled_prompt_embeds[index]
        )

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> TextEmbeddings:
        """Move / cast; ``dtype`` applies to the float tensors only (the mask stays int64)."""
        return TextEmbeddings(
            self.prompt_embeds.to(device=device, dtype=dtype),
            self.prompt_attention_mask.to(device=device),
            self.pooled_prompt_embeds.to(device=device, dtype=dtype),
        )

    @classmethod
    def cat(cls, items: Sequence[TextEmbeddings]) -> TextEmbeddings:
        """Concatenate along the batch (e.g. ``cat([negative, positive])`` for guidance)."""
        items = list(items)
        if not items:
            raise InputError("cannot concatenate an empty list of text embeddings")
        lengths = {e.seq_len for e in items}
        if len(lengths) != 1:
            raise InputError(
                f"text embeddings have different token lengths {sorted(lengths)}",
                hint="all prompts must be encoded with the same max_sequence_length",
            )
        return cls(
            torch.cat([e.prompt_embeds for e in items]),
            torch.cat([e.prompt_attention_mask for e in items]),
            torch.cat([e.pooled_prompt_embeds for e in items]),
        )

    def repeat_interleave(self, repeats: int) -> TextEmbeddings:
        """Each row ``repeats`` times in a row (the reference's ``num_images_per_prompt``)."""
        return TextEmbeddings(
            self.prompt_embeds.repeat_interleave(repeats, dim=0),
            self.prompt_attention_mask.repeat_interleave(repeats, dim=0),
            self.pooled_prompt_embeds.repeat_interleave(repeats, dim=0),
        )

    def expand(self, batch_size: int) -> TextEmbeddings:
        """A batch-1 embedding repeated to ``batch_size`` rows (e.g. the null text for a batch)."""
        if len(self) != 1:
            raise InputError(f"expand() needs a batch of 1, got {len(self)}")
        return self.repeat_interleave(batch_size)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Key names used by the latent cache and the DiT's keyword arguments."""
        return {k: getattr(self, k) for k in self.KEYS}

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor], *, batched: bool = True) -> TextEmbeddings:
        """Inverse of :meth:`as_dict`; ``batched=False`` adds the batch dimension (cache rows)."""
        missing = [k for k in cls.KEYS if k not in tensors]
        if missing:
            raise InputError(
                f"text features are missing {missing} (have {sorted(tensors)})",
                hint="re-run encode-latents to write text features",
            )
        vals = [tensors[k] for k in cls.KEYS]
        if not batched:
            vals = [v.unsqueeze(0) for v in vals]
        return cls(*vals)

    def allclose(self, other: TextEmbeddings, *, atol: float = 1e-6, rtol: float = 1e-5) -> bool:
        return (
            torch.equal(self.prompt_attention_mask.cpu(), other.prompt_attention_mask.cpu())
            and torch.allclose(
                self.prompt_embeds.float().cpu(), other.prompt_embeds.float().cpu(), atol=atol, rtol=rtol
            )
            and torch.allclose(
                self.pooled_prompt_embeds.float().cpu(),
                other.pooled_prompt_embeds.float().cpu(),
                atol=atol,
                rtol=rtol,
            )
        )
