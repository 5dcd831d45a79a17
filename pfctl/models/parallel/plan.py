"""The parallel layout of ``pfctl generate``: which ranks share a video and how (pure, no collective).

With world size W the ranks form ``data`` groups of ``cfg * sequence`` contiguous ranks. A group makes one
video at a time: with ``cfg = 2`` its first half runs the unconditional (negative-prompt) half of the
CFG batch and its second half the conditional one; inside each half, ``sequence`` ranks split the tokens
(Ulysses). The groups share out the videos (data parallel): group g makes videos g, g + data, ...

:func:`plan_parallel` is the one validator; it runs before any model is loaded and identically on every
rank, so a bad layout is refused everywhere at once (no collective can hang on it).
"""

from __future__ import annotations

from dataclasses import dataclass

from pfctl.errors import ConfigError

__all__ = ["ParallelPlan", "check_heads", "plan_parallel"]


@dataclass(frozen=True)
class ParallelPlan:
    """The layout for one world size (pure data; rank r's place is :meth:`place`)."""

    world_size: int
    cfg: int  # 1 or 2: ranks that share the CFG batch of a video
    sequence: int  # ranks that split the tokens of one forward

    @property
    def group_size(self) -> int:
        return self.cfg * self.sequence

    @property
    def data(self) -> int:
        """Groups that make different videos."""
        return self.world_size // self.group_size

    def place(self, rank: int) -> tuple[int, int, int]:
        """``(group, cfg half, sequence rank)`` of ``rank``."""
        group, inside = divmod(rank, self.group_size)
        half, seq = divmod(inside, self.sequence)
        return group, half, seq

    def group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def sequence_ranks(self, group: int, half: int) -> list[int]:
        start = group * self.group_size + half * self.sequence
        return list(range(start, start + self.sequence))

    def cfg_ranks(self, group: int, seq: int) -> list[int]:
        start = group * self.group_size + seq
        return [start + half * self.sequence for half in range(self.cfg)]

    def record(self) -> dict[str, int]:
        """What the sidecar records."""
        return {"world_size": self.world_size, "data": self.data, "cfg": self.cfg, "sequence": self.sequence}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_parallel(
    world_size: int, num_videos: int, cfg: str, sequence: int | str, guidance: bool
) -> ParallelPlan:
    """The layout for ``world_size`` ranks making ``num_videos`` videos.

    ``cfg``: ``on`` (2 ranks share each video's CFG batch; needs guidance and an even world size), ``off``,
    or ``auto`` (on when guidance is used and the ranks of a video are even). ``sequence``: the ranks that
    split each forward's tokens, or ``auto``. With both ``auto``: as many groups as there are videos (at
    most W, a divisor of W), each group's ranks first halving the CFG batch, the rest splitting the
    sequence. Raises :class:`ConfigError` naming the key and the values allowed.
    """
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if cfg not in ("auto", "on", "off"):
        raise ConfigError(f"generate.parallel.cfg = {cfg!r} is not valid", hint="use auto, on or off")
    if cfg == "on" and not guidance:
        raise ConfigError(
            "generate.parallel.cfg = on needs classifier-free guidance, but guidance_scale is 0",
            hint="set generate.parallel.cfg to auto or off, or a guidance_scale > 0",
        )
    if sequence != "auto":
        if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
            raise ConfigError(
                f"generate.parallel.sequence = {sequence!r} is not valid", hint="use auto or an integer >= 1"
            )
        if world_size % sequence:
            raise ConfigError(
                f"generate.parallel.sequence = {sequence} does not divide the world size {world_size}",
                hint=f"choose generate.parallel.sequence from {_divisors(world_size)} or auto",
            )
    if sequence == "auto":
        return _auto_sequence(world_size, num_videos, cfg, guidance)
    halves = _cfg_degree(world_size // sequence, world_size, cfg, sequence, guidance)
    return ParallelPlan(world_size=world_size, cfg=halves, sequence=sequence)


def _auto_sequence(world_size: int, num_videos: int, cfg: str, guidance: bool) -> ParallelPlan:
    """As many groups as videos (a divisor of W), the rest of the ranks on each video."""
    data = max(
        d for d in _divisors(world_size)
        if d <= max(1, num_videos) and (cfg != "on" or (world_size // d) % 2 == 0 or d == 1)
    )  # fmt: skip
    per_video = world_size // data
    halves = _cfg_degree(per_video, world_size, cfg, "auto", guidance)
    return ParallelPlan(world_size=world_size, cfg=halves, sequence=per_video // halves)


def _cfg_degree(rest: int, world_size: int, cfg: str, sequence: int | str, guidance: bool) -> int:
    """1 or 2: whether the CFG halves go to different ranks (``rest`` ranks per sequence split)."""
    if cfg == "on":
        if rest % 2:
            raise ConfigError(
                f"generate.parallel.cfg = on needs an even number of ranks per video and sequence split: "
                f"world size {world_size}, generate.parallel.sequence {sequence}",
                hint="launch an even number of processes, or set generate.parallel.cfg to auto or off",
            )
        return 2
    if cfg == "off" or not guidance or rest % 2:
        return 1
    return 2


def check_heads(heads: int, sequence: int) -> None:
    """Ulysses splits the attention heads over the ``sequence`` ranks: they must divide evenly."""
    if sequence > 1 and heads % sequence:
        allowed = [d for d in _divisors(heads) if d > 0]
        raise ConfigError(
            f"generate.parallel.sequence = {sequence} does not divide the DiT's {heads} attention heads",
            hint=f"choose generate.parallel.sequence from {allowed} (launch a matching number of processes)",
        )
