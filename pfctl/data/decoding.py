"""Decode ahead of the encoder: DataLoader worker processes, or one background thread.

:func:`decoded_items` yields :class:`~pfctl.data.video.DecodedItem` in input order while the
caller encodes. Worker processes die with the process that started them (a parent-death signal,
set in each worker's init), so a ``kill -9`` of encode-latents leaves no decoder holding memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from pfctl.data.annotations import Item
from pfctl.data.video import DecodedItem, FrameSettings, decode_item

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

AUTO_WORKERS_MAX = 8
"""``encode.num_workers: auto`` starts at most this many decode workers per process."""

Work = list[tuple[Item, frozenset[str]]]
"""Items to decode, each with the clip ids already cached (not decoded again)."""


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits, however the parent dies.

    A worker blocked on a full result pipe never reaches the DataLoader's own parent check, so
    without this it can outlive a killed parent for good. If the parent is already gone (it died
    between the fork and this call), exit now. Elsewhere than Linux: nothing (no such signal).
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


class _WorkerInit:
    """A DataLoader ``worker_init_fn`` (picklable) that ties the worker's life to its parent's."""

    def __init__(self) -> None:
        self.parent_pid = os.getpid()

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.parent_pid)


class _DecodeDataset(torch.utils.data.Dataset):
    def __init__(self, work: Work, settings: FrameSettings) -> None:
        self.work, self.settings = work, settings

    def __len__(self) -> int:
        return len(self.work)

    def __getitem__(self, index: int) -> DecodedItem:
        item, skip = self.work[index]
        return decode_item(item, self.settings, skip)


def _no_collate(x: Any) -> Any:
    return x


def _prefetch_thread(
    work: Work, settings: FrameSettings, depth: int, pin: bool = False
) -> Iterator[DecodedItem]:
    """Decode in one background thread (decord and torch release the GIL while they work).

    However the consumer stops (done, an error such as a full disk, or leaving the loop early), the thread
    is stopped and joined before this generator closes: it finishes the clip in hand, and the queue is
    drained so that a put it is blocked in returns. A decoder still running in native code when the
    interpreter exits can abort the process ("terminate called without an active exception") and turn a
    clean exit code into a crash."""
    box: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item, skip in work:
                if stop.is_set():
                    break
                decoded = decode_item(item, settings, skip)
                box.put(decoded.pin_memory() if pin else decoded)
        except BaseException as exc:
            box.put(exc)
        box.put(done)

    thread = threading.Thread(target=produce, name="pfctl-decode", daemon=True)
    thread.start()
    try:
        while True:
            got = box.get()
            if got is done:
                break
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                box.get(timeout=0.05)
        thread.join()


def resolve_workers(setting: int | str, processes_here: int = 1) -> int:
    """``encode.num_workers`` as a number: as given, or for ``auto`` min(8, usable CPU cores / processes
    on this host), at least 1."""
    if setting != "auto":
        return int(setting)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_WORKERS_MAX, cores // max(1, processes_here)))


def decoded_items(
    work: Work, settings: FrameSettings, num_workers: int, prefetch: int, pin: bool = False
) -> Iterator[DecodedItem]:
    """Decoded items in order, decoded ahead of the consumer (workers or a thread); with ``pin``
    their frames arrive in page-locked memory (for a GPU encoder)."""
    if not work:
        return
    if num_workers > 0:
        loader = torch.utils.data.DataLoader(
            _DecodeDataset(work, settings),
            batch_size=None,
            shuffle=False,
            num_workers=min(num_workers, len(work)),
            prefetch_factor=prefetch,
            collate_fn=_no_collate,
            persistent_workers=False,
            pin_memory=pin,
            worker_init_fn=_WorkerInit(),
        )
        yield from loader
        return
    yield from _prefetch_thread(work, settings, prefetch, pin)


__all__ = ["Work", "decoded_items", "die_with_parent", "resolve_workers"]
