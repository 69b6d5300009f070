"""The ``lightdist`` command as a user runs it: a config, command-line overrides, Lightning launching the ranks."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

from lightdist.checkpoint.storage import resolve
from lightdist.cli import COMMANDS, main
from lightdist.models import Llama

from training import checkpoint_files, shard_files
from wandb_offline import offline_run_config, offline_run_history

CONFIGS = Path(__file__).parents[1] / "configs"
LIGHTDIST = Path(sys.executable).with_name("lightdist")  # the command the install puts beside the interpreter
# What third-party code would print on every run without lightdist/quiet.py (issue: the first ten minutes).
NOISE = (
    "Waiting for checkpoint save request",
    "pickling/unpickling of the DeviceMesh",
    "set_vital",
    "Tip:",
    "isinstance(treespec, LeafSpec)",
    "Tracking run with wandb version",
    "there is no last checkpoint available",
    "anonymous setting has no effect",
    "flatten mesh dimensions",
)
QUICK = [
    "--trainer.devices=2",
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
]


def lightdist_fit(
    config: str, *overrides: str, cwd: Path, launcher: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The command as a user without a W&B login runs it: no API key in the environment or in ``~/.netrc``; the
    installed ``lightdist`` command, unless a ``launcher`` runs the module; ``env``: variables the user sets."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("WANDB_")}
    environment |= env or {}
    lightdist = [sys.executable, *launcher, "-m", "lightdist"] if launcher else [str(LIGHTDIST)]
    command = [
        *lightdist,
        "fit",
        "--config",
        str(CONFIGS / config),
        *QUICK,
        *overrides,
    ]
    environment["NETRC"] = str(cwd / "no-netrc")
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.multirank
def test_main_job_config_trains_3d_and_saves_every_ranks_shard(tmp_path: Path) -> None:
    # pp=2 x dp=2 x tp=2, the monitor logging every step
    run = lightdist_fit("3d_cpu.yaml", "--trainer.devices=8", "--trainer.log_every_n_steps=1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    # Before its first checkpoint, ckpt_path="last" starts from scratch; at the end, last.ckpt names the final state.
    checkpoint = Path(resolve(str(tmp_path / "runs/3d_cpu/checkpoints/last.ckpt")))
    assert checkpoint.name == "last-step=3.ckpt"
    assert sorted(path.name for path in checkpoint.iterdir() if path.suffix == ".distcp") == shard_files(8)
    # Without a W&B login the run logged offline, said so once, and recorded how it was split.
    assert run.stderr.count("W&B logs offline to runs/3d_cpu/wandb, because no API key is set") == 1
    # One header, from rank 0, says how the run is split and where its checkpoints and logs go; no noise.
    header = run.stderr[run.stderr.index("lightdist: Llama, ") :].splitlines()[:6]
    assert header[0].endswith("on 8 CPU ranks as pp=2 x dp=2 x tp=2, ZeRO-2"), header
    assert header[1] == "  1f1b schedule, 4 microbatches per batch, sequence parallel"
    # windows of one length: each batch's mean weighs alike, as Lightning weighs them, which is one process's here
    assert header[2] == (
        "  batches weigh alike, as Lightning's: the step's tokens are not counted (loss_tokens(batch) counts them)"
    )
    assert header[3].startswith("  memory per rank, planned: ")
    assert header[4].endswith("runs/3d_cpu/checkpoints, uploaded behind training (process)")
    assert header[5].startswith("  W&B: offline, in runs/3d_cpu/wandb/offline-run-")
    assert run.stderr.count("lightdist: Llama, ") == 1
    assert run.stderr.count("lightdist: no checkpoint under ") == 1
    assert not [line for line in (run.stdout + run.stderr).splitlines() if any(noise in line for noise in NOISE)]
    assert offline_run_config(tmp_path / "runs/3d_cpu/wandb")["lightdist"] == {
        "world_size": 8,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 2,
        "data_parallel_replicas": 1,
        "tensor_parallel_size": 2,
        "expert_parallel_size": 1,
        "context_parallel_size": 1,
        "context_parallel_method": None,  # no sequence split
        "zero_stage": 2,  # the config's 3, as it runs under a pipeline (gathered once per step)
        "pipeline_schedule": "1f1b",
        "virtual_stages": 1,
        "microbatches": 4,
        "sequence_parallel": True,
        "loss_parallel": False,
        "activation_checkpointing": None,
        "cpu_offload": False,
        "compile": False,
        "document_end_token": None,  # attention across the whole window
        "mask_document_end_loss": False,
        "loss_weighting": "tokens",
        "non_finite": None,
        "precision": "32-true",
        "parameters": sum(p.numel() for p in Llama("tiny").parameters()),
    }
    # TrainingMonitor's figures at every step, and the validation metrics at the end.
    history = offline_run_history(tmp_path / "runs/3d_cpu/wandb")
    monitored = [row for row in history if "perf/tokens_per_s" in row]
    assert [row["trainer/global_step"] for row in monitored] == [0, 1, 2]  # Lightning's numbering, as the loss's
    for row in monitored:
        # Each step trains 2 data-parallel batches of 8 windows of 64 tokens.
        assert row["perf/tokens_per_s"] * row["perf/step_time_s"] == pytest.approx(2 * 8 * 64)
        assert row["perf/tokens_per_s_per_device"] == pytest.approx(row["perf/tokens_per_s"] / 8)
        assert 0 < row["pipeline/bubble"] < 1
        assert row["memory/peak_gib"] > 0.1 and row["train/grad_norm"] > 0 and row["checkpoint/blocked_s"] >= 0
        assert "perf/mfu" not in row  # a CPU has no known peak
    (validated,) = [row for row in history if "val_perplexity" in row]
    assert validated["val_perplexity"] == pytest.approx(math.exp(validated["val_loss"]), rel=1e-5)


@pytest.mark.multirank
def test_torchrun_launches_the_ranks_with_a_strategy_named_on_the_command_line(tmp_path: Path) -> None:
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
    run = lightdist_fit("zero3_cpu.yaml", "--trainer.strategy=lightdist_zero2", cwd=tmp_path, launcher=torchrun)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("lightdist: 2 processes joined the process group (gloo)") == 1  # rank 0's line only
    assert "strategy: lightdist_zero2" in (tmp_path / "runs" / "zero3_cpu" / "config.yaml").read_text()
    checkpoint = Path(resolve(str(tmp_path / "runs/zero3_cpu/checkpoints/last.ckpt")))
    assert sorted(path.name for path in checkpoint.iterdir()) == checkpoint_files(2)
    # `python -m lightdist` too: torch's checkpoint process per rank imports lightdist, and its filters.
    assert not [line for line in (run.stdout + run.stderr).splitlines() if any(noise in line for noise in NOISE)]


@pytest.mark.multirank
def test_replica_groups_launched_by_torchrun_per_node_and_by_lightdist_fit_train_as_one_run(
    tmp_path: Path, lighthouse: str
) -> None:
    """The replica-groups config's groups as a cluster starts them, a torchrun per node, each its own rendezvous,
    beside one started as the config's header does on one machine; all name the lighthouse and their group in the
    environment, and the group first in each step's quorum saves the checkpoints into the one folder."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
    with ThreadPoolExecutor(3) as pool:
        runs = [
            pool.submit(
                lightdist_fit,
                "replica_groups_cpu.yaml",
                "--trainer.logger=false",
                "--model.init_args.preset=tiny",
                cwd=tmp_path,
                launcher=launcher,
                env={"TORCHFT_LIGHTHOUSE": lighthouse, "LIGHTDIST_REPLICA_GROUP": f"group-{group}"},
            )
            for group, launcher in enumerate((torchrun, torchrun, ()))
        ]
        runs = [run.result() for run in runs]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    checkpoint = Path(resolve(str(tmp_path / "runs/replica_groups_cpu/checkpoints/last.ckpt")))
    assert sorted(path.name for path in checkpoint.iterdir()) == checkpoint_files(2)


