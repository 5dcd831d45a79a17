"""The trainer's data: the encode-latents cache, the held-out split, the sync group's sampler and
loader, and the batch feed that loads the next micro-batch while the GPU runs the backward.

The helpers that only read the cache are plain functions: the dry-run (:mod:`pfctl.training.plan`)
shares them with the run.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pfctl.config.train import TrainConfig
from pfctl.data.dataset import (
    ClipInfo,
    LatentClipLoader,
    SyncGroupSampler,
    TrainBatch,
    group_rng,
    stored_latent,
)
from pfctl.errors import CacheError, ConfigError
from pfctl.flow.pyramid import merged_row_order
from pfctl.models.attention_layout import right_padded_lengths

#: The cached text conditioning: key and the number of dimensions of one clip's tensor.
TEXT_KEYS = (("prompt_embeds", 2), ("prompt_attention_mask", 1), ("pooled_prompt_embeds", 1))


def cache_path(config: Any) -> str:
    return config.train.cache or config.encode.output_dir


def open_cache(path: str) -> Any:
    """Open the encode-latents cache; the cache module checks its format version and fingerprint."""
    from pfctl.data.latent_cache import LatentCache

    return LatentCache.open(path)


def cache_clips(cache: Any) -> list[ClipInfo]:
    return [
        ClipInfo(
            id=str(r["id"]),
            num_latent_frames=int(r["num_latent_frames"]),
            height=int(r["height"]),
            width=int(r["width"]),
        )
        for r in cache.items()
    ]


def split_heldout(clips: list[ClipInfo], n: int, seed: int) -> list[ClipInfo]:
    """``n`` clips chosen by the seed alone (the same on every rank) and never trained on."""
    if n == 0:
        return []
    if n >= len(clips):
        raise ConfigError(f"train.heldout_clips {n} leaves no training clips (the cache has {len(clips)})")
    ordered = sorted(clips, key=lambda c: c.id)
    picks = group_rng(seed, 401).choice(len(ordered), size=n, replace=False)
    return [ordered[i] for i in sorted(picks)]


def cache_normalizer(cache: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """Raw VAE latents → DiT latents, with the rule the cache header records."""
    from pfctl.data.dataset import latent_normalizer

    return latent_normalizer(cache.vae)


def cache_vae_info(cache: Any) -> dict[str, Any]:
    """What the export records about the latents it was trained on: the VAE (generate needs a matching
    one) and the clips' pixel sizes [width, height], most frequent first (generate's default size)."""
    factor = int(cache.vae.get("spatial_factor", 8))
    sizes: dict[tuple[int, int], int] = {}
    for row in cache.items():
        size = (int(row["width"]) * factor, int(row["height"]) * factor)
        sizes[size] = sizes.get(size, 0) + 1
    resolutions = [list(size) for size, _ in sorted(sizes.items(), key=lambda item: (-item[1], item[0]))]
    return {"vae": cache.vae, "cache_fingerprint": cache.fingerprint, "resolutions": resolutions}


def check_cache_matches_model(cache: Any, model: torch.nn.Module) -> None:
    """Latent channels and text widths of the cache must fit the DiT (clear error, not a shape crash)."""
    config = getattr(model, "config", None)
    if config is None or not len(cache):
        return
    try:
        entry = cache.load(cache.ids()[0])
    except Exception:
        return  # a broken first clip is handled (replaced) by the loader
    latent = stored_latent(entry)  # the posterior mean or the stored sample: deterministic
    in_channels = int(config.get("in_channels", 0)) if hasattr(config, "get") else 0
    patch_channels = latent.shape[0] * 4
    if in_channels and in_channels not in (latent.shape[0], patch_channels):
        raise ConfigError(
            f"the cache's latents have {latent.shape[0]} channels but the DiT takes in_channels={in_channels}",
            hint="encode the cache with the VAE of this model, or pick a DiT preset for these latents",
        )
    width = int(config.get("joint_attention_dim", 0)) if hasattr(config, "get") else 0
    text = entry["prompt_embeds"]
    if width and text.shape[-1] != width:
        raise ConfigError(
            f"the cache's text features are {text.shape[-1]}-d but the DiT's joint_attention_dim is {width}",
            hint="encode the cache with this model's text encoder",
        )


def group_agreement(sync: Any, device: torch.device) -> Callable[[list[bool]], list[bool]]:
    """The loader's ``agree``: OR-reduce load failures over the sync group so every rank replaces the
    same slots.

    On a GPU the collective waits for the kernels queued before it (during a prefetch: the step so far);
    a group of one rank agrees with itself, so it skips the collective."""

    def agree(ok: list[bool]) -> list[bool]:
        if sync.process_group is None or sync.size == 1:
            return ok
        failed = torch.tensor([0 if good else 1 for good in ok], dtype=torch.int64, device=device)
        sync.all_reduce(failed, op="max")
        return [int(f) == 0 for f in failed.tolist()]

    return agree


@dataclass
class TrainData:
    """The run's data: the cache, the held-out clips, this sync group's sampler and its loader."""

    cache: Any
    heldout: list[ClipInfo]
    sampler: SyncGroupSampler
    loader: LatentClipLoader


def build_data(
    config: Any, *, num_groups: int, group_index: int, seed: int, agree: Callable[[list[bool]], list[bool]]
) -> TrainData:
    """Open the cache (format + fingerprint checked), split off the held-out clips, and build the
    group's sampler and loader (``agree`` OR-reduces load failures over the sync group)."""
    cfg: TrainConfig = config.train
    cache = open_cache(cache_path(config))
    clips = cache_clips(cache)
    heldout = split_heldout(clips, cfg.heldout_clips, seed)
    held_ids = {c.id for c in heldout}
    sampler = SyncGroupSampler(
        [c for c in clips if c.id not in held_ids],
        num_groups=num_groups,
        group_index=group_index,
        batch_size=cfg.batch_size,
        seed=seed,
        max_units=cfg.max_units,
        image_ratio=cfg.image_ratio,
    )
    loader = LatentClipLoader(
        cache, sampler, normalize=cache_normalizer(cache), caption_dropout=cfg.caption_dropout, agree=agree
    )
    return TrainData(cache=cache, heldout=heldout, sampler=sampler, loader=loader)


