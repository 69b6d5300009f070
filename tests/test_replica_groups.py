"""Replica groups (``ParallelStrategy(replica_groups=...)``, on torchft): launches that train as one and survive
each other. Each group here is its own gloo process group of 2 ranks, as each torchrun would start it, meeting the
others at a torchft lighthouse this test serves; every group loads the same global batch and trains on its share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import Callback
from torchft.coordination import LighthouseServer

from lightdist.plugins import ParallelStrategy
from lightdist.resilience.replica_groups import ReplicaGroups

from multirank import free_port, raised, run_each, run_ranks
from training import (
    WEIGHT_ATOL,
    Case,
    References,
    Result,
    checkpoint_files,
    keep_two_newest,
    listing,
    merge_stages,
    train,
)

GROUPS = 3
# 6 rows a rank: 2 for each of 3 groups, 3 for each of 2; steps enough for a group to be lost and its peers go on
CASE = Case(strategy=dict(zero_stage=3), batch_size=6, steps=5)
LONG = Case(strategy=dict(zero_stage=3), batch_size=6, steps=16)  # long enough for a group started again to join
TP2 = Case(strategy=dict(zero_stage=3, tensor_parallel_size=2), batch_size=12, steps=5)  # 4 rows for 3 groups, 6 for 2
PP2 = Case(strategy=dict(zero_stage=3, pipeline_parallel_size=2, microbatches=2), batch_size=12, steps=5)
# Hugging Face Llama fine-tuned on collated, padded batches labelled -100 where padded: each step weighs by its tokens
HF_PADDED = Case(strategy=dict(zero_stage=3), model="zoo_hf_llama_finetuning", data="padded", batch_size=6, steps=5)
REFERENCES = References([case.reference(world_size=2) for case in (CASE, LONG, TP2, PP2, HF_PADDED)])


@contextmanager
def lighthouse_process() -> Iterator[tuple[subprocess.Popen, str]]:
    """A lighthouse as users start one, in a process of its own that a test can kill."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}"]
    process = subprocess.Popen([*command, "--join_timeout_ms", "60000", "--heartbeat_timeout_ms", "1000"])
    yield process, f"http://127.0.0.1:{port}"
    process.kill()
    process.wait()


class KillRankAt(Callback):
    """SIGKILLs (or sends ``signal`` to) this rank at ``step``, in the group named ``group`` as first started:
    mid-step, between its forward and backward, or ``before`` the step begins."""

    def __init__(self, group: str, rank: int, step: int, before: bool = False, signal: int = signal.SIGKILL) -> None:
        self.group, self.rank, self.step, self.before, self.signal = group, rank, step, before, signal

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.before:
            self._kill_if_at(trainer)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if not self.before:
            self._kill_if_at(trainer)

    def _kill_if_at(self, trainer) -> None:
        group = trainer.strategy.replica_group
        at = trainer.global_rank == self.rank and trainer.global_step == self.step and group.joined_at == 0
        if group.options.group == self.group and at:
            os.kill(os.getpid(), self.signal)


class KillLighthouse(Callback):
    """SIGKILLs the lighthouse (process ``pid``) as ``step`` begins, from the first rank of group-0."""

    def __init__(self, pid: int, step: int) -> None:
        self.pid, self.step = pid, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first = trainer.strategy.replica_group.options.group == "group-0" and trainer.global_rank == 0
        if first and trainer.global_step == self.step:
            os.kill(self.pid, signal.SIGKILL)


class SayWhenAt(Callback):
    """Creates the file ``path`` once the run has trained ``step`` steps."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.path.touch()


class Pace(Callback):
    """Each step takes at least ``seconds``: a group started again finds the others still training."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


