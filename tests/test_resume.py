"""A run saved and resumed continues exactly where it stopped: same losses, same weights, as if never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsspec import AbstractFileSystem
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


def two_epochs(batch_size: int = 4, model: str = "llama", **strategy) -> Case:
    return Case(strategy=strategy, model=model, steps=2 * EPOCH, limit_train_batches=EPOCH, batch_size=batch_size)


def stop_and_resume(saved: Case, resumed: Case, checkpoint: str) -> tuple[Result, Result]:
    uninterrupted = train(resumed, devices=2)
    train(saved, devices=2, callbacks=[_StopAfter(EPOCH)], save_to=checkpoint)
    return uninterrupted, train(resumed, devices=2, resume_from=checkpoint)


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        (two_epochs(zero_stage=0), two_epochs(zero_stage=0)),
        (two_epochs(zero_stage=1), two_epochs(zero_stage=1)),  # each rank saves and loads its own share
        (two_epochs(zero_stage=2), two_epochs(zero_stage=2)),
        (two_epochs(zero_stage=3), two_epochs(zero_stage=3)),
        (two_epochs(zero_stage=3), two_epochs(zero_stage=0)),  # sharded on save, replicated on load
        # layers split across 2 ranks on save, whole on each of 2 data-parallel ranks on load: same global batch
        (two_epochs(tensor_parallel_size=2), two_epochs(batch_size=2, zero_stage=3)),
        # GPT-2's fused qkv rows reordered per rank on save (weights and Adam moments), in the model's order on load
        (
            two_epochs(model="gpt2_no_bias", tensor_parallel_size=2),
            two_epochs(model="gpt2_no_bias", batch_size=2, zero_stage=3),
        ),
        # two pipeline stages on save, each holding half the blocks; whole models on 2 data-parallel ranks on load
        (two_epochs(pipeline_parallel_size=2), two_epochs(batch_size=2, zero_stage=3)),
        # optimizer state split by parameter on save, whole parameters split across 2 ranks on load
        (two_epochs(batch_size=2, zero_stage=1), two_epochs(tensor_parallel_size=2, zero_stage=3)),
    ],
    ids=[
        "zero0",
        "zero1",
        "zero2",
        "zero3",
        "zero3_to_zero0",
        "tp2_to_dp2",
        "gpt2_fused_qkv_tp2_to_dp2",
        "pp2_to_dp2",
        "dp2_zero1_to_tp2",
    ],
)
def test_resumed_run_continues_the_uninterrupted_one(tmp_path: Path, saved: Case, resumed: Case) -> None:
    (uninterrupted, resumed_run), _ = run_ranks(2, stop_and_resume, saved, resumed, str(tmp_path / "ckpt"))
    assert_continues(uninterrupted, resumed_run)


def test_run_resumed_from_s3_continues_the_uninterrupted_one(s3_bucket: tuple[str, AbstractFileSystem]) -> None:
    url, storage = s3_bucket
    checkpoint = f"{url}/run/step=3.ckpt"
    (uninterrupted, resumed_run), _ = run_ranks(2, stop_and_resume, two_epochs(), two_epochs(), checkpoint)
    assert_continues(uninterrupted, resumed_run)
    # Each rank wrote its own shard straight to the bucket; Lightning's loop state sits beside them.
    written = {path.rsplit("/", 1)[-1] for path in storage.ls(checkpoint.split("://", 1)[1])}
    assert written == {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"}


def assert_continues(uninterrupted: Result, resumed_run: Result) -> None:
    # The equivalence tests' tolerance: a run whose first half ran under another layout summed in another order.
    assert len(resumed_run.losses) == EPOCH
    torch.testing.assert_close(resumed_run.losses, uninterrupted.losses[EPOCH:], rtol=1e-5, atol=0)
    for key, value in uninterrupted.params.items():
        torch.testing.assert_close(resumed_run.params[key], value, rtol=1e-5, atol=1e-5, msg=key)
