"""Pipeline parallelism for a model nobody cut into stages: cut it by its structure, run torch's schedules over it.

Each pipeline rank keeps its contiguous share of the decoder blocks; the first also keeps the embeddings, the last the
final norm and LM head. The forward of the module the training step calls (the LightningModule, or the network it
holds, ``self.model``) runs on every stage, so whatever it computes around the blocks (positions, masks, rotary
tables) is computed as usual, but:

- on later stages the embeddings are placeholders without weights, and the stage's first block takes the activation
  received from the previous stage instead of what the placeholders produced;
- earlier stages stop after their last block, whose output is the stage's: what the forward does after the blocks
  (the norm, the head, a loss from ``labels``) runs on the last stage alone.

Blocks keep their names (``model.layers.5`` stays ``model.layers.5`` on the second stage), so checkpoints are keyed
as without a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightdist.dataflow import run_first_block, tensors_in
from lightdist.parallel.structure import DecoderStack
from lightdist.torch_internals import is_view

__all__ = [
    "MicrobatchCalls",
    "ModelCall",
    "StageModel",
    "balanced_split",
    "check_blocks_hand_on_one_stream",
    "clip_grads",
    "grad_norm_across_stages",
    "keep_stages",
    "stage_costs",
    "stage_ends",
    "stage_sizes",
    "total_norm",
]


def balanced_split(costs: list[int], stages: int, *, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Blocks per stage, contiguous, minimising the largest stage's cost (the pipeline's pace).

    ``first_extra`` and ``last_extra`` are what the first and last stage carry besides blocks: the embeddings, the
    final norm and LM head.
    """
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = float("inf")
    # best[s][i]: the smallest possible largest cost when the first s stages hold the first i blocks.
    best = [[infinity] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        extra = (first_extra if s == 1 else 0) + (last_extra if s == stages else 0)
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    sizes, i = [], n
    for s in range(stages, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]


def stage_ends(model: nn.Module, stack: DecoderStack) -> dict[str, bool]:
    """The modules with weights of their own outside the stack, by name, each with whether the first stage holds it:
    those the forward runs before the first block (the embeddings, BLOOM's norm of them) belong to the first stage, the
    rest (the final norm, the head) to the last. Found by running the model up to its first block
    (``run_first_block``), since neither a module's class nor the order it was registered in tells: OPT registers its
    final norm before its blocks, LitGPT its head before its embedding. Where the model cannot run on zero tokens,
    the embeddings go first, and ``StageModel`` refuses a stand-in whose output the stage would use."""
    outside = {
        name: module
        for name, module in model.named_modules()
        if name
        and not stack.contains(name)
        and name not in stack.enclosing
        and any(True for _ in module.parameters(recurse=False))
    }
    ran: set[str] = set()
    handles = [
        module.register_forward_pre_hook(lambda _module, _args, name=name: ran.add(name))
        for name, module in outside.items()
    ]
    try:
        run_first_block(model, stack)
    except RuntimeError:
        ran = {name for name, module in outside.items() if isinstance(module, nn.Embedding)}
    finally:
        for handle in handles:
            handle.remove()
    return {name: name in ran for name in outside}


def check_blocks_hand_on_one_stream(model: nn.Module, stack: DecoderStack) -> None:
    """Refuse a model whose loop hands a block something an earlier block returned besides the hidden states (T5's
    position bias, computed by the first block and passed to the rest): a stage's first block gets only the hidden
    states from the stage before, and would compute without it. Found by running the model through its blocks on
    zero tokens (``run_first_block``); a model that cannot run so is not checked here."""
    returned: list[tuple[Tensor, int]] = []  # the tensors themselves: their ids stay theirs while the run lasts

    def keep_returned(index: int) -> Callable[..., None]:
        def hook(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if isinstance(output, tuple | list):
                given = {id(tensor) for tensor in tensors_in((args, kwargs))}  # handed back as it came: no state
                returned.extend((t, index) for t in tensors_in(output[1:]) if id(t) not in given)

        return hook

    def check_given(index: int) -> Callable[..., None]:
        def hook(block: nn.Module, args: tuple, kwargs: dict) -> None:
            given = {id(tensor) for tensor in tensors_in((args[1:], kwargs))}
            handed.extend((tensor, source, index) for tensor, source in returned if id(tensor) in given)

        return hook

    handed: list[tuple[Tensor, int, int]] = []  # a tensor a block returned, that block, and the block it reached
    handles = []
    for index, block in enumerate(stack.blocks):
        handles.append(block.register_forward_hook(keep_returned(index), with_kwargs=True))
        handles.append(block.register_forward_pre_hook(check_given(index), with_kwargs=True))
    try:
        run_first_block(model, stack, blocks=len(stack))
    except RuntimeError:
        pass  # the model cannot run on token ids alone: the stages' own checks are what is left
    finally:
        for handle in handles:
            handle.remove()
    if handed:
        tensor, source, index = handed[0]
        raise ValueError(
            f"Pipeline parallelism hands each stage's first block the previous stage's hidden states alone, but the "
            f"model's loop hands {stack.name}.{index} a tensor of shape {tuple(tensor.shape)} that "
            f"{stack.name}.{source} returned besides its hidden states: a stage starting at a later block would "
            "compute without it. Cut the "
            "stages with torch's tracer, which hands on every value (pipeline_tracer=True)."
        )


def stage_costs(model: nn.Module, stack: DecoderStack) -> tuple[list[int], int, int]:
    """Parameters of each block, of the modules before the stack (on the first stage) and of those after it (last)."""
    ends = [
        (sum(p.numel() for p in model.get_submodule(name).parameters(recurse=False)), first)
        for name, first in stage_ends(model, stack).items()
    ]
    before = sum(n for n, first in ends if first)
    after = sum(n for n, first in ends if not first)
    return [sum(p.numel() for p in block.parameters()) for block in stack.blocks], before, after


def stage_sizes(model: nn.Module, stack: DecoderStack, stages: int) -> list[int]:
    """Blocks per stage for ``model``, balanced by parameters: the modules before the blocks weigh on the first, those
    after on the last."""
    blocks, before, after = stage_costs(model, stack)
    return balanced_split(blocks, stages, first_extra=before, last_extra=after)


class _StageBlocks(nn.ModuleList):
    """This rank's blocks under their original names; ``blocks[0]`` is the stage's first, as code expects.

    While a stage runs, iterating, indexing and ``len`` see that stage's blocks only: a rank holding several virtual
    stages keeps all their blocks here, and the model's own loop must run one stage's share at a time.
    """

    _running: list[nn.Module] | None = None

    def _visible(self) -> list[nn.Module]:
        return self._running if self._running is not None else list(self.children())

    def __getitem__(self, index: int | slice) -> nn.Module | nn.ModuleList:
        if isinstance(index, int):
            return self._visible()[index]
        return nn.ModuleList(self._visible()[index])

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._visible())

    def __len__(self) -> int:
        return len(self._visible())

    @contextmanager
    def running(self, blocks: list[nn.Module]) -> Iterator[None]:
        self._running = blocks
        try:
            yield
        finally:
            self._running = None


class _StandIn(nn.Module):
    """Stands in, without weights, for a module of the model that another stage holds (``stands_for`` names it)."""

    def __init__(self, stands_for: str) -> None:
        super().__init__()
        self.stands_for = stands_for


class _EmbeddingPlaceholder(_StandIn):
    """An embedding on later stages: zeros of its output shape, replaced at the first block by the received input.
    Whatever else it is called with (OPT's learned positions get the attention mask and ``position_ids``) leaves
    that shape as it is."""

    def __init__(self, stands_for: str, embedding_dim: int) -> None:
        super().__init__(stands_for)
        self.embedding_dim = embedding_dim

    def forward(self, indices: Tensor, *args, **kwargs) -> Tensor:
        return torch.zeros(*indices.shape, self.embedding_dim, device=indices.device)


class _PassThrough(_StandIn):
    """Stands in for the final norm and LM head on earlier stages, which stop at their last block before reaching
    them, and for what runs before the blocks (an embedding's norm) on later stages, whose first block takes the
    received input instead."""

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return x


class ModelCall(NamedTuple):
    """The call a training step makes to the model: of the module at ``path`` in the LightningModule (``""``: the
    LightningModule itself), with ``args`` and ``kwargs``."""

    path: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class MicrobatchCalls:
    """The model call of each microbatch of a step, in order. torch's schedules cut only tensors, and hand this whole
    to every stage beside the microbatch's index, which they cut."""

    calls: list[ModelCall]

    def __getitem__(self, microbatch: Tensor) -> ModelCall:
        return self.calls[int(microbatch)]


class _HandedOn:
    """Where a tensor stood in the last stage's output."""


_TENSOR = _HandedOn()


def _not_a_view(tensor: Tensor) -> Tensor:
    # A view (to_local's, a head's) would let an in-place op drop FSDP's pre-backward hook on the stage.
    return tensor.clone() if is_view(tensor) else tensor


class _StageEnd(Exception):
    """Raised after an earlier stage's last block: the rest of the forward belongs to later stages."""


def _held(model: nn.Module, ends: dict[str, bool], *, first: bool, last: bool) -> dict[str, nn.Module]:
    """The modules of ``ends`` (``stage_ends``) that a rank holding the first and/or last stage holds, where the model
    still holds them, not a stand-in."""
    return {
        name: model.get_submodule(name)
        for name, before_blocks in ends.items()
        if (first if before_blocks else last) and not isinstance(model.get_submodule(name), _StandIn)
    }


def _stand_in(name: str, module: nn.Module) -> _StandIn:
    stands_for = f"{name} ({type(module).__name__})"
    if isinstance(module, nn.Embedding):
        return _EmbeddingPlaceholder(stands_for, module.embedding_dim)
    return _PassThrough(stands_for)


def keep_stages(
    model: nn.Module,
    stack: DecoderStack,
    blocks: set[int],
    *,
    first: bool,
    last: bool,
    ends: dict[str, bool] | None = None,
) -> DecoderStack:
    """Drop from ``model`` what other ranks hold: other blocks, and the modules before or after the blocks
    (``ends``, by default ``stage_ends``).

    ``first``/``last``: whether this rank holds the first/last stage. Returns the rank's own stack.
    """
    ends = stage_ends(model, stack) if ends is None else ends
    held = _held(model, ends, first=first, last=last)
    kept = _StageBlocks()
    for index, (name, block) in enumerate(stack.blocks.named_children()):
        if index in blocks:
            kept.add_module(name, block)
    _set_submodule(model, stack.name, kept)
    for name in ends:
        if name not in held:
            _set_submodule(model, name, _stand_in(name, model.get_submodule(name)))
    return DecoderStack(stack.name, kept)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


class StageModel(nn.Module):
    """One pipeline stage of ``model``: the module torch's ``PipelineStage`` runs, and FSDP's root for its share.

    It owns the stage's blocks, and the modules the forward runs before them (first stage: the embeddings) or after
    them (last stage: the final norm and LM head), as ``ends`` (by default ``stage_ends``) says. Its forward is the
    model's own: the first block takes the incoming activation (made a stream tensor by ``as_stream``:
    sequence-parallel DTensors travel as their local shards), the last block's output leaves. Other stages' blocks on
    this rank sit out, and the ends another stage owns run as stand-ins without weights, whose output no block uses:
    one that the first stage calls before its blocks, or the last stage after them, is refused.
    """

    def __init__(
        self,
        model: nn.Module,
        stack: DecoderStack,
        blocks: list[nn.Module],
        *,
        first: bool,
        last: bool,
        as_stream: Callable[[Tensor], Tensor] | None = None,
        ends: dict[str, bool] | None = None,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        ends = stage_ends(model, stack) if ends is None else ends
        own = _held(model, ends, first=first, last=last)
        self.ends = nn.ModuleList(own.values())
        self.first, self.last, self.as_stream = first, last, as_stream
        # Not submodules: the stage owns only its share of the model.
        self.__dict__["model"], self.__dict__["stack"] = model, stack.blocks
        on_rank = _held(model, ends, first=True, last=True)  # for this rank's other stages
        self._stand_ins = {name: _stand_in(name, module) for name, module in on_rank.items() if name not in own}
        self._incoming: Tensor | None = None
        self._outgoing: Tensor | None = None
        self._output_structure: Any = None
        self._zone: str | None = None  # while this stage's forward runs: "before", "in" or "after" its blocks
        blocks[0].register_forward_pre_hook(self._take_incoming, with_kwargs=True)
        blocks[-1].register_forward_hook(self._keep_outgoing)
        for stand_in in {*self._stand_ins.values(), *(m for m in model.modules() if isinstance(m, _StandIn))}:
            stand_in.register_forward_pre_hook(self._check_unused)
        self._stop_hook_due = not last

    def forward(self, *incoming: Tensor, lightdist_model_calls: MicrobatchCalls, lightdist_microbatch: Tensor) -> Any:
        """The called module's forward as this stage, on the arguments of microbatch ``lightdist_microbatch``'s model
        call; ``incoming``: the previous stage's output."""
        if self._stop_hook_due:
            # Registered at the first forward, after FSDP's and activation checkpointing's hooks on the block: theirs
            # must run on its output before the forward is cut short.
            self.blocks[-1].register_forward_hook(self._stop)
            self._stop_hook_due = False
        self._incoming = incoming[0] if incoming else None
        call = lightdist_model_calls[lightdist_microbatch]
        called = self.model.get_submodule(call.path)
        self._zone = "before"
        try:
            with self.stack.running(list(self.blocks)), self._standing_in():
                output = type(called).forward(called, *call.args, **call.kwargs)
        except _StageEnd:
            output = None
        finally:
            self._incoming, self._zone = None, None
        if not self.last:
            output, self._outgoing = self._outgoing, None
            if isinstance(output, DTensor):
                output = output.to_local()
            return _not_a_view(output)
        # torch's stages hand on tensors only: the last one's output (a tuple, a dict, a Hugging Face ModelOutput with
        # a cache in it) leaves as its tensors, and the step gets it back whole from ``whole_output``.
        handed_on = []

        def hand_on(tensor: Tensor) -> _HandedOn:
            handed_on.append(_not_a_view(tensor))
            return _TENSOR

        self._output_structure = apply_to_collection(output, Tensor, hand_on, allow_frozen=True)
        return tuple(handed_on)

    def whole_output(self, tensors: Tensor | tuple[Tensor, ...]) -> Any:
        """The called module's output, as the last stage's last forward returned it, with ``tensors`` (those it
        handed on, or merged over microbatches; torch's schedules unpack a single one) in place of its own."""
        given = iter((tensors,) if isinstance(tensors, Tensor) else tensors)
        return apply_to_collection(self._output_structure, _HandedOn, lambda _: next(given), allow_frozen=True)

    @contextmanager
    def _standing_in(self) -> Iterator[None]:
        """The ends this rank holds for another of its stages, swapped for stand-ins while this stage runs."""
        owned = {name: self.model.get_submodule(name) for name in self._stand_ins}
        for name, stand_in in self._stand_ins.items():
            _set_submodule(self.model, name, stand_in)
        try:
            yield
        finally:
            for name, module in owned.items():
                _set_submodule(self.model, name, module)

    def _take_incoming(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._zone is not None:  # not a recompute in backward
            self._zone = "in"
        if self._incoming is None:
            return None
        if not args:
            raise ValueError(
                f"Pipeline parallelism hands each stage's first block ({type(block).__name__}) the previous stage's "
                "output as its first positional argument, but the model calls its blocks by keyword only. Call them "
                "with the hidden states first, e.g. `block(x, ...)`, or cut the stages with torch's tracer "
                "(pipeline_tracer=True)."
            )
        incoming = self._incoming if self.as_stream is None else self.as_stream(self._incoming)
        return (incoming, *args[1:]), kwargs

    def _stop(self, block: nn.Module, args: tuple, output: Any) -> None:
        raise _StageEnd

    def _keep_outgoing(self, block: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, tuple):
            streams = [t for t in output if isinstance(t, Tensor) and t.shape == output[0].shape]
            if len(streams) > 1 and not self.last:
                raise ValueError(
                    f"{type(block).__name__} returns {len(streams)} tensors shaped like its hidden states "
                    f"{tuple(output[0].shape)}, but a pipeline stage hands the next stage only the first. Carry one "
                    "stream between blocks (add the residual inside the block), or cut the stages with torch's "
                    "tracer, which hands on every value (pipeline_tracer=True)."
                )
            output = output[0]
        self._outgoing = output
        if self._zone is not None:
            self._zone = "after"

    def _check_unused(self, stand_in: _StandIn, args: tuple) -> None:
        """A stand-in's output must not reach a block: before the first stage's blocks, or after the last's, the
        model's forward needs the module itself."""
        if (self._zone == "before" and self.first) or (self._zone == "after" and self.last):
            where, holder = ("before", "the last") if self._zone == "before" else ("after", "the first")
            raise ValueError(
                f"Pipeline parallelism placed {stand_in.stands_for} on {holder} stage, but the model's forward runs "
                f"it {where} its blocks, on this stage, which holds a stand-in without its weights: the stage would "
                "compute without it. lightdist places each module by running the model up to its first block, which "
                "failed for this model. Make its forward run on a batch of token ids alone (other inputs optional), "
                "or cut the stages with torch's tracer, which places every module where the forward runs it "
                "(pipeline_tracer=True)."
            )


def _by_mesh(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """``tensors`` grouped by their DTensor mesh, plain tensors together: torch's foreach kernels, which the gradient's
    norm and clipping use, take DTensors of one mesh at a time (experts are split over a mesh of their own)."""
    groups: dict[DeviceMesh | None, list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(tensor)
    return list(groups.values())


def clip_grads(parameters: Iterable[nn.Parameter], max_norm: float, total_norm: Tensor) -> None:
    """Scale the gradients of ``parameters`` so that the whole model's, of norm ``total_norm``, has ``max_norm`` at
    most: one DTensor mesh at a time."""
    for group in _by_mesh(p for p in parameters if p.grad is not None):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)


def grad_norm_across_stages(
    parameters: list[nn.Parameter],
    pp_group: dist.ProcessGroup,
    *,
    counted_elsewhere: set[int] = frozenset(),
    held_apart: Mapping[dist.ProcessGroup, set[int]] | None = None,
) -> Tensor:
    """The norm of the whole model's gradient, of which each stage holds a share (and, as DTensors, each tensor-,
    data- and expert-parallel rank a shard).

    ``counted_elsewhere``: ids of parameters another stage also holds and counts (a weight tied across the ends).
    ``held_apart``: ids of parameters of which each rank of a group holds others, by that group (listed experts).
    """
    counted = [p for p in parameters if p.grad is not None and id(p) not in counted_elsewhere]
    apart = {group: [p for p in counted if id(p) in ids] for group, ids in (held_apart or {}).items()}
    each_own = {id(p) for held in apart.values() for p in held}
    squared = _squared_norm([p for p in counted if id(p) not in each_own], parameters[0].device)
    for group, held in apart.items():
        over_group = _squared_norm(held, parameters[0].device)
        dist.all_reduce(over_group, group=group)
        squared = squared + over_group
    dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


def _squared_norm(parameters: list[nn.Parameter], device: torch.device) -> Tensor:
    squared = torch.zeros((), device=device, dtype=_NORM_DTYPES.get(device.type, torch.float32))
    for grads in _by_mesh(p.grad for p in parameters):
        norm = total_norm(grads)
        squared = squared + (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(squared.dtype).pow(2)
    return squared


# Where the norm sums: torch's CPU kernels add fp32 squares one after another, dropping a tensor's small entries
# beside its large ones (a 32000-word LM head's gradient, whose unused rows are tiny: 9e-5 of its norm); GPUs sum in
# a tree, as accurate in fp32.
_NORM_DTYPES = {"cpu": torch.float64}


def total_norm(tensors: list[Tensor]) -> Tensor:
    """The 2-norm of ``tensors`` (DTensors of one mesh, or plain), summed in float64 on CPUs (``_NORM_DTYPES``)."""
    dtype = _NORM_DTYPES.get(tensors[0].device.type) if tensors else None
    if dtype is None:
        return torch.nn.utils.get_total_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]))
