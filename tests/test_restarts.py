"""A rank killed under ``torchrun --max-restarts`` costs only the steps since the last complete checkpoint: the
restarted job resumes there by itself and continues the same run, loss for loss and weight for weight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multirank import free_port

pytestmark = pytest.mark.multirank

JOB = Path(__file__).parent / "torchrun_job.py"


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


def losses_by_step(run: Path) -> dict[int, dict]:
    """The last record of each step: a step the restart trained again replaces the one the failed attempt logged."""
    records = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    return {record["step"]: record for record in records}


def test_a_killed_rank_restarts_under_torchrun_and_continues_the_same_run(tmp_path: Path) -> None:
    whole = torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = torchrun(tmp_path / "killed", "5")  # after step 5; the checkpoint of step 4 is the newest
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "Connection refused" not in killed.stderr

    records = [json.loads(line) for line in (tmp_path / "killed" / "losses.jsonl").read_text().splitlines()]
    first_attempt = [record["step"] for record in records if record["attempt"] == 0]
    restarted = [record["step"] for record in records if record["attempt"] == 1]
    assert first_attempt[-1] == 5 and restarted[-1] == 8
    assert restarted[0] in (3, 5)  # resumed from step 4, or from step 2 if step 4's upload was cut short

    uninterrupted, resumed = losses_by_step(tmp_path / "whole"), losses_by_step(tmp_path / "killed")
    assert [resumed[step]["loss"] for step in range(1, 9)] == pytest.approx(
        [uninterrupted[step]["loss"] for step in range(1, 9)], rel=1e-5
    )
    final, final_after_restart = (torch.load(tmp_path / run / "final.pt") for run in ("whole", "killed"))
    for name, weight in final.items():
        torch.testing.assert_close(final_after_restart[name], weight, rtol=1e-5, atol=1e-7)
