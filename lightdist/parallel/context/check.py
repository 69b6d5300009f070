"""Context parallelism proves itself on the user's own step: run it whole and split, compare, refuse a difference.

``ContextParallel`` follows the split through the ops it knows (slicing the batch, positions, attention, the label
shift) and refuses those it knows to see a rank's share only. Any other op on a tensor that holds a rank's share of
each sequence sees that share: a step written another way (a mean over tokens written by hand, a shift of flattened
tensors, one position of each sequence) trains differently from one process, without an error. So the step checks
itself: on a prefix of a batch, every rank runs it once on whole sequences (context parallelism's ranks hold the
whole model, so each can) and once with each sequence split over the group, as training will run it, and compares
the loss and, for a training step, the gradients. A difference is an error naming its size and the way out.

The two runs reduce their gradients over the data-parallel ranks alike, so the gradients compare whatever the other
data-parallel ranks hold; each rank's split loss is weighed by its labelled tokens, as ``TokenWeights`` weighs it in
training, but within the context-parallel group only: the check is of the split, not of the data-parallel weighing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightdist.dataflow import cloned, tensors_in
from lightdist.parallel.context.sequences import load_balanced_positions
from lightdist.parallel.context.split import ContextParallel
from lightdist.parallel.loss_tokens import IGNORE_INDEX
from lightdist.parallel.sharding import local_tensor

__all__ = ["StepOnBatch", "check_split_step", "parameters_of", "probe_prefix", "tolerance"]

# The step on a batch: its loss (None where it returns none), and this rank's labelled tokens (None: unknown).
StepOnBatch = Callable[[Any], tuple[Tensor | None, Tensor | int | None]]


def tolerance(compute_dtype: torch.dtype) -> float:
    """The relative difference that rounding alone leaves between a step split over ranks and the whole step: in fp32
    the sums are only taken in another order (1e-7 measured); half precision rounds each partial result, and so does
    TF32, which fp32 matrix products use unless ``torch.set_float32_matmul_precision("highest")``."""
    exact = compute_dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    return 1e-5 if exact else 2e-2


def probe_prefix(batch: Any, cp: int, *, every_example: bool = False) -> Any:
    """The part of ``batch`` the check runs on: as many tokens as a rank holds in training, so that the whole run
    takes no more memory than the split one. Whole sequences of ``examples / cp`` examples where the batch has that
    many; else, or with ``every_example`` (a pipeline cuts them into its microbatches), the first tokens of the first
    example or of every one, as many as keep the sequence's length modulo ``2 * cp`` (a window of ``T + 1`` tokens
    stays one more than a length that splits). Where the batch has ``labels``, the examples kept are those whose
    labelled tokens the ranks would hold most unequally (padding and prompts do): a mean weighed wrong shows there."""
    sequences = [t for t in tensors_in(batch) if t.dim() >= 2]
    if not sequences:
        return batch
    examples = sequences[0].size(0)
    length = max(t.size(1) for t in sequences if t.size(0) == examples)
    if every_example:
        kept, tokens = examples, length // cp
    elif examples >= cp:
        kept, tokens = examples // cp, length
    else:
        kept, tokens = 1, length * examples // cp
    order = torch.arange(examples)
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, Tensor) and labels.shape == (examples, length) and length % (2 * cp) == 0:
        labelled = (labels != IGNORE_INDEX).cpu()
        held = torch.stack([labelled[:, load_balanced_positions(length, cp, rank)].sum(1) for rank in range(cp)])
        order = (held.amax(0) - held.amin(0)).argsort(descending=True, stable=True)  # the most unequal first
    kept = order[:kept].sort().values
    tokens = min(length, max(tokens, 4 * cp))
    tokens = min(length, tokens + (length - tokens) % (2 * cp))

    def cut(tensor: Tensor) -> Tensor:
        if tensor.dim() == 0 or tensor.size(0) != examples:
            return tensor
        tensor = tensor.index_select(0, kept.to(tensor.device))
        return tensor[:, :tokens] if tensor.dim() >= 2 and tensor.size(1) == length else tensor

    return apply_to_collection(batch, Tensor, cut)


def check_split_step(
    cp: ContextParallel,
    step: StepOnBatch,
    batch: Any,
    parameters: dict[str, Tensor] | None,
    *,
    rtol: float,
    step_name: str,
    around: Callable[[], AbstractContextManager] = nullcontext,
    backward_in_step: bool = False,
) -> None:
    """Run ``step`` on ``batch`` whole on each rank, then split over ``cp``'s ranks, and raise where the loss (and,
    given ``parameters`` by name, their gradients, left as they were found) differ by more than ``rtol``. A
    collective of every rank; ``around``: what the step's loss runs under besides context parallelism (loss
    parallelism); ``backward_in_step``: the step runs its own backward, weighing its loss as training does (a
    pipeline's schedule).

    Both run eagerly, compiled blocks too: the check is of the step's code, which compiling does not change, and its
    prefix, run in evaluation and whole, has shapes and modes training never runs (each compiled for them, then again
    for training's: seconds a block on CPU, minutes for a large model under inductor)."""
    device = tensors_in(batch)[0].device
    examples, length = _sequences(batch)
    saved = None if parameters is None else {name: p.grad for name, p in parameters.items()}
    try:
        with around(), torch.compiler.set_stance("force_eager"):
            _clear(parameters)
            try:
                whole, _ = step(cloned(batch))  # a step may write into its batch (labels masked in place)
            except Exception as error:
                raise ValueError(
                    f"{step_name} raised on {examples} whole sequences of {length} tokens of its first batch, which "
                    f"lightdist runs it on to check context_parallel_size={cp.size} against (as many tokens as a "
                    f"rank holds in training): {type(error).__name__}: {error}"
                ) from error
            whole_grads = _gradients(whole, parameters, backward=not backward_in_step)
        with around(), cp.active(), torch.compiler.set_stance("force_eager"):
            _clear(parameters)
            split, tokens = step(cp.shard_batch(cloned(batch)))
            weight = _weight(cp, tokens, device)
            split = None if split is None else torch.where(weight == 0, 0.0, split * weight)
            split_grads = _gradients(split, parameters, backward=not backward_in_step)
    finally:
        for name, grad in (saved or {}).items():
            parameters[name].grad = grad
    # The loss's relative difference, and the gradients' largest difference and value over every rank's shards
    gaps = torch.zeros(3, dtype=torch.float64, device=device)
    if whole is not None and split is not None:
        combined = split.detach().double()
        dist.all_reduce(combined, group=cp.group)
        combined, whole = combined / cp.size, whole.detach().double()
        if whole.isfinite():  # else one process has no loss to compare either (a prefix with no labelled token)
            gaps[0] = (combined - whole).abs() / whole.abs().clamp(min=1e-12)
    differences = {
        name: (split_grads[name] - grad).abs().amax().item() for name, grad in whole_grads.items() if grad.numel()
    }
    if differences:
        gaps[1] = max(differences.values())
        gaps[2] = max(grad.abs().amax().item() for grad in whole_grads.values() if grad.numel())
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    gaps[1] = gaps[1] / gaps[2].clamp(min=1e-12)
    if not bool((gaps[:2] <= rtol).all()):  # a NaN (a mean over no token on one rank) differs too
        parameter = max(differences, key=differences.get) if differences else ""
        raise _different(cp, step_name, (examples, length), gaps, parameter, rtol)


def parameters_of(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s parameters that train, by name: those whose gradients the check compares."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def _clear(parameters: dict[str, Tensor] | None) -> None:
    for parameter in (parameters or {}).values():
        parameter.grad = None


def _gradients(loss: Tensor | None, parameters: dict[str, Tensor] | None, *, backward: bool) -> dict[str, Tensor]:
    """The gradients of ``loss`` (reduced over the data-parallel ranks, as training reduces them) of the parameters
    that get one, this rank's shard of each: by its ``backward``, or as the step left them."""
    if loss is None or parameters is None:
        return {}
    if backward:
        loss.backward()
    return {name: local_tensor(p.grad).detach().clone() for name, p in parameters.items() if p.grad is not None}


def _weight(cp: ContextParallel, tokens: Tensor | int | None, device: torch.device) -> Tensor:
    """This rank's split loss weighed by its share of the group's labelled tokens, times the group's size (the sum
    over the group, divided by its size, is then the whole sequences' mean); 1 where a rank cannot count them."""
    counts = torch.tensor(
        [0.0 if tokens is None else float(tokens), float(tokens is None)], dtype=torch.float64, device=device
    )
    own = counts[0].clone()
    dist.all_reduce(counts, group=cp.group)
    if counts[1] > 0 or counts[0] == 0:
        return torch.ones((), device=device)
    return (own * cp.size / counts[0]).float()


def _sequences(batch: Any) -> tuple[int, int]:
    """The examples and tokens of ``batch``'s longest sequences."""
    return max((tuple(t.shape[:2]) for t in tensors_in(batch) if t.dim() >= 2), key=lambda shape: shape[1])


def _different(
    cp: ContextParallel, step_name: str, sequences: tuple[int, int], gaps: Tensor, parameter: str, rtol: float
) -> ValueError:
    differs = []
    if not gaps[0] <= rtol:
        differs.append(f"the loss by {gaps[0]:.1e}")
    if not gaps[1] <= rtol:
        differs.append(f"the gradients by {gaps[1]:.1e} (most {parameter}'s)")
    return ValueError(
        f"context_parallel_size={cp.size}: {step_name} computes something else on sequences split over "
        f"{cp.size} ranks than on whole sequences: {' and '.join(differs)}, relative, where rounding leaves "
        f"{rtol:.0e} (checked at its first run, on {sequences[0]} sequences of {sequences[1]} tokens of its batch). "
        "Something in the step or the model sees only this rank's share of each sequence: a mean over tokens "
        "written by hand other than loss.sum() / mask.sum() or reduction='sum' over a count of the labels, a shift "
        "of flattened tensors, a table of positions sliced by a length read from the share, an in-place write at "
        "positions read from a shape, or one position of each sequence (the last token). "
        "docs/context_parallel.md says what a step may do; train with context_parallel_size=1, or rewrite the step "
        "so that `lightdist verify` passes."
    )
