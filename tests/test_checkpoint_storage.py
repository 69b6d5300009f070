"""A checkpoint is complete or it is not there: what loaders see of saves cut short, damaged or failed."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from torch import Tensor, nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.utils.data import DataLoader

from lightdist.checkpoint.storage import (
    UnsafeCheckpointError,
    commit,
    remove,
    resolve,
    saved_model_tensors,
    write_pointer,
)
from lightdist.plugins import ModelCheckpoint, ParallelStrategy
from lightdist.plugins.resume import newest_complete_checkpoint

from multirank import raised, run_ranks
from training import MODELS, Case, Result, StopAfter, train


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


def complete(url: str, step: int) -> None:
    fake_shards(url)
    commit(url, b"loop state", step=step)


def test_last_is_the_newest_complete_checkpoint_and_one_line_names_the_newer_one_it_skips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning is handed the pointer that names the checkpoint, as its own search hands it ``last.ckpt``."""
    run = str(tmp_path / "run")
    complete(f"{run}/epoch=0-step=2.ckpt", step=2)
    complete(f"{run}/step=4/state.ckpt", step=4)  # filename="{step}/state": a checkpoint a folder down
    write_pointer(f"{run}/last.ckpt", f"{run}/step=4/state.ckpt")
    write_pointer(f"{run}/last-v1.ckpt", f"{run}/epoch=0-step=2.ckpt")  # another callback's, lagging
    fake_shards(f"{run}/epoch=0-step=6.ckpt")  # cut short by a kill
    assert newest_complete_checkpoint([run]) == f"{run}/last.ckpt"
    assert caplog.messages == [
        f"lightdist: skipping {run}/epoch=0-step=6.ckpt (incomplete: it has no COMPLETE manifest, which a save writes "
        f"last, so its save was cut short): resuming from {run}/step=4/state.ckpt (step 4), the newest complete "
        "checkpoint"
    ]


def test_saves_dated_to_the_same_second_are_ordered_by_step_and_one_cut_short_counts_as_newer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Object stores date objects to the second: saves made within one second, as every-step saves of a small
    model are, must still resume the later one, and a save cut short in that second must not pass for an old one."""
    run = tmp_path / "run"
    complete(str(run / "b.ckpt"), step=6)
    complete(str(run / "a.ckpt"), step=4)
    fake_shards(str(run / "c.ckpt"))
    second = 1_790_000_000
    for written in run.rglob("*"):
        os.utime(written, (second, second))
    assert newest_complete_checkpoint([str(run)]) == str(run / "b.ckpt")
    (skipped,) = caplog.messages
    assert skipped.startswith(f"lightdist: skipping {run}/c.ckpt (incomplete")


def test_last_refuses_checkpoints_none_of_which_can_be_loaded(run_url: str) -> None:
    complete(f"{run_url}/epoch=0-step=2.ckpt", step=2)
    fs, path = fsspec.core.url_to_fs(run_url)
    fs.rm_file(f"{path}/epoch=0-step=2.ckpt/__1_0.distcp")
    fake_shards(f"{run_url}/epoch=0-step=4.ckpt")
    fs.pipe_file(f"{path}/before-lightdist.ckpt", b"PK\x03\x04 a torch.save zip of a whole model")
    with pytest.raises(ValueError) as refused:
        newest_complete_checkpoint([run_url])
    message = str(refused.value)
    assert message.startswith(f"ckpt_path='last' found checkpoints under {run_url}, but none that can be loaded: ")
    assert f"{run_url}/epoch=0-step=4.ckpt is incomplete" in message
    assert f"{run_url}/epoch=0-step=2.ckpt is damaged: __1_0.distcp missing" in message
    assert f"{run_url}/before-lightdist.ckpt is a single-file checkpoint" in message
    assert "training did not start from step 0 in their place" in message


def test_last_with_only_a_save_cut_short_starts_from_step_0_and_says_so(
    run_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash during the run's first save: what it left was never committed, so no checkpoint was ever made."""
    fake_shards(f"{run_url}/epoch=0-step=1.ckpt")
    assert newest_complete_checkpoint([run_url]) is None
    assert caplog.messages == [
        f"lightdist: no checkpoint under {run_url} was completed ({run_url}/epoch=0-step=1.ckpt: saves cut short "
        "before their commit): starting from step 0"
    ]


