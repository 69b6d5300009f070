"""How each sequence is split over the context-parallel ranks: which positions a rank holds, and the whole gathered.

N ranks each hold two of a sequence's 2N chunks, the i-th from the start and the i-th from the end, so that under the
causal mask each has as much attention to compute (torchtitan's and Megatron's load balancing). ``SplitSequences``
also records, per step, which lengths it split and the tokens each mean over tokens counted: the ops that follow the
split (``sequence_shard.py``, ``token_means.py``, attention) read them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightdist.parallel.expert_parallel import all_to_all_rows
from lightdist.parallel.loss_tokens import IGNORE_INDEX

__all__ = ["SplitSequences", "load_balanced_positions"]


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


class SplitSequences:
    """The split of every sequence of a step over the ``mesh``'s ranks.

    Args:
        mesh: The context-parallel ranks (``context_mesh(...)["cp"]``).
        pipelined: Whether the model runs as pipeline stages, which count a microbatch's tokens before its loss.
    """

    def __init__(self, mesh: DeviceMesh, pipelined: bool = False) -> None:
        self.group: dist.ProcessGroup = mesh.get_group()
        self.size, self.rank, self.pipelined = mesh.size(), mesh.get_local_rank(), pipelined
        self.local_lengths: set[int] = set()  # of the sequences split in this step
        self.split_shapes: set[tuple[int, int]] = set()  # their (batch, local length)
        self._arrivals: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}
        self.shifted = False  # whether the step shifted a sequence that splits, which leaves ranks unequal tokens
        self.loss_counts: list[Tensor] = []  # the tokens of each mean over tokens of the step (token_means.py)

    def new_step(self) -> None:
        """Forget what the last step split."""
        self.local_lengths.clear()
        self.split_shapes.clear()
        self.shifted, self.loss_counts = False, []

    def positions(self, local_len: int, device: torch.device | None = None) -> Tensor:
        """The positions in the whole sequence of this rank's ``local_len`` tokens."""
        return load_balanced_positions(local_len * self.size, self.size, self.rank, device)

    def local(self, whole: Tensor) -> Tensor:
        """This rank's tokens of ``whole`` (batch, sequence, ...)."""
        positions = load_balanced_positions(whole.size(1), self.size, self.rank, whole.device)
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
