"""Chaos under ``torchrun --max-restarts``: a rank SIGKILLed at a random step, the S3 storage gone for three steps'
saves, a NaN loss, a whole node lost from an elastic job, a kill while the newest save uploads. The job restarts by
itself, resumes from the newest checkpoint that was complete when the failure came, and ends where an uninterrupted
run ends, loss for loss and weight for weight; the outage costs only the saves that fell in it. Which uploads a
failure cut short depends on the machine's load, so the tests check the rule against what the storage held when each
attempt started (``starts.jsonl``), never a step."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec import AbstractFileSystem

from faulty_storage import FaultyStorage
from multirank import free_port
from training import listing, prepared_arithmetic

pytestmark = pytest.mark.multirank

JOB = Path(__file__).parent / "torchrun_job.py"
# A new step to kill at each run (set LIGHTDIST_CHAOS_SEED to replay one); the step is in the failure message.
SEED = int(os.environ.get("LIGHTDIST_CHAOS_SEED", random.SystemRandom().randrange(10_000)))
# The storage answers nothing from when global step 3 starts (as step 3's upload runs) to when global step 5 starts:
# the saves of steps 3, 4 and 5 fail.
NAN_AT, OUTAGE = 4, (3, 5)


def torchrun(
    run: Path,
    *job_args: str,
    data: str,
    nnodes: str = "1",
    endpoint: str | None = None,
    max_restarts: int = 1,
    **env: str,
) -> subprocess.Popen:
    """One node's torchrun agent, running the job with 2 ranks and ``max_restarts`` restarts allowed, on the prepared
    corpus ``data``."""
    run.mkdir(exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint or f'127.0.0.1:{free_port()}'}",
        # A lost node is given up after 3 missed 1 s heartbeats; a round waits 2 s for more nodes once it has 1.
        "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2",
        str(JOB),
        str(run),
        *job_args,
        f"--data-path={data}",
    ]
    # A rank that aborts prints where each of its threads stood.
    env = os.environ | {"PYTHONFAULTHANDLER": "1"} | env
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finished(agent: subprocess.Popen) -> tuple[int, str]:
    _, stderr = agent.communicate(timeout=300)
    return agent.returncode, stderr


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The jobs' data: the arithmetic corpus as text, prepared by ``lightdist prepare`` and streamed by range."""
    return prepared_arithmetic(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    """The job without faults, on 2 ranks; its NaN step skipped like the others'."""
    run = tmp_path_factory.mktemp("uninterrupted")
    returncode, stderr = finished(torchrun(run, str(run / "checkpoints"), "--nan-at", str(NAN_AT), data=corpus))
    assert returncode == 0, stderr[-3000:]
    return run


def assert_same_run(uninterrupted: Path, resumed: Path, chaos: str, atol: float = 1e-7) -> None:
    """Every loss (the last computed of each step) and the final weights of the uninterrupted run; ``atol`` for weights
    near zero, which a run that changed layout reached summing in another order."""
    expected = {record["step"]: record["loss"] for record in records(uninterrupted)}
    losses = {record["step"]: record["loss"] for record in records(resumed)}
    assert [losses[step] for step in range(1, 9)] == pytest.approx(
        [expected[step] for step in range(1, 9)], rel=1e-5, nan_ok=True
    ), chaos
    final, final_after_chaos = (torch.load(run / "final.pt") for run in (uninterrupted, resumed))
    for name, weight in final.items():
        torch.testing.assert_close(final_after_chaos[name], weight, rtol=1e-5, atol=atol, msg=lambda m: f"{chaos}: {m}")


def attempts(run: Path) -> tuple[list[int], list[int]]:
    steps = [(record["attempt"], record["step"]) for record in records(run)]
    return [step for attempt, step in steps if attempt == 0], [step for attempt, step in steps if attempt == 1]


def starts(run: Path) -> list[dict]:
    """The attempt, world size and step of the newest complete checkpoint in the storage as each attempt (or elastic
    round) started."""
    return [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines()]


def newest_complete_at_each_start(run: Path) -> list[int]:
    return [start["newest_complete"] for start in starts(run)]


def test_a_job_survives_a_killed_rank_a_storage_outage_and_a_nan_loss(
    tmp_path: Path,
    uninterrupted: Path,
    corpus: str,
    s3_endpoint: str,
    s3_bucket: tuple[str, AbstractFileSystem],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kill_at = random.Random(SEED).randint(2, 7)
    chaos = f"LIGHTDIST_CHAOS_SEED={SEED}: rank 1 killed after step {kill_at}"
    url, _ = s3_bucket
    storage_down = tmp_path / "storage-down"
    with FaultyStorage(s3_endpoint, lambda method, path, attempt: "reset" if storage_down.exists() else None) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy)
        monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", proxy)
        faults = ["--kill-at", str(kill_at), "--storage-down", str(storage_down), "--down-steps", *map(str, OUTAGE)]
        returncode, stderr = finished(torchrun(tmp_path, f"{url}/run", "--nan-at", str(NAN_AT), *faults, data=corpus))
    assert returncode == 0, f"{chaos}\n{stderr[-3000:]}"
    assert "Connection refused" not in stderr, chaos

    # The first attempt trained to the kill; the second resumed from the newest complete checkpoint and finished.
    # The saves in the outage failed, and the kill may have cut short the one upload in flight, the previous step's;
    # with no checkpoint at all the second attempt starts from scratch (step 0).
    first, second = attempts(tmp_path)
    assert first[-1] == kill_at and second[-1] == 8, chaos
    _, resumable = newest_complete_at_each_start(tmp_path)
    assert second[0] - 1 == resumable, chaos
    # At most one upload is in flight: the kill cut short no more than the newest save outside the outage.
    saved = [0, *(step for step in range(1, kill_at) if not OUTAGE[0] <= step <= OUTAGE[1])]
    assert resumable in saved[-2:], chaos
    assert_same_run(uninterrupted, tmp_path, chaos)


@pytest.mark.parametrize("storage", ["local", "s3", "gcs"])
def test_lightnings_own_checkpoint_callback_resumes_a_killed_job_from_the_newest_complete_checkpoint(
    storage: str,
    tmp_path: Path,
    uninterrupted: Path,
    corpus: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job as users write it: ``lightning.pytorch.callbacks.ModelCheckpoint(dirpath=URL, every_n_train_steps=2,
    save_last=True)``, ``fit(ckpt_path="last")``, the last rank SIGKILLed after step 5 under ``torchrun
    --max-restarts=1``. On S3, rank 1's upload of step 4 stalls until the kill: step 2 is the newest complete
    checkpoint, and the restart says it skips step 4's."""
    if storage == "local":
        url, files = str(tmp_path / "checkpoints"), fsspec.filesystem("file")
    else:
        bucket, files = request.getfixturevalue("s3_bucket" if storage == "s3" else "gcs_bucket")
        url = f"{bucket}/run"
    job = (tmp_path, url, "--nan-at", str(NAN_AT), "--kill-at", "5", "--lightning-checkpoint", "--every", "2")
    if storage == "s3":

        def stall_step_4(method: str, path: str, seen: int) -> str | None:
            return "hold" if "step=4.ckpt/__1_" in path and seen == 1 else None

        stalling = FaultyStorage(request.getfixturevalue("s3_endpoint"), stall_step_4)
        with stalling as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy)
            monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", proxy)
            returncode, stderr = finished(torchrun(*job, data=corpus))
        assert stalling.injected["hold"] >= 1
    else:
        returncode, stderr = finished(torchrun(*job, data=corpus))
    assert returncode == 0, stderr[-3000:]

    first, second = attempts(tmp_path)
    assert first[-1] == 5 and second[-1] == 8
    assert newest_complete_at_each_start(tmp_path) == [0, second[0] - 1]
    if storage == "s3":
        assert second[0] == 3
        assert (
            f"lightdist: skipping {url}/epoch=0-step=4.ckpt (incomplete: it has no COMPLETE manifest, which a save "
            f"writes last, so its save was cut short): resuming from {url}/epoch=0-step=2.ckpt (step 2)" in stderr
        )
    assert "no last checkpoint available" not in stderr
    assert_same_run(uninterrupted, tmp_path, f"Lightning's ModelCheckpoint on {storage}")
    # last.ckpt names the newest checkpoint, and what the kill cut short was replaced: every checkpoint is complete.
    saved = listing(files, url if "://" in url else f"file://{url}")
    assert saved.pop("last.ckpt") == ["epoch=0-step=8.ckpt"]
    assert all("COMPLETE" in checkpoint for checkpoint in saved.values()), saved


def test_an_elastic_job_grows_onto_a_node_that_joins_and_carries_on_when_it_is_lost(
    tmp_path: Path, uninterrupted: Path, corpus: str, s3_bucket: tuple[str, AbstractFileSystem]
) -> None:
    """torchrun agents on ``--nnodes=1:2``, 2 ranks each (tensor-parallel pairs), one global batch of 4 windows. The
    job starts on one node (1 data-parallel rank), which waits after step 2 for a second node; when it joins, the
    agents restart the job on both (2 data-parallel ranks). The second node is lost after step 5, its agent and ranks
    SIGKILLed, and the first restarts the job on itself. Each round resumes from the newest complete checkpoint where
    the data stood, and the job ends with the losses and weights of an uninterrupted run."""
    url, _ = s3_bucket
    job = (tmp_path, f"{url}/run", "--nan-at", str(NAN_AT), "--nodes=2", "--wait-for-nodes-after=2")
    # torch 2.13's agents cannot share their store with a node that joins a running job (the README says why).
    # Unshared, each round's store is on a port torch picked free and released (pytorch/pytorch's get_free_port): a
    # round may fail to bind it on a busy machine, and its agents restart it, which a second restart allows for.
    elastic = {
        "nnodes": "1:2",
        "endpoint": f"127.0.0.1:{free_port()}",
        "max_restarts": 2,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    first_node = torchrun(*job, data=corpus, **elastic)
    wait_for(lambda: any(record["step"] == 2 for record in records(tmp_path)), first_node)
    second_node = torchrun(*job, data=corpus, **elastic, LOSE_THIS_NODE_AFTER_STEP="5")
    returncode, stderr = finished(first_node)
    assert returncode == 0, stderr[-3000:]
    returncode, stderr = finished(second_node)
    assert returncode == -signal.SIGKILL, stderr[-3000:]

    by_world_size = itertools.groupby(records(tmp_path), key=lambda record: record["world_size"])
    assert [(size, list(steps)[-1]["step"]) for size, steps in by_world_size] == [(2, 2), (4, 5), (2, 8)]
    # Each round resumed from the newest checkpoint complete as it started: the node may be lost (its ranks end with
    # step 5, before step 5's save) while step 4's upload is still in flight.
    newest_complete = {(start["attempt"], start["world_size"]): start["newest_complete"] for start in starts(tmp_path)}
    for (attempt, size), steps in itertools.groupby(
        records(tmp_path), key=lambda record: (record["attempt"], record["world_size"])
    ):
        assert next(steps)["step"] - 1 == newest_complete[attempt, size]
    # The equivalence tests' tolerance, as for any resume in another layout (tests/test_resume.py).
    assert_same_run(uninterrupted, tmp_path, "a node joined after step 2, lost after step 5", atol=1e-5)


def wait_for(condition: Callable[[], bool], agent: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and agent.poll() is None:
        with contextlib.suppress(FileNotFoundError):
            if condition():
                return
        time.sleep(0.2)
    raise AssertionError(f"torchrun's job never got there: {agent.communicate()[1][-3000:]}")
