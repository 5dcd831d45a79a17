"""``verify:`` section — options of ``pfctl verify-groupnorm``."""

from __future__ import annotations

from pfctl.config.base import Section


class VerifyConfig(Section):
    """Options of verify-groupnorm (filled in by the verify-groupnorm feature)."""

    vae: str | None = None
