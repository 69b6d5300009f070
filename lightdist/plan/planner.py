"""Per-rank memory and step time of each way to split a model over a cluster, before any memory is spent.

Parameters per rank are counted as the strategy splits them: the same tensor-parallel plan, pipeline split and ZeRO
sharding, read from a model built on the meta device. The rest is a model for ranking layouts, not a promise:

- memory, at the end of a step's forward, where it peaks: fp32 master weights (4 bytes per parameter), the previous
  step's fp32 gradients (4; Lightning frees them only before backward) and Adam's two moments (8), each sharded as the
  ZeRO stage says; the weights FSDP2 gathers for compute (all of them, except under ZeRO-3: the embeddings, final norm
  and head that the root keeps gathered); the activations each block saves for backward, measured once by running the
  model on fake tensors (no memory), split over tensor- and sequence-parallel ranks and held for as many microbatches
  as the pipeline keeps in flight; and the logits with their fp32 log-softmax.
- step time: the model's FLOPs at a share (``efficiency``) of the devices' peak, stretched by recomputation and by
  the pipeline's bubble, plus ring all-reduce and all-gather time of tensor- and data-parallel traffic at the links'
  bandwidth, and under context parallelism the all-to-all's heads or the ring's key/value blocks (the method "auto"
  picks from the heads), with no overlap assumed.
- context parallelism (``cp``) divides every activation and the logits by ``cp``; attention written by hand keeps
  the other ranks' keys and values too, gathered. Its ranks shard ZeRO state with the data-parallel ones. A layout
  takes it only where the same split without it does not fit.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call

from lightdist.parallel.context import auto_method
from lightdist.parallel.expert_parallel import expert_layout_problem, find_experts
from lightdist.parallel.pipeline.structural import balanced_split, stage_costs
from lightdist.parallel.sharding import replicas_problem
from lightdist.parallel.structure import find_decoder_stack
from lightdist.parallel.tensor import (
    TensorParallelStyle,
    block_attention_heads,
    check_divisible,
    discover_plan,
    replicated_key_values,
)
from lightdist.plan.throughput import DecoderFlops
from lightdist.torch_internals import FakeTensorMode

__all__ = [
    "Cluster",
    "Estimate",
    "Layout",
    "ModelShape",
    "Training",
    "choose_layout",
    "estimate",
    "plan_layouts",
    "tensor_parallel_shape",
]

GiB = 2**30
ActivationCheckpointing = Literal["selective", "full"] | None
# What selective checkpointing keeps of a block's activations: Korthikanti et al. (2022), 24 of 34 bytes.
_SELECTIVE_SHARE = 24 / 34
# Their count of a GPT block's activations for models that cannot run on fake tensors: 34 bytes per token and hidden
# unit at 16 bits, so 68 at fp32.
_KORTHIKANTI_FP32_BYTES = 68
_RECOMPUTE = {None: 1.0, "selective": 1.05, "full": 4 / 3}  # full recomputes each block's forward once more


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    tp: int
    zero_stage: int = 3
    activation_checkpointing: ActivationCheckpointing = None
    microbatches: int = 1  # per optimizer step and data-parallel rank
    loss_parallel: bool = False  # under tp, the logits stay split by vocabulary
    ep: int = 1  # data-parallel ranks that split each MoE layer's experts
    cp: int = 1  # ranks that split each sequence, beside each data-parallel rank
    replicas: int = 1  # groups of data-parallel ranks that each shard the ZeRO state (HSDP)

    def __str__(self) -> str:
        context = f" x cp={self.cp}" if self.cp > 1 else ""
        experts = f", ep={self.ep}" if self.ep > 1 else ""
        replicas = f" in {self.replicas} replicas" if self.replicas > 1 else ""
        checkpointing = f", {self.activation_checkpointing} ckpt" if self.activation_checkpointing else ""
        pipeline = f", {self.microbatches} microbatches" if self.pp > 1 else ""
        return (
            f"pp={self.pp} x dp={self.dp}{context} x tp={self.tp}{experts}, ZeRO-{self.zero_stage}{replicas}"
            f"{checkpointing}{pipeline}"
        )

    @property
    def reducing(self) -> int:
        """Ranks that reduce gradients together and shard ZeRO state: the data-parallel ones and their
        context-parallel peers."""
        return self.dp * self.cp

    @property
    def sharding(self) -> int:
        """Ranks that shard ZeRO state together: a replica's share of the reducing ranks."""
        return self.reducing // self.replicas

    def divides_evenly(self) -> bool:
        """Whether expert parallelism over ``ep`` ranks and the replicas fit this layout, by the strategy's own
        rules."""
        replicas = replicas_problem(self.replicas, self.zero_stage, dp=self.dp)
        return expert_layout_problem(self.ep, self.reducing) is None and replicas is None


