"""Training calls the decoder blocks without Hugging Face's key/value cache.

Hugging Face models build a cache on every call unless ``use_cache=False``, and hand it to each block, which appends
its keys and values. Training never reads it back, and it harms two of lightdist's wrappers around a block:

- activation checkpointing recomputes a block from the arguments its forward was given, and the cache already holds
  the forward's keys, so the recompute would attend over the forward's keys and its own;
- ``torch.compile`` guards on the cache's state per layer (``layers[i].is_initialized``), so every block recompiles
  until dynamo's recompile limit, and the rest run eagerly.

Blocks are called without it whenever gradients are on, as Hugging Face's own gradient checkpointing calls them;
without gradients (generation, validation) they keep it, except where attention runs on DTensors (tensor
parallelism's global layout), whose keys the cache's plain tensors cannot take.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["is_kv_cache", "without_kv_cache", "without_kv_cache_in_training"]


def is_kv_cache(arg: object) -> bool:
    """Hugging Face's ``Cache``, known by its interface: a block appends its keys and values with ``update`` and
    reads how many it holds with ``get_seq_length``."""
    return callable(getattr(arg, "update", None)) and callable(getattr(arg, "get_seq_length", None))


def without_kv_cache(
    args: tuple, kwargs: dict[str, Any], *, training_only: bool = True
) -> tuple[tuple, dict[str, Any]]:
    """A block's arguments with ``None`` for a cache while gradients are on, or always (GPT-2 passes its cache by
    position)."""
    if training_only and not torch.is_grad_enabled():
        return args, kwargs
    args = tuple(None if is_kv_cache(arg) else arg for arg in args)
    return args, {name: None if is_kv_cache(arg) else arg for name, arg in kwargs.items()}


def without_kv_cache_in_training(block: nn.Module) -> None:
    """Call ``block`` without a cache while gradients are on, from a pre-hook that runs before its compiled call."""
    block.register_forward_pre_hook(lambda _, args, kwargs: without_kv_cache(args, kwargs), with_kwargs=True)
