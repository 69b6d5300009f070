"""Pipeline stages for a model whose blocks are not in one ``ModuleList`` (or with ``pipeline_tracer=True``): cut by
``torch.distributed.pipelining``'s tracer.

``lightdist.parallel.pipeline.structural`` runs the model's own forward on every stage, which needs the blocks in a list
the forward loops over. A model that calls its blocks one by one (``self.first(x)``, ``self.second(x)``) or through an
``nn.Sequential`` is traced instead: ``torch.export`` records its forward on one example microbatch, and ``pipeline()``
cuts the graph before the first block of each stage. A stage module then runs the recorded operations, and hands the
next stage every value it needs, not only the hidden states.

The stage modules hold the model's own ``Parameter`` objects under the model's names, so the optimizer, checkpoints
and the weights tied across the ends are keyed as without a pipeline. The trace fixes the shapes of the model's
inputs to the example's: the stages hand each other sizes only as tensors, so every microbatch must have the shape the
trace saw.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.export.unflatten import InterpreterModule

from lightdist.parallel.pipeline.stage_chain import chain_stages
from lightdist.parallel.pipeline.structural import MicrobatchCalls, balanced_split
from lightdist.parallel.structure import CONTAINERS, holders, within

__all__ = [
    "TracedInput",
    "adopt_parameters",
    "drop_other_stages",
    "modules_around_blocks",
    "share_model_buffers",
    "trace_stages",
    "traced_stage_sizes",
]


def modules_around_blocks(model: nn.Module, block_names: list[str]) -> list[str]:
    """Names of the modules a training step may call as the model, the model itself (``""``) first: those holding
    every block (``self(x)``, ``self.model(x)``), but not a container of blocks only (``self.blocks``, an
    ``nn.Sequential`` of them), whose call leaves the embeddings and the head outside the pipeline."""
    around = [name for name in holders(block_names[0]) if all(not name or within(block, name) for block in block_names)]
    return [name for name in around if not _holds_blocks_only(model, name, block_names)]


def _holds_blocks_only(model: nn.Module, name: str, block_names: list[str]) -> bool:
    if not name or not isinstance(model.get_submodule(name), CONTAINERS):
        return False
    children = {f"{name}.{child}" for child, _ in model.get_submodule(name).named_children()}
    return children <= set(block_names)


def traced_stage_sizes(model: nn.Module, block_names: list[str], stages: int) -> list[int]:
    """Blocks per stage, balanced by parameters: embeddings weigh on the first stage, what else is outside the blocks
    on the last."""
    blocks = [model.get_submodule(name) for name in block_names]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()} - in_blocks
    outside = [p for p in model.parameters() if id(p) not in in_blocks]
    first = sum(p.numel() for p in outside if id(p) in embeddings)
    last = sum(p.numel() for p in outside if id(p) not in embeddings)
    costs = [sum(p.numel() for p in block.parameters()) for block in blocks]
    return balanced_split(costs, stages, first_extra=first, last_extra=last)


def trace_stages(
    model: nn.Module,
    example: tuple[tuple, dict],
    block_names: list[str],
    sizes: list[int],
    device: torch.device,
) -> list[fx.GraphModule]:
    """Every stage of ``model``, cut before the first block of each stage but the first (``sizes`` blocks each).

    ``example``: one microbatch's (args, kwargs) of the model call. Raises a ``ValueError`` saying what to change when
    ``torch.export`` cannot record the forward.
    """
    starts = [block_names[sum(sizes[:stage])] for stage in range(1, len(sizes))]
    args, kwargs = example
    # pipeline() marks a split point by setting attributes on the block (a forward wrapper among them), and leaves them.
    attributes_before = {name: dict(vars(model.get_submodule(name))) for name in starts}
    try:
        pipe = pipeline(model, args, kwargs, split_spec=dict.fromkeys(starts, SplitPoint.BEGINNING))
    except Exception as error:
        raise ValueError(
            f"Could not cut {type(model).__name__} into pipeline stages before its blocks {', '.join(starts)}: "
            "lightdist traced its forward with torch.export, which failed: "
            f"{str(error).splitlines()[0]} Keep the transformer blocks in one nn.ModuleList that forward loops over "
            "(for example `for block in self.layers: x = block(x)`) and leave pipeline_tracer=False, or make forward "
            "traceable by torch.export (no data-dependent control flow, no graph breaks)."
        ) from error
    finally:
        for name, attributes in attributes_before.items():
            block = model.get_submodule(name)
            for added in set(vars(block)) - set(attributes):
                delattr(block, added)
            vars(block).update(attributes)
    stages = [pipe.get_stage_module(index) for index in range(pipe.num_stages)]
    if len(stages) != len(sizes):
        raise ValueError(
            f"Tracing {type(model).__name__} gave {len(stages)} pipeline stages where {len(sizes)} were asked for: its "
            f"forward does not call the blocks {', '.join(starts)} in order. Call each block once, in order."
        )
    split = pipe.split_gm.graph
    stage_calls = [node for node in split.nodes if node.op == "call_module"]
    signature = inspect.signature(model.forward)
    # The model call's arguments each stage reads: the first takes them all, a later one reads these by name.
    arguments = [[], *([arg.name for arg in call.args if arg.op == "placeholder"] for call in stage_calls[1:])]
    _check_arguments_named(arguments, signature, type(model).__name__)
    stages[-1].whole_output = _model_output(split, stage_calls[-1], type(model).__name__)
    chain_stages(split, stages)
    for stage in stages:
        for graph_module in _graph_modules(stage):
            _make_factory_calls_on(graph_module, device)
            _slices_as_indexing(graph_module)
            graph_module.recompile()
        _drop_uncalled(stage)
        _use_model_parameters(model, stage)
    for stage, read in zip(stages, arguments, strict=True):
        stage.forward = partial(_forward_beside_model_call, stage, read, signature)
    return stages


def _forward_beside_model_call(
    stage: fx.GraphModule,
    arguments: list[str],
    signature: inspect.Signature,
    *handed_on: Any,
    lightdist_model_calls: MicrobatchCalls | None = None,
    lightdist_microbatch: Tensor | None = None,
) -> Any:
    """``stage``'s forward on what it is handed, then on the model call's ``arguments``, read from microbatch
    ``lightdist_microbatch``'s call: the schedule hands every stage the calls, as to stages cut by structure."""
    if arguments:
        call = lightdist_model_calls[lightdist_microbatch]
        given = signature.bind(*call.args, **call.kwargs).arguments
        handed_on = (*handed_on, *(given[name] for name in arguments))
    return type(stage).forward(stage, *handed_on)


