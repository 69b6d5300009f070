"""The ops of a pipeline stage cut by torch's tracer, read as the calls the model's code made.

Context parallelism recognises positions, attention and what it must refuse by the function the model calls
(``torch.arange``, ``F.scaled_dot_product_attention``, ``tokens[:, :T]``, ``scores.softmax(-1)``). A traced stage
runs what ``torch.export`` recorded instead: ``aten.arange.default``, ``aten.slice.Tensor``, ``aten.softmax.int``.
Each such op is the function's own schema, so the function takes the op's arguments as they are; a slice, recorded
one dimension at a time, becomes the index that takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["as_called"]

aten = torch.ops.aten
_REDUCTIONS = (
    "sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp",
    "count_nonzero", "std", "var", "cumsum", "cumprod", "softmax", "log_softmax",
)  # fmt: skip
_FUNCTION_OF_OP: dict[Any, Callable[..., Any]] = {
    aten.arange: torch.arange,
    aten.scaled_dot_product_attention: F.scaled_dot_product_attention,
    aten.pad: F.pad,
    aten.roll: torch.roll,
    aten.conv1d: F.conv1d,
    aten.matmul: torch.matmul,
    aten.bmm: torch.bmm,
    aten.baddbmm: torch.baddbmm,
    aten.einsum: torch.einsum,
    aten.add: torch.add,
    aten.add_: Tensor.add_,
    aten.masked_fill: torch.masked_fill,
    aten.masked_fill_: Tensor.masked_fill_,
    aten.view: Tensor.view,
    aten.reshape: torch.reshape,
    **{getattr(aten, name): getattr(torch, name) for name in _REDUCTIONS},
}


def as_called(func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """``func(*args, **kwargs)`` as the model's code called it, where ``func`` is an aten op a traced graph recorded
    in place of a function lightdist reads; any other call as it is."""
    packet = getattr(func, "overloadpacket", None)  # an aten op's, e.g. aten.slice of aten.slice.Tensor
    if packet is aten.slice:
        return Tensor.__getitem__, (args[0], _index_of_slice(*args, **kwargs)), {}
    function = _FUNCTION_OF_OP.get(packet)
    return (function, args, kwargs) if function is not None else (func, args, kwargs)


def _index_of_slice(
    tensor: Tensor, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> slice | tuple:
    """The index ``aten.slice`` of ``tensor`` takes: ``tensor[start:end]``, or ``tensor[:, start:end]`` along
    ``dim`` 1, with the bounds a recorded slice writes for its ends (``9223372036854775807`` for ``x[1:]``) made
    the tensor's."""
    bounds = slice(*slice(start, end, step).indices(tensor.size(dim)))
    dim %= tensor.dim()
    return bounds if dim == 0 else (*[slice(None)] * dim, bounds)
