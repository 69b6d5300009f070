"""Tensor parallelism applied: a model split over a tensor-parallel mesh by its plan, each attention and MLP module
("a unit") laid out as its code needs, MoE blocks run whole on every rank.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    parallelize_module,
)

from lightdist.dataflow import tensors_in
from lightdist.parallel.document_positions import is_position_table
from lightdist.parallel.expert_parallel import moe_blocks
from lightdist.parallel.pipeline.tied import tied_names
from lightdist.parallel.structure import (
    DecoderStack,
    is_projection,
    out_features,
    within,
)
from lightdist.parallel.tensor.global_layout import run_on_global_shapes
from lightdist.parallel.tensor.heads import AttentionHeads, adapt_to_rank, attention_heads, set_heads_per_rank
from lightdist.parallel.tensor.plan import check_divisible, fused_parts, replicated_key_values
from lightdist.parallel.tensor.styles import (
    COLUMN_PARALLEL,
    FUSED,
    FusedColwiseParallel,
    ReplicatedKeyValueParallel,
    ReplicateInputs,
    ReplicateParallel,
    TensorParallelStyle,
    is_local,
    local_styles,
    map_inputs,
    replicate_dtensor_inputs,
    styles_on_global_shapes,
)

__all__ = ["UnitLayout", "apply_tensor_parallel", "block_units", "parallel_styles", "prepare_units"]

# How the code of an attention or MLP module ("a unit": the parent of a block's split projections) runs split:
# fast: on each rank's local shards, its head counts set per rank (torchtitan's and Megatron's layout);
# adapted: the same, also with per-rank copies of the widths and of the config object it reshapes with;
# global: on DTensors of the unsplit shapes, torch's sharding propagation placing each op (for code that reshapes with
# sizes from its input, the fast layout's shapes cannot work; any code of torch ops is right this way).
UnitLayout = Literal["fast", "adapted", "global"]


def apply_tensor_parallel(
    model: nn.Module,
    stack: DecoderStack,
    tp_mesh: DeviceMesh,
    *,
    plan: dict[str, TensorParallelStyle],
    layouts: dict[str, UnitLayout] | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> None:
    """Split ``model`` across ``tp_mesh`` by ``plan`` (the modules this pipeline stage holds), after checking every
    split divides evenly.

    Parameters become DTensors on ``tp_mesh``. ``layouts`` says how each unit of a block runs, by its name inside the
    block (``{"attn": "global"}``; ``lightdist.parallel.layout_probe`` finds them); units not named run fast, their
    modules' head-count attributes set to per-rank counts, so attention code that reshapes with
    ``view(B, T, self.num_heads, head_dim)`` keeps working unchanged. With ``sequence_parallel``, activations between
    blocks are split along the sequence as well; with ``loss_parallel`` the logits stay split by vocabulary, for
    ``vocab_parallel_cross_entropy``.
    """
    tp = tp_mesh.size()
    plan = {name: style for name, style in plan.items() if _holds_parameters(model, name)}
    check_divisible(model, stack, plan, tp)
    every_name = model.named_parameters(remove_duplicate=False)
    tied = [(owner, user) for owner, user in tied_names(model.named_parameters(), every_name) if owner != user]
    units = {name: (layouts or {}).get(in_block, "fast") for name, in_block in block_units(stack, plan).items()}
    # A unit inside a global one (OPT's attention inside its block) runs global too: it is called with DTensors, and
    # local outputs would reach the outer code's backward as DTensor gradients, which ``to_local`` refuses.
    global_units = [name for name, layout in units.items() if layout == "global"]
    units = {name: "global" if _inside(name, global_units) else layout for name, layout in units.items()}
    parallel_plan = parallel_styles(
        model, plan, units, tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
    if sequence_parallel:
        parallel_plan.update(dict.fromkeys(_column_parallel_parents(stack, plan), ReplicateInputs()))
    parallelize_module(model, tp_mesh, parallel_plan)
    if sequence_parallel:
        _replicate_position_tables(model, stack, tp_mesh)
    for owner, user in tied:
        # Parallelising each module gave the shared weight two DTensors; both are split by vocabulary, so one serves.
        holder, _, name = user.rpartition(".")
        setattr(model.get_submodule(holder), name, model.get_parameter(owner))
    prepare_units(model, plan, units, tp_mesh)
    for name, module in model.named_modules():
        if stack.contains(name) and not _inside(name, list(units)):
            set_heads_per_rank(module, attention_heads(module), tp)
    _run_moe_blocks_whole(model)


def _replicate_position_tables(model: nn.Module, stack: DecoderStack, tp_mesh: DeviceMesh) -> None:
    """Fixed positions held in a buffer outside the blocks, of the embeddings' width (the sinusoids of PyTorch's
    ``PositionalEncoding``, ``x + self.pe[:t]``): replicated DTensors, as a learned table of positions is, for they are
    added to the sequence-parallel stream, a DTensor. Buffers of other widths (rotary tables, masks) stay plain: the
    blocks read them on each rank's local heads."""
    widths = {module.embedding_dim for module in model.modules() if isinstance(module, nn.Embedding)}
    for name, module in model.named_modules():
        if stack.contains(name):
            continue
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if is_position_table(buffer) and buffer.size(-1) in widths and not isinstance(buffer, DTensor):
                setattr(module, buffer_name, distribute_tensor(buffer, tp_mesh, [Replicate()]))


