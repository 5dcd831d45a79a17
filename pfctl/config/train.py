"""``train:`` section — options of ``pfctl train``."""

from __future__ import annotations

from pfctl.config.base import Section


class TrainConfig(Section):
    """Options of train (filled in by the train feature)."""

    output_dir: str = "outputs/train"
    video_sync_group: int = 1
