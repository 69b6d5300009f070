"""What an offline W&B run recorded, read from its ``run-*.wandb`` file, as ``wandb sync`` would upload it.

The file is a log of W&B's protobuf records in LevelDB's log format: a 7-byte file header, then 32 KiB blocks of
chunks, each with a 7-byte header (CRC, length, kind) and a record split over chunks where it crosses a block.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _LAST = 1, 2, 4


def records(run_file: Path) -> list[wandb_internal_pb2.Record]:
    data = run_file.read_bytes()
    found, pending, position = [], b"", _HEADER
    while position + _HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _HEADER:  # too little room for a chunk header: the block is padded
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        chunk = data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
    return found


def offline_run_config(wandb_dir: Path) -> dict[str, Any]:
    """The config of the one offline run under ``wandb_dir``, with every update applied."""
    (run_file,) = wandb_dir.glob("offline-run-*/run-*.wandb")
    config: dict[str, Any] = {}
    for record in records(run_file):
        if record.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return config


def offline_run_history(wandb_dir: Path) -> list[dict[str, Any]]:
    """The rows the one offline run under ``wandb_dir`` logged, in order: one per ``wandb.log`` commit."""
    (run_file,) = wandb_dir.glob("offline-run-*/run-*.wandb")
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records(run_file)
        if record.WhichOneof("record_type") == "history"
    ]
