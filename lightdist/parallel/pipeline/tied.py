"""Weights tied across the pipeline's ends: an LM head that is the embedding, held by the first and the last stage.

Each end keeps its own copy, under its own name; the copies stay equal because their gradients are summed before
every optimizer step. Which weights are tied is found one way, by ``tied_names``, for stages cut by structure, for
traced stages, and for tensor parallelism (which splits both by vocabulary and must keep them one tensor).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightdist.parallel.sharding import local_tensor
from lightdist.parallel.structure import DecoderStack

__all__ = ["TiedGradients", "tied_across_stages", "tied_gradients", "tied_names"]


def tied_names(
    first: Iterable[tuple[str, nn.Parameter]], last: Iterable[tuple[str, nn.Parameter]]
) -> list[tuple[str, str]]:
    """(name in ``first``, name in ``last``) of each Parameter both hold, from ``named_parameters()`` listings."""
    in_last = {id(parameter): name for name, parameter in last}
    return [(name, in_last[id(parameter)]) for name, parameter in first if id(parameter) in in_last]


def tied_across_stages(module: nn.Module, stack: DecoderStack) -> list[tuple[str, str]]:
    """(embedding, head) names of a weight they share, in ``module`` before it is cut: the first stage keeps one, the
    last the other."""
    outside = [(name, m) for name, m in module.named_modules() if name and not stack.contains(name)]
    embeddings = [
        (f"{name}.{p}", w) for name, m in outside if isinstance(m, nn.Embedding) for p, w in m.named_parameters()
    ]
    others = [
        (f"{name}.{p}", w)
        for name, m in outside
        if not isinstance(m, nn.Embedding)
        for p, w in m.named_parameters(recurse=False, remove_duplicate=False)
    ]
    return tied_names(embeddings, others)


class TiedGradients:
    """The tied weights this rank's stage holds, and the group of the two ends their gradients are summed over."""

    def __init__(self, module: nn.Module, names: list[str], group: dist.ProcessGroup) -> None:
        self.module, self.names, self.group = module, names, group

    def parameters(self) -> list[nn.Parameter]:
        # Looked up at every step: FSDP swaps the parameters it manages in and out of their modules.
        return [self.module.get_parameter(name) for name in self.names]

    def sum(self) -> None:
        for parameter in self.parameters():
            dist.all_reduce(local_tensor(parameter.grad), group=self.group)


def tied_gradients(
    module: nn.Module, tied: list[tuple[str, str]], mesh: DeviceMesh, timeout: timedelta
) -> TiedGradients | None:
    """This rank's share of ``tied`` (first end's name, last end's name) pairs, on the ``("pp", "dp", "tp")``
    ``mesh``; ``None`` on a rank that holds neither end.

    A collective where anything is tied: every rank takes part in creating the groups (one per (dp, tp) position,
    joining the first and last stage).
    """
    if not tied:
        return None
    ranks = mesh.mesh
    pairs = [[int(ranks[0, d, t]), int(ranks[-1, d, t])] for d in range(ranks.shape[1]) for t in range(ranks.shape[2])]
    group, _ = dist.new_subgroups_by_enumeration(pairs, timeout=timeout)
    index, last = mesh["pp"].get_local_rank(), mesh["pp"].size() - 1
    if index not in (0, last):
        return None
    return TiedGradients(module, [first if index == 0 else at_last for first, at_last in tied], group)
