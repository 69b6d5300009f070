"""Megatron-style tensor parallelism for models nobody wrote for it: find the plan, check it divides, apply it.

Inside each decoder block, the projections that fan out (q, k, v, gate, up) are split by output features
(``Y = X A``, A split along its second dimension: each rank computes whole heads), and the projections that fan in
(o, down) by input features, so a block costs one all-reduce in attention and one in the MLP. The token embedding is
split by vocabulary rows and the LM head by vocabulary columns, its logits gathered for the user's loss.

A plan is a mapping from module name to style. It comes from, first that applies: the ``tp_plan`` option
(``fnmatch`` patterns, so ``"model.layers.*.self_attn.q_proj"`` works); the model's own plan (Hugging Face models
carry one as ``_tp_plan``); the name rules below, matched against the Linear layers of the first decoder block.
Every other module with parameters is replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Literal

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightdist.structure import DecoderStack

__all__ = [
    "BLOCK_RULES",
    "ReplicateInputs",
    "ReplicateParallel",
    "TensorParallelStyle",
    "apply_tensor_parallel",
    "check_divisible",
    "discover_plan",
]

TensorParallelStyle = Literal["colwise", "rowwise", "vocab", "head", "replicate"]

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
    "plain": {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise", "fc1": "colwise", "fc2": "rowwise"},
}

# Attributes attention code reads to reshape its projections; under tensor parallelism each rank holds 1/tp of them.
# Hugging Face's names for the styles it writes into models' ``_tp_plan``.
HUGGING_FACE_STYLES: dict[str, TensorParallelStyle] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "vocab",
    "colwise_gather_output": "head",
    "replicated_with_grad_allreduce": "replicate",
}

_KEY_VALUE_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
HEAD_COUNT_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "num_attention_heads", *_KEY_VALUE_HEAD_ATTRIBUTES)


class ReplicateParallel(ParallelStyle):
    """Every rank holds the whole module; its parameters become ``Replicate`` DTensors on the tensor-parallel mesh.

    Norms and other unsplit modules then live on the same mesh as the split ones, so FSDP2 lays all parameters out
    on one (dp, tp) mesh, and the global gradient norm and checkpoints see a single layout. Outputs are local tensors
    where the inputs were, and DTensors where they were DTensors (the sequence-parallel residual stream, on which a
    norm runs on each rank's share of the sequence).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)

        def to_dtensors(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            module._lightdist_local_inputs = any(_is_local(x) for x in (*args, *kwargs.values()))

            def replicated(x):
                return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) if _is_local(x) else x

            return _map_inputs(replicated, args, kwargs)

        def like_inputs(module: nn.Module, args: tuple, output):
            return output.to_local() if module._lightdist_local_inputs and isinstance(output, DTensor) else output

        module.register_forward_pre_hook(to_dtensors, with_kwargs=True)
        module.register_forward_hook(like_inputs)
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


def _styles(*, sequence_parallel: bool) -> dict[TensorParallelStyle, ParallelStyle]:
    if not sequence_parallel:
        return {
            "colwise": ColwiseParallel(),
            "rowwise": RowwiseParallel(),
            "vocab": RowwiseParallel(input_layouts=Replicate()),  # embedding rows split by token id
            "head": ColwiseParallel(output_layouts=Replicate()),  # logits gathered: the user's loss sees all of them
            "replicate": ReplicateParallel(),
        }
    # Between blocks the residual stream is a DTensor split along the sequence (dim 1): norms run on each rank's
    # share, row-parallel outputs are reduce-scattered into it, and ReplicateInputs gathers it for attention and MLP.
    sequence = Shard(1)
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "vocab": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence, use_local_output=False),
        "head": ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
        "replicate": ReplicateParallel(),
    }


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
        rules = _block_rules(stack)
        plan = {}
        for index, block in enumerate(stack.blocks):
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    plan[f"{stack.name}.{index}.{name}"] = rules[name.rsplit(".", 1)[-1]]
        plan.update(_vocabulary_plan(model, stack))
    # Whatever holds parameters and is not split is replicated (norms, position embeddings).
    for name, module in model.named_modules():
        if name not in plan and any(True for _ in module.parameters(recurse=False)):
            plan[name] = "replicate"
    return plan


