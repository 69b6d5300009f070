"""Vocabulary-parallel cross-entropy: the loss of logits split by vocabulary, without gathering them.

Gathering the logits costs ``batch * seq * vocab`` floats per rank (a 128k vocabulary makes that the largest
activation of the step). With ``loss_parallel`` the LM head keeps its output split by vocabulary and torch's
``loss_parallel`` computes the softmax from each rank's share plus two small all-reduces per token.

The user's loss code stays as it is: ``F.cross_entropy`` (or ``nn.CrossEntropyLoss``) on the logits returns a plain
tensor, as without tensor parallelism, so masking, ``self.log`` and Lightning's loop see what they always see.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode

__all__ = ["vocab_parallel_cross_entropy"]


class _PlainLoss(TorchFunctionMode):
    """``F.cross_entropy`` on vocabulary-split logits returns the loss as a local tensor (equal on every rank)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is F.cross_entropy and isinstance(result, DTensor):
            return result.to_local()
        return result


@contextmanager
def vocab_parallel_cross_entropy() -> Generator[None, None, None]:
    """Around the step that computes the loss and around its backward, which must run inside it as well."""
    with loss_parallel(), _PlainLoss():
        yield
