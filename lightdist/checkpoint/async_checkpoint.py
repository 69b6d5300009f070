"""Checkpoint saves that barely pause training: the state is copied to CPU memory and uploaded behind training.

The copy (staging) runs in a background thread while the next step computes its forward and backward, which read
the parameters and optimizer state but do not change them; the owner calls ``wait_for_staging`` before the optimizer
changes them. At most one save is in flight: a new save first waits for the previous upload, so staged copies never
pile up. Rank 0 does everything that must follow an upload, one job at a time and in the order it was asked: commit
the checkpoint once every rank's shards are written, then removals and pointers. So a removal (retention) runs only
after a newer checkpoint is complete and a pointer never names an incomplete one. A save that fails is logged on
every rank that saw it; training goes on, and removals wait for the next save that succeeds, so the last good
checkpoint stays.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

# Not re-exported by torch.distributed.checkpoint (torch 2.13), but the writer DCP documents for fsspec.
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from lightdist.checkpoint.storage import commit, is_complete, remove, write_pointer
from lightdist.parallel.sharding import local_tensor
from lightdist.torch_internals import FsspecWriter, adopt_checkpoint_processes

__all__ = ["WRITER_THREADS", "AsyncMode", "CheckpointSaver", "buffers_copied"]

AsyncMode = Literal["process", "thread"]

# Files each rank writes in parallel (``__{rank}_{0..3}.distcp``). One stream per rank reached 60% of a durable
# ``fs.put`` to local disk and 70% of one to S3 (moto); four reached 95% of each (measured on 2 CPU cores, 0.6-1.2 GB).
WRITER_THREADS = 4

log = logging.getLogger(__name__)


class CheckpointSaver:
    """Saves, removals and pointers for one run's sharded checkpoints, in order; the upload in the background when
    ``mode`` is ``"process"`` (DCP's daemon process per rank) or ``"thread"``, in the caller when ``None``."""

    def __init__(self, mode: AsyncMode | None) -> None:
        self._mode = mode
        if mode == "process":
            adopt_checkpoint_processes()
        self._group: dist.ProcessGroup | None = None
        self._stager: DefaultStager | None = None
        self._staging: Future | None = None
        self._upload: Future | None = None
        # Rank 0's ordered jobs, and what they share (touched only by that one worker thread).
        self._jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightdist-checkpoint")
        self._last_job: Future | None = None
        self._commits_here = False
        self._last_save_ok = True
        self._failed_saves: set[str] = set()
        self._removals_waiting: list[str] = []
        self._pointers: dict[str, str] = {}  # pointer URL -> the checkpoint it names
        self.failures: list[str] = []

    def save(self, state: dict[str, Any], url: str, metadata: dict[str, Any] | None, *, background: bool) -> None:
        """Save ``state`` (every rank's shards) to ``url``; rank 0 passes Lightning's ``metadata``. A collective.

        ``background=True`` returns before the state is even staged: the caller must call ``wait_for_staging``
        before it changes any tensor in ``state``. ``background=False`` returns once the checkpoint is complete and
        raises if it could not be saved: for the saves a user waits for, such as ``trainer.save_checkpoint`` after
        ``fit``.
        """
        self.wait()
        if self._group is None:
            # DCP's own collectives run beside training's; on their own gloo group they never interleave, and
            # DCP's background saves need a CPU group even where training runs on NCCL.
            self._group = dist.new_group(backend="gloo")
        background = background and self._mode is not None
        self._commits_here = metadata is not None
        # Storage faults here fail this save like any upload's: training must not die of a bucket's bad minute.
        error: Exception | None = None
        if self._commits_here:
            try:
                remove(url)  # a checkpoint saved under this name before: its files must not mix with this one's
            except Exception as raised:
                error = raised
        dist.barrier(group=self._group)
        writer = None
        if error is None:
            try:
                writer = FsspecWriter(url, thread_count=WRITER_THREADS)
            except Exception as raised:
                error = raised
        if not _on_every_rank(writer is not None, self._group):
            error = error or RuntimeError("another rank could not prepare it")
            if not background:
                raise RuntimeError(f"lightdist: the checkpoint at {url} could not be saved: {error}") from error
            self._upload = Future()
            self._upload.set_exception(error)
        elif background:
            if torch.cuda.is_available():
                # Staging copies on its own stream: the optimizer step's kernels must have written their results.
                torch.cuda.current_stream().synchronize()
            with _checkpoint_processes_meet_at_rank_0(self._mode == "process" and dist.get_rank(self._group) == 0):
                response = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=self._group,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS
                    if self._mode == "process"
                    else AsyncCheckpointerType.THREAD,
                    async_stager=self._staging_area(),
                )
            self._staging, self._upload = response.staging_completion, response.upload_completion
        else:
            dcp.save(state, storage_writer=writer, process_group=self._group)
        if metadata is not None:
            self._submit(self._commit, self._upload, url, _serialized(metadata), metadata.get("global_step"))
        if not background:
            self.wait()
            if metadata is not None and not self._last_save_ok:
                raise RuntimeError(self.failures[-1])

    def remove(self, url: str) -> None:
        """Delete the checkpoint at ``url`` once a later save has completed. Rank 0 only."""
        self._submit(self._remove, url)

    def point(self, pointer_url: str, checkpoint_url: str) -> None:
        """Make ``pointer_url`` name ``checkpoint_url`` once that checkpoint is complete. Rank 0 only."""
        self._submit(self._point, pointer_url, checkpoint_url)

    def wait_for_staging(self) -> None:
        """Return once the state of the save in flight is copied: from then on training may change it."""
        if self._staging is not None:
            self._staging.exception()  # a failure is the upload's too, and reported with it
            self._staging = None

    def wait(self) -> None:
        """Return once this rank's upload and rank 0's jobs so far are done; failures are logged, never raised."""
        self.wait_for_staging()
        if self._upload is not None:
            error = self._upload.exception()
            self._upload = None
            if error is not None and not self._commits_here:  # rank 0's commit job reports its own
                self._report(f"this rank's shards could not be written: {error}")
        if self._last_job is not None:
            self._last_job.result()

    def _staging_area(self) -> DefaultStager:
        if self._stager is not None and not _STAGER_STAGES_TWICE:
            self._stager.close()  # its one staging is done: save() waited for it
            self._stager = None
        if self._stager is None:
            cuda = torch.cuda.is_available()
            # Pinned memory makes the device-to-host copy fast; shared memory hands it to the daemon process
            # without a second copy. The copy buffers are kept from one save to the next.
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=self._mode == "process",
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
            self._stager = DefaultStager(options)
        return self._stager

    def _submit(self, job: Any, *args: Any) -> None:
        self._last_job = self._jobs.submit(job, *args)

    def _commit(self, upload: Future | None, url: str, metadata: bytes, step: int | None) -> None:
        try:
            if upload is not None:
                upload.result()
            commit(url, metadata, step=step)
        except (Exception, CheckpointException) as error:  # DCP's own is a BaseException
            self._last_save_ok = False
            self._failed_saves.add(url)
            self._report(f"the checkpoint at {url} could not be saved: {error}")
            return
        self._last_save_ok = True
        self._failed_saves.discard(url)
        self._retry_removals()

    def _remove(self, url: str) -> None:
        # Not while the newest save failed (this may be the last good checkpoint), nor while a pointer names it:
        # Lightning asks to remove a top-k checkpoint before it points last.ckpt elsewhere.
        if not self._last_save_ok or url in self._pointers.values():
            self._removals_waiting.append(url)
            return
        try:
            remove(url)
        except Exception as error:
            self._removals_waiting.append(url)
            log.warning(
                "lightdist: could not remove the old checkpoint at %s, tried again after the next save: %s", url, error
            )

    def _point(self, pointer_url: str, checkpoint_url: str) -> None:
        try:
            # Its save failed, and was reported; asking the storage may take long where it is the storage that failed.
            if checkpoint_url in self._failed_saves or not is_complete(checkpoint_url):
                return
            write_pointer(pointer_url, checkpoint_url)
        except Exception as error:
            self._report(f"{pointer_url} could not be pointed at {checkpoint_url}: {error}")
            return
        self._pointers[pointer_url] = checkpoint_url
        self._retry_removals()

    def _retry_removals(self) -> None:
        waiting, self._removals_waiting = self._removals_waiting, []
        for url in waiting:
            self._remove(url)

    def _report(self, problem: str) -> None:
        message = f"lightdist: {problem}. Training goes on; the previous complete checkpoint is kept."
        self.failures.append(message)
        log.error(message)


