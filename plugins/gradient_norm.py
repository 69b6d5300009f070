"""The norm of the whole model's gradient, the same on every rank, and gradient clipping by it.

Lightning's clipping sees this rank's gradients only, and one DTensor mesh. The norm here covers every pipeline stage
and every tensor- and data-parallel shard, a weight tied across the pipeline's ends counted once and experts held
apart on each rank that holds them: what the non-finite check, the monitor and ``gradient_clip_val`` all read.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightdist.parallel.listed_experts import experts_held_apart
from lightdist.parallel.pipeline.structural import clip_grads, grad_norm_across_stages
from lightdist.plugins.pipeline_step import PipelineStep

__all__ = ["GradientNorm"]


class GradientNorm:
    """The gradient norm of ``module``'s parameters in an optimizer, split over ``mesh`` and run by ``pipeline_step``
    where there is a pipeline."""

    def __init__(self, module: LightningModule, mesh: DeviceMesh, pipeline_step: PipelineStep | None) -> None:
        self.module, self.pp_group, self.pipeline_step = module, mesh["pp"].get_group(), pipeline_step

    def __call__(self, optimizer: Optimizer) -> Tensor:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        elsewhere = self.pipeline_step.counted_elsewhere() if self.pipeline_step is not None else set()
        apart = experts_held_apart(self.module)
        return grad_norm_across_stages(parameters, self.pp_group, counted_elsewhere=elsewhere, held_apart=apart)

    def clip(self, optimizer: Optimizer, clip_val: float) -> None:
        """Scale the gradients so that their whole norm is at most ``clip_val`` (Lightning's ``clip_grad_by_norm``)."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grads(parameters, clip_val, self(optimizer))
