"""A LightningModule written for Lightning's ``ModelParallelStrategy`` trains unchanged under lightdist: its
``configure_model`` splits the model on ``self.device_mesh["tensor_parallel"]`` (and shards it on
``["data_parallel"]``), as Lightning's tensor-parallelism docs show, and lightdist keeps that split."""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

from lightdist.plugins import ParallelStrategy

from multirank import raised, run_each, run_ranks

pytestmark = pytest.mark.multirank


class FeedForward(nn.Module):
    """The SwiGLU feed-forward of Lightning's tensor-parallelism example."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LitModel(LightningModule):
    def __init__(self, fully_shard_too: bool = False) -> None:
        super().__init__()
        self.model = FeedForward(32, 64)
        self.fully_shard_too = fully_shard_too

    def configure_model(self) -> None:
        if self.device_mesh is None:  # one process, no strategy of Lightning's model-parallel kind
            return
        tp_mesh = self.device_mesh["tensor_parallel"]
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
        parallelize_module(self.model, tp_mesh, plan)
        if self.fully_shard_too:
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Tensor) -> Tensor:
        # The docs sum the output; a mean makes the data-parallel ranks' average one process's loss.
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


class RecordLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.split = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())
        self.split = isinstance(pl_module.model.w1.weight, DTensor)


def train(
    strategy: ParallelStrategy | str, devices: int, dp: int = 1, fully_shard_too: bool = False
) -> tuple[list[float], bool]:
    """4 AdamW steps on the same 32 random vectors, 8 per step over the ``dp`` data-parallel ranks."""
    seed_everything(0)
    model = LitModel(fully_shard_too)
    data = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    record = RecordLosses()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=4,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Lightning shuffles training data over data-parallel ranks; one process draws the same order from one replica.
    sampler = DistributedSampler(data, num_replicas=1, rank=0) if dp == 1 else None
    trainer.fit(model, DataLoader(data, batch_size=8 // dp, sampler=sampler))
    return record.losses, record.split


@cache
def runs() -> list:
    return run_ranks(
        4,
        run_each,
        [
            (train, (ParallelStrategy(tensor_parallel_size=2), 4, 2, True)),
            (train, (ParallelStrategy(tensor_parallel_size=2), 4, 2, False)),
            (raised, (train, ParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), 4)),
        ],
    )[0]


def test_lightnings_tensor_parallel_example_trains_unchanged_with_one_process_losses() -> None:
    (one_process, split) = run_ranks(1, train, "auto", 1)[0]
    assert not split
    (its_own_sharding, split), (sharded_by_lightdist, split_too), _ = runs()
    assert split and split_too  # configure_model split w1 on the tensor-parallel ranks
    # fully_shard by configure_model on ["data_parallel"], or ZeRO-3 by lightdist over the same ranks
    assert its_own_sharding == pytest.approx(one_process, rel=1e-5)
    assert sharded_by_lightdist == pytest.approx(one_process, rel=1e-5)
    assert one_process[-1] < one_process[0]


def test_a_pipeline_over_a_model_configure_model_split_is_refused_with_the_fix() -> None:
    *_, error = runs()
    assert error.startswith(
        "ValueError: LitModel.configure_model split the model itself (DTensor parameters or fully_shard), but "
        "pipeline_parallel_size=2 cuts stages from the model as written."
    )
