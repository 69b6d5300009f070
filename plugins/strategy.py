"""``ParallelStrategy``: one Lightning strategy for data, tensor and pipeline parallelism with ZeRO sharding.

On the mesh ``MeshStrategy`` builds (``mesh_strategy.py``), it splits the LightningModule with ``lightdist.parallelize``
and runs each step as Lightning does (every rank runs the whole step on its shards) or, under a pipeline, through the
schedule's runner (``pipeline_step.py``), which owns the step's backward as DeepSpeed's engine does. Its base
``CheckpointingStrategy`` (``checkpointing_strategy.py``) saves and loads the sharded checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightdist.checkpoint.async_checkpoint import AsyncMode
from lightdist.checkpoint.pretrained import PretrainedLoad, PretrainedWeights, check_pretrained, load_pretrained
from lightdist.checkpoint.storage import configure
from lightdist.config import ParallelConfig
from lightdist.parallel.activation_checkpointing import ActivationCheckpointing
from lightdist.parallel.context import ContextParallelMethod
from lightdist.parallel.pipeline.schedules import PipelineSchedule
from lightdist.parallel.pipeline.traced import share_model_buffers
from lightdist.parallel.sharding import ZeroStage, optimizers_for_layout
from lightdist.parallel.tensor import TensorParallelStyle
from lightdist.parallelize import ModelHolder, materialize, parallelize
from lightdist.plugins.auto_layout import LayoutRequest
from lightdist.plugins.checkpointing_strategy import CheckpointingStrategy
from lightdist.plugins.gradient_norm import GradientNorm
from lightdist.plugins.lightning_internals import skip_lightning_backward
from lightdist.plugins.metric_sync import metrics_set_aside, reduce_metrics_over, refuse_metrics_on_meta
from lightdist.plugins.non_finite import NonFiniteGuard, NonFinitePolicy, NonFiniteStep
from lightdist.plugins.options import validate_options
from lightdist.plugins.pipeline_step import PipelineStep, example_model_call, pipeline_step_over
from lightdist.plugins.replica_step import join_replica_group, step_in_quorum
from lightdist.plugins.run_header import announce_run
from lightdist.plugins.steps import Steps
from lightdist.plugins.strategy_names import STRATEGY_NAMES
from lightdist.plugins.token_weights import LossWeighting, TokenWeights
from lightdist.resilience.replica_groups import ReplicaGroups

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    from lightdist.plan.planner import Estimate

__all__ = ["ParallelStrategy"]


class ParallelStrategy(CheckpointingStrategy):
    """Train any LightningModule LLM with ZeRO/FSDP data parallelism on a ``("pp", "dp", "tp")`` DeviceMesh.

    Args:
        data_parallel_size: Ranks that see different batches; ``"auto"``: every rank the other sizes leave.
        tensor_parallel_size: Ranks that split each layer's matrices; ``"node"``: the devices of one node.
        pipeline_parallel_size: Ranks that each hold a slice of the decoder stack. With either size ``"auto"``,
            ``lightdist plan``'s estimates pick the fastest sizes that fit in memory (``docs/planner.md``).
        zero_stage, data_parallel_replicas, pipeline_schedule, virtual_stages, microbatches, pipeline_split,
        pipeline_tracer, activation_checkpointing, sequence_parallel, loss_parallel, cpu_offload, tp_plan, compile,
        expert_parallel_size, context_parallel_method, document_end_token, mask_document_end_loss: How the model is
            split and run (``ParallelConfig`` documents each).
        context_parallel_size: Ranks that split each sequence, attention still over all of it (``context_parallel``).
        pretrained, pretrained_prefix: A Hugging Face checkpoint (a path or fsspec URL, or a ``PretrainedWeights``)
            the split model is filled from, each rank reading its shards' bytes, named as the parameters under
            ``pretrained_prefix`` (``docs/pretrained.md``).
        async_checkpoint: How saves during ``fit`` upload behind training: ``"process"``, ``"thread"`` or ``None``.
        storage_options: fsspec options per protocol for checkpoint URLs, e.g. ``{"s3": {"endpoint_url": ...}}``;
            credentials are refused, as they would be saved with the config (``docs/checkpoints.md``).
        loss_weighting: How batches weigh across data-parallel ranks and an accumulation: ``"tokens"``, by their
            labelled tokens where counted (one process's mean); ``"batches"``, alike, as Lightning does.
        non_finite: What a step whose gradient norm is not finite does: ``"skip"`` it, ``"rollback"`` to the newest
            complete checkpoint, ``"stop"`` the run (``plugins/non_finite.py``), or ``None``: check nothing.
        replica_groups: Train as one of several launches that survive each other (``ReplicaGroups``, on torchft):
            each step's global batch is dealt among the groups alive, and a step a group dies in is redone.
        collective_timeout: Seconds a collective waits for the other ranks before it fails (default 1800, torch's);
            the rank that times out names the rank that stopped answering, from their heartbeats.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; default: the device's own.
    """

    strategy_name = "lightdist"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto", "node"] = 1,
        pipeline_parallel_size: int | Literal["auto"] = 1,
        zero_stage: ZeroStage = 3,
        data_parallel_replicas: int = 1,
        pipeline_schedule: PipelineSchedule = "1f1b",
        virtual_stages: int | None = None,
        microbatches: int | None = None,
        pipeline_split: list[int] | None = None,
        pipeline_tracer: bool = False,
        activation_checkpointing: ActivationCheckpointing | None = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = False,
        cpu_offload: bool = False,
        tp_plan: dict[str, TensorParallelStyle] | None = None,
        compile: bool = False,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        context_parallel_method: ContextParallelMethod = "auto",
        document_end_token: int | None = None,
        mask_document_end_loss: bool = False,
        async_checkpoint: AsyncMode | None = "process",
        pretrained: str | PretrainedWeights | None = None,
        pretrained_prefix: str = "",
        storage_options: dict[str, dict[str, Any]] | None = None,
        loss_weighting: LossWeighting = "tokens",
        non_finite: NonFinitePolicy | None = None,
        replica_groups: ReplicaGroups | None = None,
        collective_timeout: float = 1800.0,
        process_group_backend: str | None = None,
    ) -> None:
        # Each refuses what cannot run, before any process or tensor exists.
        sizes = LayoutRequest(data_parallel_size, tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
        config = ParallelConfig(
            zero_stage=zero_stage,
            data_parallel_replicas=data_parallel_replicas,
            pipeline_schedule=pipeline_schedule,
            virtual_stages=virtual_stages,
            microbatches=microbatches,
            pipeline_split=tuple(pipeline_split) if pipeline_split else None,
            pipeline_tracer=pipeline_tracer,
            activation_checkpointing=activation_checkpointing,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            cpu_offload=cpu_offload,
            tp_plan=tp_plan,
            compile=compile,
            expert_parallel_size=expert_parallel_size,
            context_parallel_method=context_parallel_method,
            document_end_token=document_end_token,
            mask_document_end_loss=mask_document_end_loss,
        )
        validate_options(
            sizes, config, async_checkpoint, storage_options, loss_weighting, non_finite, collective_timeout
        )
        super().__init__(sizes, config, collective_timeout, process_group_backend, async_checkpoint)
        configure(storage_options or {})  # now: Lightning looks for ckpt_path="last" before any strategy hook runs
        self._non_finite = NonFiniteGuard(non_finite)
        self._replica_groups = replica_groups.resolved() if replica_groups else None  # the lighthouse and name
        self.pipeline_step: PipelineStep | None = None  # runs this rank's pipeline stages; its clock times the bubble
        self._loss_weighting = loss_weighting
        self.steps: Steps | None = None  # how each of Lightning's steps runs on this layout, weighed by its tokens
        self.gradient_norm: GradientNorm | None = None  # of the whole model, over every shard and stage
        self._pretrained = PretrainedWeights(pretrained, pretrained_prefix) if type(pretrained) is str else pretrained
        self.pretrained_load: PretrainedLoad | None = None  # what this rank read of the pretrained weights
        self.planned_memory: Estimate | None = None  # the planner's, on rank 0: TrainingMonitor logs it beside its own

    @property
    def zero_stage(self) -> int:
        return self._config.zero_stage

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        # A later run of the module this strategy split (validate after fit) keeps its split, header and weights.
        first_run = self._parallelized is None or self._parallelized.model.module is not self.lightning_module
        if first_run:
            self.planned_memory = announce_run(self, trainer, self._config, self.run_config)
        refuse_metrics_on_meta(self.lightning_module)
        weights = self._pretrained or getattr(self.lightning_module, "pretrained_weights", None)  # PretrainedWeights
        weights = weights if first_run and self.launcher.ckpt_path is None else None  # a resume loads its checkpoint
        if weights is not None:
            reader = check_pretrained(self.lightning_module, weights)  # before the model takes any memory
        self.model = self._parallelize(self.lightning_module) if first_run else self._parallelized.model
        reduce_metrics_over(self.lightning_module, self.device_mesh["dp"].get_group())
        with metrics_set_aside(self.lightning_module):
            materialize(self.lightning_module, self.root_device, filled_after=weights.fills if weights else None)
        self.model = self.precision_plugin.convert_module(self.model)
        if not self._config.cpu_offload:
            self.model_to_device()
        if weights is not None:
            tied = self._parallelized.tied_heads_on(self.device_mesh)
            self.pretrained_load = load_pretrained(self.lightning_module, weights, tied, reader)
            rank_zero_info(f"lightdist: {self.pretrained_load.summary()}")
        if self._parallelized.traced_input is not None:
            share_model_buffers(self._parallelized.traced_input.module, self._parallelized.stages)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            skip_lightning_backward(trainer, self.pipeline_step is not None)
            self.replica_group = join_replica_group(self._replica_groups, self, self.steps.token_weights)
        self.setup_precision_plugin()
        self.gradient_norm = GradientNorm(self.lightning_module, self.device_mesh, self.pipeline_step)
        self.precision_plugin.clip_grad_by_norm = self.gradient_norm.clip

    @property
    def run_config(self) -> dict[str, Any]:
        """The layout this run trains under, as its loggers record it (W&B's run config, hparams.yaml)."""
        run = {"loss_weighting": self._loss_weighting, "non_finite": self._non_finite.policy}
        return self._config.as_run(self.layout) | run | {"precision": self.precision_plugin.precision}

    def _parallelize(self, module: pl.LightningModule) -> ModelHolder:
        """Split the LightningModule over the mesh (``lightdist.parallelize``); under a pipeline, steps run by it."""
        config = self._config.with_precision(self.precision_plugin.precision)
        self._parallelized = parallelize(
            module,
            self.device_mesh,
            config,
            root=ModelHolder(module),
            example_call=partial(example_model_call, module, config.microbatches_run(self.layout.pp)),
            report=rank_zero_info,
        )
        self.steps = Steps(
            module,
            self._parallelized.model,
            TokenWeights(module, self.device_mesh, self.root_device, self.context_parallel, self._loss_weighting),
            context_parallel=self.context_parallel,
            pipelined=bool(self._parallelized.stages),
            traced=self._parallelized.traced_input is not None,
            config=config,
            tensor_parallel=self.layout.tp > 1,
        )
        if self._parallelized.stages:
            self.pipeline_step = pipeline_step_over(
                module, self._parallelized, self.device_mesh, config, self.steps, self._collective_timeout
            )
        return self._parallelized.model

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        zero1 = self._config.zero_stage == 1 and not self._parallelized.sharded_by_user
        device = None if self._config.cpu_offload else self.root_device
        self.optimizers = optimizers_for_layout(self.optimizers, self.device_mesh["dp"] if zero1 else None, device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("training_step", super().training_step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("validation_step", super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("test_step", super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = self._step("predict_step", super().predict_step, *args, **kwargs)
        return self.context_parallel.whole_sequences(output) if self.context_parallel else output

    def _step(self, name: str, lightning_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's step ``name``, or under a pipeline the schedule's run of it (``steps.py``), on this replica
        group's share of a training batch."""
        if name == "training_step" and self.replica_group is not None:
            args = (self.replica_group.deal(args[0]), *args[1:])
        if self.pipeline_step is None:
            return self.steps.run(name, lambda batch: lightning_step(batch, *args[1:], **kwargs), args[0])
        run = partial(self.pipeline_step.run, name, optimizers=self.optimizers, precision=self.precision_plugin)
        return self.steps.run(name, lambda batch: run(batch, args[1]), args[0])

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with self.steps.loss_context():
            return super().backward(self.steps.token_weights.for_backward(closure_loss), optimizer, *args, **kwargs)

    @override
    def block_backward_sync(self) -> AbstractContextManager:
        return self.steps.gradients_held()

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Step on the gradient of the mean over the accumulation's tokens (``token_weights.py``) once a checkpoint
        save in flight has copied the state: the copy overlaps the forward and backward of ``closure``."""

        def closure_then_wait_for_staging() -> Any:
            loss = closure()
            self.steps.token_weights.scale_gradients(optimizer, self.lightning_module.trainer.accumulate_grad_batches)
            if self.replica_group is not None:
                self.replica_group.average_gradients(self.lightning_module.parameters())
            self._non_finite.check(lambda: self.gradient_norm(optimizer), loss, self.lightning_module)
            self.checkpoint_io.wait_for_staging()
            return loss

        attempt = partial(super().optimizer_step, optimizer, closure_then_wait_for_staging, model, **kwargs)
        try:
            return step_in_quorum(self.replica_group, attempt, optimizer, self.checkpoint_io)
        except NonFiniteStep as event:
            optimizer.zero_grad(set_to_none=True)
            self._non_finite.after_skipped_step(event, self.lightning_module.trainer, roll_back=self.roll_back)
            return None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, (description, options) in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=f"lightdist: {description}", **options)
