"""The pipeline schedules lightdist offers, in one table: each name, torch's schedule that runs it, and what it asks
of the layout. Options naming a schedule are checked here, when the strategy is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

__all__ = [
    "SCHEDULES",
    "PipelineSchedule",
    "Schedule",
    "check_microbatch_rounds",
    "check_schedule",
    "stages_of_rank",
    "virtual_stages_of",
]

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]


@dataclass(frozen=True)
class Schedule:
    runner: type[PipelineScheduleSingle] | type[PipelineScheduleMulti]
    looped: bool  # several stages per rank (``virtual_stages``), microbatches in rounds of the pipeline's size


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(ScheduleGPipe, looped=False),  # all forwards, then all backwards
    "1f1b": Schedule(Schedule1F1B, looped=False),  # at most pipeline_parallel_size microbatches in flight
    "interleaved_1f1b": Schedule(ScheduleInterleaved1F1B, looped=True),
    "zero_bubble": Schedule(ScheduleInterleavedZeroBubble, looped=True),  # weight gradients fill the bubble
}


def check_schedule(pipeline_schedule: str, virtual_stages: int | None, microbatches: int | None) -> None:
    """Refuse a schedule lightdist does not run, or options it cannot run with."""
    if pipeline_schedule == "zbv":
        raise NotImplementedError(
            "pipeline_schedule='zbv' is not offered: torch's V-shaped schedule cannot run forward-only (its eval "
            "passes a backward between the two stages of a rank), so validation and predict would fail. Use "
            "pipeline_schedule='zero_bubble', the interleaved zero-bubble schedule."
        )
    if pipeline_schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline_schedule={pipeline_schedule!r} is not one of {', '.join(PipelineSchedule.__args__)}."
        )
    if pipeline_schedule == "zero_bubble" and torch.__version__ < "2.13":
        raise NotImplementedError(
            f"pipeline_schedule='zero_bubble' needs torch 2.13 or later, and this is torch {torch.__version__}: its "
            "split backward takes only tensors as a stage's inputs, where lightdist's stages also take the step's "
            "other arguments. Upgrade torch, or use pipeline_schedule='interleaved_1f1b'."
        )
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(f"microbatches={microbatches!r} must be a positive integer or None.")
    if virtual_stages is not None:
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages!r} must be a positive integer or None.")
        if not SCHEDULES[pipeline_schedule].looped and virtual_stages > 1:
            looped = " or ".join(repr(name) for name, schedule in SCHEDULES.items() if schedule.looped)
            raise ValueError(
                f"pipeline_schedule={pipeline_schedule!r} runs one stage per rank, but virtual_stages={virtual_stages}."
                f" Use pipeline_schedule={looped} for several stages per rank."
            )


def check_microbatch_rounds(pipeline_schedule: str, microbatches: int | None, pipeline_parallel_size: int) -> None:
    """The looped schedules run microbatches in rounds of ``pipeline_parallel_size``; checked again once an
    ``"auto"`` size is known."""
    if not SCHEDULES[pipeline_schedule].looped or microbatches is None:
        return
    rounds = max(1, microbatches // pipeline_parallel_size)
    if pipeline_parallel_size > 1 and microbatches % rounds:
        raise ValueError(
            f"pipeline_schedule={pipeline_schedule!r} runs microbatches in rounds of pipeline_parallel_size="
            f"{pipeline_parallel_size}, so microbatches={microbatches} must be a multiple of {rounds} rounds. "
            f"Choose a multiple of {pipeline_parallel_size}."
        )


def virtual_stages_of(schedule: str, virtual_stages: int | None = None) -> int:
    """Stages per rank under ``schedule``: one for GPipe and 1F1B, else ``virtual_stages`` (default 2)."""
    return (virtual_stages or 2) if SCHEDULES[schedule].looped else 1


def stages_of_rank(rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The pipeline stages ``rank`` holds: every ``pp``-th one, as torch's looped schedules expect."""
    return [rank + pp * k for k in range(virtual_stages)]
