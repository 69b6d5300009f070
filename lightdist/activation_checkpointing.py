"""Activation checkpointing per decoder block.

Applied with torch's composable ``checkpoint`` so parameter names (and so checkpoints) do not change. Must run after
tensor parallelism and before FSDP, the order torchtitan uses: FSDP's hooks then see the recomputed forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightdist.torch_internals import ATTENTION_OPS, checkpoint_module

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
        context_fn = None
    elif mode == "selective":
        context_fn = partial(create_selective_checkpoint_contexts, _save_compute_heavy_outputs)
    else:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of None, 'full', 'selective'.")
    for block in blocks:
        checkpoint_module(block, context_fn=context_fn)