def block_units(stack: DecoderStack, plan: dict[str, TensorParallelStyle]) -> dict[str, str]:
    """The units of the blocks (parents of their split projections: attention, MLP), each with its name inside its
    block (``"model.layers.3.self_attn"`` -> ``"self_attn"``; the block itself is ``""``)."""
    units = {}
    for name, style in plan.items():
        if style in (*COLUMN_PARALLEL, "rowwise") and stack.contains(name):
            unit = name.rsplit(".", 1)[0]
            units[unit] = unit[len(stack.name) + 1 :].partition(".")[2]
    return units


def parallel_styles(
    model: nn.Module,
    plan: dict[str, TensorParallelStyle],
    units: dict[str, UnitLayout],
    tp: int,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> dict[str, ParallelStyle]:
    """The torch style of each module of ``plan``, by the layout of the unit holding it (``units``, by full name)."""
    modules = dict(model.named_modules())
    styles = local_styles(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    global_styles = styles_on_global_shapes(sequence_parallel=sequence_parallel)
    global_units = [name for name, layout in units.items() if layout == "global"]

    def style_of(name: str, style: TensorParallelStyle) -> ParallelStyle:
        if units.get(_parent(name)) == "global" and style in global_styles:
            return global_styles[style]
        if style == "replicate" and any(_within_unit(name, unit) for unit in global_units):
            # Code on DTensors, such as a learned bias per head that the unit looks up with plain positions (T5's):
            # a local output would reach backward as a DTensor gradient, which ``to_local`` refuses.
            return ReplicateParallel(local_outputs=False)
        return FusedColwiseParallel(fused_parts(modules, name, style)) if style in FUSED else styles[style]

    parallel_plan = {name: style_of(name, style) for name, style in plan.items()}
    for name, kv_heads in replicated_key_values(modules, plan, tp).items():
        if units.get(_parent(name)) != "global":
            parallel_plan[name] = ReplicatedKeyValueParallel(kv_heads)
    return parallel_plan


def prepare_units(
    model: nn.Module, plan: dict[str, TensorParallelStyle], units: dict[str, UnitLayout], tp_mesh: DeviceMesh
) -> None:
    """Make each unit's code fit its layout, after its projections are split."""
    modules, tp = dict(model.named_modules()), tp_mesh.size()
    for name, layout in units.items():
        unit = modules[name]
        if layout == "global":
            run_on_global_shapes(unit, tp_mesh)
            continue
        counts = attention_heads(unit)
        if counts is not None:
            _split_per_head_tensors(unit, counts.heads, tp_mesh)
            if layout == "adapted":
                adapt_to_rank(unit, counts, _query_width(modules, plan, name, counts), tp)
        for module in _own_modules(unit):
            set_heads_per_rank(module, attention_heads(module), tp)


def _column_parallel_parents(stack: DecoderStack, plan: dict[str, TensorParallelStyle]) -> set[str]:
    """The attention and MLP modules: parents of a block's column-parallel projections, where sequences are gathered."""
    parents = set()
    for name, style in plan.items():
        if style not in COLUMN_PARALLEL or not stack.contains(name):
            continue
        parent = name.rsplit(".", 1)[0]
        if parent.count(".") == stack.name.count(".") + 1:
            raise ValueError(
                f"sequence_parallel=True needs the projections of a block inside submodules (attention, MLP), but "
                f"{name} sits directly in its block. Pass sequence_parallel=False."
            )
        parents.add(parent)
    return parents


def _run_moe_blocks_whole(model: nn.Module) -> None:
    """Run each MoE block (router, experts, shared experts: outside the plan) whole on every tensor-parallel rank, on
    the whole sequence: a block given the sequence-parallel stream gets it gathered, as a plain tensor, and its output
    goes back into the stream. Every tensor-parallel rank then routes the same tokens, so the router's load-balancing
    loss is plain data parallelism's and expert parallelism runs alike on each; the experts' compute is repeated on
    each of them (Megatron splits the sequence between them instead)."""
    for name in moe_blocks(model):
        whole = _WholeOnEachRank()
        block = model.get_submodule(name)
        block.register_forward_pre_hook(whole.gather, with_kwargs=True)
        block.register_forward_hook(whole.split, with_kwargs=True)


class _WholeOnEachRank:
    """The hooks around one MoE block: DTensor inputs gathered whole and made plain, outputs of the input's shape put
    back as the input was placed."""

    def __init__(self) -> None:
        self.stream: DTensor | None = None

    def gather(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.stream = next((x for x in (*args, *kwargs.values()) if isinstance(x, DTensor)), None)
        args, kwargs = replicate_dtensor_inputs(module, args, kwargs)
        return map_inputs(lambda x: x.to_local() if isinstance(x, DTensor) else x, args, kwargs)

    def split(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        stream, self.stream = self.stream, None
        if stream is None:
            return output

        def placed(x: Any) -> Any:
            if not isinstance(x, Tensor) or x.shape != stream.shape:
                return x
            replicated = DTensor.from_local(
                x, stream.device_mesh, [Replicate()] * stream.device_mesh.ndim, run_check=False
            )
            return replicated.redistribute(placements=stream.placements)

        return tuple(placed(x) for x in output) if isinstance(output, tuple) else placed(output)


def _holds_parameters(model: nn.Module, name: str) -> bool:
    try:
        return any(True for _ in model.get_submodule(name).parameters(recurse=False))
    except AttributeError:  # a block another pipeline stage holds
        return False


def _split_per_head_tensors(unit: nn.Module, heads: int, tp_mesh: DeviceMesh) -> None:
    """Where a unit runs on this rank's heads (fast, adapted), the tensors it takes and gives with a slice per head.

    In: a float tensor laid out as ``bmm``'s attention scores, ``(batch * heads, queries, keys)``, built outside the
    unit from the global head count (BLOOM's ALiBi biases; the batch is that of its first tensor), is cut
    to this rank's heads, as Megatron-DeepSpeed cuts BLOOM's. Where it needs a gradient, each rank's is its heads'
    share, summed over the ranks (``Partial``). A tensor of the batch leads with the batch alone; one of every batch
    (MPT's ``(heads, 1, keys)``) leads with the heads alone, which the check tells apart: it runs a batch of two.
    Out: a tensor laid out ``(batch, heads, ...)`` with this rank's heads (the attention probabilities BLOOM returns
    beside its output) becomes a DTensor split by head: the unsplit shape, no collective, whole with ``full_tensor``.
    """
    rank, tp = tp_mesh.get_local_rank(), tp_mesh.size()
    own = slice(rank * heads // tp, (rank + 1) * heads // tp)

    def cut_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        tensors = tensors_in((args, kwargs))
        if not tensors:
            return None
        per_head = tensors[0].shape[0] * heads

        def own_heads(x: Tensor) -> Tensor:
            if not is_local(x) or not x.is_floating_point() or x.ndim != 3 or x.shape[0] != per_head:
                return x
            x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return x.unflatten(0, (-1, heads))[:, own].flatten(0, 1)

        return apply_to_collection((args, kwargs), Tensor, own_heads, allow_frozen=True)

    def split_by_head(x: Tensor) -> Tensor:
        if not is_local(x) or x.ndim != 4 or x.shape[1] != heads // tp:
            return x
        return DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)

    unit.register_forward_pre_hook(cut_inputs, with_kwargs=True)
    unit.register_forward_hook(
        lambda module, args, output: apply_to_collection(output, Tensor, split_by_head, allow_frozen=True)
    )


def _own_modules(unit: nn.Module) -> list[nn.Module]:
    """The unit and its submodules, less those holding projections themselves: a unit inside it (OPT's attention in
    its block), laid out on its own, or a module left unsplit."""
    inner = [name for name, module in unit.named_modules() if name and any(is_projection(m) for m in module.children())]
    return [module for name, module in unit.named_modules() if not _inside(name, inner)]


def _query_width(
    modules: dict[str, nn.Module], plan: dict[str, TensorParallelStyle], unit: str, counts: AttentionHeads
) -> int:
    children = [name for name, style in plan.items() if style in COLUMN_PARALLEL and _parent(name) == unit]
    fused = [name for name in children if plan[name] == "qkv"]
    if fused:
        return fused_parts(modules, fused[0], "qkv")[0]
    return max(out_features(modules[name]) for name in children)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _inside(name: str, parents: list[str]) -> bool:
    return any(within(name, parent) for parent in parents)


def _within_unit(name: str, unit: str) -> bool:
    """``within``, for the layout check too, where the unit is the root module, named ``""``."""
    return not unit or within(name, unit)
