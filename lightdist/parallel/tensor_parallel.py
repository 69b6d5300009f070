"""Megatron-style tensor parallelism for models nobody wrote for it: find the plan, check it divides, apply it.

Inside each decoder block, the projections that fan out (q, k, v, gate, up) are split by output features
(``Y = X A``, A split along its second dimension: each rank computes whole heads), and the projections that fan in
(o, down) by input features, so a block costs one all-reduce in attention and one in the MLP. A Linear computing
several projections at once (GPT-2's fused ``c_attn``, a fused gate+up) is split so each rank holds its share of every
part. The token embedding is split by vocabulary rows and the LM head by vocabulary columns, its logits gathered for
the user's loss.

A plan is a mapping from module name to style. It comes from, first that applies: the ``tp_plan`` option
(``fnmatch`` patterns, so ``"model.layers.*.self_attn.q_proj"`` works); the model's own plan (Hugging Face models
carry one as ``tp_plan``); the name rules below, matched against the Linear layers of the first decoder block; the
data flow of that block (``lightdist.dataflow``).
Every other module with parameters is replicated.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from lightdist.dataflow import tensors_in, trace_block_plan
from lightdist.parallel.expert_parallel import moe_blocks
from lightdist.parallel.kv_cache import without_kv_cache
from lightdist.parallel.pipeline.tied import tied_names
from lightdist.parallel.structure import (
    DecoderStack,
    find_decoder_stack,
    in_features,
    is_conv1d,
    is_projection,
    out_features,
    within,
)

__all__ = [
    "BLOCK_RULES",
    "Colwise",
    "FusedColwiseParallel",
    "ReplicateInputs",
    "ReplicateParallel",
    "Rowwise",
    "TensorParallelStyle",
    "UnitLayout",
    "apply_tensor_parallel",
    "attention_heads",
    "block_units",
    "check_divisible",
    "discover_plan",
    "parallel_styles",
    "prepare_units",
    "reorder_optimizer_state",
    "replicated_key_values",
]

TensorParallelStyle = Literal["colwise", "qkv", "gate_up", "rowwise", "vocab", "head", "replicate"]

# How the code of an attention or MLP module ("a unit": the parent of a block's split projections) runs split:
# fast: on each rank's local shards, its head counts set per rank (torchtitan's and Megatron's layout);
# adapted: the same, also with per-rank copies of the widths and of the config object it reshapes with;
# global: on DTensors of the unsplit shapes, torch's sharding propagation placing each op (for code that reshapes with
# sizes from its input, the fast layout's shapes cannot work; any code of torch ops is right this way).
UnitLayout = Literal["fast", "adapted", "global"]

# One entry per model family: the last name of every Linear in a decoder block, and how it splits.
# A family applies when it names all of a block's Linear layers. Adding a family is adding an entry.
BLOCK_RULES: dict[str, dict[str, TensorParallelStyle]] = {
    "llama": {  # also Mistral, Qwen2, Gemma, and lightdist's reference Llama
        "q_proj": "colwise",
        "k_proj": "colwise",
        "v_proj": "colwise",
        "o_proj": "rowwise",
        "gate_proj": "colwise",
        "up_proj": "colwise",
        "down_proj": "rowwise",
    },
    "torchtitan": {
        "wq": "colwise",
        "wk": "colwise",
        "wv": "colwise",
        "wo": "rowwise",
        "w1": "colwise",
        "w3": "colwise",
        "w2": "rowwise",
    },
    "opt": {  # OPT, BART-style decoders, Phi
        "q_proj": "colwise",
        "k_proj": "colwise",
        "v_proj": "colwise",
        "out_proj": "rowwise",
        "dense": "rowwise",
        "fc1": "colwise",
        "fc2": "rowwise",
    },
    "gpt2": {"c_attn": "qkv", "c_proj": "rowwise", "c_fc": "colwise"},  # nanoGPT and GPT-2-style models
    "plain": {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise", "fc1": "colwise", "fc2": "rowwise"},
}

# Attributes attention code reads to reshape its projections; under tensor parallelism each rank holds 1/tp of them.
# Hugging Face's names for the styles it writes into models' ``tp_plan``.
HUGGING_FACE_STYLES: dict[str, TensorParallelStyle] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "vocab",
    "colwise_gather_output": "head",
    "replicated_with_grad_allreduce": "replicate",
}

_QUERY_HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads")
_KEY_VALUE_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_query_groups")
# Widths attention code reshapes with: under the fast layout each rank holds 1/tp of the heads, so 1/tp of these.
_WIDTH_ATTRIBUTES = ("embed_dim", "split_size", "n_embd", "hidden_size", "all_head_size", "d_model", "inner_dim")
_GROUP_ATTRIBUTES = ("num_key_value_groups", "n_rep")  # query heads per key/value head


@dataclass(frozen=True)
class AttentionHeads:
    """An attention module's head counts and the attributes they were read from."""

    heads: int
    kv_heads: int
    heads_attribute: str
    kv_heads_attribute: str