@dataclass
class _Prefetched:
    """A micro-step's batch loaded ahead (:meth:`BatchFeed.prefetch`): its assembly under way on the feed's
    thread, or the data error that drawing it raised, and the sampler state before it was drawn (what a
    checkpoint records meanwhile)."""

    micro_step: int
    position: dict[str, Any]
    batch: Future[TrainBatch] | None = None
    error: CacheError | None = None


class BatchFeed:
    """Micro-batches on the training device, the next ones loaded ahead while the GPU works."""

    def __init__(self, data: TrainData, device: torch.device, *, skip_future_keys: bool) -> None:
        self.data, self.device, self.skip_future_keys = data, device, skip_future_keys
        self.ahead: deque[_Prefetched] = deque()  # the batches of the next micro-steps, loaded ahead, in order
        self._thread: ThreadPoolExecutor | None = None  # assembles prefetched batches

    def next_batch(self, micro_step: int) -> TrainBatch:
        """The batch of ``micro_step`` on the device: the prefetched one, else loaded now."""
        if not self.ahead:
            return self.to_device(self.data.loader.next_batch(micro_step))
        ahead = self.ahead.popleft()
        if ahead.micro_step != micro_step:
            asked = f"the batch of micro-step {micro_step} was asked for"
            raise RuntimeError(f"{asked}, {ahead.micro_step} is next")
        if ahead.error is not None:
            raise ahead.error
        return self.to_device(ahead.batch.result())  # a CacheError of the assembly is raised here

    def prefetch_through(self, micro_step: int, through: int) -> None:
        """Prefetch (:meth:`prefetch`) the batches after ``micro_step`` (the one just taken) up to ``through``
        that are not loaded ahead yet."""
        first = self.ahead[-1].micro_step + 1 if self.ahead else micro_step + 1
        for step in range(first, through + 1):
            self.prefetch(step)

    def prefetch(self, micro_step: int) -> None:
        """Draw the batch of ``micro_step`` now and assemble it on the feed's thread.

        Called before a micro-step is launched, for a later one. The draw (the sampler, the cache reads,
        the sync group's agreement on failed reads) runs on the main thread, in the same order on every
        rank, because the loader may all-reduce load failures over the group. The assembly (posterior samples, normalisation,
        text stacking, pinning: tensor work that releases the GIL) runs on one thread of its own while the
        main thread launches the micro-step; the micro-step that uses the batch waits for it. The
        data position before the draw is kept: until the batch is used, a checkpoint records that position,
        so a resumed run draws the same batch again. A data error (:class:`CacheError`) is raised by the
        micro-step that uses the batch, as without prefetching (the step before still completes and
        checkpoints); anything else in the draw, e.g. a failed collective, at once.
        """
        position = self.data.sampler.state_dict()
        try:
            assemble = self.data.loader.draw(micro_step)
        except CacheError as exc:
            self.ahead.append(_Prefetched(micro_step, position, error=exc))
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pfctl-batch")
        batch = self._thread.submit(lambda: self.pinned(assemble()))
        self.ahead.append(_Prefetched(micro_step, position, batch=batch))

    def position(self) -> dict[str, Any]:
        """The sampler state a checkpoint records: before the first prefetched batch, if one is waiting."""
        return self.ahead[0].position if self.ahead else self.data.sampler.state_dict()

    def pinned(self, batch: TrainBatch) -> TrainBatch:
        """The batch with its tensors in pinned host memory when the device is a GPU (else as it is)."""
        if self.device.type != "cuda":
            return batch
        return self._map_tensors(batch, torch.Tensor.pin_memory)

    def to_device(self, batch: TrainBatch) -> TrainBatch:
        """The batch with its tensors on the training device.

        On a GPU the copies are queued from pinned memory without blocking: a copy from pageable memory
        first waits for every kernel already queued.
        """
        device = self.device
        pinned = device.type == "cuda"
        lengths = right_padded_lengths(batch.prompt_attention_mask) if self.skip_future_keys else None
        batch = dataclasses.replace(batch, text_lengths=lengths)  # before the copy: no wait for the GPU
        return self._map_tensors(self.pinned(batch), lambda t: t.to(device, non_blocking=pinned))

    @staticmethod
    def _map_tensors(batch: TrainBatch, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        return dataclasses.replace(
            batch,
            latents=fn(batch.latents),
            prompt_embeds=fn(batch.prompt_embeds),
            prompt_attention_mask=fn(batch.prompt_attention_mask),
            pooled_prompt_embeds=fn(batch.pooled_prompt_embeds),
        )


@dataclass
class TextRows:
    """The text conditioning of one DiT call, row ``r`` for the DiT's row ``r``."""

    prompt_embeds: torch.Tensor
    prompt_attention_mask: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    text_lengths: list[int] | None

    @classmethod
    def of(cls, batch: TrainBatch) -> TextRows:
        """The rows of one micro-batch, as they are."""
        text = (batch.prompt_embeds, batch.prompt_attention_mask, batch.pooled_prompt_embeds)
        return cls(*text, batch.text_lengths)


def merged_text_rows(batches: list[TrainBatch], columns: int) -> TextRows:
    """The text rows of micro-batches of ``columns`` columns each, in the row order of their merged DiT input
    (:func:`pfctl.flow.pyramid.merged_row_order`). Text of different lengths is right-padded to the longest,
    the padding masked out (as the encoder's own padding is)."""
    width = max(b.prompt_embeds.shape[1] for b in batches)
    per_column = batches[0].prompt_embeds.shape[0] // columns

    def rows(tensors: list[torch.Tensor]) -> torch.Tensor:  # (no index tensor: no copy to the device)
        return torch.cat([t.unflatten(0, (per_column, columns)) for t in tensors], dim=1).flatten(0, 1)

    def padded(t: torch.Tensor) -> torch.Tensor:  # [rows, L, ...] -> [rows, width, ...]
        short = width - t.shape[1]
        return t if short == 0 else F.pad(t, (0, 0) * (t.ndim - 2) + (0, short))

    lengths = None
    if all(b.text_lengths is not None for b in batches):
        flat = [n for b in batches for n in b.text_lengths]
        lengths = [flat[i] for i in merged_row_order([columns] * len(batches), per_column)]
    return TextRows(
        prompt_embeds=rows([padded(b.prompt_embeds) for b in batches]),
        prompt_attention_mask=rows([padded(b.prompt_attention_mask) for b in batches]),
        pooled_prompt_embeds=rows([b.pooled_prompt_embeds for b in batches]),
        text_lengths=lengths,
    )
