"""What a step does when its gradients are not finite: ``ParallelStrategy(non_finite="skip" | "rollback" | "stop")``.

The check is on the global gradient norm, computed over every shard and pipeline stage, so every rank takes the same
decision without another collective; a non-finite loss always makes it non-finite too. It runs after backward and
before clipping and the optimizer, inside the optimizer's closure: raising there leaves the weights and the
optimizer's state untouched, as AMP's skipped steps do.

- ``"skip"`` leaves the weights and optimizer state as they were and goes on with the next batch;
- ``"rollback"`` also loads the newest complete checkpoint's weights and optimizer state (the batches since are not
  trained again);
- ``"stop"`` raises ``NonFiniteError`` naming the step and the tensors whose gradients were not finite.

Each event is a warning on rank 0 and is counted in ``train/non_finite_steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightdist.parallel.sharding import local_tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NonFiniteError", "NonFiniteGuard", "NonFinitePolicy", "NonFiniteStep", "check_finite"]

NonFinitePolicy = Literal["skip", "rollback", "stop"]


class NonFiniteStep(Exception):
    """Raised inside the optimizer's closure, so that the optimizer never steps; the strategy catches it."""


class NonFiniteError(RuntimeError):
    """A step's gradients were not finite and the run stops, as ``non_finite="stop"`` asks."""


def check_finite(norm: Tensor, loss: Any, module: nn.Module, step: int, policy: NonFinitePolicy) -> None:
    """Return if ``norm`` is finite; otherwise raise, with the step, the loss and the tensors whose gradients on this
    rank are not finite, so that the report says where it started."""
    if torch.isfinite(norm):
        return
    names = [name for name, param in module.named_parameters() if param.grad is not None and not _finite(param.grad)]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    loss_value = loss.item() if isinstance(loss, Tensor) else loss
    report = (
        f"Step {step}: the gradient norm is {norm.item()} (loss {loss_value}); on this rank {len(names)} gradients "
        f"are not finite" + (f": {shown}." if names else ".")
    )
    if policy == "stop":
        raise NonFiniteError(
            f"{report} Stopped, as non_finite='stop' asks: the checkpoints saved so far are untouched. Find the cause "
            "(the learning rate, gradient clipping, the data at this step) and resume with ckpt_path='last', or train "
            "with non_finite='skip' or 'rollback'."
        )
    raise NonFiniteStep(report)


class NonFiniteGuard:
    """Applies ``policy`` to the steps whose gradients are not finite, and counts them for the loggers."""

    def __init__(self, policy: NonFinitePolicy | None) -> None:
        self.policy = policy
        self.steps = 0

    def check(self, norm: Callable[[], Tensor], loss: Any, module: pl.LightningModule) -> None:
        """Within the optimizer's closure: raise ``NonFiniteStep`` (or ``NonFiniteError``) if the norm is not finite."""
        if self.policy is not None:
            check_finite(norm(), loss, module, module.trainer.global_step, self.policy)

    def after_skipped_step(self, event: NonFiniteStep, trainer: pl.Trainer, roll_back: Callable[[str], str]) -> None:
        """Once the optimizer did not step: roll back if asked (``roll_back`` loads a checkpoint and returns where it
        was), and say what happened, a warning on rank 0 and the count to the loggers."""
        self.steps += 1
        report = str(event)
        if self.policy == "rollback":
            checkpoint = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
            if not checkpoint:
                raise NonFiniteError(
                    f"{report} non_finite='rollback' has no checkpoint to roll back to: none was saved yet, or no "
                    "ModelCheckpoint(save_last=True) saves one. Add it, or use non_finite='skip'."
                )
            report += f" Rolled back to {roll_back(checkpoint)}."
        else:
            report += " The step was skipped."
        rank_zero_warn(report)
        for logger in trainer.loggers:
            logger.log_metrics({"train/non_finite_steps": self.steps}, step=trainer.global_step)


def _finite(gradient: Tensor) -> bool:
    return bool(torch.isfinite(local_tensor(gradient)).all())
