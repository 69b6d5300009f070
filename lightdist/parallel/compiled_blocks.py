"""``compile=True``: each block's forward compiled, as torchtitan compiles its model block by block.

The forward, not the module's whole call: the block's hooks (ZeRO's gathers, ``without_kv_cache_in_training``) run
before it as they are, and what the block is called with reaches the compiled code as plain tensors. Under context
parallelism a batch tensor that a model hands its blocks as it was given (Hugging Face passes ``position_ids`` to each)
stands for this rank's share of the whole sequences (``SequenceShard``), a shape its data does not have, on which
dynamo's guards, reading the data, fail ("Guard failed on the same frame it was created"); the block takes the share.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lightdist.parallel.context import unwrapped

__all__ = ["compile_block"]


def compile_block(block: nn.Module, **options: Any) -> None:
    """Compile ``block``'s forward with ``torch.compile(**options)``, taking this rank's share of any split batch
    tensor it is called with."""
    compiled = torch.compile(block.forward, **options)

    @functools.wraps(block.forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return compiled(*unwrapped(args, whole=False), **unwrapped(kwargs, whole=False))

    block.forward = forward
