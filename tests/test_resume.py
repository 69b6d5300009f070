"""A run saved and resumed continues exactly where it stopped: same losses, same weights, as if never stopped."""

from __future__ import annotations

import pytest
import torch
from fsspec import AbstractFileSystem

from multirank import run_each, run_ranks
from training import WEIGHT_ATOL, Case, Result, StopAfter, checkpoint_files, keep_two_newest, listing, train

pytestmark = pytest.mark.multirank

EPOCH = 3  # batches per epoch: the run stops and resumes at an epoch boundary, where the data order restarts


def two_epochs(batch_size: int = 4, model: str = "llama", **strategy) -> Case:
    return Case(strategy=strategy, model=model, steps=2 * EPOCH, limit_train_batches=EPOCH, batch_size=batch_size)


RESUMES = {
    "zero0": (two_epochs(zero_stage=0), two_epochs(zero_stage=0)),
    "zero3": (two_epochs(zero_stage=3), two_epochs(zero_stage=3)),
    "zero3_to_zero0": (two_epochs(zero_stage=3), two_epochs(zero_stage=0)),  # sharded on save, replicated on load
    # layers split across 2 ranks on save, whole on each of 2 data-parallel ranks on load: same global batch
    "tp2_to_dp2": (two_epochs(tensor_parallel_size=2), two_epochs(batch_size=2, zero_stage=3)),
    # GPT-2's fused qkv rows reordered per rank on save (weights and Adam moments), in the model's order on load
    "gpt2_fused_qkv_tp2_to_dp2": (
        two_epochs(model="gpt2_no_bias", tensor_parallel_size=2),
        two_epochs(model="gpt2_no_bias", batch_size=2, zero_stage=3),
    ),
    # two pipeline stages on save, each holding half the blocks; whole models on 2 data-parallel ranks on load
    "pp2_to_dp2": (two_epochs(pipeline_parallel_size=2), two_epochs(batch_size=2, zero_stage=3)),
    # each stage's optimizer state and parameter groups back on the rank of that stage
    "pp2": (two_epochs(pipeline_parallel_size=2), two_epochs(pipeline_parallel_size=2)),
    # stages cut by the tracer (blocks in an nn.Sequential, the head tied to the embedding) on save or on load; data
    # parallelism sharding per block of the nn.Sequential on the other side
    "pp2_traced_to_dp2": (
        two_epochs(model="sequential_blocks", pipeline_parallel_size=2),
        two_epochs(model="sequential_blocks", batch_size=2, zero_stage=3),
    ),
    "dp2_to_pp2_traced": (
        two_epochs(model="sequential_blocks", batch_size=2, zero_stage=1),
        two_epochs(model="sequential_blocks", pipeline_parallel_size=2),
    ),
    # each MoE layer's experts split over 2 ranks on save (and their Adam moments), every expert on each rank on load
    "moe_ep2_to_ep1": (two_epochs(model="moe", expert_parallel_size=2), two_epochs(model="moe")),
    "moe_ep1_zero0_to_ep2": (two_epochs(model="moe", zero_stage=0), two_epochs(model="moe", expert_parallel_size=2)),
    # experts in a list of modules, each rank holding and saving half of them under their own names
    "listed_experts_ep2_to_ep1": (
        two_epochs(model="listed_experts", expert_parallel_size=2),
        two_epochs(model="listed_experts", zero_stage=0),
    ),
    # each sequence split over 2 ranks on save, whole sequences on 2 data-parallel ranks on load, and back
    "cp2_to_dp2": (two_epochs(context_parallel_size=2), two_epochs(batch_size=2, zero_stage=3)),
    "dp2_to_cp2": (two_epochs(batch_size=2, zero_stage=3), two_epochs(context_parallel_size=2)),
    # optimizer state split by parameter on save, whole parameters split across 2 ranks on load
    "dp2_zero1_to_tp2": (two_epochs(batch_size=2, zero_stage=1), two_epochs(tensor_parallel_size=2, zero_stage=3)),
}


_UNINTERRUPTED: dict[str, Result] = {}


def uninterrupted(case: Case, devices: int = 2) -> Result:
    """Trained once per case in these ranks: several saved layouts resume into the same one."""
    if repr(case) not in _UNINTERRUPTED:  # a Case holds a dict of options: not hashable
        _UNINTERRUPTED[repr(case)] = train(case, devices)
    return _UNINTERRUPTED[repr(case)]


def stop_and_resume(saved: Case, resumed: Case, checkpoint: str) -> tuple[Result, Result]:
    stop_and_save(saved, checkpoint, 2)
    return uninterrupted(resumed), resume_from(resumed, checkpoint, 2)


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Result, Result]]:
    """Every pair above, in one pair of ranks: the uninterrupted run, and the run saved and resumed."""
    root = tmp_path_factory.mktemp("resume")
    calls = [(stop_and_resume, (saved, resumed, str(root / name))) for name, (saved, resumed) in RESUMES.items()]
    results, _ = run_ranks(2, run_each, calls)
    return dict(zip(RESUMES, results, strict=True))