class GroupShares(Callback):
    """The rows of each step's batch that this group trained on, the steps it redid, whether it wrote checkpoints."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append(trainer.strategy.replica_group.rows)
        self.redone = trainer.strategy.replica_group.steps_redone
        self.joined_at = trainer.strategy.replica_group.joined_at
        self.writes = trainer.strategy.checkpoint_io.writes
        self.torchft_step = trainer.strategy.replica_group.manager.current_step()


@dataclass
class GroupRun:
    result: Result
    rows: list[int]  # of each step's batch, this group's
    redone: int  # steps
    joined_at: int  # the step it joined at: 0, or where the others stood when it was started again
    writes: bool  # checkpoints, at the last step
    torchft_step: int  # torchft's count of committed steps, at the last step


def train_in_group(
    case: Case, lighthouse: str, group: str, callbacks: list[Callback], options: dict, resume_from: str | None = None
) -> GroupRun:
    options = ReplicaGroups(**{"lighthouse": lighthouse, "group": group, "groups": GROUPS, "timeout": 20, **options})
    shares = GroupShares()
    result = train(
        Case(**{**case.__dict__, "strategy": {**case.strategy, "replica_groups": options}}),
        2,
        [*callbacks, shares],
        resume_from=resume_from,
    )
    return GroupRun(result, shares.rows, shares.redone, shares.joined_at, shares.writes, shares.torchft_step)


def run_groups(
    lighthouse: str,
    case: Case,
    callbacks: list[Callback] = (),
    start_again: str | None = None,
    options: dict | None = None,
    names: tuple[str, ...] = tuple(f"group-{g}" for g in range(GROUPS)),
    resume_from: str | None = None,
) -> list[list[list[GroupRun] | BaseException]]:
    """Each group's launches: its ranks' runs, or the error the launch ended with; the group ``start_again`` is
    started again once its first launch fails. ``options``: of ``ReplicaGroups``, beside the lighthouse and name."""

    def launch(group: str) -> list[GroupRun]:
        arguments = (case, lighthouse, group, list(callbacks), options or {}, resume_from)
        return run_ranks(2, train_in_group, *arguments, timeout=240)

    def launches(group: str) -> list[list[GroupRun] | BaseException]:
        try:
            return [launch(group)]
        except RuntimeError as lost:
            return [lost, launch(group)] if group == start_again else [lost]

    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(launches, names))


def assert_same_training(result: Result, single: Result, since: int = 0) -> None:
    """``result`` trained as ``single`` did, from step ``since`` on."""
    torch.testing.assert_close(result.losses, single.losses[since:], rtol=1e-5, atol=0)
    torch.testing.assert_close(result.grad_norms, single.grad_norms[since:], rtol=1e-5, atol=0)
    for key in single.params:
        torch.testing.assert_close(result.params[key], single.params[key], rtol=1e-5, atol=WEIGHT_ATOL, msg=key)


def test_three_groups_train_as_one_process_on_the_global_batch(lighthouse: str) -> None:
    single = REFERENCES[CASE.reference(world_size=2)]
    for (group,) in run_groups(lighthouse, CASE):
        assert not isinstance(group, BaseException), group
        for rank in group:
            assert_same_training(rank.result, single)
            assert rank.rows == [2] * CASE.steps and rank.redone == 0 and rank.joined_at == 0


def test_a_group_that_loses_a_rank_mid_step_is_left_out_and_its_replacement_heals_from_the_others(
    lighthouse: str, tmp_path: Path
) -> None:
    single = REFERENCES[LONG.reference(world_size=2)]
    run = str(tmp_path / "run")
    kill = KillRankAt("group-1", rank=1, step=2)
    (first,), (lost, replacement), (last,) = run_groups(
        lighthouse, LONG, [kill, Pace(0.3), keep_two_newest(run)], start_again="group-1"
    )
    assert isinstance(lost, RuntimeError) and "killed by SIGKILL" in str(lost)
    for launch in (first, replacement, last):
        assert not isinstance(launch, BaseException), launch
    # The replacement took the live weights, optimizer, schedule, loop and data position from the others at the step
    # it joined, and trained on from there as the uninterrupted run did (no checkpoint was read: it joined later).
    joined = replacement[0].joined_at
    assert 2 < joined < LONG.steps
    for rank in replacement:
        assert rank.joined_at == joined and rank.rows == [2] * (LONG.steps - joined) and rank.redone == 0
        assert_same_training(rank.result, single, since=joined)
    # The others trained every step in the same processes, on the uninterrupted run's batches: in 3 shares, in 2 from
    # the step group 1 was lost in (redone), in 3 again once its replacement joined. The first group in each step's
    # quorum alone saved the checkpoints, complete, into the one run folder.
    for survivor, writer in ((first, True), (last, False)):
        for rank in survivor:
            assert_same_training(rank.result, single)
            assert rank.rows == [2, 2] + [3] * (joined - 2) + [2] * (LONG.steps - joined)
            assert rank.redone == 1 and rank.writes == writer
    assert listing(LocalFileSystem(), f"file://{run}") == {
        f"epoch=0-step={LONG.steps - 1}.ckpt": checkpoint_files(2),
        f"epoch=0-step={LONG.steps}.ckpt": checkpoint_files(2),
        "last.ckpt": [f"epoch=0-step={LONG.steps}.ckpt"],
    }


def test_a_fourth_group_started_mid_run_joins_with_the_live_state_and_takes_its_share(
    lighthouse: str, tmp_path: Path
) -> None:
    """More GPUs mid-run: a group under a new name, started once the three have trained 3 steps, heals from them
    and trains on from the next step; from then on the global batch's 6 rows of each rank are dealt 1, 2, 1, 2."""
    single = REFERENCES[LONG.reference(world_size=2)]
    started = tmp_path / "three groups trained 3 steps"
    with ThreadPoolExecutor(1) as pool:
        three = pool.submit(run_groups, lighthouse, LONG, [Pace(0.3), SayWhenAt(started, step=3)])
        while not started.exists() and not three.done():
            time.sleep(0.1)
        ((fourth,),) = run_groups(lighthouse, LONG, [Pace(0.3)], names=("group-3",))
        groups = [launch for (launch,) in three.result()]
    assert not isinstance(fourth, BaseException), fourth
    joined = fourth[0].joined_at
    assert 3 <= joined < LONG.steps
    for rank in fourth:
        assert rank.joined_at == joined and rank.torchft_step == LONG.steps
        assert_same_training(rank.result, single, since=joined)
    shares = []
    for group in groups:
        assert not isinstance(group, BaseException), group
        for rank in group:
            assert_same_training(rank.result, single)
            assert rank.rows[:joined] == [2] * joined and rank.redone == 0
        shares.append(group[0].rows[joined:])
    shares.append(fourth[0].rows)
    assert [sum(rows) for rows in zip(*shares, strict=True)] == [6] * (LONG.steps - joined)
    assert sorted(rows[0] for rows in shares) == [1, 1, 2, 2]


