"""Starting from pretrained weights, three ways: seconds, bytes read and peak resident memory per rank.

A Llama (``--hidden``, ``--layers``, vocabulary 32,000; the default is 0.47B parameters, 1.9 GB in fp32) is saved by
``save_pretrained`` in 4 safetensors shards, then started under ``ParallelStrategy(zero_stage=3)`` on each
``--ranks`` count of CPU ranks, until validation starts (the model built, split and filled):

- ``lightdist``: ``HuggingFaceCausalLM(pretrained=URL)``, each rank reading its own shards' bytes, from local disk and
  from S3 (moto's server on 127.0.0.1);
- ``every rank``: ``from_pretrained`` in the module's ``__init__`` on every rank, as a LightningModule does it;
- ``rank 0 + broadcast``: ``from_pretrained`` on rank 0 alone, the other ranks on the meta device, the weights
  broadcast once split (torch's ``set_model_state_dict(broadcast_from_rank0=True)``, as accelerate's
  ``cpu_ram_efficient_loading`` does).

Resident memory is each rank's growth from before the module is built, sampled every millisecond; the table shows the
largest over ranks. Bytes read are lightdist's own count per rank; the other two read whole files (the model per rank,
or on rank 0).

    python bench/pretrained_load.py                       # 1, 2 and 4 ranks
    python bench/pretrained_load.py --hidden 512 --layers 2 --ranks 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp
import transformers
from fsspec.core import url_to_fs
from lightning.pytorch import Callback, LightningModule, Trainer
from ranks import free_port, join_ranks, local_s3
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.utils.data import DataLoader

from lightdist.checkpoint.pretrained import parameters_on_meta
from lightdist.models import HuggingFaceCausalLM
from lightdist.plugins import ParallelStrategy

WAYS = ("lightdist", "every rank", "rank 0 + broadcast")


class _FromPretrained(LightningModule):
    """A module holding ``from_pretrained``'s model: on every rank, or on rank 0 with the others on meta."""

    def __init__(self, directory: str, *, on_this_rank: bool) -> None:
        super().__init__()
        if on_this_rank:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
            self.model.train()
        else:
            config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
            with parameters_on_meta():
                self.model = transformers.AutoModelForCausalLM.from_config(config)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.model(input_ids=batch)


class _Started(Callback):
    """Samples the process's resident memory until validation starts; there, broadcasts rank 0's weights if given."""

    def __init__(self, broadcast: dict[str, torch.Tensor] | None) -> None:
        self.broadcast, self.peak, self.sampling = broadcast, 0, True
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        process = psutil.Process()
        while self.sampling:
            self.peak = max(self.peak, process.memory_info().rss)
            time.sleep(0.001)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.broadcast is not None:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(pl_module, self.broadcast, options=options)
        self.sampling = False
        self.sampler.join()


def _start(way: str, url: str, directory: str, ranks: int) -> tuple[float, float, float]:
    """Seconds to a started model, this rank's resident growth in GiB, and the GiB lightdist read."""
    trainer = Trainer(
        accelerator="cpu", devices=ranks, strategy=ParallelStrategy(zero_stage=3), logger=False, limit_val_batches=1
    )
    gc.collect()
    before, began = psutil.Process().memory_info().rss, time.perf_counter()
    rank = trainer.global_rank
    if way == "lightdist":
        started, module = _Started(None), HuggingFaceCausalLM(pretrained=url)
    else:
        module = _FromPretrained(directory, on_this_rank=way == "every rank" or rank == 0)
        whole = {f"model.{name}": tensor for name, tensor in module.model.state_dict().items()}
        started = _Started(whole if way == "rank 0 + broadcast" else None)
    trainer.callbacks.append(started)
    trainer.validate(module, DataLoader(torch.zeros(4, 16, dtype=torch.long), batch_size=4), verbose=False)
    load = trainer.strategy.pretrained_load
    return time.perf_counter() - began, (started.peak - before) / 2**30, load.bytes_read / 2**30 if load else 0.0


def _rank(rank: int, ranks: int, port: int, way: str, url: str, directory: str, results: mp.Queue) -> None:
    join_ranks(rank, ranks, port)
    results.put((rank, _start(way, url, directory, ranks)))


def _run(way: str, url: str, directory: str, ranks: int) -> list[tuple[float, float, float]]:
    """One start in fresh processes, so that no run inherits another's freed memory."""
    results = mp.get_context("spawn").Queue()
    port = free_port()
    processes = [
        mp.get_context("spawn").Process(target=_rank, args=(rank, ranks, port, way, url, directory, results))
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    measured = dict(results.get(timeout=1800) for _ in processes)
    for process in processes:
        process.join()
    return [measured[rank] for rank in range(ranks)]


def _save(directory: Path, hidden: int, layers: int) -> int:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama",
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    size = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    model.save_pretrained(directory, max_shard_size=size // 4 + 1)
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "checkpoint"
        size = _save(directory, args.hidden, args.layers)
        print(f"model: {size / 2**30:.2f} GiB in fp32, {len(list(directory.glob('*.safetensors')))} shards")
        with contextlib.ExitStack() as stack:
            s3_url = None
            if not args.no_s3:
                s3_url = f"{stack.enter_context(local_s3('bench'))}/checkpoint"
                s3, path = url_to_fs(s3_url)
                s3.put(str(directory), path, recursive=True)
            print(f"{'ranks':>5}  {'way':<20} {'from':<6} {'seconds':>8} {'peak GiB/rank':>14} {'read GiB/rank':>14}")
            for ranks in args.ranks:
                for way, source, url in [
                    ("lightdist", "local", str(directory)),
                    *([("lightdist", "s3", s3_url)] if s3_url else []),
                    ("every rank", "local", str(directory)),
                    ("rank 0 + broadcast", "local", str(directory)),
                ]:
                    if way == "rank 0 + broadcast" and ranks == 1:
                        continue
                    measured = _run(way, url, str(directory), ranks)
                    seconds = max(run[0] for run in measured)
                    peak = max(run[1] for run in measured)
                    read = max(run[2] for run in measured)
                    read_text = f"{read:.2f}" if way == "lightdist" else "whole files"
                    print(
                        f"{ranks:>5}  {way:<20} {source:<6} {seconds:>8.1f} {peak:>14.2f} {read_text:>14}", flush=True
                    )


if __name__ == "__main__":
    main()
