"""The training data: clips from the encode-latents cache, batched for sync-group training.

Three rules make a sync group train the same videos (SPEC §2.4, §6):

1. **Sharding by group, not by rank.** Each epoch has one global permutation of the cache
   (seeded by ``(seed, epoch)``); group ``g`` of ``num_groups`` takes every ``num_groups``-th clip
   of it. All G ranks of a group therefore hold the same shard in the same order, and groups
   never share a clip within an epoch.
2. **Group-shared choices come from a group generator.** Which length bucket a batch is drawn
   from, which images/videos mix, which captions are dropped, which clip replaces one that
   fails to load, and the VAE posterior sample are drawn from generators seeded by
   ``(seed, group index, micro-step, purpose)`` — never from a rank's own RNG, which differs
   inside a group (the reference's ``random.choice`` did, and groups could silently desync).
3. **Failures are agreed.** A load failure is OR-reduced over the group before a
   replacement is drawn, so a file that fails on one rank only still yields one decision.

Per-rank randomness (noise, timesteps, history corruption) lives in the trainer's noise
generator, not here. A *micro-step* is one forward/backward; the sampler is indexed by it.

Buckets are keyed by (latent frames after cutting to ``max_units``, height, width), so every
batch stacks into one ``(B, C, T, H, W)`` tensor. One-frame clips are images.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pfctl.errors import CacheError
from pfctl.runtime import faults

# purposes, so the generators of one (seed, group, step) never share a stream
_EPOCH, _BUCKET, _REPLACE, _DROPOUT, _POSTERIOR = 101, 102, 103, 104, 105
MAX_REPLACEMENTS = 16


def group_rng(seed: int, *key: int) -> np.random.Generator:
    """A generator determined by ``(seed, *key)`` only — the same on every rank that asks."""
    return np.random.default_rng([seed & 0xFFFFFFFF, *(int(k) for k in key)])


@dataclass(frozen=True)
class ClipInfo:
    """One cache entry as the sampler sees it (no tensors)."""

    id: str
    num_latent_frames: int
    height: int
    width: int

    def bucket(self, max_units: int) -> tuple[int, int, int]:
        return (min(self.num_latent_frames, max_units), self.height, self.width)


@dataclass
class SamplerState:
    """The data position: epoch and how far each bucket of this group's shard was consumed."""

    epoch: int = 0
    cursors: dict[str, int] = field(default_factory=dict)
    clips_seen: int = 0


@dataclass(frozen=True)
class BatchChoice:
    """What the sampler picked for one micro-step (before load failures are handled)."""

    step: int
    epoch: int
    bucket: tuple[int, int, int]
    ids: list[str]


def _bucket_key(bucket: tuple[int, int, int]) -> str:
    return "x".join(map(str, bucket))


