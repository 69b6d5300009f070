"""Lightning's precision flag drives FSDP2's mixed precision: bf16 compute, fp32 master weights and reductions."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from lightning.pytorch import Callback

import training
from multirank import run_each, run_ranks
from training import Case, References

pytestmark = pytest.mark.multirank


class _RecordComputeDtype(Callback):
    """The dtype a block's weight has while the block runs, which is what its matmul computes in."""

    def __init__(self) -> None:
        self.dtypes: set[torch.dtype] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        projection = pl_module.model.layers[0].self_attn.q_proj
        projection.register_forward_hook(lambda module, args, output: self.dtypes.add(module.weight.dtype))


def train_and_record_dtypes(case: Case) -> tuple[training.Result, set[torch.dtype]]:
    probe = _RecordComputeDtype()
    return training.train(case, devices=2, callbacks=[probe]), probe.dtypes


ZERO_STAGES = (1, 2, 3)
STEPS = 3


# The single-process fp32 run every stage's bf16 run is compared with, trained once, beside them.
FP32 = Case(steps=STEPS, batch_size=2 * Case.batch_size)
REFERENCES = References([FP32])


@cache
def bf16_results() -> dict[int, tuple[training.Result, set[torch.dtype]]]:
    """A bf16 run per ZeRO stage, all in one pair of ranks."""
    REFERENCES.start()
    cases = [Case(strategy=dict(zero_stage=stage), precision="bf16-mixed", steps=STEPS) for stage in ZERO_STAGES]
    results, _ = run_ranks(2, run_each, [(train_and_record_dtypes, (case,)) for case in cases])
    return dict(zip(ZERO_STAGES, results, strict=True))


@pytest.mark.parametrize("zero_stage", ZERO_STAGES)
def test_bf16_mixed_computes_in_bf16_and_keeps_fp32_weights(zero_stage: int) -> None:
    result, dtypes = bf16_results()[zero_stage]
    reference = REFERENCES[FP32]

    assert dtypes == {torch.bfloat16}
    assert {tensor.dtype for tensor in result.params.values()} == {torch.float32}
    # bf16 rounds to 3 significant digits: close to the fp32 run, and not identical to it.
    torch.testing.assert_close(result.losses, reference.losses, rtol=3e-2, atol=0)
    assert result.losses != reference.losses