def attention_heads(module: nn.Module) -> AttentionHeads | None:
    """Head counts from the module's own attributes or, for attention that reads them from a config object (Hugging
    Face's, LitGPT's), the config's; ``None`` for modules that are not attention."""
    for source in (module, *_configs(module).values()):
        heads = _first_int_attribute(source, _QUERY_HEAD_ATTRIBUTES)
        if heads is not None:
            kv_heads = _first_int_attribute(source, _KEY_VALUE_HEAD_ATTRIBUTES) or heads
            return AttentionHeads(heads[1], kv_heads[1], heads[0], kv_heads[0])
    return None


def block_attention_heads(stack: DecoderStack) -> AttentionHeads | None:
    """The head counts of the attention in the stack's first block; ``None`` where none is found."""
    first_block = next(iter(stack.blocks.children()))
    return next(filter(None, map(attention_heads, first_block.modules())), None)


def model_attention_heads(model: nn.Module) -> AttentionHeads | None:
    """The head counts of ``model``'s attention, read from its blocks; ``None`` where it has no stack of blocks or
    they name none (what needs them then reads them as attention runs)."""
    try:
        return block_attention_heads(find_decoder_stack(model))
    except ValueError:  # no stack of blocks found
        return None


def _configs(module: nn.Module) -> dict[str, object]:
    """The module's attributes that are plain objects carrying head counts: the config its code reads them from."""
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, nn.Module | Tensor)
        and _first_int_attribute(value, _QUERY_HEAD_ATTRIBUTES) is not None
    }


def _first_int_attribute(source: object, names: tuple[str, ...]) -> tuple[str, int] | None:
    return next(((name, value) for name in names if isinstance(value := getattr(source, name, None), int)), None)


class ReplicateParallel(ParallelStyle):
    """Every rank holds the whole module; its parameters become ``Replicate`` DTensors on the tensor-parallel mesh.

    Norms and other unsplit modules then live on the same mesh as the split ones, so FSDP2 lays all parameters out
    on one (dp, tp) mesh, and the global gradient norm and checkpoints see a single layout. Outputs are local tensors
    where an input was one, else DTensors (the sequence-parallel residual stream, on which a norm runs on each rank's
    share of the sequence). Under sequence parallelism (``local_outputs=False``) they are always DTensors, so that a
    learned position embedding adds to that stream.
    """

    def __init__(self, *, local_outputs: bool = True) -> None:
        super().__init__()
        self.local_outputs = local_outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)

        def to_dtensors(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            inputs = (*args, *kwargs.values())
            module._lightdist_local_outputs = self.local_outputs and any(_is_local(x) for x in inputs)

            def replicated(x):
                return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) if _is_local(x) else x

            return _map_inputs(replicated, args, kwargs)

        def like_inputs(module: nn.Module, args: tuple, output):
            return output.to_local() if module._lightdist_local_outputs and isinstance(output, DTensor) else output

        module.register_forward_pre_hook(to_dtensors, with_kwargs=True)
        module.register_forward_hook(like_inputs)
        return module


def _output_dim(module: nn.Module, param: Tensor) -> int:
    """The dimension of ``param`` along which the module's outputs lie: rows of a Linear, columns of a Conv1D."""
    return param.ndim - 1 if is_conv1d(module) else 0


class Colwise(ColwiseParallel):
    """torch's ``ColwiseParallel``, also for ``Conv1D``: split by output features, its weight by columns."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _distribute_conv1d(self, module, device_mesh, weight=Shard(1), bias=Shard(0), output=Shard(-1))


class Rowwise(RowwiseParallel):
    """torch's ``RowwiseParallel``, also for ``Conv1D``: split by input features, its weight by rows.

    A local output is a tensor of its own, not ``to_local``'s view: residual code adds into it in place (Falcon's
    ``mlp_output += attention_output``), which autograd refuses on a view a custom Function made.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_conv1d(module):
            self.desired_input_layouts = (Shard(-1),)
            _distribute_conv1d(self, module, device_mesh, weight=Shard(0), bias=Replicate(), output=Partial())
        else:
            super()._apply(module, device_mesh)
        if self.use_local_output:
            module.register_forward_hook(lambda module, args, output: output.clone())
        return module


