"""``ShardedCheckpointIO``: Lightning's ``CheckpointIO`` for the sharded checkpoints ``ParallelStrategy`` saves.

Every rank writes its own shards of the model and optimizer state straight to a path or any fsspec URL (s3://,
gs://), in torch's distributed checkpoint format; rank 0 then commits Lightning's metadata beside them, so a checkpoint
is either complete or ignored. Saves during ``fit`` go on behind training once staged in CPU memory
(``lightdist.checkpoint.async_checkpoint``). Loading reshards: the model may be split another way than the run that
saved it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from lightning.fabric.loggers import Logger
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from typing_extensions import override

from lightdist.checkpoint.async_checkpoint import AsyncMode, CheckpointSaver
from lightdist.checkpoint.storage import check_same_model, load_sharded, read_metadata, resolve
from lightdist.parallel.tensor import reorder_optimizer_state

__all__ = ["ShardedCheckpointIO"]


class ShardedCheckpointIO(CheckpointIO):
    """Saves, loads and removes sharded checkpoints; every save and load is a collective of all ranks.

    Args:
        async_checkpoint: How saves asked for with ``background=True`` upload: ``"process"`` (DCP's daemon process
            per rank), ``"thread"``, or ``None`` (before the save returns).
    """

    def __init__(self, async_checkpoint: AsyncMode | None = "process") -> None:
        self.async_checkpoint = async_checkpoint
        self.blocked_s = 0.0
        # False in all but one of several replica groups: their checkpoints would be the same, written to one place
        self.writes = True
        self._saver: CheckpointSaver | None = None
        self._failures_logged = 0

    @staticmethod
    def refusing_others(io: CheckpointIO) -> ShardedCheckpointIO:
        """``io``, which must be a ``ShardedCheckpointIO``: ``ParallelStrategy`` saves sharded checkpoints only."""
        if not isinstance(io, ShardedCheckpointIO):
            raise TypeError(
                f"ParallelStrategy saves sharded checkpoints through lightdist's ShardedCheckpointIO, but the Trainer "
                f"was given {type(io).__name__}. Leave it out of Trainer(plugins=...): uploads already go on behind "
                "training (ParallelStrategy(async_checkpoint=...)), to any path or fsspec URL."
            )
        return io

    @property
    def failures(self) -> list[str]:
        """What each save that failed in this process said, oldest first."""
        return self._saver.failures if self._saver is not None else []

    def log_failures(self, loggers: Iterable[Logger], step: int) -> None:
        """Log the count of failed saves to ``loggers`` when it has grown, beside the error each rank logged."""
        failed = len(self.failures)
        if failed > self._failures_logged:
            self._failures_logged = failed
            for logger in loggers:
                logger.log_metrics({"checkpoint/failed_saves": failed}, step=step)

    @property
    def in_use(self) -> bool:
        """Whether this process has saved or loaded a checkpoint, and so may have uploads to wait for."""
        return self._saver is not None

    @override
    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        storage_options: Any | None = None,
        *,
        background: bool = False,
    ) -> None:
        """Save Lightning's ``checkpoint``, whose ``state_dict`` and ``optimizer_states`` hold this rank's shards, to
        ``path`` (the same on every rank). ``background``: return once the state is staged in CPU memory; the caller
        calls ``wait_for_staging`` before changing it. Otherwise return when the checkpoint is complete."""
        if storage_options is not None:
            raise TypeError(
                "ParallelStrategy.save_checkpoint(..., storage_options=...) is not supported: set endpoints and "
                "profiles once with ParallelStrategy(storage_options={'s3': {...}}); credentials come from the "
                "environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS) or the profile."
            )
        if not self.writes:
            return
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        with self.blocking():
            metadata = checkpoint if dist.get_rank() == 0 else None
            self._checkpoint_saver.save(state, str(path), metadata=metadata, background=background)

    @override
    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's checkpoint at ``path`` (or at the checkpoint a pointer names) without its tensors; a run that
        resumes loads them in place with ``load_training_state``, which returns this too."""
        self.wait()
        return read_metadata(resolve(str(path)), weights_only=weights_only)

    def load_training_state(
        self,
        path: str | os.PathLike,
        module: nn.Module,
        optimizers: Iterable[Optimizer],
        *,
        strict: bool = True,
        tied_names: dict[str, str] | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load ``module``'s and ``optimizers``' shards from the checkpoint at ``path``, however the run that saved
        it was split, and return the rest of Lightning's checkpoint. ``tied_names``: a weight this rank holds under
        another name than the whole model keeps it (a head tied to the embedding, on the last pipeline stage) mapped
        to the whole model's name."""
        self.wait()
        url = resolve(str(path))
        model_state = {"state_dict": get_model_state_dict(module)}
        check_same_model(url, _whole_model_shapes(model_state["state_dict"]), strict=strict)
        load_sharded(model_state, url)
        set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict))
        aliases = tied_names or {}
        own = {name: alias for alias, name in aliases.items()}
        for index, optimizer in enumerate(optimizers):
            key = f"optimizer_{index}"
            state = reorder_optimizer_state(module, get_optimizer_state_dict(module, optimizer), to_model_layout=True)
            own_names = [group["params"] for group in state["param_groups"]]
            state["state"] = {aliases.get(name, name): value for name, value in state["state"].items()}
            load_sharded({key: state}, url)
            state["state"] = {own.get(name, name): value for name, value in state["state"].items()}
            # The saved parameter groups are one rank's: under a pipeline they name that stage's parameters only.
            # Their settings (betas, weight decay) hold for every rank; which parameters they hold is this rank's.
            if len(state["param_groups"]) == len(own_names):
                for group, names in zip(state["param_groups"], own_names, strict=True):
                    group["params"] = names
            state = reorder_optimizer_state(module, state, to_model_layout=False)
            # Not strict: a ZeRO-1 rank holds state only for the parameters it owns, and dcp.load has already
            # checked that the checkpoint has every state this rank asked for.
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=StateDictOptions(strict=False))
        return read_metadata(url, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Remove a checkpoint once every save asked for before has completed, so that retention never takes the
        last complete checkpoint. Rank 0 removes; the other ranks return."""
        if dist.get_rank() == 0 and self.writes:
            self._checkpoint_saver.remove(str(path))

    def point(self, pointer: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
        """Make the small file ``pointer`` name ``checkpoint`` once that checkpoint is complete: ``last.ckpt``."""
        if dist.get_rank() == 0 and self.writes:
            self._checkpoint_saver.point(str(pointer), str(checkpoint))

    def wait_for_staging(self) -> None:
        """Return once the save in flight has copied the state, which training may change from then on."""
        if self._saver is not None:
            with self.blocking():
                self._saver.wait_for_staging()

    def wait(self) -> None:
        """Return once this rank's uploads, and on rank 0 its commits, removals and pointers, so far are done."""
        if self._saver is not None:
            self._saver.wait()

    @override
    def teardown(self) -> None:
        self.wait()  # the last upload finishes before the process may exit

    @contextmanager
    def blocking(self) -> Generator[None, None, None]:
        """Count the time inside as time training waited on checkpoints (``blocked_s``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s += time.perf_counter() - start

    @property
    def _checkpoint_saver(self) -> CheckpointSaver:
        if self._saver is None:  # built in each rank's process: it holds threads and a process group
            self._saver = CheckpointSaver(self.async_checkpoint)
        return self._saver


def _whole_model_shapes(state_dict: dict[str, Tensor]) -> dict[str, list[int]]:
    """The whole shape of every tensor of the model, each rank's included: a pipeline stage holds only its own."""
    shapes = {name: list(tensor.shape) for name, tensor in state_dict.items()}  # a DTensor's shape is whole
    every_rank: list[dict[str, list[int]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every_rank, shapes)
    return {name: shape for rank_shapes in every_rank for name, shape in rank_shapes.items()}
