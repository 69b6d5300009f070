"""Training throughput of the reference Llama on one device, several ways, in one run so the ratios are fair:

- ``plain``: the same model and a hand-written loop (AdamW, cross-entropy, nothing else);
- ``plain-compile``: that loop around ``torch.compile(model)``, what a user of plain PyTorch writes for speed;
- ``lightning``: Lightning's own ``ModelParallelStrategy`` with FSDP2 applied per block in ``configure_model``;
- ``lightdist``: lightdist's ``ParallelStrategy`` (ZeRO-3, FSDP2 per block), the model unchanged;
- ``lightdist-compile``: the same with ``compile=True`` (each block compiled, torchtitan's way);
- ``lightdist-offload``: the same with ``cpu_offload=True`` (parameters, gradients and AdamW in CPU memory).

    python bench/throughput.py --preset 1b --batch-size 4 --seq-len 2048 --precision bf16-mixed   # one GPU
    python bench/throughput.py --preset small --batch-size 4 --seq-len 256 --runs plain lightning lightdist  # CPU

Prints tokens/s, step time, MFU (6N + attention FLOPs per token over the device's bf16 peak) and peak memory.
``--profile FILE`` writes the operators of one timed step of the ``lightdist`` run, by device time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from lightdist.models import Llama
from lightdist.models.llama import LlamaModel
from lightdist.plugins import ParallelStrategy
from lightdist.throughput import DecoderFlops, device_peak_flops


class RandomTokens(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab_size, (length, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class StepTimer(Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _synchronize(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _synchronize(pl_module.device)
        self.seconds.append(time.perf_counter() - self._start)


class LlamaWithFSDP2(Llama):
    """What a Lightning user writes today for ``ModelParallelStrategy``: FSDP2 by hand in ``configure_model``."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ProfileOneStep(Callback):
    """torch.profiler around step ``step``; its operators by device time (CPU time on CPU) go to ``path``."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.step:
            self.profiler = torch.profiler.profile()
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.step:
            _synchronize(pl_module.device)
            self.profiler.__exit__(None, None, None)
            order = "self_device_time_total" if pl_module.device.type == "cuda" else "self_cpu_time_total"
            with open(self.path, "w") as file:
                file.write(self.profiler.key_averages().table(sort_by=order, row_limit=40, max_name_column_width=70))


def plain_pytorch(
    args: argparse.Namespace, device: torch.device, data: RandomTokens, compile: bool = False
) -> list[float]:
    seed_everything(0)
    model = LlamaModel(Llama(args.preset).config).to(device)
    if compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()
    seconds = []
    for batch in DataLoader(data, batch_size=args.batch_size):
        batch = batch.to(device)
        _synchronize(device)
        start = time.perf_counter()
        with autocast:
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def lightning_trainer(strategy_factory: Callable, module_class: type[Llama], profile: bool = False) -> Callable:
    def run(args: argparse.Namespace, device: torch.device, data: RandomTokens) -> list[float]:
        seed_everything(0)
        timer = StepTimer()
        profiler = [ProfileOneStep(args.warmup, args.profile)] if profile and args.profile else []
        trainer = Trainer(
            accelerator=device.type,
            devices=1,
            strategy=strategy_factory(),
            precision=args.precision,
            max_steps=args.steps,
            callbacks=[timer, *profiler],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module_class(args.preset, learning_rate=1e-4), DataLoader(data, batch_size=args.batch_size))
        return timer.seconds

    return run


RUNS = {  # option name: (printed name, run)
    "plain": ("plain PyTorch", plain_pytorch),
    "plain-compile": ("plain PyTorch + torch.compile", partial(plain_pytorch, compile=True)),
    "lightning": (
        "Lightning ModelParallelStrategy (FSDP2)",
        lightning_trainer(lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), LlamaWithFSDP2),
    ),
    "lightdist": (
        "lightdist ParallelStrategy (ZeRO-3)",
        lightning_trainer(lambda: ParallelStrategy(zero_stage=3), Llama, profile=True),
    ),
    "lightdist-compile": (
        "lightdist ParallelStrategy (ZeRO-3, compile)",
        lightning_trainer(lambda: ParallelStrategy(zero_stage=3, compile=True), Llama),
    ),
    "lightdist-offload": (
        "lightdist ParallelStrategy (ZeRO-3, cpu_offload)",
        lightning_trainer(lambda: ParallelStrategy(zero_stage=3, cpu_offload=True), Llama),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak, if not in the table")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which, in this order")
    parser.add_argument("--profile", default=None, help="file for the operators of one step of the lightdist run")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup} to leave timed steps.")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = Llama(args.preset).config
    data = RandomTokens(config.vocab_size, args.seq_len, args.steps * args.batch_size)
    flops_per_token = DecoderFlops.of(_meta_model(config), n_layers=config.n_layers, dim=config.dim).per_token(
        args.seq_len
    )
    peak = device_peak_flops(device, args.peak_tflops)
    tokens_per_step = args.batch_size * args.seq_len
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"Llama {args.preset}, batch {args.batch_size} x {args.seq_len}, {args.precision}, on {device_name}")
    print(f"{'run':42s} {'tokens/s':>10s} {'step ms':>9s} {'MFU':>7s} {'peak GiB':>9s} {'vs plain':>9s}")
    baseline = None
    for name, run in (RUNS[key] for key in args.runs):
        memory_before = _release_earlier_runs(device)
        step = statistics.median(run(args, device, data)[args.warmup :])
        tokens_per_second = tokens_per_step / step
        baseline = baseline or tokens_per_second
        mfu = f"{100 * flops_per_token * tokens_per_second / peak:6.1f}%" if peak else "    n/a"
        memory = "      n/a"
        if device.type == "cuda":
            memory = f"{(torch.cuda.max_memory_allocated(device) - memory_before) / 2**30:9.2f}"
        print(
            f"{name:42s} {tokens_per_second:10.0f} {1000 * step:9.1f} {mfu} {memory} "
            f"{tokens_per_second / baseline:8.3f}x"
        )


def _release_earlier_runs(device: torch.device) -> int:
    """Free what earlier runs left (compiled graphs hold their models); the bytes still allocated, so that each run's
    peak is its own."""
    gc.collect()
    torch.compiler.reset()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _meta_model(config) -> LlamaModel:
    with torch.device("meta"):
        return LlamaModel(config)


if __name__ == "__main__":
    main()
