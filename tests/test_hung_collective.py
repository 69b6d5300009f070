"""A rank that stops answering fails the others' next collective after ``collective_timeout``, not never, and the
error names it: each rank's heartbeat says whether it still lives, at which step, and where."""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer, seed_everything

from lightdist.models import Llama, TokenDataModule
from lightdist.plugins import ParallelStrategy

from multirank import run_ranks

pytestmark = pytest.mark.multirank

TIMEOUT_S = 4.0


class StrategyFrozenOnRankOne(ParallelStrategy):
    """Rank 1 stops itself (SIGSTOP) right after its heartbeat as step 2 starts, as a machine that hangs would stop it.

    Stopped anywhere later in the step, the heartbeat's own thread may beat once more before the stop and report where
    the step was then (an all-gather, say): true, but not the place this test can name."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        freeze = self.global_rank == 1 and self.lightning_module.trainer.global_step == 2
        super().on_train_batch_start(batch, batch_idx)
        if freeze:
            os.kill(os.getpid(), signal.SIGSTOP)


def train_until_rank_one_freezes(pids: str) -> tuple[str, float]:
    """What the run raised on this rank, and after how many seconds of waiting; rank 0 then lets rank 1 go on."""
    rank = int(os.environ["RANK"])
    Path(pids, str(rank)).write_text(str(os.getpid()))
    seed_everything(1234)
    trainer = Trainer(
        accelerator="cpu",
        devices=4,
        strategy=StrategyFrozenOnRankOne(tensor_parallel_size=2, collective_timeout=TIMEOUT_S),  # tp in pairs, dp=2
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.monotonic()
    try:
        data = TokenDataModule(seq_len=32, batch_size=4, synthetic_tokens=1 << 16)
        trainer.fit(Llama("tiny"), datamodule=data)
    except Exception as error:
        if rank == 0:
            os.kill(int(Path(pids, "1").read_text()), signal.SIGCONT)
        return "".join(traceback.format_exception(error)), time.monotonic() - start
    return "", time.monotonic() - start


def test_a_frozen_rank_is_named_when_the_collective_it_left_times_out(tmp_path: Path) -> None:
    (error, waited), *_ = run_ranks(4, train_until_rank_one_freezes, str(tmp_path))
    assert "Timed out waiting" in error
    assert waited < 60  # the two first steps, then 4 s of waiting: never torch's 30 minutes
    report = error.split("lightdist: the ranks' last heartbeats:\n")[1].splitlines()
    assert report[0].startswith("rank 0: alive, at step 2, in ")
    assert report[1].startswith("rank 1: stopped answering ")
    # Its last beat was the one as step 2 started: the step it froze in.
    assert "(killed, frozen, or its machine lost), at step 2, in on_train_batch_start (" in report[1]


def test_a_collective_timeout_must_be_a_positive_number_of_seconds() -> None:
    with pytest.raises(ValueError, match=r"collective_timeout=0 must be a positive number of seconds"):
        ParallelStrategy(collective_timeout=0)