@dataclass(frozen=True)
class Training:
    seq_len: int = 4096
    global_batch: int = 256  # sequences per optimizer step
    micro_batch: int = 1  # sequences per microbatch
    precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed"


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory_gib: float = 80.0
    peak_tflops: float = 989.0  # H100 SXM, dense bf16
    intra_node_gbps: float = 450.0  # GB/s per GPU inside a node (NVLink 4)
    inter_node_gbps: float = 50.0  # GB/s per GPU between nodes (400 Gb/s InfiniBand)
    efficiency: float = 0.5  # the share of peak that compute reaches
    device: str = "GPU"

    def describe(self) -> str:
        return f"{self.gpus} {self.device}s ({self.gpus_per_node} per node, {self.memory_gib:g} GiB each)"


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    params: float  # bytes, on the rank that needs the most memory
    grads: float
    optimizer: float
    activations: float
    step_s: float
    fits: bool

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def tensor_parallel_shape(
    shape: tuple[int, ...], style: TensorParallelStyle | None, tp: int, *, weight: bool = True
) -> tuple[int, ...]:
    """A parameter's shape on each of ``tp`` ranks: colwise, vocabulary and head styles split the output rows (of
    weights and biases), rowwise the input columns of weights."""
    if style in ("colwise", "qkv", "gate_up", "vocab", "head"):
        return (shape[0] // tp, *shape[1:])
    if style == "rowwise" and weight:
        return (*shape[:-1], shape[-1] // tp)
    return shape


@dataclass(frozen=True)
class _Tensor:
    module: str
    shape: tuple[int, ...]
    style: TensorParallelStyle | None
    weight: bool
    place: int | Literal["first", "last"]  # its block, or the end of the pipeline that holds it
    tied_copy: bool = False  # an LM head's weight tied to the embedding: a tensor of its own only under a pipeline
    expert: bool = False  # stacked experts' weights: split on dim 0 by expert parallelism, never by tp


class ModelShape:
    """The sizes of a model's tensors and where each lives, read once from the model (built on the meta device)."""

    def __init__(self, model: nn.Module, tp_plan: dict[str, TensorParallelStyle] | None = None) -> None:
        self.model, self.name = model, type(model).__name__
        self.stack = find_decoder_stack(model)
        self.experts = find_experts(model)
        self.plan = discover_plan(model, self.stack, tp_plan=tp_plan)
        self.parameters = sum(p.numel() for p in model.parameters())
        experts = {id(p) for p in self.experts.parameters(model)} if self.experts else set()
        # What a token runs through: top_k of each MoE layer's experts.
        self.active_parameters = self.parameters - (self.experts.idle_parameters(model) if self.experts else 0)
        self.block_costs, self.embeddings, self.rest = stage_costs(model, self.stack)
        self.flops = DecoderFlops.of(model)
        embedding_tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        self.dim = self.flops.dim  # the token embedding's width
        self.heads = block_attention_heads(self.stack)
        self.vocab = max(table.num_embeddings for table in embedding_tables)
        self._modules = dict(model.named_modules())
        self._blocks_per_stage: dict[int, list[int]] = {}
        self._rank_parameters: dict[tuple[int, int, int, int], list[tuple[int, int, int]]] = {}
        blocks = {id(p): index for index, block in enumerate(self.stack.blocks) for p in block.parameters()}
        first_stage = {id(table.weight) for table in embedding_tables}
        self.tensors: list[_Tensor] = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                tied_copy = id(param) in seen
                seen.add(id(param))
                place = blocks.get(id(param), "first" if id(param) in first_stage and not tied_copy else "last")
                style, weight = self.plan.get(name), param_name == "weight"
                expert = id(param) in experts
                self.tensors.append(_Tensor(name, tuple(param.shape), style, weight, place, tied_copy, expert))

    def context_parallel_method(self, tp: int, cp: int) -> str:
        """The attention that ``context_parallel_method="auto"`` picks (the ring where the heads are not found)."""
        return "ring" if self.heads is None else auto_method(self.heads.heads // tp, cp)

    @property
    def n_layers(self) -> int:
        return len(self.block_costs)

    def splits_evenly(self, tp: int) -> bool:
        try:
            check_divisible(self.model, self.stack, self.plan, tp)
        except ValueError:
            return False
        return True

    def blocks_per_stage(self, pp: int) -> list[int]:
        if pp not in self._blocks_per_stage:
            self._blocks_per_stage[pp] = balanced_split(
                self.block_costs, pp, first_extra=self.embeddings, last_extra=self.rest
            )
        return self._blocks_per_stage[pp]

    def rank_parameters(self, pp: int, tp: int, dp: int, ep: int = 1, replicas: int = 1) -> list[tuple[int, int]]:
        """For each pipeline rank: the parameters it holds as tensor and expert parallelism leave them, and its ZeRO
        shard of them (FSDP2 splits each tensor's first dimension over the ``dp / replicas`` ranks of a replica,
        padding it to a multiple; experts over the ``dp / ep`` ranks that hold the same ones)."""
        return [(whole, sharded) for whole, sharded, _ in self._count_parameters(pp, tp, dp, ep, replicas)]

    def root_parameters(self, pp: int, tp: int) -> list[int]:
        """For each pipeline rank: its parameters outside the blocks (embeddings, final norm, head), which the FSDP2
        root keeps gathered from forward to backward under ZeRO-3."""
        return [outside for _, _, outside in self._count_parameters(pp, tp, 1)]

    def activation_bytes_per_token(self, seq_len: int) -> list[float]:
        """Bytes each block saves for backward per token of a ``seq_len`` sequence, at fp32: what grows with the
        sequence (the layers' outputs) and, per token, what grows with its square (attention's scores, where it is
        written by hand: Hugging Face's ``"eager"``, nanoGPT's slow path)."""
        return [linear + square * seq_len for linear, square in self._activation_terms]

    def gathered_bytes_per_token(self, cp: int) -> list[float]:
        """Bytes each block keeps for backward, at fp32, per token of the whole sequence, beside its share under
        context parallelism: attention written by hand scores its queries against the keys of every rank and weighs
        their values, so it keeps the other ranks' keys and values, gathered
        (lightdist/parallel/context/attention_by_hand.py), as wide as the queries (grouped keys are repeated before the
        product). A kernel (SDPA, split by ring or all-to-all) keeps only its share's."""
        return [2 * 4 * self.dim * (cp - 1) / cp if square else 0.0 for _, square in self._activation_terms]

    @cached_property
    def _activation_terms(self) -> list[tuple[float, float]]:
        """Per block, bytes saved per token and per token squared, measured by running the model forward on fake
        tensors (nothing allocated, nothing computed), so that its own layers, attention kernel and activation
        function are what is counted. Weights and buffers are not activations; a tensor saved twice counts once.
        Where a saved tensor is (..., T, T), a second length tells the two apart. A model fake tensors cannot run (its
        forward branches on values, or does not take a batch of token ids) is counted as Korthikanti et al. count a
        GPT block, with a warning."""
        try:
            at_60, square_seen = self._saved_per_block(60)  # a length no model's width or head dim is
            at_30 = self._saved_per_block(30)[0] if square_seen else [saved / 2 for saved in at_60]
        except (RuntimeError, TypeError) as error:  # fake tensors' errors are RuntimeErrors
            warnings.warn(
                f"{self.name} cannot run on fake tensors ({type(error).__name__}: {error}), so its activations are "
                f"estimated as Korthikanti et al. count a GPT block's, {_KORTHIKANTI_FP32_BYTES // 2} bytes per token "
                "and hidden unit at 16 bits, rather than measured.",
                stacklevel=3,
            )
            return [(_KORTHIKANTI_FP32_BYTES * self.dim, 0.0)] * self.n_layers
        # saved(T) = linear * T + square * T^2, so saved(T) / T at T = 60 and 30 differ by square * 30
        terms = []
        for long, short in zip(at_60, at_30, strict=True):
            square = max(0.0, (long / 60 - short / 30) / 30)
            terms.append((long / 60 - square * 60, square))
        return terms

    def _saved_per_block(self, tokens: int) -> tuple[list[float], bool]:
        """Bytes each block saves for backward on one sequence of ``tokens``, on fake tensors, and whether any saved
        tensor is (..., tokens, tokens): attention's scores, written by hand."""
        # Keyed by storage: torch keeps one Python object per storage (a view's is its base's), hashed by identity,
        # where fake tensors' data pointers are all 0. The keys keep them alive, so no key is reused.
        saved: dict[torch.UntypedStorage, int] = {}  # storage -> bytes, of the block that first saved it
        block_of_storage: dict[torch.UntypedStorage, int] = {}
        current: list[int | None] = [None]
        square_seen = False

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal square_seen
            square_seen |= current[0] is not None and tensor.shape[-2:] == (tokens, tokens)
            storage = tensor.untyped_storage()
            if current[0] is not None and storage not in saved:
                saved[storage] = storage.nbytes()
                block_of_storage[storage] = current[0]
            return tensor

        hooks = []
        for index, block in enumerate(self.stack.blocks):
            hooks.append(block.register_forward_pre_hook(lambda *_, index=index: current.__setitem__(0, index)))
            hooks.append(block.register_forward_hook(lambda *_: current.__setitem__(0, None)))
        try:
            with FakeTensorMode():
                state = {
                    name: torch.empty(p.shape, dtype=torch.float32, requires_grad=True)
                    for name, p in self.model.named_parameters()
                }
                state |= {
                    name: torch.empty(b.shape, dtype=torch.float32 if b.is_floating_point() else b.dtype)
                    for name, b in self.model.named_buffers()
                }
                saved.update((t.untyped_storage(), 0) for t in state.values())  # weights are not activations
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    functional_call(self.model, state, (torch.zeros(1, tokens, dtype=torch.long),))
        finally:
            for hook in hooks:
                hook.remove()
        per_block = [0.0] * self.n_layers
        for storage, index in block_of_storage.items():
            per_block[index] += saved[storage]
        return per_block, square_seen

    def _count_parameters(
        self, pp: int, tp: int, dp: int, ep: int = 1, replicas: int = 1
    ) -> list[tuple[int, int, int]]:
        key = (pp, tp, dp, ep, replicas)
        if key not in self._rank_parameters:
            sizes = self.blocks_per_stage(pp)
            whole_modules = set(replicated_key_values(self._modules, self.plan, tp)) if tp > 1 else set()
            counts = []
            for pp_rank in range(pp):
                held = range(sum(sizes[:pp_rank]), sum(sizes[: pp_rank + 1]))
                whole = sharded = outside = 0
                for tensor in self.tensors:
                    first, last = tensor.place == "first" and pp_rank == 0, tensor.place == "last" and pp_rank == pp - 1
                    if not (first or last or tensor.place in held) or (tensor.tied_copy and pp == 1):
                        continue
                    if tensor.expert:
                        shape, shards = (tensor.shape[0] // ep, *tensor.shape[1:]), dp // ep
                    else:
                        style = None if tensor.module in whole_modules else tensor.style
                        shape = tensor_parallel_shape(tensor.shape, style, tp, weight=tensor.weight)
                        shards = dp // replicas
                    whole += math.prod(shape)
                    sharded += math.ceil(shape[0] / shards) * math.prod(shape[1:])
                    outside += math.prod(shape) if first or last else 0
                counts.append((whole, sharded, outside))
            self._rank_parameters[key] = counts
        return self._rank_parameters[key]


def estimate(shape: ModelShape, layout: Layout, training: Training, cluster: Cluster) -> Estimate:
    """Memory of the rank that needs the most, at the end of the forward where it peaks, and the step time."""
    compute_bytes = 2 if training.precision == "bf16-mixed" else 4
    # Under a pipeline each stage gathers its ZeRO-3 weights once per step and keeps them: ZeRO-2's memory.
    zero = min(layout.zero_stage, 2) if layout.pp > 1 else layout.zero_stage
    tokens = training.micro_batch * training.seq_len / layout.cp  # per microbatch and rank
    sizes = shape.blocks_per_stage(layout.pp)
    saved = [
        (own * tokens + gathered * tokens * layout.cp) * compute_bytes / 4 / layout.tp
        for own, gathered in zip(
            shape.activation_bytes_per_token(training.seq_len), shape.gathered_bytes_per_token(layout.cp), strict=True
        )
    ]
    worst: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    rank_parameters = shape.rank_parameters(layout.pp, layout.tp, layout.reducing, layout.ep, layout.replicas)
    for pp_rank, ((whole, sharded), outside) in enumerate(
        zip(rank_parameters, shape.root_parameters(layout.pp, layout.tp), strict=True)
    ):
        held = slice(sum(sizes[:pp_rank]), sum(sizes[: pp_rank + 1]))  # this rank's blocks
        # FSDP2 computes with gathered copies: of everything from forward to backward, or under ZeRO-3 of the root's
        # embeddings and head only, the blocks gathered one at a time.
        gathered = compute_bytes * (outside if zero == 3 else whole)
        params = 4 * (sharded if zero >= 2 else whole) + gathered
        if layout.pp == 1:  # the previous step's, freed only before this step's backward
            grads = 4 * (sharded if zero >= 2 else whole)
        else:
            # Zeroed before the schedule, then accumulated whole over the microbatches and reduced at the end: with
            # the fresh gradient of the largest group (or its reduce-scatter copy) and the reduced shards beside them.
            largest_group = max(outside, max(shape.block_costs[held]) / layout.tp)
            grads = 4 * (whole + largest_group + (sharded if layout.reducing > 1 else 0))
        optimizer = 8 * (sharded if zero >= 1 else whole)
        blocks = saved[held]
        in_flight = 1 if layout.pp == 1 else min(layout.microbatches, layout.pp - pp_rank)  # 1F1B
        if layout.activation_checkpointing == "full":  # each block's input, and one block recomputed in backward
            activations = len(blocks) * tokens * shape.dim * compute_bytes / layout.tp * in_flight + max(blocks)
        else:
            share = _SELECTIVE_SHARE if layout.activation_checkpointing == "selective" else 1.0
            activations = sum(blocks) * share * in_flight
        if pp_rank == layout.pp - 1:
            activations += tokens * _logit_bytes(shape.vocab, layout, compute_bytes)
        rank = (params, grads, optimizer, activations)
        if sum(rank) > sum(worst):
            worst = rank
    step_s = _step_seconds(shape, layout, training, cluster, compute_bytes, zero)
    fits = sum(worst) <= cluster.memory_gib * GiB
    return Estimate(layout, *worst, step_s=step_s, fits=fits)


def _logit_bytes(vocab: int, layout: Layout, compute_bytes: int) -> float:
    """Per token: the logits, their fp32 copy for the loss (the reference models' ``.float()``; none in fp32) and the
    fp32 log-softmax that cross-entropy saves. Without loss parallelism each tp rank gathers the whole vocabulary."""
    loss = (4 if compute_bytes < 4 else 0) + 4
    if layout.tp > 1 and layout.loss_parallel:
        return vocab / layout.tp * (compute_bytes + loss)
    if layout.tp > 1:
        return vocab * (compute_bytes / layout.tp + compute_bytes + loss)
    return vocab * (compute_bytes + loss)


def _step_seconds(
    shape: ModelShape, layout: Layout, training: Training, cluster: Cluster, compute_bytes: int, zero: int
) -> float:
    tokens = training.global_batch * training.seq_len
    flops = shape.flops.per_token(training.seq_len) * tokens * _RECOMPUTE[layout.activation_checkpointing]
    compute = flops / (cluster.gpus * cluster.peak_tflops * 1e12 * cluster.efficiency)
    if layout.pp > 1:
        compute *= 1 + (layout.pp - 1) / layout.microbatches  # the bubble: (p - 1) / (m + p - 1) of the step
    blocks = max(shape.blocks_per_stage(layout.pp))
    tokens = training.micro_batch * training.seq_len / layout.cp  # per microbatch and rank
    tensor_parallel = 0.0
    if layout.tp > 1:  # per block and microbatch: 2 all-reduces forward and 2 backward (or their SP halves)
        volume = tokens * shape.dim * compute_bytes
        ring = 2 * (layout.tp - 1) / layout.tp * volume
        tensor_parallel = blocks * layout.microbatches * 4 * ring / (cluster.intra_node_gbps * 1e9)
    context_parallel = 0.0
    if layout.cp > 1:
        # Per block and microbatch, at the model's width (an upper bound for keys and values under grouped-query
        # attention). All-to-all: queries, keys, values and the output, (cp - 1) / cp of each sent forward, and their
        # gradients backward. Ring: each rank's keys and values passed on cp - 1 times forward, and again backward
        # with their gradients.
        width = tokens * shape.dim / layout.tp * compute_bytes
        if shape.context_parallel_method(layout.tp, layout.cp) == "all_to_all":
            volume = 8 * (layout.cp - 1) / layout.cp * width
        else:
            volume = 3 * (layout.cp - 1) * 2 * width
        context_parallel = blocks * layout.microbatches * volume / (_bandwidth(cluster, layout.tp * layout.cp) * 1e9)
    data_parallel = 0.0
    params = shape.parameters / layout.tp / layout.pp
    if layout.sharding > 1:
        share = (layout.sharding - 1) / layout.sharding
        # ZeRO-3 gathers weights for forward and backward of each microbatch and reduce-scatters fp32 gradients;
        # the other stages all-reduce fp32 gradients (a reduce-scatter and an all-gather of the same size).
        gathers = 2 * compute_bytes * layout.microbatches + 4 if zero == 3 else 2 * 4
        data_parallel += share * params * gathers / (_bandwidth(cluster, layout.tp * layout.sharding) * 1e9)
    if layout.replicas > 1:  # HSDP: each rank's reduced gradient shard all-reduced across the replicas
        share = 2 * (layout.replicas - 1) / layout.replicas
        data_parallel += share * params / layout.sharding * 4 / (_bandwidth(cluster, layout.tp * layout.reducing) * 1e9)
    expert_parallel = 0.0
    if layout.ep > 1 and shape.experts is not None:
        # Per MoE layer and microbatch, each token's hidden states to its top_k experts and back, and their gradients
        # back and forth: 4 all-to-alls, of which the (ep - 1) / ep held elsewhere cross the links.
        moe_layers = math.ceil(len(shape.experts.names) / layout.pp)
        pairs = training.micro_batch * training.seq_len * (shape.experts.top_k or shape.experts.num_experts)
        volume = 4 * pairs * shape.dim * compute_bytes * (layout.ep - 1) / layout.ep
        expert_parallel = moe_layers * layout.microbatches * volume / (_bandwidth(cluster, layout.tp * layout.ep) * 1e9)
    return compute + tensor_parallel + context_parallel + data_parallel + expert_parallel


def _bandwidth(cluster: Cluster, span: int) -> float:
    """GB/s per rank of a collective over ``span`` neighbouring ranks: between nodes where they do not fit in one."""
    return cluster.inter_node_gbps if span > cluster.gpus_per_node else cluster.intra_node_gbps


def plan_layouts(shape: ModelShape, training: Training, cluster: Cluster, ep: int = 1) -> list[Estimate]:
    """For every split of ``cluster.gpus`` into pp x dp x tp (tp inside a node) that takes expert parallelism over
    ``ep`` ranks, the fastest ZeRO stage and activation checkpointing that fit, or the leanest where none does;
    fastest first. Where nothing fits a split, its data-parallel ranks split each sequence too (cp = 2, 4, ...: the
    activations shrink by cp), the smallest cp that fits taken; where none does, the split is shown without."""
    plans = []
    for tp in _divisors(cluster.gpus):
        if tp > cluster.gpus_per_node or not shape.splits_evenly(tp):
            continue
        for pp in _divisors(cluster.gpus // tp):
            tried = []
            for cp in _divisors(cluster.gpus // (tp * pp)):
                split = _best_of_split(shape, training, cluster, pp, tp, cp, ep)
                if split is not None:
                    tried.append(split)
                    if split.fits:
                        break
            if tried:
                plans.append(tried[-1] if tried[-1].fits else tried[0])
    return sorted(plans, key=lambda e: (not e.fits, e.step_s if e.fits else e.total))


def _best_of_split(
    shape: ModelShape, training: Training, cluster: Cluster, pp: int, tp: int, cp: int, ep: int
) -> Estimate | None:
    """The fastest ZeRO stage and activation checkpointing of pp x dp x cp x tp that fit, or else the leanest; ``None``
    where the split cannot run."""
    dp = cluster.gpus // (tp * pp * cp)
    sequences = training.global_batch // dp if training.global_batch % dp == 0 else 0
    if pp > shape.n_layers or not sequences or sequences % training.micro_batch or training.seq_len % (2 * cp):
        return None
    microbatches = sequences // training.micro_batch
    if (pp > 1 and microbatches < pp) or not Layout(pp, dp, tp, ep=ep, cp=cp).divides_evenly():
        return None
    reducing = dp * cp
    layouts = [
        Layout(pp, dp, tp, zero, checkpointing, microbatches, ep=ep, cp=cp, replicas=replicas)
        for zero in ((0, 1, 2, 3) if reducing > 1 else (0,))
        if not (pp > 1 and zero == 3)  # under a pipeline ZeRO-3 is ZeRO-2 (see estimate)
        and not (ep > 1 and zero == 1)  # ZeRO-1 deals whole parameters over every data-parallel rank
        for replicas in {1, _replicas_of_a_node(dp, cp, tp, cluster) if zero >= 2 else 1}
        for checkpointing in (None, "selective", "full")
    ]
    options = [estimate(shape, layout, training, cluster) for layout in layouts if layout.divides_evenly()]
    fitting = [option for option in options if option.fits]
    return min(fitting, key=lambda e: (e.step_s, e.total)) if fitting else min(options, key=lambda e: e.total)


def _replicas_of_a_node(dp: int, cp: int, tp: int, cluster: Cluster) -> int:
    """The replicas that keep ZeRO's gathers inside a node (torchtitan's HSDP): as many as the nodes the
    data-parallel ranks span, where a node holds whole data-parallel ranks and their context-parallel peers; else 1."""
    per_node = cluster.gpus_per_node // (tp * cp)
    if per_node == 0 or cluster.gpus_per_node % (tp * cp) or dp % per_node:
        return 1
    return dp // per_node


def choose_layout(
    shape: ModelShape,
    cluster: Cluster,
    *,
    seq_len: int,
    batch_per_replica: int,
    precision: Literal["bf16-mixed", "32-true"],
    zero_stage: int,
    activation_checkpointing: ActivationCheckpointing,
    pp: int | None = None,
    dp: int | None = None,
    tp: int | None = None,
    microbatches: int | None = None,
    stages_per_rank: int = 1,
    ep: int = 1,
    cp: int = 1,
    replicas: int = 1,
) -> Estimate:
    """The split of ``cluster.gpus`` ranks that trains the most tokens per second and fits, for sizes left ``None``.

    Unlike :func:`plan_layouts`, which holds the global batch, this holds the batch each data-parallel rank is given
    (Lightning's ``batch_size``): more data parallelism trains more sequences per step, so layouts are ranked by
    tokens per second, not by step time. The ZeRO stage and activation checkpointing are the user's; the pipeline
    cuts each rank's batch into ``microbatches`` (default ``pp``). ``cp`` ranks split each sequence beside each
    data-parallel rank.
    """
    fixed = ", ".join(f"{name}={size}" for name, size in (("pp", pp), ("dp", dp), ("tp", tp)) if size is not None)
    candidates = []
    for tp_size in _divisors(cluster.gpus // cp):
        if tp not in (None, tp_size) or tp_size > cluster.gpus_per_node or not shape.splits_evenly(tp_size):
            continue
        for pp_size in _divisors(cluster.gpus // (tp_size * cp)):
            dp_size = cluster.gpus // (tp_size * pp_size * cp)
            chunks = (microbatches or pp_size) if pp_size > 1 else 1
            if pp not in (None, pp_size) or dp not in (None, dp_size) or batch_per_replica % chunks:
                continue
            if pp_size * stages_per_rank > shape.n_layers:
                continue
            layout = Layout(
                pp_size, dp_size, tp_size, zero_stage, activation_checkpointing, chunks, ep=ep, cp=cp, replicas=replicas
            )
            if not layout.divides_evenly():
                continue
            training = Training(seq_len, batch_per_replica * dp_size, batch_per_replica // chunks, precision)
            candidates.append(estimate(shape, layout, training, cluster))
    if not candidates:
        raise ValueError(
            f"No split of {cluster.gpus} ranks into pp x dp x tp suits {shape.name}"
            + (f" with {fixed}" if fixed else "")
            + f": tp must divide its heads and stay inside a node of {cluster.gpus_per_node}"
            + (f", ep={ep} divide dp, pp or tp be 1" if ep > 1 else "")
            + (f", data_parallel_replicas={replicas} divide dp" if replicas > 1 else "")
            + ", pp at most "
            f"{shape.n_layers // stages_per_rank} stages, and the microbatches must divide batch_size="
            f"{batch_per_replica}. Set the sizes yourself, or change the device count or the batch size."
        )
    fitting = [candidate for candidate in candidates if candidate.fits]
    if not fitting:
        leanest = min(candidates, key=lambda candidate: candidate.total)
        remedies = ["shard more (zero_stage=3)"] if zero_stage < 3 else []
        if activation_checkpointing != "full":
            remedies.append("recompute activations (activation_checkpointing='full')")
        remedies += ["lower batch_size or seq_len", "add devices"]
        raise ValueError(
            f"No layout of {shape.name} on {cluster.describe()} fits {batch_per_replica} x {seq_len} tokens per "
            f"data-parallel rank at zero_stage={zero_stage}, activation_checkpointing={activation_checkpointing!r}"
            + (f", {fixed}" if fixed else "")
            + f": the leanest, {leanest.layout}, needs {leanest.total / GiB:.1f} GiB per device. "
            + f"{', '.join(remedies[:-1])} or {remedies[-1]}".capitalize()
            + "; `lightdist plan --gpus N` shows every layout."
        )
    return min(fitting, key=lambda candidate: (candidate.step_s / candidate.layout.dp, candidate.total))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
