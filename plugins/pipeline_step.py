"""The user's ``training_step`` as the loss of a pipeline schedule.

Lightning calls ``training_step`` once per batch and expects it to return the loss. Under a pipeline the batch is cut
into microbatches that flow through the stages, and only the last stage sees outputs. So each step:

1. cuts the batch into microbatches, whatever its form, and runs the user's step on each until it calls the model,
   to learn the model's arguments, on every stage (what it logs or adds to metrics on the way is dropped: the step
   runs again);
2. runs torch's schedule: every stage runs the model's forward on those arguments (later stages swap in the
   received activation), and the last stage calls the user's step once per microbatch with the stage output in place
   of the model call, which makes the step's own label shifting and masking the loss;
3. replays on every rank what the step logged (the mean over microbatches, weighted by their shares of the batch's
   tokens as one call over the whole batch logs it, or the sum, max or min its ``reduce_fx`` asks for), copies the
   states of the torchmetrics metrics the step updated from the last stage to the others, and returns the batch's
   loss, so ``self.log(sync_dist=True)``, metrics, the progress bar and callbacks see the usual values.

Gradients come from the schedule's backward; the strategy tells Lightning to skip its own.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from functools import partial, wraps
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.optim import Optimizer
from torch.profiler import record_function
from torchmetrics import Metric

from lightdist.config import ParallelConfig
from lightdist.dataflow import tensors_in
from lightdist.parallel.context import tolerance
from lightdist.parallel.documents import DocumentMasks, within_documents
from lightdist.parallel.loss_tokens import labelled_tokens, shares
from lightdist.parallel.pipeline.microbatches import cut_batch
from lightdist.parallel.pipeline.schedules import SCHEDULES
from lightdist.parallel.pipeline.structural import MicrobatchCalls, ModelCall
from lightdist.parallel.pipeline.tied import TiedGradients, tied_gradients
from lightdist.parallelize import Parallelized
from lightdist.plugins.lightning_internals import data_source
from lightdist.plugins.metric_sync import load_metric_states, metric_states, metrics_of
from lightdist.plugins.model_calls import answering_model_calls, model_call_of
from lightdist.plugins.pipeline_check import PipelineCheck
from lightdist.plugins.steps import Steps
from lightdist.plugins.token_weights import TokenWeights

__all__ = [
    "PipelineStep",
    "StageClock",
    "batch_on_device",
    "example_model_call",
    "optimizer_steps_after",
    "pipeline_step_over",
]


class StageClock:
    """Seconds this rank's stages compute, and seconds their schedule runs: for the rest of the schedule's time, the
    stages wait on each other (the pipeline's bubble). On GPUs CUDA events time the kernels, read once per step.

    Each stage's forward and backward of each microbatch is also a span of its own in a profiler's trace ("stage 1
    forward, microbatch 3"), whichever schedule runs them: a trace shows the schedule, and its bubble, as a timeline.
    """

    def __init__(self, device: torch.device) -> None:
        self.busy_s = self.scheduled_s = 0.0
        self._cuda = device.type == "cuda"
        self._pending: list[tuple[str, Any, Any]] = []

    @contextmanager
    def timing(self, kind: Literal["busy", "scheduled"]) -> Iterator[None]:
        if not self._cuda:
            start = time.perf_counter()
            yield
            self._add(kind, time.perf_counter() - start)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((kind, start, end))

    def timed(self, compute: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``compute`` (a stage's forward or backward of one microbatch, its first argument), counted as busy and
        named ``name`` in a profiler's trace."""

        @wraps(compute)
        def timed_compute(microbatch: int, *args: Any, **kwargs: Any) -> Any:
            with self.timing("busy"), record_function(f"{name}, microbatch {microbatch}"):
                return compute(microbatch, *args, **kwargs)

        return timed_compute

    def settle(self) -> None:
        """Add up the spans the GPU has timed; called at the end of each step, which waits for its last kernel."""
        for kind, start, end in self._pending:
            end.synchronize()
            self._add(kind, start.elapsed_time(end) / 1000)
        self._pending.clear()

    def _add(self, kind: str, seconds: float) -> None:
        if kind == "busy":
            self.busy_s += seconds
        else:
            self.scheduled_s += seconds


# A stage's computations the schedules call, one microbatch each, and their names in a trace.
_STAGE_COMPUTE = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "weight gradients",
}


# The precision plugin's context for each of Lightning's steps.
_PRECISION_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


class PipelineStep:
    """Runs ``module``'s training, validation, test or predict step for one batch on this rank's pipeline stages."""

    def __init__(
        self,
        module: LightningModule,
        stages: list[PipelineStage],
        schedule_class: type[PipelineScheduleSingle | PipelineScheduleMulti],
        microbatches: int,
        *,
        callable_as_model: list[str],
        token_weights: TokenWeights,
        sequence_shards: int = 1,
        tied: TiedGradients | None = None,
        traced_input: Callable[[tuple[tuple, dict]], tuple] | None = None,
        first_step_check: PipelineCheck | None = None,
        documents: DocumentMasks | None = None,
    ) -> None:
        """``callable_as_model``: the modules (by name in ``module``, ``""`` for itself) whose call by the step is
        the model call that enters the first stage. ``token_weights``: weighs the batch by its labelled tokens among
        the data-parallel ranks' and the accumulation's batches, told the microbatches' counts. ``sequence_shards``:
        the tensor-parallel ranks each stage hands its share of the sequence to the next (sequence parallelism), 1
        without. ``traced_input``: for stages cut by the tracer, the first stage's positional inputs from the model
        call; without it, every stage gets the call as ``StageModel`` expects. ``first_step_check``: run on the first
        training batch, before it trains. ``documents``: the step's packed documents, where attention stops; each
        stage's forward and backward of a microbatch attend within that microbatch's."""
        self.module, self.microbatches, self.tied, self.traced_input = module, microbatches, tied, traced_input
        self.callable_as_model, self.sequence_shards = callable_as_model, sequence_shards
        self.token_weights, self.first_step_check, self.documents = token_weights, first_step_check, documents
        last = [stage.submod for stage in stages if stage.is_last]
        # The model call's answer on the last stage, whole (structure-cut stages hand on the output's tensors only).
        self._whole_output = last[0].whole_output if last else lambda output: output
        self.called = ""  # the module the step calls as the model (its path), learned with each batch's call
        self.pp_group, self.last = stages[0].group, any(stage.is_last for stage in stages)
        self.first = any(stage.is_first for stage in stages)
        self.last_stage = dist.get_world_size(self.pp_group) - 1  # the last stage is on the pp group's last rank
        # The schedule's own scaling divides every gradient by the microbatch count after each step, also those
        # accumulated over earlier batches; scaling each microbatch's loss instead keeps accumulation exact.
        single = issubclass(schedule_class, PipelineScheduleSingle)
        self._new_schedule = partial(
            schedule_class, stages[0] if single else stages, n_microbatches=microbatches, loss_fn=self.loss
        )
        self.schedule = self._new_schedule(scale_grads=False)
        self._shapes: tuple | None = None  # of the tensors of the microbatches' model calls the schedule last ran
        self._step: Callable[..., Any] | None = None  # the user's step, per microbatch, as the loss
        self._step_for_input: Callable[..., Any] | None = None  # the step run only to learn the model's input
        self._microbatches: list[Any] = []  # the step's batch, cut
        self.shares = torch.ones(microbatches) / microbatches  # each microbatch's share of the batch's loss
        self._tokens: list[Tensor | int | None] = []  # each microbatch's loss tokens, counted before the schedule
        self._microbatch = 0  # the microbatch whose loss the step computes now
        self._logged: dict[str, list] = defaultdict(list)
        self._logged_metrics: dict[str, str] = {}  # logged name -> module path of the torchmetrics metric logged
        self._log_options: dict[str, dict] = {}
        self._loss_scale = 1.0
        self.metrics = metrics_of(module)
        self.clock = StageClock(stages[0].device)
        for stage in stages:
            for compute, name in _STAGE_COMPUTE.items():
                within = self._within_microbatch_documents(getattr(stage, compute))
                setattr(stage, compute, self.clock.timed(within, f"stage {stage.stage_index} {name}"))
            stage.forward_one_chunk = self._ending_setup(stage.forward_one_chunk)
        # Whether torch's schedule is still setting up this rank's stages, before its first microbatch's forward: it
        # may run them on made-up inputs and call the loss on their made-up outputs, to learn the shapes of what flows
        # between stages (torch 2.13 at the first training step and at the first after each evaluation; torch 2.11
        # without the loss). The loss call leaves no trace, and the forwards route no token that counts.
        self.setting_up_stages = False

    def run(self, step_name: str, batch: Any, batch_idx: int, optimizers: list[Optimizer], precision: Precision) -> Any:
        """Lightning's ``step_name`` for one batch, in ``precision``'s context for it. A training step also does what
        Lightning's backward would: it zeroes the gradients at the first batch of each accumulation and leaves them
        whole before the optimizer steps (tied weights summed over the pipeline's ends)."""
        with getattr(precision, _PRECISION_CONTEXTS[step_name])():
            return self._run_step(step_name, batch, batch_idx, optimizers)

    def _run_step(self, step_name: str, batch: Any, batch_idx: int, optimizers: list[Optimizer]) -> Any:
        if step_name == "predict_step":
            return self.predict(batch, batch_idx)
        if step_name != "training_step":
            return self(step_name, batch, batch_idx, train=False)
        if self.first_step_check is not None:
            check, self.first_step_check = self.first_step_check, None
            check(self, batch)
        trainer = self.module.trainer
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in optimizers:
                optimizer.zero_grad()
        loss = self(step_name, batch, batch_idx, train=True, loss_scale=1 / accumulate)
        if self.tied is not None and optimizer_steps_after(trainer, batch_idx):
            self.tied.sum()  # both ends apply the tied weight's whole gradient
        return loss

    def counted_elsewhere(self) -> set[int]:
        """Ids of the parameters another stage counts in the gradient norm: the first stage counts tied weights."""
        if self.tied is None or dist.get_group_rank(self.pp_group, dist.get_rank()) == 0:
            return set()
        return {id(parameter) for parameter in self.tied.parameters()}

    def __call__(self, step_name: str, batch: Any, batch_idx: int, *, train: bool, loss_scale: float = 1.0) -> Tensor:
        """The step's loss over the batch: the microbatches' losses, each weighted by its share of the batch's tokens
        where they can be counted (``lightdist.parallel.loss_tokens``), else alike. Backward runs on each weighted loss
        multiplied by ``loss_scale`` (Lightning's 1/accumulate_grad_batches, which it applies to a loss before its own
        backward) and by the batch's weight among the data-parallel ranks' and the accumulation's batches."""
        self._loss_scale = loss_scale
        step = getattr(type(self.module), step_name)
        self._step = lambda microbatch: step(self.module, microbatch, batch_idx)
        updates = {name: metric.update_count for name, metric in self.metrics.items()}
        losses: list[Tensor] = []
        with self.clock.timing("scheduled"):
            self._run("step" if train else "eval", batch, losses, train=train)
        self.clock.settle()
        loss = (
            torch.stack([loss.detach() for loss in losses]).sum() / self._loss_scale if self.last else torch.zeros(())
        )
        loss = self._shared_loss(loss.to(self.module.device).float(), train)
        updated = [name for name, metric in self.metrics.items() if metric.update_count != updates[name]]
        self._share_logs_and_metrics(updated)
        return loss

    def _shared_loss(self, loss: Tensor, train: bool) -> Tensor:
        """The last stage's ``loss``, on every stage. Where the end tokens' predictions are left out of the loss, the
        last stage's check of the microbatches' counts travels with it (no extra collective, no wait on the device
        otherwise), and every stage raises its error."""
        if self.documents is None or not self.documents.mask_end_loss:
            dist.broadcast(loss, group_src=self.last_stage, group=self.pp_group)
            return loss
        miscounted = self._miscounted_targets(train) if self.last else None
        verdict = torch.stack([loss, torch.tensor(float(miscounted is not None), device=loss.device)])
        dist.broadcast(verdict, group_src=self.last_stage, group=self.pp_group)
        if verdict[1] > 0:
            message = [miscounted]
            dist.broadcast_object_list(message, group_src=self.last_stage, group=self.pp_group)
            raise ValueError(message[0])
        return verdict[0]

    def _miscounted_targets(self, train: bool) -> str | None:
        """Why the targets each microbatch's cross-entropy kept, the end tokens' predictions left out, are not those
        counted before the schedule ran, which weighed the microbatches (``None`` where they are, or where an
        evaluation step computed no cross-entropy)."""
        kept = [int(count) for count in self.documents.loss_counts]
        counted = [int(count) for count in self._tokens]
        if kept == counted or (not train and not kept):
            return None
        return (
            f"mask_document_end_loss=True under a pipeline: the step's cross-entropy kept {kept} targets of the "
            f"microbatches, but lightdist counted {counted} before the schedule ran, to weigh each microbatch's loss: "
            "each token but the last (the next its target), or each target of an (inputs, targets) pair, not "
            "predicted from an end token and not -100 in the batch's labels or targets. Feed windows of tokens, "
            "(inputs, targets) pairs or a mapping with input_ids and labels, the targets to ignore -100 in the batch; "
            "or train with mask_document_end_loss=False."
        )

    def predict(self, batch: Any, batch_idx: int) -> Any:
        """The user's ``predict_step`` given the whole batch's output, which the forward-only schedule computed;
        every stage returns the last stage's result."""
        step = partial(type(self.module).predict_step, self.module, batch_idx=batch_idx)
        self._step, self._step_for_input = None, step  # no loss: the schedule's loss calls return zero
        outputs = self._run("eval", batch, [], return_outputs=True)
        result = None
        if self.last:
            outputs = self._whole_output(outputs)
            with answering_model_calls(self.module, {self.called: lambda *args, **kwargs: outputs}, metrics={}):
                result = step(batch)
        shared = [result]
        dist.broadcast_object_list(shared, group_src=self.last_stage, group=self.pp_group)
        return shared[0]

    def _run(
        self,
        run: str,
        batch: Any,
        losses: list[Tensor],
        *,
        train: bool = False,
        return_outputs: bool = False,
    ) -> Any:
        """The schedule's ``run`` (``"step"`` or ``"eval"``) on ``batch``, cut into microbatches by lightdist, whatever
        its form. torch's stages learn the shapes that flow between them once, at a schedule's first run, and size
        what they receive by them: a batch of other shapes (another sequence length, as dynamic padding makes) runs on a
        new schedule over the same stages, which learn them again.

        The user's step runs on each microbatch up to its model call, whose arguments every stage reads (stages cut
        by the tracer: the first takes them all, a later one those its graph reads); on the last stage it runs on the
        same microbatch again as the loss. torch's schedules cut only tensors, so they are handed each microbatch's
        index to cut.
        """
        self._microbatches = cut_batch(batch, self.microbatches)
        calls = [self._model_call(microbatch) for microbatch in self._microbatches]
        self.called = calls[0].path
        tokens = [
            self._loss_tokens(microbatch, call) for microbatch, call in zip(self._microbatches, calls, strict=True)
        ]
        self._tokens = tokens
        self.shares = shares(tokens, self.module.device)
        self.token_weights.count(None if any(count is None for count in tokens) else sum(tokens))
        if train:
            self._loss_scale *= self.token_weights.backward_weight(batch)
        self._check_sequence_shards(calls[0])
        shapes = tuple(tuple(tensor.shape) for tensor in tensors_in([(call.args, call.kwargs) for call in calls]))
        if self._shapes not in (None, shapes):
            self.schedule = self._new_schedule(scale_grads=False)
        self._shapes = shapes
        index = torch.arange(self.microbatches)
        stage_kwargs = {"lightdist_model_calls": MicrobatchCalls(calls), "lightdist_microbatch": index}
        inputs = ()
        if self.traced_input is not None:  # checked on every rank, so that each raises alike
            inputs = self.traced_input([(call.args, call.kwargs) for call in calls])
            inputs = inputs if self.first else ()  # torch 2.11 takes them on the first stage only
        self.setting_up_stages = True
        try:
            with within_documents(self.documents, self._microbatches[0]):  # setting up runs the stages on its shape
                return getattr(self.schedule, run)(
                    *inputs,
                    **stage_kwargs,
                    target=index if self.last else None,
                    losses=losses if self.last else None,
                    return_outputs=return_outputs,
                )
        finally:
            self._step = self._step_for_input = None
            self._microbatches = []
            self.setting_up_stages = False

    def _check_sequence_shards(self, call: ModelCall) -> None:
        # Run on every stage: sizing the model call's inputs also tells context parallelism each stage's share.
        lengths: set[int] = set()
        apply_to_collection(call, Tensor, lambda tensor: lengths.add(tensor.shape[1]) if tensor.dim() > 1 else None)
        if uneven := sorted(length for length in lengths if length % self.sequence_shards):
            shards = self.sequence_shards
            raise ValueError(
                f"Sequence parallelism hands the next pipeline stage each of the {shards} tensor-parallel ranks' "
                f"equal share of the sequence, but the model is called with sequences of {uneven[0]} positions. "
                f"Call it with sequences of a multiple of {shards} (e.g. the window's first T tokens as inputs), "
                "or pass sequence_parallel=False."
            )

    def loss(self, output: Any, microbatch: Tensor) -> Tensor:
        """The schedule's ``loss_fn`` on the last stage: the user's step on the microbatch of index ``microbatch``,
        its model call answered with ``output``."""
        if self._step is None:  # predicting: the schedule computes outputs only
            return torch.zeros((), device=self.module.device)
        whole = self._whole_output(output)
        with (
            self.clock.timing("busy"),
            self._calling_user_step(lambda *args, **kwargs: whole, leave_no_trace=self.setting_up_stages),
            within_documents(self.documents, self._microbatches[int(microbatch)]),
        ):
            self._microbatch = int(microbatch)
            result = self._step(self._microbatches[self._microbatch])
        loss = result["loss"] if isinstance(result, Mapping) else result
        if loss is not None:
            return loss * self._loss_scale * self.shares[self._microbatch]
        if torch.is_grad_enabled():
            raise ValueError(
                f"{type(self.module).__name__}'s training step returned no loss. Under a pipeline it runs on every "
                "microbatch as the schedule's loss, so it must return the loss (or a dict with a 'loss'), every time."
            )
        return torch.zeros((), device=self.module.device)  # a validation or test step that only logs

    def _within_microbatch_documents(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(compute)
        def compute_within_documents(microbatch: int, *args: Any, **kwargs: Any) -> Any:
            with within_documents(self.documents, self._microbatches[microbatch]):
                return compute(microbatch, *args, **kwargs)

        return compute_within_documents if self.documents is not None else compute

    def _ending_setup(self, forward_one_chunk: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(forward_one_chunk)
        def forward_of_a_microbatch(*args: Any, **kwargs: Any) -> Any:
            if self.setting_up_stages and self.documents is not None:
                self.documents.loss_counts.clear()  # the setup's losses of made-up outputs
            self.setting_up_stages = False
            return forward_one_chunk(*args, **kwargs)

        return forward_of_a_microbatch

    def _loss_tokens(self, microbatch: Any, call: ModelCall) -> Tensor | int | None:
        """The tokens the step's loss on ``microbatch`` averages over: with the end tokens' predictions left out, the
        targets kept (checked against the loss's own count as it runs); the module's own ``loss_tokens(batch)`` where it
        has one, else those a Hugging Face causal LM called with ``labels=`` counts; ``None`` where none tells."""
        if self.documents is not None and self.documents.mask_end_loss:
            return self.documents.targets_kept(microbatch)
        own = getattr(self.module, "loss_tokens", None)
        if own is not None:
            return own(microbatch)
        return labelled_tokens(self.module.get_submodule(call.path), call.kwargs)

    def _model_call(self, batch: Any) -> ModelCall:
        step = self._step_for_input or self._step
        return model_call_of(self.module, step, batch, self.metrics, self.callable_as_model)

    @contextmanager
    def _calling_user_step(self, model_call: Callable[..., Any], *, leave_no_trace: bool) -> Iterator[None]:
        """Within, the user's step gets ``model_call``'s answer from the model, and what it logs is kept for
        ``_share_logs_and_metrics``; with ``leave_no_trace``, what it logs and adds to metrics is dropped instead."""
        log = None if leave_no_trace else self._record_log
        with answering_model_calls(self.module, {self.called: model_call}, log=log, metrics=self.metrics):
            yield

    def _record_log(self, name: str, value: Any, **options: Any) -> None:
        if isinstance(value, Metric):
            self._logged_metrics[name] = next(path for path, metric in self.metrics.items() if metric is value)
        else:
            value = torch.as_tensor(value.detach() if isinstance(value, Tensor) else value).float()
            self._logged[name].append((self._microbatch, value))
        self._log_options[name] = options

    def _share_logs_and_metrics(self, updated: list[str]) -> None:
        """Log on every rank what the last stage's steps logged, combined over microbatches as one call over the
        whole batch would have logged it (a mean weighted by the microbatches' shares of the loss, unless a sum, max
        or min was asked for), and give every stage the last stage's states of the metrics in ``updated``, so each
        stage computes and logs what the last does."""
        shared = [
            {
                name: _over_microbatches(values, self._log_options[name].get("reduce_fx", "mean"), self.shares).cpu()
                for name, values in self._logged.items()
            },
            self._logged_metrics,
            self._log_options,
            metric_states({name: self.metrics[name] for name in updated}) if self.last else {},
        ]
        dist.broadcast_object_list(shared, group_src=self.last_stage, group=self.pp_group)
        self._logged, self._logged_metrics, self._log_options = defaultdict(list), {}, {}
        values, logged_metrics, options, states = shared
        if not self.last:
            load_metric_states(self.metrics, states)
        for name, value in values.items():
            self.module.log(name, value, **options[name])
        for name, path in logged_metrics.items():
            self.module.log(name, self.metrics[path], **options[name])


# How a batch's value follows from its microbatches' for each ``reduce_fx`` of ``self.log``; the weighted mean
# otherwise.
_OVER_MICROBATCHES = {
    **dict.fromkeys(("sum", torch.sum), torch.sum),
    **dict.fromkeys(("max", torch.max), torch.amax),
    **dict.fromkeys(("min", torch.min), torch.amin),
}


def optimizer_steps_after(trainer: Any, batch_idx: int) -> bool:
    """Whether the optimizer steps after this batch: the last of an accumulation, or of the epoch, where Lightning
    steps whatever the count."""
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or batch_idx + 1 == trainer.num_training_batches
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last


def batch_on_device(module: LightningModule, batch: Any, device: torch.device) -> Any:
    """``batch`` moved to ``device`` as Lightning moves every batch: by the datamodule's transfer hooks where it
    overrides them, else the module's."""
    datamodule = module.trainer.datamodule
    for hook, args in (("transfer_batch_to_device", (device, 0)), ("on_after_batch_transfer", (0,))):
        owner = datamodule if datamodule is not None and is_overridden(hook, datamodule) else module
        batch = getattr(owner, hook)(batch, *args)
    return batch


def _over_microbatches(values: list[tuple[int, Tensor]], reduce_fx: Any, shares: Tensor) -> Tensor:
    """A batch's value from ``values`` logged by the microbatches of the indices they come with."""
    indices, logged = (list(column) for column in zip(*values, strict=True))
    logged = torch.stack(logged)
    if reduce_fx in _OVER_MICROBATCHES:
        return _OVER_MICROBATCHES[reduce_fx](logged)
    weights = shares[indices].to(logged.device)
    return (weights * logged).sum() / weights.sum()


def _received_activations_need_gradients(stage: nn.Module, received: tuple[Any, ...]) -> None:
    """torch 2.11 makes a stage's receive buffers at its schedule's first call, needing gradients only if that call
    trains: after a validation first (Lightning's sanity check), training's would send the previous stage no gradient
    ("has gradients None and is expecting to send gradients"). Every one, as torch 2.11 itself makes them for training;
    torch 2.13 asks the sending stage which need them, from the start."""
    if torch.is_grad_enabled():
        for tensor in received:
            if isinstance(tensor, Tensor) and tensor.is_leaf and tensor.is_floating_point():
                tensor.requires_grad_(True)


class _StageLearningShapesOnZeros(PipelineStage):
    """torch 2.13 learns the shapes a later stage returns by running it once on uninitialised tensors of the shapes
    it receives (2.11 on zeros). A traced stage may be handed integers that index a table (positions computed before
    the blocks), which out of range fail that run: zeros, as 2.11 makes them."""

    def _to_tensor(self, arg: Any) -> Tensor:
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, Tensor):  # made from the shapes received, not a real input
            with torch.no_grad():
                tensor.zero_()
        return tensor


def pipeline_step_over(
    module: LightningModule,
    parallelized: Parallelized,
    mesh: DeviceMesh,
    config: ParallelConfig,
    steps: Steps,
    timeout: timedelta,
) -> PipelineStep:
    """The step runner over this rank's stages of ``parallelized``: torch's ``PipelineStage`` on the mesh's ``pp``
    group, on the rank's device (where ``steps.token_weights`` counts), the schedule ``config`` names, attending within
    ``steps``' documents. A collective: every rank takes part in grouping the tied weights' ends."""
    token_weights = steps.token_weights
    pp_group = mesh["pp"].get_group()
    stages = [
        _StageLearningShapesOnZeros(stage, index, parallelized.stage_count, token_weights.device, group=pp_group)
        for stage, index in zip(parallelized.stages, parallelized.stage_indices, strict=True)
    ]
    for stage, index in zip(parallelized.stages, parallelized.stage_indices, strict=True):
        if index > 0 and torch.__version__ < "2.13":
            stage.register_forward_pre_hook(_received_activations_need_gradients)
    return PipelineStep(
        module,
        stages,
        SCHEDULES[config.pipeline_schedule].runner,
        config.microbatches_run(mesh["pp"].size()),
        callable_as_model=parallelized.model_paths,
        token_weights=token_weights,
        sequence_shards=mesh["tp"].size() if config.sequence_parallel else 1,
        tied=tied_gradients(module, parallelized.tied, mesh, timeout),
        traced_input=parallelized.traced_input,
        first_step_check=_first_step_check(module, parallelized, mesh, config, token_weights),
        documents=steps.documents,
    )


def _first_step_check(
    module: LightningModule,
    parallelized: Parallelized,
    mesh: DeviceMesh,
    config: ParallelConfig,
    token_weights: TokenWeights,
) -> PipelineCheck | None:
    """The check of the first training step against the whole model, where ``parallelize`` kept a copy of it, the
    step trains by Lightning's automatic optimization, and whole sequences enter the stages (under context
    parallelism, a rank's share, which its own check covers). The last stage keeps the copy; other ranks drop it."""
    whole, parallelized.whole = parallelized.whole, None
    if whole is None or not module.automatic_optimization or token_weights.context_parallel is not None:
        return None
    last = mesh["pp"].get_local_rank() == mesh["pp"].size() - 1
    return PipelineCheck(whole if last else None, tolerance(config.param_dtype or torch.float32))


def example_model_call(module: LightningModule, microbatches: int, callable_as_model: list[str]) -> ModelCall:
    """One microbatch of the call the run's step makes to ``module`` or to a module it holds named in
    ``callable_as_model``, for the tracer: learned from the first batch of the data the run starts on, on the device
    the parameters are on now; under context parallelism, this rank's share of its sequences, which the stages run
    on."""
    trainer = module.trainer
    context_parallel = getattr(trainer.strategy, "context_parallel", None)
    loop, step_name = {
        TrainerFn.FITTING: (trainer.fit_loop, "training_step"),
        TrainerFn.VALIDATING: (trainer.validate_loop, "validation_step"),
        TrainerFn.TESTING: (trainer.test_loop, "test_step"),
        TrainerFn.PREDICTING: (trainer.predict_loop, "predict_step"),
    }[trainer.state.fn]
    batch, _, _ = next(iter(CombinedLoader(data_source(loop).dataloader(), "sequential")))
    batch = batch_on_device(module, batch, next(module.parameters()).device)
    if context_parallel is not None:
        batch = context_parallel.shard_batch(batch)
    step = getattr(type(module), step_name)
    first = cut_batch(batch, microbatches)[0]
    call = model_call_of(
        module, lambda microbatch: step(module, microbatch, 0), first, metrics_of(module), callable_as_model
    )
    return ModelCall(call.path, *context_parallel.shares((call.args, call.kwargs))) if context_parallel else call
