"""The names a checkpoint's tensors take in the model, and tensors the model holds as several of the checkpoint's.

A checkpoint and the model it fills do not always name or cut their weights alike. transformers 5 holds a Mixtral's
experts stacked in one tensor per layer (``mlp.experts.gate_up_proj``, every expert's ``w1`` and ``w3`` in one) where
its checkpoints hold one tensor per expert; LitGPT's ``GPT`` holds q, k and v in one ``attn.qkv`` that a Hugging Face
Llama holds in three. Each such model tensor is read as a ``Stacked`` or ``Concatenated`` view of the stored ones:
no tensor is assembled in memory, each rank reads the pieces of the slice it holds (``pieces``), an expert-parallel
rank only its own experts' tensors.

Two ways to name them: ``renamed`` takes a user's map of checkpoint names to model names (regular expressions, as
``from_pretrained(key_mapping=...)`` takes them); ``converted_as_transformers_does`` reads transformers' own
conversions for the model's family, the ones ``from_pretrained`` applies.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "Concatenated",
    "KeyMap",
    "Source",
    "Stacked",
    "Stored",
    "converted_as_transformers_does",
    "pieces",
    "renamed",
]


@dataclass(frozen=True)
class Stored:
    """A tensor as a safetensors file stores it."""

    file: str
    start: int  # the byte where the tensor's data begins in its file
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Stacked:
    """Tensors of one shape stacked along a new first dimension (a layer's experts)."""

    parts: tuple[Source, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)


@dataclass(frozen=True)
class Concatenated:
    """Tensors joined along dimension ``dim`` (q, k and v in one projection)."""

    parts: tuple[Source, ...]
    dim: int

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        return (*first[: self.dim], sum(part.shape[self.dim] for part in self.parts), *first[self.dim + 1 :])


Source = Stored | Stacked | Concatenated
KeyMap = Callable[[dict[str, Stored]], dict[str, Source]]  # the stored tensors by their names in the model


def pieces(
    source: Source, target: Tensor, offsets: Sequence[int], lengths: Sequence[int]
) -> Iterator[tuple[Stored, Tensor, Sequence[int], Sequence[int]]]:
    """The stored tensors' slices that the slice of ``source`` at ``offsets`` of ``lengths`` is made of, each with
    the view of ``target`` (that slice's tensor) it fills."""
    if isinstance(source, Stored):
        yield source, target, offsets, lengths
    elif isinstance(source, Stacked):
        for index in range(lengths[0]):
            yield from pieces(source.parts[offsets[0] + index], target[index], offsets[1:], lengths[1:])
    else:
        dim, begin, within = source.dim, offsets[source.dim], 0
        for part in source.parts:
            size = part.shape[dim]
            low, high = max(begin, within), min(begin + lengths[dim], within + size)
            if low < high:
                part_offsets = [*offsets[:dim], low - within, *offsets[dim + 1 :]]
                part_lengths = [*lengths[:dim], high - low, *lengths[dim + 1 :]]
                yield from pieces(part, target.narrow(dim, low - begin, high - low), part_offsets, part_lengths)
            within += size


def _joined(parts: Sequence[Source], dim: int, name: str) -> Source:
    if len(parts) == 1:
        return parts[0]
    if len({(part.dtype, part.shape[:dim] + part.shape[dim + 1 :]) for part in parts}) > 1:
        shapes = ", ".join(f"{part.shape} {part.dtype}" for part in parts)
        raise ValueError(
            f"{name} is joined along dimension {dim} from checkpoint tensors that do not join: {shapes}. "
            "Check the key map."
        )
    return Concatenated(tuple(parts), dim)


def renamed(key_map: Mapping[str, str]) -> KeyMap:
    """The checkpoint's tensors under the model's names: a name that one of ``key_map``'s regular expressions
    matches whole takes its replacement (``\\1`` and the like refer to its groups), the first that matches; the
    others keep their names. Tensors that several names send to one are concatenated along their first dimension,
    in the order of the entries that matched them (q, k and v into one ``qkv``)."""
    patterns = [(re.compile(pattern), replacement) for pattern, replacement in key_map.items()]

    def entry_and_name(key: str) -> tuple[int, str]:
        for entry, (pattern, replacement) in enumerate(patterns):
            if match := pattern.fullmatch(key):
                return entry, match.expand(replacement)
        return len(patterns), key

    def rename(stored: dict[str, Stored]) -> dict[str, Source]:
        joined: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for key in stored:
            entry, name = entry_and_name(key)
            joined[name].append((entry, key))
        return {name: _joined([stored[key] for _, key in sorted(keys)], 0, name) for name, keys in joined.items()}

    return rename


def converted_as_transformers_does(model: nn.Module) -> KeyMap | None:
    """transformers' own conversions of ``model``'s family from its checkpoints' names and cuts to the model's, or
    None where ``model`` is no Hugging Face model or its family has none. Renamings, and merges of per-expert tensors
    (stacked, then concatenated), are read as views; a family that needs another operation is refused by name."""
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        dot_natural_key,
        rename_source_key,
    )

    if not isinstance(model, transformers.PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    renamings = [transform for transform in transforms if not isinstance(transform, WeightConverter)]

    def joined_as(converter: WeightConverter, name: str, by_pattern: dict[str, list[Stored]]) -> Source:
        """What ``converter``'s operations make of the tensors each of its patterns matched, as a view."""
        parts: dict[str, Source | list[Source]] = dict(by_pattern)
        for operation in converter.operations:
            if isinstance(operation, MergeModulelist) and operation.dim == 0:
                parts = {pattern: Stacked(tuple(tensors)) for pattern, tensors in parts.items()}
            elif isinstance(operation, Concatenate):
                ordered = [parts[pattern] for pattern in converter.source_patterns if pattern in parts]
                parts = {name: _joined([_one(part) for part in ordered], operation.dim, name)}
            else:
                raise ValueError(
                    f"{type(model).__name__}'s checkpoints hold {name} in pieces that transformers joins with "
                    f"{type(operation).__name__}, which lightdist does not read by slices. Start from a checkpoint "
                    "lightdist saved (load it once with from_pretrained and save it), or pass a key map."
                )
        (joined,) = parts.values()
        return _one(joined)

    def convert(stored: dict[str, Stored]) -> dict[str, Source]:
        converted: dict[str, Source] = {}
        merged: dict[str, dict[str, list[Stored]]] = defaultdict(lambda: defaultdict(list))
        converter_of: dict[str, WeightConverter] = {}
        for key in sorted(stored, key=dot_natural_key):  # the order transformers stacks experts in
            name, pattern = rename_source_key(key, renamings, converters)
            if pattern is None:
                converted[name] = stored[key]
                continue
            converter_of[name] = next(c for c in converters if pattern in c.source_patterns)
            merged[name][pattern].append(stored[key])
        for name, by_pattern in merged.items():
            converted[name] = joined_as(converter_of[name], name, by_pattern)
        return converted

    return convert


def _one(part: Source | list[Source]) -> Source:
    if isinstance(part, list):
        (part,) = part
    return part
