"""A few steps of the tiny reference LLMs, run the same way by a single process and by every rank of a parallel run.

The parallel run sees the same global batches as the single process: each of ``dp`` ranks takes ``batch_size``
windows, and the distributed sampler interleaves ranks so that together they cover exactly the single process's
batch of ``dp * batch_size`` windows.

The learning rate is a moderate 1e-3: Adam moves every weight by about the learning rate whatever its gradient's size,
so where a gradient nearly cancels, summation-order noise (1e-7 relative) moves the weight by a share of the learning
rate. Final weights then agree within 1e-5 at 1e-3, and the gap grows linearly with the rate.
"""

from __future__ import annotations

import json
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from fsspec import AbstractFileSystem
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.loggers import Logger
from tokenizers import Tokenizer
from tokenizers import models as tokenizer_models
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, Dataset

from lightdist.checkpoint.async_checkpoint import WRITER_THREADS
from lightdist.data.prepare import prepare
from lightdist.models import GPT2, HuggingFaceCausalLM, Llama, MoELlama, TokenDataModule
from lightdist.models.data import ARITHMETIC_ALPHABET, arithmetic_corpus
from lightdist.models.lm import CausalLM
from lightdist.parallel.pipeline.microbatches import examples_in
from lightdist.parallel.sharding import local_tensor
from lightdist.plugins import ModelCheckpoint, ParallelStrategy, TrainingMonitor
from lightdist.verify import ShardedOrder

import zoo
from multirank import run_ranks_beside


class _Mixer(nn.Module):
    """Attention under names no rule knows, q, k and v fused and cut apart with ``chunk``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.to_qkv = nn.Linear(width, 3 * width, bias=False)
        self.to_out = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.heads, self.head_dim).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(y.transpose(1, 2).reshape(B, T, -1))


class _GatedFeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.expand = nn.Linear(width, 2 * hidden, bias=False)  # gate and up, fused
        self.contract = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.expand(x).chunk(2, dim=-1)
        return self.contract(F.silu(gate) * up)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mixer_norm, self.mixer = nn.LayerNorm(width), _Mixer(width, heads=4)
        self.ffn_norm, self.ffn = nn.LayerNorm(width), _GatedFeedForward(width, hidden=96)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class UnknownFamilyLM(CausalLM):
    """A user's own LLM that no naming rule covers: tensor parallelism finds its plan from the data flow."""

    def __init__(self, learning_rate: float, warmup_steps: int, weight_decay: float = 0.1) -> None:
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps)
        self.embed = nn.Embedding(64, 64)
        self.blocks = nn.ModuleList(_Block(64) for _ in range(2))
        self.final_norm = nn.LayerNorm(64)
        self.unembed = nn.Linear(64, 64, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.final_norm(x))


