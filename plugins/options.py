"""``ParallelStrategy``'s options beside those of ``ParallelConfig`` and ``LayoutRequest`` (which check their own),
checked when the strategy is built: an impossible value is refused before any process or tensor exists, and the
message says what to choose instead."""

from __future__ import annotations

from typing import Any

from lightdist.checkpoint.async_checkpoint import AsyncMode
from lightdist.checkpoint.storage import reject_credentials
from lightdist.config import ParallelConfig
from lightdist.parallel.pipeline.schedules import check_microbatch_rounds
from lightdist.plugins.auto_layout import LayoutRequest
from lightdist.plugins.non_finite import NonFinitePolicy
from lightdist.plugins.token_weights import LossWeighting

__all__ = ["validate_options"]


def validate_options(
    sizes: LayoutRequest,
    config: ParallelConfig,
    async_checkpoint: str | None,
    storage_options: Any,
    loss_weighting: str,
    non_finite: str | None,
    collective_timeout: float,
) -> None:
    """Reject impossible options when the strategy is built, before any process or tensor exists."""
    if isinstance(sizes.pp, int):
        check_microbatch_rounds(config.pipeline_schedule, config.microbatches, sizes.pp)
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
    if loss_weighting not in LossWeighting.__args__:
        raise ValueError(
            f"loss_weighting={loss_weighting!r} is not one of 'tokens' (batches weigh by their labelled tokens, as "
            "one process's mean over the global batch) or 'batches' (each batch's mean alike, as Lightning does)."
        )
    if non_finite not in (None, *NonFinitePolicy.__args__):
        raise ValueError(
            f"non_finite={non_finite!r} is not one of 'skip' (leave the weights as they were), 'rollback' (load the "
            "newest checkpoint), 'stop' (raise, naming the step) or None (check nothing)."
        )
    if config.pipeline_tracer and sizes.tp != 1:
        raise ValueError(
            "pipeline_tracer=True traces each block into a graph with its head counts fixed, which tensor "
            f"parallelism cannot rewrite, but tensor_parallel_size={sizes.tp!r}. Use "
            "tensor_parallel_size=1 with the tracer, or cut stages by structure (pipeline_tracer=False)."
        )
