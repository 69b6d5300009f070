"""``ProfileSteps``: a torch profiler trace of a few optimizer steps, one file per rank.

Under a pipeline every stage's forward and backward of every microbatch is a named span of the trace ("stage 1
forward, microbatch 3", ``StageClock`` names them), so the schedule and its bubble can be seen: open a rank's trace in
Perfetto (ui.perfetto.dev) or ``chrome://tracing``, or draw every rank's in one timeline with ``lightdist timeline``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.profiler import ProfilerActivity, profile
from typing_extensions import override

__all__ = ["ProfileSteps"]


class ProfileSteps(Callback):
    """Profiles the optimizer steps ``steps`` (counted from 0, as ``trainer.global_step`` counts them; a run that
    ends sooner is profiled to its end) and writes each rank's trace to ``dirpath/rank{N}.json``.

    In a YAML config: ``trainer.callbacks: [{class_path: lightdist.plugins.ProfileSteps, init_args: {steps: [10,
    11]}}]``. A profiled step runs slower than the others, and its trace takes tens of MB per rank for a large model:
    profile two or three steps after the first few.
    """

    def __init__(self, steps: list[int] | tuple[int, ...] = (10, 11), dirpath: str | os.PathLike = "traces") -> None:
        if not steps or any(not isinstance(step, int) or step < 0 for step in steps):
            raise ValueError(f"ProfileSteps(steps={steps!r}) needs optimizer step numbers, 0 or more, e.g. [10, 11].")
        self.first, self.last = min(steps), max(steps)
        self.dirpath = os.fspath(dirpath)
        self._profiler: profile | None = None
        self._done = False

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._profiler is None and not self._done and trainer.global_step >= self.first:
            activities = [ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self._profiler is not None and trainer.global_step > self.last:
            self._write(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:
            self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        self._profiler.__exit__(None, None, None)
        os.makedirs(self.dirpath, exist_ok=True)
        self._profiler.export_chrome_trace(os.path.join(self.dirpath, f"rank{trainer.global_rank}.json"))
        self._profiler, self._done = None, True
        steps = f"step {self.first}" if self.first == self.last else f"steps {self.first}-{self.last}"
        rank_zero_info(
            f"lightdist: {steps} profiled: a trace per rank in {self.dirpath}/rank*.json; `lightdist timeline "
            f"{self.dirpath}` draws the pipeline schedule"
        )
