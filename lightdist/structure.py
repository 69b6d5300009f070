"""Finding the decoder stack of an arbitrary LLM module.

Every parallelism needs the same fact about a model: which ``ModuleList`` holds the repeated transformer blocks.
FSDP shards per block, activation checkpointing wraps per block, tensor parallelism plans per block and the pipeline
cuts between blocks. Users do not tell us; we find it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["DecoderStack", "find_decoder_stack"]


@dataclass(frozen=True)
class DecoderStack:
    """The repeated blocks of a model, and where they live (``name`` is the ModuleList's qualified name)."""

    name: str
    blocks: nn.ModuleList

    def __len__(self) -> int:
        return len(self.blocks)

    def contains(self, module_name: str) -> bool:
        """Whether ``module_name`` (a name in the model) is the stack or inside it."""
        return module_name == self.name or module_name.startswith(self.name + ".")


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_decoder_stack(model: nn.Module) -> DecoderStack:
    """The ``ModuleList`` of same-class blocks holding the most parameters.

    Raises a ``ValueError`` naming the module lists it saw when the model has none with parameters, so the user knows
    what to change.
    """
    candidates = []
    seen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        block_types = {type(block) for block in module}
        seen.append(f"{name} ({len(module)} x {', '.join(sorted(t.__name__ for t in block_types))})")
        if len(block_types) == 1 and _num_params(module) > 0:
            candidates.append((_num_params(module), name, module))
    if not candidates:
        listed = "; ".join(seen) if seen else "none"
        raise ValueError(
            f"Could not find the decoder stack of {type(model).__name__}: lightdist looks for an nn.ModuleList of "
            f"repeated blocks of one class with parameters. ModuleLists seen: {listed}. Keep the transformer blocks "
            "in one nn.ModuleList (for example `self.layers = nn.ModuleList(Block(cfg) for _ in range(n))`)."
        )
    _, name, blocks = max(candidates, key=lambda c: c[0])
    return DecoderStack(name=name, blocks=blocks)
