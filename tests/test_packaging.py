"""One import package, ``lightdist``: ``plugins/`` and ``models/`` ship inside it and never as top-level names,
because users' own projects have folders called ``models``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
CHECK_IMPORTS = """
import importlib.util, lightdist.models, lightdist.plugins
assert lightdist.plugins.ParallelStrategy is lightdist.ParallelStrategy
print(lightdist.__file__)
for name in ("models", "plugins"):
    assert importlib.util.find_spec(name) is None, f"top-level {name!r} is importable"
"""


def _python(code: str, *, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"} | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_installed_checkout_exposes_only_lightdist(tmp_path: Path) -> None:
    """The install the tests run against (the README's editable install)."""
    run = _python(CHECK_IMPORTS, cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def test_wheel_exposes_only_lightdist(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        pytest.fail(build.stdout[-2000:] + build.stderr[-2000:])
    (wheel,) = tmp_path.glob("lightdist-*.whl")
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    assert sorted(path.name for path in site.iterdir() if not path.name.endswith(".dist-info")) == ["bin", "lightdist"]

    run = _python(CHECK_IMPORTS, cwd=tmp_path, pythonpath=str(site))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(site / "lightdist" / "__init__.py")


CORE_WITHOUT_LIGHTNING = """
import sys
import lightdist.parallelize, lightdist.checkpoint.storage
assert not any(name.split(".")[0] == "lightning" for name in sys.modules), "the core loaded Lightning"
"""

NAMES_WITH_LIGHTNING_AFTER = """
import lightdist
from lightning.pytorch import Trainer
trainer = Trainer(strategy="lightdist_3d", accelerator="cpu", devices=4, logger=False)
assert type(trainer.strategy) is lightdist.ParallelStrategy, trainer.strategy
"""

NAMES_WITH_LIGHTNING_BEFORE = """
import lightning
import lightdist
from lightning.pytorch.strategies import StrategyRegistry
assert "lightdist_zero2" in StrategyRegistry
"""


IMPORT_ORDERS = {
    "core": CORE_WITHOUT_LIGHTNING,
    "lightning_after": NAMES_WITH_LIGHTNING_AFTER,
    "lightning_before": NAMES_WITH_LIGHTNING_BEFORE,
}


@pytest.mark.parametrize("code", IMPORT_ORDERS.values(), ids=IMPORT_ORDERS.keys())
def test_the_core_imports_without_lightning_and_the_strategy_names_reach_lightning_either_way(
    code: str, tmp_path: Path
) -> None:
    run = _python(code, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_checkpoint_metadata_file_is_where_lightning_keeps_it() -> None:
    """Pins the one private name of Lightning's the storage layer copies, so an upgrade that moves it fails here."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    from lightdist.checkpoint.storage import LIGHTNING_METADATA_FILENAME

    assert LIGHTNING_METADATA_FILENAME == _METADATA_FILENAME
