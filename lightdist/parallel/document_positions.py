"""Absolute positions within packed documents: each token's counted from its own document's first token.

A model that adds positions to its token embeddings reads them at the window's positions, ``0..t-1``; within packed
documents (``lightdist.parallel.documents``) a later document's tokens must read theirs from 0, or the window trains
differently from its documents alone, without an error. The reads taken, each at the positions within the documents:

- ``F.embedding`` at ``arange`` positions: nanoGPT's ``wpe(arange(t))``, GPT-2's;
- a learned table, an ``nn.Parameter`` of (positions, width), (1, positions, width) or sequence-first (positions, 1,
  width), read by its first ``t`` rows: sliced (``pos_emb[:t]``, ``[:, :t, :]``, ``[None, :t]``, ``[0, :t]``),
  ``narrow``-ed, or indexed by ``arange(t)``. Its rows become (batch, t, width), or (t, batch, width);
- a buffer of those shapes read so, where its rows are added to the batch's embeddings: the sinusoids of PyTorch's
  ``PositionalEncoding`` (``x + self.pe[:t]``). A buffer's first rows may as well be a rotary table (``cos[:t]``),
  which needs nothing (attention within a document depends on differences of positions only) and whose shape the
  model's broadcasting relies on, so a buffer's rows change only as they are added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from lightdist.dataflow import expanded_index
from lightdist.parallel.sharding import local_tensor

__all__ = ["DocumentPositions", "is_position_table", "replicated_like"]

# How a model reads a table of positions by rows.
_TABLE_READS = {Tensor.__getitem__, Tensor.index_select, torch.index_select, Tensor.narrow, torch.narrow}
# What a buffer's rows may pass through, their values kept, on their way to the embeddings.
_CARRYING = {Tensor.detach, Tensor.to, Tensor.type_as, Tensor.requires_grad_, Tensor.unsqueeze, Tensor.contiguous}
# How they are added to them.
_ADDITIONS = {Tensor.__add__, Tensor.__iadd__, Tensor.add, Tensor.add_, torch.add}


class DocumentPositions:
    """The model's position lookups, given the positions within each document by ``positions_of``
    (``DocumentMasks.positions_of``): for the window's positions (or a rank's share of them), the positions within
    their documents as (batch, length); ``None`` for other indices. ``model``'s buffers are the tables that may hold
    fixed positions."""

    OPS = {F.embedding} | _TABLE_READS | _CARRYING | _ADDITIONS

    def __init__(self, positions_of: Callable[[Tensor], Tensor | None], model: nn.Module | None) -> None:
        self.positions_of, self.model = positions_of, model
        self._buffer_rows = WeakIdKeyDictionary()  # a buffer's rows, as read -> (the buffer, their positions)

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` on a position table's rows, per document; ``NotImplemented`` where ``func`` reads no positions."""
        if func is F.embedding:
            return self._embedding(*args, **kwargs)
        if func in _TABLE_READS:
            return self._table_rows(func, args, kwargs)
        if torch.compiler.is_compiling() or not self._buffer_rows:  # the embeddings run outside compiled blocks
            return NotImplemented
        if func in _CARRYING and args[0] in self._buffer_rows:
            out = func(*args, **kwargs)
            self._buffer_rows[out] = self._buffer_rows[args[0]]
            return out
        if func in _ADDITIONS:
            return self._added(func, args, kwargs)
        return NotImplemented

    def _embedding(self, indices: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        positions = self.positions_of(local_tensor(indices))
        if positions is not None:  # a table of positions, looked up per document
            indices = replicated_like(positions, indices)
        return F.embedding(indices, weight, *args, **kwargs)

    def _table_rows(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A learned table's rows at the positions within their documents; a buffer's rows as read, kept to be added
        per document (``_added``)."""
        table = args[0]
        read = _rows_read(func, args, kwargs)
        if read is None:
            return NotImplemented
        indices, sequence_first = read
        learned = isinstance(table, nn.Parameter)
        if not learned and (torch.compiler.is_compiling() or not self._is_buffer(table)):  # tables are read eagerly
            return NotImplemented
        positions = self.positions_of(indices)
        if positions is None:
            return NotImplemented
        if not learned:
            rows = func(*args, **kwargs)
            self._buffer_rows[rows] = (table, positions)
            return rows
        return replicated_like(_rows_at(table, positions, sequence_first), table)

    def _is_buffer(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is one of the model's buffers, as the model holds them now (a pipeline's check runs a
        whole copy of it in its place)."""
        return self.model is not None and any(tensor is buffer for buffer in self.model.buffers())

    def _added(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A buffer's rows added to the batch's embeddings, (batch, t, width) or (t, batch, width) as the rows were
        read, (t, width), (1, t, width) or (t, 1, width): the buffer's rows at the positions within each document."""
        operands = [*args[:2], kwargs.get("other")][:2]
        if len(operands) < 2:
            return NotImplemented
        at = next((i for i, x in enumerate(operands) if isinstance(x, Tensor) and x in self._buffer_rows), None)
        if at is None:
            return NotImplemented
        read, embeddings = operands[at], operands[1 - at]
        table, positions = self._buffer_rows[read]
        sequence_first = read.dim() == 3 and read.size(1) == 1 and read.size(0) > 1
        rows = _rows_at(table, positions, sequence_first).to(read.dtype)
        if not isinstance(embeddings, Tensor) or embeddings.shape != rows.shape:
            return NotImplemented
        operands[at] = replicated_like(rows, read)
        if len(args) < 2:
            return func(operands[0], *args[2:], **{**kwargs, "other": operands[1]})
        return func(*operands, *args[2:], **kwargs)


def is_position_table(tensor: Tensor) -> bool:
    """Whether ``tensor`` is shaped as a table of positions: (positions, width), (1, positions, width) or sequence-first
    (positions, 1, width), of floating point."""
    return tensor.is_floating_point() and (tensor.dim() == 2 or (tensor.dim() == 3 and 1 in tensor.shape[:2]))


def _rows_at(table: Tensor, positions: Tensor, sequence_first: bool) -> Tensor:
    """``table``'s rows at ``positions`` (batch, t): (batch, t, width), or (t, batch, width) ``sequence_first``."""
    rows = F.embedding(positions, local_tensor(table).flatten(0, -2))
    return rows.transpose(0, 1) if sequence_first else rows


def _rows_read(func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, bool] | None:
    """The rows ``func`` reads of ``args[0]``, a table of positions of (positions, width), (1, positions, width) or
    (positions, 1, width), where it reads rows only, its other dimensions whole (or a dimension of 1 dropped): the
    indices, and whether the rows come sequence-first (a dimension of 1 after them); ``None`` for any other read."""
    table = args[0]
    if not isinstance(table, Tensor) or not is_position_table(table):
        return None
    rows_dim, single = (0, None) if table.dim() == 2 else (1, 0) if table.size(0) == 1 else (0, 1)
    if func is Tensor.__getitem__:
        return _indexed_rows(args[1], table, rows_dim, single)
    names = ("dim", "start", "length") if func in (Tensor.narrow, torch.narrow) else ("dim", "index")
    call = dict(zip(names, args[1:], strict=False)) | kwargs
    if not isinstance(call.get("dim"), int) or call["dim"] % table.dim() != rows_dim:
        return None
    sequence_first = single is not None and single > rows_dim
    if "index" in names:
        return call["index"], sequence_first
    if call["start"] != 0 or not isinstance(call["length"], int):
        return None
    return torch.arange(call["length"], device=table.device), sequence_first


def _indexed_rows(index: Any, table: Tensor, rows_dim: int, single: int | None) -> tuple[Tensor, bool] | None:
    """``_rows_read`` of ``table[index]``: the first ``t`` rows sliced (``[:t]``, ``[:, :t, :]``, ``[None, :t]``,
    ``[0, :t]``), or indexed by a tensor of integers (``[arange(t)]``)."""
    index = index if isinstance(index, tuple) else (index,)
    leading = next((i for i, part in enumerate(index) if part is not None), len(index))
    index = expanded_index(index[leading:], table.dim())
    if len(index) != table.dim() or any(part is None or part is Ellipsis for part in index):
        return None
    rows = index[rows_dim]
    if isinstance(rows, slice):
        if rows.start not in (None, 0) or rows.step not in (None, 1) or not isinstance(rows.stop, int):
            return None
        rows = torch.arange(rows.stop, device=table.device)
    else:
        most_dims = 2 if leading == 0 and table.dim() == 2 else 1  # positions (1, t) index a 2-D table alone
        if not isinstance(rows, Tensor) or rows.is_floating_point() or rows.dim() > most_dims:
            return None
    kept = []
    for d, part in enumerate(index):
        whole = isinstance(part, slice) and part == slice(None)
        if d == single and (whole or (isinstance(part, int) and part in (0, -1))):
            kept.append(whole)
        elif d != rows_dim and not whole:
            return None
    return rows, single is not None and single > rows_dim and kept == [True]


def replicated_like(local: Tensor, like: Tensor) -> Tensor:
    """``local``, a tensor every rank computes whole, held as ``like`` is: a replicated DTensor where ``like`` is one
    (tensor parallelism's)."""
    if not isinstance(like, DTensor):
        return local
    if not all(placement.is_replicate() for placement in like.placements):
        raise ValueError(f"document_end_token: positions split over ranks ({like.placements}) are not supported yet.")
    return DTensor.from_local(local, like.device_mesh, like.placements)
