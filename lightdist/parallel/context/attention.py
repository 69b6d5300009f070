"""Attention under context parallelism: this rank's queries attend over the whole sequence, causally.

Two ways, as ``context_parallel_method`` picks:

- ``"ring"``: the keys and values of every rank gathered (torch's ring attention in its default all-gather rotation,
  Llama 3's context parallelism); each of the rank's chunks of queries attends to the keys up to its own end, so a
  rank computes only the causal half its chunks need, and a bias per key (ALiBi's) is added as it goes. Any head
  count; grouped-query keys and values travel unrepeated, in one all-to-all. Backward gathers them again and
  recomputes the attention (torch's SDPA returns no log-sum-exp to merge blocks by, nor saves one): a rank keeps its own
  keys and values only.
- ``"all_to_all"``: DeepSpeed's Ulysses: heads scattered, the sequence gathered, any attention kernel; the query and
  key/value heads must divide by the ranks.

Both go through ``F.scaled_dot_product_attention`` and torch's collectives, so gradients flow back to the ranks that
hold each token by autograd. A mask the model built is read first: a causal mask by position is the causal mask, a
bias per key is gathered, and any other mask is refused. With packed documents (``lightdist.parallel.documents``),
attention stays within each: the all-to-all attends over the whole sequences it gathers within their documents, as one
process does, and the ring attends each document's queries in the rank's chunks (which the documents' work dealt
out, ``sequences.py``) over that document's keys alone (in a compiled block, one op over the keys' document ids and
the queries' positions). A mask of the model's own over packed documents is refused, as one process refuses it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightdist.parallel.context.sequences import SplitSequences
from lightdist.parallel.document_attention import attention_per_document, compiled_attention_per_document
from lightdist.parallel.documents import DocumentMasks
from lightdist.parallel.expert_parallel import all_to_all_rows

__all__ = ["ContextParallelMethod", "SplitAttention", "auto_method"]

ContextParallelMethod = Literal["auto", "ring", "all_to_all"]


def auto_method(heads: int, cp: int) -> Literal["ring", "all_to_all"]:
    """What ``context_parallel_method="auto"`` picks for ``heads`` query heads (per tensor-parallel rank): the
    all-to-all where they divide among the ``cp`` ranks (key/value heads that do not are repeated to them), since it
    moves each activation once where the ring gathers every rank's keys and values twice (forward, and again for
    backward); else the ring."""
    return "all_to_all" if heads % cp == 0 else "ring"


class SplitAttention(SplitSequences):
    """The split of every sequence of a step, and attention over the whole of each.

    Args:
        mesh: The context-parallel ranks (``context_mesh(...)["cp"]``).
        method: ``"ring"``, ``"all_to_all"``, or ``"auto"`` (``auto_method``).
        pipelined: Whether the model runs as pipeline stages.
    """

    def __init__(self, mesh: DeviceMesh, method: ContextParallelMethod, pipelined: bool = False) -> None:
        super().__init__(mesh, pipelined)
        self.method = method
        self.attended = False
        self._masks_read: dict[int, tuple[Tensor, Tensor | None]] = {}  # the step's masks, and their bias per key
        self.documents: DocumentMasks | None = None

    def attend_within(self, documents: DocumentMasks) -> None:
        """Attend within each of the packed ``documents`` of the step's sequences, whose positions the split sets
        while it runs."""
        self.documents = documents

    def new_step(self) -> None:
        super().new_step()
        self.attended = False
        self._masks_read.clear()

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
        if self.documents is not None and self.documents.ids_for(query.size(2) * self.size) is not None:
            self.documents.check_causal(attn_mask, is_causal)  # as one process refuses them
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
        # Grouped-query attention: an all-to-all whose key/value heads do not divide among the ranks takes them
        # repeated to the query heads' count; where they divide, it deals them out as they are.
        dealt_whole = kv_heads % self.size == 0
        method = self._method(heads, kv_heads if dealt_whole else heads)
        if method == "ring":
            return self._gathered_attention(query, key, value, scale, key_bias)
        if kv_heads != heads and not dealt_whole:
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
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

    def _not_causal(self, given: str) -> ValueError:
        return ValueError(
            f"context_parallel_size={self.size} splits causal attention, but the model's attention takes {given}: a "
            "mask other than causal (left padding, packed documents, sliding windows), or attention without one, "
            "cannot be split by position. Pad on the right (tokenizer.padding_side = 'right') and leave the mask to "
            "is_causal=True (packed documents: with document_end_token, which masks them itself), or train with "
            "context_parallel_size=1."
        )

    def _gathered_attention(
        self, query: Tensor, key: Tensor, value: Tensor, scale: float | None, key_bias: Tensor | None
    ) -> Tensor:
        """This rank's queries over the whole sequence's keys and values, gathered, with ``key_bias`` (batch, heads, 1,
        sequence) added where given. Backward gathers the keys and values again and recomputes the attention, as
        torch's ring gathers them again, rather than keep every rank's keys and values for it (N times a rank's)."""
        return _GatheredAttention.apply(self, query, key, value, scale, key_bias)

    def _over_gathered(
        self, query: Tensor, key: Tensor, value: Tensor, scale: float | None, key_bias: Tensor | None
    ) -> Tensor:
        """Each of the rank's two chunks of queries over the keys up to its own end, under the causal mask: the half
        of the scores causal attention needs, for every rank alike. Within packed documents, the rank's chunks (as
        the documents dealt them) each document's queries over its own keys alone (in a compiled block, one op over
        their ids and the queries' positions). Slices by ``narrow``, which the mode does not read as a shift of a
        share."""
        whole_key, whole_value = self._gathered_keys_and_values(key, value)
        local_len, gqa = query.size(2), key.size(1) != query.size(1)
        length = local_len * self.size
        if self.documents is not None and self.documents.ids_for(length) is not None:  # no key bias (attention)
            positions = self.positions(local_len, query.device)
            return self.documents.attention_at(
                length, positions, query, whole_key, whole_value, scale=scale, enable_gqa=gqa
            )
        if length in self._balanced:  # dealt by documents the model attends across (called with a cache this time)
            return self._over_dealt_chunks(query, whole_key, whole_value, scale, key_bias)
        chunk = local_len // 2
        outs = []
        for half, index in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            end = (index + 1) * chunk
            queries = query.narrow(2, half * chunk, chunk)
            keys, values = whole_key.narrow(2, 0, end), whole_value.narrow(2, 0, end)
            mask = torch.ones(chunk, end, dtype=torch.bool, device=query.device).tril(end - chunk)
            if key_bias is not None:
                mask = torch.where(mask, key_bias.narrow(-1, 0, end), torch.finfo(key_bias.dtype).min).to(query.dtype)
            outs.append(
                F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
            )
        return torch.cat(outs, dim=2)

    def _gathered_keys_and_values(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's keys and values, in one all-to-all; each whole and contiguous, which attention kernels run
        faster on, where they have one shape."""
        if key.shape == value.shape:
            return self.gathered(torch.stack((key, value)), 3).unbind(0)
        whole = self.gathered(torch.cat((key, value), dim=-1), 2)  # heads of another size for values (MLA)
        return whole.split((key.size(-1), value.size(-1)), dim=-1)

    def _over_dealt_chunks(
        self, query: Tensor, key: Tensor, value: Tensor, scale: float | None, key_bias: Tensor | None
    ) -> Tensor:
        """The rank's queries, at chunks a step's documents dealt, over the whole sequence's ``key`` and ``value``
        under the causal mask, as of one document a sequence; with a ``key_bias``, under a mask of every key."""
        positions, length, gqa = self.positions(query.size(2), query.device), key.size(2), key.size(1) != query.size(1)
        if key_bias is not None:
            allowed = torch.arange(length, device=query.device)[None, :] <= positions[:, None]
            mask = torch.where(allowed, key_bias, torch.finfo(key_bias.dtype).min).to(query.dtype)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)
        if torch.compiler.is_compiling():
            one_document = torch.zeros(query.size(0), length, dtype=torch.long, device=query.device)
            return compiled_attention_per_document(query, key, value, one_document, positions, scale, gqa)
        lengths = [[length]] * query.size(0)
        return attention_per_document(query, key, value, lengths, positions, scale=scale, enable_gqa=gqa)

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
        whole = [gather_sequence(t) for t in (query, key, value)]
        if self.documents is not None and mask is None:
            out = self.documents.attention(*whole, scale=scale, enable_gqa=gqa)
        else:
            causal = mask is None
            out = F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        batch, heads_here, _, dim = out.shape
        parts = out.index_select(2, held).view(batch, heads_here, self.size, local_len, dim).permute(2, 0, 1, 3, 4)
        returned = all_to_all_rows(parts, [1] * self.size, [1] * self.size, self.group)
        return returned.transpose(0, 1).reshape(batch, heads_here * self.size, local_len, dim)


class _GatheredAttention(torch.autograd.Function):
    """``SplitAttention._over_gathered`` keeping this rank's own queries, keys and values for backward, which gathers
    the keys and values again, recomputes the attention and returns their gradients to the ranks that hold them.

    Its collectives are fixed here, the same on every rank: one all-to-all forward, then in backward the gather and
    the gradients' return. Torch's checkpoint recomputes a region until it has the tensors its forward saved, which
    differ where dynamo compiled that forward (a compiled block) but not the recompute, which runs eagerly; and the
    autograd engine orders the keys' and values' returns by when each is ready. Ranks whose collectives differ in
    number or order hang, or exchange the wrong tensors."""

    @staticmethod
    def forward(
        ctx: Any,
        split: SplitAttention,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        scale: float | None,
        key_bias: Tensor | None,
    ) -> Tensor:
        ctx.split, ctx.scale = split, scale
        ctx.save_for_backward(query, key, value, key_bias)
        return split._over_gathered(query, key, value, scale, key_bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, key_bias = ctx.saved_tensors
        inputs = tuple(t.detach().requires_grad_() for t in (query, key, value))
        with torch.enable_grad():
            out = ctx.split._over_gathered(*inputs, ctx.scale, key_bias)
        return None, *torch.autograd.grad(out, inputs, grad), None, None
