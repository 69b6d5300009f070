"""Pretrained Hugging Face weights read straight into a split model: each rank reads only the bytes of its shards.

``from_pretrained`` on every rank holds the whole model in each process's memory before any of it is split: a 70B
model on a node of 8 ranks needs over 2 TB of host memory. Here the model is built with its parameters on the meta
device (``parameters_on_meta``, buffers real, as accelerate's ``init_empty_weights`` does), split into its layout,
materialized shard by shard, and only then filled: torch's distributed checkpoint plans which slice of each tensor
every rank's shards hold, and ``SafetensorsReader`` reads those slices from the checkpoint's safetensors files at any
fsspec URL with range reads (each file's header gives every tensor's offset). Rows a rank holds are one range; a
slice along a later dimension (a row-parallel weight) reads the rows it spans. Where the model names or cuts its
weights otherwise than its checkpoint (transformers' per-expert checkpoints of stacked experts, LitGPT's fused
``qkv``), ``lightdist.checkpoint.pretrained_keys`` reads each weight as a view of the stored tensors.

torch's own ``HuggingFaceStorageReader`` opens each file with ``safe_open``, a local path only: it does not serve
``s3://`` or ``gs://``. Fused projections come back into their tensor-parallel order through the model's own
``load_state_dict`` hooks, the same as lightdist's checkpoints.
"""

from __future__ import annotations

import json
import math
import posixpath
import struct
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch import Tensor, nn
from torch.distributed.checkpoint import Metadata, StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.futures import Future

from lightdist.checkpoint.pretrained_keys import KeyMap, Source, Stored, converted_as_transformers_does, pieces, renamed
from lightdist.checkpoint.storage import IN_FLIGHT_RANGES, storage_fix

__all__ = [
    "PretrainedLoad",
    "PretrainedWeights",
    "SafetensorsReader",
    "check_pretrained",
    "load_pretrained",
    "parameters_on_meta",
]

INDEX = "model.safetensors.index.json"
READ_BYTES = 16 * 2**20  # the most one range read holds
IN_FLIGHT_BYTES = 4 * READ_BYTES  # the most the reads under way hold in memory beside the model, together
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class PretrainedWeights:
    """Where a LightningModule's starting weights are: the Hugging Face checkpoint directory at ``url`` (a path or any
    fsspec URL), whose names are those of the module's parameters under the module path ``prefix`` (``"model"`` for
    a model held as ``self.model``). ``new`` names parameters the checkpoint lacks on purpose (a new head): they keep
    their initialisation. ``key_map`` renames the checkpoint's tensors to the model's names, as regular expressions
    (``lightdist.checkpoint.pretrained_keys.renamed``: a LitGPT or nanoGPT-style model started from a Hugging Face
    checkpoint); without it a Hugging Face model takes transformers' own conversions for its family."""

    url: str
    prefix: str = ""
    new: tuple[str, ...] = ()
    key_map: Mapping[str, str] = field(default_factory=dict)

    def fills(self, name: str) -> bool:
        """Whether the checkpoint fills the LightningModule's parameter ``name``: all but those named new."""
        return name not in self.new


@dataclass
class PretrainedLoad:
    """What filling a model from a checkpoint did on this rank."""

    url: str
    bytes_read: int
    seconds: float
    initialised: list[str] = field(default_factory=list)  # parameters named new, kept as initialised

    def summary(self) -> str:
        kept = f"; initialised, not in it: {', '.join(self.initialised)}" if self.initialised else ""
        read = f"{self.bytes_read / 2**20:.1f} MiB read on this rank in {self.seconds:.1f} s"
        return f"weights from {self.url}: {read}{kept}"