def test_the_lighthouse_lost_stops_every_group_with_the_way_back_and_a_restart_resumes_the_run(
    lighthouse: str, tmp_path: Path
) -> None:
    """The lighthouse is the one part the groups cannot do without: lost, each group's next quorum waits
    ``quorum_timeout`` for it and the group stops, saying how to go on. Started again with a new lighthouse from the
    newest checkpoint, the run goes on as the uninterrupted one, torchft's step count where it stopped."""
    single = REFERENCES[CASE.reference(world_size=2)]
    run = str(tmp_path / "run")
    with lighthouse_process() as (process, address):
        stopped = time.monotonic()
        launches = run_groups(
            address, CASE, [KillLighthouse(process.pid, step=3), keep_two_newest(run)], options=dict(quorum_timeout=3)
        )
        stopped = time.monotonic() - stopped
    for (lost,) in launches:
        assert isinstance(lost, RuntimeError) and "no quorum from the lighthouse" in str(lost), lost
        assert "replica_groups.quorum_timeout=3 s" in str(lost) and "ckpt_path='last'" in str(lost)
    saved = listing(LocalFileSystem(), f"file://{run}")
    assert saved["last.ckpt"] == ["epoch=0-step=3.ckpt"]
    assert saved["epoch=0-step=3.ckpt"] == saved["epoch=0-step=2.ckpt"] == checkpoint_files(2)

    for (resumed,) in run_groups(lighthouse, CASE, resume_from=f"{run}/last.ckpt"):
        assert not isinstance(resumed, BaseException), resumed
        for rank in resumed:
            assert_same_training(rank.result, single, since=3)
            assert rank.rows == [2, 2] and rank.torchft_step == CASE.steps


def test_a_rank_that_hangs_mid_step_counts_as_lost_after_the_timeouts() -> None:
    """SIGSTOP, not SIGKILL: the rank's process stays, and its group's manager goes on answering the lighthouse
    while its other rank waits for it inside the group. The others' all-reduce gives up after the groups' timeout
    (3 s), and the lighthouse leaves the silent group out after its join timeout (5 s)."""
    single = REFERENCES[CASE.reference(world_size=2)]
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=5_000, heartbeat_timeout_ms=1_000)
    hang = KillRankAt("group-1", rank=1, step=2, signal=signal.SIGSTOP)
    fast = dict(timeout=3)
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # the hung group ends where the test gives up on it: stopped, it never will
        hung = pool.submit(run_ranks, 2, train_in_group, CASE, server.address(), "group-1", [hang], fast, timeout=30)
        (first,), (last,) = run_groups(server.address(), CASE, [hang], options=fast, names=("group-0", "group-2"))
        survived = time.monotonic() - started
        lost = hung.exception()
    server.shutdown()
    assert isinstance(lost, RuntimeError)
    for survivor in (first, last):
        assert not isinstance(survivor, BaseException), survivor
        for rank in survivor:
            assert_same_training(rank.result, single)
            assert rank.rows == [2, 2, 3, 3, 3] and rank.redone == 1
    assert survived < 30, survived


