"""The benchmark runs end to end (its numbers are read by people on the GPU machine, never asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench" / "throughput.py"


def test_throughput_benchmark_prints_all_three_runs(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--seq-len", "32", "--steps", "3", "--warmup", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.endswith("x")]
    assert [row.split("  ")[0] for row in rows] == [
        "plain PyTorch",
        "Lightning ModelParallelStrategy (FSDP2)",
        "lightdist ParallelStrategy (ZeRO-3)",
    ]
