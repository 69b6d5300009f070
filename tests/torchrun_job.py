"""A training job as torchrun runs it, for the restart tests: ``torchrun ... torchrun_job.py RUN_DIR [KILL_AT_STEP]``.

Rank 1 SIGKILLs itself after optimizer step ``KILL_AT_STEP`` on the first attempt only, as a lost node would end it.
Rank 0 appends each step's loss and the attempt that computed it to ``RUN_DIR/losses.jsonl``; the final weights go to
``RUN_DIR/final.pt``. Every attempt resumes from ``last``, the newest complete checkpoint, if there is one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightdist.models import Llama, TokenDataModule
from lightdist.plugins import ModelCheckpoint, ParallelStrategy

ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


class RecordLossesAndKill(Callback):
    def __init__(self, run: Path, kill_at_step: int | None) -> None:
        self.run, self.kill_at_step = run, kill_at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
        if trainer.is_global_zero:
            with (self.run / "losses.jsonl").open("a") as record:
                record.write(json.dumps({"step": trainer.global_step, "loss": loss, "attempt": ATTEMPT}) + "\n")
        if trainer.global_step == self.kill_at_step and trainer.global_rank == 1 and ATTEMPT == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def main(run: Path, kill_at_step: int | None) -> None:
    seed_everything(1234, workers=True)
    model = Llama("tiny", learning_rate=1e-3, warmup_steps=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ParallelStrategy(tensor_parallel_size=2),  # DeviceMesh's groups are made again on each attempt
        max_steps=8,
        precision="32-true",
        callbacks=[
            RecordLossesAndKill(run, kill_at_step),
            ModelCheckpoint(dirpath=str(run / "checkpoints"), every_n_train_steps=2, save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=TokenDataModule(seq_len=32, batch_size=4, synthetic_tokens=1 << 16), ckpt_path="last")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_global_zero:
        torch.save(state, run / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
