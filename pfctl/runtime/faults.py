"""Test-only fault injection: ``PFCTL_FAULT`` arms faults at named points of the pipeline.

A no-op unless the environment variable is set, so production runs pay one dict lookup per
call. The reliability suite (``tests/reliability``, ``scripts/reliability.py``) uses it to make
one rank fail, a disk fill up or a tensor turn into NaN at a chosen moment, in real processes.

Grammar: entries separated by ``;``, each ``point[:key=value]...``::

    PFCTL_FAULT="train_step:rank=2:step=3"                 raise in rank 2's step 3
    PFCTL_FAULT="write:path=ranks/rank-00002:error=enospc"  that atomic write fails: disk full
    PFCTL_FAULT="encode_nan:clip=videos/a"                   the clip's latents become NaN
    PFCTL_FAULT="train_step:rank=1:step=2:action=hang"       rank 1 stops answering (collective timeout)
    PFCTL_FAULT="encode_written:action=sleep:seconds=1"      slow every written clip down (a kill lands mid-run)

Keys: ``rank`` (default: every rank), ``after=N`` (let the first N matching calls pass),
``error`` (``raise`` default, ``enospc``, ``erofs``, ``eacces``), ``action`` (``raise`` default,
``hang``, ``exit`` = ``os._exit(error code)``, ``sleep`` = wait ``seconds`` and go on); every other
key must equal the value the call site passes (``path`` matches as a substring of the posix path).

Points wired in pfctl: ``train_step`` (rank, step), ``train_nan`` (rank, step: the batch's
latents become NaN), ``encode_nan`` (clip), ``encode_written`` (clip: after a clip's file is written),
``write`` (path: ``pfctl.utils.io`` atomic writes).
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field

ENV = "PFCTL_FAULT"
_ERRORS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS, "eacces": errno.EACCES}
_CONTROL = ("rank", "after", "error", "action", "seconds", "code")


class InjectedFault(RuntimeError):
    """Raised by an armed ``raise`` fault (never by a production run)."""


@dataclass
class _Fault:
    point: str
    params: dict[str, str]
    seen: int = field(default=0)

    def matches(self, rank: int, context: dict[str, object]) -> bool:
        if "rank" in self.params and int(self.params["rank"]) != rank:
            return False
        for key, want in self.params.items():
            if key in _CONTROL:
                continue
            got = context.get(key)
            if got is None:
                return False
            if key == "path":
                if want not in str(got).replace(os.sep, "/"):
                    return False
            elif str(got) != want:
                return False
        self.seen += 1
        return self.seen > int(self.params.get("after", "0"))


_CACHE: dict[str, list[_Fault]] = {}


def parse(spec: str) -> list[_Fault]:
    """``PFCTL_FAULT`` text → armed faults (a malformed entry is an error: a test typo must not pass)."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        point, *pairs = entry.split(":")
        params = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"{ENV}: bad entry {entry!r} (expected point:key=value:...)")
            params[key.strip()] = value.strip()
        faults.append(_Fault(point.strip(), params))
    return faults


def _armed(point: str) -> list[_Fault]:
    spec = os.environ.get(ENV, "")
    if not spec:
        return []
    if spec not in _CACHE:  # parsed once per distinct value (counters live with the parse)
        _CACHE[spec] = parse(spec)
    return [f for f in _CACHE[spec] if f.point == point]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def fault(point: str, **context: object) -> None:
    """Raise (or hang, or exit) here if a fault is armed for this point, rank and context."""
    for armed in _armed(point):
        if not armed.matches(_rank(), context):
            continue
        where = ", ".join(f"{k}={v}" for k, v in context.items())
        message = f"injected fault '{point}' on rank {_rank()} ({where})"
        action = armed.params.get("action", "raise")
        if action == "hang":
            while True:
                time.sleep(3600)
        if action == "sleep":
            time.sleep(float(armed.params.get("seconds", "1")))
            continue
        if action == "exit":
            os._exit(int(armed.params.get("code", "1")))
        error = armed.params.get("error", "raise")
        if error in _ERRORS:
            code = _ERRORS[error]
            raise OSError(code, f"{os.strerror(code)} [{message}]", str(context.get("path", "")))
        raise InjectedFault(message)


def poisoned(point: str, **context: object) -> bool:
    """True if a value-corrupting fault (e.g. ``encode_nan``) is armed for this call."""
    return any(armed.matches(_rank(), context) for armed in _armed(point))


def active() -> bool:
    return bool(os.environ.get(ENV))
