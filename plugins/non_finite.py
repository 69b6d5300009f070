"""What a step does when its gradients are not finite: ``ParallelStrategy(non_finite="skip" | "rollback" | "stop")``.

The check is on the global gradient norm, computed over every shard and pipeline stage, so every rank takes the same
decision without another collective; a non-finite loss always makes it non-finite too. It runs after backward and
before clipping and the optimizer, inside the optimizer's closure: raising there leaves the weights and the
optimizer's state untouched, as AMP's skipped steps do.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["NonFiniteError", "NonFinitePolicy", "NonFiniteStep", "check_finite"]

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


def _finite(gradient: Tensor) -> bool:
    local = gradient.to_local() if isinstance(gradient, DTensor) else gradient
    return bool(torch.isfinite(local).all())
