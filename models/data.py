"""Token data: a corpus prepared by ``lightdist prepare`` or a flat file of token ids, read by range from any fsspec
URL (lightdist/data/token_shards.py), or a learnable arithmetic corpus made on the spot.

Samples are windows of ``seq_len + 1`` tokens at stride ``seq_len``, so every token is a target exactly once.
Under lightdist the sampler shards windows by data-parallel rank only.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightdist.data.mixture import Mixture
from lightdist.data.prepare import load_tokenizer
from lightdist.data.token_shards import TokenShards
from lightdist.data.vocabulary import check_vocabulary

__all__ = ["ARITHMETIC_ALPHABET", "TokenDataModule", "TokenWindows", "arithmetic_corpus"]

ARITHMETIC_ALPHABET = "0123456789+=\n"
_ARITHMETIC_IDS = str.maketrans({character: chr(i) for i, character in enumerate(ARITHMETIC_ALPHABET)})


def arithmetic_corpus(num_tokens: int, *, seed: int = 0) -> np.ndarray:
    """Lines like ``417+38=455``, as ids into ``ARITHMETIC_ALPHABET``.

    The sums are deterministic given the operands, so a model's loss visibly falls as it learns to add. Every rank of
    every run makes it again: all operands are drawn at once (the same stream as one line at a time), and the text
    mapped to ids in one pass.
    """
    rng = np.random.default_rng(seed)
    operands = rng.integers(0, 1000, size=(num_tokens // len("0+0=0\n") + 1, 2))  # enough of the shortest lines
    text = "".join(f"{a}+{b}={a + b}\n" for a, b in operands.tolist())[:num_tokens]
    return np.frombuffer(text.translate(_ARITHMETIC_IDS).encode(), dtype=np.uint8).astype(np.uint16)


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` over tokens ``[start, stop)``; a batch's windows are
    read together (``__getitems__``, which torch's loader calls with a batch's indices)."""

    def __init__(self, tokens: TokenShards | np.ndarray, seq_len: int, start: int = 0, stop: int | None = None) -> None:
        stop = len(tokens) if stop is None else stop
        if stop - start < seq_len + 1:
            raise ValueError(f"{stop - start} tokens cannot fill one window of seq_len={seq_len} (+1 target).")
        self.tokens, self.seq_len, self.start, self.stop = tokens, seq_len, start, stop

    def __len__(self) -> int:
        return (self.stop - self.start - 1) // self.seq_len

    def __getitem__(self, index: int) -> Tensor:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Tensor]:
        if any(not 0 <= index < len(self) for index in indices):
            raise IndexError(f"windows {indices} are not all in [0, {len(self)})")
        ranges = [(self.start + i * self.seq_len, self.start + (i + 1) * self.seq_len + 1) for i in indices]
        if isinstance(self.tokens, np.ndarray):
            windows = [self.tokens[start:stop] for start, stop in ranges]
        else:
            windows = self.tokens.read(ranges)
        return [torch.from_numpy(window.astype(np.int64)) for window in windows]


