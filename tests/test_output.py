"""What a run prints. Third-party noise is dropped where it comes from, narrowly: the same packages' other messages,
and a user's own warnings and logs, still show; ``LIGHTDIST_LOG=debug`` shows everything. The progress bar counts
steps. (The header and a whole run's output under the ``lightdist`` command: ``tests/test_cli.py``; under a user's
own script: here.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar

from lightdist.models import Llama
from lightdist.plugins import ParallelStrategy
from lightdist.plugins.run_header import run_header
from lightdist.quiet import silence_known_noise

from multirank import run_ranks

CHECKPOINT_PROCESS = "/venv/site-packages/torch/distributed/checkpoint/_async_process_executor.py"


def shown(logger: str, level: int, message: str, path: str = "/home/me/train.py") -> bool:
    record = logging.LogRecord(logger, level, path, 1, message, None, None)
    return all(f.filter(record) for f in logging.getLogger(logger if logger != "root" else None).filters)


def warned(message: str, category: type[Warning], module: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning shows, as in a process of its own
        silence_known_noise()  # as importing lightdist does there
        warnings.warn_explicit(message, category, "somewhere.py", 1, module=module)
    return bool(caught)


def test_the_checkpoint_process_says_only_what_is_wrong() -> None:
    assert not shown("root", logging.INFO, "Waiting for checkpoint save request...", CHECKPOINT_PROCESS)
    assert shown("root", logging.ERROR, "Checkpoint background process failed", CHECKPOINT_PROCESS)
    assert shown("root", logging.INFO, "my own line")


def test_only_the_device_mesh_unpickling_warning_is_dropped() -> None:
    mesh = "torch.distributed.device_mesh"
    pickled = "It seems like pickling/unpickling of the DeviceMesh occurred before the PGs were created. This ..."
    assert not shown(mesh, logging.WARNING, pickled)
    assert shown(mesh, logging.WARNING, "any other warning of the DeviceMesh")


def test_deprecations_that_are_not_the_users_are_dropped_and_the_users_own_warnings_show() -> None:
    set_vital = "'set_vital' is deprecated, please do not call"
    assert not warned(set_vital, UserWarning, "torchdata.stateful_dataloader.stateful_dataloader")
    assert not warned("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, "lightning")
    assert warned(set_vital, UserWarning, "my_training_script")
    assert warned("my learning rate looks high", UserWarning, "my_training_script")


def test_lines_every_rank_prints_alike_are_printed_by_rank_0_only() -> None:
    seed = "lightning.fabric.utilities.seed"
    assert shown(seed, logging.INFO, "Seed set to 1234")  # rank 0's, before the ranks know their rank
    assert not shown(seed, logging.INFO, "[rank: 3] Seed set to 1234")


def test_debug_shows_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTDIST_LOG", "debug")
    assert shown("root", logging.INFO, "Waiting for checkpoint save request...", CHECKPOINT_PROCESS)
    assert shown("lightning.pytorch.utilities.rank_zero", logging.INFO, "💡 Tip: try our logger")


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))

    def training_step(self, batch, batch_idx):
        for layer in self.layers:
            batch = layer(batch)
        return batch.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ReadBar(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        bar = trainer.progress_bar_callback
        description = bar.progress.tasks[bar.train_progress_bar_id].description
        self.shown = type(bar).__name__, bar.get_metrics(trainer, pl_module), description


class _MyBar(RichProgressBar):
    pass


def bars_shown() -> list[tuple[str, dict]]:
    shown = []
    for bar in (RichProgressBar(), _MyBar()):
        reader = _ReadBar()
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ParallelStrategy(),
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            callbacks=[bar, reader],
        )
        trainer.fit(_Tiny(), torch.utils.data.DataLoader(torch.ones(8, 2), batch_size=2))
        shown.append(reader.shown)
    return shown


def test_the_progress_bar_counts_steps_toward_max_steps_and_a_users_own_bar_is_left_alone() -> None:
    (ours, metrics, description), (theirs, _, their_description) = run_ranks(1, bars_shown)[0]
    assert ours == "RichStepProgressBar" and metrics["step"] == "3/3" and "v_num" not in metrics
    assert description.strip() == "Training"  # not Lightning's "Epoch 0/-2" of a run that ends at max_steps
    assert theirs == "_MyBar" and their_description.startswith("Epoch 0/-2")


# A user's own script, as `python train.py` runs it: Lightning's own ModelCheckpoint, saving every step in the
# background (ParallelStrategy's default), and lightdist imported in the main block only, which the checkpoint process
# torch spawns per rank never runs. Its module declares no `seq_len` or `batch_size`, so the header says why it has
# no memory estimate. It validates after training, as scripts do: the header is printed once.
USERS_SCRIPT = """
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class Tiny(LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))

    def training_step(self, batch, batch_idx):
        for layer in self.layers:
            batch = layer(batch)
        return batch.sum()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    from lightdist.plugins import ParallelStrategy

    trainer = Trainer(
        strategy=ParallelStrategy(),
        devices=2,
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=1)],
    )
    model, data = Tiny(), torch.utils.data.DataLoader(torch.ones(8, 2), batch_size=2)
    trainer.fit(model, data)
    trainer.validate(model, data)
"""


def run_users_script(directory: Path, **environment: str) -> str:
    """What ``python train.py`` prints, stdout and stderr, run in ``directory`` (made if missing)."""
    directory.mkdir(exist_ok=True)
    (directory / "train.py").write_text(USERS_SCRIPT)
    env = {name: value for name, value in os.environ.items() if name != "LIGHTDIST_LOG"} | environment
    run = subprocess.run(
        [sys.executable, "train.py"], cwd=directory, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


@pytest.mark.multirank
def test_a_users_own_script_prints_no_checkpoint_process_lines_and_the_headers_memory_line_whole(
    tmp_path: Path,
) -> None:
    checkpoint_process = ("checkpoint background process", "checkpoint save request")
    printed = run_users_script(tmp_path)
    assert not [line for line in printed.splitlines() if any(noise in line for noise in checkpoint_process)]
    (memory,) = [line for line in printed.splitlines() if line.startswith("  memory per rank")]  # fit's, not again
    # The planner's reason whole, naming both attributes to add; not cut at a width.
    assert memory.startswith("  memory per rank: not estimated (") and memory.endswith(".)"), memory
    assert "`seq_len`" in memory and "`batch_size`" in memory, memory
    printed = run_users_script(tmp_path / "debug", LIGHTDIST_LOG="debug")
    assert all(noise in printed for noise in checkpoint_process)


def test_the_header_names_the_replicas_and_the_run_config_records_them() -> None:
    """Before any process starts: 4 ranks as 2 replicas of 2 ZeRO-3 shards, as the header says it and W&B records it."""
    trainer = Trainer(accelerator="cpu", devices=4, strategy=ParallelStrategy(data_parallel_replicas=2), logger=False)
    strategy = trainer.strategy
    strategy.connect(Llama("tiny"))
    run = strategy.run_config
    assert run["data_parallel_replicas"] == 2
    header = run_header(strategy, trainer, run, parameters=1000, estimate=None, why_not="not asked")
    assert header.splitlines()[0].endswith("on 4 CPU ranks as pp=1 x dp=4 x tp=1, ZeRO-3 in 2 replicas (HSDP)")
