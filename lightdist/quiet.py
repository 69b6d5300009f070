"""Third-party messages that tell a lightdist user nothing, silenced where they come from, each narrowly.

Installed as lightdist is imported, in every process it runs in: the ranks, and the checkpoint process torch starts
per rank, which runs lightdist's function first (``torch_internals.adopt_checkpoint_processes``) whatever the script
that started the rank imports, and where (the ``lightdist`` command, ``python -m lightdist``, a user's ``train.py``
importing lightdist in its ``main()``). A user's own warnings and logs, and any other message of these packages, still
show. ``LIGHTDIST_LOG=debug`` (``lightdist ... --verbose``), which child processes inherit, shows these too.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

__all__ = ["silence_known_noise", "verbose"]


def verbose() -> bool:
    """Whether the user asked for every message: ``LIGHTDIST_LOG=debug``, which child processes inherit."""
    return os.environ.get("LIGHTDIST_LOG", "").lower() == "debug"


class _Drop(logging.Filter):
    """Drops the records below ``WARNING`` logged from the file ending ``path``, and those whose message starts with
    a match of the regular expression ``message``, unless the user asked for every message."""

    def __init__(self, *, path: str = "", message: str = "") -> None:
        super().__init__()
        self.path, self.message = path, re.compile(message)

    def filter(self, record: logging.LogRecord) -> bool:
        if verbose():
            return True
        if self.path:
            return record.levelno >= logging.WARNING or not record.pathname.endswith(self.path)
        return not self.message.match(record.getMessage())


def silence_known_noise() -> None:
    """Install the filters; a second call adds none."""
    root = logging.getLogger()
    if not any(isinstance(existing, _Drop) for existing in root.filters):
        # torch's checkpoint process sets the root logger to INFO in its own process and logs each save request on
        # it: "Waiting for checkpoint save request..." once per rank and save.
        root.addFilter(_Drop(path=os.path.join("torch", "distributed", "checkpoint", "_async_process_executor.py")))
        # The same process unpickles the DTensors it saves, without the ranks' process groups, and torch warns that
        # torch.compile could not look them up there: nothing is compiled in it.
        logging.getLogger("torch.distributed.device_mesh").addFilter(
            _Drop(message="It seems like pickling/unpickling of the DeviceMesh occurred before the PGs were created")
        )
        # DTensor's hint, once per rank, that the gradient norm's reduction over dp and tp takes two all-reduces where a
        # flattened mesh would take one: of one number per step, which a process group more would not repay.
        logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
            _Drop(message=r"While redistributing from \(_NormPartial")
        )
        # A line every rank prints alike, which rank 0 prints too: its seed.
        logging.getLogger("lightning.fabric.utilities.seed").addFilter(_Drop(message=r"\[rank: [1-9]\d*\] Seed set"))
        # Lightning's advertisement for its paid logger, on every run.
        logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_Drop(message="💡 Tip:"))
    if not verbose():
        # torch's profiler (kineto, in C++) prints each stage of every profile it takes ("Completed Stage: Warm Up")
        # below its errors; it reads the level as each profile starts.
        os.environ.setdefault("KINETO_LOG_LEVEL", "4")
    _ignore_known_warnings()


def _ignore_known_warnings() -> None:
    """Python's warning filters, which also a test runner resets: installed each time (an identical filter replaces
    itself)."""
    if not verbose():
        # torchdata's StatefulDataLoader calls torch.set_vital, which torch has deprecated: not the user's to fix.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning, module="torchdata")
        # Lightning 2.6 asks torch's pytree in a way torch 2.11+ deprecates: not the user's to fix either.
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
