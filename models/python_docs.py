"""A small real text corpus that ships with Python, and a tokenizer trained on it on the spot: the whole path from
text to training, where nothing may be downloaded.

    python -m lightdist.models.python_docs data/python_docs

writes ``corpus/`` (the docstrings of the standard library's modules, classes and functions, as JSON lines, one file
per module, about 0.7 MB) and ``tokenizer/`` (a byte-level BPE ``tokenizer.json`` trained on them by ``tokenizers``)
there, for ``lightdist prepare``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MODULES", "docstrings", "train_tokenizer", "write_corpus"]

MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "email", "functools", "http.client", "inspect", "io", "itertools", "json", "logging", "multiprocessing",
    "os", "pathlib", "pickle", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
    "threading", "typing", "unittest", "urllib.request", "uuid", "zipfile",
)  # fmt: skip


def docstrings(module_name: str) -> Iterator[str]:
    """The module's docstring, then each public class's and function's, and each public method's, in source order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
        seen: set[str] = set()
        for obj in [module, *(value for name, value in vars(module).items() if not name.startswith("_"))]:
            members = vars(obj).values() if inspect.isclass(obj) else ()
            for documented in [obj, *members]:
                doc = inspect.getdoc(documented) if callable(documented) or inspect.ismodule(documented) else None
                if doc and len(doc) > 40 and doc not in seen and _defined_in(documented, module_name):
                    seen.add(doc)
                    yield doc


def _defined_in(obj: object, module_name: str) -> bool:
    return inspect.ismodule(obj) or (getattr(obj, "__module__", None) or "").startswith(module_name.split(".")[0])


def write_corpus(folder: Path, modules: tuple[str, ...] = MODULES) -> list[Path]:
    """One JSON-lines file per module, ``{"text": ..., "module": ...}`` per docstring."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name in modules:
        file = folder / f"{name.replace('.', '_')}.jsonl"
        lines = (json.dumps({"text": doc, "module": name}) for doc in docstrings(name))
        file.write_text("".join(line + "\n" for line in lines))
        files.append(file)
    return files


def train_tokenizer(files: list[Path], folder: Path, vocab_size: int = 2048) -> Path:
    """A byte-level BPE tokenizer (GPT-2's kind) trained on the ``text`` of ``files``, with ``<|endoftext|>``, saved
    as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (json.loads(line)["text"] for file in files for line in file.read_text().splitlines())
    tokenizer.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "data/python_docs")
    corpus = write_corpus(root / "corpus")
    train_tokenizer(corpus, root / "tokenizer")
    print(f"{len(corpus)} files of docstrings in {root / 'corpus'}, a tokenizer in {root / 'tokenizer'}")
