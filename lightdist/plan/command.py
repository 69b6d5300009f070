"""``lightdist plan``: how a model splits, what each layout costs per GPU, and which to use, before any memory is spent.

The model is built on the meta device, so a 70B model plans in seconds on a laptop.

    lightdist plan --model lightdist.models.Llama --init-args '{"preset": "70b"}' --gpus 64 --gpu-memory 80
    lightdist plan --model lightdist.models.Llama --init-args '{"preset": "70b"}' --tp 8
    lightdist plan --config configs/3d_cpu.yaml
    lightdist plan --model lightdist.models.Llama --init-args '{"preset": "70b"}' --gpus 64 --format csv > layouts.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightdist.checkpoint.pretrained import IN_FLIGHT_BYTES
from lightdist.parallel.layout_probe import probe_layouts
from lightdist.parallel.pipeline.schedules import stages_of_rank, virtual_stages_of
from lightdist.parallel.pipeline.structural import stage_costs, stage_sizes
from lightdist.parallel.structure import DecoderStack, find_decoder_stack
from lightdist.parallel.tensor import (
    TensorParallelStyle,
    check_divisible,
    discover_plan,
    replicated_key_values,
)
from lightdist.plan.planner import Cluster, Estimate, GiB, ModelShape, Training, plan_layouts, tensor_parallel_shape

__all__ = ["format_layouts", "format_plan", "format_stages", "layout_records", "main"]


def format_stages(
    model: nn.Module,
    pp: int,
    split: list[int] | None = None,
    *,
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
) -> str:
    """Which blocks each pipeline stage holds, and its parameters: the pipeline runs at its largest stage's pace.

    Under the interleaved and zero-bubble schedules each rank holds several stages; the rank is shown beside each.
    """
    stack = find_decoder_stack(model)
    virtual = virtual_stages_of(schedule, virtual_stages)
    sizes = split or stage_sizes(model, stack, pp * virtual)
    blocks, embeddings, rest = stage_costs(model, stack)
    header = f"{type(model).__name__}: {len(stack)} blocks in {stack.name}, pipeline_parallel_size={pp}"
    lines = [header + (f", virtual_stages={virtual} ({schedule})" if virtual > 1 else "")]
    rank_of = {s: r for r in range(pp) for s in stages_of_rank(r, pp, virtual)}
    start = 0
    for index, size in enumerate(sizes):
        params = sum(blocks[start : start + size])
        first, last = index == 0, index == len(sizes) - 1
        params += (embeddings if first else 0) + (rest if last else 0)
        ends = (" + embeddings" if first else "") + (" + norm and head" if last else "")
        held = f"{stack.name}.{start}" + (f"-{start + size - 1}" if size > 1 else "")
        stage = f"stage {index}" + (f" on rank {rank_of[index]}" if virtual > 1 else "")
        lines.append(f"  {stage}: {held}{ends}: {params:,} parameters")
        start += size
    return "\n".join(lines)


def format_plan(model: nn.Module, tp: int, tp_plan: dict[str, TensorParallelStyle] | None = None) -> str:
    """One line per module (blocks folded into ``*``): its style and its weight's shape, whole and per rank."""
    stack = find_decoder_stack(model)
    plan = discover_plan(model, stack, tp_plan=tp_plan)
    check_divisible(model, stack, plan, tp)
    layouts = _unit_layouts(model, stack, plan, tp)
    modules = dict(model.named_modules())
    # Fewer key/value heads than ranks: each rank holds the whole projection and uses its head.
    plan.update(dict.fromkeys(replicated_key_values(modules, plan, tp), "replicate"))
    block = re.compile(rf"^{re.escape(stack.name)}\.\d+\.")
    lines = {}
    for name, style in plan.items():
        weight = getattr(modules[name], "weight", None)
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()
        folded = block.sub(f"{stack.name}.*.", name)
        lines[folded] = f"  {folded:<48} {style:<10} {shape!s:>16} -> {tensor_parallel_shape(shape, style, tp)}"
    header = (
        f"{type(model).__name__}: {len(stack)} blocks in {stack.name}, tensor_parallel_size={tp}\n"
        f"  {'module':<48} {'style':<10} {'weight':>16} -> per rank"
    )
    return "\n".join([header, *lines.values(), *layouts])


def _unit_layouts(model: nn.Module, stack: DecoderStack, plan: dict[str, TensorParallelStyle], tp: int) -> list[str]:
    """How each attention and MLP module runs split (``lightdist.parallel.layout_probe``), checked in torch's fake
    process group on the meta device: by output shapes only, where the run compares numbers as well."""
    if dist.is_initialized():
        return []
    dist.init_process_group("fake", rank=0, world_size=tp)
    try:
        reasons: list[str] = []
        layouts = probe_layouts(model, stack, plan, init_device_mesh("cpu", (tp,)), report=reasons.append)
    finally:
        dist.destroy_process_group()
    where = [f"{stack.name}.*.{unit}" if unit else f"{stack.name}.*" for unit in layouts]
    return [
        f"  {'attention and MLP modules':<48} layout (run split on the meta device: shapes; a run checks numbers too)",
        *(f"  {name:<48} {layout}" for name, layout in zip(where, layouts.values(), strict=True)),
        *(f"  {reason.removeprefix('lightdist: ')}" for reason in reasons),
    ]


