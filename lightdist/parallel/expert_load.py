"""How evenly a Mixture-of-Experts model's router spreads tokens over its experts, counted where they are routed.

A forward pre-hook on each experts module (``lightdist.parallel.expert_parallel.find_experts``) reads the expert each
token is sent to; on experts held as a list, one on each expert counts the tokens it is given (under expert parallelism,
on the rank holding it, which gets every rank's tokens for it). Counts are summed over the ranks whose tokens differ
(not over tensor-parallel peers, which route the same tokens) and over the pipeline stages that hold the layers.
Recomputed forwards (activation checkpointing) count their tokens again, as they route them again: shares and the
imbalance are exact, the counts are then multiples.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightdist.parallel.expert_parallel import find_experts
from lightdist.parallel.sharding import local_tensor

__all__ = ["ExpertLoad", "imbalance_metrics", "wandb_histograms"]


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer of ``model`` since the last ``take``; nothing for a dense
    model. ``counting``: whether the forward now running routes tokens that count (a pipeline's stages also run on
    made-up inputs while its schedule sets them up)."""

    def __init__(self, model: nn.Module, counting: Callable[[], bool] = lambda: True) -> None:
        self.counting = counting
        experts = find_experts(model)
        self.num_experts = experts.num_experts if experts is not None else 0
        self._counts: dict[str, Tensor] = {}
        self._handles: list[RemovableHandle] = []
        for name in experts.names if experts is not None else []:
            module = model.get_submodule(name)
            if experts.listed:  # each expert a module: count the tokens each one this rank holds is given
                for index, expert in module.named_children():
                    hook = partial(self._count_tokens, name, int(index))
                    self._handles.append(expert.register_forward_pre_hook(hook))
                continue
            # The expert indices: the forward's second argument, positional or by its name.
            index_name = list(inspect.signature(module.forward).parameters)[1]
            hook = partial(self._count, name, index_name)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def __bool__(self) -> bool:
        return bool(self._handles)

    def _count(
        self, name: str, index_name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if module.training and self.counting():
            expert_index = args[1] if len(args) > 1 else kwargs[index_name]
            counts = torch.bincount(local_tensor(expert_index).detach().flatten(), minlength=self.num_experts)
            self._counts[name] = self._counts[name] + counts if name in self._counts else counts

    def _count_tokens(self, name: str, index: int, expert: nn.Module, args: tuple[Any, ...]) -> None:
        if expert.training and self.counting():
            counts = torch.zeros(self.num_experts, dtype=torch.long)
            counts[index] = local_tensor(args[0]).shape[:-1].numel()
            self._counts[name] = self._counts[name] + counts if name in self._counts else counts

    def take(self, counts_tokens: bool = True) -> dict[str, Tensor]:
        """Each layer's tokens per expert, summed over every rank, and the count started again. A collective of every
        rank; ``counts_tokens``: whether this rank's tokens count (not a tensor-parallel peer's copy)."""
        mine = {name: counts.cpu() for name, counts in self._counts.items()} if counts_tokens else {}
        self._counts = {}
        gathered: list[dict[str, Tensor]] = [mine]
        if dist.is_initialized():
            gathered = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, mine)
        total: dict[str, Tensor] = {}
        for counts_of_rank in gathered:
            for name, counts in counts_of_rank.items():
                total[name] = total[name] + counts if name in total else counts
        return dict(sorted(total.items(), key=lambda item: _layer_order(item[0])))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def imbalance_metrics(tokens: dict[str, Tensor]) -> dict[str, float]:
    """``moe/imbalance/<layer>``: each layer's busiest expert's tokens over the mean (1: balanced; a dropless layer
    runs at its busiest expert's pace), and ``moe/imbalance``, the worst layer's."""
    metrics = {
        f"moe/imbalance/{layer}": (counts.max() / counts.float().mean()).item() for layer, counts in tokens.items()
    }
    return metrics | ({"moe/imbalance": max(metrics.values())} if metrics else {})


def wandb_histograms(tokens: dict[str, Tensor]) -> dict[str, Any]:
    """``moe/tokens_per_expert/<layer>``: W&B histograms whose bars are the experts, each as high as its tokens."""
    if not tokens:
        return {}
    import wandb  # only where a W&B logger logs, which imported it

    return {
        f"moe/tokens_per_expert/{layer}": wandb.Histogram(np_histogram=(counts.tolist(), list(range(len(counts) + 1))))
        for layer, counts in tokens.items()
    }


def _layer_order(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))