class SyncGroupSampler:
    """Deterministic batch choice for one sync group (a pure function of seed, group, step, state)."""

    def __init__(
        self,
        clips: Sequence[ClipInfo],
        *,
        num_groups: int,
        group_index: int,
        batch_size: int,
        seed: int,
        max_units: int,
        image_ratio: float | None = None,
    ) -> None:
        if not clips:
            raise CacheError("the latent cache has no clips to train on")
        self.clips = sorted(clips, key=lambda c: c.id)
        self.by_id = {c.id: c for c in self.clips}
        self.num_groups, self.group_index = num_groups, group_index
        self.batch_size, self.seed, self.max_units = batch_size, seed, max_units
        self.image_ratio = image_ratio
        self.state = SamplerState()
        self._epoch_cache: tuple[int, dict[str, list[str]]] | None = None

    # -- the epoch layout ------------------------------------------------------------------------
    def shard(self, epoch: int) -> list[str]:
        """This group's clips for ``epoch``: a slice of one global permutation (same for all groups)."""
        order = group_rng(self.seed, epoch, _EPOCH).permutation(len(self.clips))
        return [self.clips[i].id for i in order[self.group_index :: self.num_groups]]

    def buckets(self, epoch: int) -> dict[str, list[str]]:
        """Shard clips per bucket, in shard order (key = 'TxHxW')."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            table: dict[str, list[str]] = {}
            for cid in self.shard(epoch):
                table.setdefault(_bucket_key(self.by_id[cid].bucket(self.max_units)), []).append(cid)
            self._epoch_cache = (epoch, table)
        return self._epoch_cache[1]

    def _ready(self, epoch: int, cursors: dict[str, int]) -> dict[str, int]:
        """Buckets with at least one full batch left → clips left."""
        left = {k: len(v) - cursors.get(k, 0) for k, v in self.buckets(epoch).items()}
        return {k: n for k, n in left.items() if n >= self.batch_size}

    # -- drawing ---------------------------------------------------------------------------------
    def next_batch(self, step: int) -> BatchChoice:
        """The batch of micro-step ``step``; advances the data position."""
        ready = self._ready(self.state.epoch, self.state.cursors)
        if not ready:
            self.state.epoch += 1
            self.state.cursors = {}
            ready = self._ready(self.state.epoch, self.state.cursors)
            if not ready:
                sizes = {k: len(v) for k, v in self.buckets(self.state.epoch).items()}
                raise CacheError(
                    f"sync group {self.group_index} of {self.num_groups} has no length bucket with "
                    f"batch_size={self.batch_size} clips (its shard: {sizes})",
                    hint="lower train.batch_size, train fewer sync groups, or add clips of equal length",
                )
        rng = group_rng(self.seed, self.group_index, step, _BUCKET)
        keys = sorted(ready)
        if self.image_ratio is not None:
            images = [k for k in keys if k.startswith("1x")]
            videos = [k for k in keys if not k.startswith("1x")]
            if images and videos:
                keys = images if rng.random() < self.image_ratio else videos
        # weight by batches left, so a long bucket is not starved by many short ones
        weights = np.array([ready[k] // self.batch_size for k in keys], dtype=np.float64)
        key = keys[int(rng.choice(len(keys), p=weights / weights.sum()))]
        start = self.state.cursors.get(key, 0)
        ids = self.buckets(self.state.epoch)[key][start : start + self.batch_size]
        self.state.cursors[key] = start + self.batch_size
        self.state.clips_seen += len(ids)
        bucket = tuple(int(x) for x in key.split("x"))
        return BatchChoice(step=step, epoch=self.state.epoch, bucket=bucket, ids=list(ids))  # type: ignore[arg-type]

    def replacement(self, choice: BatchChoice, slot: int, attempt: int) -> str:
        """A clip of the same bucket (so the batch still stacks) replacing a clip that failed."""
        pool = self.buckets(choice.epoch)[_bucket_key(choice.bucket)]
        rng = group_rng(self.seed, self.group_index, choice.step, _REPLACE, slot, attempt)
        return pool[int(rng.integers(len(pool)))]

    def caption_dropout(self, step: int, probability: float) -> list[bool]:
        """Which rows get the empty-prompt embedding (the same rows on every rank of the group)."""
        draws = group_rng(self.seed, self.group_index, step, _DROPOUT).random(self.batch_size)
        return [bool(d < probability) for d in draws]

    def posterior_generator(self, step: int) -> torch.Generator:
        """Seeds the VAE posterior sample, so the group's clean latents are identical."""
        seed = int(group_rng(self.seed, self.group_index, step, _POSTERIOR).integers(2**62))
        return torch.Generator().manual_seed(seed)

    # -- resumable position --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {"epoch": s.epoch, "cursors": dict(s.cursors), "clips_seen": s.clips_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = SamplerState(int(state["epoch"]), dict(state["cursors"]), int(state["clips_seen"]))


@dataclass
class ResolvedBatch:
    """The clip ids a micro-step trains on after load failures were replaced."""

    choice: BatchChoice
    ids: list[str]
    replaced: dict[int, list[str]]  # slot → clip ids that failed there, in order
    dropped: list[bool]


