"""A run saved and resumed continues exactly where it stopped: same losses, same weights, as if never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from multirank import run_ranks
from training import Case, Result, train

pytestmark = pytest.mark.multirank

EPOCH = 3  # batches per epoch: the run stops and resumes at an epoch boundary, where the data order restarts


class _StopAfter(Callback):
    """Ends the run early, as a preempted job would: its configuration (and so its LR schedule) is the full run's."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.should_stop = trainer.global_step >= self.steps


def stop_and_resume(saved_with: dict, resumed_with: dict, checkpoint: str) -> tuple[Result, Result]:
    uninterrupted = train(Case(strategy=resumed_with, steps=2 * EPOCH, limit_train_batches=EPOCH), devices=2)
    stopped = Case(strategy=saved_with, steps=2 * EPOCH, limit_train_batches=EPOCH)
    train(stopped, devices=2, callbacks=[_StopAfter(EPOCH)], save_to=checkpoint)
    resumed = train(
        Case(strategy=resumed_with, steps=2 * EPOCH, limit_train_batches=EPOCH), devices=2, resume_from=checkpoint
    )
    return uninterrupted, resumed


@pytest.mark.parametrize(
    ("saved_with", "resumed_with"),
    [
        (dict(zero_stage=0), dict(zero_stage=0)),
        (dict(zero_stage=2), dict(zero_stage=2)),
        (dict(zero_stage=3), dict(zero_stage=3)),
        (dict(zero_stage=3), dict(zero_stage=0)),  # sharded on save, replicated on load
    ],
    ids=["zero0", "zero2", "zero3", "zero3_to_zero0"],
)
def test_resumed_run_continues_the_uninterrupted_one(tmp_path: Path, saved_with: dict, resumed_with: dict) -> None:
    (uninterrupted, resumed), _ = run_ranks(2, stop_and_resume, saved_with, resumed_with, str(tmp_path / "ckpt"))

    assert len(resumed.losses) == EPOCH
    torch.testing.assert_close(resumed.losses, uninterrupted.losses[EPOCH:], rtol=1e-6, atol=0)
    for key, value in uninterrupted.params.items():
        torch.testing.assert_close(resumed.params[key], value, rtol=1e-6, atol=1e-6, msg=key)
