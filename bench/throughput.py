"""Training throughput on one device, several ways, in one process so that the ratios are fair.

The reference Llama (``--preset``):

- ``plain``: a hand-written loop (autocast, cross-entropy, fused AdamW, nothing else);
- ``plain-compile``: that loop around ``torch.compile(model)``, what a user of plain PyTorch writes for speed;
- ``torchtitan``: that loop with torchtitan's recipe: each block compiled, then FSDP2 per block and on the root over
  one rank, bf16 from the parameters FSDP2 gathers (``MixedPrecisionPolicy``) in place of autocast (torchtitan
  itself, on one GPU, shards nothing and runs autocast: this is its recipe for sharded runs, on one rank);
- ``lightning``: Lightning's own ``ModelParallelStrategy`` with FSDP2 applied per block in ``configure_model``;
- ``lightdist``: lightdist's ``ParallelStrategy`` (ZeRO-3, FSDP2 per block), the model unchanged;
- ``lightdist-compile``: the same with ``compile=True`` (each block compiled, torchtitan's way);
- ``lightdist-offload``: the same with ``cpu_offload=True`` (parameters, gradients and AdamW in CPU memory).

Levers measured here before the library takes them, each the ``lightdist-compile`` run with one change:

- ``lightdist-compile-no-autocast``: bf16 from FSDP2's gathered parameters alone, as torchtitan does, without
  autocast's per-op casts (a precision plugin of this bench that enters no autocast);
- ``lightdist-compile-zero2``: ``zero_stage=2``: each block's parameters, gathered (cast to bf16) for its forward,
  kept for its backward rather than gathered again; on one device resharding saves only the bf16 copies' memory.

transformers' ``LlamaForCausalLM`` in the same shape, in a LightningModule written as its users write one (the loss
the model computes from ``labels``, ``AdamW(self.parameters())``):

- ``hf-plain``, ``hf-plain-compile``: the hand-written loop, eager and around ``torch.compile(model)``;
- ``hf-lightdist``, ``hf-lightdist-compile``: ``ParallelStrategy(zero_stage=3)``, without and with ``compile=True``.

The hand-written loop steps fused AdamW (on GPUs) whatever the model; the Lightning runs step the module's own
optimizer: the reference Llama's fused AdamW, the Hugging Face module's AdamW with torch's defaults.

    python bench/throughput.py --preset 1b --batch-size 4 --seq-len 2048 --precision bf16-mixed   # one GPU
    python bench/throughput.py --preset small --batch-size 4 --seq-len 256 --runs plain lightning lightdist  # CPU

Prints tokens/s, step time, MFU (6N + attention FLOPs per token over the device's bf16 peak) and peak memory; a run
that raises prints its error in its row (the traceback on stderr) and the next one runs. ``--profile FILE`` writes
the operators of one timed step of each of ``--profile-runs``, by device time.
"""

from __future__ import annotations

import argparse
import gc
import signal
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from functools import partial

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset

from lightdist.models import Llama
from lightdist.models.llama import LLAMA_PRESETS, LlamaModel
from lightdist.plan.throughput import DecoderFlops, device_peak_flops
from lightdist.plugins import ParallelStrategy

# A run's arguments: the options, the device, the data, and where one timed step of it is profiled, if it is:
# ``profile(device)`` is the context to run that step in. It returns each step's seconds.
Profile = Callable[[torch.device], AbstractContextManager]
Run = Callable[[argparse.Namespace, torch.device, Dataset, Profile | None], list[float]]


class RandomTokens(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab_size, (length, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class HuggingFaceLlama(LightningModule):
    """transformers' ``LlamaForCausalLM`` in the shape of the reference Llama's ``preset``, as its users write the
    LightningModule: the loss the model computes from ``labels``, AdamW over ``self.parameters()`` with torch's
    defaults. ``loss`` is what the hand-written loop calls, as it calls the reference Llama's."""

    def __init__(self, preset: str, learning_rate: float = 1e-4) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM  # here, so that without transformers only these fail

        self.learning_rate = learning_rate
        config = LLAMA_PRESETS[preset]
        self.model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=config.vocab_size,
                hidden_size=config.dim,
                intermediate_size=config.ffn_dim,
                num_hidden_layers=config.n_layers,
                num_attention_heads=config.n_heads,
                num_key_value_heads=config.num_kv_heads,
                max_position_embeddings=config.max_seq_len,
                rms_norm_eps=config.norm_eps,
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                tie_word_embeddings=config.tie_embeddings,
                attn_implementation="sdpa",
            )
        )

    def loss(self, batch: Tensor) -> Tensor:
        tokens = batch[:, :-1]  # the model shifts the labels itself
        return self.model(input_ids=tokens, labels=tokens).loss

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class LlamaWithFSDP2(Llama):
    """What a Lightning user writes today for ``ModelParallelStrategy``: FSDP2 by hand in ``configure_model``."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class WithoutAutocast(Precision):
    """bf16 compute from the parameters FSDP2 gathers in bf16 alone: lightdist reads the compute dtype from
    ``precision``, and this plugin, unlike Lightning's ``bf16-mixed``, enters no autocast around the steps."""

    precision = "bf16-mixed"


