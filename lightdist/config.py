"""``ParallelConfig``: how a model is split and run besides the mesh's sizes, checked as the options are given."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightdist.layout import ParallelLayout
from lightdist.parallel.activation_checkpointing import ActivationCheckpointing
from lightdist.parallel.context import ContextParallelMethod
from lightdist.parallel.pipeline.schedules import PipelineSchedule, check_schedule, virtual_stages_of
from lightdist.parallel.sharding import ZeroStage, replicas_problem
from lightdist.parallel.tensor import TensorParallelStyle

__all__ = ["ParallelConfig"]

_MIXED_PRECISION_COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class ParallelConfig:
    """How a model is split and run, besides the mesh's sizes; ``ParallelStrategy`` takes these options by the same
    names.

    Args:
        zero_stage: What data-parallel ranks shard: 0 nothing (DDP), 1 optimizer state, 2 also gradients,
            3 also parameters.
        data_parallel_replicas: At ZeRO-2/3, the data-parallel ranks split into this many replicas, each sharding
            the model over its own ranks (HSDP: a node's GPUs, say), gradients all-reduced across replicas; it
            divides ``data_parallel_size``. 1: every data-parallel rank shards together.
        pipeline_schedule: The schedule that runs microbatches through the pipeline stages: ``"gpipe"`` (all
            forwards, then all backwards), ``"1f1b"`` (at most ``pipeline_parallel_size`` microbatches in flight),
            ``"interleaved_1f1b"`` (each rank holds ``virtual_stages`` stages, which shrinks the bubble that many
            times), ``"zero_bubble"`` (interleaved, with each backward split into its input and weight halves so the
            weight halves fill the bubble). ``"zbv"`` is refused: torch's V-shaped schedules cannot run forward-only,
            so validation and predict would fail.
        virtual_stages: Stages each pipeline rank holds under the interleaved and zero-bubble schedules (default 2);
            stage ``s`` lives on rank ``s % pipeline_parallel_size``.
        microbatches: Microbatches each data-parallel rank's batch is cut into under a pipeline (default:
            ``pipeline_parallel_size``); more shrink the pipeline's idle bubble.
        pipeline_split: Decoder blocks per pipeline stage, e.g. ``(7, 9)`` (``pipeline_parallel_size *
            virtual_stages`` entries); default: balanced by parameter count, counting the embeddings on the first
            stage and the norm and LM head on the last.
        pipeline_tracer: Cut pipeline stages with torch's tracer (``torch.distributed.pipelining.pipeline``) even
            where the blocks are in one ``nn.ModuleList``: for blocks that hand on more than one stream
            (``x, residual = block(x, residual)``) or take the hidden states by keyword. Models without a block
            ``ModuleList`` are traced anyway. Traced stages take one microbatch shape, and do not combine with tensor
            parallelism.
        activation_checkpointing: Recompute each block's activations in backward: ``"full"``, ``"selective"``
            (keep matmul and attention outputs) or ``None``.
        sequence_parallel: Under tensor parallelism, split activations between blocks along the sequence, so norms
            run on each rank's share (Megatron's sequence parallelism).
        loss_parallel: Under tensor parallelism, keep the logits split by vocabulary and compute
            ``F.cross_entropy`` from each rank's share, never gathering them. The logits reach the caller as a
            DTensor; ``F.cross_entropy`` on them (within torch's ``loss_parallel()``) returns a plain tensor.
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory (ZeRO-2/3).
        tp_plan: Module-name patterns mapped to a tensor-parallel style, overriding the discovered plan.
        compile: Compile each block with ``torch.compile`` once split, before ZeRO wraps it, so that FSDP's hooks stay
            outside the compiled graphs (torchtitan's per-block compile). Not with ``activation_checkpointing``.
        param_dtype: The compute dtype of mixed precision, which ZeRO gathers parameters in.
        expert_parallel_size: Data-parallel ranks that split each MoE layer's experts between them (``ep``, which
            divides ``data_parallel_size`` and the number of experts); tokens travel to their experts and back by
            all-to-all (``lightdist.parallel.expert_parallel``). 1: every rank holds every expert.
        context_parallel_method: How attention spans a sequence split over ``context_parallel_size`` ranks
            (``lightdist.parallel.context.attention``): ``"ring"`` gathers every rank's keys and values (any head
            count), ``"all_to_all"`` deals the heads out and gathers the sequence (DeepSpeed's Ulysses), ``"auto"`` the
            latter where the heads divide among the ranks.
        document_end_token: The token id that ends each document packed in a sequence (the tokenizer's
            ``eos_token_id``): each token attends within its own document only (``lightdist.parallel.documents``).
            ``None``: across the whole sequence.
        mask_document_end_loss: Leave out of the step's cross-entropy what each end token predicts (the next
            document's first token), as Megatron's ``--eod-mask-loss``; batches weigh by the targets kept.
    """

    zero_stage: ZeroStage = 3
    data_parallel_replicas: int = 1
    pipeline_schedule: PipelineSchedule = "1f1b"
    virtual_stages: int | None = None
    microbatches: int | None = None
    pipeline_split: tuple[int, ...] | None = None
    pipeline_tracer: bool = False
    activation_checkpointing: ActivationCheckpointing | None = None
    sequence_parallel: bool = True
    loss_parallel: bool = False
    cpu_offload: bool = False
    tp_plan: Mapping[str, TensorParallelStyle] | None = None
    compile: bool = False
    param_dtype: torch.dtype | None = None
    expert_parallel_size: int = 1
    context_parallel_method: ContextParallelMethod = "auto"
    document_end_token: int | None = None
    mask_document_end_loss: bool = False

    def __post_init__(self) -> None:
        """Refuse what cannot run, when the options are given: before any process or tensor exists."""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_stage={self.zero_stage!r} is not a ZeRO stage. Choose 0 (replicate), 1 (shard optimizer "
                "state), 2 (+ gradients) or 3 (+ parameters)."
            )
        if not isinstance(self.data_parallel_replicas, int) or self.data_parallel_replicas < 1:
            raise ValueError(f"data_parallel_replicas={self.data_parallel_replicas!r} must be a positive integer.")
        problem = replicas_problem(self.data_parallel_replicas, self.zero_stage)  # the layout checks the divisor
        if problem is not None:
            raise ValueError(problem)
        check_schedule(self.pipeline_schedule, self.virtual_stages, self.microbatches)
        if self.activation_checkpointing not in (None, "full", "selective"):
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of None, 'full', 'selective'."
            )
        if self.compile and self.activation_checkpointing is not None:
            raise ValueError(
                f"compile=True with activation_checkpointing={self.activation_checkpointing!r} is not supported: "
                "the recompute of a compiled block does not see the tensors its forward saved (measured on Hugging "
                "Face Llama blocks, torch 2.13). Choose one: compile=False, or activation_checkpointing=None."
            )
        if not isinstance(self.expert_parallel_size, int) or self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size!r} must be a positive integer.")
        if self.expert_parallel_size > 1 and self.zero_stage == 1:
            raise ValueError(
                f"zero_stage=1 with expert_parallel_size={self.expert_parallel_size}: ZeRO-1 deals whole parameters "
                "out over all data-parallel ranks, but each expert-parallel rank holds other experts. Use "
                "zero_stage=0, 2 or 3 with expert parallelism."
            )
        if self.context_parallel_method not in ContextParallelMethod.__args__:
            raise ValueError(
                f"context_parallel_method={self.context_parallel_method!r} is not one of 'auto', 'ring' (key/value "
                "blocks passed around the ranks) or 'all_to_all' (heads dealt out, the sequence gathered)."
            )
        end = self.document_end_token
        if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < 0):
            raise ValueError(f"document_end_token={end!r} must be a token id (the tokenizer's eos_token_id).")
        if end is not None and self.pipeline_tracer:
            raise ValueError(
                f"document_end_token={end} with pipeline_tracer=True: traced stages call torch's own attention and "
                "embedding operators, which lightdist cannot confine to each document. Cut stages by structure "
                "(pipeline_tracer=False), or train without document_end_token."
            )
        if self.mask_document_end_loss and end is None:
            raise ValueError(
                "mask_document_end_loss=True leaves out what each document's end token predicts, but no "
                "document_end_token is set. Set document_end_token to the tokenizer's eos_token_id."
            )
        if self.cpu_offload and self.zero_stage < 2:
            raise ValueError(
                f"cpu_offload=True needs sharded parameters and gradients, but zero_stage={self.zero_stage}. "
                "Use zero_stage=2 or 3 with cpu_offload."
            )

    @property
    def stages_per_pipeline_rank(self) -> int:
        """Stages each pipeline rank holds: one under GPipe and 1F1B, else ``virtual_stages`` (default 2)."""
        return virtual_stages_of(self.pipeline_schedule, self.virtual_stages)

    def microbatches_run(self, pp: int) -> int:
        """The microbatches each data-parallel rank's batch is cut into under ``pp`` pipeline stages: by default one a
        stage."""
        return self.microbatches or pp

    def zero_stage_run(self, pp: int) -> ZeroStage:
        """The ZeRO stage that runs: under a pipeline at most 2, since the schedules gather a stage's parameters once
        per step rather than once per microbatch (torchtitan's policy), and resharding after each forward gives the
        zero-bubble schedules wrong weight gradients."""
        return min(self.zero_stage, 2) if pp > 1 else self.zero_stage

    def with_precision(self, precision: str) -> ParallelConfig:
        """This config with the compute dtype of Lightning's ``precision`` flag, in which ZeRO gathers parameters:
        bf16 or fp16 under mixed precision, the parameters' own otherwise."""
        return dataclasses.replace(self, param_dtype=_MIXED_PRECISION_COMPUTE_DTYPES.get(precision))

    def as_run(self, layout: ParallelLayout) -> dict[str, Any]:
        """The layout and the options as they run on ``layout``, for a run's loggers: runs compared side by side must
        say how each was split."""
        pp, tp = layout.pp, layout.tp
        return {
            "world_size": layout.world_size,
            "pipeline_parallel_size": pp,
            "data_parallel_size": layout.dp,
            "data_parallel_replicas": self.data_parallel_replicas,
            "tensor_parallel_size": tp,
            "expert_parallel_size": self.expert_parallel_size,
            "context_parallel_size": layout.cp,
            "context_parallel_method": self.context_parallel_method if layout.cp > 1 else None,
            "zero_stage": self.zero_stage_run(pp),
            "pipeline_schedule": self.pipeline_schedule if pp > 1 else None,
            "virtual_stages": self.stages_per_pipeline_rank if pp > 1 else None,
            "microbatches": self.microbatches_run(pp) if pp > 1 else None,
            "sequence_parallel": self.sequence_parallel and tp > 1,
            "loss_parallel": self.loss_parallel and tp > 1,
            "activation_checkpointing": self.activation_checkpointing,
            "cpu_offload": self.cpu_offload,
            "compile": self.compile,
            "document_end_token": self.document_end_token,
            "mask_document_end_loss": self.mask_document_end_loss,
        }
