"""Context parallelism: each rank of a group holds 1/N of every sequence, and attention still sees the whole sequence.

Attention's activations grow with the sequence, and tensor parallelism's sequence parallelism splits only the norms
between blocks. Here every activation of a block is split along the sequence: N ranks each hold two of its 2N chunks,
the i-th from the start and the i-th from the end, so that under the causal mask each has as much attention to compute
(torchtitan's and Megatron's load balancing); within packed documents, finer chunks dealt out by their documents' work
(``sequences.py``).

Nothing in the user's step or model changes. While a step runs under ``ContextParallel.active``:

- the batch's tensors stand for whole sequences (``SequenceShard``): slicing or padding them along the sequence, as a
  step's own label shift does (``batch[:, 1:]``, Hugging Face's loss), acts on the whole sequence; any other use, the
  model's embedding or the loss's ``view(-1)``, sees this rank's tokens;
- a shift by one of a sequence that splits keeps its length, so that it still splits: ``labels[..., 1:]`` ends in -100
  and ``tokens[:, :-1]`` keeps its last token, whose prediction that -100 leaves out; the model's logits, split
  already, keep theirs under ``logits[..., :-1, :]``. The ranks' losses, no longer over as many tokens, are weighed by
  the tokens their cross-entropy labels (``loss_tokens``);
- positions are those of this rank's tokens: a ``torch.arange`` over the local length (nanoGPT, GPT-2, Hugging Face's
  ``cache_position``), a slice ``[:length]`` of one of the model's buffers (the rotary tables of LitGPT, torchtitan
  and the reference Llama) and a cumulative sum of ones along the sequence (OPT's, ALiBi's) give them;
- ``F.scaled_dot_product_attention`` over the local length attends over the whole sequence (``attention.py``): over
  the keys and values gathered from every rank, or by all-to-all (DeepSpeed's Ulysses), under the causal mask, and
  with the bias per key of a mask the model built (ALiBi's);
- attention written by hand (``q @ k.transpose(-2, -1)``, the mask, softmax, ``@ v``) scores the rank's queries
  against the whole sequence's keys and values, gathered (``attention_by_hand``);
- a reduction along the sequence of a rank's share (a per-sequence mean, the index of the last token), and a shift
  or convolution along it (RWKV's, Mamba's), are refused: they would see that share only.

Each rank's loss is then the mean over its own tokens; data-parallel reduction over the data-parallel and
context-parallel ranks together (FSDP shards over both, as torchtitan does) averages them into the batch's mean, and
``TokenWeights`` weighs them where padding leaves ranks different numbers of labelled tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch.nn.functional as F
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.module import register_module_forward_pre_hook

from lightdist.dataflow import tensors_in
from lightdist.parallel.context.attention import ContextParallelMethod, SplitAttention
from lightdist.parallel.context.mode import ContextParallelMode, shares_into_tensor_parallel_modules
from lightdist.parallel.context.sequence_shard import SequenceShard, unwrapped
from lightdist.parallel.documents import DocumentMasks
from lightdist.parallel.loss_tokens import IGNORE_INDEX
from lightdist.parallel.tensor import model_attention_heads

__all__ = ["ContextParallel", "context_mesh", "context_parallel_over"]

CONTEXT_MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")


def context_mesh(mesh: DeviceMesh, cp: int) -> DeviceMesh:
    """The ``("pp", "dp", "cp", "tp")`` mesh over the ranks of the ``("pp", "dp", "tp")`` ``mesh``, whose ``"dp"``
    holds the data-parallel ranks and, next to each, its ``cp`` context-parallel peers (neighbouring ranks: after
    tensor parallelism, the fastest links)."""
    pp, dp, tp = mesh.mesh.shape
    ranks = mesh.mesh.view(pp, dp // cp, cp, tp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=CONTEXT_MESH_DIM_NAMES)


def context_parallel_over(
    mesh: DeviceMesh, cp: int, method: ContextParallelMethod, module: nn.Module
) -> ContextParallel | None:
    """Context parallelism of ``module`` over ``cp`` neighbouring ranks of the ``("pp", "dp", "tp")`` ``mesh``'s
    ``"dp"``; ``None`` where ``cp`` is 1."""
    if cp == 1:
        return None
    if method == "all_to_all":
        _check_heads_deal_out(module, mesh["tp"].size(), cp)
    return ContextParallel(context_mesh(mesh, cp)["cp"], method, module, pipelined=mesh["pp"].size() > 1)


def _check_heads_deal_out(module: nn.Module, tp: int, cp: int) -> None:
    """The all-to-all's heads, checked as the run starts, before memory is allocated, where the model's blocks name
    them; where they do not, attention checks them as it runs."""
    heads = model_attention_heads(module)
    if heads is not None and (heads.heads // tp) % cp:
        raise ValueError(
            f"context_parallel_method='all_to_all' deals the heads out over the context-parallel ranks, but the "
            f"model's {heads.heads_attribute}={heads.heads} ({heads.heads // tp} per tensor-parallel rank) do not "
            f"divide by context_parallel_size={cp}. Use context_parallel_method='ring' (or 'auto')."
        )


class ContextParallel(SplitAttention):
    """Splits every sequence of ``module``'s steps over the ``mesh``'s ranks and attends over the whole of it.

    Args:
        mesh: The context-parallel ranks (``context_mesh(...)["cp"]``).
        method: ``"ring"``, ``"all_to_all"``, or ``"auto"`` (``auto_method``).
        module: The model whose buffers may hold tables indexed by position.
        pipelined: Whether ``module`` runs as pipeline stages, which count a microbatch's tokens before its loss.
    """

    def __init__(
        self, mesh: DeviceMesh, method: ContextParallelMethod, module: nn.Module, pipelined: bool = False
    ) -> None:
        super().__init__(mesh, method, pipelined)
        self.module = module
        # How the model finds documents packed by position_ids, once it has looked for them (Hugging Face's function)
        self.find_documents: Callable[[Tensor], Tensor | None] | None = None

    def new_step(self) -> None:
        super().new_step()
        if self.documents is not None and self.documents.end_token is None:  # the last step's, found by positions
            self.documents = None

    def shard_batch(self, batch: Any) -> Any:
        """``batch`` with each tensor of two or more dimensions standing for its whole sequences (``SequenceShard``).

        A Hugging Face collator's batch (``input_ids``, ``labels``, ``attention_mask``) is first padded on the right
        to a length that splits (unlabelled padding changes no loss), and its ``attention_mask`` dropped where
        attending causally is the same. Within packed documents, their sequences' chunks are dealt out by the
        documents' work (``balanced_by_documents``): those ended by ``document_end_token``, or those of restarting
        ``position_ids`` where the model looked for documents there in an earlier step (it looks as it runs, after the
        split, and not when called with a cache).
        """
        self.new_step()
        if isinstance(batch, Mapping) and isinstance(batch.get("labels"), Tensor):
            batch = type(batch)(self._padded_to_split(batch))
        ids = self.documents.ids if self.documents is not None else None
        if ids is None and self.find_documents is not None:
            positions = _position_ids(batch)
            ids = None if positions is None else self.find_documents(positions)
        if ids is not None:
            self.balance_by_documents(ids)
        self.batch_lengths.update(t.size(1) for t in tensors_in(batch) if t.dim() >= 2)
        return apply_to_collection(batch, Tensor, lambda t: SequenceShard(t, self) if t.dim() >= 2 else t)

    def _padded_to_split(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        mask = batch.get("attention_mask")
        if isinstance(mask, Tensor):
            _check_right_padded(mask, batch["labels"])
        seq_len = batch["labels"].size(-1)
        missing = -seq_len % (2 * self.size)
        fill = {"labels": IGNORE_INDEX, "attention_mask": 0}
        padded = {
            key: F.pad(value, (0, missing), value=fill.get(key, 0))
            if isinstance(value, Tensor) and value.dim() == 2 and value.size(-1) == seq_len and missing
            else value
            for key, value in batch.items()
        }
        return {**padded, "attention_mask": None} if isinstance(mask, Tensor) else padded

    def shares(self, tree: Any) -> Any:
        """``tree`` with each ``SequenceShard`` made this rank's share: a pipeline stage traced from it runs on
        shares."""
        return unwrapped(tree, whole=False)

    def whole_sequences(self, output: Any) -> Any:
        """``output`` of a step on this rank's shares (a prediction's logits) with each sequence gathered whole, in
        order, on every rank of the group."""

        def whole(tensor: Tensor) -> Tensor:
            if isinstance(tensor, SequenceShard):
                return tensor.as_subclass(Tensor)
            if tensor.dim() < 2 or tensor.size(1) not in self.local_lengths:
                return tensor
            return self.gathered(tensor, 1)

        return apply_to_collection(output, Tensor, whole)

    @contextmanager
    def _documents_by_positions(self) -> Iterator[None]:
        """Within, a Hugging Face model that looks for documents packed by ``position_ids`` (a call without a cache:
        ``DataCollatorWithFlattening``, TRL's ``padding_free``) finds them in the whole sequences, and attends within
        them here, as it would by a mask of its own in one process: it builds none over a rank's share."""
        masking = sys.modules.get("transformers.masking_utils")
        if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
            yield
            return
        find = masking.find_packed_sequence_indices

        def found_here(position_ids: Tensor) -> Tensor | None:
            if not isinstance(position_ids, SequenceShard):
                return find(position_ids)
            self.find_documents = find
            ids = find(position_ids.as_subclass(Tensor))
            if ids is not None:
                if self.documents is not None and self.documents.end_token is not None:
                    raise ValueError(
                        f"document_end_token={self.documents.end_token}: the batch's position_ids restart within its "
                        "sequences too (documents packed by DataCollatorWithFlattening), and the model looks for "
                        "documents there. Mark the documents one way: drop document_end_token, or position_ids."
                    )
                self.attend_within(DocumentMasks(end_token=None))
                self.documents.ids = ids
            return None

        masking.find_packed_sequence_indices = found_here
        try:
            yield
        finally:
            masking.find_packed_sequence_indices = find

    @contextmanager
    def active(self) -> Iterator[None]:
        """Positions and attention of the split sequences, while a step or its backward (which may recompute) runs;
        a step whose model took its share of the sequence but attended by hand is refused once it returns."""
        _hook_shares_into_tensor_parallel_modules()
        if self.documents is not None:  # their positions are the split's while it runs (a check's whole run is not)
            self.documents.split = self
        try:
            with ContextParallelMode(self, self.module), self._documents_by_positions():
                yield
        finally:
            if self.documents is not None:
                self.documents.split = None
        if (
            self.documents is not None and self.documents.end_token is None
        ):  # found by positions: the mask HF would build
            self.documents.check_attended()
        if self.local_lengths and not self.attended:
            raise ValueError(
                f"context_parallel_size={self.size}: the model took this rank's share of each sequence but computed "
                "no torch.nn.functional.scaled_dot_product_attention over it, nor scores by hand (q @ k.transpose(-2, "
                "-1), bmm, baddbmm or einsum), so its attention (scores by broadcasting, or a kernel lightdist cannot "
                "see into) would attend within each rank's share only. Load Hugging Face models with "
                "attn_implementation='sdpa'; in your own attention, call "
                "F.scaled_dot_product_attention(q, k, v, is_causal=True)."
            )
        if self.shifted and self.loss_tokens() is None:
            raise ValueError(
                f"context_parallel_size={self.size}: the step shifted a sequence by one, which leaves the ranks "
                "unequal numbers of tokens, so each rank's loss is weighed by the tokens its mean is over, "
                f"but this step computed {len(self.loss_counts)} means over tokens, not one. Compute one, "
                "or feed windows of one token more than the model takes (inputs batch[:, :-1] and targets "
                "batch[:, 1:] of a length that splits)."
            )


def _position_ids(batch: Any) -> Tensor | None:
    """The batch's ``position_ids``, where they give each token of each sequence its position; else ``None``."""
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if isinstance(positions, Tensor) and positions.dim() == 2 and not positions.is_floating_point():
        return positions
    return None


def _check_right_padded(attention_mask: Tensor, labels: Any) -> None:
    """Under a causal mask a token never sees the padding after it, so a mask that only pads on the right changes
    nothing that is labelled: the whole sequence can be attended causally, by any split."""
    kept = attention_mask.bool()
    if (kept[:, 1:] & ~kept[:, :-1]).any():
        raise ValueError(
            "Context parallelism attends causally over whole sequences, which is exact where the attention_mask only "
            "pads on the right, but this batch's mask pads on the left or masks inside a sequence. Pad on the right "
            "(tokenizer.padding_side = 'right'), or train with context_parallel_size=1."
        )
    if isinstance(labels, Tensor) and labels.shape == kept.shape and (labels[~kept] != IGNORE_INDEX).any():
        raise ValueError(
            "Context parallelism drops the attention_mask, which is exact where padding is not labelled, but this "
            f"batch labels padding tokens. Label padding {IGNORE_INDEX} (DataCollatorForLanguageModeling does), or "
            "train with context_parallel_size=1."
        )


@cache
def _hook_shares_into_tensor_parallel_modules() -> None:
    """Every module call in the process passes its inputs by ``shares_into_tensor_parallel_modules``, from a split's
    first step on; it acts on a rank's shares alone, which exist only while a split is active. Registered once, not
    per step: compiled blocks guard on the global hooks' ids, and a new id each step would compile them anew."""
    register_module_forward_pre_hook(shares_into_tensor_parallel_modules)
