"""Selective activation checkpointing keeps the outputs of the ops SDPA runs, found by asking SDPA on this device.
Both modes recompute third-party blocks (Hugging Face's, handed a key/value cache on every call) as their forward
ran them."""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.functional import scaled_dot_product_attention

from lightdist.parallel.activation_checkpointing import apply_activation_checkpointing, attention_ops
from lightdist.parallel.structure import find_decoder_stack

from multirank import run_ranks
from training import MODELS, WEIGHT_ATOL, Case, References, Result, train_cases


class Attention(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return scaled_dot_product_attention(x, x, x).sin()


def _ops(traced: torch.fx.GraphModule) -> list:
    return [node.target for node in traced.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize(("mode", "attention_runs"), [("selective", 1), ("full", 2)])
def test_selective_checkpointing_keeps_the_attention_output_rather_than_recompute_it(
    mode: str, attention_runs: int
) -> None:
    x = torch.randn(1, 2, 16, 64, requires_grad=True)
    found = attention_ops("cpu")  # found first: tracing would record the ops finding them runs
    assert len(found & set(_ops(make_fx(scaled_dot_product_attention)(x, x, x)))) == 1  # the op SDPA dispatches to

    block = Attention()
    apply_activation_checkpointing([block], mode=mode)
    forward_and_backward = make_fx(lambda x: torch.autograd.grad(block(x).sum(), x))(x)
    assert sum(op in found for op in _ops(forward_and_backward)) == attention_runs


# Qwen2 passes its blocks the cache by keyword, GPT-2 (Conv1D projections) by position.
HUGGING_FACE = ["hf_qwen2", "zoo_hf_gpt2_labels"]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model", HUGGING_FACE)
def test_hugging_face_blocks_are_recomputed_without_the_cache_their_forward_appended_to(
    model: str, attention: str, mode: str
) -> None:
    """Recomputed with the cache, a block would attend over its forward's keys and its own: selective checkpointing
    then finds ops its forward did not run, eager attention keys twice as many as its mask."""
    torch.manual_seed(0)
    plain = MODELS[model](learning_rate=1e-3, warmup_steps=1).model
    plain.set_attn_implementation(attention)
    recomputed = copy.deepcopy(plain)
    apply_activation_checkpointing(find_decoder_stack(recomputed).blocks, mode=mode)
    tokens = torch.randint(0, 64, (2, 16))
    expected, got = (
        torch.autograd.grad(lm(input_ids=tokens).logits.square().sum(), list(lm.parameters()))
        for lm in (plain, recomputed)
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_without_gradients_blocks_keep_the_cache_generation_reads() -> None:
    model = MODELS["hf_qwen2"](learning_rate=1e-3, warmup_steps=1).model
    apply_activation_checkpointing(find_decoder_stack(model).blocks, mode="selective")
    with torch.no_grad():
        output = model(input_ids=torch.randint(0, 64, (2, 16)), use_cache=True)
    assert output.cache.get_seq_length() == 16


CHECKPOINTED_UNDER_ZERO3 = {
    f"{model}_{mode}": Case(strategy=dict(zero_stage=3, activation_checkpointing=mode), model=model)
    for model in HUGGING_FACE
    for mode in ("selective", "full")
}


@cache
def zero3_and_single_process_results() -> dict[str, tuple[Result, Result]]:
    """Each case on 2 ranks (all in one group of processes) and its single-process reference, not checkpointed."""
    cases = list(CHECKPOINTED_UNDER_ZERO3.values())
    single = References([case.reference(2) for case in cases])
    single.start()
    parallel = run_ranks(2, train_cases, cases, 2)[0]
    return {
        name: (result, single[case.reference(2)])
        for (name, case), result in zip(CHECKPOINTED_UNDER_ZERO3.items(), parallel, strict=True)
    }


@pytest.mark.multirank
@pytest.mark.parametrize("name", CHECKPOINTED_UNDER_ZERO3)
def test_hugging_face_models_checkpointed_under_zero3_train_as_one_process(name: str) -> None:
    parallel, single = zero3_and_single_process_results()[name]
    assert not parallel.error, parallel.error
    assert not single.error, single.error
    assert len(parallel.losses) == CHECKPOINTED_UNDER_ZERO3[name].steps
    torch.testing.assert_close(parallel.losses, single.losses, rtol=1e-5, atol=0)
    assert parallel.params.keys() == single.params.keys()
    for key in single.params:
        torch.testing.assert_close(parallel.params[key], single.params[key], rtol=1e-5, atol=WEIGHT_ATOL, msg=key)
