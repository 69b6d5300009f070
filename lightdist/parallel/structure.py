"""Finding the decoder stack of an arbitrary LLM module.

Every parallelism needs the same fact about a model: which ``ModuleList`` holds the repeated transformer blocks.
FSDP shards per block, activation checkpointing wraps per block, tensor parallelism plans per block and the pipeline
cuts between blocks. Users do not tell us; we find it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = [
    "CONTAINERS",
    "DecoderStack",
    "find_decoder_stack",
    "find_repeated_blocks",
    "holders",
    "in_features",
    "is_conv1d",
    "is_projection",
    "out_features",
    "within",
]


@dataclass(frozen=True)
class DecoderStack:
    """The repeated blocks of a model, and where they live (``name`` is the ModuleList's qualified name)."""

    name: str
    blocks: nn.ModuleList

    def __len__(self) -> int:
        return len(self.blocks)

    def contains(self, module_name: str) -> bool:
        """Whether ``module_name`` (a name in the model) is the stack or inside it."""
        return within(module_name, self.name)

    @property
    def enclosing(self) -> list[str]:
        """Names of the modules around the stack, the model itself (``""``) first: what a training step may call as
        the model (``self(x)``, ``self.model(x)``, ``self.model.model(x)`` for ``model.model.layers``)."""
        return holders(self.name)


def holders(name: str) -> list[str]:
    """Names of the modules that hold the module called ``name``, the model itself (``""``) first."""
    parts = name.split(".")[:-1]
    return [".".join(parts[:depth]) for depth in range(len(parts) + 1)]


def within(name: str, parent: str) -> bool:
    """Whether the module called ``name`` is ``parent`` or inside it (names as ``named_modules`` gives them)."""
    return name == parent or name.startswith(parent + ".")


def is_projection(module: nn.Module) -> bool:
    """A Linear, or Hugging Face's ``Conv1D`` (GPT-2's projections: a Linear storing its weight input x output)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_conv1d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(getattr(module, "nf", None), int) and weight is not None and weight.shape[-1] == module.nf


def out_features(module: nn.Module) -> int:
    return module.nf if is_conv1d(module) else module.out_features


def in_features(module: nn.Module) -> int:
    return module.nx if is_conv1d(module) else module.in_features


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_decoder_stack(model: nn.Module) -> DecoderStack:
    """The ``ModuleList`` of same-class blocks holding the most parameters, not inside a module that repeats (a
    block's list of attention heads, where the blocks themselves are in an ``nn.Sequential``).

    Raises a ``ValueError`` naming the module lists it saw when the model has none with parameters, so the user knows
    what to change.
    """
    repeated = [name for found in _repeated_modules(model).values() for name, _ in found]
    candidates = []
    seen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        block_types = {type(block) for block in module}
        seen.append(f"{name} ({len(module)} x {', '.join(sorted(t.__name__ for t in block_types))})")
        inside_a_block = any(name.startswith(f"{other}.") for other in repeated)
        if len(block_types) == 1 and _num_params(module) > 0 and not inside_a_block:
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


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _repeated_modules(model: nn.Module) -> dict[type, list[tuple[str, nn.Module]]]:
    """The (name, module) of each class with parameters of which ``model`` holds two or more modules, containers
    (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) left out: one holding the blocks is no block."""
    instances: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if name and not isinstance(module, CONTAINERS) and any(True for _ in module.parameters()):
            instances.setdefault(type(module), []).append((name, module))
    return {cls: found for cls, found in instances.items() if len(found) > 1}


def find_repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks of a model that keeps them outside one ``ModuleList`` (separate attributes, an
    ``nn.Sequential``), in definition order: the instances of the class with the most parameters among those repeated
    at least twice and never nested in another repeated module. An empty list when no class qualifies.

    "Never nested" is what tells blocks from the layers inside them: some ``nn.Linear`` sit inside blocks, so
    ``nn.Linear`` does not qualify even if a head is one too.
    """
    repeated = _repeated_modules(model)
    names = [name for found in repeated.values() for name, _ in found]

    def nested(name: str) -> bool:
        return any(name.startswith(other + ".") for other in names)

    outermost = [found for found in repeated.values() if not any(nested(name) for name, _ in found)]
    if not outermost:
        return []
    blocks = max(outermost, key=lambda found: sum(_num_params(module) for _, module in found))
    return [name for name, _ in blocks]
