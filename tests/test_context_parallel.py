"""Context parallelism used directly, as a plain training loop would: a model's step on half of every sequence per
rank must compute what one process computes on the whole, and what cannot be split is refused by name.

The Trainer's runs (``ParallelStrategy(context_parallel_size=...)``) are compared with one process in
``tests/test_equivalence.py``.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from lightdist.models import Llama
from lightdist.parallel.activation_checkpointing import apply_activation_checkpointing
from lightdist.parallel.compiled_blocks import compile_block
from lightdist.parallel.context import ContextParallel, balanced_by_documents, check_split_step, load_balanced_positions
from lightdist.parallel.context.sequence_shard import SequenceShard
from lightdist.parallel.documents import DocumentMasks, document_ids, document_positions
from lightdist.parallel.loss_tokens import labelled_tokens
from lightdist.parallel.pipeline.traced import trace_stages
from lightdist.plan.planner import Cluster, Layout, ModelShape, Training, estimate

from multirank import raised, run_ranks
from zoo import GPT, HF_MOE_FAMILIES, HF_TINY, HF_TINY_MOE, CausalSelfAttention, GPTConfig

pytestmark = pytest.mark.multirank


def hf_llama(attn_implementation: str = "sdpa", heads: int = 4, kv_heads: int = 2) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=48 if heads == 3 else 64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def hf_causal_lm(model_type: str, **config) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **config))


class BufferAttention(CausalSelfAttention):
    """Megatron's way: scores by ``baddbmm`` into an empty buffer (``beta=0``) over batch x heads, values by ``bmm``."""

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        H, D = self.n_head, C // self.n_head
        q, k, v = (t.view(B, T, H, D).transpose(1, 2).reshape(B * H, T, D) for t in self.c_attn(x).split(C, 2))
        att = torch.baddbmm(torch.empty(B * H, T, T), q, k.transpose(1, 2), beta=0.0, alpha=1 / math.sqrt(D))
        att = att.view(B, H, T, -1).masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = torch.bmm(F.softmax(att, dim=-1).view(B * H, T, -1), v)
        return self.c_proj(y.view(B, H, T, D).transpose(1, 2).reshape(B, T, C))


