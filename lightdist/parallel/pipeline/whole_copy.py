"""A whole copy of a small model kept beside its pipeline stages, which the first training step checks them against.

Cutting a model into stages assumes its forward is a loop over its blocks with the embeddings before it and the head
after it. A forward that uses, after its blocks, a tensor computed before them (an embedding added back before the
head), trains differently under a pipeline without an error: the last stage holds no embedding, and its stand-in
gives zeros. No structural check sees every such data flow, so where the whole model is small and was built on a
device, lightdist keeps a copy of it, gives it the stages' weights at the first training step (after a resume or a
pretrained load too) and runs the user's step on it beside the pipeline (``lightdist.plugins.pipeline_check``).
"""

from __future__ import annotations

import copy

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["COPIED_UP_TO_BYTES", "load_stage_weights", "whole_copy"]

# Larger models are not copied: the copy lives until the first step, and runs it on the last stage's device.
COPIED_UP_TO_BYTES = 2 << 30

# What a module's copy must not share with the module: its own tensors, submodules and hook tables.
_MODULE_STATE = (dict, list, set, tuple, nn.Module, nn.Parameter)


def whole_copy(model: nn.Module) -> nn.Module | None:
    """A copy of ``model``'s modules, weights and buffers that shares everything else it holds (a dataset, a
    tokenizer, a config); ``None`` for a model built on the meta device or over ``COPIED_UP_TO_BYTES``."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(tensor.is_meta for tensor in tensors):
        return None
    if sum(tensor.numel() * tensor.element_size() for tensor in tensors) > COPIED_UP_TO_BYTES:
        return None
    registered = {id(tensor) for tensor in tensors}
    shared = {
        id(value): value
        for module in model.modules()
        for value in vars(module).values()
        if not isinstance(value, _MODULE_STATE) and id(value) not in registered
    }
    return copy.deepcopy(model, memo=shared)


def load_stage_weights(whole: nn.Module | None, module: nn.Module, pp_group: dist.ProcessGroup, last: int) -> None:
    """Give ``whole`` (held by the pipeline's ``last`` rank) the weights and buffers every stage of ``module`` holds
    now, under the names they have in the whole model. A collective of the pipeline's ranks, and of each stage's
    tensor- and data-parallel ranks, which gather its sharded weights. Read through ``state_dict``, which gives them
    in the model's layout (a fused projection's rows are held rank by rank under tensor parallelism)."""
    held = {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
        for name, tensor in module.state_dict().items()
    }
    stages = None if whole is None else [{} for _ in range(dist.get_world_size(pp_group))]
    dist.gather_object(held, stages, group=pp_group, group_dst=last)
    if whole is not None:
        whole.load_state_dict({name: tensor for stage in stages for name, tensor in stage.items()}, strict=False)
