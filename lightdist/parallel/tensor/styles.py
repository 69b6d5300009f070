"""The styles a plan names, as torch's ``ParallelStyle``: how each module's weights split and its inputs and
outputs are placed.

Inside each decoder block, the projections that fan out (q, k, v, gate, up) are split by output features
(``Y = X A``, A split along its second dimension: each rank computes whole heads), and the projections that fan in
(o, down) by input features, so a block costs one all-reduce in attention and one in the MLP. A Linear computing
several projections at once (GPT-2's fused ``c_attn``, a fused gate+up) is split so each rank holds its share of every
part. The token embedding is split by vocabulary rows and the LM head by vocabulary columns, its logits gathered for
the user's loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
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
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from lightdist.parallel.structure import (
    is_conv1d,
)
from lightdist.parallel.tensor.vocab_embedding import VocabParallelEmbedding

__all__ = [
    "COLUMN_PARALLEL",
    "FUSED",
    "Colwise",
    "FusedColwiseParallel",
    "ReplicateInputs",
    "ReplicateParallel",
    "ReplicatedKeyValueParallel",
    "Rowwise",
    "TensorParallelStyle",
    "is_local",
    "local_styles",
    "map_inputs",
    "reorder_optimizer_state",
    "reorder_rows",
    "replicate_dtensor_inputs",
    "styles_on_global_shapes",
]

TensorParallelStyle = Literal["colwise", "qkv", "gate_up", "rowwise", "vocab", "head", "replicate"]
FUSED = ("qkv", "gate_up")  # one Linear computing several column-parallel projections
COLUMN_PARALLEL = ("colwise", *FUSED)


class ReplicateParallel(ParallelStyle):
    """Every rank holds the whole module; its parameters become ``Replicate`` DTensors on the tensor-parallel mesh.

    Norms and other unsplit modules then live on the same mesh as the split ones, so FSDP2 lays all parameters out
    on one (dp, tp) mesh, and the global gradient norm and checkpoints see a single layout. Outputs are local tensors
    where an input was one, else DTensors (the sequence-parallel residual stream, on which a norm runs on each rank's
    share of the sequence). Under sequence parallelism (``local_outputs=False``) they are always DTensors, so that a
    learned position embedding adds to that stream.

    A module that holds submodules as well (minGPT's model, its learned ``pos_emb`` a parameter of its own) has its
    own parameters replicated, and its calls left alone: its inputs made DTensors would make DTensors of everything
    its forward computes from them, its targets too, beside the split modules' local outputs.
    """

    def __init__(self, *, local_outputs: bool = True) -> None:
        super().__init__()
        self.local_outputs = local_outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if any(True for _ in module.children()):
            if self.local_outputs:
                own = ", ".join(name for name, _ in module.named_parameters(recurse=False))
                raise ValueError(
                    f"tensor parallelism with sequence_parallel=False: {type(module).__name__} holds parameters of its "
                    f"own ({own}) beside the modules it calls, which lightdist replicates as DTensors, and its forward "
                    "would combine them with those modules' local outputs. Train with sequence_parallel=True (the "
                    "default: the stream between blocks is a DTensor they add to), or hold them in a module of their "
                    "own (an nn.Embedding of positions)."
                )
            for name, param in module.named_parameters(recurse=False):
                replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
                module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
            return module
        distribute_module(module, device_mesh)

        def to_dtensors(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            inputs = (*args, *kwargs.values())
            module._lightdist_local_outputs = self.local_outputs and any(is_local(x) for x in inputs)

            def replicated(x):
                return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) if is_local(x) else x

            return map_inputs(replicated, args, kwargs)

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
        module.register_forward_pre_hook(replicate_dtensor_inputs, with_kwargs=True)
        return module


def replicate_dtensor_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def whole(x):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim) if isinstance(x, DTensor) else x

    return map_inputs(whole, args, kwargs)


def map_inputs(convert: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(convert(x) for x in args), {key: convert(value) for key, value in kwargs.items()}


def is_local(x) -> bool:
    return isinstance(x, Tensor) and not isinstance(x, DTensor)


def local_styles(*, sequence_parallel: bool, loss_parallel: bool) -> dict[TensorParallelStyle, ParallelStyle]:
    # Between blocks, under sequence parallelism, the residual stream is a DTensor split along the sequence (dim 1):
    # norms run on each rank's share, row-parallel outputs are reduce-scattered into it, and ReplicateInputs gathers
    # it for attention and MLP. The logits are gathered for the user's loss, or under loss parallelism stay split by
    # vocabulary (a DTensor) for torch's vocabulary-parallel cross-entropy.
    stream = Shard(1) if sequence_parallel else Replicate()
    logits = Shard(-1) if loss_parallel else Replicate()
    return {
        "colwise": Colwise(),
        "rowwise": Rowwise(output_layouts=stream, use_local_output=not sequence_parallel),
        "vocab": VocabParallelEmbedding(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "head": ColwiseParallel(input_layouts=stream, output_layouts=logits, use_local_output=not loss_parallel),
        "replicate": ReplicateParallel(local_outputs=not sequence_parallel),
    }


def styles_on_global_shapes(*, sequence_parallel: bool) -> dict[TensorParallelStyle, ParallelStyle]:
    """The projections of a unit on global shapes: outputs stay DTensors, so the unit's code sees unsplit sizes and
    torch places each op. Fused projections need no reordering: a DTensor's split cuts by global position.

    The row-parallel output stays a DTensor too, whatever the unit does with it (BLOOM adds the residual inside its
    attention and MLP): a local tensor meeting a DTensor runs forward, but its gradient comes back a DTensor, which
    ``to_local``'s backward refuses. The unit's outputs are made local at its end instead (``run_on_global_shapes``).
    """
    column = Colwise(use_local_output=False)
    stream = Shard(1) if sequence_parallel else Replicate()
    return {
        "colwise": column,
        "qkv": column,
        "gate_up": column,
        "rowwise": Rowwise(output_layouts=stream, use_local_output=False),
    }
