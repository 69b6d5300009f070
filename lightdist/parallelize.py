"""``parallelize``: a model split over a ``("pp", "dp", "tp")`` DeviceMesh, in one visible order.

Cut pipeline stages, then tensor parallelism, then activation checkpointing, then ``torch.compile``, then ZeRO/FSDP:
torchtitan's order, each step a call into its own module. Nothing here knows Lightning: ``ParallelStrategy`` calls it
with the LightningModule, and a plain training loop can call it with any ``nn.Module`` (``examples/plain_loop.py``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from lightdist.config import ParallelConfig
from lightdist.parallel.activation_checkpointing import apply_activation_checkpointing
from lightdist.parallel.compiled_blocks import compile_block
from lightdist.parallel.expert_parallel import (
    ExpertModules,
    apply_expert_parallel,
    check_expert_parallel,
    expert_mesh,
    find_experts,
)
from lightdist.parallel.kv_cache import without_kv_cache_in_training
from lightdist.parallel.layout_probe import probe_layouts
from lightdist.parallel.listed_experts import apply_listed_expert_parallel
from lightdist.parallel.pipeline.schedules import stages_of_rank
from lightdist.parallel.pipeline.structural import (
    ModelCall,
    StageModel,
    check_blocks_hand_on_one_stream,
    keep_stages,
    stage_ends,
    stage_sizes,
)
from lightdist.parallel.pipeline.tied import tied_across_stages, tied_names
from lightdist.parallel.pipeline.traced import (
    TracedInput,
    adopt_parameters,
    drop_other_stages,
    modules_around_blocks,
    trace_stages,
    traced_stage_sizes,
)
from lightdist.parallel.pipeline.whole_copy import whole_copy
from lightdist.parallel.sharding import ZeroStage, apply_data_parallel, check_replicas
from lightdist.parallel.structure import DecoderStack, find_decoder_stack, find_repeated_blocks
from lightdist.parallel.tensor import apply_tensor_parallel, discover_plan

__all__ = ["ModelHolder", "ParallelConfig", "Parallelized", "materialize", "parallelize"]


@dataclass
class Parallelized:
    """What ``parallelize`` made of a model on this rank."""

    model: nn.Module
    # Under a pipeline: this rank's stage modules and their indices among ``stage_count`` stages, the paths of the
    # modules whose call the stages answer, the (first end, last end) names of weights tied across the pipeline, and
    # for traced stages what turns a model call into the first stage's inputs.
    stages: list[nn.Module] = field(default_factory=list)
    stage_indices: list[int] = field(default_factory=list)
    stage_count: int = 1
    model_paths: list[str] = field(default_factory=list)
    tied: list[tuple[str, str]] = field(default_factory=list)
    traced_input: TracedInput | None = None
    # Under a pipeline cut by structure, a copy of the whole model before it was cut, which the first training step
    # checks the stages against, where it is small and its experts are not split.
    whole: nn.Module | None = None
    # Whether the model came sharded already (a ``configure_model`` written for Lightning's ModelParallelStrategy).
    sharded_by_user: bool = False

    def tied_heads_on(self, mesh: DeviceMesh) -> dict[str, str]:
        """On the ``mesh``'s last pipeline rank, the head's name of each weight tied across the pipeline's ends, mapped
        to the embedding's name, which checkpoints save it under."""
        pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
        return {head: embedding for embedding, head in self.tied} if pp > 1 and pp_rank == pp - 1 else {}


