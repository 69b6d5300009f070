"""Expert parallelism for experts held as a list of modules, which the MoE block's own code calls one by one.

transformers 4's Mixtral, LitGPT's ``LLaMAMoE`` and much hand-written MoE code hold each expert as a module of an
``nn.ModuleList`` and loop over them in the block's forward, each expert on the tokens routed to it. No all-to-all can
sit inside that loop: each rank's loop calls other experts, in an order of its own. So under ``ep`` the block's forward
runs twice:

1. recording: each expert call gives back zeros and notes the tokens it was given;
2. the noted tokens go to the ranks holding their experts (all-to-all, autograd-aware), the experts run there on
   every rank's tokens at once, and the outputs come back;
3. replaying: the forward runs again from the same random state, and each expert call gets its output.

Each rank keeps the experts of its share of the indices, under their own names (``experts.4`` to ``experts.7`` of 8
on the second of two ranks), so checkpoints load under any ``ep``. The router, the block's loop and all it computes
around the experts run unchanged: dropless, and equal to one process. The price is that the block's own code, a
shared expert included, runs twice; the first run's output is dropped at once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial, wraps
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightdist.dataflow import device_of_call
from lightdist.parallel.expert_parallel import ExpertModules, all_to_all_rows

__all__ = ["ExpertList", "apply_listed_expert_parallel", "experts_held_apart"]


class ExpertList(nn.ModuleList):
    """The experts of one MoE layer that this rank holds, under their indices in the whole list. Indexing or iterating
    gives every expert's call, as the block's loop expects; a call is recorded or replayed by the block's forward."""

    def __init__(self, experts: nn.ModuleList, held: range, ep_group: dist.ProcessGroup) -> None:
        super().__init__()
        for index in held:
            self.add_module(str(index), experts[index])
        self.num_experts, self.ep_group = len(experts), ep_group
        self._calls: _Recording | _Replaying | None = None
        self._width: int | None = None

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(self.num_experts)[index]]
        return partial(self._call, range(self.num_experts)[operator.index(index)])

    def __iter__(self) -> Iterator[Callable[[Tensor], Tensor]]:
        return (self[index] for index in range(self.num_experts))

    def _call(self, index: int, tokens: Tensor, *more: Any, **options: Any) -> Tensor:
        if more or options:
            raise TypeError(
                f"Expert {index} was called with more than its tokens; expert parallelism over a list of experts "
                "sends each expert its tokens alone. Apply routing weights to the expert's output, outside the call."
            )
        if self._calls is None:
            raise RuntimeError(f"Expert {index} was called outside its MoE block's forward, which routes its tokens.")
        return self._calls.call(index, tokens)

    @contextmanager
    def calls_as(self, calls: _Recording | _Replaying) -> Iterator[None]:
        self._calls = calls
        try:
            yield
        finally:
            self._calls = None

    def exchange(self, recorded: list[tuple[int, Tensor]]) -> list[Tensor]:
        """Each recorded call's output: its tokens sent to the rank holding its expert, run there with every rank's
        tokens for that expert, and sent back."""
        if recorded:
            self._width = recorded[0][1].shape[-1]
        if self._width is None:
            raise RuntimeError("A MoE block called no expert on its first forward, so their input width is unknown.")
        group, ep = self.ep_group, self.ep_group.size()
        per_rank = self.num_experts // ep
        order = sorted(range(len(recorded)), key=lambda call: recorded[call][0])  # by expert: by the rank holding it
        inputs = [recorded[call][1].reshape(-1, self._width) for call in order]
        device = next(self.parameters()).device
        per_expert = torch.zeros(self.num_experts, dtype=torch.long)
        for call, tokens in zip(order, inputs, strict=True):
            per_expert[recorded[call][0]] += len(tokens)
        arrived_per_expert = torch.empty_like(per_expert, device=device)
        dist.all_to_all_single(arrived_per_expert, per_expert.to(device), group=group)  # per_rank counts each
        sent = per_expert.view(ep, per_rank).sum(1).tolist()
        arrived_per_expert = arrived_per_expert.cpu()
        received = arrived_per_expert.view(ep, per_rank).sum(1).tolist()
        sending = torch.cat(inputs) if inputs else torch.zeros(0, self._width, device=device)
        pieces = all_to_all_rows(sending, received, sent, group).split(arrived_per_expert.tolist())
        computed: list[Tensor] = [*pieces]  # by source rank, then by expert: the order they came in
        for local, expert in enumerate(self.children()):
            mine = range(local, len(pieces), per_rank)
            output = expert(torch.cat([pieces[piece] for piece in mine]))
            for piece, part in zip(mine, output.split([len(pieces[piece]) for piece in mine]), strict=True):
                computed[piece] = part
        returned = all_to_all_rows(torch.cat(computed), sent, received, group).split([len(t) for t in inputs])
        outputs: list[Tensor] = [torch.empty(0)] * len(recorded)
        for call, output in zip(order, returned, strict=True):
            outputs[call] = output.reshape(*recorded[call][1].shape[:-1], output.shape[-1])
        return outputs


