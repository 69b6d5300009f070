"""Each ZeRO stage holds what the ZeRO paper says it holds, measured per rank at dp=4; in 2 replicas (HSDP), what it
holds at dp=2, each replica sharding over its own 2 ranks.

For fp32 training with Adam, Psi parameters cost 4 Psi bytes of weights, 4 Psi of gradients and 8 Psi of optimizer
state (exp_avg, exp_avg_sq); stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the
weights. Weights are measured between forward and backward, where stage 2 holds them whole and stage 3 does not.
"""

from __future__ import annotations

import pytest
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor

import training
from multirank import run_ranks
from training import Case

pytestmark = pytest.mark.multirank

DP = 4


def _local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


class _MeasureState(Callback):
    """Per-rank bytes of weights (after forward), gradients (before the step) and optimizer state (after it)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.bytes["params"] = _local_bytes(pl_module.parameters())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.bytes["grads"] = _local_bytes(p.grad for p in pl_module.parameters() if p.grad is not None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.strategy.optimizers[0]
        self.bytes["optimizer"] = _local_bytes(
            value for state in optimizer.state.values() for value in state.values() if value.dim() > 0
        )


# (zero_stage, data_parallel_replicas)
LAYOUTS = [(0, 1), (1, 1), (2, 1), (3, 1), (2, 2), (3, 2)]


def measure(zero_stage: int, replicas: int) -> dict[str, int]:
    probe = _MeasureState()
    case = Case(strategy=dict(zero_stage=zero_stage, data_parallel_replicas=replicas), steps=1)
    training.train(case, devices=DP, callbacks=[probe])
    return probe.bytes


def measure_all_layouts() -> list[dict[str, int]]:
    return [measure(*layout) for layout in LAYOUTS]


@pytest.fixture(scope="module")
def per_rank_bytes() -> list[dict[tuple[int, int], dict[str, int]]]:
    """[rank][(stage, replicas)] -> bytes."""
    return [dict(zip(LAYOUTS, measured, strict=True)) for measured in run_ranks(DP, measure_all_layouts)]


@pytest.mark.parametrize(("zero_stage", "replicas"), LAYOUTS)
def test_zero_stage_memory_matches_the_paper(per_rank_bytes, zero_stage: int, replicas: int) -> None:
    psi = sum(p.numel() for p in training.MODELS["llama"]().parameters())
    shards = {"params": zero_stage >= 3, "grads": zero_stage >= 2, "optimizer": zero_stage >= 1}
    full_bytes = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    sharding = DP // replicas
    for rank, layouts in enumerate(per_rank_bytes):
        measured = layouts[zero_stage, replicas]
        for kind, sharded in shards.items():
            expected = full_bytes[kind] / sharding if sharded else full_bytes[kind]
            assert measured[kind] == pytest.approx(expected, rel=0.10), (
                f"rank {rank}, ZeRO-{zero_stage} in {replicas} replicas, {kind}: {measured[kind]} bytes, the paper "
                f"says {expected:.0f}"
            )