DATA_PARALLEL = "pp=1 x dp=2 x tp=1"


@pytest.mark.parametrize(
    ("name", "devices", "zero_stage", "layout"),
    [("lightdist", 2, 3, DATA_PARALLEL), ("lightdist_ddp", 2, 0, DATA_PARALLEL)]
    + [(f"lightdist_zero{stage}", 2, stage, DATA_PARALLEL) for stage in (1, 2, 3)]
    + [("lightdist_tp", 2, 3, "pp=1 x dp=1 x tp=2"), ("lightdist_pp", 4, 3, "pp=2 x dp=2 x tp=1")]
    + [("lightdist_3d", 8, 3, "pp=2 x dp=2 x tp=2")],
)
def test_registered_names_choose_the_layout(name: str, devices: int, zero_stage: int, layout: str) -> None:
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=name, logger=False)
    assert trainer.strategy.zero_stage == zero_stage
    assert str(trainer.strategy.layout) == layout


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--trainer.strategy.init_args.zero_stage=7", 'Parser key "zero_stage"'),  # not a ZeRO stage
        ("--trainer.strategy.init_args.microbatches=four", 'Parser key "microbatches"'),  # not an int
        ("--trainer.strategy.init_args.tensor_paralel_size=2", "Option 'tensor_paralel_size' is not accepted"),
        ("--config=typo.yaml", "Subcommand 'fit' does not accept option 'trainer.max_step'"),  # a YAML's unknown key
    ],
)
def test_invalid_option_fails_in_cli_validation_naming_the_option(
    option: str, message: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "argv", ["lightdist"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_step: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "zero3_cpu.yaml"), option])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_shows_every_split_of_a_70b_model_without_allocating_it(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "--model", "lightdist.models.Llama", "--init-args", '{"preset": "70b"}', "--tp", "8"])
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == "Llama: 80 blocks in model.layers, tensor_parallel_size=8"
    assert "model.layers.*.self_attn.k_proj colwise (1024, 8192) -> (128, 8192)" in lines
    assert "model.embed_tokens vocab (128256, 8192) -> (16032, 8192)" in lines


