"""The lines a run opens with, on rank 0: how the model is split, what each rank holds, and where checkpoints and
logs go. Everything else the run prints is Lightning's progress bar, or something that went wrong."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightdist.config import ParallelConfig
from lightdist.parallel.context import auto_method
from lightdist.parallel.expert_parallel import find_experts
from lightdist.parallel.tensor import model_attention_heads
from lightdist.plan.planner import Estimate, GiB
from lightdist.plugins.auto_layout import planned_layout
from lightdist.plugins.token_weights import weighing_rule

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightdist.layout import ParallelLayout
    from lightdist.plugins.checkpointing_strategy import CheckpointingStrategy

__all__ = ["announce_run", "run_header"]


def announce_run(
    strategy: CheckpointingStrategy, trainer: pl.Trainer, config: ParallelConfig, run: dict[str, Any]
) -> Estimate | None:
    """Print the run's header on rank 0 and record how it is split (``run``, the strategy's ``run_config``) in every
    logger, from the whole module: call it
    before the module is split, which the planner's run on fake tensors and the count of its parameters need. Returns
    the planner's estimate of the most loaded rank's memory on rank 0, where the module declares its batch's size;
    ``None`` elsewhere."""
    parameters = sum(p.numel() for p in strategy.lightning_module.parameters())
    estimate = None
    if trainer.is_global_zero:
        estimate, why_not = _planned_memory(strategy, config)
        rank_zero_info(run_header(strategy, trainer, run, parameters, estimate, why_not))
    for logger in trainer.loggers:
        logger.log_hyperparams({"lightdist": {**run, "parameters": parameters}})
    return estimate


def run_header(
    strategy: CheckpointingStrategy,
    trainer: pl.Trainer,
    run: dict[str, Any],
    parameters: int,
    estimate: Estimate | None,
    why_not: str = "",
) -> str:
    """The header of ``trainer``'s run split as ``run`` says, from the whole module of ``parameters`` elements and the
    planner's ``estimate`` of its memory (or why there is none)."""
    module, layout = strategy.lightning_module, strategy.layout
    device = "GPU" if strategy.root_device.type == "cuda" else f"{strategy.root_device.type.upper()} rank"
    experts = find_experts(module)
    active = ""
    if experts is not None and experts.top_k:
        active = f" ({_count(parameters - experts.idle_parameters(module))} active per token)"
    lines = [
        f"lightdist: {type(module).__name__}, {_count(parameters)} parameters{active}, on {layout.world_size} "
        f"{device}{'s' if layout.world_size > 1 else ''} as {layout}, ZeRO-{run['zero_stage']}"
        + (f" in {run['data_parallel_replicas']} replicas (HSDP)" if run["data_parallel_replicas"] > 1 else "")
    ]
    split = []
    if layout.cp > 1:
        split.append(f"each sequence split over {layout.cp} ranks (attention: {_attention(module, run, layout)})")
    if run["expert_parallel_size"] > 1:
        split.append(f"experts split over {run['expert_parallel_size']} data-parallel ranks")
    if layout.pp > 1:
        split.append(f"{run['pipeline_schedule']} schedule, {run['microbatches']} microbatches per batch")
        if run["virtual_stages"] > 1:
            split.append(f"{run['virtual_stages']} stages per rank")
    split += [name.replace("_", " ") for name in ("sequence_parallel", "loss_parallel", "compile") if run[name]]
    if run["activation_checkpointing"]:
        split.append(f"{run['activation_checkpointing']} activation checkpointing")
    if run["document_end_token"] is not None:
        split.append(f"attention within each document (ended by token {run['document_end_token']})")
        if run["mask_document_end_loss"]:
            split.append("what each end token predicts left out of the loss")
    if split:
        lines.append("  " + ", ".join(split))
    if layout.dp > 1 or trainer.accumulate_grad_batches > 1:  # where batches weigh against each other
        masked = run["mask_document_end_loss"]
        lines.append("  " + weighing_rule(module, run["loss_weighting"], cp=layout.cp, end_loss_masked=masked))
    lines += _memory(estimate, why_not) + _destinations(trainer, strategy)
    return "\n".join(lines)


def _attention(module: pl.LightningModule, run: dict[str, Any], layout: ParallelLayout) -> str:
    """How attention spans a split sequence: the method given, or the one ``"auto"`` picks from the model's heads."""
    method = run["context_parallel_method"]
    if method != "auto":
        return method
    heads = model_attention_heads(module)
    return method if heads is None else f"{auto_method(heads.heads // layout.tp, layout.cp)}, auto"


def _planned_memory(strategy: CheckpointingStrategy, config: ParallelConfig) -> tuple[Estimate | None, str]:
    """The planner's estimate of the most loaded rank's memory under the run's layout, or why there is none."""
    layout = strategy.layout
    try:
        _, estimate = planned_layout(
            strategy.lightning_module,
            world_size=layout.world_size,
            devices_per_node=strategy.num_processes,
            device=strategy.root_device,
            pp=layout.pp,
            dp=layout.dp,
            tp=layout.tp,
            config=config,
            cp=layout.cp,
        )
    except Exception as error:  # the header must not stop a run: no seq_len and batch_size, a model it cannot trace
        # The first line whole, which says what to add: the rest may list every module the planner saw.
        return None, (str(error) or type(error).__name__).splitlines()[0]
    return estimate, ""


def _memory(estimate: Estimate | None, why_not: str) -> list[str]:
    if estimate is None:
        return [f"  memory per rank: not estimated ({why_not})"]
    parts = ", ".join(
        f"{name} {_size(size)}"
        for name, size in (
            ("parameters", estimate.params),
            ("gradients", estimate.grads),
            ("optimizer", estimate.optimizer),
            ("activations", estimate.activations),
        )
    )
    return [f"  memory per rank, planned: {_size(estimate.total)} ({parts})"]


def _destinations(trainer: pl.Trainer, strategy: CheckpointingStrategy) -> list[str]:
    lines = []
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            background = strategy.checkpoint_io.async_checkpoint
            how = f"uploaded behind training ({background})" if background else "saved before training goes on"
            lines.append(f"  checkpoints: {callback.dirpath}, {how}")
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            lines.append(f"  W&B: {_wandb_run(logger)}")
    return lines


def _wandb_run(logger: WandbLogger) -> Any:
    run = logger.experiment
    return f"offline, in {run.dir} (upload it with `wandb sync`)" if run.offline else run.url


def _size(size: float) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB / 10 else f"{size / 2**20:.1f} MiB"


def _count(parameters: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= size:
            return f"{parameters / size:.1f}{unit}"
    return str(parameters)
