"""A pipeline proves itself on the user's step, at its first training step, against a whole copy of the model.

Stages cut by structure run what the model's forward does inside its block loop, and refuse what they see go wrong
(``lightdist.parallel.pipeline.structural``). Two things they cannot see train differently from one process without an
error: a forward that uses, after its blocks, a tensor computed before them (the last stage holds a stand-in for it),
and a step whose loss over a batch is not its microbatches' losses weighed as the pipeline weighs them (a mean over
tokens lightdist cannot count weighs the microbatches alike, where one process weighs their tokens). So at the first
training step, on a few examples of its batch (those whose labelled tokens differ most), the pipeline runs the step as
an evaluation, and the last stage runs it on a whole copy of the model holding the stages' weights
(``lightdist.parallel.pipeline.whole_copy``): once over all the examples and once per microbatch, for the loss and the
gradients. At initialization every token's loss is alike, so a mean weighed wrong shows in the gradients only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightdist.dataflow import cloned
from lightdist.parallel.documents import DocumentMasks, within_documents
from lightdist.parallel.expert_parallel import moe_blocks
from lightdist.parallel.loss_tokens import IGNORE_INDEX
from lightdist.parallel.pipeline.microbatches import cut_batch, examples_in
from lightdist.parallel.pipeline.whole_copy import load_stage_weights
from lightdist.plugins.steps import unseen
from lightdist.plugins.token_weights import TokenWeights

__all__ = ["Pipeline", "PipelineCheck", "probe_examples"]


def probe_examples(batch: Any, count: int) -> Any:
    """``count`` examples of ``batch``, one per microbatch: where it has ``labels``, those with the most and the fewest
    labelled tokens in turn, else the first."""
    examples = examples_in(batch)
    order = torch.arange(examples)
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, Tensor) and labels.dim() == 2 and labels.size(0) == examples:
        by_tokens = (labels != IGNORE_INDEX).sum(1).cpu().argsort(stable=True)
        order = torch.stack([by_tokens.flip(0), by_tokens], 1).flatten()  # most, fewest, second most, ...
    kept = order[:count]

    def cut(tensor: Tensor) -> Tensor:
        if tensor.dim() == 0 or tensor.size(0) != examples:
            return tensor
        return tensor.index_select(0, kept.to(tensor.device))

    return apply_to_collection(batch, Tensor, cut)


class Pipeline(Protocol):
    """What the check reads of the ``PipelineStep`` it checks, which imports this module."""

    module: LightningModule
    microbatches: int
    pp_group: dist.ProcessGroup
    last_stage: int  # the pp group's rank of the last stage
    shares: Tensor  # each microbatch's share of the batch's loss
    token_weights: TokenWeights
    documents: DocumentMasks | None  # the step's packed documents, where attention stops

    def __call__(self, step_name: str, batch: Any, batch_idx: int, *, train: bool) -> Tensor: ...


class PipelineCheck:
    """At the first training step, on a probe of its batch, two comparisons against ``whole`` (the copy the last stage
    keeps; ``None`` on other ranks), each within ``rtol``: the pipeline's loss against the step's on the whole model,
    and the gradients of the step over the probe against its microbatches' gradients weighed as the pipeline weighs
    them (a loss the pipeline cannot weigh by its tokens shows there, even where every token's loss is alike)."""

    def __init__(self, whole: nn.Module | None, rtol: float) -> None:
        self.whole, self.rtol = whole, rtol

    def __call__(self, pipeline: Pipeline, batch: Any) -> None:
        """A collective of every rank: each raises where any pipeline differs from its whole copy."""
        module = pipeline.module
        cut_batch(batch, pipeline.microbatches)  # a batch that cannot be cut is refused as training refuses it
        probe = probe_examples(batch, pipeline.microbatches)
        verdict = None
        with unseen(module), pipeline.token_weights.set_aside():
            with torch.no_grad():
                load_stage_weights(self.whole, module, pipeline.pp_group, pipeline.last_stage)
                pipelined = pipeline("training_step", cloned(probe), 0, train=False)
            if self.whole is not None:
                with _holding(module, self.whole.to(module.device)):
                    verdict = self._verdict(pipeline, probe, pipelined)
        self.whole = None  # its memory back
        verdicts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
        if message := next((verdict for verdict in verdicts if verdict is not None), None):
            raise ValueError(message)

    def _verdict(self, pipeline: Pipeline, probe: Any, pipelined: Tensor) -> str | None:
        """What differs, checked in turn: the step over the probe against its microbatches weighed as the pipeline
        weighs them, both on the whole model (not for a mixture of experts, whose load-balancing loss is over each
        microbatch's tokens, as over each data-parallel rank's); then the pipeline's loss against the weighed
        microbatches'."""
        module, name = pipeline.module, f"{type(pipeline.module).__name__}.training_step"
        stages, examples = dist.get_world_size(pipeline.pp_group), pipeline.microbatches
        weights = [p for p in module.parameters() if p.requires_grad]
        with within_documents(pipeline.documents, probe):
            whole, whole_grads = _loss_and_gradients(module, probe, weights)
        weighed = torch.zeros((), device=whole.device)
        weighed_grads = [torch.zeros_like(weight) for weight in weights]
        for share, microbatch in zip(pipeline.shares, cut_batch(probe, examples), strict=True):
            with within_documents(pipeline.documents, microbatch):
                loss, grads = _loss_and_gradients(module, microbatch, weights)
            weighed += share * loss
            for total, grad in zip(weighed_grads, grads, strict=True):
                total.add_(grad, alpha=float(share))
        gap = max(_relative(weighed, whole), _relative(_flat(weighed_grads), _flat(whole_grads)))
        routed = bool(moe_blocks(module))  # a router's balancing loss is over each microbatch's tokens, by design
        if not gap <= self.rtol and not routed:
            return (
                f"Under pipeline_parallel_size={stages}, {name} on {examples} examples of its first batch does not "
                f"compute what its microbatches compute weighed as the pipeline weighs them (loss or gradients "
                f"{gap:.1e} apart): the run would train differently from one process. Its loss is likely a mean over "
                "tokens lightdist cannot count, so the microbatches weigh alike: give the LightningModule a "
                "`loss_tokens(batch)` that returns their count (or compute the loss with a Hugging Face model's "
                "`labels=`). A loss that is no weighted sum of its examples' cannot be pipelined: train with "
                "pipeline_parallel_size=1."
            )
        if not _relative(pipelined, weighed) <= self.rtol:
            return (
                f"Under pipeline_parallel_size={stages}, {name} computes a loss of {pipelined.item():.7g} on "
                f"{examples} examples of its first batch, where it computes {weighed.item():.7g} on the whole model "
                f"({_relative(pipelined, weighed):.1e} apart): the run would train differently from one process. The "
                "model's forward uses after its blocks something it computed before them, which the pipeline's last "
                "stage does not hold: keep it inside the block loop, or train with pipeline_parallel_size=1."
            )
        return None


def _loss_and_gradients(module: LightningModule, batch: Any, weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """The step's loss on ``batch`` and its gradients of ``weights``."""
    with torch.enable_grad():
        result = type(module).training_step(module, cloned(batch), 0)
        loss = result["loss"] if isinstance(result, Mapping) else result
        grads = torch.autograd.grad(loss, weights, allow_unused=True)
    zeros = [torch.zeros_like(weight) if grad is None else grad for weight, grad in zip(weights, grads, strict=True)]
    return loss.detach().float(), zeros


@contextmanager
def _holding(module: nn.Module, whole: nn.Module) -> Iterator[None]:
    """Within, ``module`` holds ``whole``'s modules in place of its own: its step runs on the whole model."""
    own = dict(module.named_children())
    for name, child in whole.named_children():
        setattr(module, name, child)
    try:
        yield
    finally:
        for name, child in own.items():
            setattr(module, name, child)


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([tensor.flatten() for tensor in tensors])


def _relative(value: Tensor, reference: Tensor) -> float:
    return float((value.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30))
