"""Ray Train as the launcher: ``lightdist fit --config X --launcher ray --num-workers N`` runs the config on the
workers of Ray's ``TorchTrainer``.

Ray schedules the workers, makes their process group, and starts the group again when a worker dies
(``--max-failures``). Each worker runs the same LightningCLI as ``lightdist fit`` does, with Ray's
``RayLightningEnvironment`` telling Lightning its rank: lightdist builds its DeviceMesh on Ray's group, and
``ckpt_path: last`` resumes a restarted group from the newest complete checkpoint at the run's URL. Metrics reach
Ray (``ray.train.report``) as they reach the Lightning logger.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from jsonargparse import ArgumentParser
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightdist.plugins.strategy import ParallelStrategy

__all__ = ["ReportToRay", "fit", "main"]

_INSTALL = "pip install 'lightdist[ray]'"


def main(argv: list[str]) -> None:
    """``lightdist fit ... --launcher ray``: the launcher's own options, the rest is the config for the workers."""
    parser = argparse.ArgumentParser(prog="lightdist fit --launcher ray", add_help=False)
    parser.add_argument("--launcher", choices=["ray"], required=True)
    parser.add_argument(
        "--num-workers",
        type=_worker_count,
        required=True,
        help="Ray workers, one rank each: N, or MIN:MAX for an elastic group that Ray sizes to the cluster",
    )
    parser.add_argument("--ray-address", help="a running Ray cluster (host:port, ray://host:port, auto); else local")
    parser.add_argument("--max-failures", type=int, default=0, help="times Ray starts the workers again after one dies")
    options, cli_args = parser.parse_known_args(argv)
    if cli_args[:1] != ["fit"]:
        parser.error(f"--launcher ray runs `lightdist fit`, not {' '.join(cli_args[:1]) or 'nothing'}.")
    result = fit(
        cli_args[1:], num_workers=options.num_workers, address=options.ray_address, max_failures=options.max_failures
    )
    if result.error is not None:
        raise SystemExit(f"lightdist: the Ray job failed: {result.error}")


def _worker_count(text: str) -> int | tuple[int, int]:
    """``N`` workers, or ``MIN:MAX``: an elastic group."""
    low, _, high = text.partition(":")
    try:
        return (int(low), int(high)) if high else int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither N nor MIN:MAX (e.g. 8, or 4:8 for an elastic group)"
        ) from None


def fit(
    cli_args: list[str],
    *,
    num_workers: int | tuple[int, int],
    address: str | None = None,
    max_failures: int = 0,
    ray_callbacks: Sequence[Any] = (),
) -> Any:
    """Train the LightningCLI config ``cli_args`` (``--config X`` and overrides) on ``num_workers`` Ray workers;
    returns Ray's ``Result``. Bad input raises here, before any worker starts.

    ``num_workers=(min, max)`` is an elastic group: Ray starts as many workers as the cluster has room for, and
    starts the group again on another number when nodes are lost or join. Every size in the range must train the
    config's layout. A data module's batch is per rank, so the global batch follows the group's size, unless it
    is given whole (``TokenDataModule(global_batch_size=N)``).

    ``ray_callbacks``: Ray Train ``UserCallback``s, which receive the metrics every worker reports (Ray keeps no
    metrics in its ``Result`` without a Ray checkpoint, and lightdist's checkpoints go to the run's URL instead).
    """
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError as error:
        raise ModuleNotFoundError(f"--launcher ray needs Ray Train, which is not installed: {_INSTALL}") from error
    low, high = num_workers if isinstance(num_workers, tuple) else (num_workers, num_workers)
    if not 1 <= low <= high:
        raise ValueError(f"--num-workers={_shown(num_workers)}: Ray needs at least one worker, and MIN <= MAX.")
    trainer_config = _parsed_trainer_config(cli_args)
    strategy = _strategy_of(trainer_config["strategy"])
    if isinstance(strategy, ParallelStrategy):
        for size in range(low, high + 1):
            in_range = f" (the range lets Ray start {size} workers)" if low < high else ""
            strategy.check_world_size(size, launcher=f"Ray's --num-workers={_shown(num_workers)}{in_range}")
    _connect(ray, address)
    use_gpu = trainer_config["accelerator"] in ("gpu", "cuda")
    trainer = TorchTrainer(
        _fit_on_worker,
        train_loop_config={"cli_args": cli_args, "cwd": os.getcwd()},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(failure_config=FailureConfig(max_failures=max_failures), callbacks=list(ray_callbacks)),
    )
    return trainer.fit()


class ReportToRay(Callback):
    """Reports Lightning's logged metrics to Ray (``ray.train.report``) every ``log_every_n_steps``, and at the end.

    Ray takes rank 0's metrics, and every worker must report as often: every rank reports at the same steps.
    """

    def __init__(self) -> None:
        self._reported_step = -1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # the same on every rank: optimizer steps, not batches
        if step % trainer.log_every_n_steps == 0 and step != self._reported_step:
            self._report(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report(trainer)

    def _report(self, trainer: Trainer) -> None:
        import ray.train

        metrics = {name: value.item() for name, value in trainer.callback_metrics.items() if value.numel() == 1}
        ray.train.report({**metrics, "step": trainer.global_step, "epoch": trainer.current_epoch})
        self._reported_step = trainer.global_step


def _fit_on_worker(config: dict[str, Any]) -> None:
    from ray.train.lightning import RayLightningEnvironment

    # Ray starts workers in a directory of its own: the config's relative paths (runs/...) mean the directory the job
    # was launched from, where that directory is on the worker's machine too.
    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])
    sys.argv[1:] = []  # Ray's worker options, which LightningCLI would take for a mix of two command lines
    LightningCLI(
        args=["fit", *config["cli_args"]],
        trainer_defaults={"plugins": [RayLightningEnvironment()], "callbacks": [ReportToRay()]},
        save_config_kwargs={"overwrite": True},
    )


class _ParsedOnly(LightningCLI):
    """The config as the workers will read it, checked by LightningCLI's own parser; nothing is built or run."""

    def instantiate_classes(self) -> None:
        self.subcommand = None  # parsed, and not run


def _parsed_trainer_config(cli_args: list[str]) -> dict[str, Any]:
    return _ParsedOnly(args=["fit", *cli_args]).config["fit"]["trainer"].as_dict()


def _strategy_of(config: str | dict[str, Any]) -> Any:
    """The config's strategy, built to check its sizes (building one allocates nothing), by LightningCLI's parser:
    its nested options (``replica_groups``) become the classes its signature names."""
    if isinstance(config, str):
        return StrategyRegistry.get(config) if config in StrategyRegistry else config
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    return parser.instantiate(parser.parse_object({"strategy": config})).strategy


def _shown(num_workers: int | tuple[int, int]) -> str:
    return ":".join(map(str, num_workers)) if isinstance(num_workers, tuple) else str(num_workers)


def _connect(ray: Any, address: str | None) -> None:
    """Join the Ray cluster at ``address``, or start a local one; an address nobody answers at is an error in
    seconds, where Ray would retry for minutes."""
    if address is not None and address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as error:
            raise ConnectionError(
                f"No Ray cluster answers at --ray-address={address} ({error}). Start one there with `ray start --head`,"
                " or leave --ray-address out to start a local cluster."
            ) from error
    ray.init(address=address, ignore_reinit_error=True)
