"""``CheckpointingStrategy``: how ``ParallelStrategy`` saves and loads, on the mesh ``MeshStrategy`` builds.

Every rank writes its own shards straight to the checkpoint's URL through ``ShardedCheckpointIO`` (behind training
while ``fit`` runs), with each rank's random state and data position; a load puts each rank's shards back under
whatever layout the run now has, and the random state is taken back as training starts.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerStatus
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer
from typing_extensions import override

from lightdist.checkpoint.async_checkpoint import AsyncMode, buffers_copied
from lightdist.checkpoint.storage import resolve
from lightdist.config import ParallelConfig
from lightdist.parallel.tensor import reorder_optimizer_state
from lightdist.parallelize import Parallelized
from lightdist.plugins.auto_layout import LayoutRequest
from lightdist.plugins.checkpoint_io import ShardedCheckpointIO
from lightdist.plugins.lightning_internals import checkpoint_now, restore_after_setup
from lightdist.plugins.mesh_strategy import MeshStrategy
from lightdist.plugins.rank_state import deal_samples_in_turn, gather_rank_states, set_epoch_to_train, take_rank_state
from lightdist.resilience.rng import set_rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CheckpointingStrategy"]


class CheckpointingStrategy(MeshStrategy):
    """Saves and loads sharded checkpoints of the model ``ParallelStrategy`` split (``_parallelized``), uploading
    as ``async_checkpoint`` says."""

    def __init__(
        self,
        sizes: LayoutRequest,
        config: ParallelConfig,
        collective_timeout: float,
        process_group_backend: str | None,
        async_checkpoint: AsyncMode | None,
    ) -> None:
        super().__init__(sizes, config, collective_timeout, process_group_backend)
        self._sharded_io = ShardedCheckpointIO(async_checkpoint)
        self._parallelized: Parallelized | None = None
        self._rng_state_to_restore: dict[str, Any] | None = None
        self._live_checkpoint: dict[str, Any] | None = None  # received from a live replica group, to resume from

    @property
    @override
    def checkpoint_io(self) -> ShardedCheckpointIO:
        return self._sharded_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._sharded_io = ShardedCheckpointIO.refusing_others(io)  # from Trainer(plugins=[...]), as it is built

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        state = get_optimizer_state_dict(self.lightning_module, optimizer)
        return reorder_optimizer_state(self.lightning_module, state, to_model_layout=True)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Save sharded: every rank writes its shards straight to ``filepath``, a path or any fsspec URL.

        While ``fit`` runs, the save returns once the state is staged in CPU memory and the upload goes on behind
        training (``async_checkpoint``); a save outside ``fit`` returns when the checkpoint is complete.
        """
        trainer = self.lightning_module.trainer
        gather_rank_states(checkpoint, self.root_device, self.layout, self._data_parallel, *_data_position(trainer))
        checkpoint["state_dict"] = buffers_copied(self.lightning_module, checkpoint["state_dict"])
        url = self.broadcast(str(filepath))  # rank 0's path, so every rank writes into one checkpoint
        running = trainer.state.status == TrainerStatus.RUNNING
        self.checkpoint_io.save_checkpoint(checkpoint, url, storage_options, background=running)
        self.checkpoint_io.log_failures(trainer.loggers, trainer.global_step)

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        self.checkpoint_io.remove_checkpoint(filepath)

    def live_checkpoint(self) -> dict[str, Any]:
        """Lightning's checkpoint of the run as it stands, without its tensors, with this rank's random state and data
        position: what the same rank of a replica group that joins resumes from (``plugins/replica_step.py``)."""
        trainer = self.lightning_module.trainer
        checkpoint = checkpoint_now(trainer)
        del checkpoint["state_dict"], checkpoint["optimizer_states"]
        position = _data_position(trainer)
        gather_rank_states(checkpoint, self.root_device, self.layout, self._data_parallel, *position, alone=True)
        return checkpoint

    def resume_from_live(self, checkpoint: dict[str, Any]) -> None:
        """Resume from a live group's ``live_checkpoint``, its tensors already loaded: ``fit`` restores it once set
        up, in place of any ``ckpt_path``."""
        self._rng_state_to_restore = take_rank_state(
            checkpoint, rank=self.global_rank, layout=self.layout, data_parallel=self._data_parallel
        )
        self._live_checkpoint = checkpoint
        restore_after_setup(self.lightning_module.trainer, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint of any ZeRO stage and layout, keyed by the LightningModule's own parameter
        names, from a path or any fsspec URL, or from a pointer to one."""
        if self._live_checkpoint is not None:  # a replica group that joined: the live state, not the stored one
            checkpoint, self._live_checkpoint = self._live_checkpoint, None
            return checkpoint
        # Rank 0 alone writes commits and pointers (last.ckpt): its broadcast, once they are done, lets the others read.
        self.checkpoint_io.wait()
        url = self.broadcast(str(checkpoint_path))
        module = self.lightning_module
        checkpoint = self.checkpoint_io.load_training_state(
            url,
            module,
            self.optimizers,
            strict=module.strict_loading,
            tied_names=self._parallelized.tied_heads_on(self.device_mesh),
            weights_only=weights_only,
        )
        self._rng_state_to_restore = take_rank_state(
            checkpoint, rank=self.global_rank, layout=self.layout, data_parallel=self._data_parallel
        )
        return checkpoint

    def roll_back(self, checkpoint: str) -> str:
        """Load ``checkpoint``'s weights and optimizer state, not its random state: the data goes on, past the batch
        that failed. Returns the checkpoint's URL."""
        self.load_checkpoint(checkpoint)
        self._rng_state_to_restore = None
        return resolve(checkpoint)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        set_epoch_to_train(dataloader, self.lightning_module.trainer)
        return dataloader

    @override
    def on_train_start(self) -> None:
        """Each rank takes back its random state from the checkpoint it resumes, here rather than on load: creating
        the data loader's iterator draws a number, as it did before the saved run's first step."""
        super().on_train_start()
        if self._rng_state_to_restore is not None:
            set_rng_state(self._rng_state_to_restore, self.root_device)
            self._rng_state_to_restore = None

    @override
    def teardown(self) -> None:
        if self.checkpoint_io.in_use and self.lightning_module is not None:
            self.checkpoint_io.wait()  # the last upload finishes before the process may exit
            trainer = self.lightning_module.trainer
            self.checkpoint_io.log_failures(trainer.loggers, trainer.global_step)
            if trainer.state.status == TrainerStatus.RUNNING:  # not after an error
                # Rank 0 alone commits and writes last.ckpt: once fit returns, every rank finds them written.
                self.barrier("lightdist: last checkpoint complete")
        super().teardown()  # ShardedCheckpointIO.teardown waits for the uploads in any case


def _data_position(trainer: pl.Trainer) -> tuple[bool, bool]:
    """Whether the training loaders deal samples to the ranks in turn, and whether the epoch's batches are all drawn
    (``gather_rank_states``)."""
    epoch_done = trainer.fit_loop.epoch_loop.batch_progress.current.ready >= trainer.num_training_batches
    return deal_samples_in_turn(trainer.train_dataloader), epoch_done
