"""Packed documents: attention stops at each document's end, in whatever model code the step runs.

``lightdist prepare`` writes documents one after another, each ended by the tokenizer's end-of-sequence token, and a
window of that stream holds the end of one document and the start of others. With the strategy's
``document_end_token`` set, a step's token ids say where each document ends, and while the step (and its backward,
which may recompute) runs, ``DocumentMasks`` gives the model's own calls what a document run alone would see:

- ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` over the batch's sequences (nanoGPT, LitGPT, Hugging
  Face's ``sdpa`` attention, the reference models) attends within each document: each token to the tokens before it
  in its own document, SDPA's causal kernel run on each document's slice alone (``attention_per_document``);
- absolute positions (nanoGPT's ``wpe(arange(t))``, a learned table's first rows, sinusoids in a buffer) are read at
  the positions within each document, from 0 after each end token (``document_positions.py``). Rotary positions need
  nothing: within a document, attention depends on positions' differences only;
- attention it cannot reach is refused, never left causal across documents: a mask the model builds itself, or a
  step over several documents in which no attention call was seen (scores by hand, a kernel of its own).

Under a pipeline each microbatch's stages attend within its own documents (``within``); under context parallelism the
split's attention masks by them too (``lightdist.parallel.context.attention``), and a rank's share of positions is
looked up per document. The end token belongs to the document it ends, so the next document's first token is
predicted from it, as without masks; with ``mask_end_loss`` that prediction is left out of the step's cross-entropy
(Megatron's ``--eod-mask-loss``), and the targets it keeps are counted, which the loss's weight across ranks and
batches needs (``plugins/token_weights.py``). Slicing by document (``document_attention``) computes what the
block-causal mask does, without a mask in memory and at the cost of the documents' squared lengths: on CPU, where
torch 2.13's FlexAttention has no backward and its variable-length attention no kernel, it is the fastest exact path
(``bench/documents.py``); in a compiled block it is one op, and a new batch's documents compile nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointError

from lightdist.parallel.document_attention import (
    attention_per_document,
    compiled_attention_per_document,
    document_lengths,
)
from lightdist.parallel.document_positions import DocumentPositions, replicated_like
from lightdist.parallel.loss_tokens import IGNORE_INDEX
from lightdist.parallel.sharding import local_tensor

__all__ = [
    "DocumentMasks",
    "DocumentMode",
    "attention_within_documents",
    "check_end_token",
    "document_ids",
    "document_positions",
    "within_documents",
]


def document_ids(tokens: Tensor, end_token: int) -> Tensor:
    """For each position of ``tokens`` (batch, sequence), the index in its row of the document it belongs to: the
    end token closes its document, and the next token opens another."""
    ends = (tokens == end_token).long()
    return ends.cumsum(-1) - ends


def document_positions(ids: Tensor) -> Tensor:
    """Each token's position within its document (0 at each document's first token), from ``document_ids``."""
    index = torch.arange(ids.size(-1), device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def token_ids_of(batch: Any) -> Tensor | None:
    """The token ids of a step's batch: a tensor of them, a mapping's ``input_ids``, or the first integer tensor of
    a tuple (inputs before targets)."""
    if isinstance(batch, Tensor):
        return batch if batch.dim() == 2 and not batch.is_floating_point() else None
    if isinstance(batch, Mapping):
        if isinstance(batch.get("input_ids"), Tensor):
            return batch["input_ids"]
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return next((ids for item in batch if (ids := token_ids_of(item)) is not None), None)
    return None


class SequenceSplit(Protocol):
    """Context parallelism's split of the step's sequences (``lightdist.parallel.context``), which attends within
    these documents: the lengths of the ranks' shares, and the positions in the whole sequence of this rank's."""

    size: int
    local_lengths: set[int]

    def positions(self, local_len: int, device: torch.device | None = None) -> Tensor: ...


class DocumentMasks:
    """The documents of each step's batch, ended by ``end_token``, and the mode that confines attention to them;
    ``model``'s buffers are the tables of fixed positions it may read (``document_positions.py``). Without an
    ``end_token``, the documents a model found by their positions, whose ``ids`` context parallelism sets."""

    def __init__(self, end_token: int | None, mask_end_loss: bool = False, model: nn.Module | None = None) -> None:
        self.end_token, self.mask_end_loss, self.model = end_token, mask_end_loss, model
        self.tokens: Tensor | None = None  # (batch, sequence) of the step's token ids
        self.ids: Tensor | None = None  # (batch, sequence): each token's document, from ``tokens``
        # Whether an attention call was given the documents' mask since the step began: set, never read, in compiled
        # blocks (a count read there would be a guard, and each block would compile once per count)
        self.attended = False
        self.loss_counts: list[Tensor] = []  # the targets each cross-entropy of the step kept, with ``mask_end_loss``
        # Where context parallelism runs the model on a rank's share of each sequence: the share's positions.
        self.split: SequenceSplit | None = None
        # Each row's documents' lengths, by the calls' lengths, and the ids they were read from
        self._lengths: dict[int, list[list[int]]] = {}
        self._lengths_of: Tensor | None = None

    def see(self, batch: Any) -> None:
        """Take the documents of the step's ``batch`` (a step without token ids is refused)."""
        self.tokens, self.ids = self._documents_of(batch)
        self.attended, self.loss_counts = False, []

    @contextmanager
    def within(self, part: Any) -> Iterator[None]:
        """Within, attention over the documents of ``part`` of the step's batch (a pipeline's microbatch, the
        examples a check runs), which the model is called on in place of the batch; the batch's after."""
        step = self.tokens, self.ids
        self.tokens, self.ids = self._documents_of(part)
        try:
            yield
        finally:
            self.tokens, self.ids = step

    def _documents_of(self, batch: Any) -> tuple[Tensor, Tensor]:
        """The token ids of ``batch`` and each one's document."""
        tokens = token_ids_of(batch)
        if tokens is None:
            raise ValueError(
                f"document_end_token={self.end_token}: the step's batch holds no token ids (a 2-D integer tensor, a "
                "mapping's input_ids, or one in a tuple), so lightdist cannot tell where its documents end. Feed token "
                "ids, or train without document_end_token."
            )
        # A batch split by context parallelism stands for its whole sequences: theirs are the documents.
        tokens = tokens.as_subclass(Tensor)
        return tokens, document_ids(tokens, self.end_token)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The model's attention and position embeddings within the documents ``see`` took."""
        with DocumentMode(self):
            yield

    def check_attended(self) -> None:
        """Refuse a step over several documents whose attention no call gave the documents' mask."""
        if not self.attended and self.ids is not None and bool((self.ids[:, -1] > 0).any()):
            marked, without = (
                (f"document_end_token={self.end_token}", "document_end_token")
                if self.end_token is not None
                else ("position_ids that restart within a sequence", "context parallelism")
            )
            raise ValueError(
                f"{marked}: the batch packs several documents in a sequence, but the step called no "
                "torch.nn.functional.scaled_dot_product_attention over its sequences, so its attention (a kernel of "
                "its own, or scores computed by broadcasting) would cross documents. Load Hugging Face models with "
                "attn_implementation='sdpa'; in your own attention, call F.scaled_dot_product_attention(q, k, v, "
                f"is_causal=True); or train without {without}."
            )

    def check_causal(self, attn_mask: Tensor | None, is_causal: bool) -> None:
        """Refuse attention over the documents' sequences given a mask of its own (ALiBi's bias, padding) or
        ``is_causal=False``: lightdist confines only the causal mask to each document."""
        if attn_mask is not None or not is_causal:
            raise ValueError(
                f"document_end_token={self.end_token}: the model's attention passes "
                f"{'a mask of its own' if attn_mask is not None else 'is_causal=False'} over the batch's sequences, "
                "which lightdist cannot confine to each document. Call F.scaled_dot_product_attention(q, k, v, "
                "is_causal=True) with no mask (Hugging Face models build none for a batch without padding), or train "
                "without document_end_token."
            )

    def attention(self, query: Tensor, key: Tensor, value: Tensor, **options: Any) -> Tensor:
        """Causal attention within the step's documents over its sequences (batch, heads, sequence, head dim): the
        model's own calls, through the mode, and context parallelism's all-to-all over the sequences it gathers.
        ``options``: SDPA's (dropout_p, scale, enable_gqa). On each rank's own heads where tensor parallelism holds
        them as DTensors (attention that reshapes with global sizes); in a compiled block, as one op over the
        documents' ids."""
        self.attended = True
        if isinstance(query, DTensor):
            if any(placement.is_shard() and placement.dim not in (0, 1) for placement in query.placements):
                raise ValueError(
                    f"document_end_token: attention over sequences split over ranks ({query.placements}) cannot be "
                    "cut into documents. Gather the sequence before attention (sequence_parallel=False)."
                )
            out = self.attention(*(local_tensor(t) for t in (query, key, value)), **options)
            return DTensor.from_local(out, query.device_mesh, query.placements)
        dropout_p = options.pop("dropout_p", 0.0)
        if torch.compiler.is_compiling() and not dropout_p:
            return compiled_attention_per_document(query, key, value, self.ids_for(query.size(-2)), **options)
        return _attention_eagerly(self, query, key, value, dropout_p=dropout_p, **options)

    def attention_at(
        self, length: int, positions: Tensor, query: Tensor, key: Tensor, value: Tensor, **options: Any
    ) -> Tensor:
        """Causal attention within the documents of sequences of ``length`` tokens for the queries at ``positions``
        (runs of consecutive ones), over the whole sequences' keys: context parallelism's ring, a rank's chunks of
        queries over the keys gathered, at the cost of their documents' scores only."""
        self.attended = True
        if torch.compiler.is_compiling():
            return compiled_attention_per_document(query, key, value, self.ids_for(length), positions, **options)
        return attention_per_document(query, key, value, self.lengths(length), positions, **options)

    def loss_tokens(self, step_name: str) -> Tensor | None:
        """The targets the step's one cross-entropy kept once the end tokens' predictions were left out, which its
        mean is over; ``None`` without ``mask_end_loss``. A training step must compute one such mean: with none, what
        it trains on would still hold those predictions; with several, which is the loss is not known."""
        if not self.mask_end_loss:
            return None
        if len(self.loss_counts) == 1:
            return self.loss_counts[0]
        if step_name == "training_step" or self.loss_counts:
            raise ValueError(
                f"mask_document_end_loss=True leaves the end tokens' predictions out of the step's cross-entropy over "
                f"its batch's next tokens, but {step_name} computed {len(self.loss_counts)} of them, not one. Compute "
                "the loss with one F.cross_entropy (or nll_loss) whose targets are the batch's tokens shifted by one "
                "(Hugging Face models called with labels= do), or train with mask_document_end_loss=False."
            )
        return None

    def targets_kept(self, part: Any) -> Tensor:
        """The targets a loss over the next tokens of ``part`` (a pipeline's microbatch) keeps once the end tokens'
        predictions are left out, counted before the loss runs: those of every position but the last whose token is
        not an end token and, where ``part`` holds ``labels`` as long as its tokens, whose next label is not -100; for
        an ``(inputs, targets)`` pair, a target for every input, the last beyond them, where not -100. Under context
        parallelism, those of the positions this rank holds, which its cross-entropy takes."""
        tokens, _ = self._documents_of(part)
        length = tokens.size(1)
        positions = torch.arange(length, device=tokens.device)  # of the targets' inputs
        if self.split is not None:  # the rank's share of the model's sequences: the windows', or their inputs'
            split = length if length % (2 * self.split.size) == 0 else length - 1  # whichever splits
            positions = self.split.positions(split // self.split.size, tokens.device)
        pair = isinstance(part, tuple | list) and len(part) == 2 and token_ids_of(part) is part[0]
        if pair and isinstance(part[1], Tensor) and part[1].shape == tokens.shape:
            targets = part[1].index_select(1, positions)
        else:
            positions = positions[positions + 1 < length]
            labels = part.get("labels") if isinstance(part, Mapping) else None
            following = labels if isinstance(labels, Tensor) and labels.shape == tokens.shape else tokens
            targets = following.index_select(1, positions + 1)
        return ((tokens.index_select(1, positions) != self.end_token) & (targets != IGNORE_INDEX)).sum()

    def end_predictions(self, target: Tensor, ignore_index: int) -> Tensor | None:
        """Where ``target``, the class indices of a loss over the step's sequences ((batch, length) or flattened; under
        context parallelism a rank's share of them), is predicted from an end token: the target whose input is one.
        ``None`` for targets of other sequences; targets that are not the inputs' next tokens are refused, as lightdist
        cannot tell which follow an end token."""
        if self.tokens is None or target.is_floating_point() or target.dim() not in (1, 2):
            return None
        rows, length = self.tokens.shape
        over_the_rows = target.size(0) == rows if target.dim() == 2 else target.numel() % rows == 0
        if not over_the_rows:
            return None
        targets = target.reshape(rows, -1)
        positions = torch.arange(targets.size(1), device=targets.device)  # of the targets' inputs
        if self.split is not None and targets.size(1) in self.split.local_lengths:
            positions = self.split.positions(targets.size(1), targets.device)
        if int(positions.max()) >= length:
            return None
        inputs, following = self.tokens.index_select(1, positions), positions + 1 < length
        labelled = (targets != ignore_index) & following  # the last input's target may lie beyond the batch's tokens
        nexts = self.tokens.index_select(1, (positions + 1).clamp(max=length - 1))
        if not torch.equal(targets[labelled], nexts[labelled]):
            raise ValueError(
                f"mask_document_end_loss=True: the step's cross-entropy over {tuple(target.shape)} targets does not "
                "take its inputs' next tokens (labels shifted by one, or windows[:, 1:]), so lightdist cannot tell "
                "which are predicted from an end token. Pass the targets in the order of the batch's tokens, or train "
                "with mask_document_end_loss=False."
            )
        return (inputs == self.end_token).reshape(target.shape)

    def ids_for(self, length: int, rows: int | None = None) -> Tensor | None:
        """The document ids of a call over ``rows`` sequences (any, where ``None``) of ``length`` tokens: the
        batch's own, or its inputs' (the tokens but the last, whose successors are the targets); ``None`` for a call
        over other sequences."""
        # Compared one by one: dynamo reads ``length in (size, size - 1)`` with symbolic sizes as False, unguarded
        if self.ids is None or (rows is not None and rows != self.ids.size(0)):
            return None
        if length != self.ids.size(1) and length != self.ids.size(1) - 1:
            return None
        return self.ids[:, :length]

    def lengths(self, length: int) -> list[list[int]]:
        """The lengths of each row's documents in the first ``length`` tokens of the sequences, read once per batch (or
        part of one) and length (one copy from the device), for every attention call over them."""
        if self._lengths_of is not self.ids:
            self._lengths, self._lengths_of = {}, self.ids
        if length not in self._lengths:
            self._lengths[length] = document_lengths(self.ids[:, :length])
        return self._lengths[length]

    def positions_of(self, indices: Tensor) -> Tensor | None:
        """The positions within their documents of the tokens at ``indices``, where ``indices`` are the positions of
        a sequence's tokens (``arange(length)``, or under context parallelism a rank's share of them): the lookup of a
        position embedding, as (batch, length); ``None`` for any other indices."""
        if indices.dim() > 2 or indices.is_floating_point():
            return None
        length = indices.size(-1)
        whole = torch.arange(length, device=indices.device)
        if self.split is not None and length in self.split.local_lengths:
            length, whole = length * self.split.size, self.split.positions(length, indices.device)
        ids = self.ids_for(length)
        if ids is None or not bool((indices == whole).all()):
            return None
        return document_positions(ids).index_select(1, whole)


@torch.compiler.disable
def _attention_eagerly(documents: DocumentMasks, query: Tensor, key: Tensor, value: Tensor, **options: Any) -> Tensor:
    """Outside compiled code, or in a compiled block whose attention drops out, between its graphs: traced, the
    documents' lengths would compile each batch anew."""
    return attention_per_document(query, key, value, documents.lengths(query.size(-2)), **options)


def within_documents(documents: DocumentMasks | None, part: Any) -> AbstractContextManager[None]:
    """``documents.within(part)``: attention within the documents of ``part`` of the step's batch; nothing without
    documents."""
    return nullcontext() if documents is None else documents.within(part)


def check_end_token(end_token: int, data: Any) -> None:
    """Refuse an end token other than the one ``data`` (a datamodule) says ends its documents, its ``eos_token_id``:
    no window would hold it, and attention would cross every document as without masks."""
    eos = getattr(data, "eos_token_id", None)
    if isinstance(eos, int) and eos != end_token:
        raise ValueError(
            f"document_end_token={end_token}, but the documents of {type(data).__name__} end with token {eos} (its "
            f"tokenizer's end-of-sequence token): attention would cross every document. Set document_end_token={eos}."
        )


@contextmanager
def attention_within_documents(
    model: nn.Module, tokens: Tensor, end_token: int, mask_end_loss: bool = False
) -> Iterator[DocumentMasks]:
    """Run ``model`` on ``tokens`` (or its inputs ``tokens[:, :-1]``) with attention and positions confined to each
    document, and with ``mask_end_loss`` the end tokens' predictions left out of its cross-entropy, as the strategy's
    ``document_end_token`` and ``mask_document_end_loss`` do for every step: for a model used outside a Trainer."""
    documents = DocumentMasks(end_token, mask_end_loss, model)
    documents.see(tokens)
    with documents.active():
        yield documents
    documents.check_attended()


class DocumentMode(TorchFunctionMode):
    """Gives the model's attention and position lookups the documents of ``documents``; activation checkpointing
    enters it again to recompute a block, as the forward ran."""

    def __init__(self, documents: DocumentMasks) -> None:
        super().__init__()
        self.documents = documents
        self.positions = DocumentPositions(documents.positions_of, documents.model)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func in DocumentPositions.OPS and (out := self.positions(func, args, kwargs)) is not NotImplemented:
            return out
        if func in _BACKWARD:
            return self._backward(func, args, kwargs)
        if func in _LOSSES and self.documents.mask_end_loss:
            return self._loss_without_end_predictions(func, args, kwargs)
        return func(*args, **kwargs)

    def _loss_without_end_predictions(self, loss: Any, args: tuple, kwargs: dict) -> Tensor:
        """``loss`` (cross-entropy, NLL) with each target predicted from an end token ignored, as Megatron's
        ``--eod-mask-loss`` leaves it out; its mean, over the targets it keeps, is counted."""
        call = inspect.signature(loss).bind(*args, **kwargs)
        call.apply_defaults()
        target, ignore_index = call.arguments["target"], call.arguments["ignore_index"]
        target = local_tensor(target).as_subclass(Tensor)  # a rank's share of the targets, under context parallelism
        ends = self.documents.end_predictions(target, ignore_index)
        if ends is None:
            return loss(*args, **kwargs)
        options = {name: call.arguments[name] for name in ("weight", "size_average", "reduce", "reduction")}
        if options != {"weight": None, "size_average": None, "reduce": None, "reduction": "mean"}:
            raise ValueError(
                f"mask_document_end_loss=True counts the targets the step's cross-entropy averages over, but it is "
                f"called with {options}: another mean than one over its targets. Call it with its default mean "
                "(no weight, reduction='mean'), or train with mask_document_end_loss=False."
            )
        kept = target.masked_fill(ends, ignore_index)
        self.documents.loss_counts.append((kept != ignore_index).sum())
        call.arguments["target"] = replicated_like(kept, call.arguments["target"])
        return loss(*call.args, **call.kwargs)

    def _backward(self, backward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return backward(*args, **kwargs)
        except CheckpointError as error:  # torch leaves the mode while backward runs, and the model's recompute
            raise ValueError(
                f"document_end_token={self.documents.end_token}: the model recomputes its blocks in backward by its "
                "own activation checkpointing (Hugging Face's gradient_checkpointing_enable(), or "
                "torch.utils.checkpoint in its code), which runs without the documents' masks. Turn it off and let "
                "lightdist checkpoint the blocks (activation_checkpointing='full' or 'selective'), which recomputes "
                "them within the documents."
            ) from error

    def _attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        **options: Any,  # scale, enable_gqa
    ) -> Tensor:
        ids = self.documents.ids_for(query.size(-2), query.size(0)) if query.dim() == 4 else None
        if ids is None or key.size(-2) != query.size(-2):
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, **options)
        self.documents.check_causal(attn_mask, is_causal)
        return self.documents.attention(query, key, value, dropout_p=dropout_p, **options)


# The losses whose targets ``mask_end_loss`` reads.
_LOSSES = {F.cross_entropy, F.nll_loss}
# Where a step's backward starts, under which the model may recompute its blocks.
_BACKWARD = {Tensor.backward, torch.autograd.backward, torch.autograd.grad}
