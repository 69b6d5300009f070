"""Data parallelism with ZeRO stages 0-3, on torch's own parts.

| stage | parameters             | gradients        | optimizer state      | how                                     |
|-------|------------------------|------------------|----------------------|-----------------------------------------|
| 0     | replicated             | all-reduced      | replicated           | FSDP2 on a ``(dp, 1)`` mesh             |
| 1     | replicated             | all-reduced      | sharded by parameter | the same + ``ShardedOptimizer``         |
| 2     | gathered once per step | reduce-scattered | sharded              | FSDP2, ``reshard_after_forward=False``  |
| 3     | sharded                | reduce-scattered | sharded              | FSDP2, ``reshard_after_forward=True``   |

Every stage wraps each decoder block and then the root, so a block's parameters are gathered just before use
(stages 2-3) and its gradients reduced as soon as its backward ends.

Stages 2-3 shard over every data-parallel rank, or with ``replicas`` over each of that many groups of them (HSDP,
torchtitan's ``dp_replicate x dp_shard``): a replica's ranks (a node, say) shard the state and gather the parameters
over their own links, and gradients, reduce-scattered within the replica, are all-reduced across replicas, so the
slow links carry one gradient shard per step and no parameter gather. Stages 0-1 are ``fully_shard`` on an HSDP mesh
whose shard dimension has one rank, ``(dp, 1)`` (torchtitan's ``("dp_replicate", "dp_shard")``): each rank keeps
whole parameters, gathers from no other rank, and all-reduces gradients over ``dp``, which is DDP. FSDP2's machinery
rather than the composable DDP ``replicate``, which drops the gradients of tensor-parallel DTensor parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = [
    "ShardedOptimizer",
    "ZeroStage",
    "apply_data_parallel",
    "check_replicas",
    "local_tensor",
    "optimizers_for_layout",
    "replicas_problem",
]

ZeroStage = Literal[0, 1, 2, 3]


def apply_data_parallel(
    root: nn.Module,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    zero_stage: ZeroStage,
    replicas: int = 1,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    experts: Iterable[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Make ``root`` data parallel over the ``"dp"`` ranks of ``mesh`` (the ``("pp", "dp", "tp")`` mesh), sharding as
    much as ``zero_stage`` asks, one unit per block; at stages 2-3, within each of ``replicas`` groups of them.

    ``param_dtype`` is the compute dtype of FSDP2's mixed precision; gradients are always reduced in fp32.
    ``experts`` (split by expert parallelism) are units of their own over the ``"edp"`` ranks of ``expert_mesh`` (the
    ``("pp", "edp", "ep", "tp")`` mesh), the ranks that hold the same experts. Each of their gradients already sums the
    tokens of the ``ep`` ranks that sent tokens to it, so the sum over ``edp`` is divided by the whole data-parallel
    size, not by ``edp``'s. Every rank calls it alike: stages 0-1 make a group.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    dp_size = mesh["dp"].size()
    if zero_stage in (0, 1):
        dp_mesh = _replicated_mesh(mesh, "dp")
        edp_mesh = _replicated_mesh(expert_mesh, "edp") if expert_mesh is not None else None
        # Nothing to reshard: a shard of one rank is the whole parameter.
        wrap = partial(fully_shard, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    else:
        dp_mesh = mesh["dp"] if replicas == 1 else _hybrid_mesh(mesh, "dp", replicas)
        edp_mesh = expert_mesh["edp"] if expert_mesh is not None else None
        wrap = partial(
            fully_shard,
            mesh=dp_mesh,
            reshard_after_forward=zero_stage == 3,
            mp_policy=mp_policy,
            offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        )
    for module in experts:
        wrap(module, mesh=edp_mesh)
        module.set_gradient_divide_factor(dp_size)
        if zero_stage >= 2 and edp_mesh.size() > 1:
            # A reduce-scatter folds the division into a pre-multiplied sum, which gloo lacks: divide on its own.
            # Not where the shard group has one rank (edp of one rank, or stages 0-1's (edp, 1) mesh): FSDP2 (torch
            # 2.11, 2.13) then skips the reduce-scatter and divides as it copies, so a forced sum would divide twice.
            module.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        wrap(block)
    wrap(root)


def replicas_problem(replicas: int, zero_stage: int, dp: int | None = None) -> str | None:
    """Why ``replicas`` cannot split the data-parallel ranks at ``zero_stage``, nor ``dp`` of them where it is known
    (and what to choose), or ``None``."""
    if replicas == 1:
        return None
    if zero_stage < 2:
        return (
            f"data_parallel_replicas={replicas} splits the ranks that shard parameters into replicas, but "
            f"zero_stage={zero_stage} shards none: every data-parallel rank is a replica already. Use zero_stage=2 "
            "or 3 with data_parallel_replicas, or leave it at 1."
        )
    if dp is not None and dp % replicas:
        return (
            f"data_parallel_replicas={replicas} does not divide data_parallel_size={dp}: each replica must hold as "
            "many data-parallel ranks as the others. Choose a data_parallel_replicas that divides the data-parallel "
            "size."
        )
    return None


def check_replicas(replicas: int, dp: int, zero_stage: int) -> None:
    """Refuse ``replicas`` that the layout cannot take: as soon as the layout is known, before any process starts."""
    problem = replicas_problem(replicas, zero_stage, dp=dp)
    if problem is not None:
        raise ValueError(problem)


def _hybrid_mesh(mesh: DeviceMesh, dim: str, replicas: int) -> DeviceMesh:
    """The 2-D ``(dim + "_replicate", dim + "_shard")`` mesh that splits ``mesh``'s ``dim`` into ``replicas`` runs of
    neighbouring ranks (the closest ranks shard together), for ``fully_shard``'s HSDP. Built over ``mesh``'s whole
    ranks tensor, with which FSDP2 joins a tensor-parallel parameter's mesh. A collective: every rank builds the
    mesh's groups."""
    names = mesh.mesh_dim_names
    at = names.index(dim)
    shape = mesh.mesh.shape
    ranks = mesh.mesh.reshape(*shape[:at], replicas, shape[at] // replicas, *shape[at + 1 :])
    split = (f"{dim}_replicate", f"{dim}_shard")
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*names[:at], *split, *names[at + 1 :]))[split]


