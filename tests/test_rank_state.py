"""Where each rank stood when the checkpoint was saved, and which of it a resumed rank takes back.

The whole path (a run saved mid-epoch, shuffled and with dropout, resumed to the same losses) is tested in
tests/test_storage_faults.py; here, what happens when the resumed run is not laid out as the saved one was.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from lightdist.layout import ParallelLayout
from lightdist.plugins.rank_state import take_rank_state
from lightdist.resilience.rng import rng_state


def saved_mid_epoch(
    data_parallel_size: int,
    tensor_parallel_size: int = 1,
    last_batch: bool = False,
    in_turn: bool = False,
    samples_drawn: int = 12,
) -> dict[str, Any]:
    """Rank 0's checkpoint of a run whose data-parallel ranks each read their own shard, 3 batches in, each rank's
    sampler ``samples_drawn`` samples in, as torchdata's StatefulDataLoader keeps them; ``in_turn``: the ranks were
    dealt samples in turn (DistributedSampler)."""
    every_rank = [
        {
            "rng": rng_state(torch.device("cpu")) | {"rank": rank},
            "data_parallel": (rank // tensor_parallel_size, data_parallel_size),
            "loaders": [
                {
                    "shard": rank // tensor_parallel_size,
                    "_num_yielded": 3,
                    "_sampler_iter_state": {"samples_yielded": samples_drawn},
                }
            ],
            "in_turn": in_turn,
        }
        for rank in range(data_parallel_size * tensor_parallel_size)
    ]
    fit_loop = {
        "state_dict": {"combined_loader": every_rank[0]["loaders"]},
        "epoch_loop.batch_progress": {"is_last_batch": last_batch},
    }
    layout = {"pp": 1, "dp": data_parallel_size, "tp": tensor_parallel_size}
    return {"loops": {"fit_loop": fit_loop}, "lightdist_ranks": every_rank, "lightdist_layout": layout}


def loader_position(checkpoint: dict[str, Any]) -> Any:
    return checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")


def test_each_rank_resumes_its_own_shard_position_and_random_state() -> None:
    checkpoint = saved_mid_epoch(data_parallel_size=2, tensor_parallel_size=2)
    rng = take_rank_state(checkpoint, rank=3, layout=ParallelLayout(pp=1, dp=2, tp=2), data_parallel=(1, 2))
    assert loader_position(checkpoint) == [
        {"shard": 1, "_num_yielded": 3, "_sampler_iter_state": {"samples_yielded": 12}}
    ]
    assert rng["rank"] == 3
    assert "lightdist_ranks" not in checkpoint  # Lightning sees only its own keys
    assert "lightdist_layout" not in checkpoint


def test_a_resume_under_another_layout_names_the_layout_it_was_saved_under(caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = saved_mid_epoch(data_parallel_size=2, tensor_parallel_size=2)
    with caplog.at_level(logging.INFO):
        take_rank_state(checkpoint, rank=0, layout=ParallelLayout(pp=2, dp=2, tp=1), data_parallel=(0, 2))
    assert "saved under pp=1 x dp=2 x tp=2 and is resharded for this run's pp=2 x dp=2 x tp=1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        take_rank_state(saved_mid_epoch(2, 2), rank=0, layout=ParallelLayout(pp=1, dp=2, tp=2), data_parallel=(0, 2))
    assert "saved under" not in caplog.text  # the same layout: nothing to say


def test_another_tensor_parallel_size_keeps_the_position_but_not_the_random_state() -> None:
    checkpoint = saved_mid_epoch(data_parallel_size=2, tensor_parallel_size=2)
    assert take_rank_state(checkpoint, rank=1, layout=ParallelLayout(pp=1, dp=2, tp=1), data_parallel=(1, 2)) is None
    assert loader_position(checkpoint) == [
        {"shard": 1, "_num_yielded": 3, "_sampler_iter_state": {"samples_yielded": 12}}
    ]


@pytest.mark.parametrize(("ranks", "samples_each"), [(4, 6), (1, 24), (3, 8)])
def test_ranks_dealt_samples_in_turn_resume_on_another_data_parallel_size_where_the_epoch_stood(
    ranks: int, samples_each: int
) -> None:
    """2 ranks that drew 12 samples each drew the epoch's first 24: the new ranks draw theirs after those."""
    checkpoint = saved_mid_epoch(data_parallel_size=2, in_turn=True)
    take_rank_state(checkpoint, rank=0, layout=ParallelLayout(pp=1, dp=ranks, tp=1), data_parallel=(0, ranks))
    position = {"shard": 0, "_num_yielded": 3, "_sampler_iter_state": {"samples_yielded": samples_each}}
    assert loader_position(checkpoint) == [position]


@pytest.mark.parametrize(
    ("saved", "why"),
    [
        ({"in_turn": False}, "each rank read a shard of its own"),
        ({"in_turn": True, "samples_drawn": 7}, "2 ranks x 7 samples do not split over 4"),
    ],
)
def test_another_data_parallel_size_starts_the_interrupted_epoch_again_and_says_so(
    saved: dict[str, Any], why: str
) -> None:
    checkpoint = saved_mid_epoch(data_parallel_size=2, **saved)
    with pytest.warns(UserWarning, match="saved mid-epoch by 2 data-parallel ranks and resumes on 4"):
        take_rank_state(checkpoint, rank=0, layout=ParallelLayout(pp=1, dp=4, tp=1), data_parallel=(0, 4))
    assert loader_position(checkpoint) is None, why


def test_a_checkpoint_saved_on_the_last_batch_of_an_epoch_resumes_at_the_next_epochs_first() -> None:
    checkpoint = saved_mid_epoch(data_parallel_size=2, last_batch=True)
    take_rank_state(checkpoint, rank=0, layout=ParallelLayout(pp=1, dp=2, tp=1), data_parallel=(0, 2))
    assert loader_position(checkpoint) is None