def test_last_with_no_checkpoint_at_all_starts_from_step_0_and_says_so(
    run_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    fs, path = fsspec.core.url_to_fs(run_url)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f"{path}/hparams.yaml", b"lr: 0.001")
    assert newest_complete_checkpoint([run_url, f"{run_url}/never-made"]) is None
    assert caplog.messages == [
        f"lightdist: no checkpoint under {run_url} or {run_url}/never-made: starting from step 0"
    ]


def test_fit_from_last_that_cannot_be_loaded_fails_before_any_process_group_exists(tmp_path: Path) -> None:
    complete(str(tmp_path / "run" / "epoch=0-step=4.ckpt"), step=4)
    (tmp_path / "run" / "epoch=0-step=4.ckpt" / "__1_0.distcp").unlink()  # a shard lost since it was saved
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ParallelStrategy(),
        callbacks=[LightningModelCheckpoint(dirpath=tmp_path / "run", every_n_train_steps=2, save_last=True)],
        logger=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError, match=r"none that can be loaded: .*epoch=0-step=4.ckpt is damaged"):
        trainer.fit(MODELS["llama"](learning_rate=1e-3, warmup_steps=2), ckpt_path="last")
    assert not dist.is_initialized()


@pytest.mark.multirank
def test_ranks_whose_storage_shows_different_last_checkpoints_stop_rather_than_hang(tmp_path: Path) -> None:
    """A rank that found no checkpoint would not join the others' load: every rank fails, naming what each saw."""
    errors = run_ranks(2, fit_from_last_as_each_rank_sees_it, tmp_path)
    seen = f"rank 0: {tmp_path}/rank0/epoch=0-step=2.ckpt, rank 1: none"
    assert (
        errors == [f"RuntimeError: ckpt_path='last' found a checkpoint on some ranks and none on others ({seen})"] * 2
    )


def fit_from_last_as_each_rank_sees_it(run: Path) -> str:
    """Rank 0 finds a complete checkpoint, rank 1 an empty folder: what a stale listing cache shows another node."""
    rank = int(os.environ["RANK"])
    if rank == 0:
        complete(str(run / "rank0" / "epoch=0-step=2.ckpt"), step=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ParallelStrategy(),
        callbacks=[LightningModelCheckpoint(dirpath=run / f"rank{rank}")],
        logger=False,
        enable_progress_bar=False,
    )
    error = raised(fit_from_last, trainer, MODELS["llama"](learning_rate=1e-3, warmup_steps=2))
    return error.split("): ")[0] + ")"


def fit_from_last(trainer: Trainer, model: LightningModule) -> None:
    trainer.fit(model, ckpt_path="last")


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


