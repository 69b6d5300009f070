"""A parallel run must be the single-process run, only faster: same loss every step, same final weights (fp32)."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch

from lightdist.models.data import ARITHMETIC_ALPHABET
from lightdist.plugins.token_weights import weighing_rule

from multirank import run_ranks
from training import MODELS, WEIGHT_ATOL, Case, References, Result, merge_stages, train_cases

pytestmark = pytest.mark.multirank

TP2 = dict(tensor_parallel_size=2)  # with sequence parallelism, the default
TP2_NO_SP = dict(tensor_parallel_size=2, sequence_parallel=False)
PP2 = dict(pipeline_parallel_size=2)  # 1F1B over 2 microbatches, by default
CP2 = dict(context_parallel_size=2)  # the method picked by the heads: all-to-all where they divide
CP2_RING = dict(context_parallel_size=2, context_parallel_method="ring")
NEWLINE = ARITHMETIC_ALPHABET.index("\n")  # where each sum ends: a document_end_token
HSDP2 = dict(zero_stage=3, data_parallel_replicas=2)  # 2 replicas, each sharding over its half of the ranks

CASES = {
    2: {
        "zero0": Case(strategy=dict(zero_stage=0)),
        "zero1": Case(strategy=dict(zero_stage=1)),
        "zero2": Case(strategy=dict(zero_stage=2)),
        "zero3": Case(strategy=dict(zero_stage=3), validate=True),
        "zero1_accumulate_clip": Case(strategy=dict(zero_stage=1), accumulate_grad_batches=2, gradient_clip_val=0.1),
        "zero3_accumulate_clip": Case(strategy=dict(zero_stage=3), accumulate_grad_batches=2, gradient_clip_val=0.1),
        "zero2_full_checkpointing": Case(strategy=dict(zero_stage=2, activation_checkpointing="full")),
        "zero3_selective_checkpointing": Case(strategy=dict(zero_stage=3, activation_checkpointing="selective")),
        "gpt2_tied_zero3": Case(strategy=dict(zero_stage=3), model="gpt2", gradient_clip_val=0.1),
        "tp2_zero3": Case(strategy=dict(TP2, zero_stage=3)),
        "tp2_zero2_clip": Case(strategy=dict(TP2, zero_stage=2), gradient_clip_val=0.1),
        "tp2_without_sequence_parallel": Case(strategy=dict(TP2_NO_SP, zero_stage=3), gradient_clip_val=0.1),
        "tp2_loss_parallel_clip": Case(strategy=dict(TP2, loss_parallel=True), gradient_clip_val=0.1, validate=True),
        "tp2_tied_embeddings": Case(strategy=dict(TP2, zero_stage=3), model="llama_tied"),
        "gpt2_tp2_fused_qkv_tied": Case(strategy=dict(TP2, zero_stage=3), model="gpt2_no_bias", gradient_clip_val=0.1),
        "unknown_family_tp2_traced_plan": Case(strategy=dict(TP2), model="unknown_family", gradient_clip_val=0.1),
        "hf_llama_zero3": Case(strategy=dict(zero_stage=3), model="hf_llama"),
        # torch.compile per block, between tensor parallelism and ZeRO (torchtitan's order), on third-party code: HF
        # Llama with labels on tp2 x ZeRO-3, with packed documents, in tests/test_documents.py
        "hf_llama_tp2": Case(strategy=dict(TP2, zero_stage=3), model="hf_llama", gradient_clip_val=0.1),
        "hf_opt_tp2_row_parallel_biases": Case(strategy=dict(TP2_NO_SP, zero_stage=3), model="hf_opt"),
        # Context parallelism: each rank holds half of every sequence (two of four chunks); the step, the model and
        # the data are the user's. Positions come from a rotary buffer sliced [:T] (the reference Llama, LitGPT),
        # torch.arange (nanoGPT, GPT-2) or Hugging Face's cache_position; the label shift inside a Hugging Face loss
        # (windows of 32 = seq_len + 1) and in the step (windows of 33, the model fed 32; or the window of 32 fed
        # whole, its logits and labels shifted in the step, which leaves the ranks 16 and 15 labelled tokens).
        "cp2_ring": Case(strategy=CP2_RING),
        "cp2_all_to_all": Case(strategy=dict(CP2, context_parallel_method="all_to_all")),
        "zoo_hf_llama_labels_cp2_ring": Case(strategy=CP2_RING, model="zoo_hf_llama_labels", seq_len=31),
        # blocks recomputed in backward attend over the whole sequence, as their forward did
        "cp2_full_checkpointing": Case(strategy=dict(CP2, activation_checkpointing="full")),
        "zoo_hf_llama_labels_cp2_ring_selective_checkpointing_clip": Case(
            strategy=dict(CP2_RING, activation_checkpointing="selective"),
            model="zoo_hf_llama_labels",
            seq_len=31,
            gradient_clip_val=0.1,
        ),
        "zoo_hf_gpt2_labels_cp2": Case(strategy=CP2, model="zoo_hf_gpt2_labels", seq_len=31),
        # positions counted by a cumulative sum of ones (OPT); ALiBi in the causal mask the model builds (Falcon)
        "zoo_hf_opt_labels_cp2": Case(strategy=CP2, model="zoo_hf_opt_labels", seq_len=31),
        "zoo_hf_falcon_alibi_labels_cp2": Case(strategy=CP2, model="zoo_hf_falcon_alibi_labels", seq_len=31),
        # attention written by hand: ALiBi added by baddbmm, the scores masked and softmaxed in plain ops
        "hf_bloom_cp2": Case(strategy=CP2, model="hf_bloom"),
        "zoo_hf_qwen2_shifted_logits_cp2": Case(strategy=CP2, model="zoo_hf_qwen2_shifted_logits", seq_len=31),
        "zoo_nanogpt_cp2_ring": Case(strategy=CP2_RING, model="zoo_nanogpt"),
        "zoo_litgpt_cp2": Case(strategy=CP2, model="zoo_litgpt"),
        # Karpathy's lecture GPT: a module per head, each attending by hand under its tril buffer, on (x, y) pairs
        "zoo_lecture_gpt_cp2_pairs": Case(strategy=CP2, model="zoo_lecture_gpt", data="pairs"),
        "gpt2_cp2_clip": Case(strategy=CP2, model="gpt2_no_bias", gradient_clip_val=0.1),
        # each block compiled, its attention handed to the ring as it runs, masked by the packed documents
        "zoo_hf_llama_labels_cp2_ring_compiled_documents": Case(
            strategy=dict(CP2_RING, compile=True), model="zoo_hf_llama_labels", seq_len=31, document_end_token=NEWLINE
        ),
        "pp2_gpipe": Case(strategy=dict(PP2, pipeline_schedule="gpipe")),
        "pp2_1f1b_4_microbatches_clip_validating_every_2_steps": Case(
            strategy=dict(PP2, microbatches=4), gradient_clip_val=0.1, validate=True, val_check_interval=2
        ),
        "pp2_accumulate": Case(strategy=dict(PP2), accumulate_grad_batches=2),
        # the embedding on the first stage and the LM head on the last share one weight
        "pp2_gpt2_tied_clip": Case(strategy=dict(PP2, microbatches=4), model="gpt2", gradient_clip_val=0.1),
        "pp2_hf_llama": Case(strategy=dict(PP2), model="hf_llama"),
        # two virtual stages per rank: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3
        "pp2_interleaved_1f1b_clip": Case(
            strategy=dict(PP2, pipeline_schedule="interleaved_1f1b", microbatches=4), gradient_clip_val=0.1
        ),
        "pp2_zero_bubble_gpt2_tied_accumulate": Case(
            strategy=dict(PP2, pipeline_schedule="zero_bubble", microbatches=4),
            model="gpt2_no_bias",
            accumulate_grad_batches=2,
        ),
        # stages cut by torch's tracer: the Llama's on request, and a model with its blocks in an nn.Sequential and
        # its head tied to the embedding
        # four stages on two ranks: the rotary tables the first stage slices are handed on through the second
        "pp2_traced_interleaved_1f1b_clip_validating": Case(
            strategy=dict(PP2, pipeline_tracer=True, pipeline_schedule="interleaved_1f1b", microbatches=4),
            gradient_clip_val=0.1,
            validate=True,
            val_check_interval=2,
        ),
        # the lecture GPT computes its loss from targets after its blocks: the last stage reads them from the call
        "zoo_lecture_gpt_pp2_zero_bubble_pairs_clip": Case(
            strategy=dict(PP2, pipeline_schedule="zero_bubble", microbatches=4),
            model="zoo_lecture_gpt",
            data="pairs",
            gradient_clip_val=0.1,
        ),
        # four traced stages on two ranks handed the positions the first computes, which index a table in every block
        "position_indexed_pp2_traced_interleaved_1f1b": Case(
            strategy=dict(PP2, pipeline_tracer=True, pipeline_schedule="interleaved_1f1b", microbatches=4),
            model="position_indexed",
        ),
        "pp2_traced_on_request_clip": Case(
            strategy=dict(PP2, microbatches=4, pipeline_tracer=True), gradient_clip_val=0.1, validate=True
        ),
        "pp2_traced_sequential_blocks_tied_selective_checkpointing_clip": Case(
            strategy=dict(PP2, microbatches=4, activation_checkpointing="selective"),
            model="sequential_blocks",
            gradient_clip_val=0.1,
            validate=True,
        ),
        # the step calls self.model, an nn.Sequential of the whole network: that is traced
        "held_sequential_pp2_traced": Case(strategy=dict(PP2, microbatches=4), model="held_sequential"),
        # Third-party model code, the step calling the network it holds (tests/zoo.py): nanoGPT's `logits, loss =
        # self.model(x, y)` with its head tied across the stages; Hugging Face models computing their own loss from
        # labels, returning .logits to the step's loss, and called as base model then head
        "zoo_nanogpt_zero3": Case(strategy=dict(zero_stage=3), model="zoo_nanogpt"),
        "zoo_hf_gpt2_labels_zero2_clip": Case(
            strategy=dict(zero_stage=2), model="zoo_hf_gpt2_labels", gradient_clip_val=0.1
        ),
        "zoo_nanogpt_pp2_tuple_tied_clip": Case(
            strategy=dict(PP2, microbatches=4), model="zoo_nanogpt", gradient_clip_val=0.1
        ),
        "zoo_hf_llama_pp2_labels_full_checkpointing": Case(
            strategy=dict(PP2, activation_checkpointing="full"), model="zoo_hf_llama_labels"
        ),
        "zoo_hf_qwen2_pp2_logits_interleaved": Case(
            strategy=dict(PP2, pipeline_schedule="interleaved_1f1b", microbatches=4), model="zoo_hf_qwen2_logits"
        ),
        "zoo_hf_gpt2_pp2_conv1d_tied_labels_zero_bubble_accumulate": Case(
            strategy=dict(PP2, pipeline_schedule="zero_bubble", microbatches=4),
            model="zoo_hf_gpt2_labels",
            accumulate_grad_batches=2,
        ),
        "zoo_hf_llama_pp2_base_model_then_head": Case(strategy=dict(PP2), model="zoo_hf_llama_base_and_head"),
        "zoo_hf_qwen2_tp2_logits": Case(strategy=dict(TP2, zero_stage=3), model="zoo_hf_qwen2_logits"),
        "zoo_hf_llama_tp2_labels": Case(strategy=dict(TP2, zero_stage=3), model="zoo_hf_llama_labels"),
        "zoo_hf_llama_tp2_base_model_then_head_clip": Case(
            strategy=dict(TP2), model="zoo_hf_llama_base_and_head", gradient_clip_val=0.1
        ),
        # Attention whose code does not reshape with per-rank head counts: nanoGPT's runs on global shapes (its
        # split(n_embd) and view(B, T, C)), GPT-2's Conv1D attention and LitGPT's (heads in its shared config) adapted
        "zoo_nanogpt_tp2_global_attention_clip": Case(
            strategy=dict(TP2, zero_stage=3), model="zoo_nanogpt", gradient_clip_val=0.1
        ),
        "zoo_hf_gpt2_tp2_conv1d_adapted_labels": Case(strategy=dict(TP2, zero_stage=2), model="zoo_hf_gpt2_labels"),
        # fixed sinusoids in a buffer (PyTorch's tutorial), added to the sequence-parallel stream: replicated
        "zoo_nanogpt_sinusoidal_positions_tp2": Case(
            strategy=dict(TP2, zero_stage=3), model="zoo_nanogpt_sinusoidal_positions"
        ),
        "zoo_litgpt_tp2_config_heads_adapted": Case(strategy=dict(TP2, zero_stage=3), model="zoo_litgpt"),
        "zoo_litgpt_pp2_rotary_arguments": Case(strategy=dict(PP2, microbatches=4), model="zoo_litgpt"),
        # More Hugging Face families: Gemma with one key/value head (replicated), Phi-3 with fused qkv_proj (sliced
        # by its attention with config-held sizes: adapted) and gate_up_proj, GPT-NeoX with q, k, v interleaved per head
        "zoo_hf_mistral_tp2_logits": Case(strategy=dict(TP2), model="zoo_hf_mistral_logits"),
        # Qwen3's and Gemma 3's per-head q_norm and k_norm: attention runs global, where their weights' gradients sum
        # every head
        "zoo_hf_qwen3_tp2_logits": Case(strategy=dict(TP2), model="zoo_hf_qwen3_logits"),
        "zoo_hf_gemma3_tp2_logits": Case(strategy=dict(TP2), model="zoo_hf_gemma3_text_logits"),
        "zoo_hf_gemma_tp2_one_kv_head_labels": Case(strategy=dict(TP2, zero_stage=3), model="zoo_hf_gemma_labels"),
        "zoo_hf_phi3_tp2_adapted_labels_clip": Case(
            strategy=dict(TP2), model="zoo_hf_phi3_labels", gradient_clip_val=0.1
        ),
        "zoo_hf_phi3_pp2_labels": Case(strategy=dict(PP2), model="zoo_hf_phi3_labels"),
        "zoo_hf_neox_tp2_interleaved_qkv_logits": Case(strategy=dict(TP2, zero_stage=2), model="zoo_hf_neox_logits"),
        "zoo_hf_neox_pp2_logits": Case(strategy=dict(PP2), model="zoo_hf_neox_logits"),
        "zoo_hf_opt_tp2_labels": Case(strategy=dict(TP2_NO_SP), model="zoo_hf_opt_labels"),
        # one key/value head fused with the queries: global; its block adds into the MLP's output in place
        "zoo_hf_falcon_tp2_multi_query_global_in_place_residual": Case(
            strategy=dict(TP2_NO_SP, zero_stage=3), model="zoo_hf_falcon_logits"
        ),
        # ALiBi biases built from all the heads, cut to each rank's; the residual added inside attention and MLP
        "hf_bloom_tp2_alibi_per_head_clip": Case(
            strategy=dict(TP2, zero_stage=3), model="hf_bloom", gradient_clip_val=0.1
        ),
        "zoo_hf_mistral_pp2_logits": Case(strategy=dict(PP2), model="zoo_hf_mistral_logits"),
        "zoo_hf_gemma_pp2_labels": Case(strategy=dict(PP2), model="zoo_hf_gemma_labels"),
        # OPT's learned positions are called with the attention mask and position_ids on every stage
        "zoo_hf_opt_pp2_learned_positions_labels": Case(strategy=dict(PP2), model="zoo_hf_opt_labels"),
        "zoo_hf_falcon_pp2_logits": Case(strategy=dict(PP2), model="zoo_hf_falcon_logits"),
        # BLOOM norms its embeddings before its blocks: that norm runs on the first stage, where the forward runs it
        "zoo_hf_bloom_pp2_labels_embeddings_normed_on_the_first_stage": Case(
            strategy=dict(PP2), model="zoo_hf_bloom_labels"
        ),
        "zoo_hf_falcon_alibi_pp2_labels": Case(strategy=dict(PP2), model="zoo_hf_falcon_alibi_labels"),
        **{
            f"zoo_hf_{family}_pp2_logits": Case(strategy=dict(PP2), model=f"zoo_hf_{family}_logits")
            for family in ("qwen3", "gemma3_text", "deepseek_v3")  # deepseek_v3: latent attention, a dense first layer
        },
        # The batches people's loaders make (tests/training.py LoaderBatches), shuffled by the sampler Lightning adds:
        # Hugging Face's collator's dict passed whole to the model (`self.model(**batch)`), a TensorDataset's (x, y)
        "zoo_hf_llama_pp2_collated_validating_clip": Case(
            strategy=dict(PP2), model="zoo_hf_llama_finetuning", data="collated", validate=True, gradient_clip_val=0.1
        ),
        "zoo_hf_gpt2_pp2_collated_interleaved_accumulate": Case(
            strategy=dict(PP2, pipeline_schedule="interleaved_1f1b", microbatches=4),
            model="zoo_hf_gpt2_finetuning",
            data="collated",
            accumulate_grad_batches=2,
        ),
        "zoo_nanogpt_pp2_pairs": Case(
            strategy=dict(PP2, microbatches=4), model="zoo_nanogpt_pairs", data="pairs", seq_len=16
        ),
        # Documents of many lengths, padded per batch and labelled -100 there: each microbatch's loss weighs by its
        # share of the batch's labelled tokens, counted from the model's labels or by the module's loss_tokens
        "zoo_hf_llama_pp2_padded_validating": Case(
            strategy=dict(PP2), model="zoo_hf_llama_finetuning", data="padded", validate=True
        ),
        # batches of other lengths, each step: the stages learn the shapes that flow between them again
        "zoo_hf_llama_pp2_varied_lengths_validating": Case(
            strategy=dict(PP2), model="zoo_hf_llama_finetuning", data="varied", validate=True
        ),
        "zoo_hf_llama_pp2_padded_own_loss_tokens": Case(
            strategy=dict(PP2, microbatches=4), model="zoo_hf_llama_finetuning_own_loss", data="padded"
        ),
        **{
            f"zoo_hf_{family}_pp2_padded": Case(strategy=dict(PP2), model=f"zoo_hf_{family}_finetuning", data="padded")
            for family in ("qwen2", "mistral", "phi3", "neox", "opt", "gemma")
        },
        **{
            f"zoo_hf_{family}_pp2_padded_{speedup}": Case(
                strategy=dict(PP2, **options), model=f"zoo_hf_{family}_finetuning", data="padded"
            )
            for family, speedup, options in (
                ("llama", "full_checkpointing", dict(activation_checkpointing="full")),
                ("qwen2", "selective_checkpointing", dict(activation_checkpointing="selective")),
                ("llama", "compiled", dict(compile=True)),
            )
        },
        # Across an accumulation too: one process steps on each accumulation's batches at once (Case.reference)
        "zoo_hf_gpt2_pp2_padded_accumulate_clip": Case(
            strategy=dict(PP2),
            model="zoo_hf_gpt2_finetuning",
            data="padded",
            accumulate_grad_batches=2,
            gradient_clip_val=0.1,
        ),
        "zoo_hf_llama_tp2_collated": Case(strategy=dict(TP2), model="zoo_hf_llama_finetuning", data="collated"),
        # Across data-parallel ranks: each rank's loss weighs by its share of the global batch's labelled tokens
        "zoo_hf_llama_zero3_padded_validating": Case(
            strategy=dict(zero_stage=3), model="zoo_hf_llama_finetuning", data="padded", validate=True
        ),
        "zoo_hf_llama_zero2_padded_own_loss_tokens_accumulate_clip": Case(
            strategy=dict(zero_stage=2),
            model="zoo_hf_llama_finetuning_own_loss",
            data="padded",
            accumulate_grad_batches=2,
            gradient_clip_val=0.1,
        ),
        "zoo_hf_qwen2_tp2_padded_accumulate": Case(
            strategy=dict(TP2), model="zoo_hf_qwen2_finetuning", data="padded", accumulate_grad_batches=2
        ),
        # Documents packed into one row without padding (DataCollatorWithFlattening), positions restarting at each,
        # which the model's own mask keeps apart: each rank's row, weighed by its labelled tokens
        "zoo_hf_llama_zero3_flattened_accumulate": Case(
            strategy=dict(zero_stage=3),
            model="zoo_hf_llama_finetuning_packed",
            data="flattened",
            accumulate_grad_batches=2,
        ),
        "zoo_hf_llama_tp2_flattened": Case(
            strategy=dict(TP2), model="zoo_hf_llama_finetuning_packed", data="flattened"
        ),
        # Documents packed into one row by their positions (DataCollatorWithFlattening): found in the whole sequences
        # and attended within by each rank's share, where the model looks for them (no cache); with a cache, Hugging
        # Face's model attends across them, in one process too
        **{
            f"zoo_hf_llama_cp2_{method}_flattened": Case(
                strategy=dict(CP2, context_parallel_method=method),
                model="zoo_hf_llama_finetuning_packed",
                data="flattened",
            )
            for method in ("ring", "all_to_all")
        },
        "zoo_hf_llama_cp2_flattened_with_a_cache": Case(
            strategy=CP2, model="zoo_hf_llama_finetuning", data="flattened"
        ),
        **{
            f"zoo_hf_llama_zero3_collated_{speedup}": Case(
                strategy=dict(zero_stage=3, **options), model="zoo_hf_llama_finetuning", data="collated"
            )
            for speedup, options in {
                "full_checkpointing": dict(activation_checkpointing="full"),
                "selective_checkpointing": dict(activation_checkpointing="selective"),
                "compiled": dict(compile=True),
            }.items()
        },
    },
    4: {
        "zero2_clip": Case(strategy=dict(zero_stage=2), gradient_clip_val=0.1),
        "hsdp2_zero3_clip": Case(strategy=HSDP2, gradient_clip_val=0.1, validate=True),
        "zoo_hf_llama_hsdp2_zero2_collated": Case(
            strategy=dict(HSDP2, zero_stage=2), model="zoo_hf_llama_finetuning", data="collated"
        ),
        "cp4_ring": Case(strategy=dict(context_parallel_size=4, context_parallel_method="ring")),
        "zoo_hf_qwen2_logits_cp4": Case(strategy=dict(context_parallel_size=4), model="zoo_hf_qwen2_logits"),
        "cp2_dp2_zero3_clip": Case(strategy=dict(CP2, zero_stage=3), gradient_clip_val=0.1),
        # with sequence parallelism: each rank's share of the sequence split again over the tensor-parallel ranks;
        # nanoGPT's attention, which reshapes with global sizes, runs on tensor parallelism's DTensor heads
        "cp2_tp2": Case(strategy=dict(CP2, **TP2)),
        "zoo_nanogpt_cp2_tp2": Case(strategy=dict(CP2, **TP2), model="zoo_nanogpt"),
        # nanoGPT's slow path: attention by hand, on tensor parallelism's DTensor heads
        "zoo_nanogpt_slow_attention_cp2_tp2": Case(strategy=dict(CP2, **TP2), model="zoo_nanogpt_slow_attention"),
        # each stage's share of each microbatch's sequences: positions from its own inputs' length on every stage
        "pp2_cp2": Case(strategy=dict(PP2, **CP2)),
        "pp2_cp2_full_checkpointing": Case(strategy=dict(PP2, **CP2, activation_checkpointing="full")),
        "zoo_hf_llama_labels_pp2_cp2_4_microbatches": Case(
            strategy=dict(PP2, **CP2, microbatches=4), model="zoo_hf_llama_labels", seq_len=31
        ),
        "zoo_nanogpt_pp2_cp2_ring": Case(strategy=dict(PP2, **CP2_RING), model="zoo_nanogpt"),
        "zoo_litgpt_pp2_cp2": Case(strategy=dict(PP2, **CP2), model="zoo_litgpt"),
        # packed documents (tests/test_documents.py): each microbatch's documents, on each rank's share of them; what
        # each end token predicts left out of the loss, each microbatch weighed by the targets its share keeps
        "zoo_nanogpt_pp2_cp2_ring_documents_end_loss_masked": Case(
            strategy=dict(PP2, **CP2_RING), model="zoo_nanogpt", document_end_token=NEWLINE, mask_document_end_loss=True
        ),
        "zoo_hf_llama_labels_pp2_cp2_documents_end_loss_masked": Case(
            strategy=dict(PP2, **CP2),
            model="zoo_hf_llama_labels",
            seq_len=31,
            document_end_token=NEWLINE,
            mask_document_end_loss=True,
        ),
        # what each end token predicts left out of the loss: pipelined microbatches, and data-parallel ranks, weighed
        # by the targets they keep
        "zoo_nanogpt_pp2_dp2_documents_end_loss_masked_accumulate": Case(
            strategy=PP2,
            model="zoo_nanogpt",
            accumulate_grad_batches=2,
            document_end_token=NEWLINE,
            mask_document_end_loss=True,
        ),
        "zoo_hf_qwen2_logits_cp2_tp2_documents": Case(
            strategy=dict(CP2, **TP2), model="zoo_hf_qwen2_logits", document_end_token=NEWLINE
        ),
        # stages cut by torch's tracer, traced from a rank's share: of the module the step calls (self.model), and
        # with rotary positions (a table's rows)
        "held_sequential_pp2_cp2_traced": Case(strategy=dict(PP2, **CP2), model="held_sequential"),
        "zoo_lecture_gpt_pp2_cp2_pairs": Case(strategy=dict(PP2, **CP2), model="zoo_lecture_gpt", data="pairs"),
        "pp2_cp2_traced_on_request_clip": Case(
            strategy=dict(PP2, **CP2, microbatches=4, pipeline_tracer=True), gradient_clip_val=0.1
        ),
        # experts split over 2 of the 4 ranks that reduce gradients (dp2 x cp2), tokens of half-sequences routed
        "moe_cp2_ep2": Case(strategy=dict(CP2, expert_parallel_size=2), model="moe_lm_only"),
        # Collator batches: the attention mask dropped (padding on the right, unlabelled), ranks holding different
        # numbers of labelled tokens weighed by them
        "zoo_hf_llama_cp2_dp2_padded": Case(
            strategy=dict(CP2, zero_stage=2), model="zoo_hf_llama_finetuning", data="padded"
        ),
        "zoo_hf_gpt2_cp2_dp2_collated": Case(strategy=CP2, model="zoo_hf_gpt2_finetuning", data="collated"),
        "zero3_accumulate_clip": Case(strategy=dict(zero_stage=3), accumulate_grad_batches=2, gradient_clip_val=0.1),
        "tp2_dp2_zero3_clip": Case(strategy=dict(TP2, zero_stage=3), gradient_clip_val=0.1, validate=True),
        "tp2_dp2_zero2_accumulate": Case(strategy=dict(TP2, zero_stage=2), accumulate_grad_batches=2),
        "tp2_dp2_without_sequence_parallel": Case(strategy=dict(TP2_NO_SP, zero_stage=3), model="hf_llama"),
        "gpt2_tp2_dp2_without_sequence_parallel": Case(strategy=dict(TP2_NO_SP, zero_stage=2), model="gpt2_no_bias"),
        "hf_qwen2_tp2_dp2_zero2": Case(strategy=dict(TP2, zero_stage=2), model="hf_qwen2", gradient_clip_val=0.1),
        "hf_llama_tp2_dp2_loss_parallel": Case(strategy=dict(TP2, loss_parallel=True), model="hf_llama"),
        # 2 key/value heads over 4 ranks: each pair of ranks shares one (Hugging Face's num_key_value_groups too)
        "tp4_replicated_kv_heads_clip": Case(strategy=dict(tensor_parallel_size=4), gradient_clip_val=0.1),
        "hf_llama_tp4_replicated_kv_heads": Case(
            strategy=dict(tensor_parallel_size=4, zero_stage=2, sequence_parallel=False), model="hf_llama"
        ),
        "tp2_dp2_zero3_selective_checkpointing": Case(
            strategy=dict(TP2, zero_stage=3, activation_checkpointing="selective")
        ),
        "tp2_dp2_zero0_accumulate": Case(strategy=dict(TP2, zero_stage=0), accumulate_grad_batches=2),
        "tp2_dp2_zero1_clip": Case(strategy=dict(TP2, zero_stage=1), gradient_clip_val=0.1),
        "pp2_dp2_zero3_full_checkpointing": Case(strategy=dict(PP2, activation_checkpointing="full")),
        "pp2_tp2_sequence_parallel_zero_bubble_clip": Case(
            strategy=dict(PP2, **TP2, pipeline_schedule="zero_bubble", microbatches=4), gradient_clip_val=0.1
        ),
        "pp2_dp2_interleaved_1f1b_zero3": Case(
            strategy=dict(PP2, pipeline_schedule="interleaved_1f1b", microbatches=4)
        ),
        "pp2_dp2_hf_llama_zero1": Case(strategy=dict(PP2, zero_stage=1, microbatches=4), model="hf_llama"),
        "pp2_dp2_traced_zero_bubble_zero3_accumulate_clip": Case(
            strategy=dict(PP2, pipeline_schedule="zero_bubble", microbatches=4),
            model="sequential_blocks",
            accumulate_grad_batches=2,
            gradient_clip_val=0.1,
        ),
        "zoo_nanogpt_pp2_dp2_zero3_clip": Case(strategy=dict(PP2), model="zoo_nanogpt", gradient_clip_val=0.1),
        "zoo_hf_gpt2_pp2_dp2_labels_zero1": Case(strategy=dict(PP2, zero_stage=1), model="zoo_hf_gpt2_labels"),
        "zoo_hf_qwen2_pp2_tp2_logits": Case(strategy=dict(PP2, **TP2), model="zoo_hf_qwen2_logits"),
        "zoo_nanogpt_pp2_tp2_global_attention": Case(strategy=dict(PP2, **TP2), model="zoo_nanogpt"),
        "zoo_hf_gpt2_pp2_tp2_labels": Case(strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_gpt2_labels"),
        "zoo_litgpt_pp2_tp2_clip": Case(strategy=dict(PP2, **TP2), model="zoo_litgpt", gradient_clip_val=0.1),
        "zoo_hf_phi3_pp2_tp2_labels": Case(strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_phi3_labels"),
        "zoo_hf_neox_pp2_tp2_logits": Case(strategy=dict(PP2, **TP2), model="zoo_hf_neox_logits"),
        "zoo_hf_falcon_pp2_tp2_global_logits": Case(strategy=dict(PP2, **TP2), model="zoo_hf_falcon_logits"),
        "zoo_hf_mistral_pp2_tp2_logits": Case(strategy=dict(PP2, **TP2), model="zoo_hf_mistral_logits"),
        "zoo_hf_opt_pp2_tp2_labels": Case(strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_opt_labels"),
        "zoo_hf_llama_pp2_tp2_labels": Case(strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_llama_labels"),
        "zoo_hf_llama_pp2_tp2_base_model_then_head": Case(
            strategy=dict(PP2, **TP2), model="zoo_hf_llama_base_and_head"
        ),
        "zoo_hf_gemma_pp2_tp2_labels": Case(strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_gemma_labels"),
        "zoo_nanogpt_tp2_dp2_global_attention_without_sequence_parallel": Case(
            strategy=dict(TP2_NO_SP, zero_stage=3), model="zoo_nanogpt"
        ),
        "zoo_hf_llama_pp2_tp2_collated": Case(
            strategy=dict(PP2, **TP2), model="zoo_hf_llama_finetuning", data="collated"
        ),
        "zoo_hf_llama_pp2_tp2_padded": Case(strategy=dict(PP2, **TP2), model="zoo_hf_llama_finetuning", data="padded"),
        "zoo_hf_llama_pp2_cp2_varied_lengths": Case(
            strategy=dict(PP2, **CP2), model="zoo_hf_llama_finetuning", data="varied"
        ),
        "zoo_hf_llama_pp2_dp2_padded_accumulate_clip": Case(
            strategy=dict(PP2, microbatches=4),
            model="zoo_hf_llama_finetuning",
            data="padded",
            accumulate_grad_batches=2,
            gradient_clip_val=0.1,
        ),
        "zoo_hf_gpt2_tp2_dp2_padded_validating": Case(
            strategy=dict(TP2_NO_SP, zero_stage=3), model="zoo_hf_gpt2_finetuning", data="padded", validate=True
        ),
        "zoo_hf_mistral_zero3_dp4_padded_accumulate": Case(
            strategy=dict(zero_stage=3), model="zoo_hf_mistral_finetuning", data="padded", accumulate_grad_batches=2
        ),
        "zoo_hf_mixtral_pp2_ep2_padded": Case(
            strategy=dict(PP2, expert_parallel_size=2), model="zoo_hf_mixtral_finetuning", data="padded"
        ),
        "zoo_hf_mixtral_pp2_ep2_collated": Case(
            strategy=dict(PP2, expert_parallel_size=2), model="zoo_hf_mixtral_finetuning", data="collated"
        ),
        "zoo_nanogpt_pp2_dp2_pairs_selective_checkpointing": Case(
            strategy=dict(PP2, activation_checkpointing="selective"),
            model="zoo_nanogpt_pairs",
            data="pairs",
            seq_len=16,
        ),
    },
    8: {  # 3D: pp=2 x dp=2 x tp=2
        # HSDP beside tensor parallelism, a pipeline and context parallelism: dp=4 as 2 replicas of 2 shards
        "zoo_nanogpt_hsdp2_tp2": Case(strategy=dict(HSDP2, **TP2), model="zoo_nanogpt"),
        "pp2_hsdp2_clip": Case(strategy=dict(PP2, **HSDP2), gradient_clip_val=0.1),
        "zoo_litgpt_cp2_hsdp2": Case(strategy=dict(CP2, **HSDP2), model="zoo_litgpt"),
        "cp2_dp2_tp2_zero3": Case(strategy=dict(CP2, **TP2, zero_stage=3)),
        "pp2_cp2_tp2": Case(strategy=dict(PP2, **CP2, **TP2_NO_SP)),
        "3d_clip": Case(strategy=dict(PP2, **TP2), gradient_clip_val=0.1, validate=True),
        "3d_gpt2_interleaved_fused_qkv_tied_clip": Case(
            strategy=dict(PP2, **TP2, pipeline_schedule="interleaved_1f1b", microbatches=4),
            model="gpt2_no_bias",
            gradient_clip_val=0.1,
        ),
        "3d_hf_llama": Case(strategy=dict(PP2, **TP2), model="hf_llama", validate=True),
        "zoo_hf_bloom_3d_labels": Case(strategy=dict(PP2, **TP2), model="zoo_hf_bloom_labels", seq_len=31),
        # its 33-token windows do not split over 2 sequence-parallel ranks (tests/test_bad_input.py)
        "zoo_hf_llama_3d_labels_without_sequence_parallel": Case(
            strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_llama_labels"
        ),
        "zoo_nanogpt_3d_global_attention_clip": Case(
            strategy=dict(PP2, **TP2), model="zoo_nanogpt", gradient_clip_val=0.1
        ),
        "zoo_litgpt_3d": Case(strategy=dict(PP2, **TP2), model="zoo_litgpt"),
        "zoo_hf_llama_3d_labels_documents": Case(
            strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_llama_labels", document_end_token=NEWLINE
        ),
        "zoo_hf_llama_3d_collated_validating": Case(
            strategy=dict(PP2, **TP2), model="zoo_hf_llama_finetuning", data="collated", validate=True
        ),
        "zoo_hf_llama_3d_padded_validating": Case(
            strategy=dict(PP2, **TP2_NO_SP), model="zoo_hf_llama_finetuning", data="padded", validate=True
        ),
    },
}


# Every single-process run the parallel cases are compared with
REFERENCES = References([case.reference(size) for size, cases in CASES.items() for case in cases.values()], timeout=900)


# A group of ranks trains this many cases one after another (starting ranks is the slow part): a few minutes on two
# busy cores, well under the 560 s it is allowed, itself under pytest's 600 s so that a stuck group prints where its
# ranks are.
CASES_PER_GROUP = 37


@cache
def parallel_results(world_size: int, group: int) -> dict[str, Result]:
    REFERENCES.start()
    names = list(CASES[world_size])[group * CASES_PER_GROUP : (group + 1) * CASES_PER_GROUP]
    cases = [CASES[world_size][name] for name in names]
    results = merge_stages(run_ranks(world_size, train_cases, cases, world_size, timeout=560))
    return dict(zip(names, results, strict=True))


@pytest.mark.parametrize(
    ("world_size", "name"), [(world_size, name) for world_size, cases in CASES.items() for name in cases]
)
def test_parallel_run_matches_single_process(world_size: int, name: str) -> None:
    case = CASES[world_size][name]
    parallel = parallel_results(world_size, list(CASES[world_size]).index(name) // CASES_PER_GROUP)[name]
    single = REFERENCES[case.reference(world_size)]
    assert not parallel.error, parallel.error
    assert not single.error, single.error
    assert not parallel.gradients_unlike_parameters  # each rank's gradients are its share, as the planner counts

    assert len(parallel.losses) == case.steps * case.accumulate_grad_batches
    if case.reference(world_size).accumulate_grad_batches == case.accumulate_grad_batches:  # a loss per batch
        torch.testing.assert_close(parallel.losses, single.losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(parallel.logged, single.logged, rtol=1e-5, atol=0)
    assert len(parallel.grad_norms) == case.steps
    torch.testing.assert_close(parallel.grad_norms, single.grad_norms, rtol=1e-5, atol=0)
    assert parallel.params.keys() == single.params.keys()
    for key in single.params:
        torch.testing.assert_close(parallel.params[key], single.params[key], rtol=1e-5, atol=WEIGHT_ATOL, msg=key)
    # Validation loss and perplexity (torchmetrics, reduced over data-parallel ranks) and a count logged as a sum.
    assert parallel.validated.keys() == single.validated.keys()
    assert parallel.validated == pytest.approx(single.validated, rel=1e-5, abs=0)


def test_training_moves_the_weights() -> None:
    """Guards the comparison above: a run that did not train would match nothing but itself."""
    trained = REFERENCES[CASES[2]["zero3"].reference(world_size=2)]
    assert trained.losses[-1] < trained.losses[0]
    # ... and one that did not validate would compare nothing: 8 batches of 8 windows, each counted once.
    assert trained.validated.keys() == {"val_loss", "val_perplexity", "val_windows"}
    assert trained.validated["val_windows"] == 64
    assert trained.validated["val_perplexity"] == pytest.approx(math.exp(trained.validated["val_loss"]), rel=1e-6)


ACCUMULATED = dict(model="zoo_hf_llama_finetuning", data="padded", accumulate_grad_batches=2, steps=3)


def test_batches_weigh_as_lightning_weighs_them_where_asked() -> None:
    """Padded batches of a gradient accumulation weigh by their labelled tokens, the accumulation's mean over its
    tokens; with ``loss_weighting="batches"`` each batch's mean weighs alike, as Lightning alone trains them."""
    lightning, batches, tokens = run_ranks(
        1,
        train_cases,
        [
            Case(**ACCUMULATED, sampled_as_ranks=1),  # Lightning's own, in the order its sampler deals one rank
            Case(**ACCUMULATED, strategy=dict(loss_weighting="batches")),
            Case(**ACCUMULATED, strategy=dict()),
        ],
    )[0]
    assert not (lightning.error or batches.error or tokens.error), lightning.error + batches.error + tokens.error
    torch.testing.assert_close(batches.grad_norms, lightning.grad_norms, rtol=1e-6, atol=0)
    for key in lightning.params:
        torch.testing.assert_close(batches.params[key], lightning.params[key], rtol=1e-6, atol=1e-7, msg=key)
    assert abs(tokens.grad_norms[0] - lightning.grad_norms[0]) > 1e-3 * lightning.grad_norms[0]


def test_the_header_says_how_batches_weigh() -> None:
    countable, uncountable = MODELS["zoo_hf_llama_finetuning"](1e-3, 2), MODELS["llama"](learning_rate=1e-3)
    assert weighing_rule(countable, "tokens", cp=1).startswith("batches weigh by their labelled tokens")
    assert weighing_rule(countable, "batches", cp=1).endswith("as Lightning's (loss_weighting='batches')")
    assert "the step's tokens are not counted (loss_tokens(batch) counts them)" in weighing_rule(
        uncountable, "tokens", cp=1
    )
    # split sequences are counted by the step's own mean over tokens
    assert weighing_rule(uncountable, "tokens", cp=2).startswith("batches weigh by their labelled tokens")
