"""Sharded checkpoints at any fsspec URL: a local path, ``file://``, ``s3://``, ``gs://``, ``memory://``.

A checkpoint is a directory: every rank's shards and DCP's index (written by DCP's fsspec writer, s3fs and gcsfs
underneath), Lightning's non-tensor state in ``meta.pt``, and last a ``COMPLETE`` manifest listing every file and its
size, and the step saved. Only a directory with its manifest is a checkpoint: a save cut short by a crash, a kill or a
storage fault leaves a directory without one, which loaders refuse and which no pointer ever names. Object stores have
no atomic rename of a directory, so this marker written last is what makes a save all-or-nothing, and its time is when
the save ended: ``checkpoints_under`` orders a run's checkpoints by it.

A pointer is a small file (``last.ckpt``) naming a checkpoint beside it; rewriting it replaces one object, which is
atomic on every store, where rewriting a checkpoint in place would not be.

Credentials come from the environment or the filesystems' own configuration (``AWS_*``, ``~/.aws`` profiles,
``GOOGLE_APPLICATION_CREDENTIALS``), never from lightdist's options, so they never land in a saved config or a log.
Other settings (endpoint, region, profile name, retries) may also come from ``storage_options``, which become
fsspec's own per-protocol configuration in the process.

Loading runs no code from the checkpoint. DCP's index (``.metadata``) is a pickle, which DCP unpickles as is; here it
is unpickled by an unpickler that builds DCP's metadata classes, torch's sizes and dtypes and paths, and refuses any
other global. Shards hold tensor bytes only, and ``meta.pt`` is read with ``torch.load(weights_only=True)``, torch's
default, unless the caller asks otherwise.
"""

from __future__ import annotations

import json
import pickle
import posixpath
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import fsspec.config
import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

# Not re-exported by torch.distributed.checkpoint (torch 2.13), but the writer and reader DCP documents for fsspec.
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from lightdist.torch_internals import FsspecReader

__all__ = [
    "IN_FLIGHT_RANGES",
    "LIGHTNING_METADATA_FILENAME",
    "MANIFEST_FILENAME",
    "SavedCheckpoint",
    "UnsafeCheckpointError",
    "check_same_model",
    "check_writable",
    "checkpoints_under",
    "commit",
    "configure",
    "is_complete",
    "load_sharded",
    "read_metadata",
    "reader",
    "reject_credentials",
    "remove",
    "resolve",
    "saved_model_tensors",
    "storage_fix",
    "write_pointer",
]

MANIFEST_FILENAME = "COMPLETE"
# Where Lightning's sharded checkpoints keep its non-tensor state (its private ``_METADATA_FILENAME``), so that
# Lightning's own loading reads lightdist's checkpoints too; a test pins the two equal.
LIGHTNING_METADATA_FILENAME = "meta.pt"
# Range requests under way at once, in a reader's one call: object stores and their emulators throttle more.
IN_FLIGHT_RANGES = 8
_POINTER_KEY = "lightdist_checkpoint"


# Option names that hold a secret (s3fs's key/secret/token, botocore's aws_*, passwords). gcsfs's ``token`` is allowed
# where it names a method or a key file rather than holding the token itself.
_CREDENTIAL_NAME = re.compile(r"^key$|secret|password|access_key|session_token|^token$")
_GCS_TOKEN_METHODS = ("anon", "google_default", "cache", "cloud", "browser")


def reject_credentials(storage_options: Mapping[str, Any], where: str = "storage_options") -> None:
    """Refuse secrets in ``storage_options``: they would be saved with the run's config and logged with it."""
    for name, value in storage_options.items():
        if isinstance(value, Mapping):
            reject_credentials(value, f"{where}[{name!r}]")
        elif _CREDENTIAL_NAME.search(str(name).lower()) and not (
            name == "token" and isinstance(value, str) and (value in _GCS_TOKEN_METHODS or value.endswith(".json"))
        ):
            raise ValueError(
                f"{where}[{name!r}] is a credential, and storage_options are saved with the run's config and logged. "
                "Give credentials through the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "GOOGLE_APPLICATION_CREDENTIALS), a profile ({'s3': {'profile': 'name'}}) or a key file "
                "({'gs': {'token': '/path/key.json'}})."
            )


def configure(storage_options: Mapping[str, Mapping[str, Any]]) -> None:
    """Make ``storage_options`` ({protocol: {option: value}}) the defaults of fsspec's filesystems in this process.

    fsspec's own configuration reaches every filesystem created afterwards for a checkpoint URL: lightdist's, DCP's
    writers and readers, and those Lightning creates itself to find ``ckpt_path="last"`` before any strategy hook.
    """
    reject_credentials(storage_options)
    for protocol, options in storage_options.items():
        fsspec.config.conf.setdefault(protocol, {}).update(options)


