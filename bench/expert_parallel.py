"""What expert parallelism's all-to-all costs on CPU ranks: step time of the same MoE run at each ``ep``, in turn.

The tiny reference MoE Llama (8 experts, top 2) trains with ``ParallelStrategy`` on ``--ranks`` gloo ranks, data
parallel with ZeRO-3, once per ``--ep`` size and round, the sizes alternating (A B A B ...) in the same processes so
that a drift of the machine's speed falls on every size alike. Each rank sends and receives, per MoE layer and step,
its tokens' hidden states for the experts other ranks hold, forward (to the experts and back) and backward (the
gradients of both):

    bytes per rank = 4 x tokens x top_k x hidden x 4 bytes x (ep - 1) / ep         (uniform routing)

``--experts list`` holds each layer's experts as a list of modules that the MoE block's loop calls one by one
(transformers 4's Mixtral, LitGPT), the same sizes and routing: under ``ep`` its block runs twice, recording and then
replaying the expert calls (``lightdist/parallel/listed_experts.py``).

    python bench/expert_parallel.py                      # 2 ranks, ep 1 and 2
    python bench/expert_parallel.py --experts list       # the same, experts in a list
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer, seed_everything
from ranks import free_port, join_ranks
from torch import Tensor, nn

from lightdist.models import MoELlama, TokenDataModule
from lightdist.plugins import ParallelStrategy


class _ExpertMLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(dim, 2 * ffn_dim, bias=False), nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class _ListedMoE(nn.Module):
    """The reference MoE block's router and top-k, its experts a list that a loop calls one by one."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.aux_loss = top_k, None  # no load-balancing loss for the step to log
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(_ExpertMLP(dim, ffn_dim) for _ in range(n_experts))

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(0, 1)
        weights, chosen = torch.topk(F.softmax(self.gate(tokens), dim=-1), self.top_k)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            out.index_add_(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out.view_as(x)


def _model(experts: str) -> MoELlama:
    model = MoELlama("tiny")
    if experts == "list":
        cfg = model.config
        for layer in model.model.layers:
            layer.mlp = _ListedMoE(cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.top_k)
    return model


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(time.perf_counter() - self._start)


def _step_time(ep: int, ranks: int, args: argparse.Namespace) -> float:
    """The median step time of one run, after its warm-up steps."""
    seed_everything(1234)
    times = _StepTimes()
    trainer = Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy=ParallelStrategy(expert_parallel_size=ep),
        max_steps=args.warmup + args.steps,
        callbacks=[times],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TokenDataModule(seq_len=args.seq_len, batch_size=args.batch_size, val_fraction=0.0, synthetic_tokens=65_536)
    trainer.fit(_model(args.experts), datamodule=data)
    return statistics.median(times.steps[args.warmup :])


def _rank_main(rank: int, ranks: int, port: int, args: argparse.Namespace, results) -> None:
    join_ranks(rank, ranks, port)
    for round_ in range(args.rounds):
        for ep in args.ep:
            seconds = _step_time(ep, ranks, args)
            if rank == 0:
                results.put((round_, ep, seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--experts", choices=["stacked", "list"], default="stacked", help="how each layer holds them")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    results = mp.get_context("spawn").Queue()
    mp.start_processes(
        _rank_main, args=(args.ranks, free_port(), args, results), nprocs=args.ranks, start_method="spawn"
    )
    measured: dict[int, list[float]] = {}
    for _ in range(args.rounds * len(args.ep)):
        _, ep, seconds = results.get(timeout=600)
        measured.setdefault(ep, []).append(seconds)

    config = MoELlama("tiny").config
    tokens = args.seq_len * args.batch_size
    baseline = statistics.median(measured[args.ep[0]])
    print(
        f"{'ep':>3}  {'step (ms), median of rounds':>28}  {f'vs ep={args.ep[0]}':>9}  {'all-to-all MiB/rank/step':>24}"
    )
    for ep, seconds in measured.items():
        sent = 4 * tokens * config.top_k * config.dim * 4 * (ep - 1) / ep * config.n_layers / 2**20
        step = statistics.median(seconds)
        print(f"{ep:>3}  {step * 1000:>28.1f}  {step / baseline:>8.2f}x  {sent:>24.2f}")


if __name__ == "__main__":
    main()
