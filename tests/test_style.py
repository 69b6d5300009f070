"""The code stays in the shape ruff holds it to (rules in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def test_ruff_lint_and_format() -> None:
    for command in (["check", "."], ["format", "--check", "."]):
        run = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
