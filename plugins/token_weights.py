"""Each data-parallel rank's batch, and each batch of a gradient accumulation, weighed by its labelled tokens.

One process stepping on a global batch of padded documents averages its loss over all the batch's labelled tokens.
Split over data-parallel ranks, each rank averages over its own tokens and the ranks' gradients are averaged alike;
under ``accumulate_grad_batches`` Lightning averages the batches' losses alike too. That is a mean of means, not the
global batch's mean, wherever ranks or batches hold different numbers of tokens. Where lightdist can count a step's
tokens (``lightdist.parallel.loss_tokens``: a Hugging Face causal LM called with ``labels=``, or the module's own
``loss_tokens(batch)``; under context parallelism, the labels of the step's one mean cross-entropy), it weighs by
them, as Megatron and transformers' ``num_items_in_batch`` do:

- the loss a training step returns, and each mean a step logs with ``sync_dist=True``, become the rank's share of the
  global batch's: its own, times its tokens' share of the global batch's, times the data-parallel size. Lightning's
  mean over the ranks is then the global batch's mean;
- backward runs on each batch's loss weighted by its tokens, relative to those of the accumulation's first global
  batch (which keeps the scale of an unweighted loss). Once the accumulation's last batch has run, the gradients are
  scaled once, so that the optimizer steps on the gradient of the mean over every token the accumulation saw.

Where a rank cannot count a batch's tokens, the ranks' batches weigh alike, as Lightning weighs them. With
``LossWeighting`` ``"batches"``, data-parallel ranks' batches and accumulated batches weigh alike too, each its own
mean, as Lightning's DDP and accumulation weigh them, where a run is compared with one trained by Lightning alone; the
pieces of one batch (a pipeline's microbatches, context parallelism's shares of its sequences) still weigh by their
tokens, so that a batch's loss is the one its step computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightdist.parallel.context import ContextParallel
from lightdist.parallel.loss_tokens import is_causal_lm, labelled_tokens
from lightdist.resilience.replica_groups import ReplicaGroup

__all__ = ["LossWeighting", "TokenWeights", "logging_to", "weighing_rule"]

_MEANS = ("mean", torch.mean)
LossWeighting = Literal["tokens", "batches"]


class TokenWeights:
    """Weighs ``module``'s steps by their labelled tokens over the ``mesh``'s data-parallel ranks, counted from the
    module's calls of Hugging Face causal LMs (a pipeline counts its microbatches' itself), its ``loss_tokens``, or
    ``context_parallel``'s count of the step's cross-entropy."""

    def __init__(
        self,
        module: LightningModule,
        mesh: DeviceMesh,
        device: torch.device,
        context_parallel: ContextParallel | None = None,
        weighing: LossWeighting = "tokens",
    ) -> None:
        self.module, self.device, self.context_parallel = module, device, context_parallel
        self.batches_alike = weighing == "batches"
        if self.batches_alike:  # only a batch's shares of its sequences weigh by their tokens
            self.group = context_parallel.group if context_parallel else None
            self.ranks = context_parallel.size if context_parallel else 1
        else:
            self.group, self.ranks = mesh["dp"].get_group(), mesh["dp"].size()
        causal_lms = [model for model in module.modules() if is_causal_lm(model)]
        self.countable = _countable(module, split=context_parallel is not None)
        self._tokens: Tensor | int | None = None  # this rank's count for the step, once known
        self._called: list[Tensor] | None = None  # while a step runs: the labelled tokens of each call with labels
        self._shared: tuple[Tensor, Tensor, Tensor] | None = None  # the step's share, global tokens, unknown
        self._backward_scale: Tensor | None = None  # a training step's loss weight in backward, over its share
        self._window: list[tuple[Tensor, Tensor]] = []  # the accumulation's global tokens and unknown, per batch
        self.replica_group: ReplicaGroup | None = None  # where the global batch is dealt among replica groups
        if mesh["pp"].size() == 1:
            for model in causal_lms:
                model.register_forward_pre_hook(self._count_call, with_kwargs=True)

    def step(self, step_name: str, batch: Any, run: Callable[[], Any]) -> Any:
        """``run``, Lightning's ``step_name`` on ``batch``, with its sync_dist means and a training step's loss
        weighed by this rank's share of the global batch's tokens."""
        if not self.countable or step_name == "predict_step":
            return run()
        self._tokens, self._called, self._shared, self._backward_scale = None, [], None, None
        deferred: list[tuple[str, Any, dict[str, Any]]] = []
        with self._deferring_means(deferred):
            output = run()
        share, _, _ = self._share(batch)
        for name, value, options in deferred:
            self.module.log(name, _weighed(value, share), **options)
        self._called = None
        if step_name != "training_step" or not self.module.automatic_optimization:
            return output
        if self._backward_scale is None:
            self._join_accumulation(batch)
        if isinstance(output, Mapping) and "loss" in output:
            return {**output, "loss": _weighed(output["loss"], share)}
        return _weighed(output, share) if isinstance(output, Tensor) else output

    def count(self, tokens: Tensor | int | None) -> None:
        """This rank's batch covers ``tokens`` labelled tokens (``None``: it cannot tell)."""
        self._tokens = tokens

    def backward_weight(self, batch: Any) -> Tensor | float:
        """The factor on the current training batch's loss in backward, which joins it to the accumulation: its share
        of the global batch's tokens, times the global batch's tokens over the accumulation's first batch's."""
        if not self.countable:
            return 1.0
        share, _, _ = self._share(batch)
        return share * self._join_accumulation(batch)

    def for_backward(self, closure_loss: Tensor) -> Tensor:
        """Lightning's loss for backward (the step's share of its global batch's loss), weighed by the global batch's
        tokens."""
        return closure_loss if self._backward_scale is None else closure_loss * self._backward_scale

    def scale_gradients(self, optimizer: Optimizer, accumulate: int) -> None:
        """Once the accumulation's last backward has run: scale the gradients from the weights backward used to the
        mean over the accumulation's tokens. Lightning divided each batch's loss by ``accumulate``."""
        window, self._window, self._backward_scale = self._window, [], None
        if not window or (len(window) == 1 and accumulate == 1) or self.batches_alike:
            return  # one batch: its weight in backward was its share already
        tokens, unknown = (torch.stack(column) for column in zip(*window, strict=True))
        scale = torch.where(unknown.any(), 1.0, tokens[0] * accumulate / tokens.sum().clamp(min=1))
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)

    def _join_accumulation(self, batch: Any) -> Tensor:
        _, tokens, unknown = self._share(batch)
        unknown = unknown | self.batches_alike
        self._window.append((tokens, unknown))
        first = self._window[0][0]
        self._backward_scale = torch.where(unknown, 1.0, tokens / first.clamp(min=1))
        return self._backward_scale

    def _share(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's share of the global batch's loss, the global batch's tokens, and whether some rank could not
        count its own: one all-reduce a step, over the ranks whose batches weigh by their tokens (the data-parallel
        ranks; with batches alike, a batch's context-parallel ranks)."""
        if self._shared is not None:
            return self._shared
        tokens = self._own_tokens(batch)
        own = torch.as_tensor(0 if tokens is None else tokens, device=self.device).float()
        counts = torch.stack([own, torch.tensor(float(tokens is None), device=self.device)])
        if self.ranks > 1:
            dist.all_reduce(counts, group=self.group)
        ranks = self.ranks
        if self.replica_group is not None and not self.batches_alike:  # the global batch spans the groups
            counts, ranks = self.replica_group.sum(counts), ranks * self.replica_group.groups_in_step
        total, unknown = counts[0], counts[1] > 0
        share = torch.where(unknown | (total == 0), 1.0, own * ranks / total.clamp(min=1))
        self._shared = (share, total, unknown)
        return self._shared

    def counted(self, batch: Any, run: Callable[[], Any]) -> tuple[Any, Tensor | int | None]:
        """``run``'s output, a step on ``batch``, and this rank's labelled tokens in it, counted as ``step`` counts
        them (``None``: it cannot tell); nothing weighed or reduced but by the step itself (a pipeline's), as the first
        batch of an accumulation. Within ``set_aside``, which keeps the run's own weights."""
        self._tokens, self._called, self._shared, self._backward_scale, self._window = None, [], None, None, []
        try:
            output = run()
            return output, self._own_tokens(batch)
        finally:
            self._called = None

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Within, steps (a check's) leave the current batch's weights and the accumulation's as they were."""
        state = (self._tokens, self._called, self._shared, self._backward_scale, list(self._window))
        try:
            yield
        finally:
            self._tokens, self._called, self._shared, self._backward_scale, self._window = state

    def _own_tokens(self, batch: Any) -> Tensor | int | None:
        if self._tokens is not None:
            return self._tokens
        if hasattr(self.module, "loss_tokens"):
            return self.module.loss_tokens(batch)
        if self._called is not None and len(self._called) == 1:
            return self._called[0]
        return None if self.context_parallel is None else self.context_parallel.loss_tokens()

    def _count_call(self, model: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """A call with labels (not the base model's call inside it) counts its labelled tokens."""
        if self._called is not None and (tokens := labelled_tokens(model, kwargs)) is not None:
            self._called.append(tokens)

    @contextmanager
    def _deferring_means(self, deferred: list[tuple[str, Any, dict[str, Any]]]) -> Iterator[None]:
        """Within, what the module logs as a mean over the data-parallel ranks waits in ``deferred`` for the step's
        share; all else is logged at once."""
        log = self.module.log

        def log_or_defer(name: str, value: Any, *args: Any, **options: Any) -> None:
            weighed = isinstance(value, Tensor | float | int) and not args and options.get("sync_dist")
            if weighed and options.get("reduce_fx", "mean") in _MEANS and options.get("sync_dist_group") is None:
                deferred.append((name, value, options))
            else:
                log(name, value, *args, **options)

        with logging_to(self.module, log_or_defer):
            yield


def _countable(module: LightningModule, *, split: bool) -> bool:
    """Whether a step's tokens can be counted: from a Hugging Face model's labels, the module's ``loss_tokens``, or
    where sequences are ``split``, the step's mean over tokens (``token_means``). A step whose cross-entropy leaves out
    the documents' ends is counted too: ``Steps`` marks its weights countable."""
    return hasattr(module, "loss_tokens") or any(is_causal_lm(model) for model in module.modules()) or split


def weighing_rule(module: LightningModule, weighing: LossWeighting, *, cp: int, end_loss_masked: bool = False) -> str:
    """How ``module``'s batches weigh against each other, across data-parallel ranks and an accumulation: the line a
    run's header says it in."""
    if weighing == "batches":
        return "batches weigh alike, each its own mean, as Lightning's (loss_weighting='batches')"
    if end_loss_masked:
        return "batches weigh by the targets their cross-entropy keeps, the end tokens' predictions left out"
    if not _countable(module, split=cp > 1):
        return "batches weigh alike, as Lightning's: the step's tokens are not counted (loss_tokens(batch) counts them)"
    return "batches weigh by their labelled tokens, as one process's mean over the global batch does"


def _weighed(value: Tensor | float, share: Tensor) -> Tensor:
    """``value`` times ``share``; 0 where the share is 0: a rank that holds no labelled token (the answer in another
    rank's share of the sequence), whose mean over none is NaN."""
    return torch.where(share == 0, 0.0, value * share)


@contextmanager
def logging_to(module: LightningModule, log: Callable[..., None]) -> Iterator[None]:
    """Within, ``module``'s ``self.log`` calls go to ``log``; after, to whatever they went to before."""
    before = module.__dict__.get("log")
    module.log = log
    try:
        yield
    finally:
        if before is None:
            del module.log
        else:
            module.log = before
