"""The private names of torch that lightdist relies on, in one place.

torch promises nothing about its private names: an upgrade may rename or change any of them. lightdist reaches each
through this module only, and ``tests/test_internals.py`` pins the behaviour relied on, so that an upgrade fails in
that test, naming the name, rather than in a user's run. Tested with torch 2.11 and 2.13.

Each name is here because torch has no public way to do the same yet:

- ``torch.distributed.checkpoint._fsspec_filesystem``: DCP's reader and writer for fsspec URLs (s3://, gs://).
- ``torch.distributed._composable``: ``replicate`` on FSDP2's machinery (ZeRO-0), which torchtitan uses too.
- ``torch.distributed.pipelining._IR``: moving a traced stage's factory calls to this rank's device.
- ``torch._subclasses.fake_tensor``, ``torch.testing._internal.distributed.fake_pg``: shapes without memory, and a
  process group without processes, for the planner and ``lightdist plan``.
- ``torch.distributed.distributed_c10d``: the default store, and a group's timeout.
- ``Tensor._base``, ``UntypedStorage._cdata``, ``Module._orig_forward`` (set by torch's pipelining tracer), and the
  aten attention ops' names.

``SUBCLASS_PRIVATES`` lists the private members of torch's classes that lightdist's subclasses override or call.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout
from torch.distributed.tensor.parallel import ParallelStyle
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "ATTENTION_OPS",
    "SUBCLASS_PRIVATES",
    "FakeStore",
    "FakeTensorMode",
    "FsspecReader",
    "FsspecWriter",
    "default_store",
    "drop_pipeline_split_markers",
    "is_view",
    "move_graph_to_device",
    "replicate",
    "set_group_timeout",
    "storage_key",
    "style_io_hooks",
]

# Private members of torch's classes that lightdist's subclasses override or call, and why.
SUBCLASS_PRIVATES = {
    "_apply": "ParallelStyle's one abstract method: how a tensor-parallel style splits a module",
    "_prepare_input_fn": "ColwiseParallel's input hook, reused by the styles that wrap it",
    "_prepare_output_fn": "RowwiseParallel's and ColwiseParallel's output hooks, reused likewise",
    "_get_metadata_path": "FileSystemReader's path of a checkpoint's index, which the safe reader opens",
}

# The attention ops whose outputs selective activation checkpointing keeps: aten's names, one per backend.
ATTENTION_OPS = (
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
)


def default_store() -> dist.Store:
    """The default process group's store, every rank's: heartbeats go there, readable by whichever rank times out."""
    return _get_default_store()


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """``group``'s collectives wait ``timeout``: a DeviceMesh makes its groups with torch's default timeout, not the
    one the world was started with, and has no option to pass one."""
    _set_pg_timeout(timeout, group)


def is_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's memory."""
    return tensor._base is not None


def storage_key(tensor: Tensor) -> int:
    """One key per storage, also for meta and fake tensors, whose data pointers are all 0."""
    return tensor.untyped_storage()._cdata


def drop_pipeline_split_markers(block: nn.Module) -> None:
    """Take off ``block`` the forward wrapper torch's ``pipeline()`` tracer leaves on a split point."""
    del block.forward, block._orig_forward


def move_graph_to_device(stage: torch.fx.GraphModule, device: torch.device) -> None:
    """Make a traced stage's factory calls (``torch.zeros(..., device=...)``) make tensors on ``device``: the tracer
    records the example's device in them."""
    # Imported here: the tracer's module loads torch's compiler stack, which only a traced pipeline needs.
    from torch.distributed.pipelining._IR import _modify_graph_op_device

    _modify_graph_op_device(stage, device)


def style_io_hooks(style: ParallelStyle) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The input and output hooks of a Colwise or Rowwise style, as ``distribute_module`` takes them: for a module
    split another way than the style splits its weight, whose inputs and outputs still go as the style's."""
    return (
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )
