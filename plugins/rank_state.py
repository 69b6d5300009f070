"""Where each rank stood: its random state and its data loader's position, for a resumed run to stand there again.

Lightning's checkpoint is rank 0's alone and holds no random state. Dropout masks differ between ranks (pipeline
stages draw different numbers altogether), and a data loader over one data-parallel rank's shard may keep a state of
its own, so rank 0 gathers every rank's into the checkpoint and each rank takes back its own on resume.

A run resumed on another number of data-parallel ranks (an elastic restart on the nodes left) has no saved state of
its own. Where the loaders deal samples to the ranks in turn, as torch's ``DistributedSampler`` does, ``d`` ranks that
have each drawn ``n`` samples have drawn the epoch's first ``d * n`` between them, whatever ``d``: the new ranks start
after as many, and the epoch goes on where it stood.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DistributedSampler

from lightdist.layout import ParallelLayout
from lightdist.resilience.rng import rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["deal_samples_in_turn", "gather_rank_states", "set_epoch_to_train", "take_rank_state"]

_KEY = "lightdist_ranks"
_LAYOUT = "lightdist_layout"
_LOADERS = "combined_loader"  # the fit loop's data loader states, in Lightning's checkpoint


def deal_samples_in_turn(train_dataloader: Any) -> bool:
    """Whether every training loader (Lightning's ``CombinedLoader`` holds them) deals samples to the data-parallel
    ranks in turn, so that one rank's position says how far the whole epoch has gone."""
    loaders = getattr(train_dataloader, "flattened", [train_dataloader]) if train_dataloader is not None else []
    return bool(loaders) and all(isinstance(getattr(loader, "sampler", None), DistributedSampler) for loader in loaders)


def set_epoch_to_train(dataloader: Any, trainer: pl.Trainer) -> None:
    """Give ``dataloader``'s sampler the epoch the fit loop is about to train, before Lightning makes its iterator.

    Lightning (2.6) makes the training loader's iterator before it sets the epoch on the sampler, and torch's
    ``DistributedSampler`` draws its order as the iterator is made: a run resumed in epoch 1 or later would deal
    epoch 0's order, from its first batch after an epoch's end, or fast-forwarded to the saved position in mid-epoch.
    An epoch whose batches are all drawn (``is_last_batch``) but not yet counted done is over: the next one is
    trained."""
    epochs = trainer.fit_loop.epoch_progress.current
    ended = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and epochs.ready > epochs.processed
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epochs.processed + int(ended))


def gather_rank_states(
    checkpoint: dict[str, Any],
    device: torch.device,
    layout: ParallelLayout,
    data_parallel: tuple[int, int],
    in_turn: bool,
    epoch_done: bool,
    *,
    alone: bool = False,
) -> None:
    """Add the layout, and every rank's random state and data loader position, to rank 0's ``checkpoint``; every
    rank calls it.

    ``data_parallel``: this rank's (index, size) among the data-parallel ranks, which is what its loader's shard
    depends on. ``in_turn``: whether its loaders deal samples to the ranks in turn (``deal_samples_in_turn``).
    ``epoch_done``: whether the epoch's batches are all drawn. Lightning's ``is_last_batch`` says so only where the
    loader ran out, not where ``limit_train_batches`` ended the epoch first, and a run resumed from such a checkpoint
    would train on the whole epoch again: the checkpoint says it, for Lightning to start the next epoch.
    ``alone``: this rank's state stands for every rank's, with no collective: the ``checkpoint`` a replica group that
    joins receives rank by rank from a live one, each rank from the rank in its place, which holds the same shard.
    """
    checkpoint[_LAYOUT] = asdict(layout)
    if epoch_done:
        _fit_loop(checkpoint).get("epoch_loop.batch_progress", {})["is_last_batch"] = True
    loaders = _fit_loop(checkpoint).get("state_dict", {}).get(_LOADERS)
    own = {"rng": rng_state(device), "data_parallel": data_parallel, "loaders": loaders, "in_turn": in_turn}
    if alone:
        checkpoint[_KEY] = [own] * layout.world_size
        return
    every_rank = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(own, every_rank, dst=0)
    checkpoint[_KEY] = every_rank


