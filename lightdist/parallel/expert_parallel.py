"""Expert parallelism: each MoE layer's experts split across the ``ep`` ranks, tokens sent to their experts and back.

An experts module is what Hugging Face transformers 5 calls one: a module whose parameters stack every expert's weights
on dim 0 (``gate_up_proj`` ``[E, 2F, H]``, ``down_proj`` ``[E, H, F]``) and whose forward takes the routed tokens,
``experts(tokens [N, H], expert_index [N, K], weights [N, K]) -> [N, H]``. The router before it, its load-balancing
loss and everything after run unchanged, on this rank's tokens.

Under ``ep`` each rank keeps ``E / ep`` experts (DTensor ``Shard(0)`` over the ``ep`` mesh, so checkpoints reshard to
any ``ep``) and the module's forward becomes: send each (token, expert) pair to the rank holding the expert
(all-to-all, autograd-aware), run the module's own forward there on its experts alone, send the outputs back and sum
them with the routing weights. Dropless: every pair is computed, whatever the load.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = [
    "ExpertModules",
    "all_to_all_rows",
    "apply_expert_parallel",
    "check_expert_layout",
    "check_expert_parallel",
    "expert_layout_problem",
    "expert_mesh",
    "find_experts",
    "moe_blocks",
]

EXPERT_MESH_DIM_NAMES = ("pp", "edp", "ep", "tp")


@dataclass(frozen=True)
class ExpertModules:
    """The experts modules of a model, by name, the number of experts each stacks, and who said which they are."""

    names: list[str]
    num_experts: int
    declared_by: str  # "the model's base_model_ep_plan", or "discovered"
    top_k: int | None = None  # experts per token, where the MoE block or its config says
    listed: bool = False  # each expert a module of an nn.ModuleList (lightdist.parallel.listed_experts), not stacked

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Every expert's weights: the parameters of the experts modules."""
        return [p for name in self.names for p in model.get_submodule(name).parameters()]

    def idle_parameters(self, model: nn.Module) -> int:
        """The experts' weights a token does not run through: all but ``top_k / num_experts`` of them (none, where
        ``top_k`` is unknown)."""
        share = self.top_k / self.num_experts if self.top_k else 1.0
        return round(sum(p.numel() for p in self.parameters(model)) * (1 - share))


def find_experts(model: nn.Module) -> ExpertModules | None:
    """The model's experts modules: those its Hugging Face config declares (``base_model_ep_plan``), else every module
    that stacks its experts' weights and takes routed tokens, else every list of like modules beside a router (one
    output per expert); ``None`` for a dense model."""
    declared = _declared_experts(model)
    names = declared if declared is not None else [name for name, m in model.named_modules() if _is_experts(m)]
    listed = not names
    if listed:
        names = _listed_experts(model)
    if not names:
        return None
    counts = {
        len(model.get_submodule(name)) if listed else _stacked_experts(model.get_submodule(name)) for name in names
    }
    if len(counts) > 1:
        raise ValueError(
            f"The MoE layers of {type(model).__name__} stack different numbers of experts ({sorted(counts)}): "
            "expert parallelism splits every layer's experts alike, so it needs one number of experts."
        )
    declared_by = "the model's base_model_ep_plan" if declared else "discovered"
    top_k = _top_k(model.get_submodule(names[0].rpartition(".")[0]))
    return ExpertModules(names, counts.pop(), declared_by, top_k, listed)


def moe_blocks(model: nn.Module) -> list[str]:
    """The MoE blocks of ``model``: the modules that hold an experts module (with the router, shared experts)."""
    experts = find_experts(model)
    return [] if experts is None else [name.rpartition(".")[0] for name in experts.names]


def expert_layout_problem(ep: int, dp: int) -> str | None:
    """Why the layout cannot take ``ep`` (and what to choose instead), or ``None`` where it can."""
    if ep == 1:
        return None
    if dp % ep:
        return (
            f"expert_parallel_size={ep} does not divide data_parallel_size={dp}: the ranks that split the experts are "
            "taken from the data-parallel ranks. Choose an expert_parallel_size that divides the data-parallel size."
        )
    return None


def check_expert_layout(ep: int, dp: int) -> None:
    """Refuse an ``ep`` that the layout cannot take: as soon as the layout is known, before any process starts."""
    problem = expert_layout_problem(ep, dp)
    if problem is not None:
        raise ValueError(problem)


