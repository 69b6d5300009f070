"""``"auto"`` sizes: the planner picks the pipeline, data and tensor parallel sizes for the model and batch at hand.

Picked once the processes have started and before any parameter is split, from the model's own shapes (a model built
in ``configure_model`` is built early, on the meta device), the batch it will be given, and the memory of the devices.
Where the planner would be wrong the user still decides: any size given as a number is kept.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

import torch
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr

from lightdist.layout import ParallelLayout
from lightdist.parallelize import ParallelConfig
from lightdist.planner import Cluster, Estimate, GiB, ModelShape, choose_layout
from lightdist.throughput import device_peak_flops

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["device_memory_gib", "planned_layout"]


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
) -> tuple[ParallelLayout, Estimate]:
    """The layout that trains ``module`` fastest within its devices' memory, split as ``config`` says, the sizes not
    ``None`` held."""
    if not any(True for _ in module.parameters()):
        # Lightning asks the hook to be idempotent: its own call finds the layers built, on the meta device, and the
        # strategy materializes them once split, as after `trainer.init_module(empty_init=True)`.
        with torch.device("meta"):
            call._call_configure_model(module.trainer)
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
    )
    return ParallelLayout(pp=choice.layout.pp, dp=choice.layout.dp, tp=choice.layout.tp), choice


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
            f"'auto' parallel sizes are picked for the batch each rank holds, but neither {type(module).__name__} nor "
            f"its data module gives a `{name}` attribute or hyperparameter. Add `seq_len` (tokens per sample) and "
            "`batch_size` (samples per data-parallel rank), or set tensor_parallel_size and pipeline_parallel_size."
        )
    return int(value)


def _planned_precision(precision: str) -> Literal["bf16-mixed", "32-true"]:
    """The planner's two byte counts: 16-bit compute (mixed or true) or 32-bit."""
    return "bf16-mixed" if "16" in str(precision) else "32-true"