def check_writable(url: str) -> None:
    """Write and delete a small object under ``url``, so that a missing bucket, missing credentials, an unreachable
    endpoint or a read-only location fail at setup with the fix, not at the first save hours into training."""
    fs, path = url_to_fs(url)
    probe = posixpath.join(path, f".lightdist-write-check-{uuid.uuid4().hex}")
    try:
        if isinstance(fs, LocalFileSystem):  # object stores have no directories; their makedirs creates buckets
            fs.makedirs(path, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as error:
        raise ValueError(f"lightdist cannot write checkpoints to {url}: {storage_fix(error, url)}") from error


def storage_fix(error: Exception, url: str, *, reading: bool = False) -> str:
    """The storage problem ``error`` stands for, and what fixes it; ``reading``: the URL was read from, not written."""
    kinds = " ".join(cls.__name__ for cls in type(error).__mro__)
    if "Credentials" in kinds:
        return (
            f"{error}. Set the credentials in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS) or choose a profile in storage_options."
        )
    if isinstance(error, FileNotFoundError):
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return (
            f"{error}. Correct the URL."
            if reading
            else f"{error}. Create the bucket {bucket!r} first, or correct the URL."
        )
    if isinstance(error, PermissionError):
        if reading:
            return (
                f"{error}. Grant these credentials read access there (S3: s3:GetObject and s3:ListBucket; GCS: "
                "storage.objects.get and storage.objects.list)."
            )
        return f"{error}. Grant these credentials write access there, or choose another dirpath."
    if "Connection" in kinds or "Timeout" in kinds:
        return (
            f"{error}. Check the endpoint (AWS_ENDPOINT_URL, or storage_options' endpoint_url) and that the storage "
            "is reachable from this machine."
        )
    if reading:
        return f"{type(error).__name__}: {error}."
    return f"{type(error).__name__}: {error}. Choose a dirpath these processes can write to."


def commit(url: str, metadata: bytes, *, step: int | None = None) -> None:
    """Write Lightning's metadata, then the manifest that makes the checkpoint at ``url`` complete. Rank 0 only,
    after every rank's shards are written: DCP's coordinator (rank 0) returns from a save only then.

    ``step``, the global step saved, orders saves that object storage dates to the same second."""
    fs, path = url_to_fs(url)
    fs.pipe_file(posixpath.join(path, LIGHTNING_METADATA_FILENAME), metadata)
    fs.invalidate_cache(path)  # the shards were written by other processes
    manifest = {"files": _file_sizes(fs, path), "global_step": step}
    _replace(fs, posixpath.join(path, MANIFEST_FILENAME), json.dumps(manifest, indent=1).encode())


def is_complete(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.isfile(posixpath.join(path, MANIFEST_FILENAME))


def write_pointer(url: str, checkpoint_url: str) -> None:
    """Make ``url`` name the checkpoint at ``checkpoint_url``, by its path relative to the pointer's directory, so a
    run's directory can move between buckets whole."""
    fs, path = url_to_fs(url)
    name = posixpath.relpath(url_to_fs(checkpoint_url)[1], posixpath.dirname(path))
    if fs.isdir(path):  # a full checkpoint saved under this name before: the pointer takes its place
        remove(url)
    _replace(fs, path, json.dumps({_POINTER_KEY: name}).encode())


def resolve(url: str) -> str:
    """The complete checkpoint that ``url`` is or points to; a clear error when there is none."""
    fs, path = url_to_fs(url)
    fs.invalidate_cache()  # other processes write checkpoints and pointers
    if fs.isfile(path):
        name = _pointed_at(fs, path)
        if name is None:
            raise ValueError(
                f"{url} is a file, not a lightdist sharded checkpoint (a directory) or a pointer to one. Load "
                "single-file Lightning checkpoints with Lightning's own strategies."
            )
        url = posixpath.join(posixpath.dirname(url.rstrip("/")), name)
        fs, path = url_to_fs(url)
    if not fs.isdir(path):
        raise FileNotFoundError(f"No checkpoint at {url}.")
    problem, _ = _inspect(fs, path, _file_sizes(fs, path))
    if problem is not None:
        raise ValueError(
            f"The checkpoint at {url} is {problem}. Resume from another checkpoint: ckpt_path='last' picks the newest "
            "complete one under the ModelCheckpoint's dirpath."
        )
    return url


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint found in storage, and why it cannot be loaded (``None``: it is complete and whole)."""

    url: str
    problem: str | None
    saved_at: datetime  # when its save ended (its manifest was written); unfinished, when one of its files was
    step: int | None  # the global step saved, where its manifest says
    pointer: str | None = None  # a pointer beside it (last.ckpt) that names it
    cut_short: bool = False  # a save that never committed: never a checkpoint, by the atomic commit


def checkpoints_under(*urls: str) -> list[SavedCheckpoint]:
    """Every checkpoint under ``urls``, at any depth, the newest save first: sharded checkpoints, complete or not, and
    single-file checkpoints, which lightdist cannot load. Pointers are not checkpoints: they name one."""
    found = {checkpoint.url: checkpoint for url in urls for checkpoint in _checkpoints_under(url)}
    return sorted(found.values(), key=_save_order, reverse=True)


def _save_order(checkpoint: SavedCheckpoint) -> tuple[datetime, float]:
    """Saves dated to the same moment (object stores date to the second) by step; one that never finished (no step)
    as the newer of the two, so that it is named rather than passed over as an old leftover."""
    return checkpoint.saved_at, checkpoint.step if checkpoint.step is not None else float("inf")


def _checkpoints_under(url: str) -> list[SavedCheckpoint]:
    fs, root = url_to_fs(url)
    fs.invalidate_cache()  # other processes write checkpoints
    try:
        files = fs.find(root, detail=True)
    except FileNotFoundError:  # no bucket, or no folder: nothing saved yet; the setup's write check names the fix
        return []
    except Exception as error:
        raise ValueError(f"lightdist cannot look for checkpoints under {url}: {storage_fix(error, url)}") from error
    directories: dict[str, dict[str, int]] = {}
    for path, info in files.items():
        directory, name = posixpath.split(path)
        directories.setdefault(directory, {})[name] = info["size"]
    sharded, single_files, pointers = [], [], {}
    for directory, sizes in directories.items():
        if any(name in _SHARDED_FILES or name.endswith(".distcp") for name in sizes):
            sharded.append(directory)
            continue
        for name, size in sizes.items():
            path = posixpath.join(directory, name)
            if not name.endswith(".ckpt"):
                continue
            named = _pointed_at(fs, path) if size <= 4096 else None  # a pointer holds one relative path
            if named is None:
                single_files.append(path)
            else:
                pointers[posixpath.normpath(posixpath.join(directory, named))] = _spelled_as(url, root, path)
    found = []
    for directory in sharded:
        problem, step = _inspect(fs, directory, directories[directory])
        written = MANIFEST_FILENAME if MANIFEST_FILENAME in directories[directory] else max(directories[directory])
        saved_at = fs.modified(posixpath.join(directory, written))
        cut_short = MANIFEST_FILENAME not in directories[directory]
        found.append(
            SavedCheckpoint(
                _spelled_as(url, root, directory), problem, saved_at, step, pointers.get(directory), cut_short
            )
        )
    problem = "a single-file checkpoint, which lightdist's sharded loading cannot read"
    found += [SavedCheckpoint(_spelled_as(url, root, path), problem, fs.modified(path), None) for path in single_files]
    return found


def _spelled_as(url: str, root: str, path: str) -> str:
    """``path``, which the filesystem of ``url`` lists under ``url``'s ``root``, as a URL spelled the way ``url`` is."""
    relative = posixpath.relpath(path, root)
    return url if relative == "." else f"{url.rstrip('/')}/{relative}"


DCP_INDEX_FILENAME = ".metadata"
_SHARDED_FILES = frozenset({MANIFEST_FILENAME, DCP_INDEX_FILENAME, LIGHTNING_METADATA_FILENAME})


def _inspect(fs: Any, path: str, sizes: Mapping[str, int]) -> tuple[str | None, int | None]:
    """What is wrong with the checkpoint directory ``path`` holding files of ``sizes`` (``None``: nothing), and the
    step its manifest names."""
    if MANIFEST_FILENAME not in sizes:
        problem = (
            f"incomplete: it has no {MANIFEST_FILENAME} manifest, which a save writes last, so its save was cut short"
        )
        return problem, None
    try:
        manifest = json.loads(fs.cat_file(posixpath.join(path, MANIFEST_FILENAME)))
    except ValueError:
        return f"damaged: its {MANIFEST_FILENAME} manifest cannot be read", None
    damaged = sorted(name for name, size in manifest["files"].items() if sizes.get(name) != size)
    problem = f"damaged: {', '.join(damaged)} missing or of the wrong size since it was saved" if damaged else None
    return problem, manifest.get("global_step")


def _pointed_at(fs: Any, path: str) -> str | None:
    """The path, relative to its folder, of the checkpoint that the file at ``path`` names, if it is a pointer."""
    try:
        pointer = json.loads(fs.cat_file(path))
    except ValueError:  # bytes that are not JSON, UTF-8 decoding included
        return None
    return pointer.get(_POINTER_KEY) if isinstance(pointer, dict) else None


def remove(url: str) -> None:
    """Delete the checkpoint or pointer at ``url``, its manifest first, so that a deletion cut short never leaves
    something that looks complete."""
    fs, path = url_to_fs(url)
    if fs.isfile(path):
        fs.rm_file(path)
        return
    manifest_path = posixpath.join(path, MANIFEST_FILENAME)
    if fs.exists(manifest_path):
        fs.rm_file(manifest_path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def load_sharded(state: dict[str, Any], url: str) -> None:
    """Fill ``state``'s tensors in place with this rank's share of the checkpoint at ``url`` (a collective)."""
    dcp.load(state, storage_reader=reader(url))


def saved_model_tensors(url: str) -> dict[str, TensorStorageMetadata]:
    """The whole size and dtype of each model tensor in the checkpoint at ``url``, by name, from DCP's index."""
    metadata = reader(url).read_metadata()
    tensors = {}
    for key, entry in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]  # ("state_dict", "model.wte.weight"), ("optimizer_0", "state", ...)
        if path[0] == "state_dict" and isinstance(entry, TensorStorageMetadata):
            tensors[path[1]] = entry
    return tensors


def check_same_model(url: str, shapes: Mapping[str, Sequence[int]], *, strict: bool) -> None:
    """Refuse the checkpoint at ``url`` unless it holds a tensor of the same whole shape for each name in ``shapes``
    (every rank's, the model's whole state), and nothing else where ``strict``: listing all that differs, before
    anything is loaded, where DCP would stop at the first difference deep inside a collective."""
    saved = {name: list(entry.size) for name, entry in saved_model_tensors(url).items()}
    problems = []
    if strict and (missing := sorted(shapes.keys() - saved.keys())):
        problems.append(f"missing from the checkpoint: {_first_few(missing)}")
    if strict and (unexpected := sorted(saved.keys() - shapes.keys())):
        problems.append(f"not in this model: {_first_few(unexpected)}")
    resized = [
        f"{name} {saved[name]} there, {list(shapes[name])} here"
        for name in sorted(shapes.keys() & saved.keys())
        if saved[name] != list(shapes[name])
    ]
    if resized:
        problems.append(f"of another shape: {_first_few(resized)}")
    if problems:
        raise ValueError(
            f"The checkpoint at {url} holds a different model; " + "; ".join(problems) + ". Load it into the model "
            "it was saved from (the same configuration), or set `self.strict_loading = False` in the LightningModule "
            "to load only the tensors both have, where the shapes agree."
        )


def _first_few(items: list[str], shown: int = 6) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


class UnsafeCheckpointError(ValueError):
    """A checkpoint's index names code to run where only DCP's metadata belongs."""


def reader(url: str) -> FsspecReader:
    """DCP's reader for the checkpoint at ``url``, which unpickles its index safely."""
    return _SafeReader(url)


class _SafeReader(FsspecReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP's own body, with the unpickler swapped.
        rank = kwargs.get("rank")
        index = DCP_INDEX_FILENAME if rank is None else f"__{rank}{DCP_INDEX_FILENAME}"
        with self.fs.create_stream(self.fs.concat_path(self.path, index), "rb") as metadata_file:
            metadata = _IndexUnpickler(metadata_file, str(self.path)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_INDEX_GLOBALS = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }
)


class _IndexUnpickler(pickle.Unpickler):
    """Builds what DCP writes in ``.metadata`` (checked against torch 2.11-2.13's) and nothing else."""

    def __init__(self, file: Any, url: str) -> None:
        super().__init__(file)
        self.url = url

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _INDEX_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"The checkpoint at {self.url} is not loaded: its DCP index (.metadata) asks to build {module}.{name}, "
            "which no checkpoint's index holds, and unpickling it could run code. Load checkpoints from sources you "
            "trust: your own runs' storage."
        )


def read_metadata(url: str, *, weights_only: bool | None = None) -> dict[str, Any]:
    """The non-tensor part of Lightning's checkpoint at ``url``."""
    fs, path = url_to_fs(url)
    with fs.open(posixpath.join(path, LIGHTNING_METADATA_FILENAME), "rb") as file:
        return torch.load(file, weights_only=weights_only)


def _file_sizes(fs: Any, path: str) -> dict[str, int]:
    return {posixpath.basename(info["name"]): info["size"] for info in fs.ls(path, detail=True)}


def _replace(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: written aside first, then moved into place."""
    staging = f"{path}.partial"
    fs.pipe_file(staging, data)
    fs.mv(staging, path)
