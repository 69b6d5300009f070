"""The ops of a pipeline stage cut by torch's tracer, read as the calls the model's code made.

Context parallelism recognises positions, attention and what it must refuse by the function the model calls
(``torch.arange``, ``F.scaled_dot_product_attention``, ``scores.softmax(-1)``). A traced stage runs what
``torch.export`` recorded instead: ``aten.arange.default``, ``aten.softmax.int``. Each such op is the schema of the
``torch`` function of its name, so that function takes the op's arguments as they are. (Slices, recorded one dimension
at a time, are written back as the model's indexing when the stage is cut: ``lightdist.parallel.pipeline.traced``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["as_called", "functions_of_ops"]


def functions_of_ops(functions: Iterable[Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """The aten op of each of ``functions`` that has one, to the function whose parameters are the op's: ``torch``'s
    own where it is among them (``F.softmax`` takes a stack level where ``aten.softmax`` takes a dtype), else
    ``torch.nn.functional``'s, else the ``Tensor`` method (``Tensor.view``, ``Tensor.add_``)."""
    by_name: dict[str, list[Callable[..., Any]]] = {}
    for function in functions:
        by_name.setdefault(function.__name__, []).append(function)
    table = {}
    for name, named in by_name.items():
        op = None if name.startswith("_") else getattr(torch.ops.aten, name, None)
        if op is not None:
            table[op] = min(named, key=lambda f: (f is not getattr(torch, name, None), f is not getattr(F, name, None)))
    return table


def as_called(
    func: Any, args: tuple, kwargs: dict, functions: Mapping[Any, Callable[..., Any]]
) -> tuple[Any, tuple, dict]:
    """``func(*args, **kwargs)`` as the model's code called it, where ``func`` is an aten op a traced graph recorded
    in place of one of ``functions`` (``functions_of_ops``); any other call as it is."""
    function = functions.get(getattr(func, "overloadpacket", None))  # aten.sum of aten.sum.dim_IntList
    return (function, args, kwargs) if function is not None else (func, args, kwargs)