def _distribute_conv1d(
    style: ColwiseParallel | RowwiseParallel,
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    weight: Placement,
    bias: Placement,
    output: Placement,
) -> nn.Module:
    """Split a ``Conv1D``'s parameters, its weight transposed to a Linear's, and take its input and give its output
    as ``style`` does a Linear's: ``output`` is the placement the split computes."""

    def partition(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            placement = weight if param_name == "weight" else bias
            distributed = distribute_tensor(param, device_mesh, [placement], src_data_rank=style.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(distributed))

    distribute_module(module, device_mesh, partition)
    inputs = PrepareModuleInput(input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts)
    outputs = PrepareModuleOutput(
        output_layouts=output, desired_output_layouts=style.output_layouts, use_local_output=style.use_local_output
    )
    parallelize_module(module, device_mesh, inputs)
    return parallelize_module(module, device_mesh, outputs)


class FusedColwiseParallel(Colwise):
    """Column parallelism for a Linear whose output is several projections side by side, ``[q | k | v]``.

    A plain column split would give rank 0 all of q and half of k. Instead the rows are reordered so that each rank's
    contiguous share is ``[q_r | k_r | v_r]``: its heads of every part, which the model's own ``chunk``/``split`` of
    the output then separates. State dicts undo the reordering (and loading redoes it), so checkpoints hold the
    model's own layout whatever the tensor-parallel size, and a tp=2 checkpoint resumes at tp=4 or on one process.
    """

    def __init__(self, parts: tuple[int, ...]) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        order = _rank_major_rows(self.parts, device_mesh.size())
        module._lightdist_row_order = order
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                param.copy_(param.index_select(_output_dim(module, param), order.to(param.device)))
        model_layout = torch.argsort(order)

        def save_in_model_layout(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
            for name, param in module.named_parameters(recurse=False):
                dim = _output_dim(module, param)
                state_dict[prefix + name] = reorder_rows(state_dict[prefix + name], model_layout, dim)

        def load_from_model_layout(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
            for name, param in module.named_parameters(recurse=False):
                if prefix + name in state_dict:
                    state_dict[prefix + name] = reorder_rows(
                        state_dict[prefix + name], order, _output_dim(module, param)
                    )

        module.register_state_dict_post_hook(save_in_model_layout)
        module.register_load_state_dict_pre_hook(load_from_model_layout)
        return super()._apply(module, device_mesh)


def _rank_major_rows(parts: tuple[int, ...], tp: int) -> Tensor:
    """Row order putting each rank's share of every part next to each other: ``[p0_r0, p1_r0, ..., p0_r1, ...]``."""
    starts = [sum(parts[:index]) for index in range(len(parts))]
    return torch.cat(
        [
            torch.arange(start + rank * size // tp, start + (rank + 1) * size // tp)
            for rank in range(tp)
            for start, size in zip(starts, parts, strict=True)
        ]
    )


def reorder_rows(tensor: Tensor, order: Tensor, dim: int = 0) -> Tensor:
    """``tensor.index_select(dim, order)``, for a DTensor keeping its layout: each rank gathers the rows and keeps its
    own share.

    Used only around checkpoints; it briefly holds one whole tensor per rank.
    """
    if not isinstance(tensor, DTensor):
        return tensor.index_select(dim, order.to(tensor.device))
    whole = tensor.detach().full_tensor().index_select(dim, order.to(tensor.device))
    # Every rank holds the whole tensor, so each keeps its share without sending anything (no source rank); a copy
    # of it, so the whole tensor is freed.
    return distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None).clone()


def reorder_optimizer_state(model: nn.Module, optimizer_state: dict, *, to_model_layout: bool) -> dict:
    """Put the optimizer state of fused projections (Adam's moments) in the model's own layout, or back.

    ``optimizer_state`` is keyed by parameter name, as ``get_optimizer_state_dict`` gives it.
    """
    for module_name, module in model.named_modules():
        order = getattr(module, "_lightdist_row_order", None)
        if order is None:
            continue
        if to_model_layout:
            order = torch.argsort(order)
        for name, param in module.named_parameters(recurse=False):
            state = optimizer_state["state"].get(f"{module_name}.{name}", {})
            for key, value in state.items():
                if isinstance(value, Tensor) and value.shape == param.shape:
                    state[key] = reorder_rows(value, order, _output_dim(module, param))
    return optimizer_state


class ReplicatedKeyValueParallel(ParallelStyle):
    """Key and value projections when tensor parallelism exceeds the key/value heads (grouped-query attention).

    tp=4 over 2 key/value heads: ranks 0-1 use head 0 and ranks 2-3 head 1, as Megatron replicates them. Every rank
    holds the whole projection (a ``Replicate`` DTensor, so checkpoints keep one layout) and applies the rows of its
    own head. Each rank's gradients, for the weight and for the input, are its query heads' share: ``Partial`` sums,
    reduced with the rest of the step's gradients.
    """

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)
        head = device_mesh.get_local_rank() // (device_mesh.size() // self.kv_heads)
        head_dim = module.out_features // self.kv_heads
        rows = slice(head * head_dim, (head + 1) * head_dim)

        def own_head(x: Tensor) -> Tensor:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            weight, bias = (
                None if p is None else p.to_local(grad_placements=[Partial()])[rows]
                for p in (module.weight, module.bias)
            )
            return F.linear(x.to_local(grad_placements=[Partial()]), weight, bias)

        module.forward = own_head
        return module


class ReplicateInputs(ParallelStyle):
    """Sequence parallelism's entry into attention and MLP: the sequence-split stream is gathered whole.

    The input stays a DTensor (``Replicate``), so the column-parallel projections inside (q, k, v; gate, up) return
    partial input gradients that add up locally, and this all-gather's backward is one reduce-scatter per module
    (Megatron's count), not one collective per projection. The module sees the whole sequence, also in ``x.shape``.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_replicate_dtensor_inputs, with_kwargs=True)
        return module


def _replicate_dtensor_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def whole(x):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim) if isinstance(x, DTensor) else x

    return _map_inputs(whole, args, kwargs)


def _map_inputs(convert: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(convert(x) for x in args), {key: convert(value) for key, value in kwargs.items()}


def _is_local(x) -> bool:
    return isinstance(x, Tensor) and not isinstance(x, DTensor)


def _styles(*, sequence_parallel: bool, loss_parallel: bool) -> dict[TensorParallelStyle, ParallelStyle]:
    # Between blocks, under sequence parallelism, the residual stream is a DTensor split along the sequence (dim 1):
    # norms run on each rank's share, row-parallel outputs are reduce-scattered into it, and ReplicateInputs gathers
    # it for attention and MLP. The logits are gathered for the user's loss, or under loss parallelism stay split by
    # vocabulary (a DTensor) for torch's vocabulary-parallel cross-entropy.
    stream = Shard(1) if sequence_parallel else Replicate()
    logits = Shard(-1) if loss_parallel else Replicate()
    return {
        "colwise": Colwise(),
        "rowwise": Rowwise(output_layouts=stream, use_local_output=not sequence_parallel),
        "vocab": RowwiseParallel(  # embedding rows split by token id
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "head": ColwiseParallel(input_layouts=stream, output_layouts=logits, use_local_output=not loss_parallel),
        "replicate": ReplicateParallel(local_outputs=not sequence_parallel),
    }


def _global_styles(*, sequence_parallel: bool) -> dict[TensorParallelStyle, ParallelStyle]:
    """The projections of a unit on global shapes: outputs stay DTensors, so the unit's code sees unsplit sizes and
    torch places each op. Fused projections need no reordering: a DTensor's split cuts by global position.

    The row-parallel output stays a DTensor too, whatever the unit does with it (BLOOM adds the residual inside its
    attention and MLP): a local tensor meeting a DTensor runs forward, but its gradient comes back a DTensor, which
    ``to_local``'s backward refuses. The unit's outputs are made local at its end instead (``_run_on_global_shapes``).
    """
    column = Colwise(use_local_output=False)
    stream = Shard(1) if sequence_parallel else Replicate()
    return {
        "colwise": column,
        "qkv": column,
        "gate_up": column,
        "rowwise": Rowwise(output_layouts=stream, use_local_output=False),
    }


def _run_on_global_shapes(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Run ``module``'s own forward on DTensors: the tensors it is given (rotary tables, masks; not integer positions,
    which index), and those it makes that meet a DTensor (nanoGPT's causal mask, sliced from a buffer), become
    replicated DTensors, so that backward meets DTensors too (``masked_fill``'s gradient is masked by the same
    mask). On CPU, attention takes SDPA's math kernel: torch places DTensor ops for the fused CPU kernel nowhere.
    A key/value cache is not passed on: a training step never reads it back, and its plain tensors cannot take the
    DTensor keys (Hugging Face models build one on every forward unless ``use_cache=False``).

    A caller given no DTensor (without sequence parallelism) gets plain tensors back, as the fast layout gives it: each
    replicated output becomes its local copy, a tensor of its own for residual code that adds into it in place. An
    output split across the ranks (BLOOM's attention probabilities, split by head) stays a DTensor rather than cost an
    all-gather on every call."""
    forward = module.forward
    on_cpu = tp_mesh.device_type == "cpu"

    def replicated(x):
        if not _is_local(x) or not (x.is_floating_point() or x.dtype == torch.bool):
            return x
        return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)

    @functools.wraps(forward)
    def global_forward(*args, **kwargs):
        args, kwargs = without_kv_cache(args, kwargs, training_only=False)
        given_dtensors = any(isinstance(x, DTensor) for x in tensors_in((args, kwargs)))
        args, kwargs = apply_to_collection((args, kwargs), Tensor, replicated, allow_frozen=True)
        kernel = sdpa_kernel(SDPBackend.MATH) if on_cpu else contextlib.nullcontext()
        with implicit_replication(), _ReplicatedWhereMixed(replicated), kernel:  # integer indices: implicitly
            output = forward(*args, **kwargs)
        if given_dtensors:
            return output
        return apply_to_collection(output, DTensor, _local_if_replicated, allow_frozen=True)

    module.forward = global_forward


class _ReplicatedWhereMixed(TorchFunctionMode):
    """Each plain tensor an op takes beside a DTensor made a replicated DTensor by ``replicate``: DTensor's own
    ``implicit_replication`` treats it as one in forward only, and its saved copy then meets DTensor gradients in
    backward."""

    def __init__(self, replicate: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.replicate = replicate

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if any(isinstance(t, DTensor) for t in tensors) and not all(isinstance(t, DTensor) for t in tensors):
            args, kwargs = apply_to_collection((args, kwargs), Tensor, self.replicate, allow_frozen=True)
        return func(*args, **kwargs)


def _local_if_replicated(x: DTensor) -> Tensor:
    return x.to_local().clone() if all(placement.is_replicate() for placement in x.placements) else x


def discover_plan(
    model: nn.Module, stack: DecoderStack, *, tp_plan: dict[str, TensorParallelStyle] | None = None
) -> dict[str, TensorParallelStyle]:
    """The style of every module that tensor parallelism changes, by full module name."""
    own_plan = _hugging_face_plan(model) if tp_plan is None else None
    if tp_plan is not None:
        plan = _resolve_patterns(model, tp_plan)
    elif own_plan is not None:
        plan = _resolve_patterns(model, own_plan)
    else:
        block_plan = _block_plan(model, stack)
        plan = {
            f"{stack.name}.{index}.{name}": style
            for index, _ in stack.blocks.named_children()
            for name, style in block_plan.items()
        }
        plan.update(_vocabulary_plan(model, stack))
    # MoE blocks run whole on every rank (``_run_moe_blocks_whole``): no style of their own.
    moe = moe_blocks(model)
    plan = {name: style for name, style in plan.items() if not any(within(name, block) for block in moe)}
    # Whatever else holds parameters and is not split is replicated (norms, position embeddings).
    for name, module in model.named_modules():
        moe_part = any(within(name, block) for block in moe)
        if name not in plan and not moe_part and any(True for _ in module.parameters(recurse=False)):
            plan[name] = "replicate"
    return plan


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
    for owner, user in tied:
        # Parallelising each module gave the shared weight two DTensors; both are split by vocabulary, so one serves.
        holder, _, name = user.rpartition(".")
        setattr(model.get_submodule(holder), name, model.get_parameter(owner))
    prepare_units(model, plan, units, tp_mesh)
    for name, module in model.named_modules():
        if stack.contains(name) and not _inside(name, list(units)):
            _set_heads_per_rank(module, attention_heads(module), tp)
    _run_moe_blocks_whole(model)


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
        args, kwargs = _replicate_dtensor_inputs(module, args, kwargs)
        return _map_inputs(lambda x: x.to_local() if isinstance(x, DTensor) else x, args, kwargs)

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


def block_units(stack: DecoderStack, plan: dict[str, TensorParallelStyle]) -> dict[str, str]:
    """The units of the blocks (parents of their split projections: attention, MLP), each with its name inside its
    block (``"model.layers.3.self_attn"`` -> ``"self_attn"``; the block itself is ``""``)."""
    units = {}
    for name, style in plan.items():
        if style in (*_COLUMN_PARALLEL, "rowwise") and stack.contains(name):
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
    styles = _styles(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    global_styles = _global_styles(sequence_parallel=sequence_parallel)
    global_units = [name for name, layout in units.items() if layout == "global"]

    def style_of(name: str, style: TensorParallelStyle) -> ParallelStyle:
        if units.get(_parent(name)) == "global" and style in global_styles:
            return global_styles[style]
        if style == "replicate" and any(_within_unit(name, unit) for unit in global_units):
            # Code on DTensors, such as a learned bias per head that the unit looks up with plain positions (T5's):
            # a local output would reach backward as a DTensor gradient, which ``to_local`` refuses.
            return ReplicateParallel(local_outputs=False)
        return FusedColwiseParallel(_fused_parts(modules, name, style)) if style in _FUSED else styles[style]

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
            _run_on_global_shapes(unit, tp_mesh)
            continue
        counts = attention_heads(unit)
        if counts is not None:
            _split_per_head_tensors(unit, counts.heads, tp_mesh)
            if layout == "adapted":
                _adapt_to_rank(unit, counts, _query_width(modules, plan, name, counts), tp)
        for module in _own_modules(unit):
            _set_heads_per_rank(module, attention_heads(module), tp)


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
            if not _is_local(x) or not x.is_floating_point() or x.ndim != 3 or x.shape[0] != per_head:
                return x
            x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return x.unflatten(0, (-1, heads))[:, own].flatten(0, 1)

        return apply_to_collection((args, kwargs), Tensor, own_heads, allow_frozen=True)

    def split_by_head(x: Tensor) -> Tensor:
        if not _is_local(x) or x.ndim != 4 or x.shape[1] != heads // tp:
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


def _adapt_to_rank(unit: nn.Module, counts: AttentionHeads, query_width: int, tp: int) -> None:
    """Per-rank widths on the unit, and a per-rank copy of the config it reads head counts from (shared by every
    block, so it is copied, never changed): what DeepSpeed's AutoTP rewrites, found on any attention."""
    head_dim = query_width // counts.heads
    widths = {query_width: query_width // tp}
    if counts.kv_heads >= tp:
        widths.setdefault(counts.kv_heads * head_dim, counts.kv_heads * head_dim // tp)
    for name, config in _configs(unit).items():
        config = copy.copy(config)
        _set_heads_per_rank(config, counts, tp)
        _set_widths(config, widths)
        setattr(unit, name, config)
    _set_widths(unit, widths)


def _set_widths(source: object, widths: dict[int, int]) -> None:
    for name in _WIDTH_ATTRIBUTES:
        value = getattr(source, name, None)
        if isinstance(value, int) and value in widths:
            setattr(source, name, widths[value])


def _query_width(
    modules: dict[str, nn.Module], plan: dict[str, TensorParallelStyle], unit: str, counts: AttentionHeads
) -> int:
    children = [name for name, style in plan.items() if style in _COLUMN_PARALLEL and _parent(name) == unit]
    fused = [name for name in children if plan[name] == "qkv"]
    if fused:
        return _fused_parts(modules, fused[0], "qkv")[0]
    return max(out_features(modules[name]) for name in children)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _inside(name: str, parents: list[str]) -> bool:
    return any(within(name, parent) for parent in parents)


def _within_unit(name: str, unit: str) -> bool:
    """``within``, for the layout check too, where the unit is the root module, named ``""``."""
    return not unit or within(name, unit)


def _set_heads_per_rank(source: object, counts: AttentionHeads | None, tp: int) -> None:
    """Each rank computes 1/tp of the query heads and of the key/value heads, or one replicated key/value head:
    ``source`` (a module or a config) gets those counts wherever it keeps them."""
    if counts is None:
        return
    heads, kv_heads = counts.heads // tp, max(counts.kv_heads // tp, 1)
    for names, count in ((_QUERY_HEAD_ATTRIBUTES, heads), (_KEY_VALUE_HEAD_ATTRIBUTES, kv_heads)):
        for name in names:
            if isinstance(getattr(source, name, None), int):
                setattr(source, name, count)
    for name in _GROUP_ATTRIBUTES:
        if isinstance(getattr(source, name, None), int):
            setattr(source, name, heads // kv_heads)


def replicated_key_values(
    modules: dict[str, nn.Module], plan: dict[str, TensorParallelStyle], tp: int
) -> dict[str, int]:
    """The key and value projections of attention with fewer key/value heads than ``tp``, with their head counts.

    They are the column-parallel projections narrower than the query's: ``kv_heads * head_dim`` outputs.
    """
    replicated = {}
    for parent_name, children in _column_parallel_children(plan).items():
        counts = attention_heads(modules[parent_name])
        if counts is None or counts.kv_heads >= tp:
            continue
        head_dim = max(out_features(modules[name]) for name in children) // counts.heads
        for name in children:
            if plan[name] == "colwise" and out_features(modules[name]) == counts.kv_heads * head_dim:
                replicated[name] = counts.kv_heads
    return replicated


def _column_parallel_children(plan: dict[str, TensorParallelStyle]) -> dict[str, list[str]]:
    children: dict[str, list[str]] = {}
    for name, style in plan.items():
        if style in _COLUMN_PARALLEL:
            children.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name)
    return children


_FUSED = ("qkv", "gate_up")
_COLUMN_PARALLEL = ("colwise", *_FUSED)


def _fused_parts(modules: dict[str, nn.Module], name: str, style: TensorParallelStyle) -> tuple[int, ...]:
    """The widths of the projections a fused Linear computes: q, k, v from its attention's head counts; gate, up."""
    features = out_features(modules[name])
    if style == "gate_up":
        return (features // 2, features // 2)
    counts = attention_heads(modules[name.rsplit(".", 1)[0]] if "." in name else modules[""])
    if counts is None:
        return (features // 3,) * 3
    head_dim = features // (counts.heads + 2 * counts.kv_heads)
    return (counts.heads * head_dim, counts.kv_heads * head_dim, counts.kv_heads * head_dim)


def _column_parallel_parents(stack: DecoderStack, plan: dict[str, TensorParallelStyle]) -> set[str]:
    """The attention and MLP modules: parents of a block's column-parallel projections, where sequences are gathered."""
    parents = set()
    for name, style in plan.items():
        if style not in _COLUMN_PARALLEL or not stack.contains(name):
            continue
        parent = name.rsplit(".", 1)[0]
        if parent.count(".") == stack.name.count(".") + 1:
            raise ValueError(
                f"sequence_parallel=True needs the projections of a block inside submodules (attention, MLP), but "
                f"{name} sits directly in its block. Pass sequence_parallel=False."
            )
        parents.add(parent)
    return parents


def _block_plan(model: nn.Module, stack: DecoderStack) -> dict[str, TensorParallelStyle]:
    """The styles of a block's Linear layers, by name inside the block: from a family's names, else the data flow."""
    moe = moe_blocks(stack.blocks[0])  # a router Linear beside the experts is no projection to split
    linears = [
        name
        for name, module in stack.blocks[0].named_modules()
        if is_projection(module) and not any(within(name, block) for block in moe)
    ]
    last_names = sorted({name.rsplit(".", 1)[-1] for name in linears})
    for rules in BLOCK_RULES.values():
        if linears and all(name in rules for name in last_names):
            return {name: rules[name.rsplit(".", 1)[-1]] for name in linears}
    try:
        plan = trace_block_plan(model, stack)
        why = "no Linear in a block feeds another" if "rowwise" not in plan.values() else ""
    except RuntimeError as error:
        plan, why = {}, str(error)
    if why:
        example = ", ".join(f"'{stack.name}.*.{name}': ..." for name in linears) or f"'{stack.name}.*.<layer>': ..."
        raise ValueError(
            f"No tensor-parallel plan found for the blocks of {stack.name}: their projections are "
            f"{', '.join(last_names) or 'none'}, no known family ({', '.join(BLOCK_RULES)}) names them all, and "
            f"{why}. Pass tp_plan={{{example}}}, each with one of the styles "
            f"{', '.join(TensorParallelStyle.__args__)}."
        )
    return plan


def _hugging_face_plan(model: nn.Module) -> dict[str, TensorParallelStyle] | None:
    """The plan a Hugging Face model carries, in lightdist's styles and full module names; ``None`` where it has none,
    or one with styles lightdist does not apply (Phi-3's ``rowwise_split_input``): its own discovery serves then."""
    for name, module in model.named_modules():
        own = getattr(module, "tp_plan", None)  # transformers' public view of the plan a model declares
        if not isinstance(own, dict) or not own:
            continue
        if any(style not in HUGGING_FACE_STYLES for style in own.values()):
            return None
        prefix = f"{name}." if name else ""
        return {prefix + pattern: HUGGING_FACE_STYLES[style] for pattern, style in own.items()}
    return None


def _vocabulary_plan(model: nn.Module, stack: DecoderStack) -> dict[str, TensorParallelStyle]:
    """The token embedding and the LM head: outside the stack, as many rows/outputs as the vocabulary."""
    outside = [(name, module) for name, module in model.named_modules() if not stack.contains(name)]
    heads = [(name, m) for name, m in outside if isinstance(m, nn.Linear)]
    if not heads:
        return {}
    head_name, head = max(heads, key=lambda item: item[1].out_features)
    plan: dict[str, TensorParallelStyle] = {head_name: "head"}
    for name, module in outside:
        if isinstance(module, nn.Embedding) and module.num_embeddings == head.out_features:
            plan[name] = "vocab"
    return plan


def _resolve_patterns(model: nn.Module, tp_plan: dict[str, TensorParallelStyle]) -> dict[str, TensorParallelStyle]:
    names = [name for name, _ in model.named_modules() if name]
    plan: dict[str, TensorParallelStyle] = {}
    for pattern, style in tp_plan.items():
        if style not in TensorParallelStyle.__args__:
            raise ValueError(f"tp_plan[{pattern!r}]={style!r} is not one of {', '.join(TensorParallelStyle.__args__)}.")
        matches = [name for name in names if fnmatchcase(name, pattern)]
        if not matches:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__}. "
                f"Module names look like: {', '.join(names[:8])}, ..."
            )
        plan.update(dict.fromkeys(matches, style))
    return plan


def check_divisible(model: nn.Module, stack: DecoderStack, plan: dict[str, TensorParallelStyle], tp: int) -> None:
    """Every split of ``plan`` must give each of ``tp`` ranks an equal, whole share: heads first, then features."""
    modules = dict(model.named_modules())
    fused_attention = {name.rsplit(".", 1)[0] for name, style in plan.items() if style == "qkv"}
    first, block = next(iter(stack.blocks.named_children()))  # under a pipeline, this stage's first block
    for block_name, module in block.named_modules():
        counts = attention_heads(module)
        if counts is None:
            continue
        where = f"{stack.name}.{first}.{block_name}" if block_name else f"{stack.name}.{first}"
        if counts.heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide {counts.heads_attribute}={counts.heads} of {where}: each "
                "rank must hold whole attention heads. Choose a tensor_parallel_size that divides the number of heads."
            )
        kv = f"{counts.kv_heads_attribute}={counts.kv_heads} of {where}"
        if counts.kv_heads % tp and tp % counts.kv_heads:
            raise ValueError(
                f"tensor_parallel_size={tp} neither divides nor is a multiple of {kv}: each rank must hold whole "
                "key/value heads, or share one with tp/kv_heads other ranks. Choose a tensor_parallel_size that "
                "divides the key/value heads or is a multiple of them."
            )
        if counts.kv_heads < tp and where in fused_attention:
            raise ValueError(
                f"tensor_parallel_size={tp} exceeds {kv}, whose q, k and v are fused in one projection: replicating "
                f"key/value heads needs them in their own projections. Choose tensor_parallel_size<={counts.kv_heads}."
            )
    replicated = replicated_key_values(modules, plan, tp)
    split_sizes = {
        "colwise": ("out_features", "output features"),
        "head": ("out_features", "vocabulary size"),
        "rowwise": ("in_features", "input features"),
        "vocab": ("num_embeddings", "vocabulary size"),
    }
    sizes = {"out_features": out_features, "in_features": in_features, "num_embeddings": lambda m: m.num_embeddings}
    for name, style in plan.items():
        if style in _FUSED:
            for part in _fused_parts(modules, name, style):
                if part % tp:
                    raise ValueError(
                        f"tensor_parallel_size={tp} does not divide the {style} projections fused in {name} "
                        f"(widths {', '.join(map(str, _fused_parts(modules, name, style)))}). Choose a "
                        "tensor_parallel_size that divides each."
                    )
        if style not in split_sizes or name in replicated:
            continue
        attribute, what = split_sizes[style]
        size = sizes[attribute](modules[name])
        if size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the {what} of {name} ({attribute}={size}). "
                "Choose a tensor_parallel_size that divides it"
                + (", or pad the vocabulary to a multiple of it." if style in ("vocab", "head") else ".")
            )
