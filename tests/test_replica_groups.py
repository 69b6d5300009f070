"""Replica groups (``ParallelStrategy(replica_groups=...)``, on torchft): launches that train as one and survive
each other. Each group here is its own gloo process group of 2 ranks, as each torchrun would start it, meeting the
others at a torchft lighthouse this test serves; every group loads the same global batch and trains on its share."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import Callback
from torchft.coordination import LighthouseServer

from lightdist.plugins import ParallelStrategy
from lightdist.resilience.replica_groups import ReplicaGroups

from multirank import raised, run_each, run_ranks
from training import WEIGHT_ATOL, Case, References, Result, checkpoint_files, keep_two_newest, listing, train

GROUPS = 3
CASE = Case(strategy=dict(zero_stage=3), batch_size=6)  # 6 rows a rank: 2 for each of 3 groups, 3 for each of 2
REFERENCES = References([CASE.reference(world_size=2)])


@pytest.fixture
def lighthouse() -> Iterator[str]:
    # A lost group's heartbeat stops for 1 s before the survivors' next quorum leaves it out; a live group that is
    # slow to ask (saving a checkpoint) is waited for up to a minute, not left out after torchft's default 100 ms.
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=1_000)
    yield server.address()
    server.shutdown()


class KillRankAt(Callback):
    """SIGKILLs this rank mid-step, between its forward and backward, at ``step``, in the group named ``group``."""

    def __init__(self, group: str, rank: int, step: int) -> None:
        self.group, self.rank, self.step = group, rank, step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        options = trainer.strategy.replica_group.options
        if options.group == self.group and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class GroupShares(Callback):
    """The rows of each step's batch that this group trained on, and the steps it redid."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append(trainer.strategy.replica_group.rows)
        self.redone = trainer.strategy.replica_group.steps_redone
        self.writes = trainer.strategy.checkpoint_io.writes


def train_in_group(
    case: Case, lighthouse: str, group: str, callbacks: list[Callback]
) -> tuple[Result, list[int], int, bool]:
    """``case`` trained in the replica group ``group``: its result, its rows of each step's batch, the steps it
    redid, and whether it wrote the checkpoints of the last step."""
    options = ReplicaGroups(lighthouse=lighthouse, group=group, groups=GROUPS, timeout=20.0)
    shares = GroupShares()
    in_group = Case(**{**case.__dict__, "strategy": {**case.strategy, "replica_groups": options}})
    return train(in_group, 2, [*callbacks, shares]), shares.rows, shares.redone, shares.writes


def run_groups(
    lighthouse: str, callbacks: list[Callback] = ()
) -> list[list[tuple[Result, list[int], int, bool]] | BaseException]:
    """Every group's ranks' results, or the error its launch ended with."""
    with ThreadPoolExecutor(GROUPS) as pool:
        launches = [
            pool.submit(run_ranks, 2, train_in_group, CASE, lighthouse, f"group-{g}", list(callbacks), timeout=240)
            for g in range(GROUPS)
        ]
        return [launch.exception() or launch.result() for launch in launches]


def assert_same_training(result: Result, single: Result) -> None:
    torch.testing.assert_close(result.losses, single.losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(result.grad_norms, single.grad_norms, rtol=1e-5, atol=0)
    for key in single.params:
        torch.testing.assert_close(result.params[key], single.params[key], rtol=1e-5, atol=WEIGHT_ATOL, msg=key)


def test_three_groups_train_as_one_process_on_the_global_batch(lighthouse: str) -> None:
    single = REFERENCES[CASE.reference(world_size=2)]
    for group in run_groups(lighthouse):
        assert not isinstance(group, BaseException), group
        for result, rows, redone, _ in group:
            assert_same_training(result, single)
            assert rows == [2] * CASE.steps and redone == 0


def test_the_others_go_on_when_a_group_loses_a_rank_mid_step_and_redo_that_step(lighthouse: str, tmp_path) -> None:
    single = REFERENCES[CASE.reference(world_size=2)]
    run = str(tmp_path / "run")
    first, lost, last = run_groups(lighthouse, [KillRankAt("group-1", rank=1, step=2), keep_two_newest(run)])
    assert isinstance(lost, RuntimeError) and "killed by SIGKILL" in str(lost)
    # The same processes trained every step, on the uninterrupted run's batches; the first group in each step's
    # quorum alone saved its checkpoints, complete, into the one run folder.
    for survivor, writer in ((first, True), (last, False)):
        assert not isinstance(survivor, BaseException), survivor
        for result, rows, redone, writes in survivor:
            assert_same_training(result, single)
            assert rows == [2, 2, 3, 3, 3] and redone == 1 and writes == writer
    assert listing(LocalFileSystem(), f"file://{run}") == {
        "epoch=0-step=4.ckpt": checkpoint_files(2),
        "epoch=0-step=5.ckpt": checkpoint_files(2),
        "last.ckpt": ["epoch=0-step=5.ckpt"],
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(groups=0), r"replica_groups.groups=0 must be a positive number of groups"),
        (dict(min_groups=0), r"replica_groups.min_groups=0 must be a positive number of groups"),
        (dict(timeout=0), r"replica_groups.timeout=0 must be a positive number of seconds"),
        (dict(group="group-0"), r"needs the torchft lighthouse's address: set replica_groups.lighthouse or \$TORCHFT"),
        (dict(lighthouse="http://127.0.0.1:29510"), r"needs this launch's group name.*\$LIGHTDIST_REPLICA_GROUP"),
    ],
)
def test_bad_options_are_refused_as_the_strategy_is_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelStrategy(replica_groups=ReplicaGroups(**options))


def test_what_a_group_could_not_train_as_one_process_is_refused_before_training() -> None:
    options = ReplicaGroups(lighthouse="http://127.0.0.1:1", group="group-0")  # never reached
    accumulating = Case(strategy=dict(replica_groups=options), accumulate_grad_batches=2)
    labelled = Case(strategy=dict(replica_groups=options), model="zoo_hf_llama_finetuning", data="padded")
    errors = run_ranks(1, run_each, [(raised, (train, accumulating)), (raised, (train, labelled))])[0]
    assert "accumulate_grad_batches=2 spreads a step over batches already used" in errors[0]
    assert "set loss_weighting='batches'" in errors[1]
