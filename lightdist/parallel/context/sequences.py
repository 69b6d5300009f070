"""How each sequence is split over the context-parallel ranks: which positions a rank holds, and the whole gathered.

N ranks each hold two of a sequence's 2N chunks, the i-th from the start and the i-th from the end, so that under the
causal mask each has as much attention to compute (torchtitan's and Megatron's load balancing). Within packed
documents that balance fails (a rank's work is its chunks' documents' scores, which long documents leave uneven), so
there each step deals finer chunks out by the work the step's documents give them (``balanced_by_documents``).
``SplitSequences`` also records, per step, which lengths it split and the tokens each mean over tokens counted: the
ops that follow the split (``sequence_shard.py``, ``token_means.py``, attention) read them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightdist.parallel.documents import document_positions
from lightdist.parallel.expert_parallel import all_to_all_rows
from lightdist.parallel.loss_tokens import IGNORE_INDEX

__all__ = ["SplitSequences", "balanced_by_documents", "load_balanced_positions"]


def load_balanced_positions(seq_len: int, size: int, rank: int, device: torch.device | None = None) -> Tensor:
    """The positions of a ``seq_len`` sequence that context-parallel ``rank`` of ``size`` holds: chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size``."""
    if seq_len % (2 * size):
        raise ValueError(
            f"context_parallel_size={size} splits each sequence into {2 * size} chunks (two per rank, one from each "
            f"end, so that every rank has as much causal attention to compute), but a sequence here has {seq_len} "
            f"tokens, not a multiple of {2 * size}. Make the sequence length a multiple of {2 * size} (a collator's "
            f"pad_to_multiple_of={2 * size})."
        )
    chunks = torch.arange(seq_len, device=device).view(2 * size, -1)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]])


def balanced_by_documents(ids: Tensor, size: int) -> Tensor:
    """The positions each of ``size`` ranks holds (``size``, length / ``size``) of sequences whose tokens' documents
    are ``ids`` (batch, length; a multiple of ``2 * size``), so that the busiest rank has as little attention within
    documents to compute as can be found: the chunks from each end, or the sequences cut into 2, 4 or 8 chunks a rank
    (as many as divide), dealt out by the scores each computes, the heaviest first to the rank with the least so far
    that holds fewer than its share; whichever leaves the busiest rank the fewest scores (finer chunks balance better,
    but cut more documents, whose queries after a cut score under a mask, the wasted half of its square too). The same
    positions for every sequence of the batch, so that every rank holds as many tokens of each, and the same on every
    rank, which sees the same batch."""
    length = ids.size(1)
    # each token's position within its document, and the tokens after it there: what every way's scores are read from
    within, left = document_positions(ids), document_positions(ids.flip(-1)).flip(-1)
    from_each_end = torch.empty(length, dtype=torch.long, device=ids.device)
    for rank in range(size):
        from_each_end[load_balanced_positions(length, size, rank, ids.device)] = rank
    candidates = [from_each_end]
    for per_rank in (2, 4, 8):
        if length % (per_rank * size) == 0:
            chunk_of = torch.arange(length, device=ids.device) // (length // (per_rank * size))
            rank_of_chunk = _dealt(_scores_by_owner(within, left, chunk_of, per_rank * size).tolist(), size)
            candidates.append(torch.tensor(rank_of_chunk, device=ids.device)[chunk_of])
    owner = min(candidates, key=lambda owner: int(_scores_by_owner(within, left, owner, size).max()))
    return torch.stack([(owner == rank).nonzero().flatten() for rank in range(size)])


def _dealt(work: list[int], size: int) -> list[int]:
    """The rank of each chunk of ``work``, dealt the heaviest first to the rank with the least so far of those that
    hold fewer than their share."""
    rank_of_chunk, held, load = [0] * len(work), [0] * size, [0] * size
    for chunk in sorted(range(len(work)), key=lambda c: -work[c]):
        rank = min((r for r in range(size) if held[r] < len(work) // size), key=lambda r: load[r])
        rank_of_chunk[chunk], held[rank], load[rank] = rank, held[rank] + 1, load[rank] + work[chunk]
    return rank_of_chunk


def _scores_by_owner(within: Tensor, left: Tensor, owner: Tensor, owners: int) -> Tensor:
    """The attention scores within documents each of ``owners`` computes, ``owner`` the one of each position of
    sequences whose tokens stand at ``within`` their documents with ``left`` more tokens of them after, as
    ``attention_per_document`` runs its queries: each run of its consecutive positions at once, a document begun
    in the run under the causal kernel (a query's keys from its document's start), one begun before it under a mask
    over every key from the document's start to the run's last query of it."""
    position = torch.arange(within.size(1), device=within.device)
    begins, ends = position - within, position + left + 1
    changes = torch.ones_like(owner, dtype=torch.bool)
    changes[1:] = owner[1:] != owner[:-1]
    run_begins = torch.where(changes, position, 0).cummax(0).values
    run_ends = torch.where(changes.roll(-1), position + 1, within.size(1)).flip(0).cummin(0).values.flip(0)
    scores = torch.where(begins < run_begins, torch.minimum(ends, run_ends) - begins, within + 1)
    return torch.zeros(owners, dtype=scores.dtype, device=within.device).index_add_(0, owner, scores.sum(0))


class SplitSequences:
    """The split of every sequence of a step over the ``mesh``'s ranks.

    Args:
        mesh: The context-parallel ranks (``context_mesh(...)["cp"]``).
        pipelined: Whether the model runs as pipeline stages, which count a microbatch's tokens before its loss.
    """

    def __init__(self, mesh: DeviceMesh, pipelined: bool = False) -> None:
        self.group: dist.ProcessGroup = mesh.get_group()
        self.size, self.rank, self.pipelined = mesh.size(), mesh.get_local_rank(), pipelined
        self.batch_lengths: set[int] = set()  # of the sequences of this step's batch, whole
        self.local_lengths: set[int] = set()  # of the sequences split in this step
        self.split_shapes: set[tuple[int, int]] = set()  # their (batch, local length)
        self._arrivals: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}
        # By sequence length, the step's positions of every rank, and their arrival order, dealt by its documents
        self._balanced: dict[int, tuple[Tensor, Tensor]] = {}
        self.shifted = False  # whether the step shifted a sequence that splits, which leaves ranks unequal tokens
        self.loss_counts: list[Tensor] = []  # the tokens of each mean over tokens of the step (token_means.py)

    def new_step(self) -> None:
        """Forget what the last step split."""
        self.batch_lengths.clear()
        self.local_lengths.clear()
        self.split_shapes.clear()
        self.shifted, self.loss_counts = False, []
        self._balanced.clear()

    def balance_by_documents(self, ids: Tensor) -> None:
        """Split the step's sequences whose tokens' documents are ``ids`` (batch, length), and their inputs (one
        token shorter), whichever splits, by ``balanced_by_documents``: computed here, before the model runs, so that
        compiled blocks read the positions as tensors rather than compile each step's anew."""
        for length in (ids.size(1), ids.size(1) - 1):
            if length > 0 and length % (2 * self.size) == 0:
                held = balanced_by_documents(ids[:, :length], self.size)
                self._balanced[length] = (held.flatten(), held.flatten().argsort())

    def positions(self, local_len: int, device: torch.device | None = None) -> Tensor:
        """The positions in the whole sequence of this rank's ``local_len`` tokens."""
        return self._positions(local_len * self.size, device)

    def _positions(self, length: int, device: torch.device | None) -> Tensor:
        if length not in self._balanced:
            return load_balanced_positions(length, self.size, self.rank, device)
        held = self._balanced[length][0].view(self.size, -1)[self.rank]
        return held if device is None else held.to(device)

    def local(self, whole: Tensor) -> Tensor:
        """This rank's tokens of ``whole`` (batch, sequence, ...)."""
        length = whole.size(1)
        if length % (2 * self.size) and self.batch_lengths and length not in self.batch_lengths:
            raise ValueError(
                f"context_parallel_size={self.size}: the step computes on a slice of its sequences ({length} "
                "tokens of each, such as ids[:, :3] * 2), which this rank's share of the sequence cannot "
                "stand for. Slice the model's outputs rather than its inputs, or train without context parallelism."
            )
        positions = self._positions(length, whole.device)
        self._split(whole.size(0), len(positions))
        return whole.index_select(1, positions)

    def local_shape(self, whole: Tensor) -> torch.Size:
        """The shape of ``local(whole)``, which code that sizes its positions by reads first; the whole shape where
        the sequence does not split (a window of T + 1 tokens whose first T the model takes), whose batch size is
        what code reads from it."""
        seq_len = whole.size(1)
        if seq_len % (2 * self.size):
            return whole.shape
        self._split(whole.size(0), seq_len // self.size)
        return torch.Size((whole.size(0), seq_len // self.size, *whole.shape[2:]))

    def _split(self, batch: int, local_len: int) -> None:
        self.local_lengths.add(local_len)
        self.split_shapes.add((batch, local_len))

    def arrival_order(self, local_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The whole sequence's positions as the ranks' shares arrive, one rank after another, and the order that
        sorts them."""
        if local_len * self.size in self._balanced:
            return tuple(t.to(device) for t in self._balanced[local_len * self.size])
        key = (local_len, device)
        if key not in self._arrivals:
            shares = [load_balanced_positions(local_len * self.size, self.size, r, device) for r in range(self.size)]
            held = torch.cat(shares)
            self._arrivals[key] = (held, held.argsort())
        return self._arrivals[key]

    def loss_tokens(self) -> Tensor | None:
        """The tokens this rank's loss averaged over in the step: those of its one mean over tokens (``token_means``);
        ``None`` where it took none or several. Weigh each rank's loss by them where ranks hold unequal numbers."""
        return self.loss_counts[0] if len(self.loss_counts) == 1 else None

    def shift_kept_whole(self, whole: Tensor, shifted: Tensor, index: tuple) -> Tensor:
        """``shifted``, ``whole[index]`` one position shorter than ``whole``, at ``whole``'s length where that splits
        (a split needs it): ``tokens[:, :-1]`` keeps its last token; ``labels[..., 1:]`` gets a last label of -100,
        which leaves out the prediction from that kept token (the step's loss must leave out -100, as PyTorch's and
        Hugging Face's do). Both are one process's pairs of a token and its successor."""
        if not isinstance(index[1], slice) or whole.size(1) % (2 * self.size) or shifted.size(1) != whole.size(1) - 1:
            return shifted
        if self.pipelined:
            raise ValueError(
                f"context_parallel_size={self.size} under a pipeline: the step shifts a sequence of {whole.size(1)} "
                f"tokens by one, which leaves the ranks' shares of it unequal, and a pipeline weighs its microbatches "
                "before their loss is computed. Feed windows of one token more than the model takes (inputs "
                "batch[:, :-1] and targets batch[:, 1:] of a length that splits), or call a Hugging Face model with "
                "labels=."
            )
        self.shifted = True
        sequence = index[1]
        if sequence.start in (None, 0):  # the last token dropped: keep it
            return whole[(index[0], slice(None), *index[2:])]
        fill = 0 if shifted.is_floating_point() or shifted.dtype == torch.bool else IGNORE_INDEX
        return torch.cat([shifted, torch.full_like(shifted[:, :1], fill)], dim=1)

    def whole_future(self, local_len: int, device: torch.device) -> Tensor:
        """Where this rank's queries must not look over the whole sequence (L, N x L): the keys after each."""
        positions = self.positions(local_len, device)
        return torch.arange(local_len * self.size, device=device)[None, :] > positions[:, None]

    def gathered(self, share: Tensor, dim: int) -> Tensor:
        """Every rank's ``share`` of the sequence along ``dim``, in sequence order; gradients go back to the ranks
        that hold each share."""
        dim = dim % share.dim()
        parts = share.unsqueeze(0).expand(self.size, *share.shape)
        arrived = all_to_all_rows(parts, [1] * self.size, [1] * self.size, self.group)
        return torch.cat(arrived.unbind(0), dim=dim).index_select(
            dim, self.arrival_order(share.size(dim), share.device)[1]
        )
