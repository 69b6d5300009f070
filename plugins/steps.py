"""Each of Lightning's steps as ``ParallelStrategy`` runs it, and the backward that follows a training step.

A step runs on the rank's batch, or under context parallelism on its share of each of the batch's sequences (after
the step of each kind has shown, at its first run, that it computes the whole sequences' loss and gradients that way:
``lightdist.parallel.context.check``; under a pipeline too, unless its stages were traced from a rank's share), under
a pipeline through the schedule; its loss is weighed by its labelled tokens (``token_weights.py``), and computed under
loss parallelism where asked, its attention within each packed document where the documents' end token is given
(``lightdist.parallel.documents``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from lightdist.config import ParallelConfig
from lightdist.parallel.context import ContextParallel, check_split_step, parameters_of, probe_prefix, tolerance
from lightdist.parallel.documents import DocumentMasks, check_end_token, within_documents
from lightdist.parallel.loss_parallel import vocab_parallel_cross_entropy
from lightdist.plugins.metric_sync import load_metric_states, metric_states, metrics_of
from lightdist.plugins.token_weights import TokenWeights, logging_to

__all__ = ["Steps", "unseen"]


class Steps:
    """Runs ``module``'s steps on ``model`` (the FSDP root that holds it), each weighed by ``token_weights``.

    Args:
        context_parallel: Splits each sequence of a step's batch over its ranks, where given.
        pipelined: Whether a pipeline's schedule runs the steps (it runs backward and reduces gradients itself).
        traced: Whether the pipeline's stages were traced, from a rank's share of a batch: they run no other shape.
        config: How the model is split and run: loss parallelism (where ``tensor_parallel``), the compute dtype
            (which bounds the rounding a check of the split allows), the documents' end token and whether what it
            predicts is left out of the loss.
    """

    def __init__(
        self,
        module: LightningModule,
        model: FSDPModule,
        token_weights: TokenWeights,
        *,
        context_parallel: ContextParallel | None,
        pipelined: bool,
        traced: bool,
        config: ParallelConfig,
        tensor_parallel: bool,
    ) -> None:
        self.module, self.model, self.token_weights = module, model, token_weights
        self.documents = None
        if config.document_end_token is not None:
            check_end_token(config.document_end_token, module.trainer.datamodule)
            self.documents = DocumentMasks(config.document_end_token, config.mask_document_end_loss, module)
            if context_parallel is not None:
                context_parallel.attend_within(self.documents)
        if config.mask_document_end_loss:
            token_weights.countable = True  # the step's cross-entropy counts the targets it keeps
        self.context_parallel, self.pipelined = context_parallel, pipelined
        self.loss_parallel = config.loss_parallel and tensor_parallel
        self._rtol = tolerance(config.param_dtype or torch.float32)
        checked = context_parallel is not None and not traced  # traced stages take a rank's share alone
        self._unchecked = {"training_step", "validation_step", "test_step"} if checked else set()
        self._gradient_sync = True

    def run(self, name: str, step: Callable[[Any], Any], batch: Any) -> Any:
        """Lightning's step ``name``, which ``step`` runs on a batch, on ``batch``."""
        if self.documents is not None:
            self.documents.see(batch)
        if self.context_parallel is not None:
            if name in self._unchecked:
                self._unchecked.discard(name)
                self._check(name, step, batch)
            batch = self.context_parallel.shard_batch(batch)
        with self.loss_context():
            output = self.token_weights.step(name, batch, partial(self._counted, name, step, batch))
        if self.documents is not None:
            self.documents.check_attended()
        return output

    def _counted(self, name: str, step: Callable[[Any], Any], batch: Any) -> Any:
        """``step`` on ``batch``, its tokens counted where the documents' loss leaves some out (a pipeline counts its
        microbatches' itself)."""
        counting = self.documents is not None and self.documents.mask_end_loss and not self.pipelined
        if counting:
            self.documents.loss_counts.clear()  # a check runs the step twice, whole and split
        output = step(batch)
        if counting:
            self.token_weights.count(self.documents.loss_tokens(name))
        return output

    def loss_context(self, *, split: bool = True) -> ExitStack:
        """What a step's loss and its backward run under: attention within each document, context parallelism's
        positions and attention (where ``split``), and the loss of logits split by vocabulary, as asked."""
        stack = ExitStack()
        if self.documents is not None:
            stack.enter_context(self.documents.active())
        if split and self.context_parallel is not None:
            stack.enter_context(self.context_parallel.active())
        if self.loss_parallel:
            stack.enter_context(vocab_parallel_cross_entropy())
        return stack

    @contextmanager
    def gradients_held(self) -> Iterator[None]:
        """Gradients kept on each rank, not reduced, through the non-final batches of an accumulation; under a
        pipeline the schedule reduces them once, after each batch's last microbatch."""
        if self.pipelined:
            yield
            return
        self.model.set_requires_gradient_sync(False)
        self._gradient_sync = False
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
            self._gradient_sync = True

    def _check(self, name: str, step: Callable[[Any], Any], batch: Any) -> None:
        """Step ``name`` on a prefix of ``batch``, whole and split over the context-parallel ranks, must compute the
        same loss and gradients. Run as an evaluation (dropout off), logging nothing, with the random state, the
        metrics' states and the gradients as they were found."""

        def counted(batch: Any) -> tuple[Tensor | None, Tensor | int | None]:
            output, tokens = self.token_weights.counted(batch, partial(self._counted, name, step, batch))
            return _loss_in(output), tokens

        trains = name == "training_step" and self.module.automatic_optimization
        if name == "training_step" and not trains:
            return  # a manual step steps its optimizers: it cannot run twice unseen
        probe = probe_prefix(batch, self.context_parallel.size, every_example=self.pipelined)
        with (
            unseen(self.module),
            self._synced(),
            self.token_weights.set_aside(),
            within_documents(self.documents, probe),
        ):
            check_split_step(
                self.context_parallel,
                counted,
                probe,
                parameters_of(self.module) if trains else None,
                rtol=self._rtol,
                step_name=f"{type(self.module).__name__}.{name}",
                around=partial(self.loss_context, split=False),
                backward_in_step=self.pipelined,
            )

    @contextmanager
    def _synced(self) -> Iterator[None]:
        """The check's gradients reduced, within an accumulation too (a pipeline's schedule reduces them itself)."""
        if self.pipelined:
            yield
            return
        self.model.set_requires_gradient_sync(True)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(self._gradient_sync)


def _loss_in(output: Any) -> Tensor | None:
    if isinstance(output, Mapping):
        output = output.get("loss")
    return output if isinstance(output, Tensor) and output.dim() == 0 else None


@contextmanager
def unseen(module: LightningModule) -> Iterator[None]:
    """Within, ``module`` runs as an evaluation (dropout off) and logs nothing; after, its modules' modes, its
    metrics' states and the random state are as before."""
    modes = {submodule: submodule.training for submodule in module.modules()}
    metrics = metrics_of(module)
    states = metric_states(metrics)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    module.eval()
    try:
        with torch.random.fork_rng(devices=devices), logging_to(module, lambda *args, **kwargs: None):
            yield
    finally:
        for submodule, training in modes.items():
            submodule.training = training
        load_metric_states(metrics, states)
