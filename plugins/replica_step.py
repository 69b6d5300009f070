"""``ParallelStrategy``'s part in replica groups (``lightdist.resilience.replica_groups``): joining at ``fit``, after
refusing what a group could not train exactly as one process does, and each optimizer step taken in a quorum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.optim import Optimizer

from lightdist.plugins.checkpoint_io import ShardedCheckpointIO
from lightdist.plugins.steps import Steps
from lightdist.resilience.replica_groups import ReplicaGroup, ReplicaGroups, StepNotCommitted

__all__ = ["join_replica_group", "step_in_quorum"]


def join_replica_group(
    options: ReplicaGroups | None, trainer: Trainer, steps: Steps, device: torch.device
) -> ReplicaGroup | None:
    """This rank's place among the replica groups, or ``None`` where the run trains in one launch."""
    if options is None:
        return None
    if not trainer.lightning_module.automatic_optimization:
        raise ValueError(
            "replica_groups take each step's quorum around Lightning's optimizer step, which manual optimization "
            "(automatic_optimization=False) calls itself: use automatic optimization, or train in one launch."
        )
    if trainer.accumulate_grad_batches > 1:
        raise ValueError(
            f"replica_groups redo a step a group failed in on the same batch, but accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches} spreads a step over batches already used: raise the batch size in "
            "its place, or set accumulate_grad_batches=1."
        )
    if steps.token_weights.countable and not steps.token_weights.batches_alike:
        raise ValueError(
            "replica_groups weigh each group's share of a batch by its samples, but this model's steps weigh by "
            "their labelled tokens (loss_weighting='tokens'), which are not yet counted across groups: set "
            "loss_weighting='batches', or train in one launch."
        )
    return ReplicaGroup(options, dist.get_rank(), dist.get_world_size(), device)


def step_in_quorum(
    group: ReplicaGroup | None, attempt: Callable[[], Any], optimizer: Optimizer, checkpoint_io: ShardedCheckpointIO
) -> Any:
    """``attempt`` (Lightning's optimizer step on its closure) in the step's quorum, again under the next quorum
    while a group fails during it: the survivors redo the step on the same batch."""
    if group is None:
        return attempt()
    while True:
        group.start_step()
        try:
            stepped = attempt()
        except StepNotCommitted:
            optimizer.zero_grad(set_to_none=True)
            continue
        checkpoint_io.writes = group.place == 0  # the group first in the step's quorum saves the checkpoints
        return stepped
