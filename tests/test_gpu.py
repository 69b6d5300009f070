"""On one GPU, the paths a CPU run never takes: bf16 on tensor cores, NCCL, activation checkpointing of the fused
attention kernels, checkpoints staged from GPU memory, context parallelism's CUDA attention kernels. Skipped without
CUDA; a session lent the GPU machine runs them (``pytest tests/test_gpu.py``, within 2 minutes). Multi-rank
correctness stays on CPU: NCCL refuses two ranks on one GPU (context parallelism's two ranks share it over gloo).

Starting a process on the GPU (imports, CUDA, NCCL) takes longer than training the tiny model, so the runs share two
processes: one trains every case the precision and checkpointing tests compare, once each; one saves and resumes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightdist.parallel.context import ContextParallel

import training
from multirank import run_ranks
from test_context_parallel import hf_llama, labels_loss, one_process_and_split
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


def bf16_labels_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cuda", torch.bfloat16):
        return labels_loss(model, batch)


def context_parallel_on_one_gpu() -> dict[str, dict[str, float]]:
    """A Hugging Face Llama's collated batch split over two ranks on the one GPU, against one process: the ring's
    chunks of queries attend over gathered keys under a causal mask of their own (70 tokens padded to 72 to split:
    chunks of 18), in bf16 and fp32; all-to-all runs the model's own SDPA on the whole sequence."""
    dist.init_process_group("gloo")  # gloo carries CUDA tensors through the host
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
    results = {}
    for length in (128, 70):
        tokens = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length)).cuda()
        kept = torch.arange(length, device="cuda")[None] < torch.tensor([[length], [length - 9]], device="cuda")
        collated = {"input_ids": tokens, "attention_mask": kept.long(), "labels": tokens.masked_fill(~kept, -100)}
        for precision, loss_of in (("fp32", labels_loss), ("bf16", bf16_labels_loss)):
            for method in ("ring", "all_to_all"):
                model = hf_llama().cuda()
                cp = ContextParallel(mesh, method, model)
                results[f"{method}_{precision}_{length}"] = one_process_and_split(model, collated, loss_of, cp)
    return results


@pytest.fixture(scope="module")
def split_on_gpu() -> dict[str, dict[str, float]]:
    return run_ranks(2, context_parallel_on_one_gpu)[0]


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize("length", [128, 70])
def test_context_parallel_attention_kernels_on_gpu_compute_what_one_process_computes(
    split_on_gpu, method: str, length: int
) -> None:
    fp32, bf16 = split_on_gpu[f"{method}_fp32_{length}"], split_on_gpu[f"{method}_bf16_{length}"]
    assert fp32["loss"] < 1e-5 and fp32["gradients"] < 1e-4, fp32
    assert bf16["loss"] < 1e-2 and bf16["gradients"] < 5e-2, bf16