class StepTimer(Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _synchronize(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _synchronize(pl_module.device)
        self.seconds.append(time.perf_counter() - self._start)


class ProfileOneStep(Callback):
    """``profile`` around step ``step`` of a Lightning run."""

    def __init__(self, step: int, profile: Profile) -> None:
        self.step, self.profile = step, profile
        self._profile = ExitStack()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.step:
            self._profile.enter_context(self.profile(pl_module.device))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.step:
            _synchronize(pl_module.device)
            self._profile.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._profile.close()  # a step that raised must not leave the profiler running through the next runs


@contextmanager
def profiled(path: str, name: str, device: torch.device) -> Iterator[None]:
    """torch.profiler around the block, which ends with the device synchronized; the block's operators by device time
    (CPU time on CPU) are added to the file ``path`` under the heading ``name``."""
    with torch.profiler.profile() as profiler:
        yield
    order = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "a") as file:
        file.write(f"== {name}\n")
        file.write(profiler.key_averages().table(sort_by=order, row_limit=40, max_name_column_width=70))
        file.write("\n\n")


def plain_loop(
    args: argparse.Namespace,
    device: torch.device,
    data: Dataset,
    profile: Profile | None,
    *,
    model: Callable[[str], LightningModule],
    prepare: Callable[[nn.Module, torch.device, str], object] | None = None,
    autocast: bool = True,
) -> list[float]:
    """A hand-written loop over ``model(preset).loss``, after ``prepare(network, device, precision)`` of the module's
    ``model``. bf16-mixed runs under autocast unless ``autocast=False`` (then ``prepare`` gives the precision). The
    module is built on the device, as ``Trainer.init_module`` builds the Lightning runs': 1B parameters initialize
    in seconds on the CPU, of a time limit that compiling needs."""
    seed_everything(0)
    with torch.device(device):
        module = model(args.preset)
    if prepare is not None:
        prepare(module.model, device, args.precision)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    mixed = autocast and args.precision == "bf16-mixed"
    seconds = []
    for step, batch in enumerate(DataLoader(data, batch_size=args.batch_size)):
        batch = batch.to(device)
        with profile(device) if profile and step == args.warmup else nullcontext():
            _synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16) if mixed else nullcontext():
                loss = module.loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
    return seconds


def compile_whole(network: nn.Module, device: torch.device, precision: str) -> None:
    """``torch.compile(model)``: the whole network, with the loss where the model computes it (Hugging Face's)."""
    network.compile()


def torchtitan_recipe(network: nn.Module, device: torch.device, precision: str) -> None:
    """torchtitan's: each block ``torch.compile``d, then FSDP2 per block and on the root (here over one rank), whose
    hooks stay outside the compiled graphs; parameters gathered in bf16 under bf16-mixed, gradients reduced in fp32
    into fp32 master weights."""
    mesh = _one_rank_mesh(device)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None, reduce_dtype=torch.float32
    )
    for name, block in network.layers.named_children():
        network.layers.register_module(name, torch.compile(block))
    for block in network.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(network, mesh=mesh, mp_policy=policy)


