"""The tensor-parallel plan: which style each module of a model takes, and the check that every split divides.

A plan is a mapping from module name to style. It comes from, first that applies: the ``tp_plan`` option
(``fnmatch`` patterns, so ``"model.layers.*.self_attn.q_proj"`` works); the model's own plan (Hugging Face models
carry one as ``tp_plan``); the name rules below, matched against the Linear layers of the first decoder block; the
data flow of that block (``lightdist.dataflow``). Every other module with parameters is replicated.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from lightdist.dataflow import trace_block_plan
from lightdist.parallel.expert_parallel import moe_blocks
from lightdist.parallel.structure import (
    DecoderStack,
    in_features,
    is_projection,
    out_features,
    within,
)
from lightdist.parallel.tensor.heads import attention_heads
from lightdist.parallel.tensor.styles import COLUMN_PARALLEL, FUSED, TensorParallelStyle

__all__ = [
    "BLOCK_RULES",
    "HUGGING_FACE_STYLES",
    "check_divisible",
    "discover_plan",
    "fused_parts",
    "replicated_key_values",
]

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


# Hugging Face's names for the styles it writes into models' ``tp_plan``.
HUGGING_FACE_STYLES: dict[str, TensorParallelStyle] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "vocab",
    "colwise_gather_output": "head",
    "replicated_with_grad_allreduce": "replicate",
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
        if style in FUSED:
            for part in fused_parts(modules, name, style):
                if part % tp:
                    raise ValueError(
                        f"tensor_parallel_size={tp} does not divide the {style} projections fused in {name} "
                        f"(widths {', '.join(map(str, fused_parts(modules, name, style)))}). Choose a "
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
        if style in COLUMN_PARALLEL:
            children.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name)
    return children


def fused_parts(modules: dict[str, nn.Module], name: str, style: TensorParallelStyle) -> tuple[int, ...]:
    """The widths of the projections a fused Linear computes: q, k, v from its attention's head counts; gate, up."""
    features = out_features(modules[name])
    if style == "gate_up":
        return (features // 2, features // 2)
    counts = attention_heads(modules[name.rsplit(".", 1)[0]] if "." in name else modules[""])
    if counts is None:
        return (features // 3,) * 3
    head_dim = features // (counts.heads + 2 * counts.kv_heads)
    return (counts.heads * head_dim, counts.kv_heads * head_dim, counts.kv_heads * head_dim)


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