def _replicated_mesh(mesh: DeviceMesh, dim: str) -> DeviceMesh:
    """The 2-D ``(dim, dim + "_shard")`` mesh of ``mesh``, its shard dimension of one rank, this one: ``fully_shard``
    on it keeps parameters whole (``to_local()`` is the whole parameter, or its tensor-parallel shard) and all-reduces
    gradients over ``dim``.

    It indexes ``mesh``'s whole ranks tensor, a size-1 dimension put after ``dim``, because FSDP2 joins it with a
    tensor- or expert-parallel parameter's mesh only over the same ranks tensor. Its groups are ``mesh``'s own (their
    timeouts included) and one of this rank alone: a ``DeviceMesh`` built anew would make every group again, a
    collective of all ranks that, given only this rank's ranks, pairs ranks of different groups.
    """
    names = mesh.mesh_dim_names
    after = names.index(dim) + 1
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    groups = mesh.get_all_groups()
    whole = DeviceMesh.from_group(
        [*groups[:after], alone, *groups[after:]],
        mesh.device_type,
        mesh.mesh.unsqueeze(after),
        mesh_dim_names=(*names[:after], f"{dim}_shard", *names[after:]),
    )
    return whole[(dim, f"{dim}_shard")]


class ShardedOptimizer(Optimizer):
    """ZeRO-1: each data-parallel rank updates, and keeps optimizer state for, only the whole parameters it owns.

    Parameters are dealt out largest first to the rank holding the fewest elements (``ZeroRedundancyOptimizer``'s
    partition). ``step`` drops the other gradients before ``optimizer`` runs, so it creates and updates state for the
    owned parameters only; then each owner broadcasts its parameters' local tensors over ``dp_mesh``, which works for
    DTensor (tensor-parallel) parameters where ``ZeroRedundancyOptimizer``'s broadcast of the DTensor itself fails.
    ``param_groups`` and ``state`` are ``optimizer``'s own objects: LR schedulers and gradient clipping see every
    parameter, and ``get_optimizer_state_dict`` gives the usual state dict with this rank's share of the state, so a
    sharded checkpoint gets each parameter's state from its owner and loads under any layout.
    """

    def __init__(self, optimizer: Optimizer, dp_mesh: DeviceMesh) -> None:
        # Optimizer.__init__ is not called: it would give this object parameter groups and state of its own.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults  # Lightning's LearningRateMonitor reads them
        self._group = dp_mesh.get_group()
        self._owners = _deal_out([p for group in optimizer.param_groups for p in group["params"]], dp_mesh.size())

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[Tensor, Any]:
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # backward and gradient clipping run here, on every gradient
        rank = self._group.rank()
        for param, owner in self._owners.items():
            if owner != rank:
                param.grad = None
        self.optimizer.step()
        with torch.no_grad():
            handles = [
                dist.broadcast(local_tensor(param), group_src=owner, group=self._group, async_op=True)
                for param, owner in self._owners.items()
            ]
            for handle in handles:
                handle.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def optimizers_for_layout(
    optimizers: list[Optimizer], zero1_mesh: DeviceMesh | None, device: torch.device | None
) -> list[Optimizer]:
    """The user's optimizers as they step on a split model: tensor by tensor where a group mixes meshes, as ZeRO-1's
    ``ShardedOptimizer`` over ``zero1_mesh`` where given (LR schedulers keep the user's optimizers: it shares their
    parameter groups), their states moved to ``device`` where given (not under CPU offload)."""
    _step_mixed_meshes_per_tensor(optimizers)
    if zero1_mesh is not None:
        optimizers = [ShardedOptimizer(optimizer, zero1_mesh) for optimizer in optimizers]
    if device is not None:
        _optimizer_states_to(optimizers, device)
    return optimizers


