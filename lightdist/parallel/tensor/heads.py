"""Attention head counts, read from a module or the config object its code reads them from, and set per rank.

Attention code reshapes its projections with head counts and widths it keeps (``self.num_heads``,
``config.n_head``, ``self.embed_dim``). Where each rank computes 1/tp of the heads, those become per-rank values, so
``view(B, T, self.num_heads, head_dim)`` keeps working unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import Tensor, nn

from lightdist.parallel.structure import (
    DecoderStack,
    find_decoder_stack,
)

__all__ = [
    "AttentionHeads",
    "adapt_to_rank",
    "attention_heads",
    "block_attention_heads",
    "model_attention_heads",
    "set_heads_per_rank",
]

# Attributes attention code reads to reshape its projections; under tensor parallelism each rank holds 1/tp of them.
_QUERY_HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads")
_KEY_VALUE_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_query_groups")
# Widths attention code reshapes with: under the fast layout each rank holds 1/tp of the heads, so 1/tp of these.
_WIDTH_ATTRIBUTES = ("embed_dim", "split_size", "n_embd", "hidden_size", "all_head_size", "d_model", "inner_dim")
_GROUP_ATTRIBUTES = ("num_key_value_groups", "n_rep")  # query heads per key/value head


@dataclass(frozen=True)
class AttentionHeads:
    """An attention module's head counts and the attributes they were read from."""

    heads: int
    kv_heads: int
    heads_attribute: str
    kv_heads_attribute: str


def attention_heads(module: nn.Module) -> AttentionHeads | None:
    """Head counts from the module's own attributes or, for attention that reads them from a config object (Hugging
    Face's, LitGPT's), the config's; ``None`` for modules that are not attention."""
    for source in (module, *_configs(module).values()):
        heads = _first_int_attribute(source, _QUERY_HEAD_ATTRIBUTES)
        if heads is not None:
            kv_heads = _first_int_attribute(source, _KEY_VALUE_HEAD_ATTRIBUTES) or heads
            return AttentionHeads(heads[1], kv_heads[1], heads[0], kv_heads[0])
    return None


def block_attention_heads(stack: DecoderStack) -> AttentionHeads | None:
    """The head counts of the attention in the stack's first block; ``None`` where none is found."""
    first_block = next(iter(stack.blocks.children()))
    return next(filter(None, map(attention_heads, first_block.modules())), None)


def model_attention_heads(model: nn.Module) -> AttentionHeads | None:
    """The head counts of ``model``'s attention, read from its blocks; ``None`` where it has no stack of blocks or
    they name none (what needs them then reads them as attention runs)."""
    try:
        return block_attention_heads(find_decoder_stack(model))
    except ValueError:  # no stack of blocks found
        return None


def _configs(module: nn.Module) -> dict[str, object]:
    """The module's attributes that are plain objects carrying head counts: the config its code reads them from."""
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, nn.Module | Tensor)
        and _first_int_attribute(value, _QUERY_HEAD_ATTRIBUTES) is not None
    }


def _first_int_attribute(source: object, names: tuple[str, ...]) -> tuple[str, int] | None:
    return next(((name, value) for name in names if isinstance(value := getattr(source, name, None), int)), None)


def adapt_to_rank(unit: nn.Module, counts: AttentionHeads, query_width: int, tp: int) -> None:
    """Per-rank widths on the unit, and a per-rank copy of the config it reads head counts from (shared by every
    block, so it is copied, never changed): what DeepSpeed's AutoTP rewrites, found on any attention."""
    head_dim = query_width // counts.heads
    widths = {query_width: query_width // tp}
    if counts.kv_heads >= tp:
        widths.setdefault(counts.kv_heads * head_dim, counts.kv_heads * head_dim // tp)
    for name, config in _configs(unit).items():
        config = copy.copy(config)
        set_heads_per_rank(config, counts, tp)
        _set_widths(config, widths)
        setattr(unit, name, config)
    _set_widths(unit, widths)


def _set_widths(source: object, widths: dict[int, int]) -> None:
    for name in _WIDTH_ATTRIBUTES:
        value = getattr(source, name, None)
        if isinstance(value, int) and value in widths:
            setattr(source, name, widths[value])


def set_heads_per_rank(source: object, counts: AttentionHeads | None, tp: int) -> None:
    """Each rank computes 1/tp of the query heads and of the key/value heads, or one replicated key/value head:
    ``source`` (a module or a config) gets those counts wherever it keeps them."""
    if counts is None:
        return
    heads, kv_heads = counts.heads // tp, max(counts.kv_heads // tp, 1)
    for names, count in ((_QUERY_HEAD_ATTRIBUTES, heads), (_KEY_VALUE_HEAD_ATTRIBUTES, kv_heads)):
        for name in names:
            if isinstance(getattr(source, name, None), int):
                setattr(source, name, count)
    for name in _GROUP_ATTRIBUTES:
        if isinstance(getattr(source, name, None), int):
            setattr(source, name, heads // kv_heads)
