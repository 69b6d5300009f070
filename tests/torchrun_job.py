"""A training job as torchrun runs it, for the chaos test: ``torchrun ... torchrun_job.py RUN_DIR CHECKPOINTS ...``.

Rank 0 appends each step's loss and the attempt that computed it to ``RUN_DIR/losses.jsonl``, and the final weights
go to ``RUN_DIR/final.pt``. Every attempt resumes from ``last``, the newest complete checkpoint at ``CHECKPOINTS`` (any
fsspec URL), if there is one; as it starts, rank 0 appends the step of the newest complete checkpoint there, read from
the storage itself, to ``RUN_DIR/starts.jsonl``, so that a test can check the rule without guessing which uploads a
fault cut short. Checkpoints are saved by lightdist's ``ModelCheckpoint`` every step, or with ``--lightning-checkpoint``
by Lightning's own, as users configure it, every ``--every`` steps. The faults, each on the first attempt only:

- ``--kill-at N``: rank 1 SIGKILLs itself after optimizer step N, as the kernel ends a process out of memory;
- ``--storage-down FILE --down-steps A B``: rank 0 creates FILE as step A starts and removes it as step B starts; the
  test's storage proxy answers nothing while it exists;
- ``--nan-at N``: the loss of step N is NaN (on every attempt: it is the data's fault), and ``non_finite="skip"``;
- ``--wait-for-nodes-after N``: on one node, before any other has joined, the ranks wait after step N until their
  agent restarts them on more nodes (torchrun restarts a job when a node joins), or fail after two minutes;
- ``LOSE_THIS_NODE_AFTER_STEP=N`` in one agent's environment: after optimizer step N, the ranks of that agent SIGKILL
  it and themselves, as a lost machine would end them.

The elastic faults key on what the job has recorded, not on the attempt: a round torchrun restarts for a reason of its
own (it picks the port of each round's store by binding and closing it, and another process may take it before rank 0
binds it again) still waits for its node and still loses it.

The ranks share a global batch of ``--global-batch`` windows of the corpus ``lightdist prepare`` made at
``--data-path``, streamed by range and split among the data-parallel ranks of each attempt: a job restarted on fewer
nodes trains on the same batches.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import signal
import sys
import time
from pathlib import Path

import fsspec
import lightning.pytorch.callbacks
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightdist.models import TokenDataModule
from lightdist.plugins import ModelCheckpoint, ParallelStrategy

from training import LlamaWithOneBadBatch

ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
TENSOR_PARALLEL = 2  # DeviceMesh's groups are made again on each attempt


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
                step = {"step": trainer.global_step, "loss": loss, "attempt": ATTEMPT, "world_size": WORLD_SIZE}
                record.write(json.dumps(step) + "\n")
        if str(trainer.global_step) == os.environ.get("LOSE_THIS_NODE_AFTER_STEP"):
            if trainer.local_rank == 0:
                os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun agent
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_step == self.options.wait_for_nodes_after and self.on_one_node_so_far():
            waiting_since = time.monotonic()
            while not trainer.received_sigterm:  # the agent stops its ranks with SIGTERM to restart them
                if time.monotonic() - waiting_since > 120:
                    raise TimeoutError("no node joined in two minutes")
                time.sleep(0.1)
        if trainer.global_step == self.options.kill_at and ATTEMPT == 0:
            trainer.strategy.barrier()  # rank 0 has recorded the step: on a loaded machine torchrun stopped it first
            if trainer.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    def on_one_node_so_far(self) -> bool:
        """Whether this round and every earlier one ran on one node's ranks: read from the earlier rounds' records,
        which the ranks of a round read alike."""
        records = (self.options.run / "losses.jsonl").read_text().splitlines()
        sizes = {WORLD_SIZE} | {json.loads(record)["world_size"] for record in records}
        return sizes == {TENSOR_PARALLEL}


def newest_complete_step(url: str) -> int:
    """The step of the newest checkpoint under ``url`` that has its COMPLETE manifest; 0 where there is none."""
    storage, path = fsspec.core.url_to_fs(url)
    steps = []
    for manifest in storage.glob(f"{path}/**/COMPLETE"):
        with storage.open(posixpath.join(posixpath.dirname(manifest), "meta.pt"), "rb") as meta:
            steps.append(torch.load(meta)["global_step"])
    return max(steps, default=0)


def main(options: argparse.Namespace) -> None:
    if ATTEMPT > 0 and options.storage_down is not None:
        options.storage_down.unlink(missing_ok=True)  # the storage is back by the time the job restarts
    if os.environ["RANK"] == "0":
        with (options.run / "starts.jsonl").open("a") as record:
            start = {
                "attempt": ATTEMPT,
                "world_size": WORLD_SIZE,
                "newest_complete": newest_complete_step(options.checkpoints),
            }
            record.write(json.dumps(start) + "\n")
    if options.lightning_checkpoint:
        checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(
            dirpath=options.checkpoints, every_n_train_steps=options.every, save_last=True
        )
    else:
        checkpoints = ModelCheckpoint(dirpath=options.checkpoints, every_n_train_steps=1, save_last=True)
    seed_everything(1234, workers=True)
    # botocore tries each request twice rather than five times: an outage fails a save in seconds, not minutes.
    retries = {"s3": {"config_kwargs": {"retries": {"total_max_attempts": 2}}}}
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=options.nodes,  # what the user expects; torchrun's agents decide
        strategy=ParallelStrategy(
            tensor_parallel_size=TENSOR_PARALLEL, non_finite="skip", storage_options=retries, async_checkpoint="thread"
        ),
        max_steps=8,
        precision="32-true",
        callbacks=[Chaos(options), checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LlamaWithOneBadBatch(options.nan_at)
    data = TokenDataModule(data_path=options.data_path, seq_len=32, global_batch_size=options.global_batch)
    trainer.fit(model, datamodule=data, ckpt_path="last")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_global_zero:
        torch.save(state, options.run / "final.pt")
    # As torch asks of every script: a process that exits with its process groups alive can be aborted (SIGABRT) by
    # gloo's worker threads as the interpreter shuts down, after training succeeded (pytorch/pytorch#179291). It
    # happened once more after this call, in the interpreter's teardown: the job's work is written, so it leaves
    # without one, as the tests' ranks do.
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("checkpoints")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--wait-for-nodes-after", type=int)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--storage-down", type=Path)
    parser.add_argument("--down-steps", type=int, nargs=2)
    parser.add_argument("--lightning-checkpoint", action="store_true")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--data-path", required=True)
    main(parser.parse_args())
