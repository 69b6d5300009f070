"""``TrainingMonitor``: how fast a run trains and what that costs, logged every few steps to every logger.

Lightning's ``ThroughputMonitor`` runs on rank 0 alone and counts every rank as a data-parallel replica. Under
tensor and pipeline parallelism several ranks share one batch, and the peak memory, gradient norm and pipeline bubble
of a run need every rank's share, so this callback runs on every rank and reduces what it measures.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightdist.parallel.expert_load import ExpertLoad, imbalance_metrics, wandb_histograms
from lightdist.parallel.pipeline.structural import total_norm
from lightdist.parallel.sharding import local_tensor
from lightdist.plan.throughput import DecoderFlops, device_peak_flops
from lightdist.plugins.strategy import ParallelStrategy

__all__ = ["TrainingMonitor", "gradient_norm", "sequences_and_length"]

_ON_PROGRESS_BAR = ("perf/tokens_per_s", "perf/mfu")


def sequences_and_length(batch: Any) -> tuple[int, int]:
    """How many sequences a batch holds and how many tokens of each the model trains on.

    A tensor is a batch of token windows, inputs and targets in one: ``(B, T + 1)`` trains on ``T`` tokens each. A
    mapping holds ``input_ids`` of shape ``(B, T)``, as Hugging Face collators make them; a tuple or list, inputs
    ``(B, T)`` first, as a ``TensorDataset`` of inputs and targets yields them.
    """
    if isinstance(batch, Tensor) and batch.dim() == 2:
        return batch.shape[0], batch.shape[1] - 1
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        return tuple(batch["input_ids"].shape[:2])
    if isinstance(batch, list | tuple) and batch and isinstance(batch[0], Tensor) and batch[0].dim() == 2:
        return tuple(batch[0].shape)
    raise ValueError(
        f"TrainingMonitor cannot tell the tokens in a batch of type {type(batch).__name__}. Pass "
        "TrainingMonitor(batch_shape_fn=...), a function from a batch to (sequences, tokens per sequence)."
    )


class TrainingMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps:

    - ``perf/step_time_s``: wall time per optimizer step; waits for checkpoints count, validation does not.
    - ``perf/tokens_per_s``: tokens trained per second by the whole run, and ``perf/tokens_per_s_per_device``.
    - ``perf/mfu``: model FLOPs utilisation, the decoder's FLOPs per token (``DecoderFlops``) times tokens per second
      over the devices' peak (known GPUs' datasheet figures, or ``peak_tflops``); absent where no peak is known.
    - ``memory/peak_gib``: the most memory any rank held: on GPUs the peak allocated since the last log, on CPUs the
      process's peak resident memory.
    - ``memory/parameters_gib``, ``memory/gradients_gib``, ``memory/optimizer_gib``: the most any rank holds of the
      model's parameters, their gradients (as the optimizer steps) and the optimizer's state: its own shards, measured.
      On GPUs (without ``cpu_offload``) ``memory/activations_gib``: the rest of the peak, the activations and the
      buffers a step needs beside them (ZeRO's gathered parameters, communication buffers). Under
      ``ParallelStrategy`` the planner's estimate of each part goes beside them (``memory/planned_parameters_gib``,
      ...; ``lightdist plan``'s figures).
    - ``checkpoint/blocked_s``: seconds per step that training waited on checkpoint saves.
    - ``pipeline/bubble``: the share of the pipeline schedule's time its stages spent waiting on each other (pp > 1).
    - ``train/grad_norm``: the whole model's gradient norm, over every stage and shard, before clipping.
    - Mixture-of-Experts models: ``moe/imbalance/<layer>``, each MoE layer's busiest expert's tokens over the mean
      (1: balanced; a dropless layer runs at its busiest expert's pace), ``moe/imbalance`` the worst layer's, and to
      W&B ``moe/tokens_per_expert/<layer>``, a histogram of the tokens routed to each expert, over all ranks.

    ``perf/tokens_per_s`` and ``perf/mfu`` also go on the progress bar.

    Args:
        log_every_n_steps: Default: the Trainer's ``log_every_n_steps``.
        peak_tflops: The device's peak in TFLOP/s for the MFU, where the table does not know it (or to override it).
        batch_shape_fn: From a batch to (sequences, tokens per sequence); default ``sequences_and_length``.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        peak_tflops: float | None = None,
        batch_shape_fn: Callable[[Any], tuple[int, int]] | None = None,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be at least 1.")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"peak_tflops={peak_tflops} must be positive: the device's peak in TFLOP/s.")
        self.log_every_n_steps = log_every_n_steps
        self.peak_tflops = peak_tflops
        self.batch_shape_fn = batch_shape_fn or sequences_and_length
        self._flops: DecoderFlops | None = None
        self._peak_flops: float | None = None
        self._every = 1
        self._window_start = 0.0
        self._window_first_step = 0
        self._window_tokens = 0
        self._seq_len = 0
        self._validation_start: float | None = None
        self._blocked_before = 0.0
        self._pipeline_before = (0.0, 0.0)
        self._grad_norm: Tensor | None = None
        self._gradient_bytes = 0.0
        self._expert_load: ExpertLoad | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._every = self.log_every_n_steps or trainer.log_every_n_steps
        try:
            self._flops = DecoderFlops.of(pl_module)  # before the strategy splits the model
        except ValueError:  # no decoder stack (yet: layers made in configure_model): no MFU
            self._flops = None
        self._peak_flops = device_peak_flops(trainer.strategy.root_device, self.peak_tflops)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pipeline = trainer.strategy.pipeline_step if isinstance(trainer.strategy, ParallelStrategy) else None
        # The model as split: its experts modules, under any layout; not the stages' runs on made-up inputs.
        self._expert_load = ExpertLoad(pl_module, counting=lambda: pipeline is None or not pipeline.setting_up_stages)
        self._start_window(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._expert_load.remove()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:  # validation time is not training time
            self._window_start += time.perf_counter() - self._validation_start
            self._validation_start = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if (trainer.global_step + 1) % self._every == 0:
            self._grad_norm = gradient_norm(trainer, optimizer)
            self._gradient_bytes = _held_bytes(p.grad for p in pl_module.parameters() if p.grad is not None)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sequences, self._seq_len = self.batch_shape_fn(batch)
        self._window_tokens += sequences * self._seq_len
        step = trainer.global_step
        if step == self._window_first_step or step % self._every or self._grad_norm is None:
            return  # accumulating, or not a step to log
        metrics = self._measure(trainer, steps=step - self._window_first_step)
        metrics |= _memory_parts(trainer, pl_module, self._gradient_bytes)
        tokens = self._expert_load.take(counts_tokens=_counts_tokens(trainer)) if self._expert_load else {}
        metrics |= imbalance_metrics(tokens)
        for logger in trainer.loggers:
            histograms = wandb_histograms(tokens) if isinstance(logger, WandbLogger) else {}
            logger.log_metrics(metrics | histograms, step=step - 1)  # where Lightning logs the loss of the same step
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, logger=False, prog_bar=name in _ON_PROGRESS_BAR)
        self._start_window(trainer)

    def _measure(self, trainer: pl.Trainer, steps: int) -> dict[str, float]:
        strategy = trainer.strategy
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize(strategy.root_device)
        elapsed = time.perf_counter() - self._window_start
        data_parallel = strategy.layout.dp if isinstance(strategy, ParallelStrategy) else trainer.world_size
        tokens_per_s = self._window_tokens * data_parallel / elapsed
        metrics = {
            "perf/step_time_s": elapsed / steps,
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_device": tokens_per_s / trainer.world_size,
            "train/grad_norm": self._grad_norm.item(),
        }
        if self._flops is not None and self._peak_flops is not None:
            flops_per_s = self._flops.per_token(self._seq_len) * tokens_per_s
            metrics["perf/mfu"] = flops_per_s / (self._peak_flops * trainer.world_size)
        if isinstance(strategy, ParallelStrategy):
            metrics["checkpoint/blocked_s"] = (strategy.checkpoint_io.blocked_s - self._blocked_before) / steps
            if strategy.layout.pp > 1:
                (busy, scheduled), (busy_before, scheduled_before) = _pipeline_time(strategy), self._pipeline_before
                metrics["pipeline/bubble"] = 1.0 - (busy - busy_before) / (scheduled - scheduled_before)
        return metrics

    def _start_window(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize(strategy.root_device)
            torch.cuda.reset_peak_memory_stats(strategy.root_device)
        self._window_start = time.perf_counter()
        self._window_first_step = trainer.global_step
        self._window_tokens = 0
        self._grad_norm = None
        if isinstance(strategy, ParallelStrategy):
            self._blocked_before = strategy.checkpoint_io.blocked_s
            if strategy.layout.pp > 1:
                self._pipeline_before = _pipeline_time(strategy)


def _counts_tokens(trainer: pl.Trainer) -> bool:
    """Whether this rank's routed tokens are its own: not a tensor-parallel peer's copy."""
    strategy = trainer.strategy
    return not isinstance(strategy, ParallelStrategy) or strategy.device_mesh["tp"].get_local_rank() == 0


def gradient_norm(trainer: pl.Trainer, optimizer: Optimizer) -> Tensor:
    """The whole model's gradient norm, over every stage and shard of a ``ParallelStrategy``'s, or one process's."""
    if isinstance(trainer.strategy, ParallelStrategy):
        return trainer.strategy.gradient_norm(optimizer)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return total_norm(grads)


