"""A run saved and resumed continues exactly where it stopped: same losses, same weights, as if never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsspec import AbstractFileSystem

from lightdist.plugins import ModelCheckpoint

from multirank import run_ranks
from training import Case, Result, StopAfter, train

pytestmark = pytest.mark.multirank

EPOCH = 3  # batches per epoch: the run stops and resumes at an epoch boundary, where the data order restarts


def two_epochs(batch_size: int = 4, model: str = "llama", **strategy) -> Case:
    return Case(strategy=strategy, model=model, steps=2 * EPOCH, limit_train_batches=EPOCH, batch_size=batch_size)


def stop_and_resume(saved: Case, resumed: Case, checkpoint: str) -> tuple[Result, Result]:
    uninterrupted = train(resumed, devices=2)
    train(saved, devices=2, callbacks=[StopAfter(EPOCH)], save_to=checkpoint)
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


def test_run_resumed_from_s3_last_continues_the_uninterrupted_one(s3_bucket: tuple[str, AbstractFileSystem]) -> None:
    url, storage = s3_bucket
    run = f"{url}/run"
    (uninterrupted, resumed_run), _ = run_ranks(2, stop_and_resume_last, two_epochs(), run)
    assert_continues(uninterrupted, resumed_run)
    # Every step saved in the background; the two newest stayed, each complete, and last.ckpt names the newest.
    # Each rank wrote its own shard straight to the bucket; Lightning's loop state sits beside them.
    storage.invalidate_cache()
    assert sorted(path.rsplit("/", 1)[-1] for path in storage.ls(run.split("://", 1)[1])) == [
        "epoch=1-step=5.ckpt",
        "epoch=1-step=6.ckpt",
        "last.ckpt",
    ]
    newest = f"{run.split('://', 1)[1]}/epoch=1-step=6.ckpt"
    assert {path.rsplit("/", 1)[-1] for path in storage.ls(newest)} == {
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        "meta.pt",
        "COMPLETE",
    }
    assert storage.cat(f"{run.split('://', 1)[1]}/last.ckpt") == b'{"lightdist_checkpoint": "epoch=1-step=6.ckpt"}'


def stop_and_resume_last(case: Case, run: str) -> tuple[Result, Result]:
    """The run a user launches again after preemption: the same command, ``ckpt_path="last"``."""

    def keep_two_newest() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=run, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True
        )

    uninterrupted = train(case, devices=2)
    train(case, devices=2, callbacks=[StopAfter(EPOCH), keep_two_newest()])
    return uninterrupted, train(case, devices=2, callbacks=[keep_two_newest()], resume_from="last")


def assert_continues(uninterrupted: Result, resumed_run: Result) -> None:
    # The equivalence tests' tolerance: a run whose first half ran under another layout summed in another order.
    assert len(resumed_run.losses) == EPOCH
    torch.testing.assert_close(resumed_run.losses, uninterrupted.losses[EPOCH:], rtol=1e-5, atol=0)
    for key, value in uninterrupted.params.items():
        torch.testing.assert_close(resumed_run.params[key], value, rtol=1e-5, atol=1e-5, msg=key)
