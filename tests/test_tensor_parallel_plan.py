"""How the tensor-parallel plan is found, and every way it can fail, without starting a process."""

from __future__ import annotations

import pytest
from torch import nn

from lightdist.models import GPT2, Llama
from lightdist.parallel.structure import find_decoder_stack
from lightdist.parallel.tensor import check_divisible, discover_plan

from training import MODELS, UnknownFamilyLM


def plan_of(model: nn.Module, **options) -> dict[str, str]:
    return discover_plan(model, find_decoder_stack(model), **options)


def styles_under(plan: dict[str, str], prefix: str) -> dict[str, str]:
    """The styles of one block's modules, by full name."""
    return {name: style for name, style in plan.items() if name.startswith(prefix)}


def test_llama_blocks_split_column_then_row_with_vocab_parallel_ends() -> None:
    plan = plan_of(Llama("tiny"))
    assert styles_under(plan, "model.layers.0.") == {
        "model.layers.0.self_attn.q_proj": "colwise",
        "model.layers.0.self_attn.k_proj": "colwise",
        "model.layers.0.self_attn.v_proj": "colwise",
        "model.layers.0.self_attn.o_proj": "rowwise",
        "model.layers.0.mlp.gate_proj": "colwise",
        "model.layers.0.mlp.up_proj": "colwise",
        "model.layers.0.mlp.down_proj": "rowwise",
        "model.layers.0.input_layernorm": "replicate",
        "model.layers.0.post_attention_layernorm": "replicate",
    }
    assert plan["model.embed_tokens"] == "vocab"
    assert plan["model.lm_head"] == "head"
    assert plan["model.norm"] == "replicate"


def test_hugging_face_models_bring_their_own_plan() -> None:
    plan = plan_of(MODELS["hf_qwen2"]())
    assert plan["model.model.layers.1.self_attn.k_proj"] == "colwise"  # Qwen2's q/k/v carry biases: split with them
    assert plan["model.model.layers.1.mlp.down_proj"] == "rowwise"
    assert plan["model.model.embed_tokens"] == "vocab"
    assert plan["model.lm_head"] == "head"
    assert plan["model.model.layers.1.input_layernorm"] == "replicate"


def test_a_model_plan_with_styles_lightdist_does_not_apply_is_set_aside_for_its_own_discovery() -> None:
    model = Llama("tiny")
    model.model.tp_plan = {"layers.*.mlp.gate_proj": "packed_colwise"}  # as a fused-MLP Hugging Face model carries
    assert plan_of(model) == plan_of(Llama("tiny"))
    assert plan_of(model, tp_plan={"model.lm_head": "head"})["model.lm_head"] == "head"


def test_phi3_fused_projections_cut_by_slicing_are_found_in_the_data_flow() -> None:
    """Phi-3 carries a plan lightdist does not apply; its attention slices q, k and v out of qkv_proj."""
    plan = plan_of(MODELS["zoo_hf_phi3_labels"](learning_rate=1e-3, warmup_steps=2))
    assert styles_under(plan, "model.model.layers.0.") == {
        "model.model.layers.0.self_attn.qkv_proj": "qkv",
        "model.model.layers.0.self_attn.o_proj": "rowwise",
        "model.model.layers.0.mlp.gate_up_proj": "gate_up",
        "model.model.layers.0.mlp.down_proj": "rowwise",
        "model.model.layers.0.input_layernorm": "replicate",
        "model.model.layers.0.post_attention_layernorm": "replicate",
    }


def test_bloom_q_k_v_interleaved_per_head_split_as_one_projection_from_the_data_flow() -> None:
    """BLOOM names no family's layers, and its query_key_value holds q, k and v head by head ([q0 k0 v0 | q1 k1 v1 |
    ...]): its attention cuts them apart after a view by head, so a plain split by output features gives each rank
    its heads of all three."""
    plan = plan_of(MODELS["hf_bloom"]())
    assert styles_under(plan, "model.transformer.h.0.") == {
        "model.transformer.h.0.self_attention.query_key_value": "colwise",
        "model.transformer.h.0.self_attention.dense": "rowwise",
        "model.transformer.h.0.mlp.dense_h_to_4h": "colwise",
        "model.transformer.h.0.mlp.dense_4h_to_h": "rowwise",
        "model.transformer.h.0.input_layernorm": "replicate",
        "model.transformer.h.0.post_attention_layernorm": "replicate",
    }
    assert plan["model.transformer.word_embeddings"] == "vocab"
    assert plan["model.lm_head"] == "head"  # tied to the embedding


def test_explicit_plan_patterns_replace_discovery() -> None:
    plan = plan_of(Llama("tiny"), tp_plan={"model.layers.*.mlp.up_proj": "colwise", "model.lm_head": "head"})
    assert plan["model.layers.3.mlp.up_proj"] == "colwise"
    assert plan["model.layers.3.self_attn.q_proj"] == "replicate"  # not named: every rank keeps it whole
    assert plan["model.embed_tokens"] == "replicate"


def test_gpt2_splits_its_fused_qkv_by_part_and_ties_head_to_embedding() -> None:
    plan = plan_of(GPT2("tiny"))
    assert styles_under(plan, "model.h.0.") == {
        "model.h.0.attn.c_attn": "qkv",
        "model.h.0.attn.c_proj": "rowwise",
        "model.h.0.mlp.c_fc": "colwise",
        "model.h.0.mlp.c_proj": "rowwise",
        "model.h.0.ln_1": "replicate",
        "model.h.0.ln_2": "replicate",
    }
    assert (plan["model.wte"], plan["model.lm_head"], plan["model.wpe"]) == ("vocab", "head", "replicate")