class ModelHolder(nn.Module):
    """Holds the model and runs in its place, so that the outermost FSDP unit's hooks run around whatever the
    caller runs inside its ``forward``: Lightning calls the user's ``training_step`` through it ("forward
    redirection"), so parameters are gathered and gradients reduced whatever the step calls."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    config: ParallelConfig,
    *,
    root: nn.Module | None = None,
    example_call: Callable[[list[str]], ModelCall] | None = None,
    report: Callable[[str], Any] = print,
) -> Parallelized:
    """Split ``model`` over ``mesh`` as ``config`` says. A collective of every rank of the mesh.

    ``root``: the module that holds ``model`` and runs in its place, FSDP's outermost unit (default ``model``).
    ``example_call``: given the paths of the modules that may be called as the model, one microbatch's call of one of
    them, for torch's tracer, which only cuts stages of a model with no block list (or with ``pipeline_tracer``).
    ``report``: where the lines that say what was chosen go.
    """
    if not any(True for _ in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no parameters to train. Create its layers before it is split: in a "
            "LightningModule, in `__init__` or `configure_model`."
        )
    root = model if root is None else root
    sharded_by_user = any(isinstance(m, FSDPModule) for m in model.modules())
    if sharded_by_user or any(isinstance(p, DTensor) for p in model.parameters()):
        return _keep_user_split(model, mesh, config, root, sharded_by_user, report)
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    check_replicas(config.data_parallel_replicas, mesh["dp"].size(), config.zero_stage)
    experts = None
    if config.expert_parallel_size > 1:
        experts = find_experts(model)
        check_expert_parallel(model, experts, config.expert_parallel_size, mesh)
    if config.zero_stage_run(pp) != config.zero_stage:
        report(
            f"lightdist: under a pipeline zero_stage={config.zero_stage} runs as ZeRO-{config.zero_stage_run(pp)}: "
            "a stage's parameters stay gathered from its first forward of a step to its last backward (gathering "
            "them again for every microbatch would multiply the traffic), and sharded between steps."
        )
    try:
        stack = find_decoder_stack(model)
    except ValueError:
        # Without a block list: data parallelism shards per repeated block, the pipeline is traced.
        block_names = find_repeated_blocks(model)
        if not block_names or tp > 1:
            raise
        if pp > 1:
            return _parallelize_traced(model, mesh, config, root, block_names, example_call, report, experts)
        blocks = [model.get_submodule(name) for name in block_names]
        split_experts = _split_experts(model, experts, mesh, config, report)
        _recompute_and_compile(blocks, config)
        _shard(root, blocks, mesh, config, config.zero_stage, split_experts)
        return Parallelized(root)
    if config.pipeline_tracer and pp > 1:
        block_names = [f"{stack.name}.{index}" for index in range(len(stack))]
        return _parallelize_traced(model, mesh, config, root, block_names, example_call, report, experts)
    plan, layouts = {}, {}
    if tp > 1:  # on the whole model, where the embedding and the head split by vocabulary are seen
        plan = discover_plan(model, stack, tp_plan=config.tp_plan)
        layouts = probe_layouts(model, stack, plan, mesh["tp"], report=report)
    result = Parallelized(root)
    if pp > 1:
        stack, result = _cut_pipeline_stages(model, stack, mesh, config, root)
    if tp > 1:
        apply_tensor_parallel(
            model,
            stack,
            mesh["tp"],
            plan=plan,
            layouts=layouts,
            sequence_parallel=config.sequence_parallel,
            loss_parallel=config.loss_parallel,
        )
    split_experts = _split_experts(model, experts, mesh, config, report)
    _recompute_and_compile(stack.blocks, config)
    if not result.stages:
        _shard(root, stack.blocks, mesh, config, config.zero_stage, split_experts)
    for stage in result.stages:
        # Each stage is its own FSDP root, as the schedules expect: they gather, reshard and reduce per stage.
        _shard(stage, stage.blocks, mesh, config, config.zero_stage_run(pp), split_experts.within(stage))
    return result


def materialize(model: nn.Module, device: torch.device, *, filled_after: Callable[[str], bool] | None = None) -> None:
    """Allocate on ``device`` the parameters and buffers a model built on the meta device holds once it is split, and
    initialize each module's by its ``reset_parameters``: a model too big for one device is built on meta
    (``trainer.init_module(empty_init=True)``, ``configure_model``) and only ever allocates its own shards.

    Buffers built on a device (a model built with ``lightdist.pretrained.parameters_on_meta``) keep their values, and
    weights shared by several modules stay shared. ``filled_after(name)``: whether a checkpoint fills the parameter
    ``name`` next; a module holding only such tensors is left to it, as initializing a model about to be overwritten
    is most of the time its start takes (2.0 of 3.3 s for a 0.45B model on a CPU). A module with weights on meta that
    ``_initialize`` cannot initialize keeps uninitialized memory; it is named in a warning."""
    on_meta = {
        name: module
        for name, module in model.named_modules()
        if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
    }
    if not on_meta:
        return
    left_to_fill = {
        name
        for name, module in on_meta.items()
        if filled_after is not None
        and not any(buffer.is_meta for buffer in module.buffers(recurse=False))
        and all(filled_after(f"{name}.{leaf}".lstrip(".")) for leaf, _ in module.named_parameters(recurse=False))
    }
    built = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}
    first_names: dict[int, str] = {}
    tied = {
        name: first_names.setdefault(id(parameter), name)
        for name, parameter in model.named_parameters(remove_duplicate=False)
    }
    model.to_empty(device=device)
    for name, buffer in built.items():
        model.get_buffer(name).copy_(buffer)
    for name, first in tied.items():  # to_empty gives each module its own copy of a weight they shared
        if model.get_parameter(name) is not model.get_parameter(first):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    uninitialized = {
        type(module).__name__
        for name, module in on_meta.items()
        if name not in left_to_fill and not _initialize(module, device)
    }
    if uninitialized:
        warnings.warn(
            f"lightdist: {', '.join(sorted(uninitialized))} built on the meta device have no reset_parameters(), so "
            "their weights are uninitialized memory. Give them a reset_parameters(), or build the model on a device.",
            stacklevel=2,
        )


def _initialize(module: nn.Module, device: torch.device) -> bool:
    """Give a module materialized from the meta device its starting values: by its ``reset_parameters``, or, for one
    holding buffers only and built from a ``config`` (Hugging Face's rotary embeddings), by building it again on
    ``device``. False where neither applies."""
    if callable(reset := getattr(module, "reset_parameters", None)):
        reset()
        return True
    if hasattr(module, "config") and next(module.parameters(), None) is None:
        with torch.device(device):
            module.__init__(module.config)
        return True
    return False


def _keep_user_split(
    model: nn.Module,
    mesh: DeviceMesh,
    config: ParallelConfig,
    root: nn.Module,
    sharded: bool,
    report: Callable[[str], Any],
) -> Parallelized:
    """Keep the split (DTensor parameters, and FSDP units where ``sharded``) that a ``configure_model`` written for
    Lightning's ``ModelParallelStrategy`` made, on this mesh; shard over the data-parallel ranks only where it did
    not."""
    name = type(model).__name__
    if mesh["pp"].size() > 1:
        raise ValueError(
            f"{name}.configure_model split the model itself (DTensor parameters or fully_shard), but "
            f"pipeline_parallel_size={mesh['pp'].size()} cuts stages from the model as written. Let lightdist split "
            "it (drop the split from configure_model; tensor_parallel_size does it), or set pipeline_parallel_size=1."
        )
    if sharded:
        kept = "its tensor-parallel split and its data-parallel sharding"
    else:
        _shard(root, [], mesh, config, config.zero_stage)
        kept = f"its tensor-parallel split, and shards it ZeRO-{config.zero_stage} over the data-parallel ranks"
    report(
        f"lightdist: {name}.configure_model split the model itself: lightdist keeps {kept}, with no tensor "
        "parallelism or activation checkpointing of its own."
    )
    return Parallelized(root, sharded_by_user=sharded)


def _parallelize_traced(
    model: nn.Module,
    mesh: DeviceMesh,
    config: ParallelConfig,
    root: nn.Module,
    block_names: list[str],
    example_call: Callable[[list[str]], ModelCall] | None,
    report: Callable[[str], Any],
    experts: ExpertModules | None,
) -> Parallelized:
    """Pipeline stages cut by torch's tracer, each data parallel on its own: for a model whose blocks are not in
    one ``ModuleList``, or with ``pipeline_tracer``. Tensor and expert parallelism need the structure cut. What is
    traced is the module the step calls (``self(x)``, ``self.model(x)``), its stages named within it."""
    if experts is not None:
        raise ValueError(
            f"expert_parallel_size={config.expert_parallel_size} with pipeline stages cut by torch's tracer: the "
            "traced stages inline each experts module, which expert parallelism splits. Cut the stages by structure "
            "(pipeline_tracer=False, the blocks in an nn.ModuleList), or set expert_parallel_size=1."
        )
    if config.document_end_token is not None:
        raise ValueError(
            f"document_end_token={config.document_end_token} with pipeline stages cut by torch's tracer: the traced "
            "graph calls torch's own attention and embedding operators, which lightdist cannot confine to each "
            "document. Keep the blocks in an nn.ModuleList the forward loops over (stages cut by structure, "
            "pipeline_tracer=False), or train without document_end_token."
        )
    pp = mesh["pp"].size()
    count = pp * config.stages_per_pipeline_rank
    sizes = _blocks_per_stage(
        len(block_names),
        ", ".join(block_names),
        count,
        pp,
        config,
        lambda: traced_stage_sizes(model, block_names, count),
    )
    if example_call is None:
        raise ValueError(f"Cutting {type(model).__name__}'s pipeline stages with torch's tracer needs an example call.")
    path, *example = example_call(modules_around_blocks(model, block_names))
    traced, prefix = model.get_submodule(path), f"{path}." if path else ""
    block_names = [name.removeprefix(prefix) for name in block_names]
    stages = trace_stages(traced, tuple(example), block_names, sizes, _device_of(mesh))
    report(f"lightdist: pipeline stages of {type(traced).__name__} cut by torch's tracer: {sizes} blocks.")
    tied = [
        (prefix + a, prefix + b) for a, b in tied_names(stages[0].named_parameters(), stages[-1].named_parameters())
    ]
    indices = stages_of_rank(mesh["pp"].get_local_rank(), pp, config.stages_per_pipeline_rank)
    stages = [stages[index] for index in indices]
    drop_other_stages(traced, stages)
    for stage in stages:
        blocks = [stage.get_submodule(name) for name in block_names if _has_submodule(stage, name)]
        _recompute_and_compile(blocks, config)
        _shard(stage, blocks, mesh, config, config.zero_stage_run(pp))
    adopt_parameters(traced, stages)
    return Parallelized(
        root,
        stages=stages,
        stage_indices=indices,
        stage_count=count,
        model_paths=[path],
        tied=tied,
        traced_input=TracedInput(traced, tuple(example)),
    )


def _cut_pipeline_stages(
    model: nn.Module, stack: DecoderStack, mesh: DeviceMesh, config: ParallelConfig, root: nn.Module
) -> tuple[DecoderStack, Parallelized]:
    """Keep this rank's stages of ``model``: their blocks, and the modules before the blocks (the embeddings) or after
    them (the norm and head)."""
    pp = mesh["pp"].size()
    count = pp * config.stages_per_pipeline_rank
    sizes = _blocks_per_stage(len(stack), stack.name, count, pp, config, lambda: stage_sizes(model, stack, count))
    tied = tied_across_stages(model, stack)
    indices = stages_of_rank(mesh["pp"].get_local_rank(), pp, config.stages_per_pipeline_rank)
    ranges = {index: range(sum(sizes[:index]), sum(sizes[: index + 1])) for index in indices}
    blocks = list(stack.blocks)
    kept = {block for r in ranges.values() for block in r}
    check_blocks_hand_on_one_stream(model, stack)
    whole = whole_copy(model) if config.expert_parallel_size == 1 else None
    ends = stage_ends(model, stack)
    stack = keep_stages(model, stack, kept, first=0 in indices, last=count - 1 in indices, ends=ends)
    as_stream = None
    if mesh["tp"].size() > 1 and config.sequence_parallel:
        as_stream = partial(DTensor.from_local, device_mesh=mesh["tp"], placements=[Shard(1)], run_check=False)
    stages = [
        StageModel(
            model,
            stack,
            [blocks[block] for block in ranges[index]],
            first=index == 0,
            last=index == count - 1,
            as_stream=as_stream,
            ends=ends,
        )
        for index in indices
    ]
    return stack, Parallelized(
        root,
        stages=stages,
        stage_indices=indices,
        stage_count=count,
        model_paths=stack.enclosing,
        tied=tied,
        whole=whole,
    )


def _blocks_per_stage(
    blocks: int, where: str, count: int, pp: int, config: ParallelConfig, balanced: Callable[[], list[int]]
) -> list[int]:
    """``pipeline_split``, or the ``balanced`` split, of ``blocks`` (found in ``where``) over ``count`` stages."""
    if count > blocks:
        stages = f"pipeline_parallel_size={pp}"
        if count > pp:
            stages += f" x virtual_stages={count // pp} = {count} stages"
        raise ValueError(
            f"{stages} exceeds the {blocks} blocks of {where}: every stage needs at least one. Choose "
            f"fewer stages, at most {blocks}."
        )
    sizes = list(config.pipeline_split) if config.pipeline_split else balanced()
    if len(sizes) != count or sum(sizes) != blocks or min(sizes) < 1:
        raise ValueError(
            f"pipeline_split={sizes} must give each of the {count} stages at least one block, {blocks} in all."
        )
    return sizes


@dataclass(frozen=True)
class _SplitExperts:
    """The experts modules expert parallelism split, and the ``("pp", "edp", "ep", "tp")`` mesh they are split on."""

    modules: list[nn.Module]
    mesh: DeviceMesh | None

    def within(self, stage: nn.Module) -> _SplitExperts:
        held = set(stage.modules())
        return _SplitExperts([module for module in self.modules if module in held], self.mesh)


def _split_experts(
    model: nn.Module,
    experts: ExpertModules | None,
    mesh: DeviceMesh,
    config: ParallelConfig,
    report: Callable[[str], Any],
) -> _SplitExperts:
    """Deal each MoE layer's experts out over the ``ep`` ranks (``lightdist.parallel.expert_parallel``)."""
    if experts is None:
        return _SplitExperts([], None)
    ep = config.expert_parallel_size
    held_as = "lists of experts" if experts.listed else "experts modules"
    report(
        f"lightdist: expert parallelism over {ep} ranks: the {experts.num_experts} experts of each of "
        f"{len(experts.names)} MoE layers, {experts.num_experts // ep} per rank ({held_as} "
        f"{experts.declared_by}: {experts.names[0]}, ...)."
    )
    ranks = expert_mesh(mesh, ep)
    held = [name for name in experts.names if _has_submodule(model, name)]  # under a pipeline, this rank's stages'
    experts = dataclasses.replace(experts, names=held)
    if experts.listed:
        return _SplitExperts(apply_listed_expert_parallel(model, experts, ranks["ep"].get_group()), ranks)
    apply_expert_parallel(model, experts, ranks["ep"])
    return _SplitExperts([model.get_submodule(name) for name in held], ranks)


def _recompute_and_compile(blocks: Iterable[nn.Module], config: ParallelConfig) -> None:
    """Activation checkpointing or ``torch.compile`` (``ParallelConfig`` refuses both), block by block."""
    blocks = list(blocks)
    if config.activation_checkpointing is not None:
        apply_activation_checkpointing(blocks, mode=config.activation_checkpointing)
    if config.compile:
        for block in blocks:
            without_kv_cache_in_training(block)
            compile_block(block)


def _shard(
    root: nn.Module,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    config: ParallelConfig,
    zero_stage: ZeroStage,
    experts: _SplitExperts = _SplitExperts([], None),
) -> None:
    apply_data_parallel(
        root,
        blocks,
        mesh,
        zero_stage=zero_stage,
        replicas=config.data_parallel_replicas,
        param_dtype=config.param_dtype,
        cpu_offload=config.cpu_offload,
        experts=experts.modules,
        expert_mesh=experts.mesh,
    )


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _device_of(mesh: DeviceMesh) -> torch.device:
    """This rank's device: the mesh's type, and on CUDA the device Lightning or torchrun made current."""
    return (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )
