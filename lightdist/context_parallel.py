"""Context parallelism: each rank of a group holds 1/N of every sequence, and attention still sees the whole sequence.

Attention's activations grow with the sequence, and tensor parallelism's sequence parallelism splits only the norms
between blocks. Here every activation of a block is split along the sequence: N ranks each hold two of its 2N chunks,
the i-th from the start and the i-th from the end, so that under the causal mask each has as much attention to compute
(torchtitan's and Megatron's load balancing).

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
- ``F.scaled_dot_product_attention`` over the local length attends over the whole sequence, by ring (torch's ring
  attention: key/value blocks passed around the group, partial results merged by their log-sum-exp) or by all-to-all
  (DeepSpeed's Ulysses: heads scattered, the sequence gathered, any attention kernel), under the causal mask, and with
  the bias per key of a mask the model built (ALiBi's) by all-to-all;
- attention written by hand (``q @ k.transpose(-2, -1)``, the mask, softmax, ``@ v``) scores the rank's queries
  against the whole sequence's keys and values, gathered (``attention_by_hand``);
- a reduction along the sequence of a rank's share (a per-sequence mean, the index of the last token), and a shift
  or convolution along it (RWKV's, Mamba's), are refused: they would see that share only.

Each rank's loss is then the mean over its own tokens; data-parallel reduction over the data-parallel and
context-parallel ranks together (FSDP shards over both, as torchtitan does) averages them into the batch's mean, and
``TokenWeights`` weighs them where padding leaves ranks different numbers of labelled tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from lightdist.attention_by_hand import BY_HAND_OPS, AttentionByHand
from lightdist.dataflow import tensors_in
from lightdist.expert_parallel import all_to_all_rows
from lightdist.loss_tokens import IGNORE_INDEX
from lightdist.structure import find_decoder_stack
from lightdist.tensor_parallel import block_attention_heads
from lightdist.torch_internals import ring_attention_backward, ring_attention_forward, subclass_dispatch_disabled
from lightdist.traced_calls import as_called

__all__ = [
    "ContextParallel",
    "ContextParallelMethod",
    "SequenceShard",
    "auto_method",
    "context_mesh",
    "context_parallel_over",
    "load_balanced_positions",
]

ContextParallelMethod = Literal["auto", "ring", "all_to_all"]
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
    try:
        heads = block_attention_heads(find_decoder_stack(module))
    except ValueError:  # no stack of blocks found
        return
    if heads is not None and (heads.heads // tp) % cp:
        raise ValueError(
            f"context_parallel_method='all_to_all' deals the heads out over the context-parallel ranks, but the "
            f"model's {heads.heads_attribute}={heads.heads} ({heads.heads // tp} per tensor-parallel rank) do not "
            f"divide by context_parallel_size={cp}. Use context_parallel_method='ring' (or 'auto')."
        )


def auto_method(heads: int, cp: int) -> Literal["ring", "all_to_all"]:
    """What ``context_parallel_method="auto"`` picks for ``heads`` query heads (per tensor-parallel rank): the
    all-to-all where they divide among the ``cp`` ranks (key/value heads that do not are repeated to them), since it
    moves each activation once where the ring passes every key and value block around; else the ring."""
    return "all_to_all" if heads % cp == 0 else "ring"


def load_balanced_positions(seq_len: int, size: int, rank: int, device: torch.device | None = None) -> Tensor:
    """The positions of a ``seq_len`` sequence that context-parallel ``rank`` of ``size`` holds: chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size``."""
    if seq_len % (2 * size):
        raise ValueError(
            f"context_parallel_size={size} splits each sequence into {2 * size} chunks (two per rank, one from each "
            f"end, so that every rank has as much causal attention to compute), but a sequence here has {seq_len} "
            f"tokens, not a multiple of {2 * size}. Make the sequence length a multiple of {2 * size} (a collator's "
            f"pad_to_multiple_of={2 * size})."
        )
    chunks = torch.arange(seq_len, device=device).view(2 * size, -1)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]])


class ContextParallel:
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
        self.group, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.method, self.module, self.pipelined = method, module, pipelined
        self.local_lengths: set[int] = set()  # of the sequences split in this step
        self.split_shapes: set[tuple[int, int]] = set()  # their (batch, local length)
        self._arrivals: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}
        self.attended = False
        self.shifted = False  # whether the step shifted a sequence that splits, which leaves ranks unequal tokens
        self.loss_counts: list[Tensor] = []  # the labelled tokens of each mean cross-entropy of the step
        self._masks_read: dict[int, tuple[Tensor, Tensor | None]] = {}  # the step's masks, and their bias per key

    def positions(self, local_len: int, device: torch.device | None = None) -> Tensor:
        """The positions in the whole sequence of this rank's ``local_len`` tokens."""
        return load_balanced_positions(local_len * self.size, self.size, self.rank, device)

    def local(self, whole: Tensor) -> Tensor:
        """This rank's tokens of ``whole`` (batch, sequence, ...)."""
        positions = load_balanced_positions(whole.size(1), self.size, self.rank, whole.device)
        self._split(whole.size(0), len(positions))
        return whole.index_select(1, positions)

    def local_shape(self, whole: Tensor) -> torch.Size:
        """The shape of ``local(whole)``, which code that sizes its positions by reads first; the whole shape where
        the sequence does not split (a window of T + 1 tokens whose first T the model takes), whose batch size is
        what code reads from it."""
        seq_len = whole.size(1)
        if seq_len % (2 * self.size):
            return whole.shape
        self._split(whole.size(0), seq_len // self.size)
        return torch.Size((whole.size(0), seq_len // self.size, *whole.shape[2:]))

    def _split(self, batch: int, local_len: int) -> None:
        self.local_lengths.add(local_len)
        self.split_shapes.add((batch, local_len))

    def shard_batch(self, batch: Any) -> Any:
        """``batch`` with each tensor of two or more dimensions standing for its whole sequences (``SequenceShard``).

        A Hugging Face collator's batch (``input_ids``, ``labels``, ``attention_mask``) is first padded on the right
        to a length that splits (unlabelled padding changes no loss), and its ``attention_mask`` dropped where
        attending causally is the same.
        """
        self.local_lengths.clear()
        self.split_shapes.clear()
        self.attended, self.shifted, self.loss_counts = False, False, []
        self._masks_read.clear()
        if isinstance(batch, Mapping) and isinstance(batch.get("labels"), Tensor):
            batch = type(batch)(self._padded_to_split(batch))
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
        return _unwrap(tree, whole=False)

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

    def arrival_order(self, local_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The whole sequence's positions as the ranks' shares arrive, one rank after another, and the order that
        sorts them."""
        key = (local_len, device)
        if key not in self._arrivals:
            shares = [load_balanced_positions(local_len * self.size, self.size, r, device) for r in range(self.size)]
            held = torch.cat(shares)
            self._arrivals[key] = (held, held.argsort())
        return self._arrivals[key]

    def loss_tokens(self) -> Tensor | None:
        """The tokens this rank's loss averaged over in the step: those its one mean cross-entropy labelled; ``None``
        where it took none or several. Weigh each rank's loss by them where ranks hold unequal numbers."""
        return self.loss_counts[0] if len(self.loss_counts) == 1 else None

    def shift_kept_whole(self, whole: Tensor, shifted: Tensor, index: tuple) -> Tensor:
        """``shifted``, ``whole[index]`` one position shorter than ``whole``, at ``whole``'s length where that splits
        (a split needs it): ``tokens[:, :-1]`` keeps its last token; ``labels[..., 1:]`` gets a last label of -100,
        which leaves out the prediction from that kept token (the step's loss must leave out -100, as PyTorch's and
        Hugging Face's do). Both are one process's pairs of a token and its successor."""
        if not isinstance(index[1], slice) or whole.size(1) % (2 * self.size) or shifted.size(1) != whole.size(1) - 1:
            return shifted
        if self.pipelined:
            raise ValueError(
                f"context_parallel_size={self.size} under a pipeline: the step shifts a sequence of {whole.size(1)} "
                f"tokens by one, which leaves the ranks' shares of it unequal, and a pipeline weighs its microbatches "
                "before their loss is computed. Feed windows of one token more than the model takes (inputs "
                "batch[:, :-1] and targets batch[:, 1:] of a length that splits), or call a Hugging Face model with "
                "labels=."
            )
        self.shifted = True
        sequence = index[1]
        if sequence.start in (None, 0):  # the last token dropped: keep it
            return whole[(index[0], slice(None), *index[2:])]
        fill = 0 if shifted.is_floating_point() or shifted.dtype == torch.bool else IGNORE_INDEX
        return torch.cat([shifted, torch.full_like(shifted[:, :1], fill)], dim=1)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Positions and attention of the split sequences, while a step or its backward (which may recompute) runs;
        a step whose model took its share of the sequence but attended by hand is refused once it returns."""
        into_tensor_parallel = register_module_forward_pre_hook(_shares_into_tensor_parallel_modules)
        try:
            with _ContextParallelMode(self):
                yield
        finally:
            into_tensor_parallel.remove()
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
                "unequal numbers of tokens, so each rank's loss is weighed by the tokens its cross-entropy labels, "
                f"but this step computed {len(self.loss_counts)} mean F.cross_entropy losses, not one. Compute one, "
                "or feed windows of one token more than the model takes (inputs batch[:, :-1] and targets "
                "batch[:, 1:] of a length that splits)."
            )

    def attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        """Causal attention of this rank's queries (batch, heads, local length, head dim) over the whole sequence."""
        if isinstance(query, DTensor):  # tensor parallelism's heads (attention that reshapes with global sizes)
            local = (t.to_local() for t in (query, key, value))
            out = self.attention(*local, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            return DTensor.from_local(out, query.device_mesh, query.placements)
        key_bias = None
        if attn_mask is not None:
            key_bias, is_causal = self.key_bias(attn_mask), True
        if not is_causal:
            raise self._not_causal("is_causal=False")
        if dropout_p:
            raise ValueError(
                f"context_parallel_size={self.size} does not split attention dropout (dropout_p={dropout_p}): each "
                "rank would drop its own part of every row. Set the model's attention dropout to 0."
            )
        self.attended = True
        heads, kv_heads = query.size(1), key.size(1)
        # Grouped-query attention: the ring, and an all-to-all whose key/value heads do not divide among the ranks, take
        # them repeated to the query heads' count; where they divide, the all-to-all deals them out as they are.
        dealt_whole = kv_heads % self.size == 0
        method = self._method(heads, kv_heads if dealt_whole else heads)
        if kv_heads != heads and (method == "ring" or not dealt_whole):
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        if method == "ring" and key_bias is not None:  # the ring's kernel adds no bias
            return self._gathered_attention(query, key, value, scale, key_bias)
        if method == "ring":
            return _RingAttention.apply(query, key, value, self.group, scale)
        return self._all_to_all_attention(query, key, value, scale, key_bias)

    def key_bias(self, mask: Tensor) -> Tensor | None:
        """What ``mask``, made for this rank's queries and keys (..., L, L), adds to each key's score over the whole
        sequence (..., 1, N x L), where it is a causal mask by this rank's positions: ``None`` where it adds nothing
        else (Falcon builds such a mask itself), a bias where it adds one per key (ALiBi's). Any other mask is
        refused. Models pass one mask to every block, so it is read once."""
        if id(mask) in self._masks_read:
            return self._masks_read[id(mask)][1]
        local_len = mask.size(-1) if mask.dim() >= 2 else None
        if local_len not in self.local_lengths or mask.size(-2) != local_len or mask.requires_grad:
            raise self._not_causal("a mask")
        positions = self.positions(local_len, mask.device)
        allowed = positions[None, :] <= positions[:, None]
        bias = None if mask.dtype == torch.bool else mask[..., -1:, :]  # the latest query this rank holds sees all
        causal = mask == allowed if bias is None else torch.where(allowed, mask == bias, mask <= -1e4)  # exp(-1e4) is 0
        if not bool(causal.all()):
            raise self._not_causal("a mask")
        whole = None if bias is None else self.bias_of_keys(bias)  # gathered on every rank, zero or not
        if whole is not None and not whole.any():
            whole = None
        self._masks_read[id(mask)] = (mask, whole)
        return whole

    def bias_of_keys(self, bias: Tensor) -> Tensor:
        """A bias per key of this rank's share (..., L), over the whole sequence: gathered from every rank, where it
        is linear in the key's position, as ALiBi's (a slope per head) is. A bias read from a table by the share's
        length, not its positions (MPT's ALiBi), is not: it is refused rather than added wrong."""
        if id(bias) in self._masks_read:
            return self._masks_read[id(bias)][1]
        if bias.requires_grad:
            raise self._not_causal("a bias with a gradient")
        whole = self.gathered(bias, -1)
        rise = whole - whole[..., :1]
        slope = rise[..., -1:] / (whole.size(-1) - 1)
        off_line = (rise - slope * torch.arange(whole.size(-1), device=whole.device)).abs().max()
        if off_line > 1e-2 * rise.abs().max() + 1e-6:
            raise ValueError(
                f"context_parallel_size={self.size}: the model adds to each key's attention score a bias that, "
                "gathered from the ranks' shares of the sequence, is not linear in the key's position, as ALiBi's is: "
                "it was made from the share's length rather than its tokens' positions (MPT reads its ALiBi table "
                "so). Build the bias from torch.arange over the sequence, or train with context_parallel_size=1."
            )
        self._masks_read[id(bias)] = (bias, whole)
        return whole

    def whole_key_mask(self, mask: Tensor) -> Tensor:
        """``mask``, made for this rank's share of keys, over the whole sequence's: a bias per key (..., 1, L) gathered;
        a causal mask by position (..., L, L) made that of this rank's queries over all keys (..., L, N x L)."""
        if mask.size(-2) == 1:
            return self.bias_of_keys(mask)
        bias = self.key_bias(mask)
        future = self.whole_future(mask.size(-1), mask.device)
        return torch.where(future, torch.finfo(mask.dtype).min, mask.new_zeros(()) if bias is None else bias)

    def whole_future(self, local_len: int, device: torch.device) -> Tensor:
        """Where this rank's queries must not look over the whole sequence (L, N x L): the keys after each."""
        positions = self.positions(local_len, device)
        return torch.arange(local_len * self.size, device=device)[None, :] > positions[:, None]

    def gathered(self, share: Tensor, dim: int) -> Tensor:
        """Every rank's ``share`` of the sequence along ``dim``, in sequence order; gradients go back to the ranks
        that hold each share."""
        dim = dim % share.dim()
        parts = share.unsqueeze(0).expand(self.size, *share.shape)
        arrived = all_to_all_rows(parts, [1] * self.size, [1] * self.size, self.group)
        return torch.cat(arrived.unbind(0), dim=dim).index_select(
            dim, self.arrival_order(share.size(dim), share.device)[1]
        )

    def _not_causal(self, given: str) -> ValueError:
        return ValueError(
            f"context_parallel_size={self.size} splits causal attention, but the model's attention takes {given}: a "
            "mask other than causal (left padding, packed documents, sliding windows), or attention without one, "
            "cannot be split by position. Pad on the right (tokenizer.padding_side = 'right') and leave the mask to "
            "is_causal=True, or train with context_parallel_size=1."
        )

    def _gathered_attention(
        self, query: Tensor, key: Tensor, value: Tensor, scale: float | None, key_bias: Tensor
    ) -> Tensor:
        """This rank's queries over the whole sequence's keys and values, gathered, with ``key_bias`` (batch, heads, 1,
        sequence) added under the causal mask: a bias the ring cannot add, for any head count (Llama 3's all-gather
        of keys and values)."""
        future = self.whole_future(query.size(2), query.device)
        mask = torch.where(future, torch.finfo(key_bias.dtype).min, key_bias).to(query.dtype)
        whole_key, whole_value = self.gathered(key, 2), self.gathered(value, 2)
        return F.scaled_dot_product_attention(query, whole_key, whole_value, attn_mask=mask, scale=scale)

    def _method(self, heads: int, kv_heads: int) -> str:
        if self.method == "all_to_all" and (heads % self.size or kv_heads % self.size):
            raise ValueError(
                f"context_parallel_method='all_to_all' deals the heads out over the context-parallel ranks, but "
                f"{heads} query and {kv_heads} key/value heads (per tensor-parallel rank) do not divide by "
                f"context_parallel_size={self.size}. Use context_parallel_method='ring' (or 'auto')."
            )
        return auto_method(heads, self.size) if self.method == "auto" else self.method

    def _all_to_all_attention(
        self, query: Tensor, key: Tensor, value: Tensor, scale: float | None, key_bias: Tensor | None = None
    ) -> Tensor:
        """Ulysses: each rank attends over the whole sequence for its 1/N of the heads, adding ``key_bias`` (batch,
        heads, 1, sequence) to each key's score under the causal mask where given."""
        local_len = query.size(2)
        held, order = self.arrival_order(local_len, query.device)

        def gather_sequence(t: Tensor) -> Tensor:  # (B, H, L, D) -> (B, H / N, N * L, D) in sequence order
            batch, heads, _, dim = t.shape
            parts = t.reshape(batch, self.size, heads // self.size, local_len, dim).transpose(0, 1)
            arrived = all_to_all_rows(parts, [1] * self.size, [1] * self.size, self.group)
            whole = arrived.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, -1, dim)
            return whole.index_select(2, order)

        gqa = key.size(1) != query.size(1)
        mask = None
        if key_bias is not None:
            heads_here = query.size(1) // self.size
            if key_bias.size(1) > 1:
                key_bias = key_bias[:, self.rank * heads_here : (self.rank + 1) * heads_here]
            length = local_len * self.size
            future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
            mask = key_bias.expand(-1, -1, length, -1).masked_fill(future, torch.finfo(key_bias.dtype).min)
        out = F.scaled_dot_product_attention(
            *(gather_sequence(t) for t in (query, key, value)),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        batch, heads_here, _, dim = out.shape
        parts = out.index_select(2, held).view(batch, heads_here, self.size, local_len, dim).permute(2, 0, 1, 3, 4)
        returned = all_to_all_rows(parts, [1] * self.size, [1] * self.size, self.group)
        return returned.transpose(0, 1).reshape(batch, heads_here * self.size, local_len, dim)


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


# Ops that keep the batch and sequence dimensions as they are: on a SequenceShard, they act on the whole sequence.
_ELEMENTWISE = {
    Tensor.to, Tensor.long, Tensor.int, Tensor.bool, Tensor.float, Tensor.type, Tensor.contiguous, Tensor.clone,
    Tensor.detach, Tensor.cpu, Tensor.cuda, Tensor.ne, Tensor.eq, Tensor.ge, Tensor.gt, Tensor.le, Tensor.lt,
    Tensor.__ne__, Tensor.__eq__, Tensor.__ge__, Tensor.__gt__, Tensor.__le__, Tensor.__lt__, Tensor.__and__,
    Tensor.__or__, Tensor.__invert__, Tensor.logical_not, Tensor.masked_fill, Tensor.masked_fill_, Tensor.__setitem__,
    Tensor.clamp, Tensor.roll, torch.roll, torch.where, torch.clone, Tensor.cumsum, torch.cumsum,
}  # fmt: skip
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
# What a tensor is, not what it holds: the same for the whole and the rank's share, read from the whole.
_METADATA = {Tensor.dim, Tensor.is_floating_point, Tensor.element_size, Tensor.is_contiguous, Tensor.get_device}


class SequenceShard(Tensor):
    """A batch tensor of whole sequences (batch, sequence, ...) that stands for this rank's share of them.

    Its data is the whole: slicing or padding it along the sequence, ``torch.roll``, and elementwise ops (casts,
    comparisons, masks, ``where``) act on the whole sequence, which makes a step's label shift (``batch[:, 1:]``)
    the whole sequence's; any other op, and its shape, see this rank's tokens, which is what the model and the loss
    take.
    """

    cp: ContextParallel
    ignore_appended = False  # a shift by one that kept the length by a last -100 (``labels[..., 1:]``)

    @staticmethod
    def __new__(cls, whole: Tensor, cp: ContextParallel) -> SequenceShard:
        shard = whole.as_subclass(cls)
        shard.cp = cp
        return shard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shards = [t for t in tensors_in((args, kwargs)) if isinstance(t, SequenceShard)]
        cp = shards[0].cp
        with subclass_dispatch_disabled():
            if func in (Tensor.size, Tensor.shape.__get__):
                shape = cp.local_shape(args[0].as_subclass(Tensor))
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                return shape if func is Tensor.shape.__get__ or dim is None else shape[dim]
            if (
                func in _METADATA
                or getattr(func, "__name__", "") == "__get__"
                or _acts_on_whole(func, args, kwargs, shards)
            ):
                out = func(*_unwrap(args, whole=True), **_unwrap(kwargs, whole=True))
                appended = False
                if func is Tensor.__getitem__:
                    index, whole = _expanded(args[1], args[0].dim()), args[0].as_subclass(Tensor)
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
            return func(*_unwrap(args, whole=False), **_unwrap(kwargs, whole=False))


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
    return func in _ELEMENTWISE and all(s.dim() == shards[0].dim() for s in shards)


def _slices_batch_and_sequence(index: Any, dims: int) -> bool:
    """Whether ``index`` takes a slice of the examples (a pipeline's microbatch) and a slice or a position of the
    sequence (``tokens[:, 0]``, each sequence's first token), leaving any other dimension whole."""
    index = _expanded(index, dims)
    batch_and_sequence = isinstance(index[0], slice) and isinstance(index[1], slice | int)
    return batch_and_sequence and all(i == slice(None) for i in index[2:])


def _expanded(index: Any, dims: int) -> tuple:
    """``index`` as a tuple of one entry per dimension: an ``Ellipsis``, and the dimensions after the last given,
    made whole slices."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (dims - len(index) + 1) + index[at + 1 :]
    return index + (slice(None),) * (dims - len(index))


def _shift_of_a_share(tensor: Tensor, index: Any, local_lengths: set[int]) -> Literal["first", "last"] | None:
    """Which end ``tensor[index]`` drops, where ``tensor`` holds this rank's share of sequences (batch, positions,
    ...) and ``index`` drops one position of each, as a shift by one does; ``None`` for any other index."""
    if isinstance(tensor, SequenceShard) or tensor.dim() < 2 or tensor.size(1) not in local_lengths:
        return None
    batch, sequence, *rest = _expanded(index, tensor.dim())
    if batch != slice(None) or not isinstance(sequence, slice) or sequence.step not in (None, 1):
        return None
    if any(i != slice(None) for i in rest):
        return None
    if sequence.start in (None, 0) and sequence.stop in (-1, tensor.size(1) - 1):
        return "last"
    return "first" if sequence.start == 1 and sequence.stop in (None, tensor.size(1)) else None


def _joins_sequences(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` concatenates tensors along the sequence, their second dimension."""
    if func not in (torch.cat, torch.concat, torch.concatenate, torch.hstack):
        return False
    tensors = list(args[0])
    dim = 1 if func is torch.hstack else kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0))
    return tensors[0].dim() >= 2 and dim % tensors[0].dim() == 1


def _shares_into_tensor_parallel_modules(module: nn.Module, args: tuple) -> tuple | None:
    """A module with DTensor parameters of its own takes this rank's share of the batch's sequences: under tensor
    parallelism (a vocabulary-parallel embedding) its hooks make DTensors of its inputs, which read a tensor's data,
    not its ``__torch_function__``. An FSDP-sharded module's first op would take the share anyway."""
    if not any(isinstance(arg, SequenceShard) for arg in args):
        return None
    if not any(isinstance(parameter, DTensor) for parameter in module.parameters(recurse=False)):
        return None
    return _unwrap(args, whole=False)


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


def _unwrap(tree: Any, whole: bool) -> Any:
    def unwrap(value: Any) -> Any:
        if not isinstance(value, SequenceShard):
            return value
        tensor = value.as_subclass(Tensor)
        return tensor if whole else value.cp.local(tensor)

    return apply_to_collection(tree, Tensor, unwrap)


_MEAN_LOSSES = (F.cross_entropy, F.nll_loss)


class _ContextParallelMode(TorchFunctionMode):
    """Gives the split sequences' positions and attention to whatever model code runs under it."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp
        self.buffers = {id(buffer) for buffer in cp.module.buffers()}
        self.by_hand = AttentionByHand(cp)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.cp.local_lengths:
            func, args, kwargs = as_called(func, args, kwargs)  # a traced pipeline stage's aten ops
            if func is F.scaled_dot_product_attention and args[0].size(-2) in self.cp.local_lengths:
                return self.cp.attention(*args, **kwargs)
            positions = None
            if func is torch.arange:
                positions = self._arange_positions(args, kwargs)
            elif func is Tensor.__getitem__ and id(args[0]) in self.buffers:
                positions = self._table_rows(args[0], args[1])
            elif func is Tensor.__getitem__ and (shift := _shift_of_a_share(*args[:2], self.cp.local_lengths)):
                return self._shifted_share(args[0], shift)
            elif func in _OVER_A_DIMENSION and self._along_a_share(func, args, kwargs):
                return self._positions_counted(func, args, kwargs)
            elif func in _MIXING_POSITIONS and self._mixes_a_share(func, args, kwargs):
                raise self._mixing_refused(func, args[0])
            elif func in BY_HAND_OPS and (out := self.by_hand(func, args, kwargs)) is not NotImplemented:
                return out
            if positions is not None:
                return positions
            if func in _MEAN_LOSSES and len(args) == 2 and kwargs.get("reduction", "mean") == "mean":
                return self._counted_loss(func, args, kwargs)
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
        if isinstance(tensor, SequenceShard) and func in _ELEMENTWISE:
            return False
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
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

    def _counted_loss(self, func: Any, args: tuple, kwargs: dict) -> Tensor:
        """A mean cross-entropy, whose labelled tokens weigh this rank's loss where ranks hold unequal numbers."""
        target = args[1]
        if not target.is_floating_point():  # class indices, not probabilities
            self.cp.loss_counts.append((target != kwargs.get("ignore_index", IGNORE_INDEX)).sum())
        return func(*args, **kwargs)

    def _arange_positions(self, args: tuple, kwargs: dict) -> Tensor | None:
        """``torch.arange(start, start + local length)``: the positions of this rank's tokens, from ``start``."""
        numbers = [int(a) if isinstance(a, Tensor) else a for a in args]
        start, end, step = (0, numbers[0], 1) if len(numbers) == 1 else (*numbers[:2], *(numbers[2:] or [1]))
        if kwargs.get("step", step) != 1 or not all(isinstance(n, int) for n in (start, end)):
            return None
        if end - start not in self.cp.local_lengths:
            return None
        return (self.cp.positions(end - start, kwargs.get("device")) + start).to(kwargs.get("dtype") or torch.int64)

    def _table_rows(self, table: Tensor, index: Any) -> Tensor | None:
        """``table[:local length]`` of a buffer with a row per position (a rotary table): this rank's tokens' rows."""
        if not isinstance(index, slice) or index.start not in (None, 0) or index.step not in (None, 1):
            return None
        if index.stop not in self.cp.local_lengths or table.size(0) < index.stop * self.cp.size:
            return None
        return table.index_select(0, self.cp.positions(index.stop, table.device))


class _RingAttention(torch.autograd.Function):
    """torch's ring attention on this rank's two chunks: key/value blocks passed around the group, each block's
    attention merged by its log-sum-exp; backward passes the key/value gradients around the same ring."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup, scale: float | None):
        out, logsumexp, kernel_state = ring_attention_forward(group, query, key, value, scale)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.group, ctx.scale, ctx.kernel_state = group, scale, kernel_state
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, key, value, out, logsumexp = ctx.saved_tensors
        grads = ring_attention_backward(ctx.group, grad, query, key, value, out, logsumexp, ctx.kernel_state, ctx.scale)
        return *grads, None, None