class _UnknownFamilyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer_in, self.mixer_out = nn.Linear(8, 16), nn.Linear(16, 8)


def test_no_plan_found_lists_the_layers_and_asks_for_tp_plan_naming_them() -> None:
    model = nn.Module()  # no forward to trace either
    model.layers = nn.ModuleList(_UnknownFamilyBlock() for _ in range(2))
    with pytest.raises(ValueError, match=r"projections are mixer_in, mixer_out, no known family") as error:
        plan_of(model)
    assert 'missing the required "forward"' in str(error.value)
    assert "Pass tp_plan={'layers.*.mixer_in': ..., 'layers.*.mixer_out': ...}" in str(error.value)


def test_the_plan_of_a_network_held_in_an_attribute_is_traced_through_the_module_the_step_calls() -> None:
    """LitGPT's names are no known family's, and its LightningModule has no forward: its GPT is traced."""
    plan = plan_of(MODELS["zoo_litgpt"](learning_rate=1e-3, warmup_steps=2))
    assert styles_under(plan, "model.transformer.h.0.") == {
        "model.transformer.h.0.attn.qkv": "qkv",  # q, k and v of unequal widths (grouped-query attention)
        "model.transformer.h.0.attn.proj": "rowwise",
        "model.transformer.h.0.mlp.fc_1": "colwise",
        "model.transformer.h.0.mlp.fc_2": "colwise",
        "model.transformer.h.0.mlp.proj": "rowwise",
        "model.transformer.h.0.norm_1": "replicate",
        "model.transformer.h.0.norm_2": "replicate",
    }
    assert (plan["model.transformer.wte"], plan["model.lm_head"]) == ("vocab", "head")


def test_hugging_face_conv1d_projections_are_split_like_linear_ones() -> None:
    plan = plan_of(MODELS["zoo_hf_gpt2_labels"](learning_rate=1e-3, warmup_steps=2))
    assert styles_under(plan, "model.transformer.h.0.") == {
        "model.transformer.h.0.attn.c_attn": "qkv",
        "model.transformer.h.0.attn.c_proj": "rowwise",
        "model.transformer.h.0.mlp.c_fc": "colwise",
        "model.transformer.h.0.mlp.c_proj": "rowwise",
        "model.transformer.h.0.ln_1": "replicate",
        "model.transformer.h.0.ln_2": "replicate",
    }


def test_unknown_names_are_paired_by_following_the_data_flow() -> None:
    model = UnknownFamilyLM(learning_rate=1e-3, warmup_steps=2)
    plan = plan_of(model)
    assert styles_under(plan, "blocks.0.") == {
        "blocks.0.mixer.to_qkv": "qkv",  # cut into 3 by chunk: q, k and v
        "blocks.0.mixer.to_out": "rowwise",
        "blocks.0.ffn.expand": "gate_up",  # cut into 2: gate and up
        "blocks.0.ffn.contract": "rowwise",
        "blocks.0.mixer_norm": "replicate",
        "blocks.0.ffn_norm": "replicate",
    }
    assert (plan["embed"], plan["unembed"]) == ("vocab", "head")


def test_tp_plan_pattern_that_matches_nothing() -> None:
    with pytest.raises(ValueError, match=r"tp_plan pattern 'model.layers.\*.attn.wq' matches no module of Llama"):
        plan_of(Llama("tiny"), tp_plan={"model.layers.*.attn.wq": "colwise"})


def test_tp_plan_unknown_style() -> None:
    with pytest.raises(
        ValueError, match=r"tp_plan\['model.lm_head'\]='diagonal' is not one of colwise, qkv, gate_up, rowwise"
    ):
        plan_of(Llama("tiny"), tp_plan={"model.lm_head": "diagonal"})


@pytest.mark.parametrize(
    ("config", "tp", "message"),
    [
        ({}, 3, r"tensor_parallel_size=3 does not divide num_heads=4 of model.layers.0.self_attn"),
        (
            {"dim": 96, "n_heads": 6, "n_kv_heads": 3},
            2,
            r"tensor_parallel_size=2 neither divides nor is a multiple of num_key_value_heads=3 of model.layers.0",
        ),
        ({"n_heads": 8, "n_kv_heads": 8, "ffn_dim": 170}, 4, r"output features of model.layers.0.mlp.gate_proj \("),
        ({"vocab_size": 67}, 2, r"vocabulary size of model.lm_head \(out_features=67\).* pad the vocabulary"),
    ],
    ids=["heads", "kv_heads", "ffn", "vocab"],
)
def test_splits_that_do_not_divide(config: dict, tp: int, message: str) -> None:
    model = Llama("tiny", config=config)
    stack = find_decoder_stack(model)
    with pytest.raises(ValueError, match=message):
        check_divisible(model, stack, discover_plan(model, stack), tp)


def test_hugging_face_attention_heads_come_from_its_config() -> None:
    model = MODELS["hf_llama"]()  # its attention keeps only head_dim; 4 heads and 2 key/value heads are in the config
    stack = find_decoder_stack(model)
    with pytest.raises(ValueError, match=r"does not divide num_attention_heads=4 of model.model.layers.0.self_attn"):
        check_divisible(model, stack, discover_plan(model, stack), 3)


def test_fused_qkv_cannot_replicate_key_value_heads() -> None:
    model = GPT2("tiny")  # 4 heads
    model.model.h[0].attn.n_kv_head = 2
    stack = find_decoder_stack(model)
    with pytest.raises(ValueError, match=r"exceeds n_kv_head=2 of model.h.0.attn, whose q, k and v are fused"):
        check_divisible(model, stack, discover_plan(model, stack), 4)