class _ListedExperts(nn.Module):
    """A MoE feed-forward as transformers 4 wrote Mixtral's: a router, and its experts a list called one by one."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(_GatedFeedForward(width, hidden=32) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(0, 1)
        weights, chosen = torch.topk(F.softmax(self.gate(tokens), dim=-1), 2)
        out = torch.zeros_like(tokens)
        expert_mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for hit in torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero():  # only the experts that got tokens
            slot, rows = torch.where(expert_mask[hit].squeeze(0))
            out.index_add_(0, rows, self.experts[hit](tokens[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class ListedExpertsLM(UnknownFamilyLM):
    """The unknown family with a MoE feed-forward whose experts are a list of modules."""

    def __init__(self, learning_rate: float, warmup_steps: int) -> None:
        super().__init__(learning_rate=learning_rate, warmup_steps=warmup_steps)
        for block in self.blocks:
            block.ffn = _ListedExperts(64)


class _DeepSeekStyleMoE(nn.Module):
    """DeepSeek's MoE as its users write it: a shared expert every token goes through beside many small routed experts
    (fine-grained), chosen by a sigmoid router whose top scores are normalized to sum to one."""

    def __init__(self, width: int, experts: int = 8, top_k: int = 2, hidden: int = 16) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(_GatedFeedForward(width, hidden) for _ in range(experts))
        self.shared_experts = _GatedFeedForward(width, 2 * hidden)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(0, 1)
        weights, chosen = torch.topk(torch.sigmoid(self.gate(tokens)), self.top_k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = torch.zeros_like(tokens)
        for index in chosen.unique().tolist():
            rows, slot = torch.where(chosen == index)
            routed.index_add_(0, rows, self.experts[index](tokens[rows]) * weights[rows, slot, None])
        return (routed + self.shared_experts(tokens)).view_as(x)


class DeepSeekStyleLM(UnknownFamilyLM):
    """The unknown family with a DeepSeek-style MoE feed-forward written here: shared and fine-grained experts."""

    def __init__(self, learning_rate: float, warmup_steps: int) -> None:
        super().__init__(learning_rate=learning_rate, warmup_steps=warmup_steps)
        for block in self.blocks:
            block.ffn = _DeepSeekStyleMoE(64)


class SequentialBlocksLM(CausalLM):
    """A user's LLM in the style of many tutorials: blocks in an ``nn.Sequential``, learned positions, the LM head tied
    to the embedding. With no ``ModuleList`` to loop over, pipeline stages are cut by torch's tracer."""

    def __init__(self, learning_rate: float, warmup_steps: int, weight_decay: float = 0.1) -> None:
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps)
        self.embed, self.positions = nn.Embedding(64, 64), nn.Embedding(64, 64)
        self.blocks = nn.Sequential(*(_Block(64) for _ in range(4)))
        self.final_norm = nn.LayerNorm(64)
        self.unembed = nn.Linear(64, 64, bias=False)
        self.unembed.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # the head's scale

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return self.unembed(self.final_norm(self.blocks(x)))


class _PositionedBlock(_Block):
    """A block that looks its positions up in a table of its own, by the indices it is given."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.positions = nn.Embedding(64, width)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return super().forward(x + self.positions(positions))


class PositionIndexedLM(UnknownFamilyLM):
    """Positions computed once, before the blocks, and handed to every block as indices into its table (as Hugging
    Face models hand ``position_ids`` on): a traced pipeline's later stages are handed integers."""

    def __init__(self, learning_rate: float, warmup_steps: int) -> None:
        super().__init__(learning_rate=learning_rate, warmup_steps=warmup_steps)
        self.blocks = nn.ModuleList(_PositionedBlock(64) for _ in range(4))

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.unembed(self.final_norm(x))


class HeldSequentialLM(CausalLM):
    """The whole network one ``nn.Sequential`` held as ``self.model`` (embedding, blocks, norm, head; no positions),
    the step calling ``self.model(inputs)``: the tracer traces the module the step calls."""

    def __init__(self, learning_rate: float, warmup_steps: int, weight_decay: float = 0.1) -> None:
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps)
        blocks = (_Block(64) for _ in range(4))
        self.model = nn.Sequential(nn.Embedding(64, 64), *blocks, nn.LayerNorm(64), nn.Linear(64, 64, bias=False))

    def loss(self, batch: Tensor) -> Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        return F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())


class _TwoStreamBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        residual = x + residual
        return self.proj(residual), residual


class TwoStreamLM(nn.Module):
    """Its blocks hand on the hidden states and a residual stream, as Mamba's do: a pipeline stage cut by structure
    hands the next stage one tensor, a traced one every value."""

    def __init__(self, vocab: int = 16, width: int = 8, blocks: int = 4) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.layers = nn.ModuleList(_TwoStreamBlock(width) for _ in range(blocks))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        residual = torch.zeros_like(x)
        for block in self.layers:
            x, residual = block(x, residual)
        return self.head(x + residual)


