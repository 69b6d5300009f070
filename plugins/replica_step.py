"""``ParallelStrategy``'s part in replica groups (``lightdist.resilience.replica_groups``): joining at ``fit``, after
refusing what a group could not train exactly as one process does; the state a group that joins receives from a live
one, rank by rank; and each optimizer step taken in a quorum."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightdist.parallel.sharding import local_tensor
from lightdist.plugins.checkpoint_io import ShardedCheckpointIO
from lightdist.resilience.replica_groups import ReplicaGroup, ReplicaGroups, StepNotCommitted

if TYPE_CHECKING:
    from lightdist.plugins.checkpointing_strategy import CheckpointingStrategy
    from lightdist.plugins.token_weights import TokenWeights

__all__ = ["LiveState", "join_replica_group", "step_in_quorum"]


def join_replica_group(
    options: ReplicaGroups | None, strategy: CheckpointingStrategy, weights: TokenWeights
) -> ReplicaGroup | None:
    """This rank's place among the replica groups, joined (and healed, where the others have stepped); ``None``
    where the run trains in one launch. ``weights``: how the strategy's steps weigh their losses."""
    if options is None:
        return None
    trainer = strategy.lightning_module.trainer
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
    live = LiveState(strategy)
    trainer.callbacks.append(live)
    group = ReplicaGroup(options, dist.get_rank(), dist.get_world_size(), strategy.root_device, live.state, live.heal)
    if weights.countable and not weights.batches_alike:  # each step's loss weighs by its tokens, over every group's
        weights.replica_group, group.weigh_rows = group, False
    group.join()
    return group


class LiveState(Callback):
    """What the same rank of a group that joins receives from this one: Lightning's checkpoint as a save at the end
    of the last committed step holds it (loops, data position, LR schedulers, callbacks, random state), and this
    rank's shards of the weights and optimizer state as they stand. Those change only when the step under way
    commits, which torchft holds back until the group that joins has read them.

    Checkpoints keep torchft's step count (this callback's state), so that a run restarted from one counts on where
    it stopped, as Lightning's ``global_step`` does."""

    def __init__(self, strategy: CheckpointingStrategy) -> None:
        self.strategy = strategy
        self._saved: dict[str, Any] | None = None  # at the end of the last committed step

    def state_dict(self) -> dict[str, Any]:
        return {"torchft": self.strategy.replica_group.manager.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.replica_group.manager.load_state_dict(state_dict["torchft"])

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self._saved = self.strategy.live_checkpoint()

    def state(self) -> dict[str, Any]:
        return {
            "checkpoint": self._saved,
            "shards": apply_to_collection(_training_state(self.strategy), Tensor, local_tensor),
        }

    def heal(self, received: dict[str, Any]) -> None:
        strategy = self.strategy
        module = strategy.lightning_module
        state = _training_state(strategy)
        with torch.no_grad():
            _fill(state, received["shards"])
        set_model_state_dict(module, state["state_dict"])
        for index, optimizer in enumerate(strategy.optimizers):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{index}"])
        strategy.resume_from_live(received["checkpoint"])


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


def _training_state(strategy: CheckpointingStrategy) -> dict[str, Any]:
    """The module's and optimizers' state as DCP's state-dict functions give it: this rank's shards, by name."""
    module = strategy.lightning_module
    state = {"state_dict": get_model_state_dict(module)}
    for index, optimizer in enumerate(strategy.optimizers):
        state[f"optimizer_{index}"] = get_optimizer_state_dict(module, optimizer)
    return state


def _fill(tree: dict[str, Any], received: dict[str, Any]) -> None:
    """Copy ``received``'s tensors into ``tree``'s (its shards, of the same shapes) and take its other values."""
    for key, value in tree.items():
        if isinstance(value, Tensor):
            local_tensor(value).copy_(received[key])
        elif isinstance(value, dict):
            _fill(value, received[key])
        else:
            tree[key] = received[key]
