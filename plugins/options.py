"""``ParallelStrategy``'s options beside those of ``ParallelConfig`` (which checks its own), checked when the strategy
is built: an impossible value is refused before any process or tensor exists, and the message says what to choose
instead."""

from __future__ import annotations

from typing import Any

from lightdist.async_checkpoint import AsyncMode
from lightdist.pipeline.schedules import check_microbatch_rounds
from lightdist.plugins.non_finite import NonFinitePolicy
from lightdist.storage import reject_credentials

__all__ = ["validate_options"]


def validate_options(
    *,
    data_parallel_size: int | str,
    tensor_parallel_size: int | str,
    pipeline_parallel_size: int | str,
    pipeline_schedule: str,
    microbatches: int | None,
    pipeline_tracer: bool,
    async_checkpoint: str | None,
    storage_options: Any,
    non_finite: str | None,
    collective_timeout: float,
) -> None:
    """Reject impossible options when the strategy is built, before any process or tensor exists."""
    for name, size, words in (
        ("data_parallel_size", data_parallel_size, ("auto",)),
        ("tensor_parallel_size", tensor_parallel_size, ("auto", "node")),
        ("pipeline_parallel_size", pipeline_parallel_size, ("auto",)),
    ):
        if size not in words and (not isinstance(size, int) or size < 1):
            raise ValueError(f"{name}={size!r} must be a positive integer or {' or '.join(map(repr, words))}.")
    if isinstance(pipeline_parallel_size, int):
        check_microbatch_rounds(pipeline_schedule, microbatches, pipeline_parallel_size)
    if async_checkpoint not in (None, *AsyncMode.__args__):
        raise ValueError(
            f"async_checkpoint={async_checkpoint!r} is not one of 'process' (upload from a daemon process per rank), "
            "'thread' (from a thread) or None (save before training goes on)."
        )
    if storage_options is not None:
        if not isinstance(storage_options, dict) or not all(isinstance(o, dict) for o in storage_options.values()):
            raise ValueError(
                f"storage_options={storage_options!r} must map a protocol to its fsspec options, e.g. "
                "{'s3': {'endpoint_url': 'http://127.0.0.1:9000', 'profile': 'training'}}."
            )
        reject_credentials(storage_options)
    if not isinstance(collective_timeout, int | float) or collective_timeout <= 0:
        raise ValueError(f"collective_timeout={collective_timeout!r} must be a positive number of seconds.")
    if non_finite not in (None, *NonFinitePolicy.__args__):
        raise ValueError(
            f"non_finite={non_finite!r} is not one of 'skip' (leave the weights as they were), 'rollback' (load the "
            "newest checkpoint), 'stop' (raise, naming the step) or None (check nothing)."
        )
    if pipeline_tracer and tensor_parallel_size != 1:
        raise ValueError(
            "pipeline_tracer=True traces each block into a graph with its head counts fixed, which tensor "
            f"parallelism cannot rewrite, but tensor_parallel_size={tensor_parallel_size!r}. Use "
            "tensor_parallel_size=1 with the tracer, or cut stages by structure (pipeline_tracer=False)."
        )
