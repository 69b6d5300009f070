"""The private names of torch that lightdist relies on, in one place.

torch promises nothing about its private names: an upgrade may rename or change any of them. lightdist reaches each
through this module only, and ``tests/test_internals.py`` pins the behaviour relied on, so that an upgrade fails in
that test, naming the name, rather than in a user's run. Tested with torch 2.11 and 2.13.

Each name is here because torch has no public way to do the same yet:

- ``torch.distributed.checkpoint._fsspec_filesystem``: DCP's reader and writer for fsspec URLs (s3://, gs://).
- ``torch.distributed.checkpoint._async_process_executor``: what DCP's checkpoint process runs first.
- ``torch._subclasses.fake_tensor``: shapes without memory, for the planner.
- ``torch.distributed.distributed_c10d``: a group's timeout.
- ``Tensor._base``: whether a tensor is a view.
- ``torch.overrides._get_current_function_mode_stack``: the ``TorchFunctionMode``s a checkpointed block ran under,
  entered again where backward recomputes it (torch leaves a mode while the mode handles ``backward``); and those a
  mode is entered beneath (``entered_beneath``).

``SUBCLASS_PRIVATES`` lists the private members of torch's classes that lightdist's subclasses override or call.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from lightdist.quiet import silence_known_noise

__all__ = [
    "SUBCLASS_PRIVATES",
    "FakeTensorMode",
    "FsspecReader",
    "FsspecWriter",
    "adopt_checkpoint_processes",
    "entered_beneath",
    "is_view",
    "set_group_timeout",
    "torch_function_modes",
]

# Private members of torch's classes that lightdist's subclasses override or call, and why.
SUBCLASS_PRIVATES = {
    "_apply": "ParallelStyle's one abstract method: how a tensor-parallel style splits a module",
    "_to_tensor": "PipelineStage (torch 2.13): the tensors a stage learns its output shapes on, made from shapes",
}


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """``group``'s collectives wait ``timeout``: a DeviceMesh makes its groups with torch's default timeout, not the
    one the world was started with, and has no option to pass one."""
    _set_pg_timeout(timeout, group)


def torch_function_modes() -> list[TorchFunctionMode]:
    """The ``TorchFunctionMode``s entered now, outermost first."""
    return _get_current_function_mode_stack()


@contextmanager
def entered_beneath(mode: TorchFunctionMode) -> Iterator[None]:
    """``mode`` entered beneath the ``TorchFunctionMode``s entered now, as if it had been entered before them: each of
    them sees a call first and may change it on its way to ``mode``. torch has no public way to do so; the base
    class's own ``__enter__`` and ``__exit__`` push a mode on the stack and pop its top, without what subclasses
    add to them."""
    above = torch_function_modes()
    _pop_top(len(above))
    for entered in (mode, *above):
        TorchFunctionMode.__enter__(entered)
    try:
        yield
    finally:
        _pop_top(len(above) + 1)
        for entered in above:
            TorchFunctionMode.__enter__(entered)


def _pop_top(count: int) -> None:
    for _ in range(count):
        TorchFunctionMode.__exit__(None, None, None, None)


def is_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's memory."""
    return tensor._base is not None


# torch's own first function of the checkpoint process, kept before adopt_checkpoint_processes replaces it.
_checkpoint_process_main = _AsyncCheckpointProcess._checkpointing_subprocess


def adopt_checkpoint_processes() -> None:
    """DCP's checkpoint process, which torch starts per rank by spawn, runs lightdist's function first: it installs
    lightdist's filters before it logs, and it ends when its rank does.

    It logs each step of its start and every save request on the root logger, at INFO. Spawned, it inherits no
    filters, and imports only the script that started the rank, not what that script imports in ``main()``: without
    this, its lines show wherever the script does not import lightdist as it loads. Its first function is torch's
    own, called from lightdist's, which the process imports by name (and with it ``lightdist/quiet.py``).

    torch ends it from its rank's exit handlers, which a SIGKILLed rank (the kernel's out-of-memory killer, a lost
    node's torchrun) never runs: the process then waits forever on its pipe or on the other ranks' checkpoint
    processes, holding its staged copy of the state.
    """
    _AsyncCheckpointProcess._checkpointing_subprocess = staticmethod(_adopted_checkpoint_process)


def _adopted_checkpoint_process(*args: Any) -> None:
    silence_known_noise()
    _end_when_parent_ends()
    _checkpoint_process_main(*args)


def _end_when_parent_ends(poll_s: float = 1.0) -> None:
    """Exit this spawned process within ``poll_s`` of its parent's end, or at once if it has ended already (a rank
    killed while this process was still starting): the kernel then gives it another parent."""
    parent = multiprocessing.parent_process().pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="lightdist-parent-watch", daemon=True).start()
