"""The examples run as their docstrings say, and train what one process trains."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from multirank import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import plain_loop

pytestmark = pytest.mark.multirank


def test_a_plain_pytorch_loop_over_parallelize_trains_what_one_process_trains() -> None:
    """Hugging Face Llama, 2 data-parallel (ZeRO-3) x 2 tensor-parallel ranks, no Lightning anywhere."""
    parallel = run_ranks(4, plain_loop.main, ["--tp", "2", "--steps", "4"])
    one_process = run_ranks(1, plain_loop.main, ["--steps", "4"])[0]
    assert all(losses == parallel[0] for losses in parallel)
    assert parallel[0] == pytest.approx(one_process, rel=1e-5)
    assert one_process[-1] < one_process[0]