def _check_arguments_named(arguments: list[list[str]], signature: inspect.Signature, model_name: str) -> None:
    """Refuse an argument a later stage reads that is not a parameter of the model's ``forward`` by name (one of its
    ``*args``, or inside a container): that stage reads it from the microbatch's model call by name."""
    for stage, read in enumerate(arguments):
        unnamed = [name for name in read if name not in signature.parameters]
        if unnamed:
            raise ValueError(
                f"{model_name}'s forward reads its input {unnamed[0]} in pipeline stage {stage}, not a parameter of "
                "forward by name, which a stage cut by torch's tracer reads from the model call by name. Pass it as "
                "a parameter of its own, compute what reads it in the step, or keep the transformer blocks in one "
                "nn.ModuleList, whose stages take any argument."
            )


def _model_output(split: fx.Graph, last: fx.Node, model_name: str) -> Callable[[Any], Any]:
    """What makes the model's output from the last stage's: the stage returns tensors only, where the model's
    ``forward`` may return more beside them (nanoGPT's ``(logits, None)`` without targets, whose unpacking would
    otherwise split the logits). The traced graph returns its outputs flattened: one is the model's output, several
    its tuple."""
    (returned,) = next(node for node in split.nodes if node.op == "output").args

    def value_of(node: fx.Node, output: Any) -> Any:
        if node is last:
            return output
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] is last:
            return output[node.args[1]]
        raise ValueError(
            f"{model_name}'s forward returns {node.name}, which its last pipeline stage does not compute. Return only "
            "what the last blocks and the head compute, or keep the transformer blocks in one nn.ModuleList."
        )

    def model_output(output: Any) -> Any:
        values = fx.node.map_arg(returned, lambda node: value_of(node, output))
        return values[0] if isinstance(values, tuple | list) and len(values) == 1 else values

    return model_output


