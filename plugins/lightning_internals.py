"""The private names of Lightning (and torchmetrics) that lightdist relies on, in one place, each with why.

Lightning promises nothing about its private names: an upgrade may rename or change any of them. lightdist reaches
each through this module only, and ``tests/test_internals.py`` pins the behaviour relied on, so that an upgrade fails
in that test, naming the name, rather than in a user's run. Tested with Lightning 2.6 and torchmetrics 1.x.

``SUBCLASS_PRIVATES`` lists the private members of Lightning's classes that lightdist's subclasses override or use:
hooks Lightning gives its own strategies, callbacks and CLI, with no public counterpart.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from torch import nn
from torch.distributed import Store
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torchmetrics import Metric

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy

__all__ = [
    "SUBCLASS_PRIVATES",
    "SubprocessScriptLauncher",
    "apply_batch_transfer_handler",
    "call_configure_model",
    "connect_process_group",
    "data_source",
    "give_device_mesh",
    "last_checkpoints_found_by",
    "materialize_distributed_module",
    "metric_forward_cache",
    "optimizer_steps_after_this_batch",
    "optimizers_to_device",
    "set_metric_progress",
    "skip_lightning_backward",
]

# Private members of Lightning's classes that lightdist's subclasses override or use, and why.
SUBCLASS_PRIVATES = {
    "_configure_launcher": "Strategy's hook to set its launcher: the first point that knows devices and nodes, where "
    "the layout is checked before any process starts",
    "_setup_distributed": "ModelParallelStrategy's process group start, made on this start's round of the store",
    "_get_process_group_backend": "ModelParallelStrategy's default backend for the device",
    "_save_last_checkpoint": "ModelCheckpoint's save of last.ckpt, made a pointer to the newest complete checkpoint",
    "_save_checkpoint": "ModelCheckpoint's save, which the pointer's save calls",
    "_remove_checkpoint": "ModelCheckpoint's removal, which goes through the strategy after every save in flight",
    "_last_checkpoint_saved": "ModelCheckpoint's record of its last.ckpt",
    "_last_global_step_saved": "ModelCheckpoint's record of the step last saved",
    "_get_train_description": "RichProgressBar's training description, an epoch count that an endless run shows as "
    "'Epoch 0/-2'",
    "_wandb_init": "WandbLogger's arguments to wandb.init, where Lightning always puts anonymous=None, which wandb "
    "0.2x warns on every run has no effect: the key is left out",
    "_run_subcommand": "LightningCLI's run of the parsed subcommand, which the Ray launcher replaces with its workers",
}


def connect_process_group(strategy: ParallelStrategy, store: Store, timeout: timedelta) -> None:
    """Lightning's own process group start (its environment's rank and world size, its log line, NCCL's cleanup at
    exit), on ``store``: the round of the store this start of the job meets in, so a restarted rank cannot meet a
    rank of the start before."""
    device = strategy.root_device
    _init_dist_connection(
        strategy.cluster_environment,
        strategy._get_process_group_backend(),
        store=store,
        timeout=timeout,
        device_id=device if device.type != "cpu" else None,
    )


def give_device_mesh(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """``module.device_mesh`` answers ``mesh``, as Lightning's ``ModelParallelStrategy`` sets it (it has no setter)."""
    module._device_mesh = mesh


def last_checkpoints_found_by(callback: ModelCheckpoint, trainer: pl.Trainer) -> set[str]:
    """The ``last*.ckpt`` files a ``ModelCheckpoint`` without a directory of its own would resume from: Lightning's
    search, in the directory it would derive from the trainer's loggers."""
    return callback._find_last_checkpoints(trainer)


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Parameters made on the meta device (``trainer.init_module(empty_init=True)``, ``configure_model``) allocated
    on ``device`` once split, and initialized by each module's ``reset_parameters``, as Lightning does."""
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: list[Optimizer], device: torch.device) -> None:
    """Optimizer states loaded from a checkpoint onto ``device``, the ``step`` counts left where torch keeps them."""
    _optimizers_to_device(optimizers, device)


def skip_lightning_backward(trainer: pl.Trainer, skip: bool) -> None:
    """Under a pipeline the schedule runs backward inside the step: Lightning must neither zero the gradients after
    it nor call backward on the returned loss (Lightning's own ``StochasticWeightAveraging`` sets this too)."""
    trainer.fit_loop._skip_backward = skip


def optimizer_steps_after_this_batch(trainer: pl.Trainer) -> bool:
    """Whether the optimizer steps after the batch now running: the last of an accumulation, or of the epoch."""
    return not trainer.fit_loop._should_accumulate()


def data_source(loop: Any) -> Any:
    """The loop's source of data loaders: the one place that knows the loader the loop will draw from, before it
    draws (the tracer needs one batch to learn the model call before the first step)."""
    return loop._data_source


def apply_batch_transfer_handler(module: pl.LightningModule, batch: Any, device: torch.device) -> Any:
    """``batch`` moved to ``device`` through the module's own transfer hooks, as Lightning moves every batch."""
    return module._apply_batch_transfer_handler(batch, device)


def call_configure_model(trainer: pl.Trainer) -> None:
    """Lightning's call of the module's ``configure_model`` hook (within the strategy's context, once)."""
    call._call_configure_model(trainer)


def metric_forward_cache(metric: Metric) -> Any:
    """What logging ``metric`` on a step reports: the value of its last ``forward``."""
    return metric._forward_cache


def set_metric_progress(metric: Metric, update_count: int, forward_cache: Any) -> None:
    """Give ``metric`` another copy's count of updates and last ``forward`` value, its cached ``compute()`` dropped:
    the count decides whether ``compute()`` warns that nothing was updated, and torchmetrics has no setters."""
    metric._update_count, metric._computed, metric._forward_cache = update_count, None, forward_cache