def resolve_batch(
    sampler: SyncGroupSampler,
    step: int,
    try_load: Callable[[list[str]], list[bool]],
    caption_dropout: float,
) -> ResolvedBatch:
    """Draw a batch and replace clips until all load.

    ``try_load(ids)`` returns per-slot success, *agreed over the sync group* (the trainer
    OR-reduces failures; the dry-run probes the cache itself), so every rank replaces the same
    slots with the same clips.
    """
    choice = sampler.next_batch(step)
    ids = list(choice.ids)
    replaced: dict[int, list[str]] = {}
    ok = try_load(ids)
    attempt = 0
    while not all(ok):
        if attempt >= MAX_REPLACEMENTS:
            bad = [ids[i] for i, good in enumerate(ok) if not good]
            raise CacheError(
                f"{MAX_REPLACEMENTS} replacement clips in a row failed to load (last: {bad})",
                hint="check the cache with `pfctl train --dry-run`; re-run encode-latents",
            )
        for slot, good in enumerate(ok):
            if not good:
                replaced.setdefault(slot, []).append(ids[slot])
                ids[slot] = sampler.replacement(choice, slot, attempt)
        ok = try_load(ids)
        attempt += 1
    return ResolvedBatch(choice, ids, replaced, sampler.caption_dropout(step, caption_dropout))


# ------------------------------------------------------------------------------------------
# tensors: load, normalise, stack
# ------------------------------------------------------------------------------------------

TEXT_KEYS = ("prompt_embeds", "prompt_attention_mask", "pooled_prompt_embeds")


@dataclass
class TrainBatch:
    """One micro-batch: normalised latents ``(B, C, T, H, W)`` and text features ``[B, ...]``."""

    step: int
    ids: list[str]
    latents: torch.Tensor
    prompt_embeds: torch.Tensor
    prompt_attention_mask: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    dropped: list[bool]
    replaced: dict[int, list[str]]
    bucket: tuple[int, int, int]
    epoch: int
    #: valid tokens of each text row, read on the host before the copy to the device (``train.skip_future_keys``)
    text_lengths: list[int] | None = None