@pytest.mark.parametrize("name", RESUMES)
def test_resumed_run_continues_the_uninterrupted_one(resumed_runs: dict[str, tuple[Result, Result]], name: str) -> None:
    assert_continues(*resumed_runs[name])


def test_run_saved_to_s3_and_gcs_by_four_ranks_resumes_from_last_on_four_and_on_two(
    s3_bucket: tuple[str, AbstractFileSystem], gcs_bucket: tuple[str, AbstractFileSystem]
) -> None:
    """Saved in the background every step by 2 data-parallel x 2 tensor-parallel ranks, to a bucket on each of S3
    and GCS; the run is stopped midway and launched again with ``ckpt_path="last"``, from S3 in the same layout
    and from GCS on 2 data-parallel ranks."""
    (s3, s3_storage), (gcs, gcs_storage) = s3_bucket, gcs_bucket
    s3_run, gcs_run = f"{s3}/run", f"{gcs}/run"
    on_four = two_epochs(tensor_parallel_size=2, async_checkpoint="thread")
    on_two = two_epochs(zero_stage=3, async_checkpoint="thread")  # the same global batch: 2 ranks x 4 windows
    calls = [
        (stop_saving_to, (on_four, s3_run, 4)),
        (stop_saving_to, (on_four, gcs_run, 4)),
        (uninterrupted, (on_four, 4)),
        (resume, (on_four, s3_run, 4)),
    ]
    (_, _, uninterrupted_on_four, resumed_on_four), *_ = run_ranks(4, run_each, calls)
    (uninterrupted_on_two, resumed_on_two), _ = run_ranks(
        2, run_each, [(uninterrupted, (on_two,)), (resume, (on_two, gcs_run, 2))]
    )
    assert_continues(uninterrupted_on_four, resumed_on_four)
    assert_continues(uninterrupted_on_two, resumed_on_two)
    assert_two_newest_complete(s3_storage, s3_run, ranks=4)
    assert_two_newest_complete(gcs_storage, gcs_run, ranks=2)


def test_a_run_saved_by_two_replicas_resumes_as_one_and_on_two_ranks(tmp_path) -> None:
    """HSDP saves the model's and the optimizer's state, not the replicas': saved by 2 replicas of 2 ZeRO-3 shards
    each, it resumes on the same 4 ranks sharding together, and on 2 ranks; both continue the run uninterrupted on 2
    ranks (the same global batch)."""
    checkpoint = str(tmp_path / "hsdp.ckpt")
    in_replicas = two_epochs(zero_stage=3, data_parallel_replicas=2)
    on_four, on_two = two_epochs(zero_stage=3), two_epochs(batch_size=8, zero_stage=3)
    calls = [(stop_and_save, (in_replicas, checkpoint, 4)), (resume_from, (on_four, checkpoint, 4))]
    (_, resumed_on_four), *_ = run_ranks(4, run_each, calls)
    (uninterrupted_on_two, resumed_on_two), _ = run_ranks(
        2, run_each, [(uninterrupted, (on_two,)), (resume_from, (on_two, checkpoint, 2))]
    )
    assert_continues(uninterrupted_on_two, resumed_on_four)
    assert_continues(uninterrupted_on_two, resumed_on_two)


def assert_two_newest_complete(storage: AbstractFileSystem, run: str, ranks: int) -> None:
    """Every step saved in the background; the two newest stayed, each complete, and last.ckpt names the newest.
    Each rank wrote its own shards straight to the bucket; Lightning's loop state sits beside them."""
    assert listing(storage, run) == {
        "epoch=1-step=5.ckpt": checkpoint_files(ranks),
        "epoch=1-step=6.ckpt": checkpoint_files(ranks),
        "last.ckpt": ["epoch=1-step=6.ckpt"],
    }


def stop_and_save(case: Case, checkpoint: str, devices: int) -> None:
    """The run stopped midway and saved to ``checkpoint`` by ``trainer.save_checkpoint``."""
    train(case, devices, callbacks=[StopAfter(EPOCH)], save_to=checkpoint)


def resume_from(case: Case, checkpoint: str, devices: int) -> Result:
    return train(case, devices, resume_from=checkpoint)


def stop_saving_to(case: Case, run: str, devices: int) -> None:
    """The run preempted midway, after saving every step to ``run``."""
    train(case, devices, callbacks=[StopAfter(EPOCH), keep_two_newest(run)])


def resume(case: Case, run: str, devices: int) -> Result:
    """The run a user launches again after preemption, with ``ckpt_path="last"``, here perhaps in another layout."""
    return train(case, devices, callbacks=[keep_two_newest(run)], resume_from="last")


def assert_continues(uninterrupted: Result, resumed_run: Result) -> None:
    # The equivalence tests' tolerance: a run whose first half ran under another layout summed in another order.
    assert len(resumed_run.losses) == EPOCH
    torch.testing.assert_close(resumed_run.losses, uninterrupted.losses[EPOCH:], rtol=1e-5, atol=0)
    for key, value in uninterrupted.params.items():
        torch.testing.assert_close(resumed_run.params[key], value, rtol=1e-5, atol=WEIGHT_ATOL, msg=key)
