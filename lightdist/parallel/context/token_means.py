"""The tokens a step's mean averages over, read from how the step writes it, while its sequences are split.

Under context parallelism each rank's loss is a mean over its own share of the batch's tokens. Where the ranks hold
different numbers of labelled tokens (padding, a masked prompt, a shift that keeps the length), the ranks' means
weigh alike in the gradients' mean unless each is weighed by its count (``TokenWeights``). A Hugging Face model called
with ``labels=`` is counted by its labels (``lightdist.parallel.loss_tokens``); a mean written in the step is counted by
how it is written:

- ``F.cross_entropy`` (or ``nll_loss``) with its default mean: the labels it does not ignore;
- a sum over the rank's tokens divided by a count of them: ``(loss * mask).sum() / mask.sum()``,
  ``F.cross_entropy(..., reduction="sum") / (labels != -100).sum()``: the count;
- a mean of the tokens a mask selects, ``nll[labels != -100].mean()``, or of every token's loss: their number.

A step that computes several such means is not counted (which one is the loss is not known), and its ranks weigh
alike; the check of the step against whole sequences (``context_parallel_check``) then shows whether that is exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from lightdist.parallel.context.sequence_shard import SequenceShard
from lightdist.parallel.context.sequences import SplitSequences
from lightdist.parallel.loss_tokens import IGNORE_INDEX

__all__ = ["TokenMeans"]

_LOSSES = {F.cross_entropy, F.nll_loss}
_SUMS = {Tensor.sum, torch.sum, Tensor.count_nonzero, torch.count_nonzero}
_MEANS = {Tensor.mean, torch.mean}
_DIVISIONS = {Tensor.div, torch.div, Tensor.__truediv__, Tensor.true_divide, torch.true_divide}
_CARRY_A_COUNT = {Tensor.clamp, torch.clamp, Tensor.clamp_min, torch.clamp_min, Tensor.float, Tensor.to}


class TokenMeans:
    """Counts the tokens of each mean a step computes over this rank's share of its sequences (``OPS`` are the calls
    it reads), into ``cp.loss_counts``."""

    OPS = _LOSSES | _SUMS | _MEANS | _DIVISIONS | _CARRY_A_COUNT | {Tensor.__getitem__}

    def __init__(self, cp: SplitSequences) -> None:
        self.cp = cp
        self._sums = WeakIdKeyDictionary()  # a sum over the rank's tokens -> True
        self._selected = WeakIdKeyDictionary()  # the tokens a mask selected from the rank's share -> True

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func``'s result, its count noted; ``NotImplemented`` where ``func`` is no part of a mean over tokens."""
        first = args[0] if args else None
        if func in _LOSSES and len(args) == 2 and not args[1].is_floating_point():  # class indices
            out = func(*args, **kwargs)
            reduction = kwargs.get("reduction", "mean")
            if reduction == "mean":
                self.cp.loss_counts.append((args[1] != kwargs.get("ignore_index", IGNORE_INDEX)).sum())
            elif reduction == "sum":
                self._sums[out] = True
            return out
        over_all = len(args) == 1 and "dim" not in kwargs and "axis" not in kwargs
        if func in _SUMS and over_all and self._holds_tokens(first):
            out = func(*args, **kwargs)
            self._sums[out] = True
            return out
        if func in _MEANS and over_all and self._holds_tokens(first) and first.dim() <= 2:  # not logits
            self.cp.loss_counts.append(torch.tensor(first.numel(), device=first.device))
            return func(*args, **kwargs)
        if func in _CARRY_A_COUNT and _in(first, self._sums):
            out = func(*args, **kwargs)
            self._sums[out] = True
            return out
        if func in _DIVISIONS and len(args) == 2 and _in(first, self._sums) and _in(args[1], self._sums):
            self.cp.loss_counts.append(args[1].detach())
            return func(*args, **kwargs)
        if func is Tensor.__getitem__ and _is_mask(args[1]) and self._holds_tokens(first):
            out = func(*args, **kwargs)
            self._selected[out] = True
            return out
        return NotImplemented

    def _holds_tokens(self, tensor: Any) -> bool:
        """Whether ``tensor`` holds a value per token of this rank's share: the batch's (a ``SequenceShard``), one per
        position of the split sequences (batch, positions, ...), the same flattened (batch x positions, ...), or
        those a mask selected."""
        if not isinstance(tensor, Tensor) or tensor.dim() == 0:
            return False
        if isinstance(tensor, SequenceShard) or _in(tensor, self._selected):
            return True
        shapes = self.cp.split_shapes
        return tuple(tensor.shape[:2]) in shapes or tensor.size(0) in {batch * length for batch, length in shapes}


def _is_mask(index: Any) -> bool:
    return isinstance(index, Tensor) and index.dtype == torch.bool


def _in(value: Any, tensors: WeakIdKeyDictionary) -> bool:
    return isinstance(value, Tensor) and value in tensors