def check_expert_parallel(model: nn.Module, experts: ExpertModules | None, ep: int, mesh: DeviceMesh) -> None:
    """Refuse an ``ep`` that the model or the ``("pp", "dp", "tp")`` mesh cannot take, before anything is split."""
    check_expert_layout(ep, mesh["dp"].size())
    name = type(model).__name__
    if experts is None:
        raise ValueError(
            f"expert_parallel_size={ep}, but {name} has no MoE layer: no module stacks experts' weights on dim 0 and "
            "takes (tokens, expert_index, weights), no list of like modules sits beside a router with one output "
            "per expert, and its config declares no base_model_ep_plan. Set expert_parallel_size=1 for a dense model."
        )
    if experts.num_experts % ep:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide the {experts.num_experts} experts of {name}'s MoE layers "
            f"({experts.names[0]}, ...): each rank must hold whole experts. Choose an expert_parallel_size that "
            f"divides {experts.num_experts}."
        )


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ``("pp", "edp", "ep", "tp")`` mesh over the ranks of the ``("pp", "dp", "tp")`` ``mesh``: each run of
    ``ep`` neighbouring data-parallel ranks splits the experts, and ``edp`` ranks hold the same experts.

    ``ep`` innermost in ``dp`` puts the all-to-all between the closest data-parallel ranks (torchtitan's choice).
    A collective: every rank builds the mesh's groups.
    """
    pp, dp, tp = mesh.mesh.shape
    ranks = mesh.mesh.reshape(pp, dp // ep, ep, tp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=EXPERT_MESH_DIM_NAMES)


def apply_expert_parallel(model: nn.Module, experts: ExpertModules, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's share of every experts module's experts, and route its tokens over ``ep_mesh``."""
    for name in experts.names:
        module = model.get_submodule(name)
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__class__ = _expert_parallel_class(type(module))
        module.ep_group = ep_mesh.get_group()
        module.experts_per_rank = experts.num_experts // ep_mesh.size()


class ExpertParallel:
    """Mixed into an experts module's own class: its forward, on this rank's tokens, with the experts split over the
    ``ep`` group."""

    ep_group: dist.ProcessGroup
    experts_per_rank: int

    def forward(self, tokens: Tensor, expert_index: Tensor, weights: Tensor) -> Tensor:
        pairs = expert_index.numel()
        top_k = expert_index.size(-1)
        owner = expert_index.flatten() // self.experts_per_rank
        order = torch.argsort(owner, stable=True)  # pairs grouped by the rank holding their expert
        send_counts = torch.bincount(owner, minlength=self.ep_group.size())
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        sent, received = send_counts.tolist(), recv_counts.tolist()

        local_expert = (expert_index.flatten() % self.experts_per_rank)[order]
        arrived_expert = local_expert.new_empty(sum(received))
        dist.all_to_all_single(arrived_expert, local_expert, received, sent, group=self.ep_group)
        arrived = all_to_all_rows(tokens[order // top_k], received, sent, self.ep_group)

        with self._local_experts():
            computed = super().forward(arrived, arrived_expert[:, None], arrived.new_ones(len(arrived), 1))
            if not len(arrived):
                # No token came, so the experts' own forward may not have read ``arrived`` (Hugging Face's and ours
                # loop over the experts hit). Keep it in the graph: the backward must send gradients back through
                # both all-to-alls, as the peers that got tokens do, or they wait forever; and the experts get a
                # (zero) gradient, as every dp peer's do.
                unused = arrived.sum() + sum(p.sum() for p in self._local_parameters().values())
                computed = computed + unused * 0
        returned = all_to_all_rows(computed, sent, received, self.ep_group)
        per_pair = returned[torch.argsort(order)].view(pairs // top_k, top_k, -1)
        return (per_pair * weights[..., None]).sum(dim=1).to(tokens.dtype)

    def _local_parameters(self) -> dict[str, Tensor]:
        return {name: p.to_local() for name, p in self.named_parameters(recurse=False) if isinstance(p, DTensor)}

    @contextmanager
    def _local_experts(self) -> Iterator[None]:
        """The module's own forward sees its experts alone: each stacked parameter as this rank's slice, and
        ``num_experts`` (Hugging Face's experts size their masks and groups by it) as their number.

        Instance attributes come before ``nn.Module.__getattr__``'s parameter lookup, so setting them shadows the
        parameters for this call; ``to_local`` is differentiable, so gradients reach the sharded parameters."""
        shadowed = self._local_parameters()
        if isinstance(getattr(self, "num_experts", None), int):
            shadowed["num_experts"] = self.experts_per_rank
        saved = {name: self.__dict__[name] for name in shadowed if name in self.__dict__}
        for name, value in shadowed.items():
            object.__setattr__(self, name, value)
        try:
            yield
        finally:
            for name in shadowed:
                object.__delattr__(self, name)
            for name, value in saved.items():
                object.__setattr__(self, name, value)


def all_to_all_rows(tensor: Tensor, out_counts: list[int], in_counts: list[int], group: dist.ProcessGroup) -> Tensor:
    """Rows of ``tensor`` sent ``in_counts[r]`` to rank ``r``, ``out_counts[r]`` received from each; gradients go back
    the same way."""
    return _AllToAll.apply(tensor, out_counts, in_counts, group)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` whose backward is the all-to-all back (torch's public autograd version,
    ``torch.distributed.nn.functional.all_to_all_single``, is deprecated for a private one)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, out_counts: list[int], in_counts: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.counts, ctx.group = (out_counts, in_counts), group
        out = tensor.new_empty(sum(out_counts), *tensor.shape[1:])
        dist.all_to_all_single(out, tensor.contiguous(), out_counts, in_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_counts, in_counts = ctx.counts
        return _AllToAll.apply(grad, in_counts, out_counts, ctx.group), None, None, None


_EXPERT_PARALLEL_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with ``ExpertParallel``'s forward in front of its own, made once per class (as ``fully_shard`` does)."""
    if cls not in _EXPERT_PARALLEL_CLASSES:
        _EXPERT_PARALLEL_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    return _EXPERT_PARALLEL_CLASSES[cls]


def _declared_experts(model: nn.Module) -> list[str] | None:
    """The experts modules a Hugging Face config's ``base_model_ep_plan`` names (patterns relative to the base model,
    ``layers.*.mlp.experts``), as full names; ``None`` where no config declares one."""
    for prefix, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None)
        if not plan:
            continue
        patterns = [pattern for pattern, style in plan.items() if style == "ep_dispatch_experts"]
        names = [
            f"{prefix}.{name}" if prefix else name for name, _ in module.named_modules() if _matches(name, patterns)
        ]
        return names or None  # a module below the plan's base (an experts module keeps the config too): discover
    return None


def _listed_experts(model: nn.Module) -> list[str]:
    """The lists of like modules beside a router (a Linear with one output per expert) in ``model``, as transformers
    4's Mixtral and LitGPT's MoE hold their experts; split ones (``ExpertList``) count all their experts."""
    found = []
    for prefix, module in model.named_modules():
        for name, child in module.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) < 2 or len({type(m) for m in child.children()}) != 1:
                continue
            if any(isinstance(m, nn.Linear) and m.out_features == len(child) for m in module.children()):
                found.append(f"{prefix}.{name}".lstrip("."))
    return found


def _top_k(moe_block: nn.Module) -> int | None:
    """Experts per token, as the MoE block, its router or their config calls it (``top_k``, ``num_experts_per_tok``,
    LitGPT's ``n_expert_per_token``)."""
    for module in moe_block.modules():
        for owner in (module, getattr(module, "config", None)):
            for name in ("top_k", "num_experts_per_tok", "n_expert_per_token"):
                if isinstance(value := getattr(owner, name, None), int):
                    return value
    return None


def _matches(name: str, patterns: list[str]) -> bool:
    return bool(name) and any(fnmatchcase(name, pattern) or fnmatchcase(name, f"*.{pattern}") for pattern in patterns)


def _stacked_experts(module: nn.Module) -> int:
    return next(module.parameters(recurse=False)).shape[0]


def _is_experts(module: nn.Module) -> bool:
    """Stacks its experts' weights on dim 0 (at least one 3-D) and takes (tokens, expert_index, weights)."""
    params = list(module.parameters(recurse=False))
    if not params or not any(p.dim() == 3 for p in params) or len({p.shape[0] for p in params}) != 1:
        return False
    return params[0].shape[0] > 1 and _positional_arity(module.forward) == 3


def _positional_arity(forward: Callable[..., Any]) -> int:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return -1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
