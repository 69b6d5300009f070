"""A bad day for storage: a bucket that throttles and drops connections, a server that stops mid-upload, a rank
killed mid-upload. Training carries on through what can be retried, and resumes from the last complete checkpoint
after what cannot; nothing saved before is lost.

The S3 server is moto's, behind ``FaultyStorage``, a proxy that fails requests the way object stores do.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from fsspec import AbstractFileSystem
from lightning.pytorch import Callback

from faulty_storage import Fault, FaultyStorage
from multirank import run_each, run_ranks
from training import Case, Result, checkpoint_files, keep_two_newest, listing, train

pytestmark = pytest.mark.multirank

# Every save falls mid-epoch, the data is shuffled and the model drops out: a resumed run sees the batches and draws the
# masks of an uninterrupted one only if the checkpoint carries the data loader's position and each rank's random state.
# One retry per request in botocore (its default is four) and s3fs's own five: an outage fails a request in about five
# seconds rather than half a minute, and every transient fault below is still retried.
CASE = Case(
    strategy={
        "async_checkpoint": "thread",
        "storage_options": {"s3": {"config_kwargs": {"retries": {"total_max_attempts": 2}}}},
    },
    model="gpt2_dropout",
    steps=6,
    shuffle=True,
)
STORAGE_BACK_AT_STEP = 5  # down from the moment step 3's first shard arrives to the start of step 5
RANK_KILLED_AT_STEP = 6  # at its start, once step 5's shards are uploading


class BadDay:
    """Every shard's first upload throttled, every other upload's first attempt dropped, every deletion's first
    attempt a server error. Once, the storage stops as the first shard of step 3 arrives (that one lands) and
    answers nothing until ``storage_down`` is removed; once, step 5's first shard uploads slowly and says so in
    ``step_5_uploading``. A resumed run saves those steps again, on a better day."""

    def __init__(self, storage_down: Path, step_5_uploading: Path) -> None:
        self.storage_down, self.step_5_uploading = storage_down, step_5_uploading
        self.stopped_once = False

    def __call__(self, method: str, path: str, attempt: int) -> Fault | None:
        if self.storage_down.exists():
            return "reset"
        if method == "PUT" and path.endswith(".distcp"):
            if "step=3" in path and not self.stopped_once:
                self.stopped_once = True
                self.storage_down.touch()
                return None
            if "step=5" in path and not self.step_5_uploading.exists():
                self.step_5_uploading.touch()
                return "slow"
            return "throttle" if attempt == 1 else None
        if attempt == 1 and method == "PUT":
            return "reset"
        if attempt == 1 and method == "DELETE":
            return "error"
        return None


def test_a_run_through_storage_faults_and_a_killed_rank_resumes_from_the_last_complete_checkpoint(
    tmp_path: Path,
    s3_endpoint: str,
    s3_bucket: tuple[str, AbstractFileSystem],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, bucket = s3_bucket
    run = f"{url}/run"
    storage_down, step_5_uploading = tmp_path / "storage-down", tmp_path / "step-5-uploading"
    faulty = FaultyStorage(s3_endpoint, BadDay(storage_down, step_5_uploading))
    with faulty as faulty_endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", faulty_endpoint)
        monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", faulty_endpoint)
        with pytest.raises(RuntimeError, match="rank 1 was killed by SIGKILL"):
            run_ranks(2, train_until_killed, run, storage_down, step_5_uploading, tmp_path)
        faults_on_the_bad_day = set(faulty.injected)
        after_the_bad_day = listing(bucket, run)
        (uninterrupted, resumed), _ = run_ranks(2, run_each, [(train, (CASE, 2)), (resume_last, (run,))])

    # The throttled, dropped and failed requests were retried: steps 1 and 2 were saved, and last.ckpt names step 2.
    assert faults_on_the_bad_day == {"throttle", "reset", "error", "slow"}
    assert after_the_bad_day["last.ckpt"] == ["epoch=0-step=2.ckpt"]
    assert "COMPLETE" in after_the_bad_day["epoch=0-step=1.ckpt"]
    assert "COMPLETE" in after_the_bad_day["epoch=0-step=2.ckpt"]
    # Step 3's upload stopped with the storage, step 4's save fell in the outage, and both were reported while
    # training went on; step 5's upload died with rank 1 and stayed incomplete.
    reported = (tmp_path / "rank0.log").read_text()
    assert "epoch=0-step=3.ckpt could not be saved" in reported
    assert "epoch=0-step=4.ckpt could not be saved" in reported
    assert "COMPLETE" not in after_the_bad_day.get("epoch=0-step=3.ckpt", [])
    assert "COMPLETE" not in after_the_bad_day.get("epoch=0-step=5.ckpt", [])
    # The resumed run continued from step 2 as if never stopped. Its saves replaced what the cut-short saves had
    # left, and retention kept the two newest.
    assert len(resumed.losses) == 4
    torch.testing.assert_close(resumed.losses, uninterrupted.losses[2:], rtol=1e-5, atol=0)
    for name, value in uninterrupted.params.items():
        torch.testing.assert_close(resumed.params[name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert listing(bucket, run) == {
        "epoch=0-step=5.ckpt": checkpoint_files(2),
        "epoch=0-step=6.ckpt": checkpoint_files(2),
        "last.ckpt": ["epoch=0-step=6.ckpt"],
    }


def train_until_killed(run: str, storage_down: Path, step_5_uploading: Path, logs: Path) -> None:
    rank = int(os.environ["RANK"])
    logging.getLogger("lightdist").addHandler(logging.FileHandler(logs / f"rank{rank}.log"))
    callbacks = [_RestartStorage(storage_down), _KillRank(1, once=step_5_uploading), keep_two_newest(run)]
    train(CASE, devices=2, callbacks=callbacks)


def resume_last(run: str) -> Result:
    return train(CASE, devices=2, callbacks=[keep_two_newest(run)], resume_from="last")


class _RestartStorage(Callback):
    def __init__(self, storage_down: Path) -> None:
        self.storage_down = storage_down

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.is_global_zero and trainer.global_step == STORAGE_BACK_AT_STEP - 1:
            self.storage_down.unlink()


class _KillRank(Callback):
    """SIGKILLs ``rank`` at the start of step ``RANK_KILLED_AT_STEP``, as soon as the file ``once`` exists."""

    def __init__(self, rank: int, once: Path) -> None:
        self.rank, self.once = rank, once

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == RANK_KILLED_AT_STEP - 1:
            deadline = time.monotonic() + 60
            while not self.once.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
