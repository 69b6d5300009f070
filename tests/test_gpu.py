"""On one GPU, the paths a CPU run never takes: bf16 on tensor cores, NCCL, activation checkpointing of the fused
attention kernels, checkpoints staged from GPU memory. Skipped without CUDA; a session lent the GPU machine runs them
(``pytest tests/test_gpu.py``). Multi-rank correctness stays on CPU: NCCL refuses two ranks on one GPU."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import training
from multirank import run_ranks
from training import Case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 6


def train_reporting_backend(case: Case) -> tuple[training.Result, str]:
    """``case`` trained, and the process group's backend it trained under."""
    result = training.train(case)
    return result, dist.get_backend() if dist.is_initialized() else ""


def test_bf16_mixed_on_one_gpu_trains_close_to_fp32_over_nccl_with_fp32_master_weights() -> None:
    (fp32, backend), (bf16, _) = (
        run_ranks(1, train_reporting_backend, Case(accelerator="cuda", strategy={}, steps=STEPS, precision=precision))[
            0
        ]
        for precision in ("32-true", "bf16-mixed")
    )
    assert backend == "nccl"
    assert {tensor.dtype for tensor in bf16.params.values()} == {torch.float32}
    torch.testing.assert_close(bf16.losses, fp32.losses, rtol=3e-2, atol=0)
    assert bf16.losses != fp32.losses


@pytest.mark.parametrize("activation_checkpointing", ["full", "selective"])
def test_activation_checkpointing_on_gpu_recomputes_the_same_bf16_losses(activation_checkpointing: str) -> None:
    cases = [
        Case(accelerator="cuda", strategy=strategy, steps=STEPS, precision="bf16-mixed")
        for strategy in ({}, {"activation_checkpointing": activation_checkpointing})
    ]
    plain, checkpointed = (run_ranks(1, training.train, case)[0] for case in cases)
    torch.testing.assert_close(checkpointed.losses, plain.losses, rtol=1e-2, atol=0)


def test_a_checkpoint_saved_from_gpu_memory_resumes_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    # The whole run stopped early, as a preempted job is, so that both have one LR schedule; and at an epoch's end, as
    # in test_resume: Lightning resumes a checkpoint saved after fit() at the start of the next epoch.
    case = Case(accelerator="cuda", strategy={"zero_stage": 3}, steps=STEPS, limit_train_batches=STEPS // 2)
    (whole,) = run_ranks(1, training.train, case)
    stopped = partial(training.train, callbacks=[training.StopAfter(STEPS // 2)], save_to=str(tmp_path / "half.ckpt"))
    run_ranks(1, stopped, case)
    (resumed,) = run_ranks(1, partial(training.train, resume_from=str(tmp_path / "half.ckpt")), case)
    torch.testing.assert_close(resumed.losses, whole.losses[STEPS // 2 :], rtol=1e-5, atol=0)