def test_two_groups_lost_at_once_leave_the_third_to_train_on_the_whole_batch(lighthouse: str) -> None:
    single = REFERENCES[CASE.reference(world_size=2)]
    kills = [KillRankAt("group-1", rank=1, step=2), KillRankAt("group-2", rank=0, step=2)]
    (first,), (lost,), (also_lost,) = run_groups(lighthouse, CASE, kills)
    assert "killed by SIGKILL" in str(lost) and "killed by SIGKILL" in str(also_lost)
    assert not isinstance(first, BaseException), first
    for rank in first:
        assert_same_training(rank.result, single)
        assert rank.rows == [2, 2, 6, 6, 6] and rank.redone == 1


def test_the_group_that_saves_lost_while_its_upload_runs_leaves_the_next_group_to_save(
    lighthouse: str, tmp_path: Path
) -> None:
    """group-0, first in every quorum, saves each step's checkpoint in the background; it is lost in the step after
    a save, while that upload may still run. group-1, first in the quorum from then on, saves the next ones."""
    single = REFERENCES[CASE.reference(world_size=2)]
    run = str(tmp_path / "run")
    (lost,), (second,), (third,) = run_groups(
        lighthouse, CASE, [KillRankAt("group-0", 0, step=3), keep_two_newest(run)]
    )
    assert "killed by SIGKILL" in str(lost)
    for survivor, writer in ((second, True), (third, False)):
        assert not isinstance(survivor, BaseException), survivor
        for rank in survivor:
            assert_same_training(rank.result, single)
            assert rank.rows == [2, 2, 2, 3, 3] and rank.redone == 1 and rank.writes == writer
    saved = listing(LocalFileSystem(), f"file://{run}")
    assert saved["last.ckpt"] == ["epoch=0-step=5.ckpt"]
    assert saved["epoch=0-step=4.ckpt"] == saved["epoch=0-step=5.ckpt"] == checkpoint_files(2)
    # a removal the lost group had queued behind its uploads may not have run: that older checkpoint stays, whole
    left = {name: files for name, files in saved.items() if name not in ("last.ckpt", "epoch=0-step=4.ckpt")}
    assert set(left) - {"epoch=0-step=5.ckpt"} <= {"epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"}
    assert all(files == checkpoint_files(2) for files in left.values())


def test_padded_batches_of_a_hugging_face_model_weigh_by_their_tokens_across_the_groups(lighthouse: str) -> None:
    """Each group's rows hold other numbers of labelled tokens: the groups' counts are summed through torchft, so
    that every step's loss is the global batch's mean over its tokens, before and after a group is lost."""
    single = REFERENCES[HF_PADDED.reference(world_size=2)]
    (first,), (lost,), (last,) = run_groups(lighthouse, HF_PADDED, [KillRankAt("group-1", rank=1, step=2)])
    assert isinstance(lost, RuntimeError) and "killed by SIGKILL" in str(lost)
    for survivor in (first, last):
        assert not isinstance(survivor, BaseException), survivor
        for rank in survivor:
            assert_same_training(rank.result, single)
            assert rank.rows == [2, 2, 3, 3, 3] and rank.redone == 1


@pytest.mark.parametrize("case", [TP2, PP2], ids=["tp2", "pp2"])
def test_groups_split_by_tensor_or_pipeline_parallelism_go_on_without_a_lost_one(lighthouse: str, case: Case) -> None:
    single = REFERENCES[case.reference(world_size=2)]
    (first,), (lost,), (last,) = run_groups(lighthouse, case, [KillRankAt("group-1", rank=1, step=2, before=True)])
    assert isinstance(lost, RuntimeError) and "killed by SIGKILL" in str(lost)
    for survivor in (first, last):
        assert not isinstance(survivor, BaseException), survivor
        (whole,) = merge_stages([[rank.result] for rank in survivor])  # under a pipeline a rank holds one stage
        assert_same_training(whole, single)
        assert [rank.rows for rank in survivor] == [[4, 4, 6, 6, 6]] * 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(groups=0), r"replica_groups.groups=0 must be a positive number of groups"),
        (dict(min_groups=0), r"replica_groups.min_groups=0 must be a positive number of groups"),
        (dict(timeout=0), r"replica_groups.timeout=0 must be a positive number of seconds"),
        (dict(quorum_timeout=-1), r"replica_groups.quorum_timeout=-1 must be a positive number of seconds"),
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
    (error,) = run_ranks(1, run_each, [(raised, (train, accumulating))])[0]
    assert "accumulate_grad_batches=2 spreads a step over batches already used" in error
