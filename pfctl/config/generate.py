"""``generate:`` section — options of ``pfctl generate``."""

from __future__ import annotations

from pfctl.config.base import Section


class GenerateConfig(Section):
    """Options of generate (filled in by the generate feature)."""

    output_dir: str = "outputs/generate"
