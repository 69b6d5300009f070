"""lightdist on Ray Train: ParallelStrategy inside ``TorchTrainer`` on a local Ray cluster the tests start.

A worker runs ``train`` (tests/training.py) with Ray's ``RayLightningEnvironment``, the way a user's train function
builds ``Trainer(strategy=ParallelStrategy(...), plugins=[RayLightningEnvironment()])``; rank 0 saves its result for
the test to compare with a single process. ``lightdist fit --launcher ray`` runs a config the same way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec import AbstractFileSystem
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightdist.cli import main

from multirank import free_port
from training import WEIGHT_ATOL, Case, Result, keep_two_newest, merge_stages, train

ray = pytest.importorskip("ray", reason="the Ray tests need lightdist[ray]")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.train import FailureConfig, ScalingConfig, UserCallback  # noqa: E402
from ray.train.lightning import RayLightningEnvironment  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import lightdist.ray  # noqa: E402

pytestmark = pytest.mark.ray

TESTS = Path(__file__).parent
CONFIGS = TESTS.parent / "configs"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Any:
    """A local cluster of two nodes with 4 logical CPUs each (one per worker) on this machine's 2 cores: the head
    node, and a second node that one test loses as a machine is lost. Workers import the tests' helpers from tests/.

    Both nodes start here because Ray Train sees nodes that join only every 20 s, after it has started a group.
    """
    # A lost node is declared dead after 3 missed health checks 0.5 s apart (Ray's default: 5 of 3 s).
    fast_failure_detection = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "include_dashboard": False, "_system_config": fast_failure_detection},
    )
    cluster.add_node(num_cpus=4)
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def train_on_worker(config: dict[str, Any]) -> None:
    """The user's train function: ``train`` with Ray's environment, each of ``cases`` in turn in the same workers;
    each rank saves what it trained (under a pipeline, its stage's weights)."""
    os.environ.update(config.get("env", {}))
    rank = ray.train.get_context().get_world_rank()
    for index, case in enumerate(config["cases"]):
        result = train(
            case,
            callbacks=config.get("callbacks", []),
            resume_from=config.get("resume_from"),
            plugins=[RayLightningEnvironment()],
        )
        torch.save(result, Path(config["results"]) / f"{index}-{rank}.pt")


def fit_on_ray(
    workers: int | tuple[int, int], config: dict[str, Any], max_failures: int = 0, **scaling: Any
) -> list[Result]:
    """Rank 0's result of each case, with every stage's weights."""
    Path(config["results"]).mkdir()
    result = TorchTrainer(
        train_on_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, **scaling),
        run_config=ray.train.RunConfig(failure_config=FailureConfig(max_failures=max_failures)),
    ).fit()
    assert result.error is None, result.error
    results = []
    for index in range(len(config["cases"])):
        saved = sorted(Path(config["results"]).glob(f"{index}-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
        (merged,) = merge_stages([[torch.load(path, weights_only=False)] for path in saved])
        results.append(merged)
    return results


EQUIVALENCE = {
    "dp2-zero3": (2, Case(strategy={"zero_stage": 3}, steps=4)),
    "tp2-dp2": (4, Case(strategy={"tensor_parallel_size": 2, "zero_stage": 3}, steps=4)),
    "pp2-1f1b": (2, Case(strategy={"pipeline_parallel_size": 2}, steps=4)),
}


@pytest.fixture(scope="module")
def trained_on_ray(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """Each case above trained by Ray workers: the cases of one worker count in one ``TorchTrainer`` run, as the
    multi-rank tests share their ranks (starting a worker group is the slow part)."""
    results = {}
    for workers in sorted({workers for workers, _ in EQUIVALENCE.values()}):
        names = [name for name, (count, _) in EQUIVALENCE.items() if count == workers]
        config = {
            "cases": [EQUIVALENCE[name][1] for name in names],
            "results": str(tmp_path_factory.mktemp("ray") / "results"),
        }
        results |= dict(zip(names, fit_on_ray(workers, config), strict=True))
    return results


@pytest.mark.parametrize("name", EQUIVALENCE)
def test_torch_trainer_workers_train_as_one_process_does(trained_on_ray: dict[str, Result], name: str) -> None:
    workers, case = EQUIVALENCE[name]
    on_ray, one_process = trained_on_ray[name], train(case.reference(workers))
    torch.testing.assert_close(on_ray.losses, one_process.losses, rtol=1e-5, atol=0)
    for key, weight in one_process.params.items():
        torch.testing.assert_close(on_ray.params[key], weight, rtol=1e-5, atol=WEIGHT_ATOL, msg=key)


class KillOnce(Callback):
    """Rank 1 SIGKILLs itself after step ``step``, once: ``marker`` records the kill's time for the next attempt."""

    def __init__(self, step: int, marker: Path) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1 and not self.marker.exists():
            self.marker.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


class RecordRestart(Callback):
    """Rank 0 of the restarted group writes when its first step after the failure ended: recovery, as a user sees it."""

    def __init__(self, marker: Path, recovered: Path) -> None:
        self.marker, self.recovered = marker, recovered

    def on_train_start(self, trainer, pl_module) -> None:
        self.restarted = self.marker.exists()  # not the group that saw the failure, whose rank 0 may still step once

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and self.restarted and not self.recovered.exists():
            self.recovered.write_text(str(time.time()))


def test_a_killed_worker_is_restarted_by_ray_and_resumes_from_s3_where_the_run_stood(
    tmp_path: Path, s3_endpoint: str, s3_bucket: tuple[str, AbstractFileSystem]
) -> None:
    """2 workers, ZeRO-3, a checkpoint to moto's S3 after every step by Lightning's own ``ModelCheckpoint``; worker 1
    SIGKILLed after step 4 of 8 under ``FailureConfig(max_failures=1)``. Ray starts the group again; it resumes from
    the newest complete checkpoint and ends with the uninterrupted run's losses and weights."""
    url, _ = s3_bucket
    case = Case(strategy={"zero_stage": 3, "async_checkpoint": "thread"}, steps=8)
    killed, recovered = tmp_path / "killed", tmp_path / "recovered"
    config = {
        "cases": [case],
        "results": str(tmp_path / "results"),
        # The S3 server's endpoint and credentials: the workers started before this test set them.
        "env": {name: value for name, value in os.environ.items() if name.startswith(("AWS_", "FSSPEC_S3_"))},
        "callbacks": [
            keep_two_newest(f"{url}/run", kind=ModelCheckpoint),  # Lightning's own, as users configure it
            KillOnce(4, killed),
            RecordRestart(killed, recovered),
        ],
        "resume_from": "last",
    }
    (resumed,) = fit_on_ray(2, config, max_failures=1)
    assert killed.exists(), "the worker was not killed"
    recovery_s = float(recovered.read_text()) - float(killed.read_text())
    print(f"recovered from the killed worker in {recovery_s:.1f} s")  # the README's figure, with -s

    one_process = train(case.reference(2))
    # Lightning runs checkpoint callbacks last: the kill after step 4 comes before step 4's save, and may cut short
    # step 3's upload. The restart resumes after step 3, or after step 2.
    assert len(resumed.losses) in (5, 6)
    torch.testing.assert_close(resumed.losses, one_process.losses[-len(resumed.losses) :], rtol=1e-5, atol=0)
    for name, weight in one_process.params.items():
        torch.testing.assert_close(resumed.params[name], weight, rtol=1e-5, atol=WEIGHT_ATOL, msg=name)


class WaitForTheNodeToBeLost(Callback):
    """The workers on node ``node_id`` mark ``marker`` after step ``step``, and wait there for their machine to be
    lost."""

    def __init__(self, node_id: str, step: int, marker: Path) -> None:
        self.node_id, self.step, self.marker = node_id, step, marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and ray.get_runtime_context().get_node_id() == self.node_id:
            self.marker.touch()
            time.sleep(300)


def test_a_group_that_loses_a_node_comes_back_on_fewer_workers_and_resumes_under_the_new_layout(
    ray_cluster: Cluster,
    tmp_path: Path,
    s3_endpoint: str,
    s3_bucket: tuple[str, AbstractFileSystem],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Elastic Ray Train: ``num_workers=(2, 4)``, 2 CPUs a worker, on the head node and a second node of 4 CPUs each;
    tp=2 and ZeRO-3, a global batch of 4 windows, a checkpoint to moto's S3 after every step (Lightning's own
    ``ModelCheckpoint``). The second node is
    lost after step 4 of 8: Ray starts the group again on the 2 workers left (tp=2 x dp=2 becomes tp=2 x dp=1), which
    resumes from the newest complete checkpoint and ends with the uninterrupted run's losses and weights."""
    url, _ = s3_bucket
    # Ray learns of a lost node's resources only every 20 s: its first restart asks for the 4 workers of before and
    # waits this long for them (60 s by default) before it asks for the 2 there are.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
    (second_node,) = ray_cluster.worker_nodes
    waiting, lost, recovered = tmp_path / "waiting", tmp_path / "lost", tmp_path / "recovered"
    case = Case(
        strategy={"tensor_parallel_size": 2, "zero_stage": 3, "async_checkpoint": "thread"},
        steps=8,
        global_batch_size=4,  # 2 windows on each of 2 data-parallel ranks, then 4 on one
    )
    config = {
        "cases": [case],
        "results": str(tmp_path / "results"),
        "env": {name: value for name, value in os.environ.items() if name.startswith(("AWS_", "FSSPEC_S3_"))},
        "callbacks": [
            keep_two_newest(f"{url}/run", kind=ModelCheckpoint),
            WaitForTheNodeToBeLost(second_node.node_id, 4, waiting),
            RecordRestart(lost, recovered),
        ],
        "resume_from": "last",
    }

    def lose_the_second_node() -> None:
        while not waiting.exists():
            time.sleep(0.2)
        ray_cluster.remove_node(second_node, allow_graceful=False)
        lost.write_text(str(time.time()))

    losing = threading.Thread(target=lose_the_second_node, daemon=True)
    losing.start()
    (resumed,) = fit_on_ray((2, 4), config, max_failures=1, resources_per_worker={"CPU": 2})
    losing.join(timeout=0)
    assert lost.exists(), "the second node was not lost"
    recovery_s = float(recovered.read_text()) - float(lost.read_text())
    print(f"recovered from the lost node on fewer workers in {recovery_s:.1f} s")  # the README's figure, with -s
    assert resumed.layout == "pp=1 x dp=1 x tp=2", resumed.layout

    one_process = train(replace(case, strategy=None))
    assert len(resumed.losses) in (5, 6)  # after step 3's checkpoint, or step 2's if the loss cut step 3's upload short
    torch.testing.assert_close(resumed.losses, one_process.losses[-len(resumed.losses) :], rtol=1e-5, atol=0)
    for name, weight in one_process.params.items():
        torch.testing.assert_close(resumed.params[name], weight, rtol=1e-5, atol=WEIGHT_ATOL, msg=name)


def test_lightdist_fit_runs_a_config_on_ray_and_reports_its_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's launcher, on an elastic group: the config's relative paths are the launch directory's, the
    checkpoints land there, and Ray's result holds the metrics Lightning logged."""
    monkeypatch.chdir(tmp_path)
    overrides = ["--trainer.max_steps=4", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1"]
    overrides += [
        "--trainer.log_every_n_steps=2",
        "--trainer.logger=false",
        "--trainer.callbacks.init_args.every_n_train_steps=4",
    ]
    reported = tmp_path / "reported.jsonl"
    config = ["--config", str(CONFIGS / "zero3_cpu.yaml"), *overrides]
    # An elastic range: the head node has room for both workers, so Ray starts 2.
    result = lightdist.ray.fit(config, num_workers=(1, 2), ray_callbacks=[MetricsTo(reported)])
    assert result.error is None, result.error
    metrics = [json.loads(line) for line in reported.read_text().splitlines()]
    assert [report["step"] for report in metrics] == [2, 4, 4]  # every log_every_n_steps, and at the end
    assert metrics[-1]["val_loss"] > 0 and metrics[-1]["train_loss"] > 0
    assert (tmp_path / "runs/zero3_cpu/checkpoints/last.ckpt").exists()


def test_replica_groups_run_as_ray_worker_groups(
    tmp_path: Path, ray_cluster: Cluster, lighthouse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica-groups config on Ray: a ``lightdist fit --launcher ray`` per group, each its own worker group on
    one Ray cluster, meeting the others at a lighthouse; the group first in each step's quorum saves. One group is
    started as its page starts it, the other from this process (``lightdist.ray.fit``)."""
    monkeypatch.chdir(tmp_path)
    options = "--trainer.strategy.init_args.replica_groups"
    config = ["--config", str(CONFIGS / "replica_groups_cpu.yaml"), "--model.init_args.preset=tiny"]
    config += ["--trainer.max_steps=4", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1"]
    config += ["--trainer.logger=false", "--trainer.callbacks.init_args.every_n_train_steps=2"]
    config += [f"{options}.lighthouse={lighthouse}", f"{options}.groups=2"]
    launcher = ["--launcher", "ray", "--num-workers", "2", "--ray-address", ray_cluster.address]
    command = [sys.executable, "-m", "lightdist", "fit", *config, *launcher, f"{options}.group=group-0"]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    second = lightdist.ray.fit([*config, f"{options}.group=group-1"], num_workers=2)
    _, error = first.communicate(timeout=240)
    assert first.returncode == 0, error[-3000:]
    assert second.error is None, second.error
    last = tmp_path / "runs/replica_groups_cpu/checkpoints/last.ckpt"
    assert json.loads(last.read_text())["lightdist_checkpoint"] == "epoch=0-step=4.ckpt"
    assert (tmp_path / "runs/replica_groups_cpu/checkpoints/epoch=0-step=4.ckpt/COMPLETE").exists()


class MetricsTo(UserCallback):
    """Appends what rank 0 reports to Ray to ``path``; Ray runs it in its controller process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        with self.path.open("a") as lines:
            lines.write(json.dumps(metrics[0]) + "\n")


def test_bad_input_is_refused_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    config = ["fit", "--config", str(CONFIGS / "tp2_zero3_cpu.yaml")]
    with pytest.raises(
        ValueError, match=r"world size 3 is not divisible by tensor_parallel_size=2.*Ray's --num-workers"
    ):
        main([*config, "--launcher", "ray", "--num-workers", "3"])
    with pytest.raises(ValueError, match=r"world size 3 is not divisible.*the range lets Ray start 3 workers"):
        main([*config, "--launcher", "ray", "--num-workers", "2:4"])
    with pytest.raises(ValueError, match="at least one worker, and MIN <= MAX"):
        main([*config, "--launcher", "ray", "--num-workers", "4:2"])
    with pytest.raises(SystemExit):
        main([*config, "--launcher", "ray", "--num-workers", "two"])
    assert "'two' is neither N nor MIN:MAX" in capsys.readouterr().err
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=re.escape(f"No Ray cluster answers at --ray-address={nobody}")):
        main([*config, "--launcher", "ray", "--num-workers", "4", "--ray-address", nobody])
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightdist\[ray\]'"):
        main([*config, "--launcher", "ray", "--num-workers", "4"])