def take_rank_state(
    checkpoint: dict[str, Any], *, rank: int, layout: ParallelLayout, data_parallel: tuple[int, int]
) -> dict[str, Any] | None:
    """Put this rank's data loader position where Lightning restores it from, and return its random state, to be
    restored when training starts; ``None`` where no saved rank's draws would continue here. Says so where the
    checkpoint was saved under another layout than ``layout``, this run's.

    A checkpoint saved on an epoch's last batch keeps no position: Lightning would restore it whenever training counts
    steps, and a loader that ``limit_train_batches`` cut short would start the next epoch where this one stopped.
    """
    saved_layout = ParallelLayout(**checkpoint.pop(_LAYOUT)) if _LAYOUT in checkpoint else layout
    if saved_layout != layout:
        rank_zero_info(
            f"lightdist: the checkpoint was saved under {saved_layout} and is resharded for this run's {layout}"
        )
    every_rank = checkpoint.pop(_KEY, None)
    fit_loop = _fit_loop(checkpoint)
    loop_state = fit_loop.get("state_dict", {})
    if fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
        loop_state.pop(_LOADERS, None)
    if every_rank is None:  # saved by another strategy
        return None
    if _LOADERS in loop_state:
        position = _position_here(every_rank, data_parallel)
        if position is not None:
            loop_state[_LOADERS] = position
        else:
            del loop_state[_LOADERS]
            rank_zero_warn(
                f"lightdist: the checkpoint was saved mid-epoch by {every_rank[0]['data_parallel'][1]} data-parallel"
                f" ranks and resumes on {data_parallel[1]}, and its loaders' positions do not carry over: they did not"
                " deal samples to the ranks in turn (torch's DistributedSampler does), or their samples drawn do not"
                " split evenly over the new ranks. The interrupted epoch starts again from its first batch. Resume at"
                " an epoch boundary, or on as many data-parallel ranks, to see each sample once."
            )
    if len(every_rank) != layout.world_size:
        rank_zero_info(
            f"lightdist: the checkpoint holds the random states of {len(every_rank)} ranks, not {layout.world_size}:"
            " each rank keeps its seeded random state, so dropout draws other masks than the saved run would have."
        )
        return None
    return every_rank[rank]["rng"]


def _position_here(every_rank: list[dict[str, Any]], data_parallel: tuple[int, int]) -> Any:
    """This rank's loader states: those its shard saved, or those of another number of ranks dealt samples in turn
    and moved to as many samples drawn in all; ``None`` where neither applies."""
    same_shard = [saved["loaders"] for saved in every_rank if saved["data_parallel"] == data_parallel]
    if same_shard:
        return same_shard[0]
    saved = every_rank[0]
    if not saved.get("in_turn"):
        return None
    try:
        return _samples_drawn_over(saved["loaders"], saved["data_parallel"][1], data_parallel[1])
    except ValueError:
        return None


def _samples_drawn_over(state: Any, saved_ranks: int, ranks: int) -> Any:
    """``state`` with every sampler's ``samples_yielded`` (torchdata's ``StatefulDataLoader`` counts them) moved from
    ``saved_ranks`` ranks to ``ranks``. Batch counts stay: Lightning's step count, which they follow, stays too."""
    if isinstance(state, dict):
        moved = {key: _samples_drawn_over(value, saved_ranks, ranks) for key, value in state.items()}
        if isinstance(state.get("samples_yielded"), int):
            drawn = state["samples_yielded"] * saved_ranks
            if drawn % ranks:
                raise ValueError(f"{drawn} samples drawn do not split over {ranks} ranks")
            moved["samples_yielded"] = drawn // ranks
        return moved
    if isinstance(state, list):
        return [_samples_drawn_over(value, saved_ranks, ranks) for value in state]
    return state


def _fit_loop(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The fit loop's part of Lightning's checkpoint: its progress counters, and its data loaders' positions."""
    return checkpoint.get("loops", {}).get("fit_loop", {})
