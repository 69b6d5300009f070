"""The ops of a pipeline stage cut by torch's tracer, read as the calls the model's code made.

Context parallelism recognises positions, attention and what it must refuse by the function the model calls
(``torch.arange``, ``F.scaled_dot_product_attention``, ``scores.softmax(-1)``). A traced stage runs what
``torch.export`` recorded instead: ``aten.arange.default``, ``aten.softmax.int``. Each such op is the function's own
schema, so the function takes the op's arguments as they are. (Slices, recorded one dimension at a time, are written
back as the model's indexing when the stage is cut: ``lightdist.pipeline.traced``.)
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
    function = _FUNCTION_OF_OP.get(getattr(func, "overloadpacket", None))  # aten.sum of aten.sum.dim_IntList
    return (function, args, kwargs) if function is not None else (func, args, kwargs)
