"""What losing a rank costs: replica groups (torchft) against a torchrun restart from the newest checkpoint, on the
same job (the tiny Llama, ZeRO-3, 6 CPU ranks: 3 groups of 2, or one torchrun of 6; ``--groups`` for another count).

A rank SIGKILLs itself between the forward and backward of the step after ``--kill-at``. Replica groups: the other
two groups go on in the same processes, and the lost group is started again (a new torchrun) and rejoins with the
live state. torchrun restart: the agent restarts all 6 ranks, which resume from the newest complete checkpoint (saved
every ``--save-every`` steps, uploaded behind training). From the lines each launch's rank 0 writes per step:

- from the kill to the next committed step (any launch's), and to the lost step's completion;
- steps trained twice: a redone step, or the steps since the checkpoint;
- samples the final weights missed or saw twice: each step's samples over the launches that committed it (a later
  attempt replacing what an earlier one trained from the step it resumed at), against the global batch of 12;
- for replica groups, from the lost group's new start to its first step.

    python bench/failures.py           # 40 steps of at least 0.5 s, the kill in step 14, a checkpoint every 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything

from lightdist.models import Llama, TokenDataModule
from lightdist.plugins import ModelCheckpoint, ParallelStrategy
from lightdist.resilience.replica_groups import ReplicaGroups

GLOBAL_BATCH = 12  # samples a step: 6 for each of 2 ranks of a group, dealt among the groups; 2 for each of 6 ranks
REJOIN_STEPS = 15  # the others' last steps, once the lost group's new start has set up: time for it to join


class StepLog(Callback):
    """Rank 0 of each launch appends one line per committed step to ``path``: the samples its launch trained on in
    that step; the rank told to dies at ``kill_at`` in the launch's first attempt, saying when.

    Replica groups: the others wait ``REJOIN_STEPS`` steps before the end until the lost group's new start has set
    up, so that on a loaded machine the run does not end before that group rejoins (it would find no one to join)."""

    def __init__(self, path: str, launch: str, kill_at: int, kill_launch: str, pace: float, hold_at: int) -> None:
        self.path, self.launch, self.kill_at, self.kill_launch, self.pace = path, launch, kill_at, kill_launch, pace
        self.hold_at = hold_at
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == 0:
            Path(self.path).with_name(f"{self.launch}-set-up-{os.getpid()}").touch()

    def _write(self, **line: object) -> None:
        with open(self.path, "a") as log:
            log.write(json.dumps({"launch": self.launch, "attempt": self.attempt, "time": time.time(), **line}) + "\n")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        group = trainer.strategy.replica_group
        first_start = self.attempt == 0 and (group is None or group.joined_at == 0)
        here = self.launch == self.kill_launch and trainer.global_rank == 1 and trainer.global_step == self.kill_at
        if here and first_start:
            self._write(killed=self.kill_at)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.pace)  # a longer step, as a real model's: the lost group is back before the run ends
        if trainer.global_step == self.hold_at and self.launch != self.kill_launch:
            self._wait_for_the_lost_group()
        if trainer.global_rank == 0:
            group = trainer.strategy.replica_group
            rows = group.rows if group is not None else batch.shape[0]
            samples = rows * trainer.strategy.layout.dp
            self._write(step=trainer.global_step, samples=samples, redone=group.steps_redone if group else 0)

    def _wait_for_the_lost_group(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while len(list(Path(self.path).parent.glob(f"{self.kill_launch}-set-up-*"))) < 2 and time.time() < deadline:
            time.sleep(0.1)


def worker(args: argparse.Namespace) -> None:
    """One launch's ranks (under torchrun): a replica group of 2, or the whole job (2 ranks a group)."""
    seed_everything(1234)
    in_groups = args.launch != "job"
    replicas = ReplicaGroups(group=args.launch, groups=args.groups, timeout=20) if in_groups else None
    hold_at = args.steps - REJOIN_STEPS
    callbacks: list[Callback] = [StepLog(args.log, args.launch, args.kill_at, args.kill_launch, args.pace, hold_at)]
    if not in_groups:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=args.save_every, save_last=True))
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ParallelStrategy(zero_stage=3, replica_groups=replicas),
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=not in_groups,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ranks = int(os.environ["WORLD_SIZE"])
    data = TokenDataModule(seq_len=64, batch_size=GLOBAL_BATCH // ranks, synthetic_tokens=1 << 16)
    trainer.fit(Llama(preset="tiny", learning_rate=3e-3, warmup_steps=2), datamodule=data, ckpt_path="last")


def torchrun(
    ranks: int, port: int, launch: str, args: argparse.Namespace, restarts: int, **env: str
) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={port}"]
    options = [
        "--launch",
        launch,
        "--step-log",
        args.log,
        "--checkpoints",
        args.checkpoints,
        "--steps",
        str(args.steps),
    ]
    options += ["--kill-at", str(args.kill_at), "--kill-launch", args.kill_launch, "--save-every", str(args.save_every)]
    options += ["--pace", str(args.pace), "--groups", str(args.groups)]
    # the ranks' output: shown with --verbose, else kept in a file read back where the launch fails
    with contextlib.nullcontext() if args.verbose else open(output(args, launch), "a") as log:
        return subprocess.Popen(
            [*command, f"--max-restarts={restarts}", __file__, "worker", *options],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def output(args: argparse.Namespace, launch: str) -> Path:
    return Path(args.log).parent / f"{launch}.log"


def failed(args: argparse.Namespace, launch: str, problem: str) -> RuntimeError:
    tail = "" if args.verbose else "\n".join(output(args, launch).read_text().splitlines()[-40:])
    return RuntimeError(f"{problem}; the end of its ranks' output ({output(args, launch)}):\n{tail}")


def replica_groups(args: argparse.Namespace) -> dict[str, float]:
    """``--groups`` groups of 2 ranks; group-1 loses a rank and is started again once its torchrun has ended."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=1_000)
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
    launches = [torchrun(2, 29600 + g, f"group-{g}", args, 0, **env) for g in range(args.groups)]
    launches[1].wait()
    started_again = time.time()
    launches[1] = torchrun(2, 29601, "group-1", args, 0, **env)
    codes = [launch.wait() for launch in launches]
    lighthouse.shutdown()
    for group, code in enumerate(codes):
        if code:
            raise failed(args, f"group-{group}", f"replica group {group} failed: exit codes {codes} (1: its new start)")
    return summary(read(args.log), args.steps, started_again)


def torchrun_restart(args: argparse.Namespace) -> dict[str, float]:
    """One torchrun of the groups' ranks, restarted by its agent, resuming from the newest checkpoint."""
    if torchrun(2 * args.groups, 29610, "job", args, 1).wait():
        raise failed(args, "job", "the restarted job failed")
    return summary(read(args.log), args.steps)


def read(path: str) -> list[dict]:
    with open(path) as log:
        return [json.loads(line) for line in log]


def summary(lines: list[dict], steps: int, started_again: float | None = None) -> dict[str, float]:
    """The kill's cost: time to the next committed step, steps trained twice, and samples the final weights missed or
    saw twice: a launch's later attempt replaces what its earlier ones trained from the step it resumed at."""
    killed, lost_step = next((line["time"], line["killed"]) for line in lines if "killed" in line)
    trained = [line for line in lines if "step" in line]
    kept: list[dict] = []
    for launch in {line["launch"] for line in trained}:
        own = [line for line in trained if line["launch"] == launch]
        resumed_at = steps + 1  # the first step of the attempt after the one looked at
        for attempt in sorted({line["attempt"] for line in own}, reverse=True):
            kept += [line for line in own if line["attempt"] == attempt and line["step"] < resumed_at]
            resumed_at = min(line["step"] for line in own if line["attempt"] == attempt)
    samples = {step: 0 for step in range(1, steps + 1)}
    for line in kept:
        samples[line["step"]] += line["samples"]
    result = {
        "kill_to_next_step_s": min(line["time"] for line in trained if line["time"] > killed) - killed,
        "kill_to_lost_step_done_s": min(line["time"] for line in trained if line["step"] > lost_step) - killed,
        "steps_trained_twice": len(trained) - len(kept) + max(line["redone"] for line in trained),
        "samples_missed_or_repeated": sum(abs(count - GLOBAL_BATCH) for count in samples.values()),
    }
    if started_again is not None:
        rejoined = min(line["time"] for line in trained if line["launch"] == "group-1" and line["time"] > started_again)
        result["start_to_rejoined_s"] = rejoined - started_again
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="both", choices=["both", "replica-groups", "torchrun", "worker"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pace", type=float, default=0.5, help="seconds each step takes beyond its compute")
    parser.add_argument("--kill-at", type=int, default=13)
    parser.add_argument("--groups", type=int, default=3, help="replica groups of 2 ranks (torchrun: all their ranks)")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--launch", default="job")
    parser.add_argument("--kill-launch", default="group-1")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--step-log", dest="log")
    parser.add_argument("--checkpoints")
    args = parser.parse_args()
    if args.mode in ("both", "replica-groups") and args.kill_at >= args.steps - REJOIN_STEPS:
        parser.error(f"--kill-at must come before the others' last {REJOIN_STEPS} steps (--steps - {REJOIN_STEPS})")
    if args.mode == "worker":
        return worker(args)
    rows = []
    for mode, run in (("replica-groups", replica_groups), ("torchrun", torchrun_restart)):
        if args.mode not in ("both", mode):
            continue
        folder = tempfile.mkdtemp(prefix=f"failures-{mode}-")
        args.log, args.checkpoints = str(Path(folder) / "steps.jsonl"), str(Path(folder) / "checkpoints")
        args.kill_launch = "group-1" if mode == "replica-groups" else "job"
        rows.append((mode, run(args)))
        if args.verbose:
            print(f"{mode}: each step's log is in {args.log}")
        else:
            shutil.rmtree(folder)
    print(
        "| way | kill to next step | kill to the lost step done | steps trained twice | samples missed or repeated "
        "| started again to rejoined |"
    )
    print("|---|---|---|---|---|---|")
    for mode, result in rows:
        rejoined = f"{result['start_to_rejoined_s']:.1f} s" if "start_to_rejoined_s" in result else "-"
        print(
            f"| {mode} | {result['kill_to_next_step_s']:.1f} s | {result['kill_to_lost_step_done_s']:.1f} s | "
            f"{result['steps_trained_twice']} | "
            f"{result['samples_missed_or_repeated']} | {rejoined} |"
        )


if __name__ == "__main__":
    main()