# torch 2.11's DefaultStager closes its state-dict stager after each staging, so a second staging fails (KeyError:
# <class 'type'>, from the emptied copy table): there a save gets a stager of its own, which allocates its pinned
# buffers anew. From torch 2.13 one stager stages every save and keeps its buffers.
_STAGER_STAGES_TWICE = torch.__version__ >= "2.13"


def buffers_copied(module: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with copies of ``module``'s buffers in place of the buffers themselves.

    A background save copies the state while the next step runs its forward and backward: they leave parameters and
    optimizer state alone, but a forward may update buffers (BatchNorm's running statistics). Buffers are small.
    """

    def address(tensor: Tensor) -> int:
        return local_tensor(tensor).data_ptr()

    buffers = {address(buffer) for buffer in module.buffers()}
    return {
        name: value.clone() if isinstance(value, Tensor) and address(value) in buffers else value
        for name, value in state_dict.items()
    }


_CHECKPOINT_PROCESS_STORE: dist.TCPStore | None = None  # rank 0's, for its checkpoint processes' lifetime: its own


@contextlib.contextmanager
def _checkpoint_processes_meet_at_rank_0(rank_0: bool) -> Iterator[None]:
    """DCP's checkpoint processes (one per rank, started by the first save) meet at a store that rank 0 holds.

    torch has rank 0 pick a free port and its checkpoint process bind it seconds later, once it has started: a
    process that binds that port meanwhile (another job's on a shared node, another rank's store or listener) leaves
    every checkpoint process waiting for the others, and the ranks for their uploads, for DCP's 30 minutes.
    lightdist binds the store in rank 0 itself (on every interface), on a port the kernel gives as it binds, and
    points DCP's prefix-store option (``DCP_USE_PREFIX_STORE``, read as the first save starts the processes) at it.
    A store of its own, not the job's: a job that torchrun restarts keeps its agent's store, where the previous
    attempt's keys would still be.
    """
    global _CHECKPOINT_PROCESS_STORE
    if "MASTER_ADDR" not in os.environ:  # DCP's own rendezvous, as a job without one set up by a launcher has
        yield
        return
    variables = {"DCP_USE_PREFIX_STORE": "1"}
    if rank_0:
        if _CHECKPOINT_PROCESS_STORE is None:
            _CHECKPOINT_PROCESS_STORE = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        variables["MASTER_PORT"] = str(_CHECKPOINT_PROCESS_STORE.port)
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _on_every_rank(flag: bool, group: dist.ProcessGroup) -> bool:
    every = torch.tensor([int(flag)])
    dist.all_reduce(every, op=dist.ReduceOp.MIN, group=group)
    return bool(every.item())


def _serialized(metadata: dict[str, Any]) -> bytes:
    # Serialized now, while training waits: the dictionaries hold live objects that later steps change.
    buffer = io.BytesIO()
    torch.save(metadata, buffer)
    return buffer.getvalue()
