"""A checkpoint is complete or it is not there: what loaders see of saves cut short, damaged or failed."""

from __future__ import annotations

import logging
from pathlib import Path

import fsspec
import pytest

from lightdist.plugins import ModelCheckpoint
from lightdist.storage import commit, remove, resolve, write_pointer

from multirank import run_ranks
from training import Case, Result, StopAfter, train


@pytest.fixture(params=["local", "memory"])
def run_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "run") if request.param == "local" else f"memory://{tmp_path.name}/run"


def fake_shards(url: str) -> None:
    """What DCP leaves behind once every rank has written: shards and the index."""
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(path, exist_ok=True)
    for name, data in (("__0_0.distcp", b"rank 0"), ("__1_0.distcp", b"rank 1"), (".metadata", b"index")):
        fs.pipe_file(f"{path}/{name}", data)


def test_a_save_cut_short_before_its_manifest_is_refused(run_url: str) -> None:
    fake_shards(f"{run_url}/step=4.ckpt")
    with pytest.raises(ValueError, match=r"step=4.ckpt is incomplete: it has no COMPLETE manifest"):
        resolve(f"{run_url}/step=4.ckpt")


def test_a_checkpoint_that_lost_a_shard_names_it(run_url: str) -> None:
    checkpoint = f"{run_url}/step=4.ckpt"
    fake_shards(checkpoint)
    commit(checkpoint, b"loop state")
    assert resolve(checkpoint) == checkpoint
    fs, path = fsspec.core.url_to_fs(checkpoint)
    fs.rm_file(f"{path}/__1_0.distcp")
    with pytest.raises(ValueError, match=r"damaged: __1_0.distcp missing"):
        resolve(checkpoint)


def test_last_points_at_a_complete_checkpoint_and_removal_leaves_nothing(run_url: str) -> None:
    checkpoint = f"{run_url}/step=4/state.ckpt"
    fake_shards(checkpoint)
    commit(checkpoint, b"loop state")
    write_pointer(f"{run_url}/last.ckpt", checkpoint)
    assert resolve(f"{run_url}/last.ckpt") == checkpoint
    remove(checkpoint)
    fs, path = fsspec.core.url_to_fs(checkpoint)
    assert not fs.exists(path)
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at .*step=4/state.ckpt"):
        resolve(f"{run_url}/last.ckpt")


@pytest.mark.multirank
def test_a_failed_background_save_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "step=2").write_text("a file where step 2's checkpoint folder would go")
    (first, errors, last_after_failure, resumed), _ = run_ranks(2, fail_a_save_then_resume_last, str(run))
    # Training went on past the failed save, which was reported; last.ckpt still named step 1, and step 1 was kept
    # although step 2's save asked Lightning to remove it.
    assert len(first.losses) == 2
    assert any("step=2/state.ckpt could not be saved" in error for error in errors)
    assert last_after_failure == str(run / "step=1" / "state.ckpt")
    # Resumed from it, step 2 is the step the first run took.
    assert resumed.losses[0] == pytest.approx(first.losses[1], rel=1e-5)
    # The resumed run's saves succeeded: its newest is last, and the older ones went once it was complete.
    assert resolve(str(run / "last.ckpt")) == str(run / "resumed-step=3.ckpt")
    assert not (run / "step=1" / "state.ckpt").exists()


def fail_a_save_then_resume_last(run: str) -> tuple[Result, list[str], str, Result]:
    errors = _Collect()
    logging.getLogger("lightdist").addHandler(errors)
    # Each step is an epoch of one batch, so a resumed run sees the same batches as an uninterrupted one.
    case = Case(strategy={"async_checkpoint": "thread"}, steps=3, limit_train_batches=1)
    every_step = ModelCheckpoint(dirpath=run, filename="{step}/state", every_n_train_steps=1, save_last=True)
    first = train(case, devices=2, callbacks=[StopAfter(2), every_step])
    last_after_failure = resolve(f"{run}/last.ckpt")
    every_step = ModelCheckpoint(dirpath=run, filename="resumed-{step}", every_n_train_steps=1, save_last=True)
    resumed = train(case, devices=2, callbacks=[every_step], resume_from="last")
    return first, errors.messages, last_after_failure, resumed


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