@pytest.mark.multirank
def test_an_unusable_checkpoint_location_fails_before_training_with_the_fix(
    tmp_path: Path, s3_endpoint: str, s3_bucket: tuple[str, AbstractFileSystem], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, storage = s3_bucket
    # No endpoint and no credentials in the environment: the endpoint comes from storage_options, the credentials
    # from a named profile, as a user's config would give them.
    for name in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    credentials = tmp_path / "aws-credentials"
    credentials.write_text("[lightdist-test]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    s3 = {"endpoint_url": s3_endpoint}
    with_profile = {**s3, "profile": "lightdist-test"}
    # One attempt, where botocore and s3fs would retry the refused connection for 20 s
    unreachable = {
        **with_profile,
        "endpoint_url": "http://127.0.0.1:9",
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }
    # The attempts without a profile go first: storage_options add up in each rank's fsspec configuration. Those with
    # ckpt_path="last" meet the problem as they look for checkpoints, before any process group exists.
    attempts = [
        (f"{url}/run", s3, None),
        (f"{url}/run", s3, "last"),
        ("s3://lightdist-no-such-bucket/run", with_profile, "last"),
        (f"{url}/run", unreachable, None),
        (f"{url}/run", unreachable, "last"),
        (str(a_file / "run"), with_profile, None),
        (f"{url}/run", with_profile, None),
    ]
    outcomes, _ = run_ranks(2, fit_into_each, attempts)

    (no_credentials, steps), (no_credentials_last, _), (no_bucket, _), (no_endpoint, _), (no_endpoint_last, _) = (
        outcomes[:5]
    )
    (not_a_directory, _), (fine, trained) = outcomes[5:]
    assert steps == 0 and "Unable to locate credentials. Set the credentials in the environment" in no_credentials
    assert no_credentials_last.startswith(f"lightdist cannot look for checkpoints under {url}/run: Unable to locate")
    assert "Set the credentials in the environment" in no_credentials_last
    assert "Create the bucket 'lightdist-no-such-bucket' first, or correct the URL" in no_bucket
    assert not storage.exists("lightdist-no-such-bucket")  # nothing created on the way
    assert "Check the endpoint (AWS_ENDPOINT_URL, or storage_options' endpoint_url)" in no_endpoint
    assert "Check the endpoint (AWS_ENDPOINT_URL, or storage_options' endpoint_url)" in no_endpoint_last
    assert "a-file/run" in not_a_directory and "Choose a dirpath these processes can write to" in not_a_directory
    # With the profile the run trains and saves, and the check left nothing behind.
    assert fine is None and trained == 1
    storage.invalidate_cache()
    assert [path.rsplit("/", 1)[-1] for path in storage.ls(f"{url.split('://', 1)[1]}/run")] == ["epoch=0-step=1.ckpt"]


def fit_into_each(attempts: list[tuple[str, dict, str | None]]) -> list[tuple[str | None, int]]:
    """Each attempt's error, or None, and the steps it trained."""
    outcomes = []
    for dirpath, s3_options, resume_from in attempts:
        steps = _Steps()
        case = Case(strategy={"storage_options": {"s3": s3_options}}, steps=1)
        try:
            train(case, 2, [ModelCheckpoint(dirpath), steps], resume_from=resume_from)
            outcomes.append((None, steps.count))
        except ValueError as error:
            outcomes.append((str(error), steps.count))
    return outcomes


class _Steps(Callback):
    count = 0

    def on_train_batch_end(self, *args) -> None:
        self.count += 1


class _LowerByLearningRate(torch.optim.Optimizer):
    """Lowers every parameter by ``lr`` at each step, whatever its gradient."""

    def __init__(self, params, lr: float = 1.0) -> None:
        super().__init__(params, defaults={"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            closure()
        for group in self.param_groups:
            for param in group["params"]:
                param.sub_(group["lr"])


LAYERS = 500


class _SavingInTrainingStep(LightningModule):
    """Saves a checkpoint in each training step, just before the optimizer lowers every parameter by exactly 1.

    The backward in between hardly computes, and the copy of the state for the save takes long (many tensors), so
    an optimizer step that did not wait for the copy would change tensors not yet copied: a checkpoint holding
    anything but -step everywhere was copied after the step changed it.
    """

    def __init__(self, checkpoints: Path) -> None:
        super().__init__()
        self.checkpoints = checkpoints
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(LAYERS))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
        self.scale = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        self.trainer.save_checkpoint(self.checkpoints / f"step={self.global_step}")
        return (self.scale * batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _LowerByLearningRate(self.layers.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(8, 1))


def test_a_background_save_holds_the_state_of_its_step(tmp_path: Path) -> None:
    run_ranks(1, save_in_each_training_step, tmp_path)
    for step in range(2):
        saved = {"state_dict": {f"layers.{i}.weight": torch.empty(8, 8) for i in range(LAYERS)}}
        dcp.load(saved, checkpoint_id=str(tmp_path / f"step={step}"))
        for name, weight in saved["state_dict"].items():
            assert torch.equal(weight, torch.full_like(weight, -step)), f"{name} at step {step}"


def save_in_each_training_step(checkpoints: Path) -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ParallelStrategy(zero_stage=0, async_checkpoint="thread"),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_SavingInTrainingStep(checkpoints))


class RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_checkpoint_whose_index_would_run_code_is_refused(tmp_path: Path) -> None:
    checkpoint, marker = tmp_path / "step=1.ckpt", tmp_path / "code-ran"
    dcp.save({"state_dict": {"model.weight": torch.ones(2, 3)}}, checkpoint_id=str(checkpoint), no_dist=True)
    assert {name: list(entry.size) for name, entry in saved_model_tensors(str(checkpoint)).items()} == {
        "model.weight": [2, 3]
    }
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"asks to build builtins.exec, which no checkpoint's index holds"):
        saved_model_tensors(str(checkpoint))
    assert not marker.exists()
    with pytest.raises(AttributeError):  # DCP's own reader runs it before it finds no metadata in what it built
        FsspecReader(str(checkpoint)).read_metadata()
    assert marker.exists()
