"""The idle bubble of lightdist's pipeline schedules, measured beside the theory, on CPU ranks.

Each rank holds a share of a small LightningModule trained by ``ParallelStrategy``, the real training path (the
user's step as the loss, log replay, gradient sync): one stage, or two under the interleaved and zero-bubble
schedules. Its blocks do their work as fixed-duration waits (forward ``--forward-ms`` per block and microbatch, as
long again for the input gradient and for the weight gradient) rather than matmuls, so four stages measure the
schedule on a 2-core machine instead of the cores' contention. Per step and rank:

    idle = 1 - busy / step time          theory = (p - 1) / (v m + p - 1)    (v stages per rank; GPipe, 1F1B: v = 1)

and the most microbatches whose activations a rank held at once (GPipe: m, 1F1B: at most p).

    python bench/pipeline_bubble.py                      # p = 2, 4 ranks; m = 4, 8, 16 microbatches; every schedule
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp
from lightning.pytorch import Callback, LightningModule, Trainer
from ranks import free_port, join_ranks
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightdist.plugins import ParallelStrategy

VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
WIDTH, SEQ_LEN = 32, 8


class _Clock:
    """What this rank spent working, and how many blocks' activations it held (now and at most), this step."""

    busy_s = 0.0
    held = 0
    peak_held = 0

    @staticmethod
    def wait(seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        _Clock.busy_s += time.perf_counter() - start


class _InputWork(torch.autograd.Function):
    """A block's compute on its input: waits ``forward_s`` forward, and as long again for the input gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, forward_s: float) -> Tensor:
        ctx.forward_s = forward_s
        _Clock.wait(forward_s)
        _Clock.held += 1
        _Clock.peak_held = max(_Clock.peak_held, _Clock.held)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        _Clock.wait(ctx.forward_s)
        return grad, None


class _WeightWork(torch.autograd.Function):
    """A block's weight gradient: waits ``forward_s`` in backward, then the block's activations are free.

    A branch of its own, joined to the input's path by an addition, so zero-bubble schedules can defer it.
    """

    @staticmethod
    def forward(ctx, weight: Tensor, forward_s: float) -> Tensor:
        ctx.forward_s = forward_s
        return weight.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        _Clock.wait(ctx.forward_s)
        _Clock.held -= 1
        return grad, None


class _Block(nn.Module):
    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.weight = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return _InputWork.apply(x, self.forward_s) + _WeightWork.apply(self.weight, self.forward_s)


class TimedLM(LightningModule):
    def __init__(self, blocks: int, forward_s: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)
        self.layers = nn.ModuleList(_Block(forward_s) for _ in range(blocks))
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
        self.steps: list[tuple[float, float, int]] = []  # (step seconds, busy seconds, peak blocks held)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _Clock.busy_s, _Clock.held, _Clock.peak_held = 0.0, 0, 0
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append((time.perf_counter() - self._start, _Clock.busy_s, _Clock.peak_held))


def _measure(stages: int, schedule: str, microbatches: int, args: argparse.Namespace) -> tuple[float, float]:
    """This rank's mean idle fraction over the measured steps, and the most microbatches' activations it held."""
    virtual = VIRTUAL_STAGES[schedule]
    model = TimedLM(stages * args.blocks_per_stage, args.forward_ms / 1000)
    times = _StepTimes()
    batch = torch.zeros(microbatches, SEQ_LEN, dtype=torch.long)
    trainer = Trainer(
        accelerator="cpu",
        devices=stages,
        strategy=ParallelStrategy(
            pipeline_parallel_size=stages,
            pipeline_schedule=schedule,
            microbatches=microbatches,
            pipeline_split=[args.blocks_per_stage // virtual] * (stages * virtual),
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
    return idle, max(peak for _, _, peak in measured) / args.blocks_per_stage


def _rank_main(rank: int, stages: int, port: int, args: argparse.Namespace, results) -> None:
    join_ranks(rank, stages, port)
    for schedule in args.schedules:
        for microbatches in args.microbatches:
            idle, peak = _measure(stages, schedule, microbatches, args)
            results.put((stages, schedule, microbatches, idle, peak))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(VIRTUAL_STAGES), choices=list(VIRTUAL_STAGES))
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--forward-ms", type=float, default=30.0, help="each block's forward per microbatch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    context = mp.get_context("spawn")
    rows: dict[tuple, list] = {}
    for stages in args.stages:
        results = context.Queue()
        mp.start_processes(_rank_main, args=(stages, free_port(), args, results), nprocs=stages, start_method="spawn")
        for _ in range(stages * len(args.schedules) * len(args.microbatches)):
            *config, idle, peak = results.get(timeout=60)
            rows.setdefault(tuple(config), []).append((idle, peak))

    print(f"{'p':>2} {'schedule':<16} {'m':>3}  {'idle (measured)':>15}  {'theory':>7}  {'peak in flight':>14}")
    for (stages, schedule, microbatches), per_rank in sorted(rows.items()):
        idle = statistics.mean(idle for idle, _ in per_rank)
        peak = max(peak for _, peak in per_rank)
        theory = _theory(schedule, stages, microbatches)
        print(f"{stages:>2} {schedule:<16} {microbatches:>3}  {idle:>15.1%}  {theory}  {peak:>14.1f}")


def _theory(schedule: str, p: int, m: int) -> str:
    """The bubble's share of the step: ``p - 1`` idle slots against ``m`` microbatches' work, the slots ``v`` times
    shorter when each rank holds ``v`` stages. Zero bubble fills them with weight gradients: no closed form."""
    if schedule == "zero_bubble":
        return f"{'-':>7}"
    v = VIRTUAL_STAGES[schedule]
    return f"{(p - 1) / (v * m + p - 1):>7.1%}"


if __name__ == "__main__":
    main()
