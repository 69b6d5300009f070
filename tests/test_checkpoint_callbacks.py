"""Resume with the checkpoint callback users already have: under ``ParallelStrategy``, Lightning's own
``ModelCheckpoint`` (or a subclass of it) saves and resumes as lightdist's does, and ``ckpt_path="last"`` is the
newest complete checkpoint at its dirpath, on a local disk, S3 and GCS alike, or an error where none can be loaded:
never a silent start from step 0."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import yaml
from fsspec import AbstractFileSystem
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightdist.plugins
from lightdist.cli import main
from lightdist.plugins.checkpoint import adopt_checkpoint_callbacks

from multirank import run_each, run_ranks, run_ranks_beside
from training import Case, Result, StopAfter, checkpoint_files, listing, train


class EveryOtherStep(ModelCheckpoint):
    """A user's own subclass of Lightning's callback, with its own defaults and one override of its own."""

    def __init__(self, dirpath: str) -> None:
        super().__init__(dirpath=dirpath, every_n_train_steps=2, save_last=True)

    def format_checkpoint_name(self, metrics, filename=None, ver=None, prefix=None) -> str:
        return super().format_checkpoint_name(metrics, filename, ver, prefix).replace("epoch=0-", "")


def test_a_users_lightning_callback_gains_lightdists_behaviour_and_keeps_its_own_overrides_and_state_key() -> None:
    lightnings, users, lightdists = ModelCheckpoint("run"), EveryOtherStep("run"), lightdist.plugins.ModelCheckpoint()
    state_keys = [callback.state_key for callback in (lightnings, users)]
    trainer = SimpleNamespace(callbacks=[lightnings, users, lightdists])
    adopt_checkpoint_callbacks(trainer)
    adopt_checkpoint_callbacks(trainer)  # every fit adopts them again: nothing changes the second time

    assert type(lightnings) is lightdist.plugins.ModelCheckpoint
    assert isinstance(users, EveryOtherStep) and isinstance(users, lightdist.plugins.ModelCheckpoint)
    assert type(users).__mro__[1:3] == (EveryOtherStep, lightdist.plugins.ModelCheckpoint)  # the user's override first
    assert type(lightdists) is lightdist.plugins.ModelCheckpoint
    # The state key holds the class's name: checkpoints saved before or elsewhere restore the callback's state.
    assert [callback.state_key for callback in (lightnings, users)] == state_keys
    assert type(EveryOtherStep("elsewhere")) is EveryOtherStep  # other instances, under other strategies, untouched


STORAGES = ["local", "s3", "gcs"]


def preempted_then_run_again(
    case: Case, dirpath: str, callback: Callable[[str], ModelCheckpoint]
) -> tuple[Result, Result]:
    """The same script twice with ``fit(ckpt_path="last")``: stopped after step 4, as a preempted job is, then run
    to the end."""
    first = train(case, devices=2, callbacks=[StopAfter(4), callback(dirpath)], resume_from="last")
    return first, train(case, devices=2, callbacks=[callback(dirpath)], resume_from="last")


def every_other_step(dirpath: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)


@pytest.mark.multirank
def test_lightnings_callback_resumes_from_last_on_local_disk_s3_and_gcs(
    tmp_path: Path,
    s3_bucket: tuple[str, AbstractFileSystem],
    gcs_bucket: tuple[str, AbstractFileSystem],
    capfd: pytest.CaptureFixture,
) -> None:
    """2 data-parallel ranks, ZeRO-3, background saves every 2 steps by Lightning's ``ModelCheckpoint``
    (on GCS by a user's subclass of it). Each second run resumes step 4 and ends with the uninterrupted run's losses."""
    (s3, s3_storage), (gcs, gcs_storage) = s3_bucket, gcs_bucket
    runs = {"local": str(tmp_path / "run"), "s3": f"{s3}/run", "gcs": f"{gcs}/run"}
    callbacks = {"local": every_other_step, "s3": every_other_step, "gcs": EveryOtherStep}
    case = Case(strategy={"zero_stage": 3, "async_checkpoint": "thread"}, steps=6, batch_size=2)
    calls = [(train, (case, 2))]
    calls += [(preempted_then_run_again, (case, runs[name], callbacks[name])) for name in STORAGES]
    (uninterrupted, *preempted), _ = run_ranks(2, run_each, calls)

    printed = capfd.readouterr().err
    assert "no last checkpoint available" not in printed
    for name, (first, second) in zip(STORAGES, preempted, strict=True):
        assert first.losses == pytest.approx(uninterrupted.losses[:4], rel=1e-5), name
        assert second.losses == pytest.approx(uninterrupted.losses[4:], rel=1e-5), name
        assert f"lightdist: no checkpoint under {runs[name]}: starting from step 0" in printed
        step_4 = f"{runs[name]}/epoch=0-step=4.ckpt" if name != "gcs" else f"{runs[name]}/step=4.ckpt"
        assert f"lightdist: resuming from {step_4} (step 4), the newest complete checkpoint" in printed
    # last.ckpt names step 6, and Lightning's save_top_k=1 removed step 4 once step 6 was complete.
    for name, storage in (("local", fsspec.filesystem("file")), ("s3", s3_storage), ("gcs", gcs_storage)):
        newest = "epoch=0-step=6.ckpt" if name != "gcs" else "step=6.ckpt"
        url = runs[name] if "://" in runs[name] else f"file://{runs[name]}"
        assert listing(storage, url) == {newest: checkpoint_files(2), "last.ckpt": [newest]}, name
        # Lightning's CheckpointIO interface reads what the run saved, without a Trainer or a process group.
        assert lightdist.plugins.ShardedCheckpointIO().load_checkpoint(f"{runs[name]}/last.ckpt")["global_step"] == 6, (
            name
        )


def fit_keeping_the_best(case: Case, devices: int, workdir: str) -> tuple[float, str]:
    """``case`` with Lightning's ``ModelCheckpoint`` keeping the checkpoint of the lowest ``val_loss`` under
    ``workdir/checkpoints``, and its ``LearningRateMonitor`` logging every step's learning rate to a ``CSVLogger``
    under ``workdir/logs``. Returns the best score and the path the callback kept."""
    best = ModelCheckpoint(dirpath=f"{workdir}/checkpoints", monitor="val_loss", mode="min", save_top_k=1)
    logger = CSVLogger(workdir, name="logs")
    train(case, devices, [best, LearningRateMonitor(logging_interval="step")], logger=logger)
    return best.best_model_score.item(), best.best_model_path


def logged(workdir: Path, metric: str) -> dict[int, float]:
    """Each step ``metric`` was logged at and its value, from the ``CSVLogger``'s file as a user reads it."""
    with open(workdir / "logs" / "version_0" / "metrics.csv") as metrics:
        return {int(row["step"]): float(row[metric]) for row in csv.DictReader(metrics) if row[metric]}


@pytest.mark.multirank
def test_lightnings_best_checkpoint_and_learning_rate_monitor_record_what_one_process_does(tmp_path: Path) -> None:
    """A Hugging Face Llama fine-tuned on its collator's batches over 2 pipeline stages, validated every 2 steps:
    Lightning's ``ModelCheckpoint(monitor="val_loss", save_top_k=1)`` keeps the checkpoint of the step one process
    keeps, with its score, complete; ``LearningRateMonitor`` logs one process's warm-up, step by step."""
    case = Case(
        strategy=dict(pipeline_parallel_size=2),
        model="zoo_hf_llama_finetuning",
        data="collated",
        steps=6,
        validate=True,
        val_check_interval=2,
    )
    parallel, single = tmp_path / "parallel", tmp_path / "single"
    one_process = run_ranks_beside(1, fit_keeping_the_best, case.reference(2), 1, str(single))
    (score, path), rank_1 = run_ranks(2, fit_keeping_the_best, case, 2, str(parallel))
    [(single_score, single_path)] = one_process.result()

    assert rank_1 == (score, path)  # both stages' callbacks saw the same val_loss, so they saved together
    assert score == pytest.approx(single_score, rel=1e-5)
    assert logged(parallel, "val_loss") == pytest.approx(logged(single, "val_loss"), rel=1e-5)
    name = Path(single_path).name  # epoch=0-step=N.ckpt, the step of the lowest val_loss
    assert Path(path).name == name
    # The validations before it were removed: only the best is left, every rank's shards, its manifest written last.
    assert listing(fsspec.filesystem("file"), f"file://{parallel / 'checkpoints'}") == {name: checkpoint_files(2)}
    step = int(name.removesuffix(".ckpt").rsplit("step=", 1)[1])
    assert lightdist.plugins.ShardedCheckpointIO().load_checkpoint(path)["global_step"] == step
    # 1e-3 after a warm-up of 2 steps (tests/zoo.py), as the scheduler Lightning steps every step sets it.
    warm_up = {0: 5e-4, **dict.fromkeys(range(1, case.steps), 1e-3)}
    assert logged(parallel, "lr-AdamW") == logged(single, "lr-AdamW") == warm_up


class RecordLosses(Callback):
    """Rank 0 appends each step's loss to ``path``: what a LightningCLI run leaves for a test to read."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
        if trainer.is_global_zero:
            with open(self.path, "a") as record:
                record.write(f"{loss}\n")


def config(workdir: Path, name: str, *extra_callbacks: dict) -> str:
    """A LightningCLI config as users write one, naming Lightning's own checkpoint callback; each step's loss goes to
    ``workdir/losses``."""
    written = {
        "seed_everything": 1234,
        "ckpt_path": "last",
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {"class_path": "lightdist.plugins.ParallelStrategy", "init_args": {"zero_stage": 3}},
            "precision": "32-true",
            "max_steps": 6,
            "default_root_dir": str(workdir),  # where LightningCLI saves the config it ran
            "logger": False,
            "enable_progress_bar": False,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(workdir / "checkpoints"), "every_n_train_steps": 2, "save_last": True},
                },
                {"class_path": f"{__name__}.RecordLosses", "init_args": {"path": str(workdir / "losses")}},
                *extra_callbacks,
            ],
        },
        "model": {"class_path": "lightdist.models.Llama", "init_args": {"preset": "tiny", "warmup_steps": 2}},
        "data": {
            "class_path": "lightdist.models.TokenDataModule",
            "init_args": {"seq_len": 32, "batch_size": 2, "synthetic_tokens": 16384},
        },
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(written))
    return str(path)


@pytest.mark.multirank
def test_a_lightningcli_config_naming_lightnings_callback_resumes_from_last(tmp_path: Path) -> None:
    """``lightdist fit --config`` twice with the same config, the first run preempted after step 4: the second
    continues the losses of one uninterrupted run of it."""
    uninterrupted, preempted = tmp_path / "uninterrupted", tmp_path / "preempted"
    uninterrupted.mkdir()
    preempted.mkdir()
    stop_after_4 = {"class_path": "training.StopAfter", "init_args": {"steps": 4}}
    runs = [
        config(uninterrupted, "train"),
        config(preempted, "train_until_preempted", stop_after_4),
        config(preempted, "train"),
    ]
    run_ranks(2, run_each, [(main, (["fit", "--config", run],)) for run in runs])
    losses = [float(line) for line in (uninterrupted / "losses").read_text().split()]
    resumed = [float(line) for line in (preempted / "losses").read_text().split()]
    assert len(losses) == 6
    assert resumed == pytest.approx(losses, rel=1e-5)
