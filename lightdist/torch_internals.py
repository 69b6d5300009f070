"""The private names of torch that lightdist relies on, in one place.

torch promises nothing about its private names: an upgrade may rename or change any of them. lightdist reaches each
through this module only, and ``tests/test_internals.py`` pins the behaviour relied on, so that an upgrade fails in
that test, naming the name, rather than in a user's run. Tested with torch 2.11 and 2.13.

Each name is here because torch has no public way to do the same yet:

- ``torch.distributed.checkpoint._fsspec_filesystem``: DCP's reader and writer for fsspec URLs (s3://, gs://).
- ``torch._subclasses.fake_tensor``, ``torch.testing._internal.distributed.fake_pg``: shapes without memory, and a
  process group without processes, for the planner and ``lightdist plan``.
- ``torch.distributed.distributed_c10d``: a group's timeout.
- ``Tensor._base``: whether a tensor is a view.

``SUBCLASS_PRIVATES`` lists the private members of torch's classes that lightdist's subclasses override or call.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "SUBCLASS_PRIVATES",
    "FakeStore",
    "FakeTensorMode",
    "FsspecReader",
    "FsspecWriter",
    "is_view",
    "set_group_timeout",
]

# Private members of torch's classes that lightdist's subclasses override or call, and why.
SUBCLASS_PRIVATES = {
    "_apply": "ParallelStyle's one abstract method: how a tensor-parallel style splits a module",
}


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """``group``'s collectives wait ``timeout``: a DeviceMesh makes its groups with torch's default timeout, not the
    one the world was started with, and has no option to pass one."""
    _set_pg_timeout(timeout, group)


def is_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's memory."""
    return tensor._base is not None
