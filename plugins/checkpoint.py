"""Lightning's ``ModelCheckpoint`` for sharded checkpoints at any fsspec URL, with an atomic ``last.ckpt``; under
``ParallelStrategy`` every Lightning ``ModelCheckpoint`` a user configured gets this behaviour."""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any

from fsspec.core import url_to_fs
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from torch import Tensor
from typing_extensions import override

from lightdist.checkpoint.storage import check_writable, is_complete
from lightdist.plugins.checkpoint_io import ShardedCheckpointIO

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ModelCheckpoint", "adopt_checkpoint_callbacks"]

log = logging.getLogger(__name__)


def _saves_sharded(trainer: pl.Trainer) -> bool:
    """Whether ``trainer`` saves through lightdist's sharded checkpoints, as ``ParallelStrategy`` does: the pointer
    ``last.ckpt`` is written by their ``CheckpointIO``."""
    return isinstance(trainer.strategy.checkpoint_io, ShardedCheckpointIO)


class ModelCheckpoint(_LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, whose ``last.ckpt`` is a small file naming the newest checkpoint.

    Lightning rewrites ``last.ckpt`` in place at every save: on object storage, a save cut short there leaves no
    ``last`` at all, and the upload doubles. Here ``last.ckpt`` is pointed at the checkpoint this step saved, once that
    one is complete; where no top-k checkpoint was saved at this step, the state goes to ``last-step=N.ckpt`` first.
    A save cut short never takes the previous ``last`` with it.

    Before ``fit`` trains, rank 0 writes and deletes a small object under ``dirpath``: a missing bucket, missing
    credentials, an unreachable endpoint or a read-only directory fail then, each with its fix. A name that holds
    only what a save cut short left is free for the next save, rather than pushing it to Lightning's ``-v1``, and a
    storage fault in that look fails the save (reported, training goes on), not the training step.

    Under any other strategy than ``ParallelStrategy`` it is Lightning's ``ModelCheckpoint`` unchanged.
    """

    _last_only_path = ""  # the state saved for last.ckpt alone, removed once last.ckpt names a newer one

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before Lightning's own setup, whose first look into dirpath would meet the same problem with less to say.
        if stage == "fit" and self.dirpath is not None and _saves_sharded(trainer):
            problem = None
            if trainer.is_global_zero:
                try:
                    check_writable(self.dirpath)
                except ValueError as error:
                    problem = str(error)
            problem = trainer.strategy.broadcast(problem)
            if problem is not None:
                raise ValueError(problem)
        super().setup(trainer, pl_module, stage)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_only_path": self._last_only_path}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.dirpath == state_dict.get("dirpath", self.dirpath):
            self._last_only_path = state_dict.get("last_only_path", "")

    @override
    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if not self.save_last or not _saves_sharded(trainer):
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        if self._last_checkpoint_saved is None or self._last_global_step_saved != trainer.global_step:
            previous_last_only = self._last_only_path
            self._last_only_path = self._path(f"{self.CHECKPOINT_NAME_LAST}-step={trainer.global_step}")
            self._save_checkpoint(trainer, self._last_only_path)
            if previous_last_only:
                trainer.strategy.remove_checkpoint(previous_last_only)
        elif self._last_only_path:  # last.ckpt will name a top-k checkpoint: the state kept for it alone goes
            trainer.strategy.remove_checkpoint(self._last_only_path)
            self._last_only_path = ""
        self.last_model_path = self._path(self.CHECKPOINT_NAME_LAST)
        trainer.strategy.checkpoint_io.point(self.last_model_path, self._last_checkpoint_saved)

    @override
    def file_exists(self, filepath: str, trainer: pl.Trainer) -> bool:
        """Whether a checkpoint named ``filepath`` is already there, which Lightning then saves beside as ``-v1``.

        Only a complete checkpoint (or a pointer) counts: what a save cut short left under the name holds nothing to
        keep, and this save replaces it. A storage fault counts as nothing there, so that the save goes ahead, fails
        in turn and is reported, rather than training failing here on the way to it.
        """
        if not _saves_sharded(trainer):
            return super().file_exists(filepath, trainer)
        there = False
        if trainer.is_global_zero:
            try:
                fs, path = url_to_fs(filepath)
                there = fs.isfile(path) or is_complete(filepath)
            except Exception as error:
                log.warning("lightdist: could not look for a checkpoint at %s: %s", filepath, error)
        return trainer.strategy.reduce_boolean_decision(there, all=False)

    def _path(self, name: str) -> str:
        return os.path.join(self.dirpath, name + self.FILE_EXTENSION)


def adopt_checkpoint_callbacks(trainer: pl.Trainer) -> None:
    """Give each of the Trainer's Lightning ``ModelCheckpoint`` callbacks (a user's subclass too) the behaviour of
    lightdist's, so that switching the strategy is all a user changes: their own callback keeps its settings and state,
    and saves through the strategy as lightdist's does. Its class becomes a subclass of both, as FSDP2's
    ``fully_shard`` does with modules; a subclass's own overrides still come first. The class keeps its name, which
    keys the callback's state in checkpoints."""
    for callback in trainer.callbacks:
        if isinstance(callback, _LightningModelCheckpoint) and not isinstance(callback, ModelCheckpoint):
            callback.__class__ = _with_lightdist_behaviour(type(callback))


@functools.cache
def _with_lightdist_behaviour(cls: type[_LightningModelCheckpoint]) -> type[ModelCheckpoint]:
    if cls is _LightningModelCheckpoint:
        return ModelCheckpoint
    return type(cls.__name__, (cls, ModelCheckpoint), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
