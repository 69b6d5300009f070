"""Token ids in shards at any fsspec URL, read by range: a node downloads the windows its ranks train on, never the
corpus.

A prepared dataset (``lightdist prepare``) is a folder of flat shards of token ids and an ``index.json`` naming them
in order, with their token counts and the tokenizer that made them. The shards joined in that order are one stream of
tokens, as one flat file would be; a plain flat file (nanoGPT's ``train.bin``) is read as a stream of one shard.

Reads are byte ranges (fsspec's ``cat_ranges``, a batch's windows requested together), so what a rank downloads is
what it trains on, whichever order the sampler draws: there is no cache to size, and a shuffled epoch costs no more
than a sequential one. A window of 2048 uint16 tokens is a 4 KiB request; a GPU step of the 1B reference model takes
a few dozen of them, which object stores answer in one round trip.
"""

from __future__ import annotations

import bisect
import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fsspec.core import url_to_fs

from lightdist.checkpoint.storage import IN_FLIGHT_RANGES, storage_fix

__all__ = ["FORMAT", "INDEX", "TokenShards", "Tokenizer", "dtype_for"]

INDEX = "index.json"
FORMAT = "lightdist-tokens/1"


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned type holding every id of a vocabulary: half the bytes for vocabularies up to 65536."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class Tokenizer:
    """What a prepared dataset records of the tokenizer that made it: enough to refuse a run with another one, and a
    model whose embedding is too small for its ids."""

    sha256: str  # of its tokenizer.json
    vocab_size: int
    eos_token_id: int
    name: str = ""  # where it was read from, for messages


@dataclass
class TokenShards:
    """One stream of token ids over shards: ``read`` returns any token ranges of it."""

    url: str
    paths: list[str]  # each shard, in stream order, as the filesystem names it
    tokens: list[int]  # tokens in each shard
    dtype: str
    tokenizer: Tokenizer | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.itemsize = np.dtype(self.dtype).itemsize
        self.starts = np.concatenate([[0], np.cumsum(self.tokens)]).tolist()  # each shard's first token in the stream

    @classmethod
    def open(cls, url: str, dtype: str = "uint16", **storage_options: Any) -> TokenShards:
        """A prepared dataset's folder (it holds ``index.json``), or one flat file of ``dtype`` ids."""
        try:
            fs, path = url_to_fs(url, **storage_options)
            index = posixpath.join(path, INDEX)
            if fs.isdir(path) or fs.exists(index):
                return cls._prepared(url, fs, path, json.loads(fs.cat_file(index)), storage_options)
            size = fs.size(path)
        except (OSError, json.JSONDecodeError) as error:
            fix = storage_fix(error, url, reading=True)
            raise ValueError(f"lightdist cannot read the token data at {url}: {fix}") from error
        if size % np.dtype(dtype).itemsize:
            raise ValueError(
                f"{url} holds {size} bytes, not a whole number of {dtype} token ids: pass its dtype, or prepare the "
                "corpus with `lightdist prepare`."
            )
        return cls(url, [path], [size // np.dtype(dtype).itemsize], dtype, storage_options=storage_options)

    @classmethod
    def _prepared(cls, url: str, fs: Any, path: str, index: dict, storage_options: dict[str, Any]) -> TokenShards:
        if index.get("format") != FORMAT:
            raise ValueError(
                f"{posixpath.join(url, INDEX)} is not a lightdist token index (format {index.get('format')!r}, "
                f"expected {FORMAT!r}): prepare the corpus with `lightdist prepare`."
            )
        paths = [posixpath.join(path, shard["path"]) for shard in index["shards"]]
        tokens = [shard["tokens"] for shard in index["shards"]]
        itemsize = np.dtype(index["dtype"]).itemsize
        sizes = {posixpath.basename(info["name"]): info["size"] for info in fs.ls(path, detail=True)}
        for shard, count in zip(index["shards"], tokens, strict=True):
            found = sizes.get(shard["path"])
            if found != count * itemsize:
                state = "is missing" if found is None else f"holds {found} bytes"
                raise ValueError(
                    f"{url}: shard {shard['path']} {state}, where its index says {count} tokens ({count * itemsize} "
                    "bytes): the dataset was changed or cut short after it was prepared. Run the same "
                    "`lightdist prepare` again into a new output."
                )
        return cls(url, paths, tokens, index["dtype"], Tokenizer(**index["tokenizer"]), storage_options)

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """The tokens of each ``[start, stop)`` range of the stream, requested together, at most ``IN_FLIGHT_RANGES``
        at a time; a range across shards is read from each."""
        # fsspec's own instance, asked for each time: it is made anew in a process forked to load (a DataLoader
        # worker), where the parent's, its event loop left behind, cannot run.
        fs, _ = url_to_fs(self.url, **self.storage_options)
        pieces = [(i, piece) for i, (start, stop) in enumerate(ranges) for piece in self._pieces(start, stop)]
        data: list[list[bytes]] = [[] for _ in ranges]
        for first in range(0, len(pieces), IN_FLIGHT_RANGES):
            group = pieces[first : first + IN_FLIGHT_RANGES]
            files, starts, ends = zip(*(piece for _, piece in group), strict=True)
            read = fs.cat_ranges(list(files), list(starts), list(ends))
            for (i, (_, start, end)), chunk in zip(group, read, strict=True):
                if isinstance(chunk, Exception):
                    raise ValueError(
                        f"lightdist cannot read {self.url}: {storage_fix(chunk, self.url, reading=True)}"
                    ) from chunk
                if len(chunk) != end - start:
                    raise ValueError(
                        f"{self.url}: a shard ended {end - start - len(chunk)} bytes early: it was cut short after "
                        "the dataset was prepared. Prepare it again into a new output."
                    )
                data[i].append(chunk)
        return [np.frombuffer(b"".join(chunks), dtype=self.dtype) for chunks in data]

    def _pieces(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) are outside the {len(self)} of {self.url}")
        pieces = []
        shard = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            end = min(stop, self.starts[shard + 1])
            offset = self.starts[shard]
            pieces.append((self.paths[shard], (start - offset) * self.itemsize, (end - offset) * self.itemsize))
            start, shard = end, shard + 1
        return pieces
