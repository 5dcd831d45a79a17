"""``encode:`` section — options of ``pfctl encode-latents``."""

from __future__ import annotations

from pfctl.config.base import Section


class EncodeConfig(Section):
    """Options of encode-latents (filled in by the encode-latents feature)."""

    output_dir: str = "cache"
