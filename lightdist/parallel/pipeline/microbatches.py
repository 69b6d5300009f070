"""A step's batch cut into the microbatches a pipeline schedule runs, whatever form the data loader gave it.

A batch is one tensor, a tuple ``(x, y)`` from a ``TensorDataset``, a dict or Hugging Face ``BatchEncoding`` from a
collator, a dataclass or named tuple, nested, with strings or ids beside the tensors. Each microbatch has the batch's
structure over a contiguous share of its examples, so the user's step runs on it as on the whole batch, and the
model's inputs and the step's loss read the same examples:

- a tensor whose first dimension counts the batch's examples is cut along it;
- a tensor without such a dimension (a scalar, or one row broadcast over the examples) goes whole to each microbatch;
- a list or tuple of plain values (strings, ids, lengths), one per example, is cut like a tensor;
- any other value (a string, a number, ``None``) goes whole to each microbatch.

The batch's examples are counted by the first dimension its tensors share most, token-shaped (2-D and up) tensors
first. A tensor with another number of rows (packed sequences' offsets, say) cannot be cut, and is an error naming
it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any

from lightning_utilities.core.apply_func import is_dataclass_instance, is_namedtuple
from torch import Tensor

from lightdist.dataflow import tensors_in

__all__ = ["cut_batch", "examples_in"]

_PLAIN = (str, bytes, int, float, bool, type(None))


def examples_in(batch: Any) -> int:
    """The number of examples in ``batch``: the first dimension most of its tensors of two or more dimensions share
    (of its 1-D tensors, where it has none), the larger on a tie."""
    tensors = [tensor for tensor in tensors_in(batch) if tensor.dim() > 0]
    if not tensors:
        raise ValueError(
            "Pipeline parallelism cuts each batch into microbatches along its tensors' first dimension, but this "
            f"batch holds no tensor with one ({type(batch).__name__}). Yield tensors with one row per example from "
            "the data loader."
        )
    sizes = Counter(tensor.shape[0] for tensor in [t for t in tensors if t.dim() > 1] or tensors)
    return max(sizes, key=lambda size: (sizes[size], size))


def cut_batch(batch: Any, microbatches: int) -> list[Any]:
    """``batch`` as ``microbatches`` batches of the same structure, each holding a contiguous, equal share of its
    examples (the first share first)."""
    examples = examples_in(batch)
    if examples % microbatches:
        raise ValueError(
            f"microbatches={microbatches} does not divide the batch of {examples} examples on each data-parallel "
            "rank. Choose microbatches that divide the per-rank batch size."
        )
    share = examples // microbatches
    return [_cut(batch, "batch", examples, slice(i * share, (i + 1) * share)) for i in range(microbatches)]


def _cut(value: Any, name: str, examples: int, rows: slice) -> Any:
    if isinstance(value, Tensor):
        if value.dim() == 0 or (value.shape[0] == 1 and examples > 1):
            return value
        if value.shape[0] != examples:
            raise ValueError(
                f"{name} has {value.shape[0]} rows where the batch has {examples} examples, so pipeline parallelism "
                "cannot tell which rows belong to which microbatch. Give it one row per example (or a single row "
                "shared by all), or compute it in the step from per-example tensors."
            )
        return value[rows]
    if isinstance(value, Mapping):
        cut = {key: _cut(item, f"{name}[{key!r}]", examples, rows) for key, item in value.items()}
        return cut if type(value) is dict else type(value)(cut)
    if is_dataclass_instance(value):
        fields = [field.name for field in dataclasses.fields(value) if field.init]
        return dataclasses.replace(
            value, **{field: _cut(getattr(value, field), f"{name}.{field}", examples, rows) for field in fields}
        )
    if is_namedtuple(value):
        return type(value)(*(_cut(item, f"{name}[{i}]", examples, rows) for i, item in enumerate(value)))
    if isinstance(value, list | tuple):
        if len(value) == examples and all(isinstance(item, _PLAIN) for item in value):
            return type(value)(value[rows])
        return type(value)(_cut(item, f"{name}[{i}]", examples, rows) for i, item in enumerate(value))
    return value
