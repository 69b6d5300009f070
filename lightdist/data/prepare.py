"""``lightdist prepare``: a text corpus tokenized once into shards of token ids, for any number of runs to stream.

    lightdist prepare s3://corpus/*.jsonl.gz --tokenizer ./tokenizer --output s3://corpus/tokens

Text comes in as JSON lines or a JSON array (a field per record, ``text`` unless named), Parquet, plain ``.txt`` (a
file is a document), or a Hugging Face ``datasets.save_to_disk`` folder; local or at any fsspec URL, compressed or
not. A Hugging Face tokenizer (its ``tokenizer.json``, read by the Rust ``tokenizers``) encodes each document, and
its end-of-sequence token follows each. Out come flat shards of token ids and ``index.json`` (token_shards.py).

Files are tokenized in parallel, one process each, and each file's shards are followed by a small marker: a run
that is interrupted and started again keeps the files it finished. The index is written last, so a reader never
takes a half-written output for a complete one.

Why not LitData's ``optimize``: its chunks carry their own headers and its reader deals chunks to ranks by the
number of ranks, so the batches of a run restarted on fewer nodes differ. Flat shards are what Megatron and nanoGPT
keep tokens in: any token range is one byte range, which lets a sampler that knows nothing of shards draw the same
global batches on any number of ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import posixpath
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import chain
from multiprocessing import Manager, get_context
from typing import Any

import numpy as np
from fsspec.compression import compr
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression
from tqdm import tqdm

from lightdist.checkpoint.storage import storage_fix
from lightdist.data.token_shards import FORMAT, INDEX, Tokenizer, dtype_for

__all__ = ["load_tokenizer", "main", "prepare"]

SHARD_TOKENS = 2**27  # 256 MiB of uint16 ids a shard: large enough that listing a bucket stays short
TEXT_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".arrow")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_BATCH_CHARS = 4 * 2**20  # text encoded per call: the tokenizer spreads a batch over its own threads
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")


@dataclass(frozen=True)
class Source:
    url: str
    size: int
    kind: str  # "json", "txt", "parquet" or "arrow"


def load_tokenizer(url: str, eos_token: str | None = None) -> tuple[Any, Tokenizer]:
    """The ``tokenizers`` tokenizer at ``url`` (a folder holding ``tokenizer.json``, or the file), and what an index
    records of it. The end-of-sequence token is ``eos_token``, else the one ``tokenizer_config.json`` names, else the
    first of the usual names the vocabulary holds."""
    from tokenizers import Tokenizer as RustTokenizer

    fs, path = url_to_fs(url)
    folder = path if fs.isdir(path) else posixpath.dirname(path)
    file = posixpath.join(folder, "tokenizer.json") if fs.isdir(path) else path
    try:
        data = fs.cat_file(file)
    except FileNotFoundError as error:
        raise ValueError(
            f"No tokenizer.json at {url}: give a Hugging Face tokenizer's folder or its tokenizer.json (a tokenizer "
            "saved by transformers' save_pretrained, or by tokenizers' Tokenizer.save)."
        ) from error
    tokenizer = RustTokenizer.from_str(data.decode())
    eos_token = eos_token or _configured_eos(fs, folder)
    candidates = [eos_token] if eos_token else [name for name in _EOS_NAMES if tokenizer.token_to_id(name) is not None]
    eos_id = tokenizer.token_to_id(candidates[0]) if candidates else None
    if eos_id is None:
        named = (
            f"its end-of-sequence token {eos_token!r} is not in its vocabulary"
            if eos_token
            else "no end-of-sequence token was found"
        )
        raise ValueError(f"The tokenizer at {url}: {named}. Name the token that ends documents with --eos-token.")
    record = Tokenizer(
        sha256=hashlib.sha256(data).hexdigest(),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_token_id=eos_id,
        name=url,
    )
    return tokenizer, record


def _configured_eos(fs: Any, folder: str) -> str | None:
    config = posixpath.join(folder, "tokenizer_config.json")
    if not fs.exists(config):
        return None
    eos = json.loads(fs.cat_file(config)).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def sources_in(inputs: Sequence[str]) -> list[Source]:
    """Every text file the inputs name (files, folders searched recursively, globs), in a stable order: the order of
    the inputs, each one's files sorted by name, or a saved dataset's in its own order."""
    found: list[Source] = []
    for url in inputs:
        try:
            found += _sources_at(url)
        except OSError as error:
            raise ValueError(f"lightdist prepare cannot read {url}: {storage_fix(error, url, reading=True)}") from error
    return found


def _sources_at(url: str) -> list[Source]:
    fs, path = url_to_fs(url)
    if fs.isdir(path) and fs.exists(posixpath.join(path, "state.json")):  # datasets.save_to_disk
        state = json.loads(fs.cat_file(posixpath.join(path, "state.json")))
        paths = [posixpath.join(path, file["filename"]) for file in state["_data_files"]]
    elif fs.isdir(path):
        paths = sorted(p for p in fs.find(path) if _kind(p))
    else:
        paths = sorted(fs.glob(path)) if any(c in path for c in "*?[") else [path]
    if not paths:
        raise ValueError(f"{url} names no text files ({', '.join(TEXT_SUFFIXES)}, optionally compressed).")
    for file in paths:
        if not _kind(file):
            raise ValueError(
                f"{fs.unstrip_protocol(file)}: not a file lightdist prepare reads. It reads "
                f"{', '.join(TEXT_SUFFIXES)} (JSON as lines or an array), optionally {', '.join(COMPRESSIONS)}."
            )
    return [Source(fs.unstrip_protocol(file), fs.size(file), _kind(file)) for file in paths]


def _kind(path: str) -> str | None:
    for compression in COMPRESSIONS:
        path = path.removesuffix(compression)
    suffix = posixpath.splitext(path)[1]
    return {".jsonl": "json", ".json": "json", ".txt": "txt", ".parquet": "parquet", ".arrow": "arrow"}.get(suffix)


@dataclass
class _Tally:
    """What a source held besides documents: records skipped, by reason, and the fields of those without text (for
    the error that names the right field)."""

    skipped: Counter = field(default_factory=Counter)
    other_fields: set[str] = field(default_factory=set)
    records: int = 0

    def text_of(self, record: Any, text_field: str) -> str | None:
        self.records += 1
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            self.skipped[f"records without a text field {text_field!r}"] += 1
            self.other_fields.update(record if isinstance(record, dict) else ())
            return None
        if not value:
            self.skipped["empty documents"] += 1
            return None
        return value


def documents(source: Source, text_field: str, tally: _Tally) -> Iterator[tuple[str, int]]:
    """Each document's text in ``source``, with the bytes of the file read so far (0 where unknown); records without
    text are counted in ``tally``, never dropped silently."""
    if source.kind in ("parquet", "arrow"):
        yield from _arrow_documents(source, text_field, tally)
        return
    fs, path = url_to_fs(source.url)
    compression = infer_compression(path)
    with fs.open(path, "rb") as raw:
        file = compr[compression](raw, mode="rb") if compression else raw
        text = io.TextIOWrapper(file, encoding="utf-8", errors="strict")
        try:
            if source.kind == "txt":
                document = tally.text_of({text_field: text.read()}, text_field)
                yield from [(document, 0)] if document else []
                return
            first = text.read(1)
            while first.isspace():
                first = text.read(1)
            records = json.loads(first + text.read()) if first == "[" else map(json.loads, _lines(first, text))
            for record in records:
                document = tally.text_of(record, text_field)
                if document:
                    yield document, raw.tell()
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{source.url}: bytes that are not UTF-8 after record {tally.records} ({error.reason}). Convert the "
                "file to UTF-8 (iconv -f <its encoding> -t utf-8) and prepare again: finished files are kept."
            ) from error
        except json.JSONDecodeError as error:
            raise ValueError(f"{source.url}: record {tally.records + 1} is not JSON ({error}).") from error


def _lines(first: str, text: io.TextIOWrapper) -> Iterator[str]:
    """The JSON lines of ``text``, whose first character was read already; blank lines are not records."""
    for line in chain([first + text.readline()], text):
        if line.strip():
            yield line


def _arrow_documents(source: Source, text_field: str, tally: _Tally) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as error:
        raise ValueError(f"{source.url}: {source.kind} needs pyarrow: pip install 'lightdist[data]'.") from error

    fs, path = url_to_fs(source.url)
    with fs.open(path, "rb") as file:
        if source.kind == "parquet":
            parquet = pyarrow.parquet.ParquetFile(file)
            names = parquet.schema_arrow.names
            batches = parquet.iter_batches(columns=[text_field]) if text_field in names else iter(())
        else:
            stream = pyarrow.ipc.open_stream(file)
            names = stream.schema.names
            batches = iter(stream)
        if text_field not in names:
            raise ValueError(
                f"{source.url} has no column {text_field!r}; its columns are {', '.join(names)}. Name the text "
                "column with --text-field."
            )
        for batch in batches:
            for value in batch.column(text_field).to_pylist():
                document = tally.text_of({text_field: value}, text_field)
                if document:
                    yield document, 0


class _ShardWriter:
    """Token ids into shards of ``shard_tokens`` each (a source's last one fewer), named after the source."""

    def __init__(self, output: str, source_index: int, dtype: str, shard_tokens: int) -> None:
        self.fs, self.folder = url_to_fs(output)
        self.prefix, self.dtype, self.shard_tokens = f"{source_index:05d}", dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.file: Any = None

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self.file is None:
                name = f"{self.prefix}-{len(self.shards):04d}.bin"
                self.file = self.fs.open(posixpath.join(self.folder, name), "wb")
                self.shards.append({"path": name, "tokens": 0})
            room = self.shard_tokens - self.shards[-1]["tokens"]
            self.file.write(ids[:room].astype(self.dtype).tobytes())
            self.shards[-1]["tokens"] += len(ids[:room])
            ids = ids[room:]
            if self.shards[-1]["tokens"] == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def tokenize_source(
    index: int,
    source: Source,
    tokenizer_url: str,
    eos_token: str | None,
    text_field: str,
    output: str,
    shard_tokens: int,
    report: Callable[[int, int, int], None],
) -> dict[str, Any]:
    """One source into its shards, then its marker; returns the marker. ``report(bytes, documents, tokens)`` is
    called with what each batch added."""
    tokenizer, record = load_tokenizer(tokenizer_url, eos_token)
    writer = _ShardWriter(output, index, dtype_for(record.vocab_size), shard_tokens)
    tally = _Tally()
    totals: Counter = Counter()
    batch: list[str] = []
    reported = 0  # bytes of the source reported read

    def flush(position: int) -> None:
        nonlocal reported
        encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
        ids = np.fromiter((i for encoding in encodings for i in (*encoding.ids, record.eos_token_id)), dtype=np.int64)
        writer.write(ids)
        totals.update(documents=len(batch), tokens=len(ids))
        report(max(position - reported, 0), len(batch), len(ids))
        reported = max(position, reported)
        batch.clear()

    chars = 0
    for text, position in documents(source, text_field, tally):
        batch.append(text)
        chars += len(text)
        if chars >= _BATCH_CHARS:
            flush(position)
            chars = 0
    if batch:
        flush(source.size)
    report(max(source.size - reported, 0), 0, 0)
    writer.close()
    marker = {
        "source": asdict(source),
        "tokenizer": record.sha256,
        "shards": writer.shards,
        "documents": totals["documents"],
        "tokens": totals["tokens"],
        "skipped": dict(tally.skipped),
        "other_fields": sorted(tally.other_fields)[:20],
    }
    fs, folder = url_to_fs(output)
    fs.pipe_file(posixpath.join(folder, f"{index:05d}.json"), json.dumps(marker).encode())
    return marker


def _put(queue: Any, *counts: int) -> None:
    queue.put(counts)


def prepare(
    inputs: Sequence[str],
    tokenizer: str,
    output: str,
    *,
    text_field: str = "text",
    eos_token: str | None = None,
    processes: int | None = None,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``output``; returns the index written. Files finished by an earlier, interrupted run
    into the same output are kept. ``progress``: show the bar (``None``: where the output is a terminal)."""
    _, record = load_tokenizer(tokenizer, eos_token)
    sources = sources_in(inputs)
    fs, folder = url_to_fs(output)
    if fs.exists(posixpath.join(folder, INDEX)):
        index = json.loads(fs.cat_file(posixpath.join(folder, INDEX)))
        if index["tokenizer"]["sha256"] == record.sha256 and index["sources"] == [asdict(s) for s in sources]:
            print(f"lightdist prepare: {output} already holds these sources, tokenized by this tokenizer.")
            return index
        raise ValueError(
            f"{output} already holds a prepared dataset of other sources or another tokenizer: choose another "
            "output, or delete that one first."
        )
    fs.makedirs(folder, exist_ok=True)
    markers = {i: _finished(fs, folder, i, source, record) for i, source in enumerate(sources)}
    todo = [i for i, marker in markers.items() if marker is None]
    kept = len(sources) - len(todo)
    bar = tqdm(
        total=sum(sources[i].size for i in todo),
        unit="B",
        unit_scale=True,
        desc=f"tokenizing {len(todo)} files" + (f" ({kept} kept from an earlier run)" if kept else ""),
        disable=None if progress is None else not progress,
    )
    counted = Counter()
    started = time.perf_counter()

    def advance(size: int, documents: int, tokens: int) -> None:
        counted.update(documents=documents, tokens=tokens)
        rate = counted["tokens"] / max(time.perf_counter() - started, 1e-9)
        bar.set_postfix(documents=counted["documents"], tokens=counted["tokens"], tokens_per_s=f"{rate:,.0f}")
        bar.update(size)

    work = partial(_tokenize, sources, tokenizer, eos_token, text_field, output, shard_tokens)
    workers = min(processes or os.cpu_count() or 1, len(todo))
    if workers <= 1:
        for i in todo:
            markers[i] = work(i, advance)
    else:
        markers.update(_in_processes(work, todo, workers, advance))
    bar.close()
    index = _index(sources, markers, record)
    fs.pipe_file(posixpath.join(folder, INDEX), json.dumps(index, indent=1).encode())
    return index


def _tokenize(
    sources: list[Source],
    tokenizer: str,
    eos_token: str | None,
    text_field: str,
    output: str,
    shard_tokens: int,
    i: int,
    report: Callable[[int, int, int], None],
) -> dict[str, Any]:
    return tokenize_source(i, sources[i], tokenizer, eos_token, text_field, output, shard_tokens, report)


def _in_processes(
    work: Callable, todo: list[int], workers: int, advance: Callable[[int, int, int], None]
) -> dict[int, dict[str, Any]]:
    """``work`` on each source in its own process; each tokenizer's threads share the cores out between them."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    with (
        Manager() as manager,
        ProcessPoolExecutor(workers, get_context("spawn"), initializer=_tokenizer_threads, initargs=(threads,)) as pool,
    ):
        queue = manager.Queue()
        futures = {pool.submit(work, i, partial(_put, queue)): i for i in todo}
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.2)
            while not queue.empty():
                advance(*queue.get())
        while not queue.empty():
            advance(*queue.get())
        return {futures[future]: future.result() for future in futures}


