"""Sharded checkpoints at any fsspec URL: a local path, ``file://``, ``s3://``, ``gs://``, ``memory://``.

Every rank writes its own shards straight to the URL through DCP's fsspec writer (s3fs and gcsfs underneath), and
one rank writes the rest of Lightning's checkpoint (loop counters, callbacks, hyperparameters) beside them, after
the shards. Lightning's own sharded save turns ``s3://bucket/x`` into a local folder ``s3:/bucket/x``.

Endpoints and credentials come from the environment or the filesystems' own configuration (``AWS_*``,
``~/.aws``, ``GOOGLE_APPLICATION_CREDENTIALS``), so they never pass through lightdist's arguments or logs.
"""

from __future__ import annotations

from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME

# Not re-exported by torch.distributed.checkpoint (torch 2.13), but the writer and reader DCP documents for fsspec.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

__all__ = ["load_sharded", "read_metadata", "save_sharded"]


def save_sharded(state: dict[str, Any], url: str, *, metadata: dict[str, Any] | None = None) -> None:
    """Write ``state``'s shards to ``url`` from every rank (a collective), then ``metadata``, which one rank passes.

    ``dcp.save`` returns once every rank's shards and DCP's index are written, so the metadata file comes last.
    """
    dcp.save(state, storage_writer=FsspecWriter(url))
    if metadata is not None:
        with fsspec.open(_join(url, _METADATA_FILENAME), "wb") as file:
            torch.save(metadata, file)


def load_sharded(state: dict[str, Any], url: str) -> None:
    """Fill ``state``'s tensors in place with this rank's share of the checkpoint at ``url`` (a collective)."""
    dcp.load(state, storage_reader=FsspecReader(url))


def read_metadata(url: str, *, weights_only: bool | None = None) -> dict[str, Any]:
    """The non-tensor part of Lightning's checkpoint at ``url``."""
    with fsspec.open(_join(url, _METADATA_FILENAME), "rb") as file:
        return torch.load(file, weights_only=weights_only)


def _join(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"
