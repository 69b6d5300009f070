"""The idle bubble of lightdist's pipeline schedules, measured beside the theory, on CPU ranks.

Each rank is one pipeline stage of a small LightningModule trained by ``ParallelStrategy``, the real training path
(the user's step as the loss, log replay, gradient sync). Its blocks do their work as fixed-duration waits (forward
``--forward-ms`` per block and microbatch, backward twice that) rather than matmuls, so four stages measure the
schedule on a 2-core machine instead of the cores' contention. Per step and stage:

    idle = 1 - busy / step time          theory (GPipe, 1F1B) = (p - 1) / (m + p - 1)

and the most microbatches whose activations a stage held at once (GPipe: m, 1F1B: at most p).

    python bench/pipeline_bubble.py                      # p = 2, 4 stages; m = 4, 8, 16 microbatches
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightdist.plugins import ParallelStrategy

SCHEDULES = ("gpipe", "1f1b")
WIDTH, SEQ_LEN = 32, 8


class _Work(torch.autograd.Function):
    """Stands for a block's compute: waits ``forward_s`` forward and twice that backward, and counts the time."""

    busy_s = 0.0
    in_flight = 0
    peak_in_flight = 0

    @staticmethod
    def forward(ctx, x: Tensor, forward_s: float) -> Tensor:
        ctx.forward_s = forward_s
        _Work._wait(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        _Work._wait(2 * ctx.forward_s)
        return grad, None

    @staticmethod
    def _wait(seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        _Work.busy_s += time.perf_counter() - start


class _Block(nn.Module):
    """A stage's first block (``counts=True``) also counts the microbatches whose activations the stage holds: one
    more in forward, one fewer when backward reaches the stage's input."""

    def __init__(self, forward_s: float, *, counts: bool) -> None:
        super().__init__()
        self.forward_s, self.counts = forward_s, counts
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        if self.counts and x.requires_grad:
            _Work.in_flight += 1
            _Work.peak_in_flight = max(_Work.peak_in_flight, _Work.in_flight)
            x.register_hook(_backward_reached_input)
        return _Work.apply(self.norm(x), self.forward_s)


def _backward_reached_input(grad: Tensor) -> None:
    _Work.in_flight -= 1


class TimedLM(LightningModule):
    def __init__(self, stages: int, blocks_per_stage: int, forward_s: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)
        self.layers = nn.ModuleList(
            _Block(forward_s, counts=index % blocks_per_stage == 0) for index in range(stages * blocks_per_stage)
        )
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int]] = []  # (step seconds, busy seconds, peak in flight)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _Work.busy_s, _Work.in_flight, _Work.peak_in_flight = 0.0, 0, 0
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append((time.perf_counter() - self._start, _Work.busy_s, _Work.peak_in_flight))


def _measure(stages: int, schedule: str, microbatches: int, args: argparse.Namespace) -> tuple[float, int]:
    """This stage's mean idle fraction over the measured steps, and its peak microbatches in flight."""
    model = TimedLM(stages, args.blocks_per_stage, args.forward_ms / 1000)
    times = _StepTimes()
    batch = torch.zeros(microbatches, SEQ_LEN, dtype=torch.long)
    trainer = Trainer(
        accelerator="cpu",
        devices=stages,
        strategy=ParallelStrategy(
            pipeline_parallel_size=stages,
            pipeline_schedule=schedule,
            microbatches=microbatches,
            pipeline_split=[args.blocks_per_stage] * stages,
            zero_stage=0,
        ),
        max_steps=args.warmup + args.steps,
        callbacks=[times],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader([batch[0]] * (microbatches * (args.warmup + args.steps)), batch_size=microbatches))
    measured = times.steps[args.warmup :]
    idle = statistics.mean(1 - busy / step for step, busy, _ in measured)
    return idle, max(peak for _, _, peak in measured)


def _rank_main(rank: int, stages: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(stages), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    for schedule in SCHEDULES:
        for microbatches in args.microbatches:
            idle, peak = _measure(stages, schedule, microbatches, args)
            results.put((stages, schedule, microbatches, idle, peak))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--forward-ms", type=float, default=30.0, help="each block's forward per microbatch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    context = mp.get_context("spawn")
    rows: dict[tuple, list] = {}
    for stages in args.stages:
        results = context.Queue()
        mp.start_processes(_rank_main, args=(stages, _free_port(), args, results), nprocs=stages, start_method="spawn")
        for _ in range(stages * len(SCHEDULES) * len(args.microbatches)):
            *config, idle, peak = results.get(timeout=60)
            rows.setdefault(tuple(config), []).append((idle, peak))

    print(f"{'p':>2} {'schedule':<9} {'m':>3}  {'idle (measured)':>15}  {'theory':>7}  {'peak in flight':>14}")
    for (stages, schedule, microbatches), per_rank in sorted(rows.items()):
        idle = statistics.mean(idle for idle, _ in per_rank)
        theory = (stages - 1) / (microbatches + stages - 1)
        peak = max(peak for _, peak in per_rank)
        print(f"{stages:>2} {schedule:<9} {microbatches:>3}  {idle:>15.1%}  {theory:>7.1%}  {peak:>14}")


if __name__ == "__main__":
    main()
