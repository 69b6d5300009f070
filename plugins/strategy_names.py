"""The names ``Trainer(strategy=...)`` and LightningCLI configs take for ``ParallelStrategy``: each name's
description and the options it stands for."""

from __future__ import annotations

from typing import Any

__all__ = ["STRATEGY_NAMES"]

_ZERO_SHARDS = {1: "optimizer state", 2: "optimizer state and gradients", 3: "everything"}

STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "lightdist": ("every rank data parallel, ZeRO-3 (FSDP2) sharding", {}),
    "lightdist_ddp": ("data parallel, replicated (ZeRO-0)", {"zero_stage": 0}),
    "lightdist_tp": (
        "tensor parallel across each node's devices, ZeRO-3 across nodes",
        {"tensor_parallel_size": "node"},
    ),
    "lightdist_auto": (
        "the planner picks the pipeline, data and tensor parallel sizes, ZeRO-3",
        {"tensor_parallel_size": "auto", "pipeline_parallel_size": "auto"},
    ),
    "lightdist_pp": (
        "2 pipeline stages (1F1B), ZeRO-2 across the rest (parameters sharded between steps)",
        {"pipeline_parallel_size": 2},
    ),
    "lightdist_3d": (
        "2 pipeline stages x tensor parallel in pairs x ZeRO-2 across the rest (parameters sharded between steps)",
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    ),
    **{
        f"lightdist_zero{stage}": (f"data parallel, ZeRO-{stage} (shards {shards})", {"zero_stage": stage})
        for stage, shards in _ZERO_SHARDS.items()
    },
}
