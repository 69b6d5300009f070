"""The batch's tensors under context parallelism: each stands for this rank's share of its whole sequences.

A step slices, shifts, pads, masks and casts its batch before the model sees it (``batch[:, 1:]``, Hugging Face's
label shift). Done on the rank's share, a shift would pair each token with a neighbour another rank holds. A
``SequenceShard`` keeps the whole sequence as its data and does such ops on it; any other op, the model's embedding or
the loss's ``view(-1)``, and its shape, see the rank's share (``SplitSequences.local``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightdist.dataflow import expanded_index, tensors_in
from lightdist.parallel.context.sequences import SplitSequences
from lightdist.parallel.loss_tokens import IGNORE_INDEX

__all__ = ["ELEMENTWISE", "SequenceShard", "unwrapped"]

# Ops that keep the batch and sequence dimensions as they are: on a SequenceShard, they act on the whole sequence.
ELEMENTWISE = {
    Tensor.to, Tensor.long, Tensor.int, Tensor.bool, Tensor.float, Tensor.type, Tensor.contiguous, Tensor.clone,
    Tensor.detach, Tensor.cpu, Tensor.cuda, Tensor.ne, Tensor.eq, Tensor.ge, Tensor.gt, Tensor.le, Tensor.lt,
    Tensor.__ne__, Tensor.__eq__, Tensor.__ge__, Tensor.__gt__, Tensor.__le__, Tensor.__lt__, Tensor.__and__,
    Tensor.__or__, Tensor.__invert__, Tensor.logical_not, Tensor.masked_fill, Tensor.masked_fill_, Tensor.__setitem__,
    Tensor.clamp, Tensor.roll, torch.roll, torch.where, torch.clone, Tensor.cumsum, torch.cumsum,
}  # fmt: skip
# What a tensor is, not what it holds: the same for the whole and the rank's share, read from the whole.
_METADATA = {Tensor.dim, Tensor.is_floating_point, Tensor.element_size, Tensor.is_contiguous, Tensor.get_device}


class SequenceShard(Tensor):
    """A batch tensor of whole sequences (batch, sequence, ...) that stands for this rank's share of them.

    Its data is the whole: slicing or padding it along the sequence, ``torch.roll``, and elementwise ops (casts,
    comparisons, masks, ``where``) act on the whole sequence, which makes a step's label shift (``batch[:, 1:]``)
    the whole sequence's; any other op, and its shape, see this rank's tokens, which is what the model and the loss
    take.
    """

    cp: SplitSequences
    ignore_appended = False  # a shift by one that kept the length by a last -100 (``labels[..., 1:]``)

    @staticmethod
    def __new__(cls, whole: Tensor, cp: SplitSequences) -> SequenceShard:
        shard = whole.as_subclass(cls)
        shard.cp = cp
        return shard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Tensor's own __torch_function__ calls what it is given with subclass dispatch off: torch's ops inside see
        # plain tensors, and what they return is left as it is.
        return Tensor.__torch_function__(_on_shards, (), (func, args, kwargs or {}))


def _on_shards(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the ``SequenceShard``s among its arguments: on their whole sequences, or on this rank's share."""
    shards = [t for t in tensors_in((args, kwargs)) if isinstance(t, SequenceShard)]
    cp = shards[0].cp
    if func in (Tensor.size, Tensor.shape.__get__):
        shape = cp.local_shape(args[0].as_subclass(Tensor))
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return shape if func is Tensor.shape.__get__ or dim is None else shape[dim]
    if func in _METADATA or getattr(func, "__name__", "") == "__get__" or _acts_on_whole(func, args, kwargs, shards):
        out = func(*unwrapped(args, whole=True), **unwrapped(kwargs, whole=True))
        appended = False
        if func is Tensor.__getitem__:
            index, whole = expanded_index(args[1], args[0].dim()), args[0].as_subclass(Tensor)
            out = cp.shift_kept_whole(whole, out, index)
            appended = isinstance(index[1], slice) and index[1].start == 1 and out.size(1) == whole.size(1)
        out = apply_to_collection(out, Tensor, lambda t: SequenceShard(t, cp) if t.dim() >= 2 else t)
        if appended:
            out.ignore_appended = True
        return out
    if _joins_sequences(func, args, kwargs):
        if (shifted := _ignore_appended_again(args[0])) is not None:
            return shifted
        raise ValueError(
            f"context_parallel_size={cp.size}: the step joins a batch's sequences to tensors of its own along "
            "the sequence (torch.cat or hstack), which this rank's share of the sequence cannot stand for. "
            "To shift labels, use labels[..., 1:] (under context parallelism it keeps the sequence's length "
            "and ends in -100), with or without a column of -100 joined after it, as torchtune does."
        )
    return func(*unwrapped(args, whole=False), **unwrapped(kwargs, whole=False))


def _acts_on_whole(func: Any, args: tuple, kwargs: dict, shards: list[SequenceShard]) -> bool:
    tensors = tensors_in((args, kwargs))
    if any(not isinstance(t, SequenceShard) and t.dim() > 0 for t in tensors):
        return False  # met with a tensor of the rank's own (the model's logits): take the rank's share
    if func is Tensor.__getitem__:
        return _slices_batch_and_sequence(args[1], args[0].dim())
    if func is F.pad:
        return args[0].dim() == 2 and len(args[1]) == 2  # pads the sequence, the last dimension
    if _joins_sequences(func, args, kwargs):
        return True  # the batch's sequences joined: a longer whole
    return func in ELEMENTWISE and all(s.dim() == shards[0].dim() for s in shards)


def _slices_batch_and_sequence(index: Any, dims: int) -> bool:
    """Whether ``index`` takes a slice of the examples (a pipeline's microbatch) and a slice or a position of the
    sequence (``tokens[:, 0]``, each sequence's first token), leaving any other dimension whole."""
    index = expanded_index(index, dims)
    batch_and_sequence = isinstance(index[0], slice) and isinstance(index[1], slice | int)
    return batch_and_sequence and all(i == slice(None) for i in index[2:])


def _joins_sequences(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` concatenates tensors along the sequence, their second dimension."""
    if func not in (torch.cat, torch.concat, torch.concatenate, torch.hstack):
        return False
    tensors = list(args[0])
    dim = 1 if func is torch.hstack else kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0))
    return tensors[0].dim() >= 2 and dim % tensors[0].dim() == 1


def _ignore_appended_again(joined: Any) -> SequenceShard | None:
    """torchtune's shift, ``hstack((labels[..., 1:], a column of -100))``: where the shift kept the sequence's
    length by a last -100 already, the joined column adds nothing, and the shifted labels are the join."""
    if len(joined) != 2 or not getattr(joined[0], "ignore_appended", False) or isinstance(joined[1], SequenceShard):
        return None
    shifted, column = joined
    batch = shifted.as_subclass(Tensor).size(0)
    if column.shape != (batch, 1) or not bool((column == IGNORE_INDEX).all()):
        return None
    return shifted


def unwrapped(tree: Any, whole: bool) -> Any:
    """``tree`` with each ``SequenceShard`` its whole sequences, or this rank's share of them."""

    def unwrap(value: Any) -> Any:
        if not isinstance(value, SequenceShard):
            return value
        tensor = value.as_subclass(Tensor)
        return tensor if whole else value.cp.local(tensor)

    return apply_to_collection(tree, Tensor, unwrap)
