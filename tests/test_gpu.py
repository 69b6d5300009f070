"""On one GPU, the paths a CPU run never takes: bf16 on tensor cores, NCCL, activation checkpointing of the fused
attention kernels, checkpoints staged from GPU memory. Skipped without CUDA; a session lent the GPU machine runs them
(``pytest tests/test_gpu.py``, within 2 minutes). Multi-rank correctness stays on CPU: NCCL refuses two ranks on one
GPU.

Starting a process on the GPU (imports, CUDA, NCCL) takes longer than training the tiny model, so the runs share two
processes: one trains every case the precision and checkpointing tests compare, once each; one saves and resumes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import training
from multirank import run_ranks
from training import Case, Result

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 6
BF16 = Case(accelerator="cuda", strategy={}, steps=STEPS, precision="bf16-mixed")
CASES = {
    "fp32": replace(BF16, precision="32-true"),
    "bf16": BF16,
    "full": replace(BF16, strategy={"activation_checkpointing": "full"}),
    "selective": replace(BF16, strategy={"activation_checkpointing": "selective"}),
}


def train_reporting_backend(cases: list[Case]) -> tuple[list[Result], str]:
    """``cases`` trained one after another (a failed one gives its error), and the process group's backend."""
    results = training.train_cases(cases)
    return results, dist.get_backend() if dist.is_initialized() else ""


@pytest.fixture(scope="module")
def trained() -> tuple[dict[str, Result], str]:
    """Each case of ``CASES`` by name, trained in one process, and the backend they trained under."""
    ((results, backend),) = run_ranks(1, train_reporting_backend, list(CASES.values()))
    return dict(zip(CASES, results, strict=True)), backend


def _results(trained: tuple[dict[str, Result], str], *names: str) -> list[Result]:
    results = [trained[0][name] for name in names]
    for result in results:
        assert not result.error, result.error
    return results


def test_bf16_mixed_on_one_gpu_trains_close_to_fp32_over_nccl_with_fp32_master_weights(trained) -> None:
    fp32, bf16 = _results(trained, "fp32", "bf16")
    assert trained[1] == "nccl"
    assert {tensor.dtype for tensor in bf16.params.values()} == {torch.float32}
    torch.testing.assert_close(bf16.losses, fp32.losses, rtol=3e-2, atol=0)
    assert bf16.losses != fp32.losses


@pytest.mark.parametrize("activation_checkpointing", ["full", "selective"])
def test_activation_checkpointing_on_gpu_recomputes_the_same_bf16_losses(
    trained, activation_checkpointing: str
) -> None:
    plain, checkpointed = _results(trained, "bf16", activation_checkpointing)
    torch.testing.assert_close(checkpointed.losses, plain.losses, rtol=1e-2, atol=0)


def stop_and_resume(case: Case, checkpoint: str) -> tuple[Result, Result]:
    """The uninterrupted run, and the run stopped halfway, saved to ``checkpoint`` and resumed from it, in this one
    process (a Trainer each, as tests/test_resume.py runs them)."""
    whole = training.train(case)
    training.train(case, callbacks=[training.StopAfter(STEPS // 2)], save_to=checkpoint)
    return whole, training.train(case, resume_from=checkpoint)


def test_a_checkpoint_saved_from_gpu_memory_resumes_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    # The whole run stopped early, as a preempted job is, so that both have one LR schedule; and at an epoch's end, as
    # in test_resume: Lightning resumes a checkpoint saved after fit() at the start of the next epoch.
    case = Case(accelerator="cuda", strategy={"zero_stage": 3}, steps=STEPS, limit_train_batches=STEPS // 2)
    ((whole, resumed),) = run_ranks(1, stop_and_resume, case, str(tmp_path / "half.ckpt"))
    torch.testing.assert_close(resumed.losses, whole.losses[STEPS // 2 :], rtol=1e-5, atol=0)
