"""How long a checkpoint save stops training, beside a synchronous save of the same state, in one run.

For each target (local disk, and an S3 API server: moto's, started here on 127.0.0.1, unless ``--s3-endpoint`` names
another), over three training steps:

1. lightdist: ``trainer.save_checkpoint`` inside ``fit``, as ``ModelCheckpoint`` calls it, at the end of two steps
   (the first save also allocates the staging memory). The state is copied to CPU memory while the next step runs
   its forward and backward, and uploaded behind training. Blocked: the time the call took plus the time the next
   step's optimizer waited for the copy to finish (between ``on_after_backward`` and ``on_before_optimizer_step``).
   Beside it, how much longer than a step without saves that next step took: on a machine whose cores all train,
   the copy and the upload share them with training. Upload: from the call until the checkpoint is complete.
2. ``dcp.save`` of the same state: torch's synchronous save.
3. ``dcp.async_save`` with torch's defaults: the time it blocked.
4. ``fs.put`` of the same files from local disk: what the storage takes at best. On local disk each file is then
   fsynced, as DCP's writer does, so that both sides are durable rather than one in the page cache.

    python bench/checkpoint_stall.py --preset 1b --precision bf16-mixed     # one GPU: 0.95B parameters, 11 GB state
    python bench/checkpoint_stall.py --preset small --layers 24             # CPU: 104M parameters, 1.2 GB state
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from ranks import moto_server, s3_bucket
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightdist.checkpoint.storage import is_complete, remove
from lightdist.models import Llama, TokenDataModule
from lightdist.plugins import ParallelStrategy


@dataclass
class Timings:
    target: str
    state_bytes: int = 0
    lightdist_first_blocking: float = 0.0
    lightdist_blocking: float = 0.0
    next_step_slower: float = 0.0
    lightdist_upload: float = 0.0
    dcp_save: float = 0.0
    dcp_async_blocking: float = 0.0
    put: float = 0.0


class SaveTimer(Callback):
    """From step ``first_save_step`` on, three steps per target: a lightdist save at the end of the first two (the
    step after each shows what it cost training), and the comparisons at the end of the third."""

    def __init__(self, targets: dict[str, str], first_save_step: int) -> None:
        self.targets, self.first_save_step = targets, first_save_step
        self.results = [Timings(target) for target in targets]
        self.step_seconds: dict[int, float] = {}
        self._blocking: dict[int, float] = {}  # step -> how long the save at its end blocked the call
        self._optimizer_waited: dict[int, float] = {}  # step -> between backward and optimizer step
        self._uploads: list[Future] = []
        self._local_copy: str | None = None

    @property
    def last_step(self) -> int:
        return self.first_save_step + 3 * len(self.targets)

    def median_step_without_saves(self) -> float:
        steps = sorted(self.step_seconds[step] for step in range(2, self.first_save_step + 1))  # after the first
        return steps[len(steps) // 2]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        _synchronize(pl_module.device)
        self._start = time.perf_counter()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._backward_done = time.perf_counter()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._optimizer_waited[trainer.global_step + 1] = time.perf_counter() - self._backward_done

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        _synchronize(pl_module.device)
        step = trainer.global_step
        self.step_seconds[step] = time.perf_counter() - self._start
        if not self.first_save_step <= step < self.last_step:
            return
        index, phase = divmod(step - self.first_save_step, 3)
        root = list(self.targets.values())[index]
        timings = self.results[index]
        if phase == 0:
            self._blocking[step] = self._lightdist_save(trainer, f"{root}/lightdist-first")
        elif phase == 1:
            self._uploads.pop().result()  # the first save's upload must not hold up the second
            self._blocking[step] = self._lightdist_save(trainer, f"{root}/lightdist")
        else:
            timings.lightdist_upload = self._uploads.pop().result()
            remove(f"{root}/lightdist-first")  # measured: the disk holds at most two states (the 1b one is 11 GB)
            remove(f"{root}/lightdist")
            timings.lightdist_first_blocking = self._blocked(step - 2)
            timings.lightdist_blocking = self._blocked(step - 1)
            timings.next_step_slower = self.step_seconds[step] - self.median_step_without_saves()
            # Before the slower comparisons, so that a run stopped by its time limit still leaves lightdist's figures.
            print(
                f"{timings.target}: lightdist blocked {timings.lightdist_blocking:.3f} s (first save "
                f"{timings.lightdist_first_blocking:.3f} s), next step {timings.next_step_slower:+.2f} s, upload "
                f"{timings.lightdist_upload:.2f} s",
                flush=True,
            )
            self._compare_with_torch(trainer, pl_module, root, timings)

    def _lightdist_save(self, trainer: Trainer, url: str) -> float:
        start = time.perf_counter()
        trainer.save_checkpoint(url)
        blocking = time.perf_counter() - start
        self._uploads.append(_POLLER.submit(_wait_until_complete, url, start))
        return blocking

    def _blocked(self, save_step: int) -> float:
        return self._blocking[save_step] + self._optimizer_waited[save_step + 1]

    def _compare_with_torch(self, trainer: Trainer, pl_module: LightningModule, root: str, timings: Timings) -> None:
        group = dist.new_group(backend="gloo")  # DCP's collectives on CPU, as lightdist's own saves do
        state = {
            "state_dict": get_model_state_dict(pl_module),
            "optimizer_0": get_optimizer_state_dict(pl_module, trainer.optimizers[0]),
        }
        start = time.perf_counter()
        dcp.save(state, storage_writer=FsspecWriter(f"{root}/dcp-save"), process_group=group)
        timings.dcp_save = time.perf_counter() - start
        start = time.perf_counter()
        upload = dcp.async_save(state, storage_writer=FsspecWriter(f"{root}/dcp-async"), process_group=group)
        timings.dcp_async_blocking = time.perf_counter() - start
        upload.result()
        remove(f"{root}/dcp-async")
        fs, path = url_to_fs(f"{root}/dcp-save")
        timings.state_bytes = fs.du(path)
        self._local_copy = self._local_copy or path  # the first target is local disk
        start = time.perf_counter()
        put = f"{path.removesuffix('dcp-save')}put"
        fs.put(self._local_copy, put, recursive=True)
        if isinstance(fs, LocalFileSystem):
            for name in fs.ls(put, detail=False):
                with open(name, "rb") as file:
                    os.fsync(file.fileno())
        timings.put = time.perf_counter() - start
        fs.rm(put, recursive=True)


_POLLER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-upload-poll")


def _wait_until_complete(url: str, start: float) -> float:
    while not is_complete(url):
        time.sleep(0.02)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace, targets: dict[str, str]) -> SaveTimer:
    seed_everything(0)
    config = {"n_layers": args.layers} if args.layers else None
    model = Llama(preset=args.preset, config=config)
    timer = SaveTimer(targets, first_save_step=args.save_at)
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        strategy=ParallelStrategy(async_checkpoint=args.async_checkpoint),
        precision=args.precision,
        max_steps=timer.last_step + 1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, datamodule=TokenDataModule(seq_len=args.seq_len, batch_size=args.batch_size))
    return timer


COLUMNS = (
    "state GB",
    "sync save s",
    "DCP async s",
    "lightdist s",
    "1st save s",
    "of sync",
    "next step +s",
    "upload GB/s",
    "put GB/s",
)


def report(timer: SaveTimer) -> None:
    """Training blocked by a save (DCP async, lightdist, lightdist's first save) beside the synchronous save; how
    much slower the step after lightdist's save ran; lightdist's background upload throughput beside fs.put's."""
    print(f"training step without saves (median): {timer.median_step_without_saves():.3f} s")
    print(f"{'target':<8}" + "".join(f"{column:>14}" for column in COLUMNS))
    for t in timer.results:
        gigabytes = t.state_bytes / 1e9
        row = (
            f"{gigabytes:.3f}",
            f"{t.dcp_save:.2f}",
            f"{t.dcp_async_blocking:.2f}",
            f"{t.lightdist_blocking:.3f}",
            f"{t.lightdist_first_blocking:.3f}",
            f"{t.lightdist_blocking / t.dcp_save:.1%}",
            f"{t.next_step_slower:+.2f}",
            f"{gigabytes / t.lightdist_upload:.2f}",
            f"{gigabytes / t.put:.2f}",
        )
        print(f"{t.target:<8}" + "".join(f"{value:>14}" for value in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of blocks")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--save-at", type=int, default=4, help="the first step after which to save")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--async-checkpoint", default="process", choices=["process", "thread"])
    parser.add_argument("--local-only", action="store_true", help="leave out the S3 target")
    parser.add_argument("--local-dir", default=None, help="where the local saves go (default: a temporary folder)")
    parser.add_argument("--s3-endpoint", default=None, help="an S3 API endpoint (default: start moto's server)")
    args = parser.parse_args()
    if args.save_at < 3:
        parser.error(f"--save-at={args.save_at}: give at least 3, so that steps after the first time training alone")

    scratch = args.local_dir or tempfile.mkdtemp(prefix="lightdist-bench-")
    try:
        with ExitStack() as servers:
            targets = {"local": scratch}  # first: its files are the source of every target's fs.put
            if not args.local_only:
                endpoint = args.s3_endpoint or servers.enter_context(moto_server())
                targets["s3"] = s3_bucket(endpoint, f"lightdist-bench-{uuid.uuid4().hex[:8]}")
            report(run(args, targets))
    finally:
        if args.local_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