class EinsumAttention(CausalSelfAttention):
    """Scores and values by ``torch.einsum``, as lucidrains' x-transformers writes them."""

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        att = torch.einsum("b h i d, b h j d -> b h i j", q, k) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = torch.einsum("b h i j, b h j d -> b h i d", F.softmax(att, dim=-1), v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class BroadcastAttention(CausalSelfAttention):
    """Scores by broadcasting and summing, which lightdist does not read as attention."""

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        att = (q[..., :, None, :] * k[..., None, :, :]).sum(-1).masked_fill(self.bias[:, :, :T, :T] == 0, -1e9)
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def nanogpt(attention: type[CausalSelfAttention] = CausalSelfAttention) -> nn.Module:
    """nanoGPT on its slow path (attention by hand, its causal mask a buffer), or with ``attention`` written like it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(flash=False))
    for block in model.transformer.h:
        block.attn = attention(GPTConfig(flash=False))
    return model


# nanoGPT's slow path, and Hugging Face's "eager" attention with grouped keys, repeated before the scores
BY_HAND = {"nanogpt_slow": nanogpt, "hf_llama_eager": functools.partial(hf_llama, "eager")}


def nanogpt_loss(model: nn.Module, batch: Tensor) -> Tensor:
    return model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())[1]


def traced_nanogpt_loss(
    model: nn.Module, windows: Tensor, cp: ContextParallel
) -> Callable[[nn.Module, Tensor], Tensor]:
    """nanoGPT's loss with the model cut by torch's tracer into one pipeline stage, traced from this rank's share of
    ``windows`` as a traced pipeline's stages are, and called with the shares, as the pipeline calls its first stage:
    it runs the aten ops torch.export recorded. One process calls the model."""
    share = tuple(cp.local(t.contiguous()) for t in (windows[:, :-1], windows[:, 1:]))
    blocks = [f"transformer.h.{index}" for index in range(len(model.transformer.h))]
    (stage,) = trace_stages(model, (share, {}), blocks, [len(blocks)], torch.device("cpu"))

    def loss_of(model: nn.Module, batch: Tensor) -> Tensor:
        inputs = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        return stage(*cp.shares(inputs))[1] if isinstance(batch, SequenceShard) else model(*inputs)[1]

    return loss_of


def labels_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """A fine-tuning step's loss: the collator's batch into the model, which shifts the labels itself."""
    return model(**batch).loss


def shifted_logits_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The loss computed in the step from the logits, both shifted there, as Hugging Face's loss used to be."""
    logits = model(input_ids=batch["input_ids"]).logits
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = batch["labels"][..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def torchtune_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """torchtune's shift: the labels moved left and a column of -100 joined after them, the logits left whole."""
    labels = batch["labels"]
    labels = torch.hstack((labels[..., 1:], torch.full((labels.shape[0], 1), -100)))
    return F.cross_entropy(model(input_ids=batch["input_ids"]).logits.flatten(0, 1), labels.flatten())


def one_process_and_split(model: nn.Module, batch, loss_of, cp: ContextParallel) -> dict[str, float]:
    """The loss and gradients of ``model`` on ``batch`` in one process, and with each sequence split over the ranks:
    the largest differences, relative to the one-process values."""
    whole = loss_of(model, batch)
    whole.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with cp.active():
        shards = cp.shard_batch(batch)
        loss = loss_of(model, shards)
        # Each rank's loss is the mean over its own labelled tokens, which padding and shifts make unequal: weigh it
        # by them, as counted by the step's cross-entropy, or else by a Hugging Face model from its labels.
        tokens = cp.loss_tokens()
        if tokens is None:
            tokens = labelled_tokens(model, shards) if isinstance(shards, dict) else torch.tensor(1)
        share = tokens / _summed(tokens.clone())
    with cp.active():  # backward under it too: activation checkpointing recomputes attention there
        (loss * share).backward()
    gradient_gap = 0.0
    for name, parameter in model.named_parameters():
        # A key's bias has no gradient (softmax ignores a shift shared by all keys): only its rounding, below 1e-10
        scale = expected[name].abs().max().clamp(min=1e-6)
        gap = (_summed(parameter.grad) - expected[name]).abs().max() / scale
        gradient_gap = max(gradient_gap, gap.item())
    model.zero_grad()
    return {"loss": abs(_summed(loss.detach() * share).item() - whole.item()) / whole.item(), "gradients": gradient_gap}


def _summed(tensor: Tensor) -> Tensor:
    dist.all_reduce(tensor)
    return tensor


def saved_activation_bytes(model: nn.Module, tokens: Tensor, cp: ContextParallel | None) -> int:
    """Bytes the forward keeps for backward besides the weights: the activations, which grow with the sequence."""
    weights = {parameter.data_ptr() for parameter in model.parameters()}
    saved = 0

    def keep(tensor: Tensor) -> Tensor:
        nonlocal saved
        if tensor.data_ptr() not in weights:
            saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        if cp is None:
            model(tokens)
        else:
            with cp.active():
                model(cp.shard_batch(tokens))
    return saved


def context_parallel_in_a_plain_loop() -> dict:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 64), generator=generator)
    # A collator's batch: documents of different lengths padded on the right (38 tokens: padded to 40 to split),
    # padding masked and labelled -100
    lengths = torch.tensor([38, 21])
    kept = torch.arange(38)[None] < lengths[:, None]
    collated = {
        "input_ids": tokens[:, :38].masked_fill(~kept, 0),
        "attention_mask": kept.long(),
        "labels": tokens[:, :38].masked_fill(~kept, -100),
    }
    results = {}
    for method in ("ring", "all_to_all"):
        model = hf_llama()
        cp = ContextParallel(mesh, method, model)
        results[f"hf_llama_{method}"] = one_process_and_split(model, collated, labels_loss, cp)
    # OPT counts positions by a cumulative sum of a mask of ones; Falcon passes attention a causal mask of its own
    opt = hf_causal_lm("opt", **dict(HF_TINY, ffn_dim=176, word_embed_proj_dim=64, dropout=0.0))
    results["hf_opt_ring"] = one_process_and_split(opt, collated, labels_loss, ContextParallel(mesh, "ring", opt))
    falcon = hf_causal_lm("falcon", **HF_TINY, multi_query=True, new_decoder_architecture=False, alibi=False)
    cp = ContextParallel(mesh, "auto", falcon)
    results["hf_falcon_causal_mask"] = one_process_and_split(falcon, collated, labels_loss, cp)
    # ALiBi: a slope per head times the key's position, which Falcon adds to its causal mask
    alibi = hf_causal_lm("falcon", **HF_TINY, multi_query=False, new_decoder_architecture=False, alibi=True)
    cp = ContextParallel(mesh, "auto", alibi)
    results["hf_falcon_alibi_all_to_all"] = one_process_and_split(alibi, collated, labels_loss, cp)
    cp = ContextParallel(mesh, "ring", alibi)  # the keys and values gathered whole, the bias added to them
    results["hf_falcon_alibi_ring"] = one_process_and_split(alibi, collated, labels_loss, cp)
    # Latent attention (DeepSeek-V3) whose value heads differ in size from its query and key heads (a key and value
    # head per query head, as latent attention makes them: with fewer, Hugging Face's model fails in one process)
    latent = HF_MOE_FAMILIES["deepseek_v3"] | {"v_head_dim": 24, "num_key_value_heads": 4}
    deepseek = hf_causal_lm("deepseek_v3", **dict(HF_TINY_MOE, **latent))
    cp = ContextParallel(mesh, "ring", deepseek)
    results["hf_deepseek_v3_ring_values_of_another_size"] = one_process_and_split(deepseek, collated, labels_loss, cp)
    # Attention written by hand: Hugging Face's "eager", BLOOM's ALiBi added by baddbmm, nanoGPT's slow path
    eager = hf_llama("eager")
    results["hf_llama_eager"] = one_process_and_split(
        eager, collated, labels_loss, ContextParallel(mesh, "auto", eager)
    )
    bloom = hf_causal_lm("bloom", vocab_size=64, hidden_size=64, n_layer=2, n_head=4)
    results["hf_bloom_alibi"] = one_process_and_split(
        bloom, collated, labels_loss, ContextParallel(mesh, "auto", bloom)
    )
    slow = nanogpt()
    windows_of_65 = torch.randint(0, 64, (2, 65), generator=generator)
    cp = ContextParallel(mesh, "auto", slow)
    results["nanogpt_slow_attention"] = one_process_and_split(slow, windows_of_65, nanogpt_loss, cp)
    buffered = nanogpt(BufferAttention)
    cp = ContextParallel(mesh, "auto", buffered)
    results["nanogpt_buffer_attention"] = one_process_and_split(buffered, windows_of_65, nanogpt_loss, cp)
    einsum = nanogpt(EinsumAttention)
    cp = ContextParallel(mesh, "auto", einsum)
    results["nanogpt_einsum_attention"] = one_process_and_split(einsum, windows_of_65, nanogpt_loss, cp)
    # The same attention in a pipeline stage cut by torch's tracer, which runs aten ops (aten.matmul, aten.slice)
    cp = ContextParallel(mesh, "auto", slow)
    results["nanogpt_slow_attention_traced"] = one_process_and_split(
        slow, windows_of_65, traced_nanogpt_loss(slow, windows_of_65, cp), cp
    )
    model = hf_llama()
    cp = ContextParallel(mesh, "ring", model)
    results["hf_llama_shifted_logits"] = one_process_and_split(model, collated, shifted_logits_loss, cp)
    cp = ContextParallel(mesh, "all_to_all", model)
    results["hf_llama_torchtune_shift"] = one_process_and_split(model, collated, torchtune_loss, cp)
    # Blocks recomputed in backward, which torch runs outside the mode that split the forward
    checkpointed = hf_llama()
    apply_activation_checkpointing(checkpointed.model.layers, mode="full")
    cp = ContextParallel(mesh, "ring", checkpointed)
    results["hf_llama_ring_full_checkpointing"] = one_process_and_split(checkpointed, collated, labels_loss, cp)
    # The reference Llama, whose step shifts the labels: batch[:, :-1] in, batch[:, 1:] as targets, 65 tokens
    torch.manual_seed(0)
    llama = Llama("tiny").model

    def shifted_loss(model: nn.Module, batch: Tensor) -> Tensor:
        return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    windows = torch.randint(0, 64, (2, 65), generator=generator)
    results["llama_ring"] = one_process_and_split(llama, windows, shifted_loss, ContextParallel(mesh, "ring", llama))
    # The same step on 64 tokens, a length that splits: the inputs keep their last token and the targets end in -100
    shifted = ContextParallel(mesh, "all_to_all", llama)
    results["llama_shift_of_a_split_length"] = one_process_and_split(llama, windows[:, :64], shifted_loss, shifted)

    # Targets made by rolling the inputs, cast and masked before the model sees them: each on the whole sequence
    def rolled_loss(model: nn.Module, batch: Tensor) -> Tensor:
        targets = torch.roll(batch, -1, dims=1).long()
        targets = torch.where(targets >= 0, targets, 0)
        return F.cross_entropy(model(batch).flatten(0, 1), targets.flatten())

    rolled = ContextParallel(mesh, "all_to_all", llama)
    results["llama_rolled_targets"] = one_process_and_split(llama, windows[:, :64], rolled_loss, rolled)

    # Blocks compiled as compile=True compiles them under context parallelism (dynamo, here with its eager backend):
    # each compiles once for the whole and once for the split, and the steps after compile nothing anew (new rotary
    # tables, the split's hooks entered again)
    compiled = Llama("tiny").model
    for block in compiled.layers:
        compile_block(block, backend="eager")
    cp = ContextParallel(mesh, "ring", compiled)
    one_process_and_split(compiled, windows, shifted_loss, cp)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            again = torch.randint(0, 64, (2, 65), generator=generator)
            results["llama_ring_compiled_blocks"] = one_process_and_split(compiled, again, shifted_loss, cp)
    except RuntimeError as error:
        results["llama_ring_compiled_blocks"] = str(error)
    # The check a step runs at its first batch (ParallelStrategy: whole, then split, in evaluation) runs compiled
    # blocks eagerly: it compiles nothing for shapes and modes training never runs; the step after it compiles
    graphs = []

    def keep(graph: torch.fx.GraphModule, inputs: list) -> Callable:  # one backend for every block, as compile=True
        graphs.append(graph)
        return graph.forward

    checked = Llama("tiny").model
    for block in checked.layers:
        compile_block(block, backend=keep)
    check_split_step(
        ContextParallel(mesh, "ring", checked),
        lambda batch: (shifted_loss(checked, batch), None),
        windows,
        None,  # the loss only: the split's gradients are summed over the ranks by ZeRO, not in this loop
        rtol=1e-5,
        step_name="shifted_loss",
    )
    results["graphs_compiled_by_the_check"] = len(graphs)
    shifted_loss(checked, windows)
    results["graphs_compiled_by_a_step"] = len(graphs)
    # Within packed documents the ring's chunks are dealt out by each batch's documents: the compiled blocks take the
    # chunks' positions as a tensor, so a batch whose documents deal them otherwise compiles nothing anew either
    documents = DocumentMasks(end_token=0, model=compiled)
    cp = ContextParallel(mesh, "ring", compiled)
    cp.attend_within(documents)

    def loss_within_documents(model: nn.Module, batch: Tensor) -> Tensor:
        with documents.active():
            return shifted_loss(model, batch)

    def packed(lengths: list[int], length: int = 65) -> Tensor:  # documents of these lengths, each ended by token 0
        tokens = torch.randint(1, 64, (2, length), generator=generator)
        tokens[:, torch.tensor(lengths).cumsum(0) - 1] = 0
        return tokens

    dealt = []  # rank 0's positions, batch by batch
    for lengths in ([40], [9, 30, 20]):
        documents.see(packed(lengths))
        one_process_and_split(compiled, documents.tokens, loss_within_documents, cp)
        dealt.append(cp.positions(32).tolist())
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            documents.see(packed([5, 20, 10, 5]))
            results["llama_ring_compiled_blocks_documents"] = one_process_and_split(
                compiled, documents.tokens, loss_within_documents, cp
            )
            dealt.append(cp.positions(32).tolist())
    except RuntimeError as error:
        results["llama_ring_compiled_blocks_documents"] = str(error)
    results["chunks_dealt_by_documents"] = dealt
    # A batch of another length compiles the blocks for any length, where a check written `n in (size, size - 1)`,
    # which dynamo reads as False for symbolic sizes, made them attend within the last batch's documents, with no error
    documents.see(packed([9, 30, 20, 30], length=97))
    results["llama_ring_compiled_blocks_documents_longer"] = one_process_and_split(
        compiled, documents.tokens, loss_within_documents, cp
    )
    # Blocks compiled on one rank only, as where dynamo decides otherwise on each (a limit of recompiles reached on
    # one), over packed documents, which a compiled block attends within by another op: the ring's collectives are
    # its own, the same on every rank, one all-to-all for an attention's forward and two for its backward
    mixed = Llama("tiny").model
    if dist.get_rank() == 0:
        for block in mixed.layers:
            compile_block(block, backend="eager")
    mixed_documents = DocumentMasks(end_token=0, model=mixed)
    cp = ContextParallel(mesh, "ring", mixed)
    cp.attend_within(mixed_documents)
    mixed_documents.see(packed([9, 30, 20]))

    def loss_within_mixed_documents(model: nn.Module, batch: Tensor) -> Tensor:
        with mixed_documents.active():
            return shifted_loss(model, batch)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as collectives:
        results["llama_ring_compiled_on_one_rank"] = one_process_and_split(
            mixed, mixed_documents.tokens, loss_within_mixed_documents, cp
        )
    all_to_alls = sum(event.name == "gloo:all_to_all" for event in collectives.events())
    results["ring_all_to_alls_per_attention"] = [None, None]
    dist.all_gather_object(results["ring_all_to_alls_per_attention"], all_to_alls / len(mixed.layers))

    # Documents packed by their positions (DataCollatorWithFlattening), 40, 12 and 12 tokens: the model looks for
    # them in position_ids as it runs, after the split, so the ring keeps the chunks from each end in the first step,
    # and from the next on deals them by the documents' work. A step that then attends across them (a call with a
    # cache, or ALiBi without position_ids: Falcon's bias per key, BLOOM's scores by hand) attends at the dealt chunks
    # causally over the whole sequence
    rows = (tokens[0, :40], tokens[1, :12], tokens[1, 20:32])
    flattened_long = transformers.DataCollatorWithFlattening()([{"input_ids": row.tolist()} for row in rows])
    packed = hf_causal_lm("llama", **HF_TINY, use_cache=False)
    cp = ContextParallel(mesh, "ring", packed)
    held_by_step = []
    for step in ("hf_llama_ring_flattened_first_step", "hf_llama_ring_flattened_dealt"):
        results[step] = one_process_and_split(packed, flattened_long, labels_loss, cp)
        held_by_step.append(cp.positions(32).tolist())
    packed.config.use_cache = True
    results["hf_llama_ring_flattened_dealt_with_a_cache"] = one_process_and_split(
        packed, flattened_long, labels_loss, cp
    )
    held_by_step.append(cp.positions(32).tolist())

    def without_positions(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    for name, model in (("falcon", alibi), ("bloom", bloom)):
        cp = ContextParallel(mesh, "ring", model)
        cp.find_documents = transformers.masking_utils.find_packed_sequence_indices  # as an earlier step's model
        results[f"hf_{name}_alibi_ring_flattened_dealt"] = one_process_and_split(
            model, flattened_long, without_positions, cp
        )
        held_by_step.append(cp.positions(32).tolist())
    results["flattened_held_by_step"] = held_by_step
    # Blocks compiled as compile=True compiles them under context parallelism, called with the batch's own
    # position_ids (a rank's share of them, which dynamo's guards would otherwise read the whole sequences of), then on
    # documents found by them, in batches of two lengths
    compiled_hf = hf_causal_lm("llama", **HF_TINY, use_cache=False)
    for layer in compiled_hf.model.layers:
        compile_block(layer, backend="eager")
    positioned = {"input_ids": tokens[:, :40], "labels": tokens[:, :40], "position_ids": torch.arange(40).expand(2, -1)}
    cp = ContextParallel(mesh, "ring", compiled_hf)
    shorter = transformers.DataCollatorWithFlattening()([{"input_ids": row.tolist()} for row in tokens[:, :20]])
    for name, batch in (("given_position_ids", positioned), ("flattened", flattened_long), ("shorter", shorter)):
        results[f"hf_llama_ring_compiled_blocks_{name}"] = one_process_and_split(compiled_hf, batch, labels_loss, cp)

    # Activation memory per rank: half of one process's, for a sequence twice as long as a rank holds
    long = torch.randint(0, 64, (1, 64), generator=generator)
    for method in ("all_to_all", "ring"):  # the ring keeps its own keys and values, not the gathered whole
        results[f"saved_ratio_{method}"] = saved_activation_bytes(
            llama, long, ContextParallel(mesh, method, llama)
        ) / saved_activation_bytes(llama, long, None)
    # The ring keeps its own queries, keys and values for backward, not every rank's keys and values gathered
    held = [torch.randn(1, 4, 32, 8, requires_grad=True) for _ in range(3)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ContextParallel(mesh, "ring", llama).attention(*held, is_causal=True)
    results["ring_saved_over_held"] = sum(saved) / sum(t.numel() for t in held)
    # Attention written by hand keeps the other rank's keys and values too, gathered for its scores
    for name, model in BY_HAND.items():
        model = model()
        results[f"saved_ratio_{name}"] = saved_activation_bytes(
            model, long, ContextParallel(mesh, "auto", model)
        ) / saved_activation_bytes(model, long, None)

    def step_on(model: nn.Module, batch, method: str = "auto", loss_of=labels_loss, pipelined: bool = False) -> Tensor:
        cp = ContextParallel(mesh, method, model, pipelined)
        with cp.active():
            return loss_of(model, cp.shard_batch(batch))

    def labels_joined(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:  # a column of labels of its own
        labels = batch["labels"]
        labels = torch.hstack((labels[..., 1:], torch.zeros((labels.shape[0], 1), dtype=labels.dtype)))
        return F.cross_entropy(model(input_ids=batch["input_ids"]).logits.flatten(0, 1), labels.flatten())

    def reshaped_then_shifted(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:  # the view takes the share
        tokens = batch["input_ids"].view(batch["input_ids"].size(0), -1)
        return F.cross_entropy(model(input_ids=tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())

    def two_losses(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return shifted_logits_loss(model, batch) + 0.1 * shifted_logits_loss(model, batch)

    def per_sequence_mean(model: nn.Module, batch: Tensor) -> Tensor:  # each sequence's mean, then the batch's
        losses = F.cross_entropy(model(batch[:, :-1]).transpose(1, 2), batch[:, 1:], reduction="none")
        return losses.mean(dim=1).mean()

    def sequence_classification(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:  # the last token's logits
        return model(input_ids=batch["input_ids"], labels=torch.tensor([0, 1])).loss

    torch.manual_seed(0)
    classifier = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**HF_TINY, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    )
    # Attention beside Mamba layers (a causal convolution over positions), and RWKV's token shift (a pad by one)
    jamba = hf_causal_lm(
        "jamba", **HF_TINY, num_experts=2, attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False
    )
    rwkv = hf_causal_lm("rwkv", vocab_size=64, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64)
    falcon_eager = hf_causal_lm("falcon", **HF_TINY, new_decoder_architecture=False, alibi=True)
    falcon_eager.config._attn_implementation = "eager"
    # ALiBi's bias, a mask of the model's own, over packed documents: refused, as one process refuses it
    two_documents = torch.randint(1, 64, (2, 32), generator=generator)
    two_documents[:, 9] = 0

    def step_within_documents(model: nn.Module, batch: dict[str, Tensor], method: str) -> Tensor:
        documents = DocumentMasks(end_token=0, model=model)
        cp = ContextParallel(mesh, method, model)
        cp.attend_within(documents)
        documents.see(batch)
        with documents.active(), cp.active():
            return labels_loss(model, cp.shard_batch(batch))

    left_padded = dict(collated, attention_mask=kept.flip(-1).long())
    # Documents packed into one row, positions restarting at each, marked by end tokens too
    flattened = transformers.DataCollatorWithFlattening()([{"input_ids": row.tolist()} for row in tokens[:3, :13]])

    packed_eager = hf_causal_lm("llama", **HF_TINY, use_cache=False)
    packed_eager.config._attn_implementation = "eager"  # scores by hand, which the documents' attention cannot reach

    def sliced_first(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:  # computes on each sequence's first 3
        return labels_loss(model, batch) + (batch["input_ids"][:, :3] * 2).float().mean()

    labelled_padding = dict(collated, labels=tokens[:, :38])
    results["errors"] = {
        "indivisible": raised(step_on, hf_llama(), {"input_ids": tokens[:, :30]}),
        "left_padding": raised(step_on, hf_llama(), left_padded),
        "labelled_padding": raised(step_on, hf_llama(), labelled_padding),
        "broadcast_attention": raised(step_on, nanogpt(BroadcastAttention), windows_of_65, "auto", nanogpt_loss),
        "alibi_from_a_table": raised(
            step_on, hf_causal_lm("mpt", vocab_size=64, d_model=64, n_layers=2, n_heads=4), collated
        ),
        "scores_viewed_by_share": raised(step_on, falcon_eager, collated),
        "heads_do_not_divide": raised(step_on, hf_llama(heads=3, kv_heads=3), collated, "all_to_all"),
        "labels_joined": raised(step_on, hf_llama(), collated, "auto", labels_joined),
        "two_losses_of_a_shift": raised(step_on, hf_llama(), collated, "auto", two_losses),
        "share_shifted": raised(step_on, hf_llama(), collated, "auto", reshaped_then_shifted),
        "shift_in_a_pipeline": raised(step_on, hf_llama(), collated, "auto", shifted_logits_loss, True),
        "per_sequence_mean": raised(step_on, llama, windows, "auto", per_sequence_mean),
        "sliding_window": raised(step_on, hf_causal_lm("mistral", **HF_TINY, sliding_window=8), collated),
        "sliced_sequences": raised(step_on, hf_llama(), collated, "auto", sliced_first),
        "packed_by_positions_attended_by_hand": raised(step_on, packed_eager, flattened, "ring"),
        "packed_by_end_tokens_and_positions": raised(
            step_within_documents, hf_causal_lm("llama", **HF_TINY, use_cache=False), flattened, "ring"
        ),
        "hybrid_with_mamba": raised(step_on, jamba, collated),
        "token_shift": raised(step_on, rwkv, collated),
        "sequence_classification": raised(step_on, classifier, collated, "auto", sequence_classification),
        **{
            f"alibi_within_documents_{method}": raised(
                step_within_documents, alibi, {"input_ids": two_documents, "labels": two_documents}, method
            )
            for method in ("ring", "all_to_all")
        },
    }
    return results


@pytest.fixture(scope="module")
def plain_loop() -> dict:
    # About 100 s alone, 250 s to over 300 s beside another group's ranks on 2 cores: the limit of the other large
    # groups (pytest's own is 600 s)
    return run_ranks(2, context_parallel_in_a_plain_loop, timeout=560)[0]


@pytest.mark.parametrize(
    "name",
    [
        "hf_llama_ring",
        "hf_llama_all_to_all",
        "hf_llama_shifted_logits",
        "hf_llama_torchtune_shift",
        "hf_llama_ring_full_checkpointing",
        "hf_opt_ring",
        "hf_falcon_causal_mask",
        "hf_falcon_alibi_all_to_all",
        "hf_falcon_alibi_ring",
        "hf_deepseek_v3_ring_values_of_another_size",
        "hf_llama_eager",
        "hf_bloom_alibi",
        "nanogpt_slow_attention",
        "nanogpt_slow_attention_traced",
        "nanogpt_buffer_attention",
        "nanogpt_einsum_attention",
        "llama_ring",
        "llama_shift_of_a_split_length",
        "llama_rolled_targets",
        "llama_ring_compiled_blocks",
        "llama_ring_compiled_blocks_documents",
        "llama_ring_compiled_blocks_documents_longer",
        "hf_llama_ring_flattened_first_step",
        "hf_llama_ring_flattened_dealt",
        "hf_llama_ring_flattened_dealt_with_a_cache",
        "hf_llama_ring_compiled_blocks_given_position_ids",
        "hf_llama_ring_compiled_blocks_flattened",
        "hf_llama_ring_compiled_blocks_shorter",
        "llama_ring_compiled_on_one_rank",
        "hf_falcon_alibi_ring_flattened_dealt",
        "hf_bloom_alibi_ring_flattened_dealt",
    ],
)
def test_half_of_each_sequence_per_rank_computes_what_one_process_computes(plain_loop: dict, name: str) -> None:
    assert isinstance(plain_loop[name], dict), plain_loop[name]  # or what the run raised
    assert plain_loop[name]["loss"] < 1e-5
    assert plain_loop[name]["gradients"] < 1e-4


def test_the_rings_collectives_are_the_same_on_every_rank_whether_its_blocks_compiled_or_not(plain_loop: dict) -> None:
    """Keys and values travel together: one all-to-all forward; backward gathers them again and returns their
    gradients. Ranks that ran different collectives would hang, or swap keys' and values' gradients unnoticed."""
    assert plain_loop["ring_all_to_alls_per_attention"] == [3, 3]


def test_the_check_of_a_step_runs_compiled_blocks_without_compiling_them(plain_loop: dict) -> None:
    assert plain_loop["graphs_compiled_by_the_check"] == 0  # 24 where it compiled the blocks for its runs
    assert plain_loop["graphs_compiled_by_a_step"] > 0


def test_each_batch_deals_the_chunks_by_its_own_documents(plain_loop: dict) -> None:
    dealt = plain_loop["chunks_dealt_by_documents"]
    assert len(dealt) == 3 and len({tuple(positions) for positions in dealt}) == 3


def test_documents_packed_by_positions_deal_the_chunks_once_the_model_has_looked_for_them(plain_loop: dict) -> None:
    first, dealt, *attended_across = plain_loop["flattened_held_by_step"]  # a cache, Falcon's ALiBi, BLOOM's
    assert first == load_balanced_positions(64, 2, rank=0).tolist()
    assert dealt != first and attended_across == [dealt] * 3


@pytest.mark.parametrize("method", ["all_to_all", "ring"])
def test_each_rank_keeps_half_the_activations_as_the_planner_estimates(plain_loop: dict, method: str) -> None:
    with torch.device("meta"):
        shape = ModelShape(Llama("tiny"))
    training, cluster = Training(seq_len=64, global_batch=1, precision="32-true"), Cluster(gpus=2)
    whole, split = (estimate(shape, Layout(1, 1, 1, cp=cp), training, cluster).activations for cp in (1, 2))
    assert split / whole == 0.5
    assert plain_loop[f"saved_ratio_{method}"] == pytest.approx(split / whole, abs=0.05)
    assert plain_loop["ring_saved_over_held"] == 1.0  # its queries, keys and values, gathered again in backward


@pytest.mark.parametrize("name", BY_HAND)
def test_attention_by_hand_keeps_the_gathered_keys_and_values_as_the_planner_estimates(
    plain_loop: dict, name: str
) -> None:
    with torch.device("meta"):
        shape = ModelShape(BY_HAND[name]())
    training, cluster = Training(seq_len=64, global_batch=1, precision="32-true"), Cluster(gpus=2)
    whole, split = (estimate(shape, Layout(1, 1, 1, cp=cp), training, cluster).activations for cp in (1, 2))
    assert split / whole > 0.52
    assert plain_loop[f"saved_ratio_{name}"] == pytest.approx(split / whole, abs=0.02)


def test_what_cannot_be_split_is_refused_with_the_way_out(plain_loop: dict) -> None:
    errors = plain_loop["errors"]
    assert "a sequence here has 30 tokens, not a multiple of 4" in errors["indivisible"]
    assert "pad_to_multiple_of=4" in errors["indivisible"]
    assert "pads on the left or masks inside a sequence. Pad on the right" in errors["left_padding"]
    assert "labels padding tokens. Label padding -100" in errors["labelled_padding"]
    assert "computed no torch.nn.functional.scaled_dot_product_attention" in errors["broadcast_attention"]
    assert "not linear in the key's position, as ALiBi's is" in errors["alibi_from_a_table"]
    assert "then views the scores with 20 keys" in errors["scores_viewed_by_share"]
    assert "attn_implementation='sdpa'" in errors["scores_viewed_by_share"]
    assert "3 query and 3 key/value heads (per tensor-parallel rank) do not divide" in errors["heads_do_not_divide"]
    assert "joins a batch's sequences to tensors of its own" in errors["labels_joined"]
    assert "with or without a column of -100 joined after it, as torchtune does" in errors["labels_joined"]
    assert "this step computed 2 means over tokens, not one" in errors["two_losses_of_a_shift"]
    assert "shifts a tensor that holds this rank's share of each sequence ((2, 20), the last" in errors["share_shifted"]
    assert "Shift the batch's own tensors first" in errors["share_shifted"]
    assert "a pipeline weighs its microbatches before their loss" in errors["shift_in_a_pipeline"]
    assert "Feed windows of one token more than the model takes" in errors["shift_in_a_pipeline"]
    assert "computes mean along the sequence of a tensor that holds this rank's share" in errors["per_sequence_mean"]
    assert "(2, 32)" in errors["per_sequence_mean"] and "loss.sum() / mask.sum()" in errors["per_sequence_mean"]
    assert "computes argmax along the sequence" in errors["sequence_classification"]
    for method in ("ring", "all_to_all"):
        assert (
            "document_end_token=0: the model's attention passes a mask of its own"
            in (errors[f"alibi_within_documents_{method}"])
        )
    assert "computes conv1d along the sequence of a tensor that holds this rank's share" in errors["hybrid_with_mamba"]
    assert "computes pad along the sequence" in errors["token_shift"] and "RWKV's" in errors["token_shift"]
    assert "computes on a slice of its sequences (3 tokens of each" in errors["sliced_sequences"]
    assert "Mark the documents one way" in errors["packed_by_end_tokens_and_positions"]
    assert (
        "position_ids that restart within a sequence: the batch packs several documents"
        in (errors["packed_by_positions_attended_by_hand"])
    )
    assert "attn_implementation='sdpa'" in errors["packed_by_positions_attended_by_hand"]
    assert (
        "attention takes a mask: a mask other than causal (left padding, packed documents, sliding windows)"
        in (errors["sliding_window"])
    )


def test_each_rank_holds_a_chunk_from_each_end() -> None:
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([load_balanced_positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))


@pytest.mark.parametrize("ranks", [2, 4])
def test_within_long_packed_documents_the_chunks_are_dealt_by_their_documents_work(ranks: int) -> None:
    """A query's attention within documents scores the keys from its document's start: with documents of 6000 tokens
    in windows of 16k, the chunks from each end leave one rank 1.5x (4 ranks: 2x) the other's work; chunks dealt out
    by it keep every rank within 8% of the others, each holding as many tokens, together the whole sequence."""
    tokens = torch.ones(2, 16384, dtype=torch.long)
    tokens[0, 5999::6000] = 0
    tokens[1, 2999::6000] = 0  # the second sequence's documents cut elsewhere
    ids = document_ids(tokens, end_token=0)
    from_each_end = [load_balanced_positions(16384, ranks, rank) for rank in range(ranks)]
    dealt = list(balanced_by_documents(ids, ranks))
    assert busiest_over_least_busy(from_each_end, ids) > 1.25
    assert busiest_over_least_busy(dealt, ids) < 1.08
    assert all(len(positions) == 16384 // ranks for positions in dealt)
    assert sorted(torch.cat(dealt).tolist()) == list(range(16384))
    # one document a sequence: dealt as evenly as the chunks from each end
    one_document = torch.zeros(1, 16384, dtype=torch.long)
    assert busiest_over_least_busy(list(balanced_by_documents(one_document, ranks)), one_document) < 1.05


def busiest_over_least_busy(held: list[Tensor], ids: Tensor) -> float:
    """The most attention within documents a rank's ``held`` positions score over the least: each query's keys from
    its document's start, summed over the sequences."""
    work = (document_positions(ids) + 1).sum(0)
    loads = [int(work[positions].sum()) for positions in held]
    return max(loads) / min(loads)


# A user's own fine-tuning script, as `python train.py` runs it under Lightning's own launcher: a Hugging Face Llama
# computing its loss from labels, collated batches padded to a multiple of 8 with -100 labels, Lightning's
# ModelCheckpoint saving in the background, every block recomputed in backward. `--one-process` trains it on one
# process, without lightdist.
LONG_CONTEXT_SCRIPT = """
import json
import sys

import torch
import transformers
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler


class FineTuning(LightningModule):
    def __init__(self):
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(self.trainer.callback_metrics["train_loss"].item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def collate(documents):
    length = -(-max(len(document) for document in documents) // 8) * 8
    input_ids = torch.zeros(len(documents), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, document in enumerate(documents):
        input_ids[row, : len(document)] = torch.tensor(document)
        attention_mask[row, : len(document)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


if __name__ == "__main__":
    seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(1, 64, (int(n),), generator=generator).tolist() for n in torch.randint(20, 60, (12,))]
    if "--one-process" in sys.argv:  # in the order Lightning's own sampler deals the parallel run: shuffled, seed 0
        strategy, devices = "auto", 1
        order = DistributedSampler(documents, num_replicas=1, rank=0, shuffle=True, seed=0)
    else:
        from lightdist.plugins import ParallelStrategy

        strategy, devices = ParallelStrategy(context_parallel_size=2, activation_checkpointing="full"), 2
        order = None
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=2)],
    )
    model = FineTuning()
    trainer.fit(model, DataLoader(documents, batch_size=4, sampler=order, collate_fn=collate))
    if trainer.is_global_zero:
        print("losses:", json.dumps(model.losses))
"""


def test_a_users_own_script_trains_long_sequences_with_recomputed_blocks_as_one_process_does(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LONG_CONTEXT_SCRIPT)
    runs = {  # side by side: the one process trains on the core the two ranks leave idle
        name: subprocess.Popen(
            [sys.executable, "train.py", *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in (("cp2", []), ("one_process", ["--one-process"]))
    }
    losses, printed = {}, {}
    for name, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-3000:]
        (line,) = [line for line in stdout.splitlines() if line.startswith("losses: ")]
        losses[name], printed[name] = json.loads(line.removeprefix("losses: ")), stdout + stderr
    assert (
        "each sequence split over 2 ranks (attention: all_to_all, auto), full activation checkpointing"
        in (printed["cp2"])
    )
    assert len(losses["cp2"]) == 3
    assert losses["cp2"] == pytest.approx(losses["one_process"], rel=1e-5)
