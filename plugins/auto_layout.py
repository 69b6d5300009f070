"""The layout a run trains under: the sizes given, or for ``"auto"`` sizes the planner's pick for the model and batch.

Given sizes are checked against the world size as soon as the Trainer knows its devices, before any process starts.
``"auto"`` sizes are picked once the processes have started and before any parameter is split, from the model's own
shapes (a model built in ``configure_model`` is built early, on the meta device), the batch it will be given, and the
memory of the devices. Where the planner would be wrong the user still decides: any size given as a number is kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr

from lightdist.config import ParallelConfig
from lightdist.layout import ParallelLayout
from lightdist.parallel.pipeline.schedules import check_microbatch_rounds
from lightdist.plan.planner import Cluster, Estimate, GiB, ModelShape, choose_layout
from lightdist.plan.throughput import device_peak_flops

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LayoutRequest", "device_memory_gib", "planned_layout"]


@dataclass(frozen=True)
class LayoutRequest:
    """The parallel sizes as the user gave them: numbers, ``"auto"`` (the planner picks), or for tensor parallelism
    ``"node"`` (one node's devices: it needs the fastest links)."""

    dp: int | Literal["auto"]
    tp: int | Literal["auto", "node"]
    pp: int | Literal["auto"]
    cp: int = 1

    def __post_init__(self) -> None:
        for name, size, words in (
            ("data_parallel_size", self.dp, ("auto",)),
            ("tensor_parallel_size", self.tp, ("auto", "node")),
            ("pipeline_parallel_size", self.pp, ("auto",)),
            ("context_parallel_size", self.cp, ()),
        ):
            if size not in words and (not isinstance(size, int) or size < 1):
                raise ValueError(f"{name}={size!r} must be a positive integer{''.join(f' or {w!r}' for w in words)}.")

    @property
    def planned(self) -> bool:
        """Whether the planner picks the sizes, which needs the model: once the processes have started."""
        return "auto" in (self.tp, self.pp)

    def resolve(self, world_size: int, world_from: str, devices_per_node: int) -> ParallelLayout:
        """The layout of given sizes on ``world_size`` ranks (which ``world_from`` sets), ``dp="auto"`` filled in."""
        return ParallelLayout.resolve(
            world_size,
            data_parallel_size=self.dp,
            tensor_parallel_size=self._tp(devices_per_node),
            pipeline_parallel_size=self.pp,
            world_from=world_from,
            context_parallel_size=self.cp,
        )

    def plan(
        self,
        module: pl.LightningModule,
        *,
        world_size: int,
        devices_per_node: int,
        device: torch.device,
        config: ParallelConfig,
    ) -> tuple[ParallelLayout, str]:
        """The planner's layout for ``module``, the given sizes held, and the line that says why it was chosen."""

        def given(size: int | str) -> int | None:
            return None if size == "auto" else size

        layout, choice = planned_layout(
            module,
            world_size=world_size,
            devices_per_node=devices_per_node,
            device=device,
            pp=given(self.pp),
            dp=given(self.dp),
            tp=given(self._tp(devices_per_node)),
            config=config,
            cp=self.cp,
        )
        check_microbatch_rounds(config.pipeline_schedule, config.microbatches, layout.pp)
        return layout, (
            f"lightdist: the planner chose {layout} for the 'auto' sizes: about {choice.total / GiB:.2f} GiB per "
            f"device, the most tokens per second of the layouts that fit (`lightdist plan --gpus {world_size}` "
            "explains the estimate)."
        )

    def _tp(self, devices_per_node: int) -> int | Literal["auto"]:
        return devices_per_node if self.tp == "node" else self.tp


def planned_layout(
    module: pl.LightningModule,
    *,
    world_size: int,
    devices_per_node: int,
    device: torch.device,
    pp: int | None,
    dp: int | None,
    tp: int | None,
    config: ParallelConfig,
    cp: int = 1,
) -> tuple[ParallelLayout, Estimate]:
    """The layout that trains ``module`` fastest within its devices' memory, split as ``config`` says, the sizes not
    ``None`` held, each sequence split over ``cp`` ranks."""
    if not any(True for _ in module.parameters()):
        # Lightning asks the hook to be idempotent: its own call finds the layers built, on the meta device, and the
        # strategy materializes them once split, as after `trainer.init_module(empty_init=True)`.
        trainer = module.trainer
        with (
            torch.device("meta"),
            trainer.strategy.tensor_init_context(),
            trainer.strategy.model_sharded_context(),
            trainer.precision_plugin.module_init_context(),
        ):
            module.configure_model()
    seq_len, batch_size = (_batch_dimension(module, name) for name in ("seq_len", "batch_size"))
    peak = device_peak_flops(device)
    cluster = Cluster(
        world_size,
        gpus_per_node=devices_per_node,
        memory_gib=device_memory_gib(device, devices_per_node),
        device="GPU" if device.type == "cuda" else f"{device.type.upper()} rank",
        **({"peak_tflops": peak / 1e12} if peak is not None else {}),
    )
    choice = choose_layout(
        ModelShape(module, config.tp_plan),
        cluster,
        seq_len=seq_len,
        batch_per_replica=batch_size,
        precision=_planned_precision(module.trainer.precision),
        zero_stage=config.zero_stage,
        activation_checkpointing=config.activation_checkpointing,
        pp=pp,
        dp=dp,
        tp=tp,
        microbatches=config.microbatches,
        stages_per_rank=config.stages_per_pipeline_rank,
        ep=config.expert_parallel_size,
        replicas=config.data_parallel_replicas,
        cp=cp,
    )
    return ParallelLayout(pp=choice.layout.pp, dp=choice.layout.dp, tp=choice.layout.tp, cp=cp), choice


def device_memory_gib(device: torch.device, local_ranks: int) -> float:
    """What one rank may fill: its GPU's memory, or its share of the machine's memory on CPU ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GiB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local_ranks / GiB


def _batch_dimension(module: pl.LightningModule, name: Literal["seq_len", "batch_size"]) -> int:
    """Found where Lightning's batch-size finder looks: the module, its hparams, the data module and its hparams."""
    value = lightning_getattr(module, name) if lightning_hasattr(module, name) else None
    if value is None:  # a global batch is not enough: its share per rank depends on the layout being picked
        raise ValueError(
            f"Memory is planned, and 'auto' parallel sizes picked, for the batch each rank holds, but neither "
            f"{type(module).__name__} nor its data module gives a `{name}` attribute or hyperparameter. Add `seq_len` "
            "(tokens per sample) and `batch_size` (samples per data-parallel rank); 'auto' sizes need them, where "
            "given sizes train without."
        )
    return int(value)


def _planned_precision(precision: str) -> Literal["bf16-mixed", "32-true"]:
    """The planner's two byte counts: 16-bit compute (mixed or true) or 32-bit."""
    return "bf16-mixed" if "16" in str(precision) else "32-true"