def _one_rank_mesh(device: torch.device) -> DeviceMesh:
    """FSDP2 shards over a process group, also alone. Where no earlier run started one, one of this process alone,
    its rank met in an in-memory store (no port to find); the Lightning runs after it take it as theirs."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, (1,))


def lightning_trainer(
    model: Callable[[str], LightningModule],
    strategy: Callable[[], object],
    precision: type[Precision] | None = None,
) -> Run:
    """A run of ``Trainer.fit``, the module built as ``Trainer.init_module`` builds it; ``precision`` replaces the
    plugin that ``--precision`` picks."""

    def run(args: argparse.Namespace, device: torch.device, data: Dataset, profile: Profile | None) -> list[float]:
        seed_everything(0)
        timer = StepTimer()
        profiler = [ProfileOneStep(args.warmup, profile)] if profile else []
        trainer = Trainer(
            accelerator=device.type,
            devices=1,
            strategy=strategy(),
            **({"plugins": [precision()]} if precision else {"precision": args.precision}),
            max_steps=args.steps,
            callbacks=[timer, *profiler],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with trainer.init_module():
            module = model(args.preset)
        trainer.fit(module, DataLoader(data, batch_size=args.batch_size))
        return timer.seconds

    return run


RUNS: dict[str, tuple[str, Run]] = {  # option name: (printed name, run)
    "plain": ("plain PyTorch", partial(plain_loop, model=Llama)),
    "plain-compile": ("plain PyTorch + torch.compile", partial(plain_loop, model=Llama, prepare=compile_whole)),
    "torchtitan": (
        "torchtitan's recipe (FSDP2 mixed precision, compiled blocks)",
        partial(plain_loop, model=Llama, prepare=torchtitan_recipe, autocast=False),
    ),
    "lightning": (
        "Lightning ModelParallelStrategy (FSDP2)",
        lightning_trainer(LlamaWithFSDP2, lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)),
    ),
    "lightdist": (
        "lightdist ParallelStrategy (ZeRO-3)",
        lightning_trainer(Llama, partial(ParallelStrategy, zero_stage=3)),
    ),
    "lightdist-compile": (
        "lightdist ParallelStrategy (ZeRO-3, compile)",
        lightning_trainer(Llama, partial(ParallelStrategy, zero_stage=3, compile=True)),
    ),
    "lightdist-compile-no-autocast": (
        "lightdist (ZeRO-3, compile, bf16 params, no autocast)",
        lightning_trainer(Llama, partial(ParallelStrategy, zero_stage=3, compile=True), precision=WithoutAutocast),
    ),
    "lightdist-compile-zero2": (
        "lightdist (ZeRO-2, compile)",
        lightning_trainer(Llama, partial(ParallelStrategy, zero_stage=2, compile=True)),
    ),
    "lightdist-offload": (
        "lightdist ParallelStrategy (ZeRO-3, cpu_offload)",
        lightning_trainer(Llama, partial(ParallelStrategy, zero_stage=3, cpu_offload=True)),
    ),
    "hf-plain": ("HF Llama: plain PyTorch", partial(plain_loop, model=HuggingFaceLlama)),
    "hf-plain-compile": (
        "HF Llama: plain PyTorch + torch.compile",
        partial(plain_loop, model=HuggingFaceLlama, prepare=compile_whole),
    ),
    "hf-lightdist": (
        "HF Llama: lightdist (ZeRO-3)",
        lightning_trainer(HuggingFaceLlama, partial(ParallelStrategy, zero_stage=3)),
    ),
    "hf-lightdist-compile": (
        "HF Llama: lightdist (ZeRO-3, compile)",
        lightning_trainer(HuggingFaceLlama, partial(ParallelStrategy, zero_stage=3, compile=True)),
    ),
}
NAME_WIDTH = max(len(name) for name, _ in RUNS.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=list(LLAMA_PRESETS))
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak, if not in the table")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which, in this order")
    parser.add_argument("--run-timeout", type=int, default=None, help="seconds a run may take, compiling included")
    parser.add_argument("--profile", default=None, help="file for the operators of one step of each profiled run")
    parser.add_argument("--profile-runs", nargs="+", choices=list(RUNS), default=["lightdist", "lightdist-compile"])
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup} to leave timed steps.")
    if args.profile:
        open(args.profile, "w").close()  # each profiled run adds its table

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LLAMA_PRESETS[args.preset]
    data = RandomTokens(config.vocab_size, args.seq_len, args.steps * args.batch_size)
    flops_per_token = DecoderFlops.of(_meta_model(config), n_layers=config.n_layers, dim=config.dim).per_token(
        args.seq_len
    )
    peak = device_peak_flops(device, args.peak_tflops)
    tokens_per_step = args.batch_size * args.seq_len
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"Llama {args.preset}, batch {args.batch_size} x {args.seq_len}, {args.precision}, on {device_name}")
    print(f"{'run':{NAME_WIDTH}s} {'tokens/s':>10s} {'step ms':>9s} {'MFU':>7s} {'peak GiB':>9s} {'vs first':>9s}")
    baseline = None
    for key in args.runs:
        name, run = RUNS[key]
        memory_before = _release_earlier_runs(device)
        profile = partial(profiled, args.profile, name) if args.profile and key in args.profile_runs else None
        try:
            with _time_limit(args.run_timeout):
                seconds = run(args, device, data, profile)
        except Exception as error:
            traceback.print_exc()
            message = " ".join(str(error).split())[:200]
            print(f"{name:{NAME_WIDTH}s} failed: {type(error).__name__}: {message}")
            continue
        step = statistics.median(seconds[args.warmup :])
        tokens_per_second = tokens_per_step / step
        baseline = baseline or tokens_per_second
        mfu = f"{100 * flops_per_token * tokens_per_second / peak:6.1f}%" if peak else "    n/a"
        memory = "      n/a"
        if device.type == "cuda":
            memory = f"{(torch.cuda.max_memory_allocated(device) - memory_before) / 2**30:9.2f}"
        print(
            f"{name:{NAME_WIDTH}s} {tokens_per_second:10.0f} {1000 * step:9.1f} {mfu} {memory} "
            f"{tokens_per_second / baseline:8.3f}x"
        )


@contextmanager
def _time_limit(seconds: int | None) -> Iterator[None]:
    """Raise ``TimeoutError`` in the block after ``seconds``, and again every 10 s while it runs, since compilers catch
    exceptions where they fall back: a run that compiles for too long leaves the time of the runs after it. (The
    signal lands between Python's bytecodes, which compiling mostly runs.)"""
    if seconds is None:
        yield
        return

    def expire(signum, frame) -> None:
        raise TimeoutError(f"over --run-timeout={seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 10)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _meta_model(config) -> LlamaModel:
    with torch.device("meta"):
        return LlamaModel(config)


if __name__ == "__main__":
    main()