def _memory_parts(trainer: pl.Trainer, module: nn.Module, gradient_bytes: float) -> dict[str, float]:
    """GiB: the most any rank held since the window began (GPUs), or in its life (CPUs: that peak cannot be reset),
    and the most any rank holds of each part of the training state; the planner's estimate of each beside them."""
    strategy = trainer.strategy
    device = strategy.root_device
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
    parameters = _held_bytes(p for p in module.parameters() if not p.is_meta)  # a pipeline stage holds its own
    optimizer = _held_bytes(
        value for opt in trainer.optimizers for state in opt.state.values() for value in state.values()
    )
    held = {"peak": peak, "parameters": parameters, "gradients": gradient_bytes, "optimizer": optimizer}
    offloaded = isinstance(strategy, ParallelStrategy) and strategy.run_config["cpu_offload"]
    if device.type == "cuda" and not offloaded:  # offloaded, the parts are in CPU memory, not in the GPU's peak
        held["activations"] = peak - parameters - gradient_bytes - optimizer
    values = torch.tensor(list(held.values()), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    metrics = {f"memory/{part}_gib": value / 2**30 for part, value in zip(held, values.tolist(), strict=True)}
    planned = strategy.planned_memory if isinstance(strategy, ParallelStrategy) else None
    if planned is not None:  # on rank 0, which logs
        parts = {
            "parameters": planned.params,
            "gradients": planned.grads,
            "optimizer": planned.optimizer,
            "activations": planned.activations,
        }
        metrics |= {f"memory/planned_{part}_gib": size / 2**30 for part, size in parts.items()}
    return metrics


def _held_bytes(tensors: Iterable[Any]) -> float:
    """Bytes of this rank's share of the tensors among ``tensors``."""
    return float(sum(local_tensor(t).numel() * t.element_size() for t in tensors if isinstance(t, Tensor)))


def _pipeline_time(strategy: ParallelStrategy) -> tuple[float, float]:
    """Seconds every rank's stages computed, and seconds their schedules ran, summed over the ranks."""
    clock = strategy.pipeline_step.clock
    totals = torch.tensor([clock.busy_s, clock.scheduled_s], dtype=torch.float64, device=strategy.root_device)
    dist.all_reduce(totals)
    return totals[0].item(), totals[1].item()
