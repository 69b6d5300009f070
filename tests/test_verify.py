"""``lightdist verify``: a user checks their config's layout against one process, on CPU ranks, before a GPU hour.

The reference configs pass (``tests/test_docs_commands.py`` runs the README's ``lightdist verify --config
configs/3d.yaml``); here a Hugging Face config, shrunk, passes, and a module that trains differently under data
parallelism (dropout: each rank draws its own masks) is reported at its first step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightdist.layout import ParallelLayout
from lightdist.verify import main, verification_config

REPO = Path(__file__).parents[1]

pytestmark = pytest.mark.multirank


def verify(capsys: pytest.CaptureFixture, *argv: str) -> tuple[str, str | int | None]:
    """What ``lightdist verify`` prints, and how it exits (``None``: 0)."""
    try:
        main(list(argv))
        code = None
    except SystemExit as exit:
        code = exit.code
    return capsys.readouterr().out, code


def test_a_hugging_face_config_shrunk_trains_as_one_process(capsys: pytest.CaptureFixture) -> None:
    printed, code = verify(capsys, "--config", str(REPO / "configs/hf_qwen2.yaml"), "--steps", "3")
    assert code is None, printed
    assert "configs/hf_qwen2.yaml as pp=1 x dp=2 x tp=2 on 4 CPU ranks against one process, 3 steps" in printed
    assert "qwen2 shrunk to 2 layers of width 64 with 4 heads" in printed
    steps = [line for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert len(steps) == 3 and all(line.endswith("equal") for line in steps), printed
    assert printed.rstrip().endswith("Equal within 1e-05 at every step.")


def test_a_module_that_trains_differently_is_reported_at_its_first_step(capsys: pytest.CaptureFixture) -> None:
    printed, code = verify(
        capsys,
        "--config",
        str(REPO / "configs/zero3_cpu.yaml"),
        "--steps",
        "2",
        "--model.class_path=lightdist.models.GPT2",
        "--model.init_args.config={dropout: 0.1}",
    )
    assert isinstance(code, str) and "the layout trains differently from one process" in code
    first, second = [line for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert first.startswith("   1") and "DIFFERS by " in first and first.endswith("(first)"), printed
    assert "(first)" not in second


def test_the_config_runs_its_layout_small_on_cpu_ranks() -> None:
    config = yaml.safe_load((REPO / "configs/3d.yaml").read_text())
    verified, layout, notes = verification_config(config, steps=4)
    assert layout == ParallelLayout(pp=2, dp=2, tp=2)
    trainer = verified["trainer"]
    assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("cpu", 8, "32-true")
    assert (trainer["max_steps"], trainer["logger"], trainer["callbacks"]) == (4, False, [])
    strategy = trainer["strategy"]["init_args"]
    assert strategy["data_parallel_size"] == 2 and strategy["microbatches"] == 4 and strategy["zero_stage"] == 3
    assert "ckpt_path" not in verified
    assert verified["model"]["init_args"]["preset"] == "tiny"
    assert (
        verified["data"]["init_args"] | {"batch_size": 4, "seq_len": 32, "shuffle": False}
        == verified["data"]["init_args"]
    )
    assert notes[0] == "data_parallel_size='auto' runs as 2"
    # a size the planner would pick cannot be verified as it is
    config["trainer"]["strategy"]["init_args"]["tensor_parallel_size"] = "auto"
    with pytest.raises(ValueError, match=r"tensor_parallel_size='auto': give it a number"):
        verification_config(config, steps=4)
