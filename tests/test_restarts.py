"""Chaos under ``torchrun --max-restarts``: a rank SIGKILLed at a random step, the S3 storage gone for three steps'
saves, a NaN loss. The job restarts by itself, resumes from the newest complete checkpoint, and ends where an
uninterrupted run ends, loss for loss and weight for weight; the outage costs only the saves that fell in it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsspec import AbstractFileSystem

from faulty_storage import FaultyStorage
from multirank import free_port

pytestmark = pytest.mark.multirank

JOB = Path(__file__).parent / "torchrun_job.py"
# A new step to kill at each run (set LIGHTDIST_CHAOS_SEED to replay one); the step is in the failure message.
SEED = int(os.environ.get("LIGHTDIST_CHAOS_SEED", random.SystemRandom().randrange(10_000)))
# The storage answers nothing from when global step 3 starts (as step 3's upload runs) to when global step 5 starts:
# the saves of steps 3, 4 and 5 fail.
NAN_AT, OUTAGE = 4, (3, 5)


def torchrun(run: Path, *job_args: str) -> subprocess.CompletedProcess:
    run.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(JOB),
        str(run),
        *job_args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]


def test_a_job_survives_a_killed_rank_a_storage_outage_and_a_nan_loss(
    tmp_path: Path, s3_endpoint: str, s3_bucket: tuple[str, AbstractFileSystem], monkeypatch: pytest.MonkeyPatch
) -> None:
    kill_at = random.Random(SEED).randint(2, 7)
    chaos = f"LIGHTDIST_CHAOS_SEED={SEED}: rank 1 killed after step {kill_at}"
    url, _ = s3_bucket
    storage_down = tmp_path / "storage-down"
    with FaultyStorage(s3_endpoint, lambda method, path, attempt: "reset" if storage_down.exists() else None) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy)
        monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", proxy)
        whole = torchrun(tmp_path / "whole", f"{url}/whole", "--nan-at", str(NAN_AT))
        assert whole.returncode == 0, whole.stderr[-3000:]
        faults = ["--kill-at", str(kill_at), "--storage-down", str(storage_down), "--down-steps", *map(str, OUTAGE)]
        killed = torchrun(tmp_path / "killed", f"{url}/killed", "--nan-at", str(NAN_AT), *faults)
    assert killed.returncode == 0, f"{chaos}\n{killed.stderr[-3000:]}"
    assert "Connection refused" not in killed.stderr, chaos

    # The first attempt trained to the kill; the second resumed from the newest complete checkpoint and finished.
    # The saves in the outage failed, and the kill may have cut short the one upload in flight, the previous step's;
    # with no checkpoint at all the second attempt starts from scratch (step 0).
    steps = [(record["attempt"], record["step"]) for record in records(tmp_path / "killed")]
    first, second = [step for attempt, step in steps if attempt == 0], [step for attempt, step in steps if attempt == 1]
    assert first[-1] == kill_at and second[-1] == 8, chaos
    saved = [0, *(step for step in range(1, kill_at) if not OUTAGE[0] <= step <= OUTAGE[1])]
    assert second[0] - 1 in saved[-2:], chaos

    # The same run as without the faults: the NaN step skipped in both, every other loss and the final weights equal.
    uninterrupted = {record["step"]: record["loss"] for record in records(tmp_path / "whole")}
    resumed = {record["step"]: record["loss"] for record in records(tmp_path / "killed")}  # the last of each step
    assert [resumed[step] for step in range(1, 9)] == pytest.approx(
        [uninterrupted[step] for step in range(1, 9)], rel=1e-5, nan_ok=True
    ), chaos
    final, final_after_chaos = (torch.load(tmp_path / run / "final.pt") for run in ("whole", "killed"))
    for name, weight in final.items():
        torch.testing.assert_close(final_after_chaos[name], weight, rtol=1e-5, atol=1e-7, msg=lambda m: f"{chaos}: {m}")