def apply_tensor_parallel(
    model: nn.Module,
    stack: DecoderStack,
    tp_mesh: DeviceMesh,
    *,
    plan: dict[str, TensorParallelStyle],
    sequence_parallel: bool = True,
) -> None:
    """Split ``model`` across ``tp_mesh`` by ``plan``, after checking every split divides evenly.

    Parameters become DTensors on ``tp_mesh``; modules' head-count attributes become per-rank counts, so attention
    code that reshapes with ``view(B, T, self.num_heads, head_dim)`` keeps working unchanged. With
    ``sequence_parallel``, activations between blocks are split along the sequence as well.
    """
    tp = tp_mesh.size()
    check_divisible(model, stack, plan, tp)
    tied = _tied_weights(model)
    styles = _styles(sequence_parallel=sequence_parallel)
    parallel_plan: dict[str, ParallelStyle] = {name: styles[style] for name, style in plan.items()}
    if sequence_parallel:
        parallel_plan.update(dict.fromkeys(_column_parallel_parents(stack, plan), ReplicateInputs()))
    parallelize_module(model, tp_mesh, parallel_plan)
    for owner, user in tied:
        # Parallelising each module gave the shared weight two DTensors; both are split by vocabulary, so one serves.
        user.weight = owner.weight
    for block in stack.blocks:
        for module in block.modules():
            for attribute, count in _head_counts(module):
                setattr(module, attribute, count // tp)


def _head_counts(module: nn.Module) -> list[tuple[str, int]]:
    """The head-count attributes ``module`` sets, with their values."""
    return [(name, value) for name in HEAD_COUNT_ATTRIBUTES if isinstance(value := getattr(module, name, None), int)]


def _column_parallel_parents(stack: DecoderStack, plan: dict[str, TensorParallelStyle]) -> set[str]:
    """The attention and MLP modules: parents of a block's column-parallel projections, where sequences are gathered."""
    parents = set()
    for name, style in plan.items():
        if style != "colwise" or not _inside(name, stack.name):
            continue
        parent = name.rsplit(".", 1)[0]
        if parent.count(".") == stack.name.count(".") + 1:
            raise ValueError(
                f"sequence_parallel=True needs the projections of a block inside submodules (attention, MLP), but "
                f"{name} sits directly in its block. Pass sequence_parallel=False."
            )
        parents.add(parent)
    return parents


def _block_rules(stack: DecoderStack) -> dict[str, TensorParallelStyle]:
    linear_names = sorted(
        {name.rsplit(".", 1)[-1] for name, module in stack.blocks[0].named_modules() if isinstance(module, nn.Linear)}
    )
    for rules in BLOCK_RULES.values():
        if linear_names and all(name in rules for name in linear_names):
            return rules
    raise ValueError(
        f"No tensor-parallel plan found for the blocks of {stack.name}: their Linear layers are "
        f"{', '.join(linear_names) or 'none'}, and no known family ({', '.join(BLOCK_RULES)}) names them all. "
        f"Pass tp_plan, for example tp_plan={{'{stack.name}.*.attn.q': 'colwise', '{stack.name}.*.attn.out': "
        f"'rowwise', ...}}, with styles {', '.join(TensorParallelStyle.__args__)}."
    )


def _hugging_face_plan(model: nn.Module) -> dict[str, TensorParallelStyle] | None:
    """The plan a Hugging Face model carries, in lightdist's styles and full module names."""
    for name, module in model.named_modules():
        own = getattr(module, "_tp_plan", None)
        if not own:
            continue
        unknown = sorted({style for style in own.values() if style not in HUGGING_FACE_STYLES})
        if unknown:
            raise ValueError(
                f"{type(module).__name__} carries a tensor-parallel plan with styles lightdist does not apply yet: "
                f"{', '.join(unknown)}. Pass tp_plan to choose the styles yourself."
            )
        prefix = f"{name}." if name else ""
        return {prefix + pattern: HUGGING_FACE_STYLES[style] for pattern, style in own.items()}
    return None


def _vocabulary_plan(model: nn.Module, stack: DecoderStack) -> dict[str, TensorParallelStyle]:
    """The token embedding and the LM head: outside the stack, as many rows/outputs as the vocabulary."""
    outside = [(name, module) for name, module in model.named_modules() if not _inside(name, stack.name)]
    heads = [(name, m) for name, m in outside if isinstance(m, nn.Linear)]
    if not heads:
        return {}
    head_name, head = max(heads, key=lambda item: item[1].out_features)
    plan: dict[str, TensorParallelStyle] = {head_name: "head"}
    for name, module in outside:
        if isinstance(module, nn.Embedding) and module.num_embeddings == head.out_features:
            plan[name] = "vocab"
    return plan


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


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
    for block_name, module in stack.blocks[0].named_modules():
        for attribute, count in _head_counts(module):
            if count % tp:
                where = f"{stack.name}.0.{block_name}" if block_name else f"{stack.name}.0"
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide {attribute}={count} of {where}: each rank must hold "
                    "whole attention heads. Choose a tensor_parallel_size that divides the number of heads"
                    + (
                        " (replicating key/value heads is not supported yet)."
                        if attribute in _KEY_VALUE_HEAD_ATTRIBUTES
                        else "."
                    )
                )
    modules = dict(model.named_modules())
    split_sizes = {
        "colwise": ("out_features", "output features"),
        "head": ("out_features", "vocabulary size"),
        "rowwise": ("in_features", "input features"),
        "vocab": ("num_embeddings", "vocabulary size"),
    }
    for name, style in plan.items():
        if style not in split_sizes:
            continue
        attribute, what = split_sizes[style]
        size = getattr(modules[name], attribute)
        if size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the {what} of {name} ({attribute}={size}). "
                "Choose a tensor_parallel_size that divides it"
                + (", or pad the vocabulary to a multiple of it." if style in ("vocab", "head") else ".")
            )


def _tied_weights(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(first owner, later user) pairs of modules sharing one ``weight`` Parameter."""
    owners: dict[int, nn.Module] = {}
    pairs = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            if id(weight) in owners:
                pairs.append((owners[id(weight)], module))
            else:
                owners[id(weight)] = module
    return pairs
