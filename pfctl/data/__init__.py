"""Data: annotations → decoded, resampled, bucketed clips → the latent cache the trainer reads.

- ``annotations``: JSONL / CSV / folder inputs, validated into :class:`Item` rows.
- ``video``: decord decoding, fps resampling, clip extraction, resize-to-cover + center crop.
- ``buckets``: resolution buckets (nearest aspect ratio) and the one check of trainable sizes.
- ``latent_cache``: the on-disk cache (writer + :class:`LatentCache` reader, format_version, fingerprint).
- ``encode``: the ``encode-latents`` pipeline (:func:`run_encode`), in steps;
  ``encode_setup``: which model and settings, their checks, the cache header;
  ``encode_batch``: the per-rank encoder (clips batched by shape, captions once, writes behind);
  ``encode_writer``: its writer thread and stage clock;
  ``decoding``: decode-ahead workers (they die with their parent) or a prefetch thread.

Import the submodules directly; this package imports nothing heavy.
"""
