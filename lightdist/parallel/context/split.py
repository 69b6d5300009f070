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

from lightdist.parallel.context.mode import ContextParallelMode, shares_into_tensor_parallel_modules
from lightdist.parallel.context.sequence_shard import SequenceShard, unwrapped
from lightdist.parallel.expert_parallel import all_to_all_rows
from lightdist.parallel.loss_tokens import IGNORE_INDEX
from lightdist.parallel.tensor import model_attention_heads
from lightdist.torch_internals import ring_attention_backward, ring_attention_forward

__all__ = [
    "ContextParallel",
    "ContextParallelMethod",
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
    heads = model_attention_heads(module)
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
        self.loss_counts: list[Tensor] = []  # the tokens of each mean over tokens of the step (token_means.py)
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
        """The tokens this rank's loss averaged over in the step: those of its one mean over tokens (``token_means``);
        ``None`` where it took none or several. Weigh each rank's loss by them where ranks hold unequal numbers."""
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
        into_tensor_parallel = register_module_forward_pre_hook(shares_into_tensor_parallel_modules)
        try:
            with ContextParallelMode(self):
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
                "unequal numbers of tokens, so each rank's loss is weighed by the tokens its mean is over, "
                f"but this step computed {len(self.loss_counts)} means over tokens, not one. Compute one, "
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