def _tokenizer_threads(threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the tokenizer first encodes a batch


def _finished(fs: Any, folder: str, i: int, source: Source, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """The marker of ``source`` left by an earlier run into this output, if that run finished it alike."""
    path = posixpath.join(folder, f"{i:05d}.json")
    if not fs.exists(path):
        return None
    marker = json.loads(fs.cat_file(path))
    if marker["source"] != asdict(source) or marker["tokenizer"] != tokenizer.sha256:
        raise ValueError(
            f"{fs.unstrip_protocol(folder)} holds shards of an earlier run with other sources or another tokenizer: "
            "choose another output, or delete that one first."
        )
    return marker


def _index(sources: list[Source], markers: dict[int, dict[str, Any]], tokenizer: Tokenizer) -> dict[str, Any]:
    skipped: Counter = Counter()
    for marker in markers.values():
        skipped.update(marker["skipped"])
    documents = sum(marker["documents"] for marker in markers.values())
    if documents == 0:
        fields = sorted({name for marker in markers.values() for name in marker["other_fields"]})
        seen = f" Their records have the fields {', '.join(fields)}: name one with --text-field." if fields else ""
        skips = ", ".join(f"{count} {what}" for what, count in skipped.items()) or "all empty"
        raise ValueError(f"No documents in {len(sources)} files ({skips}).{seen}")
    return {
        "format": FORMAT,
        "dtype": dtype_for(tokenizer.vocab_size),
        "tokenizer": asdict(tokenizer),
        "documents": documents,
        "tokens": sum(marker["tokens"] for marker in markers.values()),
        "skipped": dict(skipped),
        "empty_files": [s.url for i, s in enumerate(sources) if markers[i]["documents"] == 0],
        "sources": [asdict(source) for source in sources],
        "shards": [shard for i in range(len(sources)) for shard in markers[i]["shards"]],
    }


def _summary(index: dict[str, Any], output: str) -> str:
    lines = [
        f"lightdist prepare: {index['documents']:,} documents, {index['tokens']:,} tokens in "
        f"{len(index['shards'])} shards at {output}"
    ]
    lines += [f"  skipped: {count:,} {what}" for what, count in index["skipped"].items()]
    lines += [f"  empty file: {url}" for url in index["empty_files"]]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightdist prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="text files, folders or globs, local or any fsspec URL")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer's folder, or its tokenizer.json")
    parser.add_argument("--output", required=True, help="the folder (local or any fsspec URL) for shards and index")
    parser.add_argument("--text-field", default="text", help="the field or column holding each document's text")
    parser.add_argument("--eos-token", help="the token that ends each document (default: the tokenizer's)")
    parser.add_argument("--processes", type=int, help="files tokenized at once (default: one per core)")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens a shard holds, about")
    args = parser.parse_args(argv)
    try:
        index = prepare(
            args.inputs,
            args.tokenizer,
            args.output,
            text_field=args.text_field,
            eos_token=args.eos_token,
            processes=args.processes,
            shard_tokens=args.shard_tokens,
        )
    except ValueError as error:
        parser.exit(2, f"lightdist prepare: {error}\n")
    print(_summary(index, args.output))