class _Recording:
    """The first forward: every call noted, zeros given back."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Tensor]] = []

    def call(self, index: int, tokens: Tensor) -> Tensor:
        self.calls.append((index, tokens))
        return torch.zeros_like(tokens)


class _Replaying:
    """The second forward: every call, in the same order, given its expert's output."""

    def __init__(self, recorded: list[tuple[int, Tensor]], outputs: list[Tensor]) -> None:
        self._next = iter(zip(recorded, outputs, strict=True))

    def call(self, index: int, tokens: Tensor) -> Tensor:
        (recorded_index, recorded_tokens), output = next(self._next, ((None, None), None))
        if recorded_index != index or recorded_tokens.shape != tokens.shape:
            raise RuntimeError(
                f"The MoE block called expert {index} on tokens of shape {tuple(tokens.shape)} on its second forward, "
                "not as on its first: its routing depends on something other than its inputs and torch's random "
                "state, which expert parallelism over a list of experts needs to run the block twice."
            )
        return output


def apply_listed_expert_parallel(
    model: nn.Module, experts: ExpertModules, ep_group: dist.ProcessGroup
) -> list[nn.Module]:
    """Keep this rank's share of each list of experts and route each MoE block's tokens over ``ep_group``; the experts
    this rank holds, each a unit of its own for data parallelism."""
    rank, ep = dist.get_group_rank(ep_group, dist.get_rank()), ep_group.size()
    per_rank = experts.num_experts // ep
    held = []
    for name in experts.names:
        block_name, _, attribute = name.rpartition(".")
        block = model.get_submodule(block_name)
        listed = ExpertList(getattr(block, attribute), range(rank * per_rank, (rank + 1) * per_rank), ep_group)
        setattr(block, attribute, listed)
        block.forward = _routed_twice(block.forward, listed)
        held += list(listed.children())
    return held


def _routed_twice(forward: Callable[..., Any], experts: ExpertList) -> Callable[..., Any]:
    @wraps(forward)
    def routed_twice(*args: Any, **kwargs: Any) -> Any:
        recording = _Recording()
        device = device_of_call(args, kwargs)  # whose random state the replay forks
        with torch.random.fork_rng([device] if device.type == "cuda" else []), experts.calls_as(recording):
            forward(*args, **kwargs)
        outputs = experts.exchange(recording.calls)
        with experts.calls_as(_Replaying(recording.calls, outputs)):
            return forward(*args, **kwargs)

    return routed_twice


def experts_held_apart(model: nn.Module) -> dict[dist.ProcessGroup, set[int]]:
    """Ids of the listed experts' parameters, by the ``ep`` group whose ranks hold the others: a gradient norm sums
    their squares over that group, as no DTensor mesh says they are split."""
    apart: dict[dist.ProcessGroup, set[int]] = {}
    for module in model.modules():
        if isinstance(module, ExpertList):
            apart.setdefault(module.ep_group, set()).update(id(p) for p in module.parameters())
    return apart
