"""Causal attention within each packed document: SDPA's causal kernel on each document's slice alone.

Slicing computes what the block-causal mask does (to rounding), without a mask in memory and at the cost of the
documents' squared lengths, not the window's. The slices' lengths are the batch's own, so a block ``torch.compile``
traced through them would compile anew for every batch; in compiled blocks the slicing runs as one opaque op instead
(``lightdist::attention_within_documents``), given the documents' ids, whose backward runs each slice's forward again
and differentiates it. Nothing in the graph depends on the lengths, and the block compiles once. Attention that drops
out would draw other masks in that rerun: the documents' mode runs it eagerly between the block's graphs instead.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "attention_per_document",
    "compiled_attention_per_document",
    "document_lengths",
]


def document_lengths(ids: Tensor) -> list[list[int]]:
    """The lengths of each row's documents, in order, from each token's document id (batch, sequence)."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in ids]


def attention_per_document(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    lengths: list[list[int]],
    positions: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Causal attention within each document of each sequence, SDPA's causal kernel run on each document's slice of the
    queries, keys and values (batch, heads, sequence, head dim) alone: the block-causal mask's result, without it, at
    a cost of the sum of the documents' squared lengths rather than the sequence's, and no mask in memory.
    ``lengths``: each sequence's documents' lengths, in order. The queries may be those of ``positions`` (context
    parallelism's chunks; the first ``query.size(2)`` where ``None``), each run of consecutive ones over the keys
    before its last: a document begun before a run attends its queries there over its keys from its beginning, under
    the causal mask aligned to the last."""
    options = dict(dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
    runs = [(0, query.size(2))] if positions is None else _runs(positions.tolist())
    rows = []
    for counts, queries, keys, values in zip(lengths, *(t.split(1) for t in (query, key, value)), strict=True):
        spans = [span for start, stop in runs for span in _spans(counts, start, stop)]
        # The keys split once where spans begin and end, not sliced span by span: each slice's backward would fill a
        # gradient of the whole sequence; a span over several pieces (a document over runs) joins them.
        cuts = sorted({0, keys.size(2), *(begins for begins, _, _ in spans), *(last for *_, last in spans)})
        piece = {cut: index for index, cut in enumerate(cuts)}
        sizes = [end - begin for begin, end in itertools.pairwise(cuts)]
        key_pieces, value_pieces = keys.split(sizes, dim=2), values.split(sizes, dim=2)
        outs = []
        split_queries = queries.split([last - first for _, first, last in spans], dim=2)
        for (begins, first, last), q in zip(spans, split_queries, strict=True):
            k, v = (_joined(pieces[piece[begins] : piece[last]]) for pieces in (key_pieces, value_pieces))
            causal = dict(is_causal=True)
            if first > begins:  # a document begun before the queries: the causal mask aligned to the last key
                kept = torch.ones(last - first, last - begins, dtype=torch.bool, device=query.device)
                causal = dict(attn_mask=kept.tril(first - begins))
            outs.append(F.scaled_dot_product_attention(q, k, v, **causal, **options))
        rows.append(torch.cat(outs, 2))
    return torch.cat(rows)


def _joined(pieces: tuple[Tensor, ...]) -> Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 2)


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Where each run of consecutive ``positions`` starts and stops (exclusive)."""
    runs = [[positions[0], positions[0]]]
    for position in positions:
        if position != runs[-1][1]:
            runs.append([position, position])
        runs[-1][1] = position + 1
    return [(start, stop) for start, stop in runs]


def _spans(counts: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Where each document with queries in positions ``start`` to ``stop`` begins, and its first and last query
    there (exclusive)."""
    spans, begins = [], 0
    for count in counts:
        first, last = max(begins, start), min(begins + count, stop)
        if first < last:
            spans.append((begins, first, last))
        begins += count
    return spans


def compiled_attention_per_document(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    ids: Tensor,
    positions: Tensor | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``attention_per_document`` as a compiled block calls it: one op over the documents' ``ids`` (batch, the
    keys' positions), without dropout, which its backward, running the forward again, would not draw alike. The
    queries may be those of ``positions`` (a rank's chunks under context parallelism's ring), a tensor the graph takes
    as an input, so that a batch whose chunks differ compiles nothing anew."""
    return torch.ops.lightdist.attention_within_documents(query, key, value, ids, positions, scale, enable_gqa)


@torch.library.custom_op("lightdist::attention_within_documents", mutates_args=())
def _attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    ids: Tensor,
    positions: Tensor | None,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    lengths = document_lengths(ids)
    return attention_per_document(
        query, key, value, lengths, positions, scale=scale, enable_gqa=enable_gqa
    ).contiguous()


@_attention_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, *options: object) -> Tensor:  # ids, positions, scale, enable_gqa
    return query.new_empty((*query.shape[:-1], value.size(-1)))


@torch.library.custom_op("lightdist::attention_within_documents_backward", mutates_args=())
def _attention_backward_op(
    grad: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    ids: Tensor,
    positions: Tensor | None,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    lengths = document_lengths(ids)
    _, pullback = torch.func.vjp(
        lambda *qkv: attention_per_document(*qkv, lengths, positions, scale=scale, enable_gqa=enable_gqa),
        query,
        key,
        value,
    )
    return tuple(gradient.contiguous() for gradient in pullback(grad))


@_attention_backward_op.register_fake
def _(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, *options: object) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(tensor.new_empty(tensor.shape) for tensor in (query, key, value))


def _keep_inputs(ctx, inputs: tuple, output: Tensor) -> None:
    query, key, value, ids, positions, ctx.scale, ctx.enable_gqa = inputs
    ctx.save_for_backward(query, key, value, ids, positions)


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
    gradients = _attention_backward_op(grad, *ctx.saved_tensors, ctx.scale, ctx.enable_gqa)
    return (*gradients, None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_keep_inputs)
