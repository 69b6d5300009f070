"""Lightning's progress bar for an LLM run, whose length is ``max_steps``: it counts optimizer steps toward it
(``step 120/300``) beside the loss and ``TrainingMonitor``'s tokens/s and MFU, where Lightning counts epochs (an
endless run's ``Epoch 0/-2``) and the logger's version."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RichStepProgressBar", "TQDMStepProgressBar", "adopt_progress_bar"]


class _CountsSteps:
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        if trainer.max_steps > 0:
            metrics = {"step": f"{trainer.global_step}/{trainer.max_steps}", **metrics}
        return metrics


class RichStepProgressBar(_CountsSteps, RichProgressBar):
    """Lightning's ``RichProgressBar``, counting steps; a run that ends at ``max_steps`` is described as training,
    not by an epoch count."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._describe_training(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        made_here = self.train_progress_bar_id is None  # Lightning makes the bar here on a resume mid-epoch
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if made_here:
            self._describe_training(trainer)

    def _describe_training(self, trainer: pl.Trainer) -> None:
        endless = trainer.max_epochs is None or trainer.max_epochs <= 0
        if endless and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(
                self.train_progress_bar_id, description=f"{'Training':{len(self.validation_description)}}"
            )


class TQDMStepProgressBar(_CountsSteps, TQDMProgressBar):
    """Lightning's ``TQDMProgressBar``, counting steps."""


_STEP_COUNTING = {RichProgressBar: RichStepProgressBar, TQDMProgressBar: TQDMStepProgressBar}


def adopt_progress_bar(trainer: pl.Trainer) -> None:
    """Make the Trainer's progress bar count steps, where it is Lightning's own (a user's subclass is left as it is);
    it keeps its settings and theme."""
    bar = trainer.progress_bar_callback
    if type(bar) in _STEP_COUNTING:
        bar.__class__ = _STEP_COUNTING[type(bar)]
