"""Activation checkpointing per decoder block.

Each block's own ``forward`` is wrapped in ``torch.utils.checkpoint``, in place, so parameter names (and so
checkpoints) do not change, as they would under a wrapper module. Must run after tensor parallelism and before FSDP,
the order torchtitan uses: FSDP's hooks on the block then gather its parameters before the recomputed forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial, wraps
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightdist.torch_internals import ATTENTION_OPS

__all__ = ["ActivationCheckpointing", "apply_activation_checkpointing"]

ActivationCheckpointing = Literal["full", "selective"]

# Outputs worth keeping: matmuls and attention are where the FLOPs are; norms, activations and elementwise ops are
# cheap to recompute and hold as much memory. This is torchtitan's op-level selective checkpointing policy.
_SAVE_OUTPUTS_OF = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    *ATTENTION_OPS,
}


def _save_compute_heavy_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OUTPUTS_OF else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(blocks: Iterable[nn.Module], *, mode: ActivationCheckpointing) -> None:
    """Recompute each block's activations in backward: all of them (``"full"``) or only the cheap ones. ``blocks``:
    a decoder stack's, or a traced pipeline stage's."""
    if mode == "full":
        options = {}
    elif mode == "selective":
        options = {"context_fn": partial(create_selective_checkpoint_contexts, _save_compute_heavy_outputs)}
    else:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of None, 'full', 'selective'.")
    for block in blocks:
        block.forward = _recomputed_in_backward(block.forward, options)


def _recomputed_in_backward(forward: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    @wraps(forward)
    def recomputed_in_backward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return recomputed_in_backward
