"""Several token datasets blended by weight, in an order fixed by the seed alone.

Each epoch of the blend holds ``n_k`` samples of dataset ``k``, in proportion to its weight: a dataset weighed above
its share of the tokens is drawn more than once (each pass in a new order), one weighed below it gives a subset
drawn at random. The blend interleaves them evenly (sample ``j`` of dataset ``k`` sits at ``(j + 0.5) / n_k``, as
Megatron's blended datasets place theirs), and it is a plain indexable dataset: the sampler above it deals its
indices to the data-parallel ranks as it deals any dataset's, so the global batches and a resume's position are the
same on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["Mixture"]


class Mixture(Dataset):
    """``datasets`` blended by ``weights`` (``None``: each sample of each once), ``samples`` in an epoch (default:
    as many as the datasets hold together)."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float] | None = None,
        *,
        samples: int | None = None,
        seed: int = 0,
    ) -> None:
        lengths = np.array([len(dataset) for dataset in datasets])
        weights = np.asarray(lengths if weights is None else weights, dtype=np.float64)
        if len(weights) != len(datasets) or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(
                f"weights={weights.tolist()} do not blend {len(datasets)} datasets: give one non-negative weight each, "
                "not all zero."
            )
        samples = int(lengths.sum()) if samples is None else samples
        counts = np.floor(weights / weights.sum() * samples).astype(np.int64)
        counts[np.argsort(-(weights / weights.sum() * samples - counts), kind="stable")[: samples - counts.sum()]] += 1
        rng = np.random.default_rng(seed)
        sources, positions, times = [], [], []
        for k, (count, length) in enumerate(zip(counts, lengths, strict=True)):
            passes = -(-count // length) if count else 0
            order = np.concatenate([rng.permutation(length) for _ in range(passes)] or [np.empty(0, np.int64)])
            sources.append(np.full(count, k))
            positions.append(order[:count])
            times.append((np.arange(count) + 0.5) / count)
        blend = np.argsort(np.concatenate(times), kind="stable")
        self.datasets = list(datasets)
        self.source = np.concatenate(sources)[blend]
        self.position = np.concatenate(positions)[blend]
        self.counts = counts.tolist()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Tensor:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Tensor]:
        """Each dataset's samples of the batch fetched together, as each dataset fetches a batch."""
        taken: list[Tensor | None] = [None] * len(indices)
        for k, dataset in enumerate(self.datasets):
            mine = [i for i, index in enumerate(indices) if self.source[index] == k]
            if mine:
                fetched = dataset.__getitems__([int(self.position[indices[i]]) for i in mine])
                for i, sample in zip(mine, fetched, strict=True):
                    taken[i] = sample
        return taken