class MoELlamaRoutedToTheFirstExperts(MoELlama):
    """Every router prefers experts 0 and 1 by far (a bias a few steps cannot unlearn), so under ep=2 the second
    rank's experts get no token at all."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("tiny", config={"aux_loss_coef": 0.0}, **kwargs)
        for layer in self.model.layers:
            preferred = torch.zeros(self.config.n_experts)
            preferred[:2] = 8.0
            layer.mlp.gate.bias = nn.Parameter(preferred)


# Final weights after a few AdamW steps of lr=1e-3. Adam moves a weight whose gradient is near zero by lr * m /
# (sqrt(v) + eps), which rounding in that gradient shifts by a few percent of lr: one weight in 11k of LitGPT's MLP ends
# 1.8e-5 apart at tp=2, where the same runs with SGD end 7.5e-8 apart; one in 12k of GPT-2's fused qkv 1.2e-5 apart
# after resuming a tp=2 run on dp=2; one in 2k of Qwen3's v_proj 9.2e-5 apart at tp=2 with its attention global (the
# rest of that weight within 3e-6). A wrong split moves whole tensors by about lr.
WEIGHT_ATOL = 1e-4

HF_TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
MODELS = {
    "llama": partial(Llama, "tiny"),
    "llama_tied": partial(Llama, "tiny", config={"tie_embeddings": True}),
    "llama_vocab512": partial(Llama, "tiny", config={"vocab_size": 512}),  # for tokenizers trained on real text
    "gpt2": partial(GPT2, "tiny"),
    # The key bias's true gradient is zero (softmax ignores a constant added to all of a query's scores), so Adam turns
    # its float noise into learning-rate-sized steps that differ between layouts; tensor-parallel runs compare
    # weights without biases, and tests/test_tensor_parallel_plan.py checks the fused biases' layout on their own.
    "gpt2_no_bias": partial(GPT2, "tiny", config={"bias": False}),
    "gpt2_dropout": partial(GPT2, "tiny", config={"dropout": 0.1}),  # each rank draws its own masks
    "unknown_family": UnknownFamilyLM,
    "listed_experts": ListedExpertsLM,
    "deepseek_style": DeepSeekStyleLM,
    "sequential_blocks": SequentialBlocksLM,
    "hf_llama": partial(HuggingFaceCausalLM, config=dict(HF_TINY, model_type="llama", num_key_value_heads=2)),
    "hf_qwen2": partial(HuggingFaceCausalLM, config=dict(HF_TINY, model_type="qwen2", num_key_value_heads=2)),
    # Biases on the row-parallel layers, learned positions, tied embeddings; no dropout, so runs are deterministic.
    "hf_opt": partial(
        HuggingFaceCausalLM,
        config=dict(HF_TINY, model_type="opt", ffn_dim=176, word_embed_proj_dim=64, dropout=0.0),
    ),
    # ALiBi biases built outside the blocks from the global head count, q, k and v interleaved per head in one Linear,
    # the residual added inside attention and MLP; its own config names (n_layer, n_head), embeddings tied.
    "hf_bloom": partial(
        HuggingFaceCausalLM,
        config=dict(
            model_type="bloom",
            vocab_size=64,
            hidden_size=64,
            n_layer=2,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    # Third-party model code in LightningModules written as their users write them (tests/zoo.py).
    "moe": partial(MoELlama, "tiny"),
    # The load-balancing loss is over each rank's tokens, so only without it does data parallelism equal one process.
    "moe_lm_only": partial(MoELlama, "tiny", config={"aux_loss_coef": 0.0}),
    "moe_3_experts": partial(MoELlama, "tiny", config={"n_experts": 3}),
    "moe_routed_to_the_first_experts": MoELlamaRoutedToTheFirstExperts,
    "hf_mixtral": partial(
        HuggingFaceCausalLM, config=dict(zoo.HF_TINY_MOE, model_type="mixtral", **zoo.HF_MOE_FAMILIES["mixtral"])
    ),
    **{
        f"zoo_hf_{family}_{style}": partial(
            zoo.HuggingFaceLabels if style == "labels" else zoo.HuggingFaceLogits,
            model_type=family,
            output_router_logits=style == "labels",
            **dict(zoo.HF_TINY_MOE, **extra),
        )
        for family, extra in zoo.HF_MOE_FAMILIES.items()
        for style in ("labels", "logits")
    },
    "zoo_nanogpt": zoo.NanoGPT,
    "zoo_nanogpt_slow_attention": partial(zoo.NanoGPT, flash=False),
    "zoo_nanogpt_sliced_positions": partial(zoo.NanoGPT, network=zoo.SlicedPositionsGPT),
    "zoo_nanogpt_table_positions": partial(zoo.NanoGPT, network=zoo.TablePositionsGPT),
    "zoo_nanogpt_sinusoidal_positions": partial(zoo.NanoGPT, network=zoo.SinusoidalPositionsGPT),
    "zoo_litgpt": zoo.LitGPT,
    # LitGPT's Mixtral-style MoE: its experts a list of modules that LLaMAMoE's loop calls one by one.
    "zoo_litgpt_moe": partial(
        zoo.LitGPT, mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=64
    ),
    "zoo_hf_llama_labels": partial(zoo.HuggingFaceLabels, model_type="llama", num_key_value_heads=2, **zoo.HF_TINY),
    "zoo_hf_qwen2_logits": partial(zoo.HuggingFaceLogits, model_type="qwen2", num_key_value_heads=2, **zoo.HF_TINY),
    "zoo_hf_qwen2_shifted_logits": partial(
        zoo.HuggingFaceShiftedLogits, model_type="qwen2", num_key_value_heads=2, **zoo.HF_TINY
    ),
    "zoo_hf_llama_base_and_head": partial(
        zoo.HuggingFaceBaseAndHead, model_type="llama", num_key_value_heads=2, **zoo.HF_TINY
    ),
    "zoo_hf_mistral_logits": partial(zoo.HuggingFaceLogits, model_type="mistral", num_key_value_heads=2, **zoo.HF_TINY),
    # Each head's queries and keys normed (q_norm, k_norm) after the projections: their weights see every head
    **{
        f"zoo_hf_{family}_logits": partial(
            zoo.HuggingFaceLogits, model_type=family, num_key_value_heads=2, head_dim=16, **zoo.HF_TINY
        )
        for family in ("qwen3", "gemma3_text")
    },
    "zoo_hf_gemma_labels": partial(
        zoo.HuggingFaceLabels, model_type="gemma", num_key_value_heads=1, head_dim=16, **zoo.HF_TINY
    ),
    "zoo_hf_phi3_labels": partial(
        zoo.HuggingFaceLabels, model_type="phi3", num_key_value_heads=2, pad_token_id=0, **zoo.HF_TINY
    ),
    "zoo_hf_neox_logits": partial(
        zoo.HuggingFaceLogits, model_type="gpt_neox", hidden_dropout=0.0, attention_dropout=0.0, **zoo.HF_TINY
    ),
    "zoo_hf_opt_labels": partial(
        zoo.HuggingFaceLabels, model_type="opt", ffn_dim=176, word_embed_proj_dim=64, dropout=0.0, **zoo.HF_TINY
    ),
    "zoo_hf_falcon_logits": partial(
        zoo.HuggingFaceLogits,
        model_type="falcon",
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        bias=False,
        alibi=False,
        **zoo.HF_TINY,
    ),
    # ALiBi, added to the causal mask that Falcon builds and hands to scaled_dot_product_attention; one key/value head
    "zoo_hf_falcon_alibi_labels": partial(
        zoo.HuggingFaceLabels, model_type="falcon", new_decoder_architecture=False, alibi=True, **zoo.HF_TINY
    ),
    "zoo_hf_gpt2_labels": partial(zoo.HuggingFaceLabels, **zoo.HF_TINY_GPT2),
    # BLOOM norms its embeddings before its blocks and adds ALiBi in attention written by hand; its own config names
    "zoo_hf_bloom_labels": partial(
        zoo.HuggingFaceLabels,
        model_type="bloom",
        vocab_size=64,
        hidden_size=64,
        n_layer=4,
        n_head=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    # Fine-tuning on the batches people's loaders make (LoaderBatches): the collator's dict into the model's own loss
    "zoo_hf_llama_finetuning": partial(
        zoo.HuggingFaceFineTuning, model_type="llama", num_key_value_heads=2, **zoo.HF_TINY
    ),
    # Without a cache, as packed batches train: its mask keeps each document of a flattened batch to itself
    "zoo_hf_llama_finetuning_packed": partial(
        zoo.HuggingFaceFineTuning, model_type="llama", num_key_value_heads=2, use_cache=False, **zoo.HF_TINY
    ),
    "zoo_hf_gpt2_finetuning": partial(zoo.HuggingFaceFineTuning, **zoo.HF_TINY_GPT2),
    "zoo_hf_llama_finetuning_own_loss": partial(
        zoo.HuggingFaceFineTuningOwnLoss, model_type="llama", num_key_value_heads=2, **zoo.HF_TINY
    ),
    "zoo_hf_mixtral_finetuning": partial(
        zoo.HuggingFaceFineTuning, model_type="mixtral", **dict(zoo.HF_TINY_MOE, **zoo.HF_MOE_FAMILIES["mixtral"])
    ),
    "zoo_nanogpt_pairs": zoo.NanoGPTOnPairs,
    "zoo_nanogpt_ignoring_last_targets": zoo.NanoGPTIgnoringLastTargets,
    "zoo_lecture_gpt": zoo.LectureGPT,
    "held_sequential": HeldSequentialLM,
    "position_indexed": PositionIndexedLM,
}
# The zoo's other Hugging Face families, fine-tuned on collator batches as HuggingFaceFineTuning trains them.
ZOO_FAMILIES = ("qwen2_logits", "mistral_logits", "phi3_labels", "neox_logits", "opt_labels", "gemma_labels")
MODELS.update(
    {
        f"zoo_hf_{family.rsplit('_', 1)[0]}_finetuning": partial(
            zoo.HuggingFaceFineTuning, **MODELS[f"zoo_hf_{family}"].keywords
        )
        for family in ZOO_FAMILIES
    }
)


class LlamaWithOneBadBatch(Llama):
    """The tiny Llama, whose loss is NaN at optimizer step ``bad_step``."""

    def __init__(self, bad_step: int) -> None:
        super().__init__("tiny", learning_rate=1e-3, warmup_steps=2)
        self.bad_step = bad_step

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == self.bad_step else loss


@dataclass(frozen=True)
class Case:
    """One training configuration. ``strategy`` holds ParallelStrategy options; ``None`` is the plain single process."""

    strategy: dict[str, Any] | None = None
    model: str = "llama"
    # the first step from the initial weights, then two on the optimizer's state: each a loss, a gradient norm
    steps: int = 3
    batch_size: int = 4  # per data-parallel rank
    global_batch_size: int | None = None  # over all data-parallel ranks, in place of batch_size
    seq_len: int = 32
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    precision: str = "32-true"
    accelerator: str = "cpu"
    limit_train_batches: int | None = None  # batches per epoch
    shuffle: bool = False  # a parallel run's shuffled order is not the single process's: compare runs in one layout
    validate: bool = False  # after training, trainer.validate: its loss and perplexity must be the single process's
    val_check_interval: int | None = None  # also validate every this many batches while training
    # The batches: "windows" of tokens (one tensor); as people's loaders make them (LoaderBatches.FORMS)
    data: str = "windows"
    data_path: str | list[str] | None = None  # windows of prepared corpora (lightdist prepare); None: arithmetic
    data_weights: list[float] | None = None  # each corpus's share, where data_path lists several
    # Loader batches in a single process: drawn in the order of this many ranks' samplers (None: a parallel run's)
    sampled_as_ranks: int | None = None
    # Attention within each document the token ends; the single process too, as lightdist on one rank
    document_end_token: int | None = None
    mask_document_end_loss: bool = False  # with it, what each end token predicts left out of the loss

    def reference(self, world_size: int) -> Case:
        """The single-process run that must produce the same numbers as this one on ``world_size`` ranks."""
        strategy = self.strategy or {}
        data_parallel_size = world_size // (
            strategy.get("tensor_parallel_size", 1)
            * strategy.get("pipeline_parallel_size", 1)
            * strategy.get("context_parallel_size", 1)
        )
        # Batches of documents weigh by their tokens across an accumulation too: one step on all its batches at once.
        at_once = self.accumulate_grad_batches if self.data in ("padded", "varied", "flattened") else 1
        return Case(
            model=self.model,
            steps=self.steps,
            batch_size=self.batch_size * data_parallel_size * at_once,
            seq_len=self.seq_len,
            accumulate_grad_batches=self.accumulate_grad_batches // at_once,
            gradient_clip_val=self.gradient_clip_val,
            precision=self.precision,
            validate=self.validate,
            val_check_interval=self.val_check_interval,
            data=self.data,
            sampled_as_ranks=data_parallel_size if self.data in LoaderBatches.FORMS else None,
            document_end_token=self.document_end_token,
            mask_document_end_loss=self.mask_document_end_loss,
        )


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)  # per micro-batch, mean over the global batch
    logged: list[float] = field(default_factory=list)  # the user's self.log("train_loss", sync_dist=True)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full state dict after training
    validated: dict[str, float] = field(default_factory=dict)  # what trainer.validate returned after training
    grad_norms: list[float] = field(default_factory=list)  # per optimizer step, before clipping (TrainingMonitor)
    expert_imbalance: list[float] = field(default_factory=list)  # per optimizer step, MoE models (TrainingMonitor)
    # This rank's gradients as the optimizer steps: their elements (the last step's), and any not laid out as its
    # parameter is (where DTensor has no split rule for an op's backward, a rank holds the whole tensor's, Partial)
    gradient_elements: int = 0
    gradients_unlike_parameters: list[str] = field(default_factory=list)
    layout: str = ""  # the layout ParallelStrategy trained under
    error: str = ""  # the traceback of a run that raised: the runs after it in the same ranks still ran


class _RecordLosses(Callback):
    def __init__(self, result: Result) -> None:
        self.result = result

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step
        if isinstance(trainer.strategy, ParallelStrategy):
            self.result.layout = str(trainer.strategy.layout)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.result.losses.append(loss.item())
        self.result.logged.append(trainer.callback_metrics["train_loss"].item())
        if trainer.global_step > self.step:  # the optimizer stepped: the monitor logged the gradient's norm
            self.step = trainer.global_step
            self.result.grad_norms.append(trainer.callback_metrics["train/grad_norm"].item())
            if "moe/imbalance" in trainer.callback_metrics:
                self.result.expert_imbalance.append(trainer.callback_metrics["moe/imbalance"].item())


class _RecordGradients(Callback):
    def __init__(self, result: Result) -> None:
        self.result = result

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        held = {name: param for name, param in pl_module.named_parameters() if param.grad is not None}
        self.result.gradient_elements = sum(local_tensor(param.grad).numel() for param in held.values())
        self.result.gradients_unlike_parameters += [
            f"{name}: {_layout(param.grad)}, its parameter {_layout(param)}"
            for name, param in held.items()
            if _layout(param.grad) != _layout(param)
        ]


def _layout(tensor: Tensor) -> tuple:
    return tuple(getattr(tensor, "placements", ())), tuple(local_tensor(tensor).shape)


class _CountValidationWindows(Callback):
    """Logs the windows validated as a sum over ranks: each must count once, not once per tensor-parallel peer or
    pipeline stage."""

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        pl_module.log("val_windows", float(examples_in(batch)), reduce_fx="sum", sync_dist=True)


class LoaderBatches(LightningDataModule):
    """Batches as people's loaders make them, from plain DataLoaders to which Lightning adds its distributed sampler:
    ``"collated"``, Hugging Face's collator over documents of one length (a ``BatchEncoding``); ``"padded"``, over
    documents of many lengths, padded per batch (to 24 tokens, nearly every batch); ``"varied"``, the same up to 40
    tokens, so that batches differ in length; ``"flattened"``, the documents of many lengths packed into one row
    without padding, positions restarting at each (``DataCollatorWithFlattening``, TRL's ``padding_free``);
    ``"pairs"``, a ``TensorDataset``'s ``(inputs, targets)``. With
    ``sampled_as_ranks``, a single process draws the order that many ranks' samplers deal."""

    FORMS = ("collated", "padded", "varied", "pairs", "flattened")

    def __init__(self, form: str, batch_size: int, seq_len: int, validate: bool, sampled_as_ranks: int | None) -> None:
        super().__init__()
        self.form, self.batch_size, self.seq_len = form, batch_size, seq_len
        self.validate, self.sampled_as_ranks = validate, sampled_as_ranks

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._dataset(seed=0), shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader(self._dataset(seed=1), shuffle=False) if self.validate else []

    def _dataset(self, seed: int) -> Dataset:
        if self.form == "pairs":
            return zoo.pairs(512, self.seq_len, seed=seed)
        longest = 40 if self.form == "varied" else 24  # padded to each batch's longest: lengths that vary by batch
        return zoo.documents(512, padded=self.form in ("padded", "varied", "flattened"), seed=seed, longest=longest)

    def _loader(self, dataset: Dataset, *, shuffle: bool) -> DataLoader:
        if self.form == "pairs":
            collate = None
        elif self.form == "flattened":
            collate = transformers.DataCollatorWithFlattening()
        else:
            collate = zoo.language_modelling_collator()
        if self.sampled_as_ranks is None:
            return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, collate_fn=collate)
        order = ShardedOrder(dataset, self.sampled_as_ranks, self.batch_size // self.sampled_as_ranks, shuffle=shuffle)
        return DataLoader(dataset, batch_sampler=order, collate_fn=collate)


def shard_files(ranks: int) -> list[str]:
    """The files of a checkpoint saved by ``ranks`` ranks, each writing its shards in parallel streams."""
    return [f"__{rank}_{stream}.distcp" for rank in range(ranks) for stream in range(WRITER_THREADS)]


def checkpoint_files(ranks: int) -> list[str]:
    """Every file of a complete checkpoint saved by ``ranks`` ranks, sorted: shards, DCP's index, Lightning's loop
    state and the manifest written last."""
    return sorted([".metadata", "COMPLETE", *shard_files(ranks), "meta.pt"])


def listing(storage: AbstractFileSystem, run: str) -> dict[str, list[str]]:
    """Each checkpoint under the URL ``run`` with its files, and each pointer with the checkpoint it names."""
    storage.invalidate_cache()
    found = {}
    for entry in storage.ls(run.split("://", 1)[1], detail=True):
        name = entry["name"].rsplit("/", 1)[-1]
        if entry["type"] == "directory":
            found[name] = sorted(path.rsplit("/", 1)[-1] for path in storage.ls(entry["name"]))
        else:
            found[name] = [json.loads(storage.cat(entry["name"]))["lightdist_checkpoint"]]
    return found


def keep_two_newest(run: str, kind: type[LightningModelCheckpoint] = ModelCheckpoint) -> LightningModelCheckpoint:
    """Saves to ``run`` every step, keeping the two newest checkpoints and ``last.ckpt``: lightdist's callback, or
    ``kind=LightningModelCheckpoint``, Lightning's own, as users configure it."""
    return kind(dirpath=run, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True)


class StopAfter(Callback):
    """Ends the run early, as a preempted job would: its configuration (and so its LR schedule) is the full run's."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.should_stop = trainer.global_step >= self.steps


def train(
    case: Case,
    devices: int = 1,
    callbacks: list[Callback] = (),
    *,
    resume_from: str | None = None,
    save_to: str | None = None,
    plugins: list[Any] = (),
    logger: Logger | bool = False,
) -> Result:
    """Train ``case``, optionally resuming from a checkpoint first and saving one at the end; ``plugins`` go to the
    Trainer (a launcher's cluster environment), and ``logger`` gets every step's metrics."""
    seed_everything(1234, workers=True)
    model = MODELS[case.model](learning_rate=1e-3, warmup_steps=2)
    if case.data in LoaderBatches.FORMS:
        data = LoaderBatches(case.data, case.batch_size, case.seq_len, case.validate, case.sampled_as_ranks)
    else:
        data = TokenDataModule(
            data_path=case.data_path,
            weights=case.data_weights,
            seq_len=case.seq_len,
            batch_size=case.batch_size if case.global_batch_size is None else None,
            global_batch_size=case.global_batch_size,
            shuffle=case.shuffle,
            val_fraction=0.05 if case.validate else 0.0,
            synthetic_tokens=65_536,
        )
    result = Result()
    documents = dict(document_end_token=case.document_end_token, mask_document_end_loss=case.mask_document_end_loss)
    strategy = case.strategy if case.document_end_token is None else {**(case.strategy or {}), **documents}
    trainer = Trainer(
        accelerator=case.accelerator,
        devices=devices,
        strategy=ParallelStrategy(**strategy) if strategy is not None else "auto",
        plugins=list(plugins),
        max_steps=case.steps,
        limit_train_batches=case.limit_train_batches,
        accumulate_grad_batches=case.accumulate_grad_batches,
        gradient_clip_val=case.gradient_clip_val,
        precision=case.precision,
        # The first 8 batches of each data-parallel rank: together the single process's first 8 batches.
        limit_val_batches=8,
        val_check_interval=case.val_check_interval,
        num_sanity_val_steps=0,
        # A single process that draws the ranks' order itself: on lightdist's one rank too, no sampler of Lightning's
        use_distributed_sampler=case.sampled_as_ranks is None,
        callbacks=[
            TrainingMonitor(log_every_n_steps=1),
            _RecordLosses(result),
            _RecordGradients(result),
            _CountValidationWindows(),
            *callbacks,
        ],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=any(isinstance(callback, Checkpoint) for callback in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    if case.validate:
        (result.validated,) = trainer.validate(model, datamodule=data, verbose=False)
    # Every rank gathers its own pipeline stage's parameters (full_state_dict with cpu_offload would fill rank 0 only).
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    result.params = {name: tensor.detach().cpu().clone() for name, tensor in state.items()}
    return result


def prepared_arithmetic(folder: Path, tokens: int = 1 << 16) -> str:
    """The arithmetic corpus as text (a sum a document), prepared by ``lightdist prepare`` with a tokenizer of its
    characters, whose ids are the tiny models' (the end-of-sequence id in place of the newline's); its URL."""
    text = "".join(ARITHMETIC_ALPHABET[i] for i in arithmetic_corpus(tokens))
    lines = folder / "sums.jsonl"
    lines.write_text("".join(json.dumps({"text": line}) + "\n" for line in text.splitlines() if line))
    vocabulary = {character: i for i, character in enumerate(ARITHMETIC_ALPHABET)}
    tokenizer = Tokenizer(tokenizer_models.BPE(vocab=vocabulary | {"<|endoftext|>": len(vocabulary)}, merges=[]))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    prepare([str(lines)], str(folder / "tokenizer.json"), str(folder / "tokens"), processes=1)
    return str(folder / "tokens")


def merge_stages(results_per_rank: list[list[Result]]) -> list[Result]:
    """Rank 0's results with every rank's parameters (under a pipeline each rank holds one stage's) and gradients
    unlike their parameters."""
    merged = results_per_rank[0]
    for rank_results in results_per_rank[1:]:
        for result, other in zip(merged, rank_results, strict=True):
            result.params.update(other.params)
            result.gradients_unlike_parameters += other.gradients_unlike_parameters
    return merged


def train_cases(cases: list[Case], devices: int = 1) -> list[Result]:
    """Several runs in one group of processes, so the start-up cost is paid once. A run that raises is reported as its
    error and the next one runs: every case gets its own result where the run raised on every rank alike, as the
    same code on the same data does (where one rank alone raised, the others wait in a collective until the group's
    timeout names it)."""
    results = []
    for case in cases:
        try:
            results.append(train(case, devices))
        except Exception:
            results.append(Result(error=traceback.format_exc()))
    return results


class References:
    """Single-process runs, once each, trained in one process beside the parallel groups they are compared with: on
    the core those groups' ranks leave idle while they wait for each other. ``start`` it with the first group."""

    def __init__(self, cases: list[Case], timeout: float = 300.0) -> None:
        self.cases, self.timeout = list(dict.fromkeys(cases)), timeout
        self._training: Future[list[list[Result]]] | None = None

    def start(self) -> None:
        if self._training is None:
            self._training = run_ranks_beside(1, train_cases, self.cases, timeout=self.timeout)

    def __getitem__(self, case: Case) -> Result:
        self.start()
        return self._training.result()[0][self.cases.index(case)]
