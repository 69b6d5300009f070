"""Data parallelism with ZeRO stages 0-3, on torch's own parts.

| stage | parameters  | gradients          | optimizer state | how                                           |
|-------|-------------|--------------------|-----------------|-----------------------------------------------|
| 0     | replicated  | all-reduced        | replicated      | composable ``replicate`` (DDP)                |
| 1     | replicated  | all-reduced        | sharded         | ``replicate`` + ``ZeroRedundancyOptimizer``   |
| 2     | gathered once per step | reduce-scattered | sharded | FSDP2, ``reshard_after_forward=False``        |
| 3     | sharded     | reduce-scattered   | sharded         | FSDP2, ``reshard_after_forward=True``         |

FSDP2 is applied per decoder block and then at the root, so each block's parameters are gathered in one collective
just before use and freed after it.
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightdist.structure import DecoderStack

__all__ = ["ZeroStage", "apply_data_parallel", "shard_optimizer_state"]

ZeroStage = Literal[0, 1, 2, 3]


def apply_data_parallel(
    root: nn.Module,
    stack: DecoderStack,
    dp_mesh: DeviceMesh,
    *,
    zero_stage: ZeroStage,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> None:
    """Make ``root`` data parallel over ``dp_mesh``, sharding as much as ``zero_stage`` asks.

    ``param_dtype`` is the compute dtype of FSDP2's mixed precision (stages 2-3); gradients are always reduced in
    fp32. Stages 0-1 keep parameters as they are and leave mixed precision to autocast.
    """
    if zero_stage in (0, 1):
        replicate(root, process_group=dp_mesh.get_group())
        return
    fsdp_options = dict(
        mesh=dp_mesh,
        reshard_after_forward=zero_stage == 3,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    for block in stack.blocks:
        fully_shard(block, **fsdp_options)
    fully_shard(root, **fsdp_options)


def shard_optimizer_state(optimizer: Optimizer, dp_mesh: DeviceMesh) -> ZeroRedundancyOptimizer:
    """ZeRO-1: the same optimizer class and parameter groups, each rank keeping state for its share of parameters.

    After its local step each rank broadcasts the parameters it owns, so every replica stays identical.
    """
    optimizer_class = type(optimizer)
    # `defaults` can hold derived entries the constructor does not take (AdamW's `decoupled_weight_decay`).
    accepted = inspect.signature(optimizer_class).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=optimizer_class, process_group=dp_mesh.get_group(), **defaults
    )
