"""What context parallelism does to the model's code while a step runs: the ops it reads, and those it refuses.

A ``TorchFunctionMode`` sees every torch call of the step, the model's included. Where the step has split sequences,
it gives positions (``arange``, a table's rows, a cumulative sum of ones) as the rank's tokens', hands attention
(``F.scaled_dot_product_attention``, or written by hand: ``attention_by_hand``) the whole sequence, keeps a causal
LM's logits whole under its shift, counts the tokens of the step's means (``token_means``), and refuses what would see
the rank's share only: a reduction, shift or convolution along it. A traced pipeline stage's aten ops are read as
the calls the model made (``traced_calls``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightdist.dataflow import expanded_index
from lightdist.parallel.context.attention import SplitAttention
from lightdist.parallel.context.attention_by_hand import BY_HAND_OPS, AttentionByHand
from lightdist.parallel.context.sequence_shard import ELEMENTWISE, SequenceShard, unwrapped
from lightdist.parallel.context.token_means import TokenMeans
from lightdist.parallel.context.traced_calls import as_called, functions_of_ops

__all__ = ["TRACED_CALLS", "ContextParallelMode", "shares_into_tensor_parallel_modules"]

# Ops over a dimension: along the sequence of a rank's share, each sees that share only.
_OVER_A_DIMENSION = {
    Tensor.sum, torch.sum, Tensor.nansum, torch.nansum, Tensor.mean, torch.mean, Tensor.nanmean, torch.nanmean,
    Tensor.prod, torch.prod, Tensor.amax, torch.amax, Tensor.amin, torch.amin, Tensor.max, torch.max, Tensor.min,
    torch.min, Tensor.argmax, torch.argmax, Tensor.argmin, torch.argmin, Tensor.logsumexp, torch.logsumexp,
    Tensor.count_nonzero, torch.count_nonzero, Tensor.std, torch.std, Tensor.var, torch.var, Tensor.cumsum,
    torch.cumsum, Tensor.cumprod, torch.cumprod, Tensor.softmax, torch.softmax, F.softmax, Tensor.log_softmax,
    torch.log_softmax, F.log_softmax,
}  # fmt: skip
# Ops that move or convolve positions: along the sequence of a rank's share, each needs its neighbours' tokens.
_MIXING_POSITIONS = {F.pad, torch.roll, Tensor.roll, F.conv1d}
# What the mode reads, by the aten op a pipeline stage cut by torch's tracer calls in its place.
TRACED_CALLS = functions_of_ops(
    _OVER_A_DIMENSION | _MIXING_POSITIONS | BY_HAND_OPS | {torch.arange, F.scaled_dot_product_attention}
)


class ContextParallelMode(TorchFunctionMode):
    """Gives the split sequences' positions and attention to whatever model code runs under it."""

    def __init__(self, cp: SplitAttention, module: nn.Module) -> None:
        super().__init__()
        self.cp = cp
        self.buffers = list(module.buffers())
        self.by_hand = AttentionByHand(cp)
        self.token_means = TokenMeans(cp)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.cp.local_lengths:
            func, args, kwargs = as_called(func, args, kwargs, TRACED_CALLS)  # a traced stage's aten ops
            if func is F.scaled_dot_product_attention and args[0].size(-2) in self.cp.local_lengths:
                return self.cp.attention(*args, **kwargs)
            positions = None
            if func is torch.arange:
                positions = self._arange_positions(args, kwargs)
            elif func is Tensor.__getitem__ and self._is_table(args[0]):
                positions = self._table_rows(args[0], args[1])
            elif func is Tensor.__getitem__ and (shift := _shift_of_a_share(*args[:2], self.cp.split_shapes)):
                return self._shifted_share(args[0], shift)
            elif func in _OVER_A_DIMENSION and self._along_a_share(func, args, kwargs):
                return self._positions_counted(func, args, kwargs)
            elif func in _MIXING_POSITIONS and self._mixes_a_share(func, args, kwargs):
                raise self._mixing_refused(func, args[0])
            elif (func in BY_HAND_OPS and (out := self.by_hand(func, args, kwargs)) is not NotImplemented) or (
                func in TokenMeans.OPS
                and not torch.compiler.is_compiling()  # a step's means are outside the blocks lightdist compiles
                and (out := self.token_means(func, args, kwargs)) is not NotImplemented
            ):
                return out
            if positions is not None:
                return positions
        return func(*args, **kwargs)

    def _shifted_share(self, share: Tensor, dropped: str) -> Tensor:
        """A causal LM's logits (batch, this rank's positions, vocabulary) keep their last position under
        ``logits[..., :-1, :]``: the labels shifted alike end in -100 (``shift_kept_whole``). Token ids that are this
        rank's share already cannot be shifted: the successor of its last token is on another rank."""
        if dropped == "last" and share.dim() >= 3 and share.is_floating_point():
            return share
        raise ValueError(
            f"context_parallel_size={self.cp.size}: the step shifts a tensor that holds this rank's share of each "
            f"sequence ({tuple(share.shape)}, the {dropped} position dropped), whose neighbouring tokens are on other "
            "ranks: an op lightdist does not run on the whole sequence (a view, reshape or flatten) took the share "
            "before the shift. Shift the batch's own tensors first (batch[:, :-1], batch[:, 1:], labels[..., 1:]), "
            "then reshape."
        )

    def _along_a_share(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` reduces or scans along the sequence, not the batch, of this rank's share of sequences
        (a cumulative sum of whole sequences, a ``SequenceShard``'s, runs on the whole)."""
        tensor = args[0]
        if not isinstance(tensor, Tensor) or tensor.dim() < 2 or tuple(tensor.shape[:2]) not in self.cp.split_shapes:
            return False
        if isinstance(tensor, SequenceShard) and func in ELEMENTWISE:
            return False
        dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else None))
        dims = dim if isinstance(dim, tuple | list) else (dim,)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return False  # over every dimension, or not a dimension (torch.max(a, b), var(unbiased))
        over = {d % tensor.dim() for d in dims}
        return 1 in over and 0 not in over

    def _mixes_a_share(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` moves or convolves positions along the sequence of this rank's share: a pad or roll
        along it (RWKV's token shift), a convolution over it wider than one token (Mamba's causal convolution)."""
        tensor = args[0]
        if func is F.conv1d:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            return (tensor.size(0), tensor.size(-1)) in self.cp.split_shapes and weight.size(-1) > 1
        if tensor.dim() < 2 or tuple(tensor.shape[:2]) not in self.cp.split_shapes:
            return False
        if func is F.pad:
            pad = args[1] if len(args) > 1 else kwargs["pad"]
            if isinstance(tensor, SequenceShard) and tensor.dim() == 2 and len(pad) == 2:
                return False  # the whole sequence padded
            at = 2 * (tensor.dim() - 2)  # pad lists (before, after) per dimension from the last
            return any(pad[at : at + 2])
        if isinstance(tensor, SequenceShard):
            return False  # rolled whole
        dims = kwargs.get("dims", args[2] if len(args) > 2 else None)
        dims = dims if isinstance(dims, tuple | list) else (dims,)
        return None in dims or 1 in {d % tensor.dim() for d in dims}

    def _mixing_refused(self, func: Any, tensor: Tensor) -> ValueError:
        return ValueError(
            f"context_parallel_size={self.cp.size}: the model computes {getattr(func, '__name__', func)} along the "
            f"sequence of a tensor that holds this rank's share of each sequence ({tuple(tensor.shape)}), which "
            "needs the tokens next to the share, held by other ranks: a token shift (RWKV's) or a convolution over "
            "positions (Mamba's). Context parallelism splits attention models; train this one with "
            "context_parallel_size=1."
        )

    def _positions_counted(self, func: Any, args: tuple, kwargs: dict) -> Tensor:
        """A cumulative sum of ones along the sequence counts positions (OPT's, and ALiBi's in Falcon, from a mask of
        ones made at the local length): those of this rank's tokens, plus one. Any other op along a rank's share is
        refused, since it would see that share only."""
        tensor = args[0]
        if func in (torch.cumsum, Tensor.cumsum) and bool((tensor == 1).all()):
            out = func(*args, **kwargs)
            positions = self.cp.positions(tensor.size(1), tensor.device) + 1
            return positions.view(1, -1, *[1] * (tensor.dim() - 2)).to(out.dtype).expand_as(out).contiguous()
        raise ValueError(
            f"context_parallel_size={self.cp.size}: the step computes {getattr(func, '__name__', func)} along the "
            f"sequence of a tensor that holds this rank's share of each sequence ({tuple(tensor.shape)}), which sees "
            "that share only: a per-sequence mean or sum (a loss normalised per sequence, mean pooling), a softmax or "
            "maximum over positions, or the index of a sequence's last token. Reduce over all of the rank's tokens "
            "instead (loss.sum() / mask.sum(), which lightdist weighs by the tokens each rank holds), or train with "
            "context_parallel_size=1."
        )

    def _arange_positions(self, args: tuple, kwargs: dict) -> Tensor | None:
        """``torch.arange(start, start + local length)``: the positions of this rank's tokens, from ``start``."""
        numbers = [int(a) if isinstance(a, Tensor) else a for a in args]
        start, end, step = (0, numbers[0], 1) if len(numbers) == 1 else (*numbers[:2], *(numbers[2:] or [1]))
        if kwargs.get("step", step) != 1 or not all(isinstance(n, int) for n in (start, end)):
            return None
        if end - start not in self.cp.local_lengths:
            return None
        return (self.cp.positions(end - start, kwargs.get("device")) + start).to(kwargs.get("dtype") or torch.int64)

    def _is_table(self, tensor: Any) -> bool:
        """A buffer of the model, or a parameter whose rows follow one or more dimensions of one (a learned
        ``pos_emb`` of shape (1, positions, width)): what positions may index. A buffer is told by ``is``: an
        ``id()`` would be a guard of a compiled block on each new tensor it reads, which would compile it anew."""
        if any(tensor is buffer for buffer in self.buffers):
            return True
        return isinstance(tensor, nn.Parameter) and tensor.dim() >= 2 and tensor.size(0) == 1

    def _table_rows(self, table: Tensor, index: Any) -> Tensor | None:
        """``table[:local length]`` along one dimension, the others whole (a rotary table's ``cos[:T]``, a learned
        ``pos_emb[:, :T, :]``): this rank's tokens' rows."""
        index = expanded_index(index, table.dim())
        cut = [d for d, i in enumerate(index) if i != slice(None)]
        if len(cut) != 1 or not isinstance(index[cut[0]], slice):
            return None
        dim, rows = cut[0], index[cut[0]]
        if rows.start not in (None, 0) or rows.step not in (None, 1) or rows.stop not in self.cp.local_lengths:
            return None
        if table.size(dim) < rows.stop * self.cp.size or (dim == 0 and isinstance(table, nn.Parameter)):
            return None
        return table.index_select(dim, self.cp.positions(rows.stop, table.device))


def _shift_of_a_share(
    tensor: Tensor, index: Any, split_shapes: set[tuple[int, int]]
) -> Literal["first", "last"] | None:
    """Which end ``tensor[index]`` drops, where ``tensor`` holds this rank's share of sequences, (batch, positions,
    ...) or flattened (batch x positions, ...), and ``index`` drops one position of each, or of the flattened ones,
    as a shift by one does; ``None`` for any other index."""
    if isinstance(tensor, SequenceShard) or tensor.dim() == 0:
        return None
    index = expanded_index(index, tensor.dim())
    if tensor.dim() >= 2 and tensor.size(1) in {length for _, length in split_shapes} and index[0] == slice(None):
        dim = 1  # along each sequence
    elif tensor.size(0) in {batch * length for batch, length in split_shapes}:
        dim = 0  # along the flattened sequences
    else:
        return None
    positions, length = index[dim], tensor.size(dim)
    if not isinstance(positions, slice) or positions.step not in (None, 1):
        return None
    if any(i != slice(None) for i in index[dim + 1 :]):
        return None
    # Compared one by one: dynamo reads ``stop in (-1, length - 1)`` as False where only the symbolic length matches
    stop = positions.stop
    if positions.start in (None, 0) and stop is not None and (stop == -1 or stop == length - 1):
        return "last"
    return "first" if positions.start == 1 and (stop is None or stop == length) else None


def shares_into_tensor_parallel_modules(module: nn.Module, args: tuple) -> tuple | None:
    """A module with DTensor parameters of its own takes this rank's share of the batch's sequences: under tensor
    parallelism (a vocabulary-parallel embedding) its hooks make DTensors of its inputs, which read a tensor's data,
    not its ``__torch_function__``. An FSDP-sharded module's first op would take the share anyway."""
    if not any(isinstance(arg, SequenceShard) for arg in args):
        return None
    if not any(isinstance(parameter, DTensor) for parameter in module.parameters(recurse=False)):
        return None
    return unwrapped(args, whole=False)
