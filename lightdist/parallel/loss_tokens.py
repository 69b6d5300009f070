"""How many tokens a step's loss averages over, so that a batch cut into microbatches weighs each by its tokens.

A causal LM's loss is a mean over the tokens it labels. Cut a padded batch (documents of many lengths, padding
labelled -100) into microbatches and each holds its own number of labelled tokens: the mean of the microbatches'
means is not the batch's mean. lightdist weighs each microbatch's loss by its share of the batch's tokens where it
can count them:

- a call of a Hugging Face causal LM with ``labels=``: the labels that are not -100 after its shift, the tokens its
  loss averages over (unless the call passes ``num_items_in_batch`` itself);
- a LightningModule's own ``loss_tokens(batch)``, for a loss lightdist cannot see into.

Elsewhere microbatches weigh alike, which is exact where each holds as many loss terms (fixed-length windows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["IGNORE_INDEX", "is_causal_lm", "labelled_tokens", "shares"]

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy and Hugging Face's losses leave out


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM, whose loss from ``labels=`` averages over the labelled tokens."""
    return getattr(getattr(model, "loss_function", None), "__name__", "") == "ForCausalLMLoss"


def labelled_tokens(model: nn.Module, kwargs: dict[str, Any]) -> Tensor | None:
    """The tokens ``model``'s own loss averages over when called with ``kwargs``: a Hugging Face causal LM's labels
    that are not -100 after the shift by one; ``None`` for any other call."""
    labels = kwargs.get("labels")
    if not isinstance(labels, Tensor) or not is_causal_lm(model) or "num_items_in_batch" in kwargs:
        return None
    # Padded then shifted, as the loss shifts them: a sequence split by context parallelism keeps its length.
    return (F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:] != IGNORE_INDEX).sum()


def shares(tokens: list[Tensor | int | None], device: torch.device) -> Tensor:
    """Each piece's share of a batch's loss: its share of the tokens where every piece's count is known (and not all
    are zero), else an equal share."""
    equal = torch.full((len(tokens),), 1 / len(tokens), device=device)
    if any(count is None for count in tokens):
        return equal
    counts = torch.stack([torch.as_tensor(count, device=device) for count in tokens]).float()
    total = counts.sum()
    return torch.where(total > 0, counts / total.clamp(min=1), equal)