class SafetensorsReader(StorageReader):
    """torch's distributed checkpoint reads a Hugging Face safetensors checkpoint at any fsspec URL through this: the
    index and each file's header, then for every slice a rank asks for, the byte range of the rows it spans.
    ``key_map`` gives the stored tensors their names in the model."""

    def __init__(self, url: str, key_map: KeyMap | None = None) -> None:
        super().__init__()
        self.url = url
        self.fs, self.path = url_to_fs(url)
        self.key_map = key_map
        self.bytes_read = 0
        self.tensors: dict[str, Source] = {}  # by their names in the model

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self) -> Metadata:
        if not self.tensors:
            try:
                stored = {name: tensor for file in self._files() for name, tensor in self._read_header(file).items()}
            except (FileNotFoundError, ValueError):  # a shard missing or truncated: named where it is found
                raise
            except Exception as error:  # no access, no credentials, no connection
                fix = storage_fix(error, self.url, reading=True)
                raise ValueError(f"lightdist cannot read the pretrained weights at {self.url}: {fix}") from error
            self.tensors = self.key_map(stored) if self.key_map else dict(stored)
        return Metadata(
            state_dict_metadata={
                name: TensorStorageMetadata(
                    TensorProperties(dtype=tensor.dtype),
                    torch.Size(tensor.shape),
                    [ChunkStorageMetadata(torch.Size([0] * len(tensor.shape)), torch.Size(tensor.shape))],
                )
                for name, tensor in self.tensors.items()
            },
            storage_data={MetadataIndex(name): tensor for name, tensor in self.tensors.items()},
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every slice of ``plan``, its ranges read concurrently (fsspec's ``cat_ranges``: object stores answer many
        requests at once) in groups of at most ``IN_FLIGHT_RANGES`` ranges and ``IN_FLIGHT_BYTES``."""
        targets = [planner.resolve_tensor(item).detach() for item in plan.items]
        group: list[_Range] = []
        for item, target in zip(plan.items, targets, strict=True):
            source = self.tensors[item.storage_index.fqn]
            for stored, view, offsets, lengths in pieces(source, target, item.storage_offsets, item.lengths):
                for read in _ranges(view, stored, offsets, lengths):
                    held = sum(r.end - r.start for r in group) + read.end - read.start
                    if group and (len(group) == IN_FLIGHT_RANGES or held > IN_FLIGHT_BYTES):
                        self._read_group(group)
                        group = []
                    group.append(read)
        self._read_group(group)
        for item, target in zip(plan.items, targets, strict=True):
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_group(self, group: list[_Range]) -> None:
        if not group:
            return
        datas = self.fs.cat_ranges([r.file for r in group], [r.start for r in group], [r.end for r in group])
        for read, data in zip(group, datas, strict=True):
            if isinstance(data, Exception):
                raise data
            self.bytes_read += len(data)
            read.fill(data)

    def _files(self) -> list[str]:
        index = posixpath.join(self.path, INDEX)
        if self.fs.exists(index):
            weight_map = json.loads(self._read(index))["weight_map"]
            return [posixpath.join(self.path, name) for name in sorted(set(weight_map.values()))]
        files = sorted(self.fs.glob(posixpath.join(self.path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(
                f"{self.url} holds no safetensors checkpoint: neither {INDEX} nor a *.safetensors file. Point it at a "
                "directory written by save_pretrained (safetensors, the default since transformers 4.35)."
            )
        return files

    def _read_header(self, file: str) -> dict[str, Stored]:
        try:
            size = self.fs.size(file)
        except FileNotFoundError as error:
            raise FileNotFoundError(
                f"{self.url}: {INDEX} names {posixpath.basename(file)}, which is missing."
            ) from error
        (length,) = struct.unpack("<Q", self._read(file, 0, 8))
        header = json.loads(self._read(file, 8, 8 + length))
        header.pop("__metadata__", None)
        stored = {}
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if 8 + length + end > size:
                raise ValueError(
                    f"{posixpath.basename(file)} in {self.url} is truncated: {name} ends at byte {8 + length + end} "
                    f"of a file of {size}. Copy the checkpoint again."
                )
            stored[name] = Stored(file, 8 + length + begin, _DTYPES[entry["dtype"]], tuple(entry["shape"]))
        return stored

    def _read(self, file: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self.fs.cat_file(file, start=start, end=end)
        self.bytes_read += len(data)
        return data


@dataclass(frozen=True)
class _Range:
    """Bytes ``start`` to ``end`` of ``file``, and what fills the model's tensor with them."""

    file: str
    start: int
    end: int
    fill: Callable[[bytes], None]


def _ranges(target: Tensor, stored: Stored, offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[_Range]:
    """The reads that fill ``target`` with the slice of ``stored`` at ``offsets`` of ``lengths``: the rows it spans,
    at most ``READ_BYTES`` a range."""
    if not stored.shape:  # a scalar
        end = stored.start + stored.dtype.itemsize
        yield _Range(stored.file, stored.start, end, partial(_fill, target, stored, ()))
        return
    row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
    within = tuple(slice(offset, offset + length) for offset, length in zip(offsets[1:], lengths[1:], strict=True))
    step = max(1, READ_BYTES // max(row_bytes, 1))
    for done in range(0, lengths[0], step):
        rows = min(step, lengths[0] - done)
        start = stored.start + (offsets[0] + done) * row_bytes
        fill = partial(_fill, target[done : done + rows], stored, (slice(None), *within))
        yield _Range(stored.file, start, start + rows * row_bytes, fill)


def _fill(target: Tensor, stored: Stored, within: tuple[slice, ...], data: bytes) -> None:
    """Copy into ``target`` the part ``within`` of rows of ``stored`` that ``data`` holds."""
    shape = (-1, *stored.shape[1:]) if stored.shape else ()
    target.copy_(_tensor_of(data, stored.dtype).reshape(shape)[within])


def _tensor_of(data: bytes, dtype: torch.dtype) -> Tensor:
    """The tensor ``data`` holds, without copying it: it is only read, into the model's own tensors."""
    if not data:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # torch warns that bytes are read-only: nothing writes to them
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(data, dtype=dtype)


def check_pretrained(model: nn.Module, weights: PretrainedWeights) -> SafetensorsReader:
    """Raise, naming the weight, where the checkpoint of ``weights`` lacks one of ``model``'s or holds it in another
    shape: from the checkpoint's headers and the unsplit model, on the meta device or not, before any memory is
    taken for it. Returns the reader, its headers read, for ``load_pretrained``."""
    reader = _reader_for(model, weights)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    _read_items(model.state_dict(keep_vars=True), parameters, reader, weights, {})
    return reader


def load_pretrained(
    model: nn.Module,
    weights: PretrainedWeights,
    aliases: dict[str, str] | None = None,
    reader: SafetensorsReader | None = None,
) -> PretrainedLoad:
    """Fill ``model``'s parameters, whole or split over the ranks (every rank calls this), from the checkpoint of
    ``weights``, each rank reading only its shards' bytes. ``aliases``: a parameter name this rank holds in place of
    another's, which the checkpoint saves it under (a head tied to the embedding, on the pipeline's last stage).
    ``reader``: the one ``check_pretrained`` returned for the unsplit model, so that headers are read once."""
    began = time.perf_counter()
    reader = reader or _reader_for(model, weights)
    state = get_model_state_dict(model)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    wanted, initialised = _read_items(state, parameters, reader, weights, aliases or {})
    with warnings.catch_warnings():  # that one process loads alone is what is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(wanted, storage_reader=reader, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state)
    return PretrainedLoad(weights.url, reader.bytes_read, time.perf_counter() - began, initialised)


def _reader_for(model: nn.Module, weights: PretrainedWeights) -> SafetensorsReader:
    """A reader naming the checkpoint's tensors as ``model`` (unsplit) names them."""
    if weights.key_map:
        return SafetensorsReader(weights.url, renamed(weights.key_map))
    held = model.get_submodule(weights.prefix.rstrip(".")) if weights.prefix else model
    return SafetensorsReader(weights.url, converted_as_transformers_does(held))


def _read_items(
    state: dict[str, Tensor],
    parameters: dict[str, nn.Parameter],
    reader: SafetensorsReader,
    weights: PretrainedWeights,
    aliases: dict[str, str],
) -> tuple[dict[str, Tensor], list[str]]:
    """The tensors of ``state`` to read, by their names in the checkpoint, and the parameters named new; raises for a
    parameter the checkpoint lacks (a weight shared by several modules counts once) or holds in another shape."""
    stored = reader.read_metadata().state_dict_metadata
    first_name = {id(parameter): name for name, parameter in reversed(parameters.items())}
    wanted: dict[str, Tensor] = {}
    missing, initialised = [], []
    prefix = f"{weights.prefix.rstrip('.')}." if weights.prefix else ""
    for name, tensor in state.items():
        key = aliases.get(name, name).removeprefix(prefix)
        if key in stored:
            if tuple(stored[key].size) != tuple(tensor.shape):
                raise ValueError(
                    f"{name} has shape {tuple(tensor.shape)} in the model and {tuple(stored[key].size)} in "
                    f"{weights.url} ({key}): the checkpoint is of another model or config."
                )
            wanted[key] = tensor
        elif name in weights.new:
            initialised.append(name)
        elif name in parameters and first_name[id(parameters[name])] == name:
            missing.append(name)
    if missing:
        raise ValueError(
            f"{weights.url} lacks {len(missing)} of the model's weights: {', '.join(missing[:6])}"
            f"{', ...' if len(missing) > 6 else ''} (looked up as {missing[0].removeprefix(prefix)!r}). "
            "Check that the checkpoint is of this model and that the names' prefix is right (or give a key map from "
            "its names to the model's); weights the model adds (a new head) are listed in `new` and keep their "
            "initialisation."
        )
    return wanted, initialised


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within, every parameter a module registers goes to the meta device, its buffers stay real (rotary tables
    computed at construction, which no checkpoint holds): the model takes no memory until it is split."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        if parameter is not None and not parameter.is_meta:
            parameter = type(parameter)(parameter.to("meta"), requires_grad=parameter.requires_grad)
        register(module, name, parameter)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