def unbatch(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Cache tensors may carry a leading batch axis of 1; the loader works per clip."""
    return t[0] if t.ndim == ndim + 1 and t.shape[0] == 1 else t


def stored_latent(entry: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(C, T, H, W)`` as stored: the clip's latent sample, else its posterior mean."""
    return unbatch(entry["latent_sample"] if "latent_sample" in entry else entry["latent_mean"], 4)


def clip_latent(
    entry: dict[str, torch.Tensor],
    generator: torch.Generator | None,
    frames: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(C, T, H, W)`` raw VAE latent of one clip in float32: the stored sample, or mean + std * eps
    (eps drawn for the whole clip, so the first frames are the same whatever ``frames`` is). Only the
    first ``frames`` frames (all if None), written into ``out`` if given: the stored bf16 tensors are
    read once, with no float32 copies of them (the loader's share of a training step's host time)."""
    stored = stored_latent(entry)
    if "latent_sample" in entry or "latent_std" not in entry:
        return stored[:, :frames].float() if out is None else out.copy_(stored[:, :frames])
    std = unbatch(entry["latent_std"], 4)
    eps = torch.randn(stored.shape, generator=generator, dtype=torch.float32)[:, :frames]
    dtype = torch.promote_types(std.dtype, torch.float32)
    z = torch.mul(std[:, :frames], eps, out=out if out is not None else torch.empty_like(eps, dtype=dtype))
    return z.add_(stored[:, :frames])  # + the mean


class LatentClipLoader:
    """Turns the sampler's choices into tensors.

    ``cache``: an opened :class:`pfctl.data.latent_cache.LatentCache` (``load(id)``, ``null_text()``);
    ``normalize``: raw ``(B, C, T, H, W)`` VAE latents → the latents the DiT trains on;
    ``agree``: OR-reduces a per-slot failure mask over the sync group (identity without one).
    """

    def __init__(
        self,
        cache: Any,
        sampler: SyncGroupSampler,
        *,
        normalize: Callable[[torch.Tensor], torch.Tensor],
        caption_dropout: float,
        agree: Callable[[list[bool]], list[bool]] | None = None,
    ) -> None:
        self.cache, self.sampler, self.normalize = cache, sampler, normalize
        self.caption_dropout = caption_dropout
        self.agree = agree or (lambda ok: ok)
        null = cache.null_text()
        self.null_text = {k: unbatch(null[k], d) for k, d in zip(TEXT_KEYS, (2, 1, 1), strict=False)}

    def _load(self, cid: str) -> dict[str, torch.Tensor] | None:
        try:
            faults.fault("cache_load", clip=cid)  # test hook: a file that fails on one rank only
            return self.cache.load(cid)
        except Exception:  # a corrupt or missing file: replaced by the group's agreed choice
            return None

    def next_batch(self, step: int) -> TrainBatch:
        """The batch of ``step``: :meth:`draw`, then the assembly it returns."""
        return self.draw(step)()

    def draw(self, step: int) -> Callable[[], TrainBatch]:
        """Choose and read the clips of ``step``: the sampler's draw, the cache reads and the sync group's
        agreement on failed reads, in the same order on every rank. Returns the batch's assembly from them
        (posterior samples, normalisation, text stacking): tensor work only, with no collective, so it may run
        on another thread (:class:`pfctl.training.data.BatchFeed`)."""
        loaded: dict[str, dict[str, torch.Tensor] | None] = {}

        def try_load(ids: list[str]) -> list[bool]:
            for cid in ids:
                if cid not in loaded:
                    loaded[cid] = self._load(cid)
            return self.agree([loaded[cid] is not None for cid in ids])

        batch = resolve_batch(self.sampler, step, try_load, self.caption_dropout)
        generator = self.sampler.posterior_generator(step)
        return functools.partial(self._assemble, step, batch, loaded, generator)

    def _assemble(
        self, step: int, batch: ResolvedBatch, loaded: dict[str, Any], generator: torch.Generator
    ) -> TrainBatch:
        frames = batch.choice.bucket[0]
        first = loaded[batch.ids[0]]
        shape = stored_latent(first).shape  # type: ignore[arg-type]
        latents = torch.empty((len(batch.ids), shape[0], frames, *shape[2:]))
        for row, cid in zip(latents, batch.ids, strict=True):
            clip_latent(loaded[cid], generator, frames, out=row)  # type: ignore[arg-type]
        text = {key: [] for key in TEXT_KEYS}
        for cid, drop in zip(batch.ids, batch.dropped, strict=False):
            entry = loaded[cid]
            for key, ndim in zip(TEXT_KEYS, (2, 1, 1), strict=False):
                value = self.null_text[key] if drop else unbatch(entry[key], ndim)  # type: ignore[index]
                text[key].append(value)
        try:
            stacked = {key: torch.stack(values) for key, values in text.items()}
        except RuntimeError as exc:
            raise CacheError(
                f"text features of batch {batch.ids} (or the empty-prompt embedding) differ in shape: {exc}",
                hint="all clips (and null_text) must come from the same text encoder and max length",
            ) from None
        return TrainBatch(
            step=step,
            ids=batch.ids,
            latents=self.normalize(latents),
            prompt_embeds=stacked["prompt_embeds"].float(),
            prompt_attention_mask=stacked["prompt_attention_mask"].long(),
            pooled_prompt_embeds=stacked["pooled_prompt_embeds"].float(),
            dropped=batch.dropped,
            replaced=batch.replaced,
            bucket=batch.choice.bucket,
            epoch=batch.choice.epoch,
        )


# ------------------------------------------------------------------------------------------
# the header's normalisation rule, and a synthetic cache for tests and benchmarks
# ------------------------------------------------------------------------------------------


def latent_normalizer(vae_info: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rule the cache header records (``vae.normalization``) as a function on ``(B, C, T, H, W)``."""
    from pfctl.models.vae import LatentNorm, normalize_latents

    rule = None
    if isinstance(vae_info, dict):
        rule = vae_info.get("normalization")
    if isinstance(rule, dict) and rule.get("rule", "frame0_image_rest_video") == "frame0_image_rest_video":
        norm = LatentNorm.from_dict(rule)
        return lambda z: normalize_latents(z, norm)
    if isinstance(rule, dict) and rule.get("rule") == "identity":
        return lambda z: z
    raise CacheError(
        f"the latent cache header records no latent normalisation this trainer understands (vae = {vae_info!r})",
        hint="re-encode the cache with this pfctl (its header must carry vae.normalization)",
    )


def _synthetic_clip(
    coarse: torch.Tensor, size: tuple[int, int], text: tuple[int, int, int], store: str, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One synthetic clip: ``coarse`` (C, T, h, w) noise smoothed to ``size``, and a caption embedding
    (``text`` = length, width, pooled width) correlated with it."""
    channels, t = coarse.shape[:2]
    height, width = size
    text_len, text_dim, pooled_dim = text
    frames = coarse.flatten(0, 1)[:, None]
    smooth = torch.nn.functional.interpolate(frames, size=(height, width), mode="bilinear").reshape(
        channels, t, height, width
    )
    latent = 2.0 * smooth - 0.2  # about the raw VAE range, so normalisation is non-trivial
    code = coarse.mean(dim=(1, 2, 3))
    prompt = torch.randn(text_len, text_dim, generator=gen) * 0.1
    prompt[:, : min(channels, text_dim)] += code[: min(channels, text_dim)]
    tensors: dict[str, torch.Tensor] = {
        "prompt_embeds": prompt,
        "prompt_attention_mask": torch.ones(text_len, dtype=torch.long),
        "pooled_prompt_embeds": torch.randn(pooled_dim, generator=gen) * 0.1,
    }
    if store == "mean_std":
        tensors["latent_mean"], tensors["latent_std"] = latent, torch.full_like(latent, 0.05)
    else:
        tensors["latent_sample"] = latent
    return tensors


def write_synthetic_cache(
    root: str,
    lengths: Sequence[int],
    *,
    height: int = 8,
    width: int = 8,
    channels: int = 16,
    text_len: int = 8,
    text_dim: int = 32,
    pooled_dim: int = 24,
    seed: int = 0,
    store: str = "mean_std",
    patterns: int | None = None,
) -> list[str]:
    """A small cache of smooth random latents through :class:`LatentCacheWriter` (tests, benchmarks).

    Clip ``i`` has ``lengths[i]`` latent frames; its "caption" embedding is correlated with its
    latents so conditioning carries signal. With ``patterns`` = P, clip ``i`` shows pattern
    ``i % P`` (a learnable data distribution: loss-goes-down tests). Returns the clip ids.
    """
    from pfctl.data import latent_cache as lc
    from pfctl.models.vae import FLUX_LATENT_NORM

    gen = torch.Generator().manual_seed(seed)
    header = {
        "format": lc.FORMAT_NAME,
        "format_version": lc.FORMAT_VERSION,
        "fingerprint": f"synthetic-{seed}-{channels}x{height}x{width}-{store}",
        "vae": {
            "name": "synthetic",
            "latent_channels": channels,
            "normalization": FLUX_LATENT_NORM.to_dict(),
        },
        "latent_keys": list(lc.LATENT_KEYS_MEAN_STD if store == "mean_std" else lc.LATENT_KEYS_SAMPLE),
        "provenance": {"synthetic": {"seed": seed, "lengths": list(lengths)}},
    }
    lc.prepare_folder(root, header)
    writer = lc.LatentCacheWriter(root, header)
    writer.write_header()
    writer.write_null_text(
        {
            "prompt_embeds": torch.zeros(text_len, text_dim),
            "prompt_attention_mask": torch.cat([torch.ones(1), torch.zeros(text_len - 1)]).long(),
            "pooled_prompt_embeds": torch.zeros(pooled_dim),
        }
    )
    rows, ids = [], []
    longest = max(lengths)
    for i, t in enumerate(lengths):
        source = gen if patterns is None else torch.Generator().manual_seed(seed * 1000 + i % patterns)
        coarse = torch.randn(channels, longest, max(height // 4, 1), max(width // 4, 1), generator=source)[
            :, :t
        ]
        tensors = _synthetic_clip(coarse, (height, width), (text_len, text_dim, pooled_dim), store, gen)
        cid = f"clip-{i:03d}"
        kind = "image" if t == 1 else "video"
        rows.append(
            writer.write(
                cid, tensors, {"kind": kind, "num_frames": 1 + 8 * (t - 1), "bucket": f"{height}x{width}"}
            )
        )
        ids.append(cid)
    writer.write_part(rows, [], {"written": len(rows)})
    lc.merge_parts(root, 1)
    return ids
