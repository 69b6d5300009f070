"""When a run fails, the user reads one traceback first: the error of the rank that failed first, not every rank's
copy interleaved. Each run here is a user's script started by Lightning's own launcher, as ``python train.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

SCRIPT = textwrap.dedent(
    """
    import sys

    from lightning.pytorch import Trainer, seed_everything

    from lightdist.models import Llama, TokenDataModule
    from lightdist.plugins import ParallelStrategy

    FAILING_RANKS = [int(rank) for rank in sys.argv[1].split(",")]


    class BuggyLlama(Llama):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1 and self.trainer.global_rank in FAILING_RANKS:
                raise ValueError(f"a bug in training_step at step {self.trainer.global_step}")
            return super().training_step(batch, batch_idx)


    seed_everything(1234)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ParallelStrategy(tensor_parallel_size=2, collective_timeout=20),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BuggyLlama("tiny"), datamodule=TokenDataModule(seq_len=16, batch_size=2, synthetic_tokens=1 << 12))
    """
)


def run_script(tmp_path: Path, failing_ranks: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), failing_ranks]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)


def test_a_bug_that_fails_every_rank_prints_one_traceback_and_a_line_for_the_other_rank(tmp_path: Path) -> None:
    run = run_script(tmp_path, failing_ranks="0,1")
    assert run.returncode != 0
    assert run.stderr.count("Traceback (most recent call last)") == 1, run.stderr
    first = next(line for line in run.stderr.splitlines() if "failed first" in line)
    other = "1" if first == "lightdist: rank 0 failed first:" else "0"
    assert first in ("lightdist: rank 0 failed first:", "lightdist: rank 1 failed first:")
    assert "ValueError: a bug in training_step at step 1" in run.stderr.split(first)[1]
    assert f"lightdist: rank {other} failed with the same error as rank {1 - int(other)}, whose traceback is above" in (
        run.stderr
    )


def test_a_rank_that_fails_alone_prints_its_traceback_first(tmp_path: Path) -> None:
    run = run_script(tmp_path, failing_ranks="1")
    assert run.returncode != 0
    failure = run.stderr.split("lightdist: rank 1 failed first:\n")[1]
    assert failure.startswith("Traceback (most recent call last)")
    assert "ValueError: a bug in training_step at step 1" in failure
    assert run.stderr.count("Traceback (most recent call last)") == 1, run.stderr