def test_plan_reads_the_model_and_tp_size_from_a_config(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "--config", str(CONFIGS / "tp2_zero3_cpu.yaml")])
    assert capsys.readouterr().out.startswith("Llama: 4 blocks in model.layers, tensor_parallel_size=2\n")


def test_plan_of_a_config_that_leaves_the_sizes_to_the_planner_shows_the_tp2_plan(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    config = yaml.safe_load((CONFIGS / "tp2_zero3_cpu.yaml").read_text())
    config["trainer"]["strategy"]["init_args"].update(tensor_parallel_size="auto", pipeline_parallel_size="auto")
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump(config))
    main(["plan", "--config", str(tmp_path / "auto.yaml")])
    assert capsys.readouterr().out.startswith("Llama: 4 blocks in model.layers, tensor_parallel_size=2\n")


def test_plan_shows_the_pipeline_stages_of_a_3d_config(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "--config", str(CONFIGS / "3d_cpu.yaml")])
    stages = capsys.readouterr().out.split("pipeline_parallel_size=2\n")[1].splitlines()
    assert stages == [
        "  stage 0: model.layers.0-1 + embeddings: 96,512 parameters",  # 2 blocks of 46,208 and the 64 x 64 embedding
        "  stage 1: model.layers.2-3 + norm and head: 96,576 parameters",
    ]


def test_plan_rejects_a_split_that_does_not_divide(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "lightdist.models.Llama", "--tp", "3"])
    assert exit_info.value.code == 2
    assert "tensor_parallel_size=3 does not divide num_heads=4" in capsys.readouterr().err


def test_plan_of_a_pipeline_alone_balances_an_8b_model(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "--model", "lightdist.models.Llama", "--init-args", '{"preset": "8b"}', "--pp", "4"])
    assert capsys.readouterr().out.splitlines() == [
        "Llama: 32 blocks in model.layers, pipeline_parallel_size=4",  # no tensor-parallel plan: none was asked for
        "  stage 0: model.layers.0-6 + embeddings: 2,052,120,576 parameters",  # 7 blocks beside the embeddings
        "  stage 1: model.layers.7-15: 1,963,008,000 parameters",
        "  stage 2: model.layers.16-24: 1,963,008,000 parameters",
        "  stage 3: model.layers.25-31 + norm and head: 2,052,124,672 parameters",
    ]


def test_plan_shows_which_rank_holds_each_interleaved_stage(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "--model", "lightdist.models.Llama", "--pp", "2", "--schedule", "interleaved_1f1b"])
    assert capsys.readouterr().out.splitlines() == [
        "Llama: 4 blocks in model.layers, pipeline_parallel_size=2, virtual_stages=2 (interleaved_1f1b)",
        "  stage 0 on rank 0: model.layers.0 + embeddings: 50,304 parameters",
        "  stage 1 on rank 1: model.layers.1: 46,208 parameters",
        "  stage 2 on rank 0: model.layers.2: 46,208 parameters",
        "  stage 3 on rank 1: model.layers.3 + norm and head: 50,368 parameters",
    ]


def test_plan_writes_the_layouts_as_csv_or_json_records_for_a_notebook(capsys: pytest.CaptureFixture) -> None:
    plan = ["plan", "--model", "lightdist.models.Llama", "--init-args", '{"preset": "70b"}', "--gpus", "64"]
    main([*plan, "--format", "json"])
    records = json.loads(capsys.readouterr().out)
    main([*plan, "--format", "csv"])
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    main(plan)
    table = capsys.readouterr().out.splitlines()
    assert len(records) == len(rows) == len(table) - 4  # the title, column names, pretrained load and recommendation
    assert [row["layout"] for row in rows] == [record["layout"] for record in records]
    assert records[0]["recommended"] and table[-1].startswith(f"Recommended: {records[0]['layout']}: ")
    assert float(rows[0]["total_gib"]) == records[0]["total_gib"] == pytest.approx(54.5, abs=0.05)
    assert sum(record["recommended"] for record in records) == 1


def test_the_layouts_formats_need_a_cluster(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--model", "lightdist.models.Llama", "--format", "csv"])
    assert "--format csv writes the layouts table: add --gpus N." in capsys.readouterr().err


def test_lightdist_help_lists_its_own_commands_beside_lightnings(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert all(f"  {name:<10}{what}" in shown for name, (_, what) in COMMANDS.items())
    assert "{fit,validate,test,predict}" in shown
