"""``lightdist verify``: a config's layout against one process, on CPU ranks, before a GPU hour is spent on it.

    lightdist verify --config configs/3d.yaml
    lightdist verify --config my.yaml --steps 6 --model.init_args.config.num_hidden_layers=4

It trains the config's module a few steps twice, from the same seed on the same batches: once in the config's layout
on CPU ranks (gloo, fp32), once in one process, and prints each optimizer step's loss and gradient norm side by side:
equal, or the first step where they differ and by how much. The module is shrunk first where lightdist knows how: a
reference model's preset becomes ``tiny``, a Hugging Face config's layers, width and heads small (as many layers as
the pipeline has stages, heads that the tensor- and context-parallel sizes divide). Any other module trains as
configured, and ``--model.init_args.NAME=VALUE`` (LightningCLI's syntax) shrinks it. ``data_parallel_size="auto"``
becomes 2 data-parallel ranks where the rest leaves room on 8 ranks.

Both runs draw the same global batches: each data-parallel rank takes its batches in the data module's own order, dealt
as a distributed sampler deals them without shuffling, and the one process takes every rank's batches of a step at
once (and every batch of an accumulation, where batches weigh by their tokens: ``loss_weighting``). Checkpoints,
loggers and validation are left out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from lightdist.layout import ParallelLayout
from lightdist.plugins.monitor import gradient_norm

__all__ = ["ShardedOrder", "StepRecord", "compare", "main", "verification_config"]

RANKS = 8  # the most CPU ranks a verification starts
_HF_SIZES = {  # a Hugging Face config's names for each size, by family, and the small value each gets
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "width": ("hidden_size", "n_embd", "d_model"),
    "ffn": ("intermediate_size", "ffn_dim", "n_inner"),
}


def verification_config(config: dict[str, Any], steps: int) -> tuple[dict[str, Any], ParallelLayout, list[str]]:
    """``config`` (a LightningCLI config) made for a verification of ``steps`` optimizer steps: its sizes resolved for
    CPU ranks, its module shrunk where lightdist knows how, its data small. Returns it, the layout it runs, and what
    was changed, to print."""
    config, notes = copy.deepcopy(config), []
    trainer = config.setdefault("trainer", {})
    strategy = (trainer.get("strategy") or {}).get("init_args", {})
    sizes = {name: _size(strategy, name) for name in ("tensor_parallel_size", "pipeline_parallel_size")}
    sizes["context_parallel_size"] = strategy.get("context_parallel_size", 1)
    tp, pp, cp = sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"], sizes["context_parallel_size"]
    dp = strategy.get("data_parallel_size", "auto")
    if dp == "auto":
        dp = max(2 if tp * pp * cp * 2 <= RANKS else 1, strategy.get("expert_parallel_size", 1))
        notes.append(f"data_parallel_size='auto' runs as {dp}")
    interleaved = strategy.get("pipeline_schedule") in ("interleaved_1f1b", "zero_bubble")
    stages = pp * (strategy.get("virtual_stages") or (2 if interleaved else 1))
    kept = {key: value for key, value in strategy.items() if key not in ("async_checkpoint", "storage_options")}
    layout = ParallelLayout(pp=pp, dp=dp, tp=tp, cp=cp)
    trainer.update(
        accelerator="cpu",
        devices=layout.world_size,
        num_nodes=1,
        precision="32-true",
        max_steps=steps,
        max_epochs=None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        val_check_interval=None,
        logger=False,
        callbacks=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        strategy={
            "class_path": "lightdist.plugins.ParallelStrategy",
            "init_args": {**kept, **sizes, "data_parallel_size": dp, "async_checkpoint": None},
        },
    )
    config.pop("ckpt_path", None)
    config.setdefault("seed_everything", 1234)
    data = config.get("data") or {}
    arithmetic = _is_token_data(data) and not data.get("init_args", {}).get("data_path")
    heads = math.lcm(4, tp * cp)
    notes += _shrink_model(
        config["model"], layers=max(stages, 2), heads=heads, kv_heads=max(tp, 2), vocab=64 if arithmetic else None
    )
    notes += _shrink_data(data, batch=max(2, strategy.get("microbatches") or pp), seq_len=32 * cp)
    return config, layout, notes


def _size(strategy: dict[str, Any], name: str) -> int:
    size = strategy.get(name, 1)
    if size == "node":
        return 2
    if not isinstance(size, int):
        raise ValueError(
            f"lightdist verify runs the layout as given, but {name}={size!r}: give it a number "
            f"(--trainer.strategy.init_args.{name}=2)."
        )
    return size


def _shrink_model(model: dict[str, Any], *, layers: int, heads: int, kv_heads: int, vocab: int | None) -> list[str]:
    """Make ``model`` (its config's ``class_path`` and ``init_args``) small where lightdist knows its sizes; its
    vocabulary ``vocab`` words where the data's ids are that few."""
    init_args = model.setdefault("init_args", {})
    if init_args.get("pretrained"):
        return [
            f"{model['class_path']} starts from {init_args['pretrained']}, which is verified as it is; give it a "
            "small config instead (--model.init_args.pretrained=null --model.init_args.config=...) to shrink it"
        ]
    hf = init_args.get("config")
    if isinstance(hf, dict) and "model_type" in hf:
        small = {"layers": layers, "heads": heads, "width": 16 * heads, "ffn": 32 * heads}
        for size, names in _HF_SIZES.items():
            for name in names:
                if name in hf:
                    hf[name] = small[size]
        if "num_key_value_heads" in hf:
            hf["num_key_value_heads"] = min(kv_heads, heads)
        if "head_dim" in hf:
            hf["head_dim"] = 16
        if vocab is not None and "vocab_size" in hf:
            hf["vocab_size"] = vocab
        return [f"{hf['model_type']} shrunk to {layers} layers of width {16 * heads} with {heads} heads"]
    module = _class(model["class_path"])
    presets = getattr(module, "presets", None)
    if isinstance(presets, dict) and "tiny" in presets:
        fields = {field.name for field in dataclasses.fields(presets["tiny"])}
        tiny = presets["tiny"]
        wanted = {"n_layers": layers, "n_layer": layers, "n_heads": heads, "n_head": heads, "n_kv_heads": kv_heads}
        overrides = {name: value for name, value in wanted.items() if name in fields and getattr(tiny, name) < value}
        for width in ("dim", "n_embd"):
            if overrides and width in fields:
                overrides[width] = max(getattr(tiny, width), 16 * heads)
        init_args["preset"], init_args["config"] = "tiny", {**(init_args.get("config") or {}), **overrides}
        return [f"{module.__name__} as its tiny preset" + (f", with {overrides}" if overrides else "")]
    return [
        f"{module.__name__} is verified as configured: shrink it with --model.init_args.NAME=VALUE where it is large"
    ]


def _is_token_data(data: dict[str, Any]) -> bool:
    return data.get("class_path", "").rsplit(".", 1)[-1] == "TokenDataModule"


def _shrink_data(data: dict[str, Any], *, batch: int, seq_len: int) -> list[str]:
    """Short windows of lightdist's ``TokenDataModule``, ``batch`` to each data-parallel rank; other data as it is."""
    if not _is_token_data(data):
        return []
    init_args = data.setdefault("init_args", {})
    init_args.pop("global_batch_size", None)
    init_args.update(batch_size=batch, seq_len=seq_len, shuffle=False, num_workers=0)
    return [f"TokenDataModule windows of {seq_len} tokens, {batch} to each data-parallel rank"]


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class ShardedOrder(Sampler[list[int]]):
    """The batches of ``batch_size`` that ``ranks`` data-parallel ranks' distributed samplers deal, joined: a single
    process draws a parallel run's global batches in its order (``shuffle``: shuffled as Lightning's sampler shuffles
    training data, from the seed ``PL_GLOBAL_SEED`` holds, as it does)."""

    def __init__(self, dataset: Dataset, ranks: int, batch_size: int, *, shuffle: bool) -> None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.samplers = [DistributedSampler(dataset, ranks, rank, shuffle=shuffle, seed=seed) for rank in range(ranks)]
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        shards = [list(sampler) for sampler in self.samplers]
        for start in range(0, len(shards[0]), self.batch_size):
            yield [index for shard in shards for index in shard[start : start + self.batch_size]]

    def __len__(self) -> int:
        return -(-len(self.samplers[0]) // self.batch_size)

    @property
    def sampler(self) -> ShardedOrder:
        """Lightning sets the epoch of a batch sampler's ``sampler`` only, not of the batch sampler: this one."""
        return self

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)


class _Dealt(LightningDataModule):
    """``data``'s training batches as a verification deals them: each data-parallel rank its share of the dataset in
    order, or in one process, ``ranks`` ranks' batches (``at_once`` of each) joined into one."""

    def __init__(self, data: LightningDataModule, ranks: int | None = None, at_once: int = 1) -> None:
        super().__init__()
        self.data, self.ranks, self.at_once = data, ranks, at_once

    def prepare_data(self) -> None:
        self.data.prepare_data()

    def setup(self, stage: str) -> None:
        self.data.trainer = self.trainer
        self.data.setup(stage)

    def train_dataloader(self) -> DataLoader:
        loader = self.data.train_dataloader()
        dataset, collate = loader.dataset, loader.collate_fn
        if self.ranks is None:
            sharding = self.trainer.strategy.distributed_sampler_kwargs
            order = DistributedSampler(dataset, shuffle=False, drop_last=True, **sharding)
            return DataLoader(dataset, batch_size=loader.batch_size, sampler=order, collate_fn=collate, drop_last=True)
        order = ShardedOrder(dataset, self.ranks, loader.batch_size * self.at_once, shuffle=False)
        return DataLoader(dataset, batch_sampler=order, collate_fn=collate)


class StepRecord(Callback):
    """Writes to ``path`` (JSON), from global rank 0, each optimizer step's losses (one per batch, the mean over the
    data-parallel ranks) and the whole model's gradient norm before clipping."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[dict[str, Any]] = []
        self._losses: list[float] = []
        self._norm: float | None = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._norm = gradient_norm(trainer, optimizer).item()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *args: Any) -> None:
        self._losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())
        if self._norm is not None:  # the optimizer stepped after this batch
            self.steps.append({"losses": self._losses, "grad_norm": self._norm})
            self._losses, self._norm = [], None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.steps))


def compare(parallel: list[dict[str, Any]], single: list[dict[str, Any]], rtol: float) -> tuple[str, bool]:
    """A line per optimizer step, the layout's numbers beside one process's, and whether every one is within
    ``rtol``. Losses are compared where both runs have one per batch (one process steps on an accumulation's batches
    at once where batches weigh by their tokens)."""
    lines, equal = ["step  loss (layout / one process)        gradient norm (layout / one process)  "], True
    for index, (ours, theirs) in enumerate(zip(parallel, single, strict=True)):
        gaps = [_gap(ours["grad_norm"], theirs["grad_norm"])]
        losses = "per batch: not compared"
        if len(ours["losses"]) == len(theirs["losses"]):
            gaps += [_gap(a, b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)]
            losses = f"{ours['losses'][-1]:.6f} / {theirs['losses'][-1]:.6f}"
        gap = max(gaps)
        verdict = "equal" if gap <= rtol else f"DIFFERS by {gap:.1e}"
        if gap > rtol and equal:
            verdict += " (first)"
        equal = equal and gap <= rtol
        norms = f"{ours['grad_norm']:.6f} / {theirs['grad_norm']:.6f}"
        lines.append(f"{index + 1:>4}  {losses:<34}{norms:<38}{verdict}")
    return "\n".join(lines), equal


def _gap(value: float, expected: float) -> float:
    return abs(value - expected) / max(abs(expected), 1e-12) if math.isfinite(value) else math.inf


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightdist verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="a LightningCLI config, as `lightdist fit` takes")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps each run trains (default 4)")
    parser.add_argument("--rtol", type=float, default=1e-5, help="the relative difference that counts as equal")
    # A run's own process: which run, and how the one process is dealt the layout's batches
    parser.add_argument("--run", choices=["layout", "one_process"], help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--at-once", type=int, default=1, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.run is not None:
        _train(args.config, args.run, args.ranks, args.at_once)
        return
    config = yaml.safe_load(args.config.read_text())
    for override in overrides:
        _set(config, override, parser)
    config, layout, notes = verification_config(config, args.steps)
    with tempfile.TemporaryDirectory(prefix="lightdist-verify-") as folder:
        runs = {}
        for run in ("layout", "one_process"):  # side by side: the one process on the cores the ranks leave idle
            plan = Path(folder) / f"{run}.yaml"
            run_config, dealt = _as_run(config, run, Path(folder) / f"{run}.json")
            plan.write_text(yaml.safe_dump(run_config))
            runs[run] = subprocess.Popen(
                [sys.executable, "-m", "lightdist.cli", "verify", "--config", str(plan), "--run", run, *dealt],
                cwd=folder,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        printed = {run: process.communicate()[0] for run, process in runs.items()}
        failed = [run for run, process in runs.items() if process.returncode != 0]
        if failed:
            sys.exit(f"lightdist verify: the {failed[0]} run failed:\n{printed[failed[0]][-4000:]}")
        records = {run: json.loads((Path(folder) / f"{run}.json").read_text()) for run in runs}
    print(
        f"lightdist verify: {args.config} as {layout} on {layout.world_size} CPU ranks against one process, "
        f"{args.steps} steps"
    )
    for note in notes:
        print(f"  {note}")
    table, equal = compare(records["layout"], records["one_process"], args.rtol)
    print(table)
    if not equal:
        sys.exit(
            "lightdist verify: the layout trains differently from one process. Find the first step that differs "
            "above; docs/correctness.md#check-your-own-code says what to look for."
        )
    print(f"Equal within {args.rtol:.0e} at every step.")


def _set(config: dict[str, Any], override: str, parser: argparse.ArgumentParser) -> None:
    """``--a.b.c=value`` (LightningCLI's form) sets ``config["a"]["b"]["c"]`` to the YAML value."""
    if not override.startswith("--") or "=" not in override:
        parser.error(f"{override}: give overrides as --model.init_args.NAME=VALUE")
    path, value = override[2:].split("=", 1)
    *parents, leaf = path.split(".")
    for name in parents:
        config = config.setdefault(name, {})
    config[leaf] = yaml.safe_load(value)


def _as_run(config: dict[str, Any], run: str, record: Path) -> tuple[dict[str, Any], list[str]]:
    """The config of one run, and how its batches are dealt (``--ranks``, ``--at-once``): the layout as verified, or
    one process stepping on the layout's global batches, an accumulation's at once where batches weigh by tokens."""
    config = copy.deepcopy(config)
    trainer = config["trainer"]
    trainer["callbacks"] = [{"class_path": "lightdist.verify.StepRecord", "init_args": {"path": str(record)}}]
    if run == "layout":
        return config, []
    strategy = trainer["strategy"]["init_args"]
    accumulate = trainer.get("accumulate_grad_batches", 1)
    at_once = accumulate if strategy.get("loss_weighting", "tokens") == "tokens" else 1
    trainer.update(strategy="auto", devices=1, accumulate_grad_batches=accumulate // at_once)
    return config, ["--ranks", str(strategy["data_parallel_size"]), "--at-once", str(at_once)]


def _train(config_path: Path, run: str, ranks: int | None, at_once: int) -> None:
    """One run of a verification, in this process (the layout's rank 0 starts the other ranks, as ``lightdist fit``
    does)."""
    from lightning.pytorch.cli import LightningCLI

    import lightdist.plugins  # noqa: F401  (the strategy names)

    cli = LightningCLI(args=yaml.safe_load(config_path.read_text()), run=False, save_config_callback=None)
    cli.trainer.fit(cli.model, datamodule=_Dealt(cli.datamodule, ranks, at_once))