def _step_mixed_meshes_per_tensor(optimizers: Iterable[Optimizer]) -> None:
    """Let each optimizer step its groups that hold DTensors of more than one mesh (experts split over
    ``("edp", "ep")``, the rest over ``dp``) one tensor at a time: torch's foreach kernels refuse DTensors of different
    meshes in one call (torch 2.13). Fused kernels (the reference models' on GPUs) are turned off there too: they have
    not been run across meshes. Groups of one mesh keep their kernels."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if len({p.device_mesh for p in group["params"] if isinstance(p, DTensor)}) > 1:
                group["foreach"] = False
                if group.get("fused"):
                    group["fused"] = False


def _optimizer_states_to(optimizers: Iterable[Optimizer], device: torch.device) -> None:
    """Move the optimizers' states (a restored checkpoint's, loaded on the CPU) to ``device``. Each ``step`` count
    stays where it is: torch's optimizers keep it on the CPU unless they are fused or capturable."""
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, Tensor):
                    state[key] = value.to(device)


def _deal_out(params: list[Tensor], ranks: int) -> dict[Tensor, int]:
    """Each parameter's owner among ``ranks``; the same on every rank, tensor-parallel peers included.

    DTensor sizes are global, so the peers that hold the shards of one parameter give it the same owner. Every rank
    must own a parameter: ``get_optimizer_state_dict`` starts an optimizer without state by stepping it (broadcasts
    included), and a rank that never had state would take that step alone at every save, waiting forever.
    """
    if len(params) < ranks:
        raise ValueError(
            f"zero_stage=1 gives each data-parallel rank whole parameters to update, but {ranks} ranks share "
            f"{len(params)} parameter tensors. Use zero_stage=2 or 3, which split every parameter across the ranks, "
            "or fewer data-parallel ranks."
        )
    owners: dict[Tensor, int] = {}
    sizes = [0] * ranks
    for param in sorted(params, key=lambda p: p.numel(), reverse=True):
        owner = sizes.index(min(sizes))
        owners[param] = owner
        sizes[owner] += param.numel()
    return owners


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's share of ``tensor``: a DTensor's local tensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
