"""Attention written by hand, under context parallelism: each rank's queries scored against the whole sequence's keys.

Eager attention computes ``softmax(q @ k.T * scale + mask) @ v`` in plain ops (BLOOM's and Hugging Face's
``"eager"``, nanoGPT's slow path). With each rank holding its share of the sequence, ``q @ k.T`` would score the
rank's queries against its own keys only. While a step runs, its ops are recognised by their shapes and each made
the whole sequence's:

- ``q @ k.T`` (``matmul``, ``bmm``, ``baddbmm``, ``einsum``) takes the keys of every rank, gathered in sequence
  order: the scores are (..., local length, whole length);
- a causal mask the model made for its share, added or filled into those scores, becomes the causal mask of the
  rank's queries over the whole sequence; a bias per key (ALiBi's), gathered from every rank, is added over all keys;
- ``probs @ v`` (``matmul``, ``bmm``, ``einsum``) takes the values of every rank.

The gathers send their gradients back to the ranks that hold the keys and values. Each rank holds scores of its
queries over the whole sequence: 1/N of one process's. Attention that tensor parallelism runs on DTensor heads (code
that reshapes with global sizes) takes each step on the rank's heads, whole along the sequence, and splits the result
by head again.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightdist.dataflow import tensors_in
from lightdist.parallel.context.attention import SplitAttention

__all__ = ["BY_HAND_OPS", "AttentionByHand"]

_PRODUCTS = {torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm}
_BIASED_PRODUCTS = {torch.baddbmm, Tensor.baddbmm}
_ADDITIONS = {torch.add, Tensor.add, Tensor.add_, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__}
_FILLS = {torch.masked_fill, Tensor.masked_fill, Tensor.masked_fill_}
_VIEWS = {Tensor.view, Tensor.reshape, torch.reshape}
BY_HAND_OPS = _PRODUCTS | _BIASED_PRODUCTS | _ADDITIONS | _FILLS | _VIEWS | {torch.einsum}


class AttentionByHand:
    """The steps of attention written by hand, over the whole sequence, for the rank's queries."""

    def __init__(self, cp: SplitAttention) -> None:
        self.cp = cp

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` made the whole sequence's where it is a step of attention on this rank's share; else
        ``NotImplemented``."""
        if func not in _VIEWS and any(isinstance(t, DTensor) for t in tensors_in((args, kwargs))):
            return self._on_local_heads(func, args, kwargs)
        if func in _PRODUCTS and len(args) == 2:
            queries, keys = args
            if self._scores(queries, keys):
                self.cp.attended = True
                return func(queries, self.cp.gathered(keys, -1))
            if self._weighted_values(queries, keys):
                return func(queries, self.cp.gathered(keys, -2))
        if func in _BIASED_PRODUCTS:
            return self._biased_scores(func, args, kwargs)
        if func is torch.einsum:
            operands = args[1] if len(args) == 2 and isinstance(args[1], tuple | list) else args[1:]
            return self._einsum(args[0], *operands) if len(operands) == 2 else NotImplemented
        if func in _ADDITIONS and len(args) == 2 and all(isinstance(a, Tensor) for a in args):
            scores_first = self._whole_scores(args[0])
            scores, mask = args if scores_first else args[::-1]
            if not self._whole_scores(scores) or not self._share_mask(mask, scores):
                return NotImplemented
            whole = self.cp.whole_key_mask(mask)
            return func(scores, whole, **kwargs) if scores_first else func(whole, scores, **kwargs)
        if func in _VIEWS and self._whole_scores(args[0]):
            self._check_view(args[0], args[1:])
            return NotImplemented
        if func in _FILLS and len(args) >= 2 and self._whole_scores(args[0]) and self._share_mask(args[1], args[0]):
            self.cp.key_bias(~args[1])  # the keys it leaves are those at and before each query: causal, or refused
            return func(args[0], self.cp.whole_future(args[1].size(-1), args[1].device), *args[2:], **kwargs)
        return NotImplemented

    def _on_local_heads(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A step on tensor parallelism's DTensor heads, taken on this rank's heads and split by head again as its
        first split operand is: neither the positions nor the head dim (the last two dimensions) may be split."""
        dtensors = [t for t in tensors_in((args, kwargs)) if isinstance(t, DTensor)]
        placements = [(t.dim(), p) for t in dtensors for p in t.placements]
        if any(p.is_partial() or (p.is_shard() and p.dim % dims >= dims - 2) for dims, p in placements):
            return NotImplemented
        layout = next((t for t in dtensors if not all(p.is_replicate() for p in t.placements)), dtensors[0])
        out = self(func, *apply_to_collection((args, kwargs), DTensor, DTensor.to_local))
        if out is NotImplemented:
            return out
        return DTensor.from_local(out, layout.device_mesh, layout.placements, run_check=False)

    def _biased_scores(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``bias.baddbmm(q, k.T)``: BLOOM's ALiBi, a bias per key, added to the scores, or a causal mask of the
        share's, made the whole sequence's."""
        named = ("input", "batch1", "batch2")
        given = dict(zip(named, args, strict=False)) | {k: kwargs[k] for k in named if k in kwargs}
        bias, queries, keys = (given.get(name) for name in named)
        if not isinstance(queries, Tensor) or not isinstance(keys, Tensor) or not self._scores(queries, keys):
            return NotImplemented
        self.cp.attended = True
        rest = {k: v for k, v in kwargs.items() if k not in named}
        if rest.get("beta", 1) == 0:  # the input is left out (Megatron's buffer): only its shape would be the share's
            bias = bias.new_zeros(())
        elif bias.dim() >= 1 and bias.size(-1) == queries.size(-2):
            bias = self.cp.whole_key_mask(bias)
        return func(bias, queries, self.cp.gathered(keys, -1), **rest)

    def _einsum(self, equation: str, first: Tensor, second: Tensor) -> Any:
        """Scores (``"bhid,bhjd->bhij"``: a position of each operand kept, a head dim contracted) or weighted values
        (``"bhij,bhjd->bhid"``: the values' positions contracted against the scores' whole sequence) by ``einsum``,
        the second operand's positions gathered from every rank."""
        spec = equation.replace(" ", "")
        if "..." in spec or "->" not in spec or spec.count(",") != 1:
            return NotImplemented
        (ours, theirs), out = spec.split("->")[0].split(","), spec.split("->")[1]
        if len(ours) != first.dim() or len(theirs) != second.dim():
            return NotImplemented
        size, their_size = dict(zip(ours, first.shape, strict=True)), dict(zip(theirs, second.shape, strict=True))
        for position in theirs:
            length = their_size[position]
            if length not in self.cp.local_lengths:
                continue
            queries = [i for i in ours if i not in theirs and i in out and size[i] == length]
            head_dims = [d for d in ours if d in theirs and d not in out and size[d] > 1]
            scores = position not in ours and position in out and queries and head_dims
            weighted = position in ours and position not in out and size[position] == length * self.cp.size
            if scores:
                self.cp.attended = True
            if scores or weighted:
                return torch.einsum(equation, first, self.cp.gathered(second, theirs.index(position)))
        return NotImplemented

    def _check_view(self, scores: Tensor, shape: tuple) -> None:
        """Scores over the whole sequence viewed as scores over the share's keys (Falcon's eager attention views them
        with the keys' length) are refused by name, where the view would fail by size."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple | list | torch.Size) else shape
        local_len = scores.size(-2)
        if shape and shape[-1] == local_len and not _fits(scores.numel(), shape):
            raise ValueError(
                f"context_parallel_size={self.cp.size}: the model's attention, written by hand, scores each query "
                f"against the whole sequence's {scores.size(-1)} keys, then views the scores with {local_len} keys, "
                "the length of the rank's share, which it read from the keys' shape. Load Hugging Face models with "
                "attn_implementation='sdpa'; in your own attention, call F.scaled_dot_product_attention(q, k, v, "
                "is_causal=True) or view the scores with -1 keys."
            )

    def _scores(self, queries: Tensor, keys: Tensor) -> bool:
        """Whether ``queries @ keys`` scores this rank's queries (..., L, head dim) against its keys (..., head dim,
        L): not a product of positions (a rotary table's outer product has a head dim of 1)."""
        if queries.dim() < 3 or keys.dim() < 3:
            return False
        length = queries.size(-2)
        return length in self.cp.local_lengths and keys.size(-1) == length and keys.size(-2) == queries.size(-1) > 1

    def _weighted_values(self, probs: Tensor, values: Tensor) -> bool:
        """Whether ``probs @ values`` weighs the values of this rank's share (..., L, head dim) by probabilities of
        its queries over the whole sequence (..., L, N x L)."""
        if values.dim() < 3 or probs.dim() < 3:
            return False
        length = values.size(-2)
        return length in self.cp.local_lengths and probs.shape[-2:] == (length, length * self.cp.size)

    def _whole_scores(self, tensor: Tensor) -> bool:
        if not isinstance(tensor, Tensor) or tensor.dim() < 2:
            return False
        length = tensor.size(-2)
        return length in self.cp.local_lengths and tensor.size(-1) == length * self.cp.size

    def _share_mask(self, mask: Tensor, scores: Tensor) -> bool:
        """Whether ``mask`` was made for this rank's keys (..., L or 1, L), where ``scores`` cover the whole
        sequence's: added to them, it would not broadcast."""
        return isinstance(mask, Tensor) and mask.dim() >= 2 and mask.size(-1) == scores.size(-2)


def _fits(numel: int, shape: tuple) -> bool:
    """Whether ``numel`` elements can be viewed as ``shape``, which may hold one -1."""
    known = torch.Size([d for d in shape if d != -1]).numel()
    return known > 0 and numel % known == 0 if -1 in shape else numel == known