def format_layouts(shape: ModelShape, training: Training, cluster: Cluster, ep: int = 1) -> tuple[str, bool]:
    """A row per layout (memory of its most loaded GPU, in GiB, and its step time), then the one to use and why, or by
    how much nothing fits and what would; and whether something fits. ``ep``: the experts of a Mixture-of-Experts
    model split over that many data-parallel ranks."""
    plans = plan_layouts(shape, training, cluster, ep)
    active = f" ({shape.active_parameters / 1e9:.1f}B active per token)" if shape.experts is not None else ""
    header = (
        f"{shape.name}, {shape.parameters / 1e9:.1f}B parameters{active}, on {cluster.describe()}: "
        f"{training.global_batch} x {training.seq_len} tokens per step, {training.precision}"
    )
    if not plans:
        raise ValueError(
            f"No split of {cluster.gpus} GPUs into pp x dp x tp suits {shape.name}: tp must divide its heads and stay "
            f"inside a node of {cluster.gpus_per_node}, and dp must divide the global batch of "
            f"{training.global_batch} sequences. Change the GPU count or the global batch."
        )
    width = max(len(str(plan.layout)) for plan in plans)
    gib = " ".join(f"{name:>6}" for name in ("params", "grads", "optim", "activ", "total"))
    lines = [header, f"  {'layout':<{width}} {gib} fits step s", *(_layout_row(plan, width) for plan in plans)]
    lines.append(_pretrained_load(shape, cluster))
    best = plans[0]
    if best.fits:
        fitting = sum(plan.fits for plan in plans)
        lines.append(
            f"Recommended: {best.layout}: the shortest estimated step ({best.step_s:.2f} s) of the {fitting} layouts "
            f"that fit, with {best.total / GiB:.1f} of {cluster.memory_gib:g} GiB per GPU."
        )
    else:
        leanest = min(plans, key=lambda plan: plan.total)
        lines.append(
            f"Nothing fits: the leanest layout, {leanest.layout}, needs {leanest.total / GiB:.1f} GiB per GPU, "
            f"{(leanest.total / GiB - cluster.memory_gib):.1f} GiB more than {cluster.memory_gib:g}. "
            + _what_would_fit(shape, training, cluster, leanest, ep)
        )
    return "\n".join(lines), best.fits


def _pretrained_load(shape: ModelShape, cluster: Cluster) -> str:
    """Host memory per rank while a run starts from pretrained weights, beside ``from_pretrained`` on every rank: the
    load reads byte ranges straight into the GPUs' shards, which the table already counts."""
    whole, in_flight = 2 * shape.parameters, IN_FLIGHT_BYTES / 2**20  # bf16, as checkpoints are published
    return (
        f"Starting from pretrained weights (pretrained=): host memory per rank about {in_flight:.0f} MiB, "
        f"the ranges read at a time into each GPU's shards (with cpu_offload, its shards too); from_pretrained on "
        f"every rank holds {whole / GiB:.1f} GiB per rank, {whole * cluster.gpus_per_node / GiB:.0f} GiB a node."
    )


def layout_records(shape: ModelShape, training: Training, cluster: Cluster, ep: int = 1) -> list[dict[str, object]]:
    """The layouts table as records, the recommended layout first, for comparing layouts in a notebook: GiB per GPU
    on the most loaded GPU, and seconds per step."""
    plans = plan_layouts(shape, training, cluster, ep)
    return [
        {
            "layout": str(plan.layout),
            "pp": plan.layout.pp,
            "dp": plan.layout.dp,
            "tp": plan.layout.tp,
            "cp": plan.layout.cp,
            "ep": plan.layout.ep,
            "zero_stage": plan.layout.zero_stage,
            "replicas": plan.layout.replicas,
            "activation_checkpointing": plan.layout.activation_checkpointing or "",
            "microbatches": plan.layout.microbatches,
            **{
                f"{name}_gib": round(size / GiB, 3)
                for name, size in (
                    ("params", plan.params),
                    ("grads", plan.grads),
                    ("optimizer", plan.optimizer),
                    ("activations", plan.activations),
                    ("total", plan.total),
                )
            },
            "fits": plan.fits,
            "step_s": round(plan.step_s, 4),
            "recommended": index == 0 and plan.fits,
        }
        for index, plan in enumerate(plans)
    ]


def _layout_row(plan: Estimate, width: int) -> str:
    sizes = (plan.params, plan.grads, plan.optimizer, plan.activations, plan.total)
    gib = " ".join(f"{size / GiB:6.1f}" for size in sizes)
    return f"  {plan.layout!s:<{width}} {gib} {'yes' if plan.fits else 'no':>4} {plan.step_s:6.2f}"


