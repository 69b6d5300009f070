"""Which rank stopped answering: every rank's heartbeat in a store rank 0 serves, read when a collective times out.

A timed-out collective tells the rank that waited only that it waited. Each rank's heartbeat thread writes, every
``interval_s``, the time, the training step and where its main thread is. When a collective times out, the waiting rank
reads them all: a rank whose heartbeat stopped was killed, frozen or lost with its machine; a rank that still beats is
alive, and where its main thread is says what it is stuck in.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from types import FrameType

import torch.distributed as dist
from torch.distributed import DistBackendError, Store, TCPStore

__all__ = ["Heartbeat", "describe_ranks", "failed_collective", "name_the_silent_rank", "store_on_rank_zero"]

_KEY = "lightdist/resilience/heartbeat/{rank}"


class Heartbeat:
    """A daemon thread that writes this rank's heartbeat, and ``beat(step)`` for the main thread as a step starts."""

    def __init__(self, store: Store, rank: int, interval_s: float) -> None:
        self.store, self.rank, self.interval_s = store, rank, interval_s
        self.step = 0
        self._stopped = threading.Event()
        self._main_thread = threading.main_thread().ident
        self._thread = threading.Thread(target=self._beat, name=f"lightdist-heartbeat-{rank}", daemon=True)

    @classmethod
    def started(cls, store: Store, rank: int, timeout: timedelta) -> Heartbeat:
        """This rank's heartbeat, beating into ``store`` often enough to be read within a quarter of ``timeout``."""
        heartbeat = cls(store, rank, min(10.0, timeout.total_seconds() / 4))
        heartbeat.start()
        return heartbeat

    def start(self) -> None:
        self._write()  # before any collective: a rank that never beat never started
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def beat(self, step: int) -> None:
        """Beat now, with the step that starts: a rank that freezes right after still reports the step it froze in."""
        self.step = step
        self._write()

    def _beat(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self._write()
            except RuntimeError:  # the store's host (rank 0 or the agent) is gone: nobody is left to read it
                return

    def _write(self) -> None:
        beat = {"time": time.time(), "step": self.step, "where": _where(self._main_thread)}
        self.store.set(_KEY.format(rank=self.rank), json.dumps(beat))


def store_on_rank_zero(host: str, timeout: timedelta) -> Store:
    """A store that rank 0 serves at ``host`` to every rank of the world, for heartbeats and failure reports: the
    process group's own store is not reachable through torch's public API, and may be the user's. A collective."""
    server = (
        TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout) if dist.get_rank() == 0 else None
    )
    port = [server.port if server is not None else None]
    dist.broadcast_object_list(port, src=0)
    return server or TCPStore(host, port[0], is_master=False, timeout=timeout)


def describe_ranks(store: Store, world_size: int, interval_s: float) -> str:
    """One line per rank: stopped answering (no heartbeat for 3 intervals) or alive, its step, and where it was."""
    now, lines = time.time(), []
    for rank in range(world_size):
        key = _KEY.format(rank=rank)
        if not store.check([key]):
            lines.append(f"rank {rank}: no heartbeat at all: it never started")
            continue
        beat = json.loads(store.get(key))
        silent = now - beat["time"]
        state = (
            f"stopped answering {silent:.0f} s ago (killed, frozen, or its machine lost)"
            if silent > 3 * interval_s
            else "alive"
        )
        lines.append(f"rank {rank}: {state}, at step {beat['step']}, in {beat['where']}")
    return "\n".join(lines)


def _where(thread_id: int | None) -> str:
    """The thread's innermost frame outside this module, and where that was called from outside torch: "in wait
    (distributed_c10d.py:4394), from forward (llama.py:141)"."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "an unknown place"
    where = _describe(frame)
    caller = frame
    while caller is not None and _TORCH in caller.f_code.co_filename:
        caller = caller.f_back
    return where if caller is None or caller is frame else f"{where}, from {_describe(caller)}"


_TORCH = f"{os.sep}torch{os.sep}"


def _describe(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def failed_collective(exception: BaseException) -> bool:
    """A collective's error: torch's backend errors, and gloo's timeouts, which it raises as plain RuntimeErrors."""
    return isinstance(exception, DistBackendError) or (
        isinstance(exception, RuntimeError) and "timed out" in str(exception).lower()
    )


def name_the_silent_rank(exception: BaseException, heartbeat: Heartbeat | None, world_size: int) -> None:
    """Add every rank's last heartbeat to ``exception`` when a collective failed: the error itself names no rank."""
    if heartbeat is None or not failed_collective(exception):
        return
    report = "lightdist: the ranks' last heartbeats:\n" + describe_ranks(
        heartbeat.store, world_size, heartbeat.interval_s
    )
    if hasattr(exception, "add_note"):  # Python 3.11+: printed under the error
        exception.add_note(report)
    else:
        logging.getLogger(__name__).error(report)
