"""The decoder stack is found in models nobody wrote for lightdist."""

from __future__ import annotations

import pytest
from torch import nn

from lightdist.models import GPT2, Llama
from lightdist.parallel.structure import find_decoder_stack

from training import MODELS


@pytest.mark.parametrize(
    ("model", "name", "blocks"), [(Llama("tiny"), "model.layers", 4), (GPT2("tiny"), "model.h", 4)]
)
def test_reference_models(model: nn.Module, name: str, blocks: int) -> None:
    stack = find_decoder_stack(model)
    assert (stack.name, len(stack)) == (name, blocks)


def test_largest_list_of_same_class_blocks_wins() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(16, 2), nn.Linear(16, 2)])  # small: not the decoder
            self.mixed = nn.ModuleList([Block(), nn.Linear(16, 16)])  # mixed classes: not repeated blocks
            self.blocks = nn.ModuleList(Block() for _ in range(3))

    assert find_decoder_stack(Model()).name == "blocks"


@pytest.mark.parametrize(
    ("model", "enclosing"),
    [
        ("zoo_nanogpt", ["", "model", "model.transformer"]),  # nanoGPT's GPT as self.model
        ("zoo_hf_llama_labels", ["", "model", "model.model"]),  # a Hugging Face CausalLM and its base model
        ("llama", ["", "model"]),
    ],
)
def test_a_step_may_call_as_the_model_any_module_around_the_stack(model: str, enclosing: list[str]) -> None:
    stack = find_decoder_stack(MODELS[model](learning_rate=1e-3, warmup_steps=2))
    assert stack.enclosing == enclosing
