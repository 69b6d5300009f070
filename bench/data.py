"""Data throughput: tokenizing a corpus, and loading windows for training, against what a GPU step consumes.

Tokenizing: the standard library's docstrings (lightdist/models/python_docs.py), copied into ``--files`` JSON-lines
files of about ``--megabytes`` in all, with a byte-level BPE of ``--vocab-size`` tokens trained on them, by

- ``tokenizers`` alone: ``Tokenizer.encode_batch_fast`` over every document, in this process (its own threads);
- ``lightdist prepare`` with one process, and with one per core (each file a process).

Loading: windows of ``--seq-len`` + 1 tokens of the prepared corpus, shuffled and dealt to rank 0 of ``--ranks`` as
``TokenDataModule`` deals them, ``--batch`` a batch, read by ``--workers`` loader processes, from local disk and from
S3 (moto's server on 127.0.0.1, one Python process: a floor for real S3). The last column is the GPU rate those
tokens per second would keep fed: the 0.95B reference Llama's fastest measured rate on one H200, 84,475 tokens/s
(plain PyTorch + ``torch.compile``, docs/performance.md), so 1.0x or more means the loader is never what a step waits
for.

    python bench/data.py
    python bench/data.py --megabytes 4 --files 2 --batches 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ranks import local_s3
from tokenizers import Tokenizer
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightdist.data.prepare import prepare
from lightdist.data.token_shards import TokenShards
from lightdist.models.data import TokenWindows
from lightdist.models.python_docs import MODULES, train_tokenizer, write_corpus

GPU_TOKENS_PER_SECOND = 84_475  # docs/performance.md: Llama 1b, one H200, plain PyTorch + torch.compile


def corpus(folder: Path, megabytes: float, files: int) -> list[Path]:
    """The docstrings, copied until the files hold about ``megabytes`` together."""
    docstrings = write_corpus(folder / "docstrings", MODULES)
    documents = [line for file in docstrings for line in file.read_text().splitlines()]
    size = sum(len(line) + 1 for line in documents)
    copies = max(1, round(megabytes * 2**20 / size / files))
    paths = []
    for i in range(files):
        path = folder / "corpus" / f"part-{i}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for _ in range(copies) for line in documents))
        paths.append(path)
    return paths


def tokenizing(files: list[Path], tokenizer: Path, output: Path) -> list[tuple[str, float, int]]:
    """Seconds and tokens of each way."""
    rust = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    documents = [json.loads(line)["text"] for file in files for line in file.read_text().splitlines()]
    started = time.perf_counter()
    tokens = sum(len(encoding.ids) + 1 for encoding in rust.encode_batch_fast(documents, add_special_tokens=False))
    rows = [("tokenizers alone, its threads", time.perf_counter() - started, tokens)]
    for processes in (1, os.cpu_count() or 1):
        shutil.rmtree(output, ignore_errors=True)
        started = time.perf_counter()
        index = prepare([str(file) for file in files], str(tokenizer), str(output), processes=processes, progress=False)
        rows.append((f"lightdist prepare, {processes} process(es)", time.perf_counter() - started, index["tokens"]))
    return rows


def loading(url: str, seq_len: int, batch: int, ranks: int, workers: int, batches: int) -> float:
    """Tokens per second rank 0's loader delivers, after its first batch."""
    windows = TokenWindows(TokenShards.open(url), seq_len)
    sampler = DistributedSampler(windows, num_replicas=ranks, rank=0, shuffle=True, seed=0, drop_last=True)
    loader = StatefulDataLoader(windows, batch_size=batch, sampler=sampler, num_workers=workers, drop_last=True)
    iterator = iter(loader)
    next(iterator)
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch * seq_len / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=64.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--vocab-size", type=int, default=32_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        files = corpus(folder, args.megabytes, args.files)
        tokenizer = train_tokenizer(files[:1], folder / "tokenizer", vocab_size=args.vocab_size)
        megabytes = sum(file.stat().st_size for file in files) / 2**20
        print(f"corpus: {megabytes:.1f} MiB of text in {len(files)} files, {os.cpu_count()} cores")
        print(f"{'tokenizing':<36} {'seconds':>8} {'tokens/s':>12}")
        for way, seconds, tokens in tokenizing(files, tokenizer, folder / "tokens"):
            print(f"{way:<36} {seconds:>8.2f} {tokens / seconds:>12,.0f}", flush=True)
        print(f"{'loading, rank 0 of ' + str(args.ranks):<36} {'tokens/s':>12} {'x one H200 step':>16}")
        with local_s3("bench") as bucket:
            prepare([str(file) for file in files], str(tokenizer), f"{bucket}/tokens", progress=False)
            for source, url in (("local disk", str(folder / "tokens")), ("S3 (moto)", f"{bucket}/tokens")):
                rate = loading(url, args.seq_len, args.batch, args.ranks, args.workers, args.batches)
                print(f"{source:<36} {rate:>12,.0f} {rate / GPU_TOKENS_PER_SECOND:>15.1f}x", flush=True)


if __name__ == "__main__":
    main()
