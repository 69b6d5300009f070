"""The data's token ids against the model's embedding, checked before the first step.

An id past the embedding's rows fails deep in a kernel (an index error on CPU, a device-side assert on a GPU that
names no tensor), or worse, reads a row of padding that a resized vocabulary left. Here it is an error that names
both sizes.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

__all__ = ["check_vocabulary", "token_embedding_rows"]


def token_embedding_rows(model: nn.Module) -> int | None:
    """Rows of the embedding that takes the token ids: the one a Hugging Face model names as its input embedding,
    else the largest (positions have fewer rows than tokens). ``None`` where this rank holds none (a later pipeline
    stage)."""
    for module in model.modules():
        named = getattr(module, "get_input_embeddings", None)
        try:  # Hugging Face's raises where the model holds none: a later pipeline stage's
            embedding = named() if callable(named) else None
        except (NotImplementedError, AttributeError):
            embedding = None
        if isinstance(embedding, nn.Embedding):
            return embedding.num_embeddings  # the whole vocabulary, however its weight is split or held
    return max((module.num_embeddings for module in model.modules() if isinstance(module, nn.Embedding)), default=None)


def check_vocabulary(model: nn.Module, vocabulary_size: int | None, data: str) -> None:
    """Refuse ``data``, whose ids run up to ``vocabulary_size`` (``None``: unknown), where the model's token
    embedding has fewer rows; every rank calls it, and every rank raises, whichever holds the embedding."""
    if vocabulary_size is None:
        return
    rows = token_embedding_rows(model)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every_rank: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, rows)
        rows = max((r for r in every_rank if r is not None), default=None)
    if rows is not None and rows < vocabulary_size:
        raise ValueError(
            f"{data} holds token ids up to {vocabulary_size - 1} (a vocabulary of {vocabulary_size}), and the model's "
            f"token embedding has {rows} rows: ids from {rows} on have no row. Give the model a vocabulary of at least "
            f"{vocabulary_size} (its vocab_size), or prepare the data with the model's own tokenizer."
        )
