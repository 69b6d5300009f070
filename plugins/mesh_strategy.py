"""``MeshStrategy``: the processes of a run and the ``("pp", "dp", "tp")`` DeviceMesh over them.

``ParallelStrategy`` trains on the mesh; this layer makes it. The layout's sizes are checked against the world size as
soon as the Trainer knows its devices, before any process starts; the processes meet in their start's round of the
store (a restarted rank cannot meet a rank of the start before); every group waits ``collective_timeout``; each rank
beats a heartbeat into the store, so the rank a collective timed out on is named; the rank that failed first prints
its traceback, the others one line each (``lightdist/resilience/failures.py``); ``sync_dist`` reduces over the
data-parallel ranks, who alone see different batches.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

from lightdist.config import ParallelConfig
from lightdist.layout import ParallelLayout, ParallelMesh
from lightdist.parallel.context import ContextParallel, context_parallel_over
from lightdist.parallel.expert_parallel import check_expert_layout
from lightdist.parallel.sharding import check_replicas
from lightdist.plugins.auto_layout import LayoutRequest
from lightdist.plugins.lightning_internals import give_device_mesh
from lightdist.plugins.resume import ResumesLast, resuming_launcher
from lightdist.resilience.failures import FailureReport
from lightdist.resilience.heartbeat import Heartbeat, name_the_silent_rank, store_on_rank_zero
from lightdist.resilience.replica_groups import ReplicaGroup
from lightdist.resilience.restarts import nodes_started_by_torchrun, round_store
from lightdist.torch_internals import set_group_timeout

__all__ = ["MeshStrategy"]


class MeshStrategy(ModelParallelStrategy):
    """Starts a run's processes and builds the mesh of ``sizes``; ``config`` is how the model will be split, which the
    planner needs for ``"auto"`` sizes."""

    def __init__(
        self,
        sizes: LayoutRequest,
        config: ParallelConfig,
        collective_timeout: float,
        process_group_backend: str | None,
    ) -> None:
        self._collective_timeout = timedelta(seconds=collective_timeout)
        super().__init__(process_group_backend=process_group_backend, timeout=self._collective_timeout)
        self._backend = process_group_backend
        self._sizes, self._config = sizes, config
        self._layout: ParallelLayout | None = None
        self._mesh: ParallelMesh | None = None
        self._resuming_launcher: ResumesLast | None = None
        self._heartbeat: Heartbeat | None = None
        self._failures: FailureReport | None = None
        self.context_parallel: ContextParallel | None = None  # each sequence split over neighbouring "dp" ranks
        self.replica_group: ReplicaGroup | None = None  # this launch's place among replica groups, while fit runs

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError(
                "The parallel layout is known once the Trainer knows its devices and nodes, and where the planner "
                "picks it ('auto' sizes), once the processes have started."
            )
        return self._layout

    @property
    @override
    def device_mesh(self) -> ParallelMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh is built once the processes have started: in the strategy's setup.")
        return self._mesh

    @property
    @override
    def launcher(self) -> ResumesLast | None:
        return self._resuming_launcher

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only data-parallel ranks see different batches: tensor-parallel peers share theirs.
        rank, size = self._data_parallel
        return {"num_replicas": size, "rank": rank}

    @property
    def _data_parallel(self) -> tuple[int, int]:
        """This rank's index among the data-parallel ranks, and their number (context-parallel peers, beside each
        other in ``"dp"``, share a batch)."""
        return self.device_mesh["dp"].get_local_rank() // self.layout.cp, self.layout.dp

    def check_world_size(self, world_size: int, launcher: str) -> None:
        """Raise what this strategy's sizes would raise on ``world_size`` ranks, before a ``launcher`` starts any."""
        if not self._sizes.planned:
            self._sizes.resolve(world_size, launcher, devices_per_node=self.num_processes)

    @property
    @override
    def root_device(self) -> torch.device:
        # A launcher that gives each process one device of its own (Ray, with `devices="auto"`) leaves Lightning one
        # device per process, whatever the process's local rank.
        if len(self.parallel_devices) == 1:
            return self.parallel_devices[0]
        return super().root_device

    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this once it knows devices and nodes: the earliest point where the layout can be
        # checked against the world size, long before any process starts or any memory is allocated. The planner
        # needs the model, which the Trainer does not have yet.
        if isinstance(self.cluster_environment, TorchElasticEnvironment):
            self.num_nodes = nodes_started_by_torchrun(self.num_nodes, report=rank_zero_info)
        if not self._sizes.planned:
            self._layout = self._resolve_layout()
            check_expert_layout(self._config.expert_parallel_size, self._layout.dp * self._layout.cp)
            check_replicas(self._config.data_parallel_replicas, self._layout.dp, self._config.zero_stage)
        if self._config.cpu_offload and self.root_device.type == "cpu":
            raise ValueError(
                "cpu_offload=True moves sharded state from accelerator memory to CPU memory, but the accelerator is "
                "the CPU. Drop cpu_offload, or train on GPUs."
            )
        self._resuming_launcher = resuming_launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _start_process_group(self) -> None:
        """The world's process group, its ranks met in this start's round of the store, its collectives waiting
        ``collective_timeout``; NCCL's groups destroyed at exit, as torch asks."""
        environment, backend = self.cluster_environment, self.process_group_backend
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = environment.main_address, str(environment.main_port)
        dist.init_process_group(
            backend,
            rank=self.global_rank,
            world_size=self.world_size,
            store=round_store(self.global_rank, self._collective_timeout),
            timeout=self._collective_timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )
        if backend == "nccl":
            atexit.register(_destroy_process_group)
        rank_zero_info(f"lightdist: {self.world_size} processes joined the process group ({backend})")

    def _resolve_layout(self) -> ParallelLayout:
        """The given sizes on the ranks the job will have, which the launcher that started them sets (torchrun,
        SLURM, Ray), or ``num_nodes x devices``, as Lightning's launcher starts them."""
        environment = self.cluster_environment
        if environment is not None and environment.creates_processes_externally:
            world = environment.world_size(), f"the launcher's world size ({type(environment).__name__})"
        else:
            world = self.num_nodes * self.num_processes, "devices x num_nodes"
        return self._sizes.resolve(*world, devices_per_node=self.num_processes)

    @property
    @override
    def process_group_backend(self) -> str:
        return self._backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    @override
    def setup_environment(self) -> None:
        _share_cpu_threads(self.num_processes)
        self.accelerator.setup_device(self.root_device)
        reset_seed()
        self.set_world_ranks()
        if not dist.is_initialized():
            self._start_process_group()
        if self._sizes.planned:
            # Every rank plans, so that each raises a bad input itself; rank 0's layout is taken, so that ranks on
            # machines that differ cannot disagree.
            layout, report = self._sizes.plan(
                self.lightning_module,
                world_size=self.world_size,
                devices_per_node=self.num_processes,
                device=self.root_device,
                config=self._config,
            )
            self._layout = self.broadcast(layout)
            rank_zero_info(report)
        else:
            self._layout = self._resolve_layout()
        self._resuming_launcher.check_every_rank_resumes_alike()
        self._mesh = self._layout.build_mesh(self.root_device.type)
        for dim in self._mesh.mesh_dim_names:  # torch makes a mesh's groups with its default timeout
            set_group_timeout(self._mesh[dim].get_group(), self._collective_timeout)
        give_device_mesh(self.lightning_module, self._mesh)
        method = self._config.context_parallel_method
        self.context_parallel = context_parallel_over(self._mesh, self._layout.cp, method, self.lightning_module)
        if self.world_size > 1:  # a single process has no one to wait on
            if self._heartbeat is None:
                store = store_on_rank_zero(self.cluster_environment.main_address, self._collective_timeout)
                self._heartbeat = Heartbeat.started(store, self.global_rank, self._collective_timeout)
            self._failures = FailureReport(self._heartbeat.store, self.global_rank)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._heartbeat is not None:
            self._heartbeat.beat(self.lightning_module.trainer.global_step)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        name_the_silent_rank(exception, self._heartbeat, self.world_size)
        if self._failures is not None:
            self._failures.report(exception)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over the data-parallel ranks unless told otherwise: what a step logs with ``sync_dist=True`` is the
        same on tensor-parallel peers and on every pipeline stage, and a sum over the world would count it again.
        Among replica groups, a mean or sum also spans the other groups' shares of the batch."""
        reduced = super().reduce(tensor, group if group is not None else self.device_mesh["dp"].get_group(), reduce_op)
        if self.replica_group is None or group is not None or not isinstance(reduced, Tensor):
            return reduced
        if reduce_op in ("mean", "avg", ReduceOp.AVG):
            return self.replica_group.average(reduced)
        return self.replica_group.sum(reduced) if reduce_op in ("sum", ReduceOp.SUM) else reduced

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Every rank votes (to save a checkpoint, to stop early): over the world, not the data-parallel ranks alone.
        votes = super().reduce(torch.tensor(int(decision), device=self.root_device), dist.group.WORLD, ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def teardown(self) -> None:
        if self.replica_group is not None:
            self.replica_group.shutdown()
            self.replica_group = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        super().teardown()


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _share_cpu_threads(local_ranks: int) -> None:
    """Give each local rank its share of the cores, unless the user chose OMP_NUM_THREADS.

    Lightning's launcher caps threads only in the process it launches from; the ranks it starts run one intra-op
    thread per core, and ranks that wait on each other in collectives then also wait for cores. Measured: 4 CPU
    ranks with tensor parallelism on 2 cores trained 3.4x slower (0.55 against 1.84 steps/s).
    """
    if "OMP_NUM_THREADS" not in os.environ and local_ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
