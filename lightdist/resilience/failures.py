"""When ranks fail, the rank that failed first prints its traceback, once; every other rank prints one line.

Every rank prints what ends it. A bug in a training step fails every rank at once, and their tracebacks interleave
line by line; a rank that fails alone leaves the others failing in collectives after it, each with a traceback of a
broken connection that hides the cause. A store rank 0 serves says which rank failed first: the first to set a
key. Its traceback is printed as it fails, before the others' lines, which say how they ended and name it.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from types import TracebackType

from torch.distributed import Store

__all__ = ["FailureReport"]

_RUNS = itertools.count()  # every rank starts as many runs, in order: the key of each is the same on every rank


class FailureReport:
    """Reports how one multi-process run failed, in each of its ranks; ``report`` as the rank's run fails."""

    def __init__(self, store: Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self._key = f"lightdist/first_failure/{next(_RUNS)}"

    def report(self, exception: BaseException) -> None:
        """Print ``exception``'s traceback now if this rank failed first; otherwise print one line for it when it
        reaches the top of the process, where Python would print its traceback."""
        if not isinstance(exception, Exception):  # Ctrl-C and exits: every rank was told, nothing to explain
            return
        error = _one_line(exception)
        summary = f"rank {self.rank}: {error}"
        try:
            first = self.store.compare_set(self._key, "", summary).decode()
        except Exception:  # the store went with rank 0, its host, which so ended first (and printed why)
            first = None
        if first == summary:
            sys.stderr.write(f"lightdist: rank {self.rank} failed first:\n")
            traceback.print_exception(exception)
            sys.stderr.flush()
            _replace_traceback(exception, line=None)
            return
        if first is None:
            line = f"{summary}, after rank 0, which held the store of failures, exited: the first error is above"
        elif first.partition(": ")[2] == error:
            line = f"rank {self.rank} failed with the same error as {first.partition(':')[0]}, whose traceback is above"
        else:
            line = f"{summary}, after {first}, whose traceback is above"
        _replace_traceback(exception, line=f"lightdist: {line}\n")


def _one_line(exception: BaseException) -> str:
    message = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {message[0][:200]}" if message else type(exception).__name__


def _replace_traceback(exception: BaseException, line: str | None) -> None:
    """Print ``line`` (or nothing) in place of ``exception``'s traceback if it ends the process; any other uncaught
    error prints as before."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        if value is not exception:
            previous(kind, value, trace)
        elif line is not None:
            sys.stderr.write(line)

    sys.excepthook = hook
