"""Where a run under ``ParallelStrategy`` starts: ``ckpt_path="last"`` is the newest complete checkpoint, whichever
``ModelCheckpoint`` class saved it.

Lightning resolves ``"last"`` inside ``Trainer.fit`` before any strategy hook runs, from the ``last*.ckpt`` names its
callbacks list. On ``s3://`` and ``gs://`` its search drops the protocol, finds nothing and trains from step 0; on a
local disk it picks a ``last.ckpt`` that a kill may have cut short. The one part of a strategy that runs earlier is
its launcher: Lightning hands it each entry point (``fit``, ``validate``, ``test``, ``predict``) with the Trainer, in
every process. So ``ParallelStrategy``'s launcher resolves ``"last"`` itself, and gives the Trainer's checkpoint
callbacks lightdist's behaviour (plugins/checkpoint.py) before they first save, then launches as Lightning's would.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightdist.checkpoint.storage import checkpoints_under
from lightdist.plugins.checkpoint import adopt_checkpoint_callbacks
from lightdist.plugins.lightning_internals import SubprocessScriptLauncher, last_checkpoints_found_by
from lightdist.plugins.progress import adopt_progress_bar

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ResumesLast", "checkpoint_directories", "newest_complete_checkpoint", "resuming_launcher"]

_NOT_ASKED = object()


class ResumesLast:
    """Resolves ``ckpt_path="last"`` before the launcher it is mixed into launches (Lightning's own, or none)."""

    _resumes: object = _NOT_ASKED  # the checkpoint "last" named in this process, None for none
    ckpt_path: str | None = None  # the checkpoint the call launched last loads ("last" resolved), None for none

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer, **kwargs: Any) -> Any:
        adopt_checkpoint_callbacks(trainer)
        adopt_progress_bar(trainer)
        call = inspect.signature(function).bind(*args, **kwargs)  # Lightning's _fit_impl(..., ckpt_path, ...)
        self._resumes = _NOT_ASKED
        if call.arguments.get("ckpt_path") == "last":
            last = newest_complete_checkpoint(checkpoint_directories(trainer))
            self._resumes = call.arguments["ckpt_path"] = last
        self.ckpt_path = call.arguments.get("ckpt_path")
        return super().launch(function, *call.args, trainer=trainer, **call.kwargs)

    def check_every_rank_resumes_alike(self) -> None:
        """Refuse a run where ``"last"`` named a checkpoint on some ranks and nothing on others (a collective, once
        the process group exists): those that found none would not join the others' load, and all would hang.
        Storage whose listings lag between machines (NFS's attribute cache) can show ranks different checkpoints."""
        if self._resumes is _NOT_ASKED or dist.get_world_size() == 1:
            return
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, self._resumes)
        if len({checkpoint is None for checkpoint in found}) > 1:
            seen = ", ".join(f"rank {rank}: {checkpoint or 'none'}" for rank, checkpoint in enumerate(found))
            raise RuntimeError(
                f"ckpt_path='last' found a checkpoint on some ranks and none on others ({seen}): their storage "
                "listings disagree. Give every rank the same view of the checkpoint directory (a shared filesystem "
                "without attribute caching, or object storage), or pass the checkpoint's URL as ckpt_path."
            )


class _StartsRanks(ResumesLast, SubprocessScriptLauncher):
    """Lightning's launcher, which starts the other ranks by running the script again, each resolving in turn."""


class _InThisProcess:
    """Where torchrun, SLURM or Ray started the processes: the function runs in this one."""

    is_interactive_compatible = True

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    def kill(self, signum: int) -> None:
        pass


class _RunsHere(ResumesLast, _InThisProcess):
    """The launcher under torchrun, SLURM and Ray."""


def resuming_launcher(environment: ClusterEnvironment, num_processes: int, num_nodes: int) -> ResumesLast:
    """The strategy's launcher: Lightning's own where it starts the processes, as ``ModelParallelStrategy`` has it."""
    if environment.creates_processes_externally:
        return _RunsHere()
    return _StartsRanks(environment, num_processes, num_nodes)


def newest_complete_checkpoint(directories: list[str]) -> str | None:
    """The newest complete checkpoint under ``directories``, ``None`` where there are no checkpoints there at all, or
    only saves cut short (a first save that a crash stopped: never committed, so never a checkpoint); newer ones that
    cannot be loaded (cut short, damaged) are skipped with one line naming them. Where checkpoints exist but none can
    be loaded, an error: never a silent start from step 0.

    Where a pointer (``last.ckpt``) names it, the pointer is returned, as Lightning's own search returns
    ``last.ckpt``: Lightning's retention spares the checkpoint a run was resumed from, so a checkpoint directory
    passed on would never be removed, one more kept on a local disk after every restart."""
    newest_first = checkpoints_under(*directories)
    where = " or ".join(directories) or "no checkpoint callback's dirpath"
    if not newest_first:
        rank_zero_info(f"lightdist: no checkpoint under {where}: starting from step 0")
        return None
    complete = next((checkpoint for checkpoint in newest_first if checkpoint.problem is None), None)
    if complete is None and all(checkpoint.cut_short for checkpoint in newest_first):
        more = f" and {len(newest_first) - 1} more" if len(newest_first) > 1 else ""
        rank_zero_info(
            f"lightdist: no checkpoint under {where} was completed ({newest_first[0].url}{more}: saves cut short "
            "before their commit): starting from step 0"
        )
        return None
    if complete is None:
        listed = "; ".join(f"{checkpoint.url} is {checkpoint.problem}" for checkpoint in newest_first[:4])
        more = f"; and {len(newest_first) - 4} more" if len(newest_first) > 4 else ""
        raise ValueError(
            f"ckpt_path='last' found checkpoints under {where}, but none that can be loaded: {listed}{more}. "
            "Nothing was loaded, and training did not start from step 0 in their place. Pass the URL of a "
            "checkpoint saved elsewhere as ckpt_path, or ckpt_path=None to train from step 0 beside them."
        )
    newer = newest_first[: newest_first.index(complete)]
    resumes = f"{complete.url} (step {complete.step})" if complete.step is not None else complete.url
    if newer:
        more = f" and {len(newer) - 1} more" if len(newer) > 1 else ""
        rank_zero_info(
            f"lightdist: skipping {newer[0].url} ({newer[0].problem}){more}: resuming from {resumes}, the newest "
            "complete checkpoint"
        )
    else:
        rank_zero_info(f"lightdist: resuming from {resumes}, the newest complete checkpoint under {where}")
    return complete.pointer or complete.url


def checkpoint_directories(trainer: pl.Trainer) -> list[str]:
    """Where the Trainer's checkpoint callbacks save. A ``ModelCheckpoint`` without a dirpath gets Lightning's
    default directory in its setup, long after ``"last"`` is resolved: there, the directory Lightning's own search
    for ``last.ckpt`` looks into."""
    directories = []
    for callback in trainer.callbacks:
        if isinstance(callback, (ModelCheckpoint, OnExceptionCheckpoint)) and callback.dirpath is not None:
            directories.append(str(callback.dirpath))
        elif isinstance(callback, ModelCheckpoint):
            directories.extend(os.path.dirname(path) for path in last_checkpoints_found_by(callback, trainer))
    return list(dict.fromkeys(directories))