def _graph_modules(stage: fx.GraphModule) -> list[fx.GraphModule]:
    """The graphs a traced stage runs: its own and its submodules' (the ``InterpreterModule``s the tracer outlines the
    model's modules into; those it made for containers such as a ``ModuleList`` run no graph, and have no
    ``graph_module``)."""
    found = []
    for module in stage.modules():
        graph_module = getattr(module, "graph_module", None) if isinstance(module, InterpreterModule) else module
        if isinstance(graph_module, fx.GraphModule):
            found.append(graph_module)
    return found


def _make_factory_calls_on(graph_module: fx.GraphModule, device: torch.device) -> None:
    """Make a traced graph's factory calls (``torch.zeros(..., device=...)``) make tensors on ``device``: the tracer
    records the example's device in them. As torch's ``Pipe.build_stage`` does."""
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.kwargs.get("device", device) != device:
            node.update_kwarg("device", device)


def _slices_as_indexing(graph_module: fx.GraphModule) -> None:
    """Write each run of ``aten.slice`` calls on one tensor (torch.export records one per dimension) as the one index
    the model's code wrote: ``tril[:T, :T]``, ``cos[:T]``, ``x[:, 1:]``. What reads a model's calls (context
    parallelism: a table's rows are ``cos[:T]``, a mask ``tril[:T, :T]``) then reads a traced stage's alike."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if not _is_slice(node) or any(_is_slice(user) for user in node.users):
            continue  # joined from the last slice of a run
        chain, index = [node], {}
        while True:
            sliced = _slice_of(chain[-1])
            if sliced is None or sliced[0] in index:
                chain.pop()
                break
            index[sliced[0]] = sliced[1]
            source = chain[-1].args[0]
            if not _is_slice(source) or len(source.users) != 1:
                break
            chain.append(source)
        if not chain:
            continue
        source = chain[-1].args[0]
        written = tuple(index.get(dim, slice(None)) for dim in range(max(index) + 1))
        with graph.inserting_before(node):
            joined = graph.call_function(operator.getitem, (source, written[0] if len(written) == 1 else written))
        joined.meta = dict(node.meta)
        node.replace_all_uses_with(joined)
        for link in chain:
            graph.erase_node(link)


def _is_slice(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == torch.ops.aten.slice.Tensor


def _slice_of(node: fx.Node) -> tuple[int, slice] | None:
    """The dimension ``node``'s ``aten.slice`` slices and the slice as code writes it (``None`` for an end the tracer
    wrote as ``9223372036854775807`` or as the size); ``None`` where its sizes are not plain numbers."""
    names = ("dim", "start", "end", "step")
    given = dict(zip(names, node.args[1:], strict=False)) | {k: v for k, v in node.kwargs.items() if k in names}
    dim, start, end, step = (given.get(name, default) for name, default in zip(names, (0, None, None, 1), strict=True))
    value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(value, Tensor) or not all(isinstance(n, int | None) for n in (dim, start, end, step)):
        return None
    size = value.size(dim)
    if not isinstance(size, int):
        return None
    end = None if end is not None and end >= size else end
    return dim % value.dim(), slice(start or None, end, None if step == 1 else step)


def _drop_uncalled(stage: fx.GraphModule) -> None:
    """Remove the submodules the stage never calls: the tracer attaches a weight's every user (the LM head to the
    first stage, for an embedding tied to it), where the stage must hold only what it computes with."""
    used = {node.target.split(".")[0] for node in stage.graph.nodes if node.op in ("call_module", "get_attr")}
    for name, _ in list(stage.named_children()):
        if name not in used:
            delattr(stage, name)


def _use_model_parameters(model: nn.Module, stage: nn.Module) -> None:
    """Point the stage at the model's own ``Parameter`` under each name. The tracer keeps them for untied weights but
    copies a tied one to every user but one, which would leave the copies training apart."""
    for name, parameter in list(stage.named_parameters(remove_duplicate=False)):
        own = model.get_parameter(name)
        if parameter is not own:
            owner, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(owner), leaf, own)


def drop_other_stages(model: nn.Module, stages: list[nn.Module]) -> None:
    """Remove from ``model`` each parameter that none of ``stages`` (this rank's) holds under the same name, so
    ``model.parameters()`` and its state dict hold this rank's share, as they do for a pipeline cut by structure.

    A weight tied across the ends stays on each end's rank under that stage's name only (the embedding's on the
    first, the head's on the last). The model's own forward no longer runs; the stages do.
    """
    for name, parameter in list(model.named_parameters(remove_duplicate=False)):
        if not any(_holds(stage, name, parameter) for stage in stages):
            owner, _, leaf = name.rpartition(".")
            delattr(model.get_submodule(owner), leaf)


def _holds(stage: nn.Module, name: str, parameter: nn.Parameter) -> bool:
    try:
        return stage.get_parameter(name) is parameter
    except AttributeError:
        return False


def adopt_parameters(model: nn.Module, stages: list[nn.Module]) -> None:
    """Give ``model`` the stages' parameters under their names: sharding replaces a stage's parameters (FSDP's
    DTensors), and the optimizer and checkpoints read them from the model."""
    for stage in stages:
        for name, parameter in stage.named_parameters():
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, parameter)


def share_model_buffers(model: nn.Module, stages: list[nn.Module]) -> None:
    """Point each stage's buffers (rotary tables, masks) at the model's own under the same name. The trace shares
    them, but materializing a model built on the meta device, moving it or casting it replaces its buffers, where its
    parameters keep their objects: call this once the model is where it trains, or the stages compute with the old
    tensors (on the meta device, never filled by ``reset_parameters``)."""
    for stage in stages:
        for name, _ in list(stage.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(owner), leaf, model.get_buffer(name))


class TracedInput:
    """The first traced stage's inputs from each microbatch's model call (args, kwargs): positional, since torch's
    schedules hand keyword arguments to every stage, checked against the shapes the trace fixed, and joined along
    the batch, which the schedule cuts back into the same microbatches."""

    def __init__(self, module: nn.Module, example: tuple[tuple, dict]) -> None:
        """``module``: what was traced; ``example``: one microbatch's call of it, as the trace saw it."""
        self.module = module
        self.shapes = [tuple(t.shape) for t in self._positional(example) if isinstance(t, Tensor)]

    def __call__(self, calls: list[tuple[tuple, dict]]) -> tuple:
        microbatches = [self._positional(call) for call in calls]
        for inputs in microbatches:
            shapes = [tuple(t.shape) for t in inputs if isinstance(t, Tensor)]
            if shapes != self.shapes:
                raise ValueError(
                    f"Pipeline stages cut by tracing run the microbatch shapes the trace saw, {self.shapes}, but this "
                    f"batch's microbatches are {shapes}. Give every batch one shape (for example drop_last=True in "
                    "the DataLoader, one sequence length), or keep the blocks in one nn.ModuleList, whose stages take "
                    "any shape."
                )
        if any(t.dim() == 0 for t in microbatches[0] if isinstance(t, Tensor)):
            raise ValueError(
                "Pipeline stages cut by tracing take per-example tensors, cut along their first dimension, but the "
                "model is called with a scalar tensor. Pass it as a Python number, or keep the blocks in one "
                "nn.ModuleList, whose stages take any argument."
            )
        columns = zip(*microbatches, strict=True)
        return tuple(torch.cat(column) if isinstance(column[0], Tensor) else column[0] for column in columns)

    def _positional(self, call: tuple[tuple, dict]) -> tuple:
        args, kwargs = call
        if not kwargs:
            return args
        bound = inspect.signature(self.module.forward).bind(*args, **kwargs)
        if bound.kwargs:
            raise ValueError(
                "Pipeline stages cut by tracing take the model's inputs by position, but forward takes "
                f"{', '.join(bound.kwargs)} by keyword only. Make them positional parameters of forward."
            )
        return bound.args
