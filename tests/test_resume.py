"""A run saved and resumed continues exactly where it stopped: same losses, same weights, as if never stopped."""

from __future__ import annotations

import pytest
import torch
from fsspec import AbstractFileSystem

from lightdist.plugins import ModelCheckpoint

from multirank import run_each, run_ranks
from training import Case, Result, StopAfter, train

pytestmark = pytest.mark.multirank

EPOCH = 3  # batches per epoch: the run stops and resumes at an epoch boundary, where the data order restarts


def two_epochs(batch_size: int = 4, model: str = "llama", **strategy) -> Case:
    return Case(strategy=strategy, model=model, steps=2 * EPOCH, limit_train_batches=EPOCH, batch_size=batch_size)


RESUMES = {
    "zero0": (two_epochs(zero_stage=0), two_epochs(zero_stage=0)),
    "zero1": (two_epochs(zero_stage=1), two_epochs(zero_stage=1)),  # each rank saves and loads its own share
    "zero2": (two_epochs(zero_stage=2), two_epochs(zero_stage=2)),
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
    # optimizer state split by parameter on save, whole parameters split across 2 ranks on load
    "dp2_zero1_to_tp2": (two_epochs(batch_size=2, zero_stage=1), two_epochs(tensor_parallel_size=2, zero_stage=3)),
}


_UNINTERRUPTED: dict[str, Result] = {}


def uninterrupted(case: Case) -> Result:
    """Trained once per case in these ranks: several saved layouts resume into the same one."""
    if repr(case) not in _UNINTERRUPTED:  # a Case holds a dict of options: not hashable
        _UNINTERRUPTED[repr(case)] = train(case, devices=2)
    return _UNINTERRUPTED[repr(case)]


def stop_and_resume(saved: Case, resumed: Case, checkpoint: str) -> tuple[Result, Result]:
    train(saved, devices=2, callbacks=[StopAfter(EPOCH)], save_to=checkpoint)
    return uninterrupted(resumed), train(resumed, devices=2, resume_from=checkpoint)


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


def test_run_resumed_from_s3_last_continues_the_uninterrupted_one(s3_bucket: tuple[str, AbstractFileSystem]) -> None:
    url, storage = s3_bucket
    (uninterrupted, resumed_run), _ = run_ranks(2, stop_and_resume_last, two_epochs(), two_epochs(), f"{url}/run")
    assert_continues(uninterrupted, resumed_run)
    assert_two_newest_complete(storage, f"{url}/run")


def test_run_saved_to_gcs_by_tensor_parallel_ranks_resumes_on_data_parallel_ones(
    gcs_bucket: tuple[str, AbstractFileSystem],
) -> None:
    url, storage = gcs_bucket
    saved, resumed = RESUMES["tp2_to_dp2"]
    (uninterrupted, resumed_run), _ = run_ranks(2, stop_and_resume_last, saved, resumed, f"{url}/run")
    assert_continues(uninterrupted, resumed_run)
    assert_two_newest_complete(storage, f"{url}/run")


def assert_two_newest_complete(storage: AbstractFileSystem, run: str) -> None:
    """Every step saved in the background; the two newest stayed, each complete, and last.ckpt names the newest.
    Each rank wrote its own shard straight to the bucket; Lightning's loop state sits beside them."""
    run = run.split("://", 1)[1]
    storage.invalidate_cache()
    assert sorted(path.rsplit("/", 1)[-1] for path in storage.ls(run)) == [
        "epoch=1-step=5.ckpt",
        "epoch=1-step=6.ckpt",
        "last.ckpt",
    ]
    assert {path.rsplit("/", 1)[-1] for path in storage.ls(f"{run}/epoch=1-step=6.ckpt")} == {
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        "meta.pt",
        "COMPLETE",
    }
    assert storage.cat(f"{run}/last.ckpt") == b'{"lightdist_checkpoint": "epoch=1-step=6.ckpt"}'


def stop_and_resume_last(saved: Case, resumed: Case, run: str) -> tuple[Result, Result]:
    """The run a user launches again after preemption, with ``ckpt_path="last"``, here perhaps in another layout."""

    def keep_two_newest() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=run, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True
        )

    train(saved, devices=2, callbacks=[StopAfter(EPOCH), keep_two_newest()])
    return uninterrupted(resumed), train(resumed, devices=2, callbacks=[keep_two_newest()], resume_from="last")


def assert_continues(uninterrupted: Result, resumed_run: Result) -> None:
    # The equivalence tests' tolerance: a run whose first half ran under another layout summed in another order.
    assert len(resumed_run.losses) == EPOCH
    torch.testing.assert_close(resumed_run.losses, uninterrupted.losses[EPOCH:], rtol=1e-5, atol=0)
    for key, value in uninterrupted.params.items():
        torch.testing.assert_close(resumed_run.params[key], value, rtol=1e-5, atol=1e-5, msg=key)
