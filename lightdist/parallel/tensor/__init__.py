"""Megatron-style tensor parallelism for models nobody wrote for it: find the plan, check it divides, apply it.

``plan.py`` finds each module's style and checks the splits divide; ``styles.py`` holds the styles as torch's
``ParallelStyle``; ``apply.py`` splits the model, laying out each attention and MLP module as its code needs (per-rank
head counts, ``heads.py``; or the unsplit shapes on DTensors, ``global_layout.py``).
"""

from lightdist.parallel.tensor.apply import (
    UnitLayout,
    apply_tensor_parallel,
    block_units,
    parallel_styles,
    prepare_units,
)
from lightdist.parallel.tensor.heads import (
    AttentionHeads,
    attention_heads,
    block_attention_heads,
    model_attention_heads,
)
from lightdist.parallel.tensor.plan import BLOCK_RULES, check_divisible, discover_plan, replicated_key_values
from lightdist.parallel.tensor.styles import (
    Colwise,
    FusedColwiseParallel,
    ReplicateInputs,
    ReplicateParallel,
    Rowwise,
    TensorParallelStyle,
    reorder_optimizer_state,
    reorder_rows,
)

__all__ = [
    "BLOCK_RULES",
    "AttentionHeads",
    "Colwise",
    "FusedColwiseParallel",
    "ReplicateInputs",
    "ReplicateParallel",
    "Rowwise",
    "TensorParallelStyle",
    "UnitLayout",
    "apply_tensor_parallel",
    "attention_heads",
    "block_attention_heads",
    "block_units",
    "check_divisible",
    "discover_plan",
    "model_attention_heads",
    "parallel_styles",
    "prepare_units",
    "reorder_optimizer_state",
    "reorder_rows",
    "replicated_key_values",
]
