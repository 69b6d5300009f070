"""The private names of Lightning (and torchmetrics) that lightdist relies on, in one place, each with why.

Lightning promises nothing about its private names: an upgrade may rename or change any of them. lightdist reaches
each through this module only, and ``tests/test_internals.py`` pins the behaviour relied on, so that an upgrade fails
in that test, naming the name, rather than in a user's run. Tested with Lightning 2.6 and torchmetrics 1.x.

``SUBCLASS_PRIVATES`` lists the private members of Lightning's classes that lightdist's subclasses override or use:
hooks Lightning gives its own strategies, callbacks and CLI, with no public counterpart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "SUBCLASS_PRIVATES",
    "SubprocessScriptLauncher",
    "checkpoint_now",
    "data_source",
    "give_device_mesh",
    "last_checkpoints_found_by",
    "metric_forward_cache",
    "restore_after_setup",
    "set_metric_progress",
    "skip_lightning_backward",
]

# Private members of Lightning's classes that lightdist's subclasses override or use, and why.
SUBCLASS_PRIVATES = {
    "_configure_launcher": "Strategy's hook to set its launcher: the first point that knows devices and nodes, where "
    "the layout is checked before any process starts",
    "_save_last_checkpoint": "ModelCheckpoint's save of last.ckpt, made a pointer to the newest complete checkpoint",
    "_save_checkpoint": "ModelCheckpoint's save, which the pointer's save calls",
    "_last_checkpoint_saved": "ModelCheckpoint's record of its last.ckpt",
    "_last_global_step_saved": "ModelCheckpoint's record of the step last saved",
    "_wandb_init": "WandbLogger's arguments to wandb.init, where Lightning always puts anonymous=None, which wandb "
    "0.2x warns on every run has no effect: the key is left out",
}


def give_device_mesh(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """``module.device_mesh`` answers ``mesh``, as Lightning's ``ModelParallelStrategy`` sets it (it has no setter)."""
    module._device_mesh = mesh


def last_checkpoints_found_by(callback: ModelCheckpoint, trainer: pl.Trainer) -> set[str]:
    """The ``last*.ckpt`` files a ``ModelCheckpoint`` without a directory of its own would resume from: Lightning's
    search, in the directory it would derive from the trainer's loggers."""
    return callback._find_last_checkpoints(trainer)


def checkpoint_now(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's checkpoint of the run as it stands, as ``Trainer.save_checkpoint`` would save it."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_after_setup(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Have ``fit`` restore ``checkpoint`` (loops, callbacks, LR schedulers, data module) once the strategy is set up,
    as it restores the one ``ckpt_path`` names: the state a replica group that joins receives from a live one."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def skip_lightning_backward(trainer: pl.Trainer, skip: bool) -> None:
    """Under a pipeline the schedule runs backward inside the step: Lightning must neither zero the gradients after
    it nor call backward on the returned loss (Lightning's own ``StochasticWeightAveraging`` sets this too)."""
    trainer.fit_loop._skip_backward = skip


def data_source(loop: Any) -> Any:
    """The loop's source of data loaders: the one place that knows the loader the loop will draw from, before it
    draws (the tracer needs one batch to learn the model call before the first step)."""
    return loop._data_source


def metric_forward_cache(metric: Metric) -> Any:
    """What logging ``metric`` on a step reports: the value of its last ``forward``."""
    return metric._forward_cache


def set_metric_progress(metric: Metric, update_count: int, forward_cache: Any) -> None:
    """Give ``metric`` another copy's count of updates and last ``forward`` value, its cached ``compute()`` dropped:
    the count decides whether ``compute()`` warns that nothing was updated, and torchmetrics has no setters."""
    metric._update_count, metric._computed, metric._forward_cache = update_count, None, forward_cache