class TokenDataModule(LightningDataModule):
    """Token windows for causal language modelling.

    Args:
        data_path: URL or path of a corpus ``lightdist prepare`` made, or of a flat file of token ids, or a list of
            them to blend; ``None`` makes the arithmetic corpus in memory. Each rank reads its windows by range:
            nothing is downloaded whole.
        weights: Each corpus's share of the training samples where ``data_path`` lists several (``None``: in
            proportion to their tokens, each window once an epoch); validation takes each one's held-out tail whole.
        dtype: Element type of a flat token file (a prepared corpus names its own).
        tokenizer: The run's tokenizer (a folder or ``tokenizer.json``): a prepared corpus made by another one is
            refused before training.
        seq_len: Tokens per sample (the model sees ``seq_len`` inputs and ``seq_len`` targets).
        batch_size: Samples per batch on each data-parallel rank (8 if neither size is given).
        global_batch_size: Samples per batch over all data-parallel ranks, in place of ``batch_size``: each rank
            takes its share, so a job that restarts on another number of ranks (elastic torchrun, Ray) trains on the
            same batches.
        val_fraction: Share of the tokens, taken from the end, held out for validation.
        synthetic_tokens: Size of the arithmetic corpus when ``data_path`` is ``None``.
        shuffle: Shuffle training windows each epoch (seeded, identical on every rank).
        seed: Seed of the arithmetic corpus.
    """

    def __init__(
        self,
        data_path: str | list[str] | None = None,
        weights: list[float] | None = None,
        dtype: Literal["uint16", "uint32"] = "uint16",
        tokenizer: str | None = None,
        seq_len: int = 64,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        val_fraction: float = 0.05,
        synthetic_tokens: int = 262_144,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
        if batch_size is not None and global_batch_size is not None:
            raise ValueError(
                f"batch_size={batch_size} (per rank) and global_batch_size={global_batch_size} (over all ranks) both"
                " set the batch: give one of them."
            )
        self.data_path, self.weights, self.dtype, self.tokenizer = data_path, weights, dtype, tokenizer
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.batch_size = 8 if batch_size is None and global_batch_size is None else batch_size
        self.val_fraction, self.synthetic_tokens = val_fraction, synthetic_tokens
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.train: TokenWindows | Mixture | None = None
        self.val: TokenWindows | Mixture | None = None
        self.corpora: list[TokenShards] = []

    def setup(self, stage: str | None = None) -> None:
        # Lightning sets up the data before it builds the model: a global batch that does not split fails here.
        self.batch_size = self._batch_per_rank()
        if self.data_path is None:
            tokens: TokenShards | np.ndarray = arithmetic_corpus(self.synthetic_tokens, seed=self.seed)
            self.train, self.val = self._split(tokens)
            return
        paths = [self.data_path] if isinstance(self.data_path, str) else self.data_path
        self.corpora = [TokenShards.open(path, self.dtype) for path in paths]
        self._check_tokenizers()
        if len(paths) == 1 and self.weights is None:
            self.train, self.val = self._split(self.corpora[0])
            return
        trains, vals = zip(*(self._split(tokens) for tokens in self.corpora), strict=True)
        self.train = Mixture(trains, self.weights, seed=self.seed)
        self.val = Mixture(vals) if self.val_fraction > 0 else None

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends each document of the prepared corpora, once set up (``None`` for the arithmetic
        corpus and flat token files, which do not say): a strategy's ``document_end_token`` must be it."""
        return next((corpus.tokenizer.eos_token_id for corpus in self.corpora if corpus.tokenizer), None)

    def _split(self, tokens: TokenShards | np.ndarray) -> tuple[TokenWindows, TokenWindows | None]:
        """Training windows, and validation's from the last ``val_fraction`` of the tokens."""
        split = int(len(tokens) * (1 - self.val_fraction))
        train = TokenWindows(tokens, self.seq_len, stop=split)
        return train, TokenWindows(tokens, self.seq_len, start=split) if self.val_fraction > 0 else None

    def train_dataloader(self) -> StatefulDataLoader:
        # Lightning asks for the loader once the model is built, and before the first step.
        if self.trainer is not None and self.train is not None:
            data = ", ".join(corpus.url for corpus in self.corpora) or "the arithmetic corpus"
            check_vocabulary(self.trainer.lightning_module, self._vocabulary_size(), data)
        return self._loader(self.train, shuffle=self.shuffle)

    def val_dataloader(self) -> StatefulDataLoader | list:
        if self.val_fraction == 0:
            return []  # Lightning skips validation
        return self._loader(self.val, shuffle=False)

    def _vocabulary_size(self) -> int | None:
        """Ids the data may hold: the tokenizer's vocabulary where it is known (a flat file does not say)."""
        if self.data_path is None:
            return len(ARITHMETIC_ALPHABET)
        return max((corpus.tokenizer.vocab_size for corpus in self.corpora if corpus.tokenizer), default=None)

    def _check_tokenizers(self) -> None:
        """Every prepared corpus made by one tokenizer, the run's where the run names one."""
        prepared = [corpus for corpus in self.corpora if corpus.tokenizer is not None]
        if not prepared:
            return
        if self.tokenizer is not None:
            _, expected = load_tokenizer(self.tokenizer)
            named = f"this run's {self.tokenizer}"
        else:
            expected = prepared[0].tokenizer
            named = f"{expected.name}, which prepared {prepared[0].url}"
        for corpus in prepared:
            if corpus.tokenizer.sha256 != expected.sha256:
                raise ValueError(
                    f"{corpus.url} was prepared with the tokenizer at {corpus.tokenizer.name} (vocabulary of "
                    f"{corpus.tokenizer.vocab_size}), not with {named} (vocabulary of {expected.vocab_size}): its ids "
                    "would mean other tokens to the model. Prepare the corpus again with the run's tokenizer, or "
                    "train with the one that prepared it."
                )

    def _sharding(self) -> dict[str, int] | None:
        """How the strategy deals samples to data-parallel ranks; ``None`` in a single process."""
        return getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None

    def _batch_per_rank(self) -> int:
        if self.global_batch_size is None:
            return self.batch_size
        sharding = self._sharding()
        ranks = sharding["num_replicas"] if sharding else 1
        if self.global_batch_size % ranks:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split over {ranks} data-parallel ranks. Make it a"
                f" multiple of {ranks}, or of every data-parallel size an elastic job may run on."
            )
        return self.global_batch_size // ranks

    def _loader(self, dataset: TokenWindows | Mixture | None, *, shuffle: bool) -> StatefulDataLoader:
        if dataset is None:
            raise RuntimeError("Call setup() before asking for a dataloader.")
        sharding = self._sharding()
        if sharding is None:
            return StatefulDataLoader(
                dataset, batch_size=self.batch_size, shuffle=shuffle, drop_last=True, num_workers=self.num_workers
            )
        # Our own sampler, because Lightning's injected one always shuffles training data, and pre-shuffled token
        # files must keep their order. The strategy says how to shard: by data-parallel rank only.
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=self.seed, drop_last=True, **sharding)
        return StatefulDataLoader(
            dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True, num_workers=self.num_workers
        )