def _what_would_fit(shape: ModelShape, training: Training, cluster: Cluster, leanest: Estimate, ep: int) -> str:
    """More GPUs of the same memory, the fewest that suffice, or else GPUs with more memory."""
    for factor in (2, 4, 8, 16, 32, 64):
        more = replace(cluster, gpus=cluster.gpus * factor)
        fitting = [plan for plan in plan_layouts(shape, training, more, ep) if plan.fits]
        if fitting:
            return f"It fits on {more.gpus} GPUs: {fitting[0].layout}, {fitting[0].total / GiB:.1f} GiB per GPU."
    return f"It fits on GPUs with {math.ceil(leanest.total / GiB)} GiB."


def _given_size(size: int | str | None) -> int | None:
    """A config's size, unless it leaves the size to the planner ("auto") or to the node ("node")."""
    return size if isinstance(size, int) else None


def _build_on_meta(class_path: str, init_args: dict) -> nn.Module:
    module_name, _, class_name = class_path.rpartition(".")
    model_class = getattr(importlib.import_module(module_name), class_name)
    with torch.device("meta"):
        return model_class(**init_args)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightdist plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="a LightningCLI config: its model, and its strategy's tp size")
    parser.add_argument("--model", help="class path of a LightningModule or nn.Module, e.g. lightdist.models.Llama")
    parser.add_argument("--init-args", default="{}", help="JSON keyword arguments for the model class")
    parser.add_argument("--tp", type=int, help="tensor_parallel_size (default: the config's, else 2)")
    parser.add_argument("--pp", type=int, help="pipeline_parallel_size (default: the config's, else 1)")
    parser.add_argument("--schedule", help="pipeline_schedule (default: the config's, else 1f1b)")
    parser.add_argument("--virtual-stages", type=int, help="stages per rank of interleaved and zero-bubble schedules")
    parser.add_argument(
        "--ep", type=int, help="expert_parallel_size of a Mixture-of-Experts model (default: the config's, else 1)"
    )
    cluster = parser.add_argument_group("layouts: per-GPU memory and step time of every split of a cluster")
    cluster.add_argument("--gpus", type=int, help="GPUs to train on; shows every layout and recommends one")
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    cluster.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100: 989)")
    cluster.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU inside a node (NVLink)")
    cluster.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU between nodes (IB)")
    cluster.add_argument("--seq-len", type=int, default=4096)
    cluster.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    cluster.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch")
    cluster.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    cluster.add_argument(
        "--format", choices=["table", "csv", "json"], default="table", help="csv or json: one record per layout"
    )
    args = parser.parse_args(argv)
    if args.format != "table" and args.gpus is None:
        parser.error(f"--format {args.format} writes the layouts table: add --gpus N.")

    class_path, init_args, tp, tp_plan = args.model, json.loads(args.init_args), args.tp, None
    pp, split, schedule, virtual_stages, ep = args.pp, None, args.schedule, args.virtual_stages, args.ep
    if args.config is not None:
        config = yaml.safe_load(args.config.read_text())
        class_path = class_path or config["model"]["class_path"]
        init_args = {**config["model"].get("init_args", {}), **init_args}
        strategy = (config.get("trainer", {}).get("strategy") or {}).get("init_args", {})
        tp = tp or _given_size(strategy.get("tensor_parallel_size"))
        tp_plan = strategy.get("tp_plan")
        pp, split = pp or _given_size(strategy.get("pipeline_parallel_size")), strategy.get("pipeline_split")
        schedule = schedule or strategy.get("pipeline_schedule")
        virtual_stages = virtual_stages or strategy.get("virtual_stages")
        ep = ep or strategy.get("expert_parallel_size")
    if class_path is None:
        parser.error("name the model with --model or --config.")
    try:
        model = _build_on_meta(class_path, init_args)
        if args.gpus is not None:
            training = Training(args.seq_len, args.global_batch, args.micro_batch, args.precision)
            cluster = Cluster(
                args.gpus,
                args.gpus_per_node,
                args.gpu_memory,
                args.peak_tflops,
                args.intra_node_gbps,
                args.inter_node_gbps,
            )
            if args.format != "table":
                _write_records(layout_records(ModelShape(model, tp_plan), training, cluster, ep or 1), args.format)
                return
            table, fits = format_layouts(ModelShape(model, tp_plan), training, cluster, ep or 1)
            print(table)
            if not fits:
                parser.exit(1)
            return
        if tp is not None or pp is None:  # nothing asked for: the tensor-parallel plan at tp=2
            print(format_plan(model, tp or 2, tp_plan))
        if (pp or 1) > 1:
            print(format_stages(model, pp, split, schedule=schedule or "1f1b", virtual_stages=virtual_stages))
    except ValueError as error:
        parser.exit(2, f"lightdist plan: {error}\n")


def _write_records(records: list[dict[str, object]], form: str) -> None:
    if form == "json":
        print(json.dumps(records, indent=2))
        return
    writer = csv.DictWriter(sys.stdout, fieldnames=list(records[0]) if records else [])
    writer.writeheader()
    writer.writerows(records)
