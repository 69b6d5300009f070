"""A training job as torchrun runs it, for the chaos test: ``torchrun ... torchrun_job.py RUN_DIR CHECKPOINTS ...``.

Rank 0 appends each step's loss and the attempt that computed it to ``RUN_DIR/losses.jsonl``, and the final weights
go to ``RUN_DIR/final.pt``. Every attempt resumes from ``last``, the newest complete checkpoint at ``CHECKPOINTS`` (any
fsspec URL), if there is one. The faults, each on the first attempt only:

- ``--kill-at N``: rank 1 SIGKILLs itself after optimizer step N, as a lost node would end it;
- ``--storage-down FILE --down-steps A B``: rank 0 creates FILE as step A starts and removes it as step B starts; the
  test's storage proxy answers nothing while it exists;
- ``--nan-at N``: the loss of step N is NaN (on every attempt: it is the data's fault), and ``non_finite="skip"``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightdist.models import TokenDataModule
from lightdist.plugins import ModelCheckpoint, ParallelStrategy

from training import LlamaWithOneBadBatch

ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


class Chaos(Callback):
    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.options.storage_down is None or ATTEMPT > 0 or not trainer.is_global_zero:
            return
        down_from, down_until = self.options.down_steps
        if trainer.global_step == down_from:
            self.options.storage_down.touch()
        if trainer.global_step == down_until:
            self.options.storage_down.unlink()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
        if trainer.is_global_zero:
            with (self.options.run / "losses.jsonl").open("a") as record:
                record.write(json.dumps({"step": trainer.global_step, "loss": loss, "attempt": ATTEMPT}) + "\n")
        if trainer.global_step == self.options.kill_at and trainer.global_rank == 1 and ATTEMPT == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def main(options: argparse.Namespace) -> None:
    if ATTEMPT > 0 and options.storage_down is not None:
        options.storage_down.unlink(missing_ok=True)  # the storage is back by the time the job restarts
    seed_everything(1234, workers=True)
    # botocore tries each request twice rather than five times: an outage fails a save in seconds, not minutes.
    retries = {"s3": {"config_kwargs": {"retries": {"total_max_attempts": 2}}}}
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        # tp=2: DeviceMesh's groups are made again on each attempt
        strategy=ParallelStrategy(
            tensor_parallel_size=2, non_finite="skip", storage_options=retries, async_checkpoint="thread"
        ),
        max_steps=8,
        precision="32-true",
        callbacks=[Chaos(options), ModelCheckpoint(dirpath=options.checkpoints, every_n_train_steps=1, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LlamaWithOneBadBatch(options.nan_at)
    trainer.fit(model, datamodule=TokenDataModule(seq_len=32, batch_size=4, synthetic_tokens=1 << 16), ckpt_path="last")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_global_zero:
        torch.save(state, options.run / "final.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("checkpoints")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--storage-down", type=Path)
    parser.add_argument("--down-steps", type=int, nargs=2)
    main(parser.parse_args())
